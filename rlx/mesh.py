"""Device mesh and logical-axis rules.

One mesh with five named axes, ``(data, fsdp, context, tensor, expert)``. Parameters and activations
carry *logical* axis names (``embed``, ``mlp``, ``heads``, ...); a rules table maps each logical
name to mesh axes. Training and sampling use different tables: training shards weights over ``fsdp``
(ZeRO-3 style, gathered per layer by XLA; the ``expert`` devices hold such shards too, gathered per
layer by the scan, ``gathered_rules``), sampling keeps weights whole along ``fsdp`` and only splits
them over ``tensor``/``expert`` so that a decode step needs no weight all-gather (the built-in
engine's own copies; the learner's frozen base, which it reads as placed, is gathered layer by
layer).

The mesh is always passed explicitly; nothing here reads a global mesh. Axes are created as
``AxisType.Auto`` on purpose: GSPMD propagates shardings from the parameters and the batch, which is
what the model code (plain ``jnp`` ops, no ``out_sharding=`` arguments) expects.

``context`` splits each sequence's tokens (logical ``seq``) for context parallelism
(``rlx.kernels.attention.context``); in training its devices also hold FSDP shards of the
weights and optimizer state, as the ``fsdp`` devices do, so that context parallelism costs no
extra copy of the model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from rlx.errors import ConfigError

MESH_AXES = ("data", "fsdp", "context", "tensor", "expert")

LogicalRules = tuple[tuple[str, tuple[str, ...] | str | None], ...]

# logical name -> mesh axes. Order of the table matters only for readability. Training stores
# every weight's ``embed`` dimension (and MLA's latent ranks) split over ``fsdp``, ``context`` and
# ``expert``; tokens are split over the batch axes (rows) and ``context`` (``seq``, each row's
# tokens):
# the expert devices hold FSDP shards of the attention, dense and shared-expert weights, which
# scanned layers gather one layer at a time (``gathered_rules``, ``rlx.models.stack.scan``). A
# weight whose ``expert`` dimension comes first (routed experts) keeps that axis for its experts.
TRAIN_RULES: LogicalRules = (
    ("batch", ("data", "fsdp", "expert")),
    ("seq", "context"),
    ("vocab", "tensor"),
    ("embed", ("fsdp", "context", "expert")),
    ("q_lora", ("fsdp", "context", "expert")),
    ("kv_lora", ("fsdp", "context", "expert")),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("expert", "expert"),
    ("expert_mlp", "tensor"),
    ("norm", None),
    ("lora_rank", None),
)

SAMPLE_RULES: LogicalRules = (
    ("batch", ("data", "fsdp", "expert")),
    ("seq", "context"),
    ("vocab", "tensor"),
    ("embed", None),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("expert", "expert"),
    ("expert_mlp", "tensor"),
    ("norm", None),
    ("lora_rank", None),
)


def fsdp_as_tensor(rules: LogicalRules) -> LogicalRules:
    """``rules`` with the ``fsdp`` devices splitting what ``tensor`` splits (attention heads, MLP
    features, the vocabulary, experts' features) rather than holding rows of their own: the
    sampling layout of a full-parameter run whose engine copies the weights (an asynchronous
    run's), which are then split over the fsdp devices like the learner's state, not whole on
    each (``sampling_rules``)."""
    def one(name, target):
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        if name == "batch":
            axes = tuple(a for a in axes if a != "fsdp")
        elif "tensor" in axes and "fsdp" not in axes:
            axes = axes + ("fsdp",)
        return None if not axes else axes[0] if len(axes) == 1 else axes

    return tuple((name, one(name, target)) for name, target in rules)


def sampling_rules(mode: str, copies: bool) -> LogicalRules:
    """The built-in engine's rules in a run of training ``mode`` whose engine ``copies`` the
    trainable variables (an asynchronous run's: the learner donates them at each update).

    ``SAMPLE_RULES`` (rows split over ``fsdp``, weights whole along it) where the engine reads
    the learner's arrays as placed: the frozen base, a synchronous run's trainables (gathered a
    layer at a time by the programs, each device decoding its rows with its own KV cache), and
    where its copy is small (LoRA mode's adapters). A full-mode engine that copies every
    parameter takes ``fsdp_as_tensor``: whole along ``fsdp`` that copy would be the model on
    every device; split like the learner's state, the fsdp devices decode the rows together
    (and hold their KV cache split over KV heads where those divide, else whole)."""
    return fsdp_as_tensor(SAMPLE_RULES) if mode == "full" and copies else SAMPLE_RULES


def context_as_rows(rules: LogicalRules) -> LogicalRules:
    """``rules`` with the ``context`` axis holding rows rather than each row's tokens: the
    continuous engine's layout on a context-parallel mesh, where each sequence's pages stay on
    one device and the context devices are more data shards."""
    def one(name, target):
        if name == "seq":
            return None
        if name == "batch":
            axes = (target,) if isinstance(target, str) else tuple(target or ())
            return axes + ("context",) if "context" not in axes else axes
        return target

    return tuple((name, one(name, target)) for name, target in rules)


def gathered_rules(rules: LogicalRules) -> LogicalRules:
    """``rules`` as a layer's weights are used: the ``expert`` mesh axis holds only experts and
    tokens (``expert``, ``batch``); its FSDP shards of every other dimension are gathered."""
    def drop(target):
        names = (target,) if isinstance(target, str) else tuple(target or ())
        kept = tuple(a for a in names if a != "expert")
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return tuple((name, target if name in ("expert", "batch") else drop(target))
                 for name, target in rules)


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Sizes of the five mesh axes (``config.mesh``); their product must equal the device count."""

    data: int = 1  # data-parallel replicas
    fsdp: int = 1  # parameter/optimizer sharding (ZeRO-3)
    context: int = 1  # context parallelism: each sequence's tokens split over these devices
    tensor: int = 1  # tensor parallelism over heads / mlp / vocab
    expert: int = 1  # expert parallelism for MoE layers

    def validate(self) -> None:
        for name, size in zip(MESH_AXES, self.sizes):
            if size < 1:
                raise ConfigError(f"config.mesh.{name}={size} must be >= 1")

    def check_devices(self, n_devices: int) -> None:
        if self.num_devices != n_devices:
            raise ConfigError(
                f"config.mesh data*fsdp*context*tensor*expert = {'*'.join(map(str, self.sizes))} = "
                f"{self.num_devices}, but {n_devices} devices are visible; choose sizes whose "
                f"product is {n_devices}")

    @property
    def sizes(self) -> tuple[int, int, int, int, int]:
        return (self.data, self.fsdp, self.context, self.tensor, self.expert)

    @property
    def num_devices(self) -> int:
        return math.prod(self.sizes)


def make_mesh(shape: MeshShape, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build a ``Mesh`` over ``MESH_AXES`` with Auto axis types.

    Raises ``ValueError`` naming the sizes when their product does not match the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    if shape.num_devices != len(devices):
        raise ValueError(
            f"mesh data*fsdp*context*tensor*expert = {'*'.join(map(str, shape.sizes))} = "
            f"{shape.num_devices}"
            f" but {len(devices)} devices are available; set config.mesh sizes whose product is "
            f"{len(devices)}"
        )
    if any(s < 1 for s in shape.sizes):
        raise ValueError(f"mesh sizes must be >= 1, got {shape}")
    grid = _device_grid(shape, devices)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _device_grid(shape: MeshShape, devices: list[jax.Device]) -> np.ndarray:
    try:  # topology-aware placement where the platform offers it
        from jax.experimental import mesh_utils

        return mesh_utils.create_device_mesh(shape.sizes, devices=devices)
    except Exception:  # noqa: BLE001 - fall back to plain order (CPU, odd shapes)
        return np.asarray(devices, dtype=object).reshape(shape.sizes)


def logical_to_spec(
    axes: Sequence[str | None] | None, rules: LogicalRules, mesh: Mesh | None = None
) -> PartitionSpec:
    """Map logical axis names to a ``PartitionSpec``.

    A mesh axis is used at most once per spec (later dims that would reuse it stay replicated), and
    when ``mesh`` is given, mesh axes of size 1 are dropped so specs stay readable.
    """
    if axes is None:
        return PartitionSpec()
    table: Mapping[str, tuple[str, ...] | str | None] = dict(rules)
    used: set[str] = set()
    out: list[tuple[str, ...] | str | None] = []
    for name in axes:
        target = table.get(name) if name is not None else None
        mesh_axes = (target,) if isinstance(target, str) else tuple(target or ())
        keep = tuple(
            a for a in mesh_axes if a not in used and (mesh is None or mesh.shape[a] > 1)
        )
        used.update(keep)
        out.append(None if not keep else keep[0] if len(keep) == 1 else keep)
    return PartitionSpec(*out)


def named_sharding(
    mesh: Mesh, axes: Sequence[str | None] | None, rules: LogicalRules, shape: Sequence[int] = ()
) -> NamedSharding:
    """``NamedSharding`` for an array with logical ``axes``; dims that do not divide stay whole."""
    spec = logical_to_spec(axes, rules, mesh)
    if shape:
        spec = _drop_indivisible(spec, shape, mesh)
    return NamedSharding(mesh, spec)


def _drop_indivisible(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    parts = []
    for dim, part in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = (part,) if isinstance(part, str) else tuple(part or ())
        size = math.prod(mesh.shape[n] for n in names)
        parts.append(part if dim % size == 0 else None)
    return PartitionSpec(*parts)


def batch_axes(rules: LogicalRules = TRAIN_RULES) -> tuple[str, ...]:
    """The mesh axes the logical ``batch`` axis is split over under ``rules``."""
    spec = logical_to_spec(("batch",), rules)[0]
    return (spec,) if isinstance(spec, str) else tuple(spec or ())


def batch_shards(mesh: Mesh | MeshShape, rules: LogicalRules = TRAIN_RULES) -> int:
    """Devices the rows of a batch are split over: the product of the ``batch_axes`` sizes (the
    rows of a batch must be a multiple of it)."""
    sizes = dict(mesh.shape) if isinstance(mesh, Mesh) else dict(zip(MESH_AXES, mesh.sizes))
    return math.prod(sizes[a] for a in batch_axes(rules))


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-n // multiple) * multiple


def batch_sharding(mesh: Mesh, ndim: int, rules: LogicalRules = TRAIN_RULES) -> NamedSharding:
    """Sharding for a batch-major array: first dim over the batch axes, the rest replicated."""
    return named_sharding(mesh, ("batch",) + (None,) * (ndim - 1), rules)


def shard_variables(model: nnx.Module, kind, mesh: Mesh, rules: LogicalRules) -> None:
    """Place every ``kind`` variable of ``model`` by its logical axes on ``mesh`` (in place)."""
    for _, var in nnx.iter_graph(model):
        if isinstance(var, kind):
            axes = var.get_metadata().get("logical_axes")
            var.set_value(jax.device_put(var[...], named_sharding(mesh, axes, rules, var.shape)))


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def variable_shardings(tree, mesh: Mesh, rules: LogicalRules = TRAIN_RULES):
    """A sharding per variable of an nnx State: from its `logical_axes`, else replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())

    def one(v):
        if not _is_variable(v):
            return replicated
        axes = v.get_metadata().get("logical_axes")
        shape = jax.tree.leaves(v)[0].shape
        if axes is None or len(axes) != len(shape):
            return replicated
        return named_sharding(mesh, axes, rules, shape)

    return jax.tree.map(one, tree, is_leaf=_is_variable)


def host_values(tree):
    """Numpy values of a pytree of device arrays on this process. An array spanning several
    processes' devices (a mesh across processes) is all-gathered first: a collective, so every
    process makes the call with the same tree."""
    from jax.experimental import multihost_utils

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree.map(one, tree)
