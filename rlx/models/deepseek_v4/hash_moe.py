"""DeepSeek-V4's mixture of experts (paper section 2.1): routed experts chosen by a learned router
or, in the first layers (``mlp_layer_types`` ``hash_moe``), by a frozen token-id table.

Scores are ``scoring(x @ gate)`` in f32, ``scoring`` one of ``SCORING`` (DeepSeek-V4:
``sqrtsoftplus = sqrt(softplus(.))``). A routed layer takes the top-k of ``scores + bias`` (the
checkpoint's ``gate.bias``, transformers' ``e_score_correction_bias``: a frozen
``CorrectionBias``); a hash layer takes the experts ``tid2eid[token]`` (``[vocab, k]``, a frozen
integer table, ``HashTable``). Either way the gates are the chosen experts' *uncorrected* scores,
renormalised (denominator + 1e-20) and times ``routed_scaling_factor``. The experts
(``rlx.models.moe.Experts``: ``w1`` gate, ``w3`` up, ``w2`` down) and the one shared expert use
``silu(min(gate, l)) * clip(up, -l, l)`` with ``l = swiglu_limit``; the shared expert's output
is added ungated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from rlx.models.layers import Linear, param
from rlx.models.moe import CorrectionBias, Experts, SparseMoE

SCORING = {"sqrtsoftplus": lambda x: jnp.sqrt(jax.nn.softplus(x)), "sigmoid": jax.nn.sigmoid}


class HashTable(nnx.Variable):
    """A hash layer's token -> experts table ``[vocab, k]`` (int32): frozen, never a parameter."""


def limited_swiglu(gate: Array, up: Array, limit: float) -> Array:
    """``silu(min(gate, limit)) * clip(up, -limit, limit)`` in f32, rounded to ``gate``'s dtype."""
    g = jnp.minimum(gate.astype(jnp.float32), limit)
    u = jnp.clip(up.astype(jnp.float32), -limit, limit)
    return (jax.nn.silu(g) * u).astype(gate.dtype)


class LimitedExperts(Experts):
    """``rlx.models.moe.Experts`` with ``limited_swiglu``."""

    def activate(self, gate: Array, up: Array) -> Array:
        return limited_swiglu(gate, up, self.limit)


class SharedExpert(nnx.Module):
    """The shared expert: ``down(limited_swiglu(gate(x), up(x)))``."""

    def __init__(self, d: int, f: int, limit: float, *, dtype, param_dtype, rngs):
        kw = dict(bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = Linear(d, f, ("embed", "mlp"), **kw)
        self.up_proj = Linear(d, f, ("embed", "mlp"), **kw)
        self.down_proj = Linear(f, d, ("mlp", "embed"), **kw)
        self.limit = limit

    def __call__(self, x: Float[Array, "... d"], adapter: bool = True) -> Float[Array, "... d"]:
        h = limited_swiglu(self.gate_proj(x, adapter), self.up_proj(x, adapter), self.limit)
        return self.down_proj(h, adapter)


class V4MoE(SparseMoE):
    """One sparse layer: router (``hashed``: the table), experts and the shared expert. A
    ``SparseMoE`` by its parts (``experts``, ``shared_expert``), so ``rlx.quant.apply_lora``
    adapts them as it does every MoE's; routing, arithmetic and call are its own (its experts
    run whole: no token dispatch over an expert mesh axis, which ``expert_parallel`` refuses)."""

    dispatches = False

    def __init__(self, d: int, f: int, experts: int, k: int, vocab: int, *, hashed: bool,
                 scoring: str, scale: float, limit: float, dtype, param_dtype, rngs):
        self.gate = param(rngs, (d, experts), jnp.float32, ("embed", None))
        self.tid2eid = nnx.data(HashTable(jnp.zeros((vocab, k), jnp.int32)) if hashed else None)
        self.bias = nnx.data(None if hashed else CorrectionBias(jnp.zeros((experts,), jnp.float32)))
        self.experts = LimitedExperts(experts, d, f, dtype=dtype, param_dtype=param_dtype,
                                      rngs=rngs)
        self.experts.limit = limit
        self.shared_expert = SharedExpert(d, f, limit, dtype=dtype, param_dtype=param_dtype,
                                           rngs=rngs)
        self.k, self.scoring, self.scale = k, scoring, scale
        self.shared_gate = None

    def route(self, x: Float[Array, "n d"], ids: Int[Array, " n"]):
        """``(experts [n, k], gates [n, k])`` (module docstring)."""
        scores = SCORING[self.scoring](x.astype(jnp.float32) @ self.gate[...])  # [n, e]
        if self.tid2eid is not None:
            idx = self.tid2eid[...][ids]
        else:
            _, idx = jax.lax.top_k(jax.lax.stop_gradient(scores + self.bias[...]), self.k)
        w = jnp.take_along_axis(scores, idx, axis=-1)
        return idx, w / (w.sum(-1, keepdims=True) + 1e-20) * self.scale

    def __call__(self, x: Float[Array, "b t d"], ids: Int[Array, "b t"], adapter: bool = True
                 ) -> Float[Array, "b t d"]:
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        idx, gates = self.route(flat, ids.reshape(-1))
        routed = self.experts.ragged(flat, idx, gates.astype(x.dtype), adapter)
        return (routed + self.shared_expert(flat, adapter)).reshape(b, t, d)
