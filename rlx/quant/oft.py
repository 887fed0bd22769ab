"""OFT adapters (Qiu et al. 2023, orthogonal fine-tuning) with PEFT 0.21's block-diagonal Cayley form.

A projection ``y = x W`` (``W: [in, out]``, frozen, possibly quantized) becomes ``y = (x R) W`` with
``R`` block-diagonal: ``in / b`` blocks of ``b x b`` (``b = oft.block_size``), each orthogonal by
the Cayley map of a skew-symmetric ``Q``: ``R = (I - Q)(I + Q)^-1``, or with ``oft.cayley_neumann``
PEFT's truncated Neumann series ``I + 2Q + 2Q^2 + ... + 2Q^(n-2) + Q^(n-1)`` (``n =
oft.neumann_terms``, at least the ``Q^3`` term; PEFT's default, 5 terms). A block's trainable
parameters are the ``b (b - 1) / 2`` entries of ``Q`` above the diagonal, stored as PEFT stores
``oft_R.weight`` (``[in / b, b (b - 1) / 2]``, row-major upper triangle), zero at init: a fresh
adapter is the identity. MoE experts get one rotation per expert (``[E, in / b, b (b - 1) / 2]``),
applied to the rows of each expert's group (``ragged``) or to every expert's copy (``dense``).

PEFT applies the rotation to the input too (``x -> x R``, then the base layer), which equals the
merged weight ``W' = R W`` (PEFT's ``merge``: ``W_out_in' = W_out_in R^T``): rlx rotates the
activations before the frozen product, so the base is multiplied as it is stored (int4 / int8 /
fp8 / GGUF blocks never dequantized for the adapter). The rotation runs in f32 and is rounded
to the compute dtype after, as PEFT casts the input to the adapter's dtype and back. Departures:
PEFT's ``coft``, ``block_share``, ``module_dropout`` and ``r`` (blocks counted instead of sized)
are not implemented and are refused (``rlx.quant.config.OftConfig``, ``rlx.quant.peft_import``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from rlx.quant.config import LoraConfig, OftConfig


def skew(vec: Float[Array, "... p"], b: int) -> Float[Array, "... b b"]:
    """The skew-symmetric ``Q`` whose upper triangle (row-major, above the diagonal) is ``vec``."""
    rows, cols = np.triu_indices(b, 1)
    upper = jnp.zeros((*vec.shape[:-1], b, b), vec.dtype).at[..., rows, cols].set(vec)
    return upper - jnp.swapaxes(upper, -1, -2)


def cayley(vec: Float[Array, "... p"], b: int, cfg: OftConfig) -> Float[Array, "... b b"]:
    """Each block's rotation ``R`` (f32): exact Cayley or PEFT's Neumann series (module doc)."""
    q = skew(vec.astype(jnp.float32), b)
    eye = jnp.eye(b, dtype=jnp.float32)
    if not cfg.cayley_neumann:
        # (I + Q)^-1 (I - Q) = (I - Q)(I + Q)^-1: both are polynomials in Q, so they commute
        return jnp.linalg.solve(eye + q, jnp.broadcast_to(eye - q, q.shape))
    n = cfg.neumann_terms
    r = jnp.broadcast_to(eye, q.shape)
    if n > 1:
        r = r + 2.0 * q
    if n > 2:
        power = q @ q
        r = r + 2.0 * power
        for _ in range(3, n - 1):
            power = power @ q
            r = r + 2.0 * power
        r = r + power @ q  # the last term (Q^3 at least) with coefficient 1, as PEFT >= 0.18
    return r


def blocks(x: Float[Array, "... d"], b: int) -> Float[Array, "... nb b"]:
    """``x`` split into its rotation blocks."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // b, b)


# ragged_dot_general of the rows' blocks [nb, m, b] and the experts' blocks [nb, e, b, b]: batch
# over the block position, rows ragged by expert, contracting a block's inputs
_PER_BLOCK = jax.lax.RaggedDotDimensionNumbers((((2,), (2,)), ((0,), (0,))), [1], [1])


class OFT(nnx.Module):
    """One block-diagonal rotation of a projection's input; with ``experts=E`` one per expert."""

    rotates = True  # the adapter transforms the input of the frozen product (LoRA adds to it)

    def __init__(self, d_in: int, cfg: LoraConfig, *, dtype, experts: int | None = None):
        b = cfg.oft.block_size
        lead = () if experts is None else (experts,)
        lead_axes = () if experts is None else ("expert",)
        shape = lead + (d_in // b, b * (b - 1) // 2)
        # replicated like a LoRA rank axis: the blocks are few and small
        self.oft_r = nnx.LoRAParam(jnp.zeros(shape, jnp.float32),
                                   logical_axes=lead_axes + ("lora_rank", "lora_rank"))
        self.block_size, self.oft, self.dtype = b, cfg.oft, dtype

    def rotation(self) -> Float[Array, "... nb b b"]:
        """Every block's ``R`` (f32)."""
        return cayley(self.oft_r[...], self.block_size, self.oft)

    def rotate(self, x: Float[Array, "... d"]) -> Float[Array, "... d"]:
        """``x R`` (block by block, f32, rounded to ``x``'s dtype)."""
        y = jnp.einsum("...rk,rkc->...rc", blocks(x.astype(jnp.float32), self.block_size),
                       self.rotation())
        return y.reshape(x.shape).astype(x.dtype)

    def ragged(self, x: Float[Array, "m d"], group_sizes: Int[Array, " e"]) -> Float[Array, "m d"]:
        """Rows of ``x`` sorted by expert (``group_sizes[e]`` rows for expert ``e``), each rotated
        by its expert's ``R``: a ``ragged_dot_general`` batched over the block positions."""
        r = jnp.swapaxes(self.rotation(), 0, 1)  # [nb, e, b, b]
        xb = jnp.swapaxes(blocks(x.astype(jnp.float32), self.block_size), 0, 1)  # [nb, m, b]
        y = jax.lax.ragged_dot_general(xb, r, group_sizes, _PER_BLOCK)  # [nb, m, b]
        return jnp.swapaxes(y, 0, 1).reshape(x.shape).astype(x.dtype)

    def dense(self, x: Float[Array, "n ... d"]) -> Float[Array, "n e d"]:
        """``[n, d]`` (the same input for every expert) or ``[n, e, d]`` -> each expert's ``x R_e``."""
        spec = "nrk,erkc->nerc" if x.ndim == 2 else "nerk,erkc->nerc"
        y = jnp.einsum(spec, blocks(x.astype(jnp.float32), self.block_size), self.rotation())
        return y.reshape(*y.shape[:2], -1).astype(x.dtype)

    def fold(self, w: Float[Array, "... d_in d_out"]) -> Float[Array, "... d_in d_out"]:
        """``R W`` (f32): the rotation folded into a float ``[in, out]`` weight (per expert for
        ``[E, in, out]``), which computes ``(x R) W`` as one product (merged export, MLA's
        absorbed decode)."""
        r = self.rotation()
        wb = w.astype(jnp.float32).reshape(*w.shape[:-2], r.shape[-3], self.block_size, w.shape[-1])
        return jnp.einsum("...rkc,...rcn->...rkn", r, wb).reshape(w.shape)


def oft_adapter(d_in: int, cfg: LoraConfig, *, dtype, experts: int | None = None) -> OFT:
    """An OFT adapter for a projection with input width ``d_in``; a width the block size does
    not divide is refused."""
    if d_in % cfg.oft.block_size:
        raise ValueError(f"config.lora.oft.block_size={cfg.oft.block_size} does not divide an "
                         f"adapted projection's input width {d_in}; use a divisor of it")
    return OFT(d_in, cfg, dtype=dtype, experts=experts)
