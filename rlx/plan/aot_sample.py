"""The built-in engine's generate step for XLA:TPU (``python -m rlx.plan --aot``): its lowering on
abstract arguments, and the TPU plan of its temporaries.

``generate_lowered`` jits ``rlx.rollout.jax.sampling.generate_batch`` as the engine does (its
sampling shardings, every row its own prompt, sampled with log-probs) on ``nnx.eval_shape``
state. ``sample_temp`` is the TPU plan of that program's temporaries per device: the features of
``sample_features`` (bytes of the physical buffers it holds: the KV cache, the prefill's
activations and attention scores over its rows x prompt tokens, the token-dispatch exchange
buffers, one layer's dequantized experts, the sampling logits) times
``SAMPLE_TPU_COEFFS``, fitted by ``rlx.plan.aot.calibrate_sample`` (non-negative least squares on
relative error) to XLA:TPU's own ``memory_analysis()`` of small ``--layers`` programs and the
whole-model programs of ``SAMPLE_WHOLE_MODEL_POINTS``. The XLA:CPU plan's sampling figures stay
``rlx.plan.memory.step_bytes``' (``kv_cache`` + ``decode_temp``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from rlx.mesh import (TRAIN_RULES, batch_sharding, batch_shards, context_as_rows,
                      variable_shardings)
from rlx.models.parallel import parallelize
from rlx.models.moe_dispatch import capacity
from rlx.plan.memory import kv_cache_per_token
from rlx.plan.spec import PlanSpec, abstract_model, trainable_filter
from rlx.quant.tensors import QTensor
from rlx.models.paged_kv import PagedKVCache
from rlx.models.stack import cache_stacks
from rlx.rollout.jax.batching import pow2
from rlx.rollout.jax.cache_layout import cache_sharding
from rlx.rollout.jax.config import JaxSection
from rlx.rollout.jax.continuous import MIN_ROWS, Placement, Slots, compile_programs
from rlx.rollout.jax.paged import pool_pages
from rlx.rollout.jax.engine import Buckets
from rlx.rollout.jax.sampler import Knobs, SamplerSpec
from rlx.rollout.jax.sampling import GenerateStatic, generate_batch, segment_ends
from rlx.rollout.jax.stops import Stops

# XLA:TPU's generate-step temporaries per feature of ``sample_features`` (bytes per byte),
# fitted by ``rlx.plan.aot.calibrate_sample``
SAMPLE_TPU_COEFFS = {"kv": 1.603, "resid": 0.0, "qkv": 0.0, "scores": 0.0, "moe_d": 2.526,
                     "moe_f": 0.0, "experts": 2.145, "logits": 0.0,
                     "layer_w": 0.0, "moe_q": 1.122, "unpack": 0.72,
                     # not fitted (no compiled program binds it alone): the train step's
                     "gathered": 2.0,
                     # fitted on the Kimi-K2 and DeepSeek-V3 :long programs at 32,768 tokens
                     # (whose last decode segment binds), least squares on relative error
                     "kv_full": 1.185}
# The whole-model generate programs ``calibrate_sample`` fits besides ``SAMPLE_CALIBRATION``: the
# arguments of ``python -m rlx.plan`` and XLA:TPU's temporaries in GB per device
# (rlx/plan/README.md's generate rows)
SAMPLE_WHOLE_MODEL_POINTS: tuple[tuple[str, float], ...] = (
    ("--config configs/kimi_k2.py --aot tpu7x:2x2x2 --capacity-factor 0", 16.0),
    ("--config configs/deepseek_v3_fp8.py --aot tpu7x:2x2x2", 7.047),
    ("--config configs/qwen3_235b_a22b_plan.py --aot tpu7x:2x2x2", 7.55),
    ("--config configs/kimi_k2.py:long --aot tpu7x:2x2x2", 44.492),
    ("--config configs/deepseek_v3_fp8.py:long --aot tpu7x:2x2x2", 48.667),
    ("--config configs/kimi_k2.py:long --config.rollout.max_new_tokens=6144 --aot tpu7x:2x2x2",
     32.973),
    ("--config configs/deepseek_v3_fp8.py:long --config.rollout.max_new_tokens=6144 "
     "--aot tpu7x:2x2x2", 29.677),
)
# The small programs ``calibrate_sample`` compiles and fits (first layers at full width)
SAMPLE_CALIBRATION: tuple[str, ...] = (
    "--config configs/deepseek_v3_fp8.py --aot tpu7x:2x2x2 --layers 4",
    "--config configs/deepseek_v3_fp8.py --aot tpu7x:2x2x2 --layers 5 --capacity-factor 0",
    "--config configs/kimi_k2.py --aot tpu7x:2x2x2 --capacity-factor 0 --layers 2",
    "--config configs/qwen3_235b_a22b_plan.py --aot tpu7x:2x2x2 --layers 2",
)


def generate_shapes(spec: PlanSpec) -> tuple[int, int, int]:
    """(rows, prompt width, new-token buffer) of the engine's bucket for ``spec``'s rollouts:
    ``rollout_len`` split as ``rollout_prompt`` prompt tokens (a run config's
    ``max_prompt_tokens``; else a quarter) and the rest completion, each rounded up as
    ``rlx.rollout.jax.engine.Buckets`` rounds them."""
    b, dp = Buckets(max_rows=spec.rollout_rows), batch_shards(spec.mesh, spec.engine_rules)
    prompt = spec.rollout_prompt or spec.rollout_len // 4
    return b.rows(spec.rollout_rows, dp), b.prompt(prompt), b.new_tokens(spec.rollout_len - prompt)


def _abstract(tree, shardings):
    """``tree``'s leaves as ShapeDtypeStructs on ``shardings`` (a prefix tree: one per variable)."""
    def one(sharding, sub):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                            sub)

    return jax.tree.map(one, shardings, tree)


def generate_lowered(spec: PlanSpec, mesh):
    """The engine's generate function for ``spec``, lowered on abstract arguments: every row its
    own prompt, sampled at temperature with log-probs (the training rollouts)."""
    rules = spec.engine_rules
    model = parallelize(abstract_model(spec), mesh, rules,
                        spec.moe_capacity_factor or None)  # as the engine's _eval_split
    model.eval()
    graphdef, state = nnx.split(model)
    shardings = engine_shardings(state, mesh, spec)
    rows, prompt, new = generate_shapes(spec)
    kv = cache_sharding(mesh, spec.model, rules, batch_shards(mesh, rules))
    static = GenerateStatic(graphdef, SamplerSpec(), new, True, kv, batch_sharding(mesh, 2, rules))
    row1, row2 = (batch_sharding(mesh, n, rules) for n in (1, 2))
    rep = NamedSharding(mesh, PartitionSpec())
    args = [jax.ShapeDtypeStruct((rows, prompt), jnp.int32, sharding=row2)]
    args += [jax.ShapeDtypeStruct((rows,), dt, sharding=row1)
             for dt in (jnp.int32, jnp.int32, jnp.uint32, jnp.int32)]
    scalar = lambda dt: jax.ShapeDtypeStruct((), dt, sharding=rep)  # noqa: E731
    args += [scalar(jnp.int32), Knobs(*(scalar(jnp.float32) for _ in range(3))),
             scalar(jnp.int32)]
    args.append(Stops(jax.ShapeDtypeStruct((4,), jnp.int32, sharding=rep)))  # stop ids
    fn = jax.jit(functools.partial(generate_batch, static=static),
                 in_shardings=(shardings, *jax.tree.map(lambda a: a.sharding, args)),
                 out_shardings=(row2, row2, row1, row1))
    return fn.lower(_abstract(state, shardings), *args)


def paged_shapes(spec: PlanSpec, section: JaxSection = JaxSection()) -> dict[str, int]:
    """The continuous engine's shapes for ``spec``'s rollouts (``rlx.rollout.jax.paged``):
    ``slots`` decode slots (``rollout_rows``, a block per data shard), each data shard's pool
    of ``pages`` pages (``spec.kv_pages``, else ``pool_pages``), a decode burst's page table
    ``width``, and a prefill chunk's ``rows``, ``chunk`` tokens and table ``prefill_width`` (the
    prompt's pages); ``section`` gives the rest of the engine's settings."""
    shards, size = spec.page_shards, spec.page_size
    slots = -(-spec.rollout_rows // shards) * shards
    width = -(-spec.rollout_len // size)
    prompt = spec.rollout_prompt or spec.rollout_len // 4
    per = max(1, section.prefill_rows // shards)
    pages = spec.kv_pages or pool_pages(spec.rollout_rows, spec.rollout_group, spec.rollout_len,
                                        slots, shards, size)
    return dict(shards=shards, slots=slots, pages=pages, width=width,
                rows=shards * max(MIN_ROWS, min(per, pow2(-(-slots // shards)))),
                chunk=min(section.prefill_chunk, -(-prompt // 16) * 16),
                prefill_width=pow2(-(-prompt // size)))


def paged_lowered(spec: PlanSpec, mesh, section: JaxSection = JaxSection()) -> dict:
    """The continuous engine's decode burst and prefill chunk for ``spec`` (``paged_shapes``),
    lowered on abstract arguments with the shardings the engine declares (``Placement``):
    ``{"burst": ..., "prefill": ...}``."""
    rules = context_as_rows(spec.engine_rules)  # the engine's, context: rows
    model = parallelize(abstract_model(spec), mesh, rules, spec.moe_capacity_factor or None)
    model.eval()
    graphdef, state = nnx.split(model)
    n, stacks = paged_shapes(spec, section), cache_stacks(model)
    total = n["pages"] * n["shards"]
    dtype = jnp.bfloat16 if spec.kv_dtype == "bfloat16" else jnp.float32
    pools = jax.eval_shape(lambda: PagedKVCache.zeros(spec.model, total, spec.page_size, dtype,
                                                      stacks))
    place = Placement.of(mesh, rules, spec.model, stacks, total, spec.page_size,
                         engine_shardings(state, mesh, spec))
    programs = compile_programs(graphdef, SamplerSpec(), burst=section.burst,
                                shards=n["shards"], place=place)
    pools = _abstract(pools, place.pools)
    rep = place.whole
    arg = lambda shape, dt=jnp.int32: jax.ShapeDtypeStruct(  # noqa: E731
        shape, dt, sharding=place.rows(len(shape)))
    scalar = lambda dt: jax.ShapeDtypeStruct((), dt, sharding=rep)  # noqa: E731
    knobs = Knobs(*(scalar(jnp.float32) for _ in range(3)))
    stops = Stops(jax.ShapeDtypeStruct((4,), jnp.int32, sharding=rep))
    s, r, c = n["slots"], n["rows"], n["chunk"]
    slots = Slots(arg((s, n["width"])), *(arg((s,)) for _ in range(4)), arg((s,), jnp.bool_),
                  arg((s,)), arg((s,), jnp.uint32), arg((s,)))
    weights = _abstract(state, place.state)
    return {"burst": programs.burst.lower(weights, pools, slots, scalar(jnp.int32), knobs, stops,
                                          scalar(jnp.bool_), scalar(jnp.int32)),
            "prefill": programs.prefill.lower(weights, pools, *(arg((r, c)) for _ in range(3)),
                                              arg((r, n["prefill_width"])), arg((r,)))}


def engine_shardings(state, mesh, spec: PlanSpec):
    """The engine's variables where a run holds them (``rlx.run.engines``): the frozen base as
    the learner placed it (``TRAIN_RULES``: the engine reads the learner's own arrays), and so
    the trainable variables of a synchronous run; an asynchronous run's engine copies those by
    the sampling rules."""
    shared = nnx.Not(trainable_filter(spec)) if spec.engine_copies_trainables else ...
    train = nnx.to_flat_state(variable_shardings(state, mesh, TRAIN_RULES))
    sample = nnx.to_flat_state(variable_shardings(state, mesh, spec.engine_rules))
    held = {tuple(p) for p, _ in nnx.to_flat_state(nnx.filter_state(state, shared))}
    return nnx.from_flat_state([(p, t if tuple(p) in held else s)
                                for (p, t), (_, s) in zip(train, sample)])


def local_expert_bytes(spec: PlanSpec) -> int:
    """One MoE layer's routed experts on a device (gate, up and down) in the compute dtype: what
    a quantized base dequantizes, and a full-parameter step differentiates, a layer at a time."""
    c, moe = spec.model, spec.model.moe
    if moe is None:
        return 0
    a = 2 if spec.dtype == "bfloat16" else 4
    local = moe.num_experts // spec.mesh.expert if moe.num_experts % spec.mesh.expert == 0 else (
        moe.num_experts)
    return a * local * 3 * c.hidden_size * moe.intermediate_size // spec.mesh.tensor


def _qkv_width(spec: PlanSpec) -> float:
    """Per-token width (per device) of one layer's attention projections in a prefill: GQA's q,
    k and v; MLA's query (and its low-rank bottleneck), latent and shared rotary key."""
    c, t = spec.model, spec.mesh.tensor
    if c.mla is None:
        return (c.num_heads + 2 * c.num_kv_heads) * c.head_dim / t
    m = c.mla
    return (m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_rope_head_dim + (
        c.num_heads * m.qk_head_dim / t)


def _layer_weights(spec: PlanSpec, sparse: bool) -> float:
    """Parameters of one layer's non-expert weights on a device as a scanned stack gathers them
    (``rlx.models.stack.LayerGather``): attention and the dense (or shared-expert) MLP."""
    c, t = spec.model, spec.mesh.tensor
    d, h = c.hidden_size, c.num_heads
    if c.mla is None:
        attn = d * (h + 2 * c.num_kv_heads) * c.head_dim + h * c.head_dim * d
    else:
        m = c.mla
        q = d * m.q_lora_rank + m.q_lora_rank * h * m.qk_head_dim if m.q_lora_rank else (
            d * h * m.qk_head_dim)
        attn = (q + d * (m.kv_lora_rank + m.qk_rope_head_dim)
                + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim) + h * m.v_head_dim * d)
    width = c.moe.shared_intermediate_size if sparse else c.intermediate_size
    return (attn + 3 * d * width) / t


def _moe_rows(spec: PlanSpec, n: int) -> int:
    """Rows of a MoE layer's expert products for ``n`` prefill tokens on a device: the
    token-dispatch exchange's ``P * C`` (``rlx.models.moe_dispatch.capacity``), ``n * k`` on one
    expert shard, every local expert's ``n`` on the einsum path (``moe_impl="dense"``)."""
    e, p = spec.model.moe, spec.mesh.expert
    if spec.moe_impl == "dense":  # the einsum path: every local expert over every token
        return n * (e.num_experts // p if e.num_experts % p == 0 else e.num_experts)
    if p == 1:
        return n * e.top_k
    return p * capacity(n, e.top_k, e.num_experts // p, p, spec.moe_capacity_factor or None)


def _one_layer(spec: PlanSpec):
    """The abstract model of ``spec`` cut to one layer (a MoE layer where the model has any)."""
    c = spec.model
    moe = c.moe and dataclasses.replace(c.moe, sparse_layers=(0,))
    one = spec.replace(model=dataclasses.replace(c, num_layers=1, moe=moe), scan_layers="off")
    return abstract_model(one).layers[0]


def _copy_bytes(spec: PlanSpec, w, float_copy: bool) -> int:
    """Bytes per element of weight ``w``'s working copy in a prefill: a quantized one's
    dequantized copy, f32 where ``QTensor.dequantize`` computes in f32 (f32 scales, as fp8
    blocks have, or zero points), else the compute dtype; a float one's gathered copy where
    ``float_copy``, else none."""
    a = 2 if spec.dtype == "bfloat16" else 4
    if not isinstance(w, QTensor):
        return a if float_copy else 0
    return 4 if w.zero is not None or w.scale.get_value().dtype == jnp.float32 else a


def sample_features(spec: PlanSpec) -> dict[str, float]:
    """Bytes per device of the generate step's buffers, one unit of each ``SAMPLE_TPU_COEFFS``.

    ``kv``: the cache of the bucket's rows as the prefill writes it (prompt + first segment
    slots, a device's share of them under ``context``; the programs' peak is in the prefill,
    the cache grows by segments after it). Of the prefill (rows x prompt tokens per device: a
    row's over ``context``; one layer at a time): ``gathered`` one layer's prompt keys and
    values (MLA: latents) gathered whole under context parallelism, ``resid`` its hidden states,
    ``qkv`` its attention projections (MLA: also the per-head keys and values expanded over the
    first segment's slots), ``scores`` its f32 attention scores over those slots, ``layer_w``
    the largest layer's non-expert weights as the scan gathers (and dequantizes) them, and the
    MoE terms of ``_moe_features``. ``logits``: one step's f32 logits (MLA's decode steps absorb
    ``kv_b_proj``: no per-head keys or values, ``rlx.models.mla``).
    ``kv_full``: the last decode segment's, the whole cache (every slot of the bucket) of the
    row's context devices together: under context parallelism XLA:TPU's temporaries of the
    32,768-token programs were 1.14-1.24x that, not a device's share (4 devices: 4.5-5.0x it)."""
    c, m, layer = spec.model, spec.mesh, _one_layer(spec)
    a = 2 if spec.dtype == "bfloat16" else 4
    rows, p, new = generate_shapes(spec)
    r = math.ceil(rows / batch_shards(m, spec.engine_rules))
    slots, n = p + segment_ends(new)[0], r * p // m.context
    per_token = kv_cache_per_token(c) if c.mla is not None else kv_cache_per_token(c) / m.tensor
    kv_bytes = 2 if spec.kv_dtype == "bfloat16" else 4
    f = {"kv": c.num_layers * r * slots // m.context * per_token * kv_bytes,
         "resid": a * n * c.hidden_size, "qkv": a * n * _qkv_width(spec),
         "scores": 4 * r * c.num_heads / m.tensor * p // m.context * slots,
         "logits": 4 * r * c.vocab_size / m.tensor,
         "gathered": a * r * p * per_token if m.context > 1 else 0.0,
         "kv_full": c.num_layers * r * (p + new) * per_token * kv_bytes}
    if c.mla is not None:
        kv_width = c.num_heads / m.tensor * (c.mla.qk_nope_head_dim + c.mla.v_head_dim)
        f["qkv"] += a * r * slots * kv_width
    kinds = {c.is_sparse_layer(i) for i in range(c.num_layers)}
    f["layer_w"] = _copy_bytes(spec, layer.self_attn.o_proj.kernel, True) * max(
        _layer_weights(spec, k) for k in kinds)
    return {**f, **_moe_features(spec, layer, n)}


def _moe_features(spec: PlanSpec, layer, n: int) -> dict[str, float]:
    """A MoE layer's prefill of ``n`` tokens per device (zeros for a dense model): ``moe_d`` /
    ``moe_f`` the exchange's rows (``_moe_rows``) of ``hidden`` / of the expert width, ``moe_q``
    their f32 copy that W8A8 experts quantize, ``experts`` the local experts dequantized
    (``_copy_bytes``), ``unpack`` int4's unpacked values (``unpack_nibbles``)."""
    f = dict.fromkeys(("moe_d", "moe_f", "moe_q", "experts", "unpack"), 0.0)
    c = spec.model
    if c.moe is None:
        return f
    a = 2 if spec.dtype == "bfloat16" else 4
    rows, w = _moe_rows(spec, n), layer.mlp.experts.gate_proj
    f["moe_d"] = a * rows * c.hidden_size
    f["moe_f"] = a * rows * c.moe.intermediate_size / spec.mesh.tensor
    if layer.mlp.experts.act_quant != "none":
        f["moe_q"] = 4 * rows * c.hidden_size
    f["experts"] = local_expert_bytes(spec) / a * _copy_bytes(spec, w, False)
    if isinstance(w, QTensor) and w.spec.values_per_byte > 1:  # several values per stored byte
        f["unpack"] = float(local_expert_bytes(spec))
    return f


def _phases(spec: PlanSpec, coeffs: dict[str, float]) -> tuple[float, float]:
    """(prefill, last decode segment) temporaries of ``spec`` under ``coeffs``: every feature
    but ``kv_full`` summed, and ``kv_full`` alone."""
    f = sample_features(spec)
    return (sum(coeffs[k] * v for k, v in f.items() if k != "kv_full"),
            coeffs["kv_full"] * f["kv_full"])


def sample_temp(spec: PlanSpec, coeffs: dict[str, float] | None = None) -> int:
    """The TPU plan of the generate step's temporaries per device (``coeffs``: default
    ``SAMPLE_TPU_COEFFS``): the larger of its two phases (``_phases``), the prefill and the last
    decode segment (``kv_full``: the whole cache, which the last growth copies and the layer
    scan's outputs hold again)."""
    return int(max(_phases(spec, SAMPLE_TPU_COEFFS if coeffs is None else coeffs)))


def fit_sample_coeffs(points: list[tuple[PlanSpec, int, float]]) -> dict[str, float]:
    """``SAMPLE_TPU_COEFFS`` fitted to (spec, XLA:TPU's temporaries in bytes, weight) points:
    the prefill features by non-negative least squares on the weighted relative error over the
    points whose prefill phase binds, ``kv_full`` by least squares over the others; which phase
    binds is re-decided from the fit until it settles (``sample_temp``)."""
    import numpy as np
    from scipy.optimize import nnls
    keys = sorted(k for k in SAMPLE_TPU_COEFFS if k != "kv_full")
    coeffs = dict(SAMPLE_TPU_COEFFS)
    for _ in range(5):
        decode = [d > p for p, d in (_phases(s, coeffs) for s, _, _ in points)]
        pre = [p for p, d in zip(points, decode) if not d]
        rows = [[w * sample_features(s)[k] / t for k in keys] for s, t, w in pre]
        fitted, _ = nnls(np.asarray(rows), np.asarray([w for *_, w in pre]))
        new = dict(zip(keys, (round(float(x), 3) for x in fitted)))
        full = [(sample_features(s)["kv_full"] / t, w) for (s, t, w), d in zip(points, decode)
                if d]
        new["kv_full"] = round(sum(w * x for x, w in full) / sum(w * x * x for x, w in full),
                               3) if full else coeffs["kv_full"]
        if new == coeffs:
            break
        coeffs = new
    return coeffs
