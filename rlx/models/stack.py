"""Scanned decoder layers: runs of same-structure layers stacked on a leading ``layers`` axis.

``stack_layers(model)`` turns a ``Transformer``'s per-layer ``Block`` list into ``LayerStack``
modules, one per run of consecutive layers whose structure is the same (``layer_runs``): every
variable of the run (float, quantized, LoRA, router buffer) becomes one array with the layer
axis first, its logical axes prefixed by ``"layers"`` (no mesh axis: each device holds all the
layers of its own slices). The forward pass, the remat forward and the cached decode then run
each stack with ``jax.lax.scan`` over that axis (``scan``): XLA compiles one layer body per
stack, so the program and its compile time no longer grow with depth.

Layers whose structure differs cannot share a stack: DeepSeek-V3 / Kimi-K2 / GLM-4.5 put dense
MLPs in the first ``first_k_dense_replace`` layers and MoE after them, which gives two stacks, a
dense prefix and the MoE rest (a model with sparse layers interleaved gets one stack per run).

Stacking happens after a model is loaded, quantized and given its adapters, and
``unstack_layers`` undoes it, so every file format keeps its per-layer tensors: a checkpoint
on disk is the same with and without ``config.model.scan_layers``. The math per layer is that of
the unrolled loop; only XLA's fusion across layer boundaries differs (f32 logits and gradients
agree to rounding, ``tests/models/test_scan_layers.py``).

On one CPU device a stack is written layer by layer into host memory that XLA:CPU takes without
a copy, and 1-byte float (fp8) stacks are stored as their ``uint8`` bits (``stored_bits``): a
loop over an fp8 stack makes XLA:CPU copy or widen the whole stack ahead of the loop, while a
``uint8`` argument it slices in place; ``scan`` turns each layer back into fp8 inside the loop,
and the unrolled view (``unstack_layers``, ``per_layer_tree``) holds fp8 arrays again.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from rlx.mesh import LogicalRules, named_sharding
from rlx.platform.cpu.host_layout import aligned_empty, on_host, uint_view
from rlx.platform.policy import PlatformPolicy, current

LAYERS = "layers"  # logical name of the stacked axis (no mesh axis in any rules table)
BITS = "stored_bits"  # variable metadata: the float dtype a uint8 stack holds (``stored_bits``)


@dataclasses.dataclass(frozen=True)
class LayerGather:
    """Where ``scan`` puts each layer's weights before the layer runs: on ``mesh`` by their
    logical axes under ``rules`` (``rlx.mesh.gathered_rules``: the expert devices' FSDP shards
    gathered), so that one layer's gathered copy exists at a time, inside the loop."""

    mesh: Mesh
    rules: LogicalRules

    def place(self, var: nnx.Variable, value):
        """``value`` (one layer of the stacked ``var``) constrained to its gathered sharding."""
        axes = var.get_metadata().get("logical_axes")
        if axes is None or len(axes) != value.ndim + 1:
            return value
        sharding = named_sharding(self.mesh, tuple(axes)[1:], self.rules, value.shape)
        return jax.lax.with_sharding_constraint(value, sharding)


class LayerStack(nnx.Module):
    """``count`` decoder layers from layer ``first`` on, as one ``block`` whose variables carry
    the layer axis first; ``gather`` (a ``LayerGather``, set by ``rlx.models.moe.expert_parallel``
    on a mesh whose expert devices hold FSDP shards) places each layer's weights inside the scan."""

    def __init__(self, block: nnx.Module, first: int, count: int):
        self.block, self.first, self.count = block, first, count
        self.gather: LayerGather | None = None


def layer_runs(kinds: list) -> tuple[tuple[int, int], ...]:
    """(first layer, count) of each run of consecutive equal entries of ``kinds``."""
    runs: list[list[int]] = []
    for i, kind in enumerate(kinds):
        if runs and kinds[runs[-1][0]] == kind:
            runs[-1][1] += 1
        else:
            runs.append([i, 1])
    return tuple((first, count) for first, count in runs)


def is_stacked(model: nnx.Module) -> bool:
    return getattr(model, "stacks", None) is not None


def _stack_values(values: list, consume: frozenset = frozenset()) -> jax.Array:
    """``jnp.stack(values)`` placed like its inputs with the new axis whole. Concrete arrays are
    written into the stacked buffer one at a time, and those whose ``id`` is in ``consume`` are
    deleted once written, so a loaded model's weights exist about once while they are stacked,
    not twice."""
    first = values[0]
    sharding = getattr(first, "sharding", None)
    out = None
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = jax.sharding.PartitionSpec(None, *sharding.spec)
        out = jax.sharding.NamedSharding(sharding.mesh, spec)
    if not all(isinstance(v, jax.Array) and not isinstance(v, jax.core.Tracer) for v in values):
        if out is not None:
            return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=out)(*values)
        return jnp.stack(values)
    out = out or sharding
    if (len(first.sharding.device_set) == 1 and on_host(first.sharding)
            and all(v.dtype == first.dtype for v in values)):
        return _stack_on_host(values, consume)
    buf = jax.jit(lambda: jnp.zeros((len(values), *first.shape), first.dtype), out_shardings=out)()
    for i, v in enumerate(values):
        buf = _put_layer(buf, v, i)
        if id(v) in consume:
            v.delete()
    return buf


def _stack_on_host(values: list[jax.Array], consume: frozenset) -> jax.Array:
    """``_stack_values`` for arrays on one CPU device: the stack is host memory whose pages exist
    only once written (``aligned_empty``), each layer copied in as bits and deleted once copied
    where consumed, then taken by the device without a copy. A whole zero-filled stack first
    would cost the largest variable's stacked bytes on top of the model while stacking."""
    first = values[0]
    host = aligned_empty((len(values), *first.shape), first.dtype)
    bits = uint_view(host)
    for i, v in enumerate(values):
        bits[i] = uint_view(np.asarray(v))
        if id(v) in consume:
            v.delete()
    return jax.device_put(bits if _byte_float(first.dtype) else host, first.sharding)


def _byte_float(dtype) -> bool:
    """Whether ``dtype`` is a 1-byte float (fp8), which XLA:CPU widens ahead of a loop."""
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 1


def stored_bits(var: nnx.Variable):
    """The float dtype a stacked variable's ``uint8`` value holds the bits of, or None: on
    XLA:CPU 1-byte float stacks are stored as their bits (``BITS``), and read as floats one
    layer at a time inside ``scan``'s loop, since XLA:CPU copies or widens a whole 1-byte float
    stack that a loop takes (even when the program bitcasts it first); an argument that already
    is ``uint8`` it reads in place."""
    name = var.get_metadata().get(BITS)
    return None if name is None else jnp.dtype(name)


def _as_stored(value, bits) -> jax.Array:
    """``value`` (a stored layer or slice) in its float dtype ``bits`` (None: as it is)."""
    if bits is None:
        return value
    if isinstance(value, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(value.shape, bits, sharding=value.sharding)
    return jax.lax.bitcast_convert_type(value, bits)


@jax.jit(donate_argnums=0)
def _put_layer(buf: jax.Array, value: jax.Array, i) -> jax.Array:
    """``buf`` with ``value`` as its layer ``i`` (``buf`` donated: written in place)."""
    return jax.lax.dynamic_update_index_in_dim(buf, value.astype(buf.dtype), i, 0)


def _with_axes(var: nnx.Variable, value, lead: bool, bits=None) -> nnx.Variable:
    """``var`` holding ``value``, its logical axes with the layer axis added (``lead``) or
    removed; ``bits``: the float dtype whose bits ``value`` stores (``stored_bits``; a layer
    taken out of a stack holds its floats again)."""
    had = var.get_metadata()
    meta = {BITS: jnp.dtype(bits).name} if bits is not None else (
        {BITS: None} if had.get(BITS) is not None else {})
    axes = had.get("logical_axes")
    if axes is not None:
        meta["logical_axes"] = (LAYERS,) + tuple(axes) if lead else tuple(axes)[1:]
    return var.replace(value, **meta)


def stack_blocks(blocks: list[nnx.Module], consume: bool = False) -> nnx.Module:
    """One block of ``blocks``' common structure whose variables stack theirs on a leading axis.
    ``consume``: the blocks' arrays are owned by them alone (a freshly loaded model), and each one
    held by a single variable is deleted once copied into its stack."""
    splits = [nnx.split(b) for b in blocks]
    graphdef = splits[0][0]
    if any(g != graphdef for g, _ in splits[1:]):
        raise ValueError("cannot stack layers of different structure")
    flats = [nnx.to_flat_state(s) for _, s in splits]
    for path, var in flats[0]:
        if isinstance(var, nnx.RngState):
            raise ValueError(
                f"cannot scan layers holding random state ({'/'.join(map(str, path))}: LoRA "
                "dropout); set config.lora.dropout=0 or config.model.scan_layers=False")
    owned = frozenset()
    if consume:
        held = collections.Counter(id(v[...]) for flat in flats for _, v in flat)
        owned = frozenset(k for k, n in held.items() if n == 1)
    out = []
    for i, (path, var) in enumerate(flats[0]):
        dtype = getattr(var[...], "dtype", None)
        value = _stack_values([flat[i][1][...] for flat in flats], owned)
        bits = dtype if dtype is not None and value.dtype != dtype else None
        out.append((path, _with_axes(var, value, lead=True, bits=bits)))
    return nnx.merge(graphdef, nnx.from_flat_state(out))


def _layer(value, i: int):
    """Layer ``i`` of a stacked value (of an abstract one, its shape)."""
    if isinstance(value, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(value.shape[1:], value.dtype)
    return value[i]


def unstack_block(block: nnx.Module, count: int) -> list[nnx.Module]:
    """The ``count`` per-layer blocks of a stacked ``block`` (copies of their slices)."""
    graphdef, state = nnx.split(block)
    flat = nnx.to_flat_state(state)
    return [nnx.merge(graphdef, nnx.from_flat_state(
        [(p, _with_axes(v, _as_stored(_layer(v.get_value(), i), stored_bits(v)), lead=False))
         for p, v in flat]))
        for i in range(count)]


def stack_layers(model: nnx.Module, consume: bool = False) -> nnx.Module:
    """``model`` (a ``Transformer``) with its ``layers`` replaced, in place, by ``stacks``:
    one ``LayerStack`` per run of same-structure layers. ``consume``: nothing else holds the
    layers' arrays (``stack_blocks``), so they are freed while stacking. Returns ``model``."""
    if is_stacked(model):
        return model
    layers = list(model.layers)
    kinds = [nnx.split(b)[0] for b in layers]
    stacks = [LayerStack(stack_blocks(layers[f:f + n], consume), f, n)
              for f, n in layer_runs(kinds)]
    del model.layers
    model.stacks = nnx.List(stacks)
    return model


def unstack_layers(model: nnx.Module) -> nnx.Module:
    """The inverse of ``stack_layers``, in place: per-layer ``layers`` again. Returns ``model``."""
    if not is_stacked(model):
        return model
    blocks = [b for s in model.stacks for b in unstack_block(s.block, s.count)]
    del model.stacks
    model.layers = nnx.List(blocks)
    return model


def unrolled(model: nnx.Module, only=...) -> nnx.Module:
    """``model`` itself when its layers are not stacked, else an unstacked copy: the file
    writers' view, with per-layer paths ``layers/{i}/...``. The copy holds the variables the
    filter ``only`` selects (by default all; they cost their memory once more) and leaves the
    others abstract (``jax.ShapeDtypeStruct``: shapes only, e.g. the base beside the adapters a
    PEFT export writes)."""
    if not is_stacked(model):
        return model
    graphdef, kept, rest = nnx.split(model, only, ...)
    rest = nnx.from_flat_state([(p, v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype)))
                                for p, v in nnx.to_flat_state(rest)])
    return unstack_layers(nnx.merge(graphdef, kept, rest))


def scan(stack: LayerStack, carry, xs, fn: Callable, policy=None, remat: bool = False):
    """``jax.lax.scan`` of ``fn(block, carry, x) -> (carry, y)`` over the layers of ``stack``:
    ``block`` is one layer (its variables sliced, their logical axes those of an unstacked
    layer), ``x`` that layer's slice of ``xs``; with ``stack.gather`` each layer's weights are
    gathered inside the loop body (under remat: again in the backward pass). ``remat``: each
    layer is a ``jax.checkpoint`` (with checkpoint ``policy``), as
    ``rlx.learner.step.remat_forward`` does unrolled."""
    graphdef, state = nnx.split(stack.block)
    flat = nnx.to_flat_state(state)
    values = [v[...] for _, v in flat]
    dtypes = [stored_bits(v) or getattr(x, "dtype", None) for (_, v), x in zip(flat, values)]
    values = [x if stored_bits(v) is not None else _as_bits(x) for (_, v), x in zip(flat, values)]
    gather = getattr(stack, "gather", None)

    def body(carry, inputs):
        layer_values, x = inputs
        layer_values = [_as_stored(v, None if d == v.dtype else d)
                        for v, d in zip(layer_values, dtypes)]
        if gather is not None:
            layer_values = [gather.place(v, value) for (_, v), value in zip(flat, layer_values)]
        layer = nnx.from_flat_state([(p, _with_axes(v, value, lead=False))
                                     for (p, v), value in zip(flat, layer_values)])
        return fn(nnx.merge(graphdef, layer), carry, x)

    if remat:
        body = jax.checkpoint(body, policy=policy)
    return jax.lax.scan(body, carry, (values, xs))


def _as_bits(value):
    """A stacked 1-byte float array not stored as its bits (a stack sharded over several
    devices) as its ``uint8`` bits where the platform's policy says so (``byte_floats_as_bits``:
    XLA:CPU), bitcast in the program: XLA:CPU then copies the stack's bytes once ahead of the
    loop instead of widening every layer to a wider float. Elsewhere, and for other types,
    ``value`` itself."""
    dtype = getattr(value, "dtype", None)
    if dtype is None or not _byte_float(dtype) or not current().byte_floats_as_bits:
        return value
    return jax.lax.bitcast_convert_type(value, jnp.uint8)


class LayerSlice:
    """Layer ``index`` of a stacked array, read when asked (``value``): a leaf of a lazy
    ``per_layer_tree`` (``take=LayerSlice``), e.g. for hashing a base one layer at a time."""

    def __init__(self, array, index: int, bits=None):
        self.array, self.index, self.bits = array, index, bits

    def value(self):
        return _as_stored(self.array[self.index], self.bits)


def per_layer_tree(tree, take: Callable = lambda x, i: x[i]):
    """``tree`` (params, an optimizer state: any pytree of ``nnx.State``, dicts, tuples) with each
    stacked ``stacks`` entry replaced by the unrolled model's ``layers`` entries, layer ``i``
    ``take(stacked, i)`` (the slice; ``LayerSlice``: a lazy one): the paths and shapes a
    checkpoint of the unrolled model holds. A tree without stacked layers is returned as is."""
    if not _has_stacks(tree):
        return tree
    out = _per_layer(tree, take)
    left = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(out)
            if "'stacks'" in jax.tree_util.keystr(p)]
    if left:
        raise TypeError(f"per_layer_tree cannot reach the stacked layers at {left[0]} (inside a "
                        "container it does not know); add the container to rlx.models.stack")
    return out


def _has_stacks(tree) -> bool:
    return any("'stacks'" in jax.tree_util.keystr(p)
               for p, _ in jax.tree_util.tree_leaves_with_path(tree))


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _take_layer(x, i: int, take):
    """``take(x, i)`` for a stacked leaf or variable; a variable stored as bits gives its floats
    (``stored_bits``)."""
    if not _is_var(x):
        return take(x, i)
    bits, got = stored_bits(x), take(x.get_value(), i)
    if bits is not None:
        got = LayerSlice(got.array, got.index, bits) if isinstance(got, LayerSlice) else (
            _as_stored(got, bits))
    return x.replace(got) if bits is None else x.replace(got, **{BITS: None})


def _per_layer(tree, take):
    if isinstance(tree, (nnx.State, dict)):
        items = {k: _per_layer(v, take) for k, v in tree.items() if k != "stacks"}
        if "stacks" in tree:
            stacks = [tree["stacks"][k]["block"] for k in sorted(tree["stacks"].keys())]
            layers = [jax.tree.map(lambda x, i=i: _take_layer(x, i, take), s, is_leaf=_is_var)
                      for s in stacks for i in range(jax.tree.leaves(s)[0].shape[0])]
            items["layers"] = type(tree)({i: _per_layer(b, take) for i, b in enumerate(layers)})
        return type(tree)(items)
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_per_layer(t, take) for t in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(_per_layer(t, take) for t in tree)
    return tree


def stacked_tree(tree, like):
    """The inverse of ``per_layer_tree``: ``tree`` (per-layer) in the structure of ``like`` (the
    stacked tree it came from, its very pytree types), each stack's layers stacked again on
    ``like``'s shardings."""
    if not _has_stacks(like):
        return tree
    flat, paths = _by_path(tree), jax.tree_util.tree_flatten_with_path(like)
    counts: dict[str, dict[int, int]] = {}  # path prefix -> stack -> layers
    for p, x in paths[0]:
        pre, k, _ = _stack_path(jax.tree_util.keystr(p))
        if pre is not None:
            counts.setdefault(pre, {})[k] = x.shape[0]
    leaves = []
    for p, x in paths[0]:
        pre, k, tail = _stack_path(jax.tree_util.keystr(p))
        if pre is None:
            leaves.append(flat[jax.tree_util.keystr(p)])
            continue
        first = sum(n for j, n in counts[pre].items() if j < k)
        layers = [flat[f"{pre}['layers'][{first + i}]{tail}"] for i in range(x.shape[0])]
        leaves.append(jax.device_put(jnp.stack(layers), getattr(x, "sharding", None)))
    return jax.tree.unflatten(paths[1], leaves)


def _stack_path(path: str):
    """(prefix, stack, rest) of a leaf path inside ``stacks``; (None, None, None) elsewhere."""
    match = re.fullmatch(r"(.*)\['stacks'\]\[(\d+)\]\['block'\](.*)", path)
    return (match.group(1), int(match.group(2)), match.group(3)) if match else (None, None, None)


def _by_path(tree) -> dict:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def layer_counts(model: nnx.Module) -> tuple[int, ...] | None:
    """Layers per stack of a stacked model, None for an unrolled one (``KVCache.zeros``)."""
    return tuple(s.count for s in model.stacks) if is_stacked(model) else None


def decode_model(model: nnx.Module) -> nnx.Module:
    """The model a decode program runs: ``model``, or with ``unroll_decode`` its stacks as
    per-layer blocks, sliced inside the program once, ahead of its token loop (in place)."""
    return unstack_layers(model) if getattr(model, "unroll_decode", False) else model


def cache_stacks(model: nnx.Module) -> tuple[int, ...] | None:
    """The ``stacks`` of the cache that ``decode_model(model)`` decodes with (``KVCache.zeros``):
    its layers per stack when it scans them, None (one buffer per layer) for an unrolled model
    or a stacked one whose decode unstacks it (``Transformer.unroll_decode``)."""
    return None if getattr(model, "unroll_decode", False) else layer_counts(model)


def scan_default(num_layers: int, params: int = 0, policy: PlatformPolicy | None = None,
                 recompute: bool = False) -> bool:
    """Whether ``config.model.scan_layers="auto"`` scans the layers of a model of ``num_layers``
    layers and ``params`` parameters trained under the platform's ``policy`` (None: the plain
    one): from ``SCAN_FROM_LAYERS`` layers on, where the unrolled program's size starts to
    dominate compile time. Except where the policy unrolls large models
    (``unroll_train_from_params``), for a model of that many parameters or more whose train step
    keeps its activations (no ``recompute``, ``train.remat='none'``): there the unrolled step runs
    faster by more than its longer compile costs once."""
    unroll_from = policy.unroll_train_from_params if policy is not None else None
    if unroll_from is not None and params >= unroll_from and not recompute:
        return False
    return num_layers >= SCAN_FROM_LAYERS


SCAN_FROM_LAYERS = 16

__all__ = ["LAYERS", "LayerGather", "LayerStack", "layer_runs", "is_stacked", "stack_blocks",
           "unstack_block", "stack_layers", "unstack_layers", "unrolled", "scan", "decode_model",
           "layer_counts", "cache_stacks", "LayerSlice", "per_layer_tree", "stacked_tree",
           "scan_default", "SCAN_FROM_LAYERS"]
