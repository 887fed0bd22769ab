"""Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024), the linear-attention layers of Qwen3-Next.

Per token, after a depthwise causal convolution (``conv_kernel`` taps, then SiLU) over the
concatenated queries, keys and values, the L2-normalised queries and keys (``eps`` 1e-6 inside
the root, queries also times ``key_head_dim ** -0.5``) read and write a per-head state
``S [key_head_dim, value_head_dim]``::

    S <- exp(g_t) S                              g_t = -exp(A_log) * softplus(a_t + dt_bias)
    S <- S + k_t (beta_t (v_t - k_t S))^T        beta_t = sigmoid(b_t)
    o_t = q_t S

Each key head serves ``num_value_heads // num_key_heads`` consecutive value heads. The output
goes through an RMSNorm over each value head times ``silu(z)`` (``z`` a fourth projection of the
input) and ``out_proj``. The projections keep transformers' fused layouts: ``in_proj_qkvz``
groups ``[q, k, v, z]`` per key head, ``in_proj_ba`` ``[b, a]`` per key head, ``conv1d.weight``
is ``[channels, 1, taps]`` over the channels ``[q, k, v]``.

Padding and packing: a padding token (segment id 0) enters as zeros, as transformers zeroes it
(``apply_mask_to_padding_states``), and a token's convolution and state never see another
segment's tokens: the convolution's taps over an earlier segment are dropped and the state is
reset at every segment's first token, so a packed row gives each sequence's own outputs and a
left-padded row those of its unpadded sequence.

The recurrence is a ``lax.scan`` over time (``gated_delta_rule``), exact and simple where the
chunked (WY) form of the paper trades extra products for matrix-matrix work. Memory: a plain scan
keeps every step's ``[heads, dk, dv]`` state for the backward pass (``T`` states per layer and
row); here the steps run in chunks of ``CHUNK`` under ``jax.checkpoint``, so the backward pass
keeps one state per chunk (``T / CHUNK``) and recomputes a chunk's steps once: about twice the
forward compute for ``CHUNK`` times less memory. The chunked form would also be faster on an
accelerator (a chunk's steps become matrix products); a kernel for it is future work.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from rlx.models.hparams import ModelConfig
from rlx.models.layers import Linear, RMSNorm, param

CHUNK = 64  # time steps per remat chunk of the recurrence
L2_EPS = 1e-6  # inside the root of the queries' and keys' L2 norm (transformers' l2norm)


def causal_conv(x: Float[Array, "b t c"], w: Float[Array, "c k"], segment_ids: Int[Array, "b t"]
                ) -> Float[Array, "b t c"]:
    """Depthwise causal convolution, then SiLU: ``out[t] = silu(sum_j w[:, j] x[t - k + 1 + j])``
    over the taps of ``t``'s own segment (f32 inside, returned in ``x``'s dtype)."""
    k, t = w.shape[1], x.shape[1]
    x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
    out = jnp.zeros_like(x32)
    for j in range(k):
        shift = k - 1 - j  # tap j reads the token ``shift`` steps back
        src = jnp.pad(x32, ((0, 0), (shift, 0), (0, 0)))[:, :t]
        seg = jnp.pad(segment_ids, ((0, 0), (shift, 0)), constant_values=-1)[:, :t]
        out = out + jnp.where((seg == segment_ids)[..., None], src, 0.0) * w32[:, j]
    return jax.nn.silu(out).astype(x.dtype)


def _step(state, inputs):
    """One token of the gated delta rule for every row and head (``state [b, h, dk, dv]``)."""
    q, k, v, g, beta, reset = inputs  # [b, h, dk], [b, h, dk], [b, h, dv], [b, h], [b, h], [b]
    state = jnp.where(reset[:, None, None, None], 0.0, state) * jnp.exp(g)[..., None, None]
    delta = (v - jnp.einsum("bhk,bhkv->bhv", k, state)) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return state, jnp.einsum("bhk,bhkv->bhv", q, state)


def gated_delta_rule(q: Float[Array, "b t h dk"], k: Float[Array, "b t h dk"],
                     v: Float[Array, "b t h dv"], g: Float[Array, "b t h"],
                     beta: Float[Array, "b t h"], reset: Bool[Array, "b t"],
                     state: Float[Array, "b h dk dv"] | None = None
                     ) -> tuple[Float[Array, "b t h dv"], Float[Array, "b h dk dv"]]:
    """Outputs of the recurrence (module docstring) in f32 and the state after the last token;
    ``reset``: the state is zeroed before that token (a segment's first); ``state``: the state
    before the first token (zeros when None). ``q`` / ``k`` normalised and repeated per value
    head already. Runs as chunks of ``CHUNK`` steps, each recomputed in the backward pass."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    if state is None:
        state = jnp.zeros((b, h, dk, dv), jnp.float32)
    chunk = min(CHUNK, t)
    pad = -t % chunk  # trailing steps that leave the state as it is (no decay, no write)
    xs = [a.astype(jnp.float32) for a in (q, k, v, g, beta)] + [reset]
    xs = [jnp.pad(a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2)) for a in xs]
    n = (t + pad) // chunk
    # [b, t, ...] -> [n, chunk, b, ...]: time leading for the scans
    xs = [jnp.moveaxis(a, 1, 0).reshape(n, chunk, *a.shape[:1], *a.shape[2:]) for a in xs]

    @jax.checkpoint
    def run_chunk(state, chunk_xs):
        return jax.lax.scan(_step, state, chunk_xs)

    state, out = jax.lax.scan(run_chunk, state.astype(jnp.float32), tuple(xs))
    out = jnp.moveaxis(out.reshape(n * chunk, b, h, dv), 0, 1)[:, :t]
    return out, state


def l2_normalize(x: Float[Array, "... d"]) -> Float[Array, "... d"]:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last axis, in f32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def segment_starts(segment_ids: Int[Array, "b t"]) -> Bool[Array, "b t"]:
    """Tokens whose segment differs from the previous token's (every row's first token too)."""
    prev = jnp.pad(segment_ids, ((0, 0), (1, 0)), constant_values=-1)[:, :-1]
    return segment_ids != prev


class GatedDeltaNet(nnx.Module):
    """A gated DeltaNet layer (module docstring) with transformers' parameter names."""

    def __init__(self, cfg: ModelConfig, p, rngs, layer: int = 0):
        la, d = cfg.linear_attention, cfg.hidden_size
        kw = dict(bias=False, dtype=p.dtype, param_dtype=p.param_dtype, rngs=rngs)
        self.in_proj_qkvz = Linear(d, 2 * la.key_dim + 2 * la.value_dim, ("embed", "heads"), **kw)
        self.in_proj_ba = Linear(d, 2 * la.num_value_heads, ("embed", "heads"), **kw)
        self.conv1d = param(rngs, (la.conv_dim, 1, la.conv_kernel), p.param_dtype,
                            ("heads", None, None), scale=0.2)
        self.dt_bias = param(None, (la.num_value_heads,), p.param_dtype, ("heads",), "ones")
        self.A_log = param(rngs, (la.num_value_heads,), p.param_dtype, ("heads",))
        self.norm = RMSNorm(la.value_head_dim, cfg.rms_norm_eps, dtype=p.dtype,
                            param_dtype=p.param_dtype)
        self.out_proj = Linear(la.value_dim, d, ("heads", "embed"), **kw)
        self.la, self.dtype = la, p.dtype
        self.sharding = None  # set by rlx.models.parallel; a context axis is refused (_no_context)

    def linears(self) -> tuple[Linear, ...]:
        """Every projection of the layer (for quantization and LoRA)."""
        return (self.in_proj_qkvz, self.in_proj_ba, self.out_proj)

    def _no_context(self):
        """Refuse context parallelism: it reorders each row's tokens over devices, and the
        convolution and the recurrence run over them in order."""
        if self.sharding is not None and self.sharding.context_shards > 1:
            raise ValueError("gated DeltaNet layers run a recurrence over each sequence's tokens "
                             "in order; context parallelism splits them: use mesh context=1")

    def _project(self, x, adapter: bool):
        """``(qkv [b, t, conv channels], z [b, t, hv, dv], b, a [b, t, hv])`` from transformers'
        per-key-head groups."""
        la = self.la
        bsz, t, _ = x.shape
        r = la.num_value_heads // la.num_key_heads
        qkvz = self.in_proj_qkvz(x, adapter).reshape(bsz, t, la.num_key_heads, -1)
        dk, vz = la.key_head_dim, r * la.value_head_dim
        q, k = qkvz[..., :dk], qkvz[..., dk:2 * dk]
        v, z = qkvz[..., 2 * dk:2 * dk + vz], qkvz[..., 2 * dk + vz:]
        ba = self.in_proj_ba(x, adapter).reshape(bsz, t, la.num_key_heads, 2 * r)
        flat = lambda a: a.reshape(bsz, t, -1)  # noqa: E731
        qkv = jnp.concatenate([flat(q), flat(k), flat(v)], axis=-1)
        return (qkv, z.reshape(bsz, t, la.num_value_heads, la.value_head_dim),
                flat(ba[..., :r]), flat(ba[..., r:]))

    def _heads(self, qkv):
        """Queries and keys normalised and repeated per value head (queries scaled), values."""
        la = self.la
        bsz, t, _ = qkv.shape
        r = la.num_value_heads // la.num_key_heads
        q, k, v = jnp.split(qkv, [la.key_dim, 2 * la.key_dim], axis=-1)
        heads = lambda a: jnp.repeat(l2_normalize(a.reshape(bsz, t, la.num_key_heads, -1)),  # noqa: E731
                                     r, axis=2)
        return (heads(q) * la.key_head_dim ** -0.5, heads(k),
                v.reshape(bsz, t, la.num_value_heads, la.value_head_dim))

    def _gates(self, b, a):
        """``beta = sigmoid(b)`` and the log-decay ``g`` (f32, ``[b, t, hv]``)."""
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        return jax.nn.sigmoid(b.astype(jnp.float32)), g

    def _out(self, o, z, adapter: bool):
        """The gated RMSNorm per value head (``norm(o) * silu(z)``) and ``out_proj``."""
        gated = self.norm(o.astype(self.dtype)) * jax.nn.silu(z.astype(jnp.float32))
        bsz, t = o.shape[:2]
        return self.out_proj(gated.astype(self.dtype).reshape(bsz, t, -1), adapter)

    def __call__(self, x, positions, segment_ids, angles, adapter: bool = True):
        """The layer over ``x [b, t, D]`` (``positions`` and ``angles`` unused: no rotary)."""
        self._no_context()
        x = jnp.where((segment_ids > 0)[..., None], x, 0).astype(x.dtype)
        qkv, z, b, a = self._project(x, adapter)
        qkv = causal_conv(qkv, self.conv1d[...][:, 0, :], segment_ids)
        q, k, v = self._heads(qkv)
        beta, g = self._gates(b, a)
        o, _ = gated_delta_rule(q, k, v, g, beta, segment_starts(segment_ids))
        return self._out(o, z, adapter)

    def decode(self, x, positions, segment_ids, angles, kv, cache, adapter: bool = True,
               order=None):
        """The layer over ``t`` new tokens of each row continuing its states ``kv`` =
        (convolution inputs ``[b, k - 1, c]``, recurrent state ``[b, hv, dk, dv]``, a
        ``KVCache``'s buffers of this layer); returns (out, the states after them). The states
        carry on where the row's previous slot (``cache.previous_segments``) is of the same
        segment, else restart (an empty cache, a left-padded prompt's first token)."""
        if order is not None or not hasattr(cache, "previous_segments"):
            raise ValueError("gated DeltaNet layers decode over a KVCache (lockstep batching), "
                             "without context parallelism; got "
                             f"{type(cache).__name__} with order={order}")
        self._no_context()
        conv_state, state = kv
        x = jnp.where((segment_ids > 0)[..., None], x, 0).astype(x.dtype)
        qkv, z, b, a = self._project(x, adapter)
        rows, hist = qkv.shape[0], conv_state.shape[1]
        prev = cache.previous_segments()[:, None]  # [b, 1]
        ext = jnp.concatenate([conv_state.astype(qkv.dtype), qkv], axis=1)  # [b, k - 1 + t, c]
        ext_seg = jnp.concatenate([jnp.broadcast_to(prev, (rows, hist)), segment_ids], axis=1)
        conv = causal_conv(ext, self.conv1d[...][:, 0, :], ext_seg)[:, hist:]
        q, k, v = self._heads(conv)
        beta, g = self._gates(b, a)
        reset = segment_ids != jnp.concatenate([prev, segment_ids[:, :-1]], axis=1)
        o, state = gated_delta_rule(q, k, v, g, beta, reset, state)
        kept = ext[:, ext.shape[1] - hist:].astype(conv_state.dtype)  # the last k - 1 inputs
        return self._out(o, z, adapter), (kept, state)


def param_map_entries(us: str, hf: str) -> dict[str, tuple[str, str]]:
    """rlx parameter path -> (HF tensor name, layout) of a gated DeltaNet layer at rlx ``us`` /
    HF ``hf`` (``rlx.models.hf.ParamSource`` layouts: "T" a linear, "copy" as stored)."""
    out = {f"{us}/{p}/kernel": (f"{hf}.{p}.weight", "T")
           for p in ("in_proj_qkvz", "in_proj_ba", "out_proj")}
    out.update({f"{us}/{p}": (f"{hf}.{p}", "copy") for p in ("dt_bias", "A_log")})
    out[f"{us}/conv1d"] = (f"{hf}.conv1d.weight", "copy")
    out[f"{us}/norm/weight"] = (f"{hf}.norm.weight", "copy")
    return out


__all__ = ["CHUNK", "causal_conv", "gated_delta_rule", "l2_normalize", "segment_starts",
           "GatedDeltaNet", "param_map_entries"]
