"""Per-device memory of a ``PlanSpec``: exact state sizes, an analytic step model, and XLA's own.

* ``state_bytes``: frozen base, trainable params and AdamW moments (and full mode's frozen
  reference copy of the params) per device, from the abstract
  model's shapes and its variables' logical axes under ``TRAIN_RULES`` (exact; any size), and
  PPO's critic with its AdamW moments when the spec has one. Also the built-in engine's weights:
  it samples from the learner's own frozen arrays (``rlx.rollout.jax.engine``, ``shared``), and
  in a synchronous run from its trainable arrays too; an asynchronous run's engine
  (``engine_copies_trainables``) copies the trainable variables (LoRA mode the adapters, full
  mode every parameter) under the engine's rules (``rlx.mesh.sampling_rules``: LoRA mode whole
  along ``fsdp``, full mode split over it), and a synchronous one with the ``out_in`` decode
  layout (XLA:CPU) the trainable float kernels it transposes, placed as the learner's; and the
  load transient,
  the checkpoint's largest tensor (``load_tensor_bytes``).
* ``step_bytes``: the train step's transient memory per device (gradients, saved activations,
  log-prob chunks, the batch) from a layer-by-layer count of what the backward pass keeps (see
  ``_layer_features`` and ``COEFFS``), and the built-in engine's KV cache.
* ``compiled_bytes``: lower and compile the real ``make_train_step`` on abstract inputs and read
  ``memory_analysis()`` (arguments + outputs - aliased + temporaries). Needs the mesh's devices
  locally and a model small enough to compile quickly; the tests check the analytic model
  against it.

All numbers are bytes per device. The analytic activation model counts XLA's saved residuals,
not a lower bound: attention's f32 scores and probabilities where the platform's policy attends
densely (sequences up to ``dense_attention_slots``: the causal query blocks,
``rlx.kernels.attention.causal_blocks``) and its per-query log-sum-exp where it runs a blockwise
kernel (``rlx.kernels.attention``: no score outlives a block), the MoE routing buffers, and the
[chunk, V] log-softmax working set.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from rlx.kernels.attention import causal_blocks
from rlx.kernels.logprobs import balanced_chunk
from rlx.learner.state import OptimizerConfig, TrainState, make_optimizer, state_shardings
from rlx.learner.step import FORWARDS, StepConfig, make_train_step
from rlx.mesh import (MESH_AXES, TRAIN_RULES, LogicalRules, MeshShape, logical_to_spec,
                      make_mesh)
from rlx.models import ModelConfig
from rlx.models.moe_dispatch import capacity
from rlx.models.parallel import parallelize
from rlx.plan.spec import PlanSpec, abstract_model, trainable_filter
from rlx.rollout.jax.decode_layout import out_in_kernels
from rlx.rollout.jax.paged import pool_pages
from rlx.platform.policy import current
from rlx.types import BATCH_FIELDS, TrainBatch

_BYTES = {"float32": 4, "bfloat16": 2}


class _Sizes:
    """Stand-in for a mesh where only axis sizes matter (no devices needed)."""

    def __init__(self, spec: PlanSpec):
        self.shape = dict(zip(MESH_AXES, spec.mesh.sizes))


def _shard_elems(shape, axes, sizes: _Sizes, rules: LogicalRules = TRAIN_RULES) -> int:
    """Elements of one device's shard of an array with logical ``axes`` (ceil where uneven)."""
    if not shape:
        return 1
    if axes is None or len(axes) != len(shape):
        return math.prod(shape)
    spec = tuple(logical_to_spec(axes, rules, sizes))
    spec += (None,) * (len(shape) - len(spec))
    n = 1
    for dim, part in zip(shape, spec):
        names = (part,) if isinstance(part, str) else tuple(part or ())
        split = math.prod(sizes.shape[a] for a in names)
        n *= dim // split if dim % split == 0 else dim  # indivisible dims stay whole
    return n


def _representative(spec: PlanSpec) -> tuple[PlanSpec, dict[int, int]]:
    """A spec with one layer of each kind (dense / sparse) and how many layers each stands for."""
    c = spec.model
    kinds = [c.is_sparse_layer(i) for i in range(c.num_layers)]
    firsts = sorted({kinds.index(k) for k in set(kinds)})
    weight = {new: kinds.count(kinds[old]) for new, old in enumerate(firsts)}
    moe = c.moe
    if moe is not None:
        sparse = tuple(new for new, old in enumerate(firsts) if kinds[old])
        moe = dataclasses.replace(moe, sparse_layers=sparse)
    small = dataclasses.replace(c, num_layers=len(firsts), moe=moe)
    return spec.replace(model=small, mesh=MeshShape(), scan_layers="off"), weight  # per layer


@functools.lru_cache(maxsize=16)
def _abstract_leaves(key: str, spec: PlanSpec
                     ) -> tuple[tuple[bool, tuple, Any, Any, int, bool, bool], ...]:
    """(trainable?, shape, dtype, logical axes, layer multiplicity, a kernel the ``out_in``
    decode layout transposes?, a decoder layer's?) of every state leaf."""
    del key  # the cache key: the spec without its mesh (shapes do not depend on the mesh)
    small, weight = _representative(spec)
    model = abstract_model(small)
    kernels = out_in_kernels(model)
    _, params, frozen = nnx.split(model, trainable_filter(small), ...)
    out = []
    for trainable, state in ((True, params), (False, frozen)):
        for path, var in nnx.to_flat_state(state):
            axes = var.get_metadata().get("logical_axes") if isinstance(var, nnx.Variable) else None
            leaf = jax.tree.leaves(var)[0]
            times = weight[path[1]] if path[0] == "layers" else 1
            out.append((trainable, tuple(leaf.shape), leaf.dtype, axes, times,
                        tuple(path) in kernels, path[0] == "layers"))
    return tuple(out)


def state_bytes(spec: PlanSpec) -> dict[str, int]:
    """Per-device bytes of the frozen base, the trainable params and the AdamW moments.

    Layers of one kind have identical shapes, so one layer of each kind is built abstractly and
    counted as many times as the model has such layers (a 61-layer 1T model builds in seconds).
    """
    sizes, total, engine = _Sizes(spec), {True: 0, False: 0}, 0
    meshless = spec.replace(mesh=MeshShape())  # the cache's key: shapes do not depend on the mesh
    rules = spec.engine_rules
    for trainable, shape, dtype, axes, times, linear, _ in _abstract_leaves(repr(meshless),
                                                                            meshless):
        total[trainable] += times * _shard_elems(shape, axes, sizes) * np.dtype(dtype).itemsize
        # the engine's own copies: an asynchronous engine's of every trainable variable (by the
        # sampling rules), a synchronous one's of the trainable float kernels the out_in layout
        # transposes (placed as the learner's); the frozen base (and a synchronous run's other
        # trainable variables) it shares with the learner
        if trainable and spec.engine_copies_trainables:
            engine += times * _shard_elems(shape, axes, sizes, rules) * np.dtype(dtype).itemsize
        elif trainable and linear and spec.decode_layout == "out_in":
            engine += times * _shard_elems(shape, axes, sizes) * np.dtype(dtype).itemsize
    # PPO's critic (rlx.learner.critic): a copy of the trainable variables, sharded alike, and
    # the replicated f32 value head (kernel [D] and bias)
    critic = total[True] + 4 * (spec.model.hidden_size + 1) if spec.critic else 0
    return {"frozen": total[False], "trainable": total[True],
            "optimizer": 2 * total[True],  # AdamW: mu and nu in the parameter dtype
            "critic": critic, "critic_optimizer": 2 * critic, "engine": engine,
            # full mode's frozen reference policy: one more copy of the params, as they are placed
            "reference": total[True] if spec.reference and spec.mode == "full" else 0,
            "reward_model": reward_model_bytes(spec), "load_tensor": load_tensor_bytes(spec)}


def reward_model_bytes(spec: PlanSpec) -> int:
    """Per-device bytes of the frozen reward model (``spec.reward_model``): its body counted as
    full mode's parameters in its dtype (sharded by the same rules), plus the score head
    ``[D, labels]`` whole (an upper bound: it is split over the ``embed`` axes)."""
    if spec.reward_model is None:
        return 0
    dt = spec.reward_model_dtype
    body = spec.replace(model=spec.reward_model, mode="full", dtype=dt, param_dtype=dt,
                        reward_model=None, critic=False, decode_layout="in_out",
                        engine_copies_trainables=False, gguf_types=())
    head = spec.reward_model.hidden_size * spec.reward_model_labels * np.dtype(dt).itemsize
    return state_bytes(body)["trainable"] + head


def load_tensor_bytes(spec: PlanSpec) -> int:
    """The load transient: the checkpoint's largest single tensor, whole, as it is read (a float
    checkpoint's ``param_dtype``; one expert's matrix where the model stacks experts). Loading
    streams tensor by tensor (``rlx.quant.loading``), so a device holds the base built so far
    plus at most this one tensor on its way in. Counted from the float model: a shipped
    quantized checkpoint reads its quantized tensors in fewer bytes, and its largest is the
    float embedding or head (DeepSeek-V3, Kimi-K2)."""
    full = spec.replace(mode="full", mesh=MeshShape())
    experts = spec.model.moe.num_experts if spec.model.moe is not None else 1
    largest = 0
    for _, shape, dtype, axes, _, _, _ in _abstract_leaves(repr(full), full):
        per = experts if axes is not None and "expert" in axes else 1
        largest = max(largest, math.prod(shape) // per * np.dtype(dtype).itemsize)
    return largest


def _abstract_batch(spec: PlanSpec, mesh) -> TrainBatch:
    shape, rows = (spec.rows, spec.seq_len), NamedSharding(mesh, logical_to_spec(
        ("batch", None), TRAIN_RULES, mesh))
    fields = {}
    for name in BATCH_FIELDS:
        if name in ("old_values", "returns"):  # the critic's; none in a planned policy step
            continue
        dtype = jnp.int32 if name in ("input_ids", "positions", "segment_ids", "uid",
                                      "weight_version") else jnp.float32
        fields[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=rows)
    return TrainBatch(**fields)


def _with_shardings(tree, shardings):
    def one(sharding, sub):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), sub)

    return jax.tree.map(one, shardings, tree)


def compiled_bytes(spec: PlanSpec, devices=None) -> dict[str, int]:
    """XLA's memory analysis of the compiled train step (abstract inputs; nothing allocated)."""
    devices = list(devices or jax.devices())[: spec.mesh.num_devices]
    mesh = make_mesh(spec.mesh, devices)
    model = parallelize(abstract_model(spec), mesh, TRAIN_RULES,
                            spec.moe_capacity_factor or None)  # as create_train_state
    graphdef, params, frozen = nnx.split(model, trainable_filter(spec), ...)
    opt_cfg = OptimizerConfig()
    optimizer = make_optimizer(opt_cfg)
    zero = jax.ShapeDtypeStruct((), jnp.int32)
    state = TrainState(step=zero, skipped=zero, params=params, frozen=frozen,
                       opt_state=jax.eval_shape(optimizer.init, params),
                       rng=jax.eval_shape(lambda: jax.random.key(0)))
    state = _with_shardings(state, state_shardings(state, optimizer, mesh))
    cfg = StepConfig(micro_batches=spec.micro_batches, logprob_chunk=spec.logprob_chunk)
    step = make_train_step(graphdef, state, mesh, cfg, opt_cfg, apply_fn=FORWARDS[spec.remat])
    stats = step.lower(state, _abstract_batch(spec, mesh)).compile().memory_analysis()
    out = {"argument": stats.argument_size_in_bytes, "output": stats.output_size_in_bytes,
           "alias": stats.alias_size_in_bytes, "temp": stats.temp_size_in_bytes}
    out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out



# Coefficients of the analytic model: how many tensors of each shape the backward pass keeps
# (or the step holds at its peak), per feature of ``step_features``. Calibrated once against
# XLA's buffer assignment of the real train step on a sweep of small models (different shapes
# from the ones tests/plan/test_plan.py checks), then frozen here.
# Fitted on 17 single-device f32 steps (dense and dense-impl MoE; residuals within 2.5%):
COEFFS = {"resid": 3.6, "qkv": 1.5, "scores": 2.95, "mlp": 6.0, "moe_d": 0.83, "moe_f": 6.45,
          "router": 0.0, "logits": 2.14, "grads": 1.21, "embed": 7.5,
          "lora": 1.9,  # mode "lora" only: base and adapter outputs kept apart (3 such points;
                        # refitted after LoRA's products became 2-D, which dropped XLA's
                        # transposed cotangent copies: 3.8 before)
          "ckpt": 1.0,  # remat="layer": each layer's input, kept once (not fitted)
          # context parallelism: a layer's keys and values over the whole sequence, kept for
          # the backward pass, and their gradient before its reduce-scatter (not fitted)
          "gathered": 2.0,
          # Fitted on 12 full-mode f32 steps on fsdp = 1, 2, 8 (vocabularies of 2,048 and
          # 32,768, widths 128 and 256, 2 and 4 layers; residuals within 10%): the decoder
          # layers' weights FSDP gathers (whole less the device's shard; the gathered copy lives
          # from the forward to the backward pass, and each layer's whole gradient before its
          # reduce-scatter adds the rest), and, with the vocabulary in tiles (``vocab_block``),
          # the embedding-sized gradients of the tied lookup and head and one head tile
          "fsdp_gather": 1.3, "vocab_grads": 0.64, "head_tile": 0.68}


# the step features ``step_bytes`` reports apart from the activations
STEP_NOT_ACTIVATIONS = ("grads", "logits", "fsdp_gather", "vocab_grads", "head_tile")


def _div(x: int, parts: int) -> float:
    return x / parts if x % parts == 0 else x


def _layer_features(spec: PlanSpec, layer: int) -> dict[str, float]:
    """Bytes per device of one layer's tensor shapes (one unit of each coefficient)."""
    c, m = spec.model, spec.mesh
    a = 2 if spec.dtype == "bfloat16" else 4
    rows = math.ceil(spec.micro_rows / spec.batch_shards)
    n, t = rows * spec.seq_len / m.context, m.tensor  # tokens per device: context splits rows
    f = {"resid": a * n * c.hidden_size,
         "qkv": a * n * _qkv_width(c, t),
         "scores": 4 * rows * _div(c.num_heads, t) * _attention_pairs(spec.seq_len, m.context),
         "gathered": a * rows * spec.seq_len * _gathered_width(c, t) if m.context > 1 else 0.0,
         "mlp": 0.0, "moe_d": 0.0, "moe_f": 0.0, "router": 0.0, "lora": 0.0}
    if not c.is_sparse_layer(layer):
        f["mlp"] = a * n * _div(c.intermediate_size, t)
        f["lora"] = f["mlp"] if spec.mode == "lora" else 0.0
        return f
    e = c.moe
    slots = moe_slots(spec, n)
    f["moe_d"] = a * n * slots * c.hidden_size
    f["moe_f"] = a * n * slots * _div(e.intermediate_size, t)
    f["router"] = 4 * n * e.num_experts
    f["mlp"] = a * n * _div(e.shared_intermediate_size, t)
    if spec.mode == "lora":
        f["lora"] = f["mlp"]  # batched expert adapters measured no extra beyond moe_f
    return f


def _attention_pairs(length: int, context: int = 1) -> float:
    """f32 numbers per (row, head) and device that one layer's attention keeps for the backward
    pass: the scores of the causal query blocks where the platform attends densely (under
    context parallelism a device's queries over every key), else one log-sum-exp per query
    (``rlx.kernels.attention``)."""
    if length <= current().dense_attention_slots:
        if context > 1:
            return length * length / context
        return sum((e - b) * e for b, e in causal_blocks(length))  # the blocks' query-key pairs
    return length / context


def moe_slots(spec: PlanSpec, n: int) -> float:
    """Expert rows a MoE layer computes per token for ``n`` tokens on a device: ``top_k`` on one
    expert shard; with the experts split over ``expert``, the token-dispatch exchange's rows
    (``rlx.models.moe_dispatch.capacity`` per device pair: dropless ``expert * min(k, E /
    expert)``, about ``c * k`` with a capacity factor ``c``); the dense path every local expert."""
    e, p = spec.model.moe, spec.mesh.expert
    if spec.moe_impl == "dense":
        return _div(e.num_experts, p)
    if p == 1:
        return e.top_k
    cap = capacity(n, e.top_k, e.num_experts // p, p, spec.moe_capacity_factor or None)
    return p * cap / n


def _qkv_width(c: ModelConfig, tensor: int) -> float:
    """Per-token width (per device) of one layer's attention projections' outputs: GQA's q, k
    and v; MLA's query (and its low-rank bottleneck), the latent and shared rotary key
    (``kv_a_proj_with_mqa``, not split over heads) and ``kv_b_proj``'s per-head keys and values."""
    m, h = c.mla, c.num_heads
    if m is None:
        return _div((h + 2 * c.num_kv_heads) * c.head_dim, tensor)
    width = (m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_rope_head_dim
    return width + _div(h * m.qk_head_dim, tensor) + _div(
        h * (m.qk_nope_head_dim + m.v_head_dim), tensor)


def _gathered_width(c: ModelConfig, tensor: int) -> float:
    """Per-token width (per device) of what context parallelism gathers for a layer's attention
    over the whole sequence (``rlx.kernels.attention.context``): GQA's keys and values; MLA's
    latent and shared rotary key, and the per-head keys and values expanded from them."""
    m = c.mla
    if m is None:
        return _div(2 * c.num_kv_heads * c.head_dim, tensor)
    return m.kv_lora_rank + m.qk_rope_head_dim + _div(
        c.num_heads * (m.qk_head_dim + m.v_head_dim), tensor)


def step_features(spec: PlanSpec, trainable: int) -> dict[str, float]:
    """Feature bytes of the whole step: per-layer terms summed over the layers that keep them."""
    c = spec.model
    layers = [_layer_features(spec, i) for i in range(c.num_layers)]
    if spec.remat == "none":
        total = {k: sum(lf[k] for lf in layers) for k in layers[0]}
        total["ckpt"] = 0.0
    else:  # every layer keeps only its input; one layer at a time holds its full set
        total = dict(max(layers, key=lambda lf: sum(COEFFS[k] * v for k, v in lf.items())))
        total["ckpt"] = sum(lf["resid"] for lf in layers)
    a = 2 if spec.dtype == "bfloat16" else 4
    rows = math.ceil(spec.micro_rows / spec.batch_shards)
    tokens = rows * spec.seq_len / spec.mesh.context
    cols, tiled = vocab_columns(spec)
    total["logits"] = 4 * balanced_chunk(math.ceil(tokens), spec.logprob_chunk) * cols
    total["grads"] = trainable
    total["embed"] = a * tokens * c.hidden_size
    total["fsdp_gather"] = fsdp_gather_bytes(spec)
    p = _BYTES[spec.param_dtype]
    trained = tiled and spec.mode == "full"  # LoRA mode's embedding and head have no gradient
    total["vocab_grads"] = p * c.vocab_size * c.hidden_size / _embed_shards(spec) if trained else 0.0
    total["head_tile"] = p * cols * c.hidden_size if tiled else 0.0
    return total


def vocab_columns(spec: PlanSpec) -> tuple[float, bool]:
    """Vocabulary columns of one log-softmax tile per device, and whether the head runs in
    several tiles: ``StepConfig.vocab_block`` columns at a time (``rlx.learner.step.
    logprob_head``), or whole rows split over ``tensor`` (``for_mesh``)."""
    v, t, block = spec.model.vocab_size, spec.mesh.tensor, StepConfig().vocab_block
    if t > 1 or v <= block:
        return _div(v, t), False
    return float(block), True


def _embed_shards(spec: PlanSpec) -> int:
    """Devices an ``embed`` dimension is split over (``TRAIN_RULES``)."""
    return spec.mesh.fsdp * spec.mesh.context * spec.mesh.expert


# ``TRAIN_RULES`` as a layer's weights are used: ``embed`` dimensions (and MLA's latent ranks)
# gathered from their FSDP shards, the tensor and expert splits kept
_USED_RULES = tuple((name, "tensor" if target == "tensor" else
                     "expert" if name == "expert" else None if name != "batch" else target)
                    for name, target in TRAIN_RULES)


def fsdp_gather_bytes(spec: PlanSpec) -> float:
    """Per-device bytes FSDP gathers of the decoder layers' weights: each weight as its layer
    uses it (``embed`` dimensions whole) less the device's own shard, for every layer of an
    unrolled model (XLA keeps each gathered copy for the backward pass), one average layer's
    for scanned ones (gathered inside the loop, ``rlx.models.stack.scan``; not compared with
    XLA). The embedding and head are not gathered whole: the lookup gathers rows and the head
    runs in vocabulary tiles (``vocab_grads``, ``head_tile``)."""
    sizes, meshless = _Sizes(spec), spec.replace(mesh=MeshShape())
    total = 0
    for _, shape, dtype, axes, times, _, layer in _abstract_leaves(repr(meshless), meshless):
        if layer:
            used = _shard_elems(shape, axes, sizes, _USED_RULES)
            total += times * (used - _shard_elems(shape, axes, sizes)) * np.dtype(dtype).itemsize
    return total / spec.model.num_layers if spec.scanned else float(total)


def kv_cache_per_token(c: ModelConfig) -> int:
    """Numbers the built-in engine caches per token and layer (``rlx.models.kv_cache``), before
    tensor sharding: GQA every KV head's key and value, MLA the latent and the shared rotary key
    (DeepSeek-V3: 512 + 64 = 576; DSA adds the indexer's key: GLM-5 512 + 128 + 64 = 704)."""
    if c.mla is not None:
        return c.latent_cache_width + c.mla.qk_rope_head_dim
    return c.num_kv_heads * (c.head_dim + c.value_head_dim)


def kv_cache_bytes(spec: PlanSpec) -> int:
    """Built-in engine: every layer's cache buffers (GQA keys and values split over the tensor
    axis with their KV heads; MLA's latent cache has no head axis and is whole on every device;
    both split over ``context`` along the slots), per-slot positions / segment ids (whole along
    the slots) and the shared write index."""
    c, m = spec.model, spec.mesh
    rows = math.ceil(spec.rollout_rows / spec.batch_shards)
    slots = rows * spec.rollout_len
    per_token = (kv_cache_per_token(c) if c.mla is not None
                 else _div(c.num_kv_heads, m.tensor) * (c.head_dim + c.value_head_dim))
    layer_slots = rows * _div(spec.rollout_len, m.context)
    return int(c.num_layers * layer_slots * per_token * _BYTES[spec.kv_dtype] + 2 * slots * 4
               + 4)


def page_pool_bytes(spec: PlanSpec) -> int:
    """The continuous engine's page pools per device (``rlx.rollout.jax.paged``): every layer's
    pool of its data shard (``page_shards``: the context devices are data shards there), ``kv_pages`` pages or ``pool_pages`` for the shard's share of
    ``rollout_rows`` sequences of ``rollout_len`` tokens (as many slots as rows: an engine
    with fewer, ``config.rollout.jax.slots``, holds fewer pages); GQA keys and values split over the
    tensor axis with their KV heads, MLA's latent pages whole on every device of the shard."""
    c, m = spec.model, spec.mesh
    shards = spec.page_shards
    slots = -(-spec.rollout_rows // shards) * shards  # the engine's: a block per shard
    pages = spec.kv_pages or pool_pages(spec.rollout_rows, spec.rollout_group, spec.rollout_len,
                                        slots, shards, spec.page_size)
    per_token = (kv_cache_per_token(c) if c.mla is not None
                 else _div(c.num_kv_heads, m.tensor) * (c.head_dim + c.value_head_dim))
    return int(c.num_layers * pages * spec.page_size * per_token * _BYTES[spec.kv_dtype])


def engine_cache_bytes(spec: PlanSpec) -> int:
    """The built-in engine's KV cache per device as it batches: page pools
    (``page_pool_bytes``), or the lockstep cache (``kv_cache_bytes``)."""
    return page_pool_bytes(spec) if spec.continuous else kv_cache_bytes(spec)


def step_bytes(spec: PlanSpec, trainable: int) -> dict[str, int]:
    """Per-device transient bytes of the train step by category, and the sampler's KV cache
    (``engine_cache_bytes``)."""
    f = step_features(spec, trainable)
    part = {k: COEFFS[k] * v for k, v in f.items()}
    rows = math.ceil(spec.rows / spec.batch_shards)
    acts = sum(v for k, v in part.items() if k not in STEP_NOT_ACTIVATIONS)
    c = spec.model
    decode_logits = 4 * math.ceil(spec.rollout_rows / spec.batch_shards) * _div(
        c.vocab_size, spec.mesh.tensor)
    return {"grads": int(part["grads"]), "activations": int(acts),
            "fsdp_gather": int(part["fsdp_gather"]),
            "logprob_chunks": int(part["logits"] + part["vocab_grads"] + part["head_tile"]),
            "batch": 32 * rows * spec.seq_len,  # 8 int32/f32 fields the step reads
            "kv_cache": engine_cache_bytes(spec), "decode_temp": int(decode_logits)}
