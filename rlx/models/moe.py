"""Sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, GLM-4.5, gpt-oss).

Routing follows each model (``MoEConfig.router``):

- ``softmax`` (Mixtral, Qwen, gpt-oss): softmax over all experts in f32, top-k, then
  renormalisation of the top-k weights when ``norm_topk_prob`` (always for Mixtral and gpt-oss,
  whose softmax over the top-k logits is the same; its router logits add ``router_bias``).
- ``sigmoid`` (DeepSeek-V3 "auxiliary-loss-free" routing, also GLM-4.5): router logits in f32,
  scores ``sigmoid(logits)``; the experts are chosen by ``scores + correction_bias`` (the
  checkpoint's ``e_score_correction_bias``), first keeping the ``topk_group`` best of ``n_group``
  expert groups (a group scores the sum of its best two experts), then the top-k experts within
  them; the gates are the *uncorrected* scores of the chosen experts, renormalised when
  ``norm_topk_prob`` (denominator + 1e-20, as transformers) and times ``routed_scaling_factor``.
  The bias is a ``CorrectionBias``: a frozen buffer read from and written to checkpoints, never
  an ``nnx.Param``, so neither training mode's trainable filter picks it up (DeepSeek updates it
  outside the gradient from expert load; rlx keeps it fixed). The router weight is kept in f32,
  as transformers keeps ``gate.weight``. The selection is not differentiable (top-k indices);
  gradients reach the router through the gates.

Qwen2-MoE adds a shared expert scaled by ``sigmoid(x @ w_gate)``; DeepSeek-V3 / GLM-4.5 add
``n_shared_experts`` ungated shared experts, run as one SwiGLU MLP of their summed width.
gpt-oss's experts add per-expert biases to each projection and use ``clamped_swiglu``.

Experts are stacked parameters ``[E, in, out]`` and run as one batched computation, never a Python
loop over experts. Expert weights may be frozen quantized tensors (``rlx.quant``) and each projection
may carry a batched per-expert adapter (``gate_lora`` / ``up_lora`` / ``down_lora``, LoRA or OFT, with
``ragged(x, group_sizes)`` and ``dense(x)`` methods); ``adapter=False`` skips the adapters. Two
implementations give the same numbers:

- ``ragged``: tokens sorted by expert, ``jax.lax.ragged_dot`` over contiguous groups (k x tokens
  rows, no wasted FLOPs on backends with a native grouped product; jax lowers it on XLA:CPU as a
  masked product over every group, so there a frozen quantized stack runs through
  ``rlx.models.grouped.grouped_matmul``: the groups' row tiles, one expert's matrix at a time).
  With the experts split over an ``expert`` mesh axis (``expert_parallel(model, mesh, rules)``,
  which the learner's train state and the built-in engine apply), the layer dispatches tokens to
  the devices that hold their experts and back (``rlx.models.moe_dispatch``: dropless
  ``all_to_all``, grouped ``ragged_dot`` per device).
- ``dense``: every expert on every token, combined with a zero-padded gate matrix. E/k times the
  FLOPs, a plain einsum whose expert dimension GSPMD shards over the ``expert`` mesh axis (an
  all-reduce combines the experts); kept as the reference and for comparison.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from rlx.mesh import LogicalRules, gathered_rules
from rlx.models.grouped import grouped_matmul
from rlx.models.hparams import MoEConfig
from rlx.models.layers import Linear, param, quantize_activations, weight_value
from rlx.models.moe_dispatch import ExpertParallel, dispatch
from rlx.models.stack import LayerGather, LayerStack
from rlx.platform.policy import current

MOE_IMPLS = ("ragged", "dense")  # the two implementations above (config.model.moe_impl)


class DenseMLP(nnx.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, d: int, f: int, *, dtype, param_dtype, rngs):
        kw = dict(bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = Linear(d, f, ("embed", "mlp"), **kw)
        self.up_proj = Linear(d, f, ("embed", "mlp"), **kw)
        self.down_proj = Linear(f, d, ("mlp", "embed"), **kw)

    def __call__(self, x: Float[Array, "... d"], adapter: bool = True) -> Float[Array, "... d"]:
        h = swiglu(self.gate_proj(x, adapter), self.up_proj(x, adapter))
        return self.down_proj(h, adapter)


def swiglu(gate: Array, up: Array) -> Array:
    """``silu(gate) * up`` in f32, rounded once to ``gate``'s dtype: XLA:CPU runs bf16 element-wise
    work (and its gradient) as f32 with a conversion pair around every operation."""
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype)


def clamped_swiglu(gate: Array, up: Array, limit: float, alpha: float) -> Array:
    """gpt-oss's SwiGLU: ``(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with
    ``g = min(gate, limit)`` (transformers' ``GptOssExperts._apply_gate``), in f32, rounded once
    to ``gate``'s dtype."""
    g = jnp.minimum(gate.astype(jnp.float32), limit)
    u = jnp.clip(up.astype(jnp.float32), -limit, limit)
    return ((u + 1.0) * g * jax.nn.sigmoid(alpha * g)).astype(gate.dtype)


class Experts(nnx.Module):
    """``E`` SwiGLU experts stored as ``gate/up: [E, d, f]`` and ``down: [E, f, d]``; with
    ``m.expert_bias`` each projection adds its expert's bias (``gate_bias`` / ``up_bias``:
    ``[E, f]``, ``down_bias``: ``[E, d]``), and ``m.swiglu_limit`` makes the activation
    ``clamped_swiglu`` (gpt-oss)."""

    def __init__(self, e: int, d: int, f: int, *, dtype, param_dtype, rngs,
                 m: MoEConfig | None = None):
        self.gate_proj = param(rngs, (e, d, f), param_dtype, ("expert", "embed", "expert_mlp"))
        self.up_proj = param(rngs, (e, d, f), param_dtype, ("expert", "embed", "expert_mlp"))
        self.down_proj = param(rngs, (e, f, d), param_dtype, ("expert", "expert_mlp", "embed"))
        biased = m is not None and m.expert_bias
        bias = lambda w, axes: param(None, w, param_dtype, axes, "zeros") if biased else None  # noqa: E731
        self.gate_bias = bias((e, f), ("expert", "expert_mlp"))
        self.up_bias = bias((e, f), ("expert", "expert_mlp"))
        self.down_bias = bias((e, d), ("expert", "embed"))
        self.swiglu_limit = None if m is None else m.swiglu_limit
        self.swiglu_alpha = 1.0 if m is None else m.swiglu_alpha
        self.dtype = dtype
        self.gate_lora = self.up_lora = self.down_lora = nnx.data(None)  # set by rlx.quant.apply_lora
        self.act_quant = "none"  # set by rlx.quant.quantize_model for W8A8 serving formats

    def weights(self):
        return tuple(weight_value(w, self.dtype) for w in (self.gate_proj, self.up_proj, self.down_proj))

    def activate(self, gate: Array, up: Array) -> Array:
        """The experts' gated activation (``swiglu`` or gpt-oss's ``clamped_swiglu``)."""
        if self.swiglu_limit is None:
            return swiglu(gate, up)
        return clamped_swiglu(gate, up, self.swiglu_limit, self.swiglu_alpha)

    def _row_bias(self, y, bias, group_sizes):
        """``y`` plus each sorted row's expert's ``bias`` (rows past the groups: none)."""
        if bias is None:
            return y
        ends = jnp.cumsum(group_sizes)
        expert = jnp.searchsorted(ends, jnp.arange(y.shape[0]), side="right")  # [m]; E: none
        b = bias[...].astype(y.dtype)[jnp.minimum(expert, group_sizes.shape[0] - 1)]
        return y + jnp.where((expert < group_sizes.shape[0])[:, None], b, 0)

    def _ragged(self, x, w, lora, group_sizes, adapter: bool):
        """One projection of the grouped rows: ``w`` the stored stack (a float variable, or a
        frozen quantized tensor, which XLA:CPU multiplies one expert's matrix at a time)."""
        if adapter and lora is not None and lora.rotates:  # OFT: rotate each expert's rows
            x, lora = lora.ragged(x, group_sizes), None
        xq = quantize_activations(x, self.act_quant)
        if not isinstance(w, nnx.Variable) and current().experts_one_at_a_time:
            y = grouped_matmul(xq, w, group_sizes)
        else:
            y = jax.lax.ragged_dot(xq, weight_value(w, self.dtype), group_sizes)
        if adapter and lora is not None:
            y = y + lora.ragged(x, group_sizes).astype(y.dtype)
        return y

    def num_local_experts(self) -> int:
        """Experts this module holds: all ``E``, or a device's share inside a ``shard_map``."""
        w = self.gate_proj
        leaf = w[...] if isinstance(w, nnx.Variable) else jax.tree.leaves(nnx.state(w))[0]
        return leaf.shape[0]

    def grouped(self, xs: Float[Array, "m d"], group_sizes: Int[Array, " e"], adapter: bool = True
                ) -> Float[Array, "m d"]:
        """The experts on rows sorted by expert, ``group_sizes[e]`` rows for expert ``e`` (rows past
        their sum belong to no expert)."""
        wg, wu, wd = self.gate_proj, self.up_proj, self.down_proj
        gate = self._ragged(xs, wg, self.gate_lora, group_sizes, adapter)
        up = self._ragged(xs, wu, self.up_lora, group_sizes, adapter)
        h = self.activate(self._row_bias(gate, self.gate_bias, group_sizes),
                          self._row_bias(up, self.up_bias, group_sizes))
        y = self._ragged(h, wd, self.down_lora, group_sizes, adapter)
        return self._row_bias(y, self.down_bias, group_sizes)

    def ragged(self, x: Float[Array, "n d"], idx: Int[Array, "n k"], gates: Float[Array, "n k"],
               adapter: bool = True):
        """Sort (token, slot) pairs by expert and run grouped matmuls."""
        n, k = idx.shape
        flat = idx.reshape(-1)  # [n*k]
        order = jnp.argsort(flat, stable=True)
        token = order // k
        group_sizes = jnp.bincount(flat, length=self.num_local_experts()).astype(jnp.int32)
        y = self.grouped(x[token], group_sizes, adapter)  # [n*k, d]
        y = y * gates.reshape(-1)[order][:, None].astype(y.dtype)
        return jnp.zeros_like(x).at[token].add(y)

    def _dense(self, x, w, lora, spec: str, adapter: bool, bias=None):
        if adapter and lora is not None and lora.rotates:  # OFT: each expert's rotated copy
            x, lora, spec = lora.dense(x), None, spec.replace("nd,", "ned,")
        y = jnp.einsum(spec, quantize_activations(x, self.act_quant), w)
        if adapter and lora is not None:
            y = y + lora.dense(x).astype(y.dtype)
        return y if bias is None else y + bias[...].astype(y.dtype)[None]

    def dense(self, x: Float[Array, "n d"], idx: Int[Array, "n k"], gates: Float[Array, "n k"],
              adapter: bool = True):
        """All experts on all tokens, weighted by a gate matrix that is zero off the top-k."""
        wg, wu, wd = self.weights()
        combine = jnp.zeros((x.shape[0], wg.shape[0]), gates.dtype)
        combine = combine.at[jnp.arange(x.shape[0])[:, None], idx].add(gates)  # [n, e]
        h = self.activate(self._dense(x, wg, self.gate_lora, "nd,edf->nef", adapter, self.gate_bias),
                          self._dense(x, wu, self.up_lora, "nd,edf->nef", adapter, self.up_bias))
        y = self._dense(h, wd, self.down_lora, "nef,efd->ned", adapter, self.down_bias)
        return jnp.einsum("ned,ne->nd", y, combine.astype(y.dtype))


class Routed(NamedTuple):
    """A MoE layer's output, the experts each token went to (``[b, t, k]``) and the number of
    (token, expert) pairs a dispatch capacity dropped (0 when dropless)."""

    out: Array
    experts: Int[Array, "b t k"]
    dropped: Int[Array, ""]


class CorrectionBias(nnx.Variable):
    """A router's per-expert selection bias (``e_score_correction_bias``), f32: a frozen buffer,
    deliberately not an ``nnx.Param`` (nor an ``nnx.LoRAParam``), so it is never trained nor
    differentiated; loaded from and saved to HF checkpoints with the parameters."""


def softmax_topk(logits: Float[Array, "n e"], k: int, norm: bool,
                 replay: Int[Array, "n k"] | None = None
                 ) -> tuple[Int[Array, "n k"], Float[Array, "n k"]]:
    """Experts and gates of the softmax router (f32); ``replay`` fixes the experts (routing
    replay) and the gates are the router's probabilities of those experts."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    if replay is None:
        gates, idx = jax.lax.top_k(probs, k)  # [n, k]
    else:
        idx, gates = replay, jnp.take_along_axis(probs, replay, axis=1)
    if norm:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return idx, gates


def sigmoid_group_topk(logits: Float[Array, "n e"], bias: Float[Array, " e"] | None, m: MoEConfig,
                       replay: Int[Array, "n k"] | None = None
                       ) -> tuple[Int[Array, "n k"], Float[Array, "n k"]]:
    """Experts and gates of the sigmoid router with group-limited top-k (f32; see the module doc);
    ``replay`` fixes the experts (routing replay), the gates are their uncorrected scores."""
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))  # [n, e]
    idx = _group_topk(scores, bias, m) if replay is None else replay
    gates = jnp.take_along_axis(scores, idx, axis=1)
    if m.norm_topk_prob:
        gates = gates / (jnp.sum(gates, axis=-1, keepdims=True) + 1e-20)
    return idx, gates


def _group_topk(scores: Float[Array, "n e"], bias: Float[Array, " e"] | None, m: MoEConfig
                ) -> Int[Array, "n k"]:
    """The experts the sigmoid router chooses: by ``scores + bias``, within the best groups."""
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    if m.topk_group < m.n_group:  # keep the topk_group best groups, by their best two experts
        n, e = choice.shape
        grouped = choice.reshape(n, m.n_group, e // m.n_group)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [n, groups]
        _, best = jax.lax.top_k(group_scores, m.topk_group)  # [n, topk_group]
        keep = jnp.sum(jax.nn.one_hot(best, m.n_group, dtype=jnp.int32), axis=1) > 0  # [n, groups]
        keep = jnp.repeat(keep, e // m.n_group, axis=1)  # [n, e]
        choice = jnp.where(keep, choice, -jnp.inf)
    return jax.lax.top_k(choice, m.top_k)[1]  # [n, k]


class SparseMoE(nnx.Module):
    """Router + experts (+ optional shared experts, gated or not)."""

    dispatches = True  # routes by ``routing`` and dispatches over the expert axis (expert_parallel)

    def __init__(self, d: int, m: MoEConfig, *, dtype, param_dtype, rngs, impl: str = "ragged"):
        sigmoid = m.router == "sigmoid"
        self.router = param(rngs, (d, m.num_experts), jnp.float32 if sigmoid else param_dtype,
                            ("embed", None))
        self.router_bias = (param(None, (m.num_experts,), param_dtype, (None,), "zeros")
                            if m.router_bias else None)
        self.correction_bias = CorrectionBias(
            jnp.zeros((m.num_experts,), jnp.float32), logical_axes=(None,)) if m.correction_bias else None
        self.experts = Experts(m.num_experts, d, m.intermediate_size, dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs, m=m)
        self.shared_expert = (
            DenseMLP(d, m.shared_intermediate_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
            if m.shared_intermediate_size else None
        )
        self.shared_gate = (
            param(rngs, (d, 1), param_dtype, ("embed", None)) if m.shared_expert_gate else None
        )
        self.routing, self.dtype, self.impl = m, dtype, impl
        self.expert_parallel = None  # an ExpertParallel: set by expert_parallel() on a mesh

    def route(self, x: Float[Array, "n d"], replay: Int[Array, "n k"] | None = None
              ) -> tuple[Int[Array, "n k"], Float[Array, "n k"]]:
        """The experts of each token and their gates (in the compute dtype). ``replay`` (routing
        replay) fixes the experts; the gates are still computed from this router's logits over
        them, so a trainable router keeps its gradient. A token whose replayed row holds a -1
        (a position the sampler never fed: padding, a completion's last token) is routed
        freely, as without replay."""
        m = self.routing
        if m.router == "softmax":
            logits = x @ self.router[...].astype(self.dtype)  # [n, e]
            if self.router_bias is not None:
                logits = logits + self.router_bias[...].astype(self.dtype)
            pick = functools.partial(softmax_topk, logits, m.top_k, m.norm_topk_prob)
        else:
            logits = x.astype(jnp.float32) @ self.router[...].astype(jnp.float32)  # [n, e]
            bias = None if self.correction_bias is None else self.correction_bias[...]
            pick = functools.partial(sigmoid_group_topk, logits, bias, m)
        if replay is not None:  # a row holding a -1 (never recorded) takes the router's choice
            own, replay = pick()[0], replay.astype(jnp.int32)
            replay = jnp.where(jnp.any(replay < 0, axis=-1, keepdims=True), own, replay)
        idx, gates = pick(replay)
        if m.routed_scaling_factor != 1.0:
            gates = gates * m.routed_scaling_factor
        return idx, gates.astype(self.dtype)

    def __call__(self, x: Float[Array, "b t d"], adapter: bool = True) -> Float[Array, "b t d"]:
        return self.routed(x, adapter).out

    def routed(self, x: Float[Array, "b t d"], adapter: bool = True,
               replay: Int[Array, "b t k"] | None = None) -> "Routed":
        """The layer's output with the experts it chose per token (``replay``, when given) and
        the (token, expert) pairs a dispatch capacity dropped."""
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        idx, gates = self.route(flat, None if replay is None else replay.reshape(b * t, -1))
        dropped = jnp.zeros((), jnp.int32)
        if self.impl == "dense":
            out = self.experts.dense(flat, idx, gates, adapter)
        elif self.expert_parallel is not None:
            out, dropped = dispatch(self.experts, self.expert_parallel, flat, idx, gates, adapter)
        else:
            out = self.experts.ragged(flat, idx, gates, adapter)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat, adapter)
            if self.shared_gate is not None:
                shared = jax.nn.sigmoid(flat @ self.shared_gate[...].astype(self.dtype)) * shared
            out = out + shared
        return Routed(out.reshape(b, t, d), idx.reshape(b, t, -1).astype(jnp.int32), dropped)


def expert_parallel(model: nnx.Module, mesh: Mesh | None, rules: LogicalRules,
                    capacity_factor: float | None = None) -> nnx.Module:
    """Make every ``ragged`` MoE layer of ``model`` dispatch tokens to experts split over
    ``mesh``'s expert axis (``rlx.models.moe_dispatch``), or run them whole where the expert axis
    is 1 or ``mesh`` is None; and, with the expert axis split, every stack of scanned layers
    gather its weights' FSDP shards over the expert devices one layer at a time
    (``rlx.models.stack.LayerGather``); in place, returns ``model``."""
    ep = None if mesh is None else ExpertParallel.of(mesh, rules, capacity_factor)
    for _, node in nnx.iter_graph(model):
        if isinstance(node, LayerStack):
            node.gather = None if ep is None else LayerGather(mesh, gathered_rules(rules))
        if isinstance(node, SparseMoE) and not node.dispatches:
            if ep is not None and ep.experts_split > 1:
                raise ValueError(f"{type(node).__name__} layers have no token dispatch over the "
                                 f"mesh axis {ep.expert_axis!r}; set config.mesh.expert=1")
        elif isinstance(node, SparseMoE):
            e = node.routing.num_experts
            if ep is not None and node.impl == "ragged" and e % ep.experts_split:
                raise ValueError(f"mesh axis {ep.expert_axis!r} of size {ep.experts_split} does "
                                 f"not divide the layer's {e} experts; "
                                 "choose config.mesh.expert among the divisors")
            node.expert_parallel = ep
    return model
