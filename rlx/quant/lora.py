"""LoRA adapters (Hu et al. 2021) on the decoder's projections, incl. batched per-expert adapters.

``y = W x + (alpha / rank) * B A dropout(x)`` with ``A: [in, r]`` and ``B: [r, out]`` as
``nnx.LoRAParam`` (so ``nnx.LoRAParam`` filters pick exactly the trainable state). Init follows
PEFT's default: ``A ~ U(-1/sqrt(in), 1/sqrt(in))`` (kaiming-uniform with a = sqrt 5), ``B = 0``, so a
fresh adapter leaves the model unchanged. MoE experts get ``A: [E, in, r]``, ``B: [E, r, out]``,
run with ``ragged_dot`` over the same expert groups as the base (or an einsum in the dense path).

The adapter sees the unquantized input (as SGLang's LoRA path does under a W8A8 base). Dropout is
``nnx.Dropout`` (active in ``model.train()``, off in ``model.eval()``). qwix's ``LoraProvider`` is not
used: it intercepts flax ``nnx.Linear`` / einsum calls and owns the quantized base itself, while rlx
keeps its own frozen base representations and needs per-expert adapters on stacked expert weights.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from rlx.mesh import TRAIN_RULES, LogicalRules, shard_variables
from rlx.models.decoder import Transformer
from rlx.models.hf import param_map
from rlx.models.hparams import ModelConfig
from rlx.models.layers import Linear
from rlx.models.mixed import matmul
from rlx.models.moe import DenseMLP, Experts, SparseMoE
from rlx.quant.config import ATTN_MODULES, MLP_MODULES, TARGET_MODULES, LoraConfig
from rlx.quant.oft import OFT, oft_adapter

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class LoRA(nnx.Module):
    """One adapter; with ``experts=E`` a stack of E adapters applied per expert group."""

    rotates = False  # the adapter's output adds to the frozen product's (OFT rotates its input)

    def __init__(self, d_in: int, d_out: int, cfg: LoraConfig, axes, *, dtype, rngs: nnx.Rngs,
                 experts: int | None = None):
        lead = () if experts is None else (experts,)
        lead_axes = () if experts is None else ("expert",)
        pdt = _DTYPES[cfg.param_dtype]
        bound = 1.0 / math.sqrt(d_in)
        a = jax.random.uniform(rngs.params(), lead + (d_in, cfg.rank), jnp.float32, -bound, bound)
        self.lora_a = nnx.LoRAParam(a.astype(pdt), logical_axes=lead_axes + (axes[0], "lora_rank"))
        self.lora_b = nnx.LoRAParam(jnp.zeros(lead + (cfg.rank, d_out), pdt),
                                    logical_axes=lead_axes + ("lora_rank", axes[1]))
        self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs) if cfg.dropout > 0 else None
        self.scaling, self.dtype = cfg.scaling, dtype

    def _in(self, x):
        x = x.astype(self.dtype)
        return self.dropout(x) if self.dropout is not None else x

    def __call__(self, x: Float[Array, "... d_in"], out_dtype=None) -> Float[Array, "... d_out"]:
        """``scaling * x A B``; ``out_dtype`` f32 keeps a low-precision product's accumulator."""
        # Rows flattened to 2-D: the gradients of A and B then contract over one row axis, which
        # XLA:CPU runs in place; with [b, t, ...] operands it first copied the [b, t, d_out]
        # cotangent transposed (a third of a LoRA train step's time on SmolLM2).
        lead = x.shape[:-1]
        x2 = self._in(x).reshape(-1, x.shape[-1])  # [N, d_in]
        h = matmul(x2, self.lora_a[...], self.dtype)  # [N, r]
        y = matmul(h, self.lora_b[...], self.dtype, out_dtype) * self.scaling  # [N, d_out]
        return y.reshape(*lead, y.shape[-1])

    def ragged(self, x: Float[Array, "m d_in"], group_sizes: Int[Array, "e"]) -> Float[Array, "m d_out"]:
        """Rows of ``x`` sorted by expert, ``group_sizes[e]`` rows for expert ``e``."""
        h = ragged_rank_product(self._in(x), self.lora_a[...].astype(self.dtype), group_sizes)
        return jax.lax.ragged_dot(h, self.lora_b[...].astype(self.dtype), group_sizes) * self.scaling

    def dense(self, x) -> Array:
        """``[n, d]`` (same input for every expert) or ``[n, e, d]`` -> ``[n, e, out]``."""
        spec = "nd,edr->ner" if x.ndim == 2 else "ned,edr->ner"
        h = jnp.einsum(spec, self._in(x), self.lora_a[...].astype(self.dtype))
        return jnp.einsum("ner,erf->nef", h, self.lora_b[...].astype(self.dtype)) * self.scaling


# ragged_dot_general dimension numbers of the three products of ``ragged_rank_product``
_RANK_FWD = jax.lax.RaggedDotDimensionNumbers((((1,), (2,)), ((), ())), [0], [0])  # x . At
_RANK_DX = jax.lax.RaggedDotDimensionNumbers((((1,), (1,)), ((), ())), [0], [0])  # ct . At
_RANK_DA = jax.lax.RaggedDotDimensionNumbers((((0,), (0,)), ((), ())), [0], [])  # ct . x


def ragged_rank_product(x: Float[Array, "m d"], a: Float[Array, "e d r"],
                        group_sizes: Int[Array, " e"]) -> Float[Array, "m r"]:
    """``jax.lax.ragged_dot(x, a, group_sizes)`` for per-expert LoRA ``A`` matrices, whose
    rank ``r`` is far below a TPU's 128-wide lane dimension. Every product here takes ``A`` as
    ``[e, r, d]`` and its gradient comes out as ``[e, r, d]`` (``ct^T x`` per group), so XLA
    lays ``A``, its gradient and what accumulates it out with ``d`` minor. JAX's own rule forms
    the gradient as ``x^T ct``, ``[e, d, r]``: XLA:TPU keeps ``r`` minor there, padded to 128
    lanes (8x the bytes at rank 16), and carries that layout into the stacked gradients of
    every layer, their micro-batch sum and AdamW's update. Same products, same values.
    Inside ``shard_map`` ``a`` is first marked varying over the axes ``x`` varies over (as JAX's
    own product does), so that its gradient is summed over them outside this rule."""
    more = tuple(sorted(jax.typeof(x).mat.varying - jax.typeof(a).mat.varying))
    return _rank_product(x, jax.lax.pcast(a, more, to="varying") if more else a, group_sizes)


@jax.custom_vjp
def _rank_product(x, a, group_sizes):
    return jax.lax.ragged_dot_general(x, jnp.swapaxes(a, 1, 2), group_sizes, _RANK_FWD)


def _rank_fwd(x, a, group_sizes):
    return _rank_product(x, a, group_sizes), (x, a, group_sizes)


def _rank_bwd(res, ct):
    x, a, group_sizes = res
    at = jnp.swapaxes(a, 1, 2)  # [e, r, d]
    dx = jax.lax.ragged_dot_general(ct, at, group_sizes, _RANK_DX).astype(x.dtype)
    dat = jax.lax.ragged_dot_general(ct, x, group_sizes, _RANK_DA).astype(a.dtype)
    return dx, jnp.swapaxes(dat, 1, 2), None


_rank_product.defvjp(_rank_fwd, _rank_bwd)


def _linear_lora(lin: Linear, cfg: LoraConfig, rngs) -> LoRA | OFT:
    d_in, d_out = lin.kernel.shape
    if cfg.kind == "oft":
        return oft_adapter(d_in, cfg, dtype=lin.dtype)
    return LoRA(d_in, d_out, cfg, lin.axes, dtype=lin.dtype, rngs=rngs)


def _mlp_adapters(mlp: DenseMLP, cfg: LoraConfig, rngs) -> None:
    for t, name in MLP_MODULES.items():
        if t in cfg.targets:
            lin = getattr(mlp, name)
            lin.lora = _linear_lora(lin, cfg, rngs)


def _expert_adapters(ex: Experts, cfg: LoraConfig, rngs) -> None:
    axes = {"gate": ("embed", "expert_mlp"), "up": ("embed", "expert_mlp"), "down": ("expert_mlp", "embed")}
    for t, name in MLP_MODULES.items():
        if t in cfg.targets:
            e, d_in, d_out = getattr(ex, name).shape
            adapter = (oft_adapter(d_in, cfg, dtype=ex.dtype, experts=e) if cfg.kind == "oft" else
                       LoRA(d_in, d_out, cfg, axes[t], dtype=ex.dtype, rngs=rngs, experts=e))
            setattr(ex, f"{t}_lora", adapter)


def apply_lora(model: Transformer, cfg: LoraConfig, rngs: nnx.Rngs, *, mesh: Mesh | None = None,
               rules: LogicalRules = TRAIN_RULES) -> Transformer:
    """Attach adapters to ``model`` in place (and return it): LoRA, or OFT for ``cfg.kind="oft"``
    (``rlx.quant.oft``); on a mesh they are sharded by logical axes. A target the model lacks (``k`` on an MLA layer) adapts nothing here; ``target_counts``
    says which, and ``rlx.run.checks`` refuses such targets before a run loads weights."""
    for layer in model.layers:
        for t, name in ATTN_MODULES.items():
            lin = getattr(layer.self_attn, name, None)
            if t in cfg.targets and lin is not None:
                lin.lora = _linear_lora(lin, cfg, rngs)
        mlp = layer.mlp
        if isinstance(mlp, DenseMLP):
            _mlp_adapters(mlp, cfg, rngs)
            continue
        assert isinstance(mlp, SparseMoE)
        if mlp.shared_expert is not None:
            _mlp_adapters(mlp.shared_expert, cfg, rngs)
        if cfg.experts:
            _expert_adapters(mlp.experts, cfg, rngs)
    if mesh is not None:
        shard_variables(model, nnx.LoRAParam, mesh, rules)
    return model


def target_counts(arch: ModelConfig, cfg: LoraConfig) -> dict[str, int]:
    """How many weights of ``arch`` each target of ``cfg`` adapts (a layer's expert stack counts
    once; experts only with ``cfg.experts``), read from the parameter names of
    ``rlx.models.hf.param_map``: ``.../self_attn/<module>/kernel``, ``.../mlp/[shared_expert/]
    <module>/kernel`` and ``.../mlp/experts/<module>``."""
    paths = [p.split("/") for p in param_map(arch)]
    counts = {}
    for t in cfg.targets:
        module = TARGET_MODULES[t]
        linear = sum(1 for p in paths if p[-2:] == [module, "kernel"])
        experts = sum(1 for p in paths if p[-2:] == ["experts", module]) if cfg.experts else 0
        counts[t] = linear + experts
    return counts


def lora_targets(model: Transformer) -> list[tuple[str, LoRA]]:
    """(rlx path of the adapter: ``.../kv_b_proj/lora``, ``.../experts/gate_lora``, adapter) for
    every adapter of ``model``."""
    out = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, LoRA):
            out.append(("/".join(map(str, path)), node))
    return out
