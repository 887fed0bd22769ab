"""What a checkpoint holds and whether the current run may restore it.

A ``Fingerprint`` is written with every checkpoint (``rlx.io.checkpoint``): every saved leaf's path,
shape and dtype, the model's hyper-parameters, a ``BaseRef`` to the frozen base (its source, format
and a SHA-256 of its leaves; the base itself is never saved) and the PRNG implementation.
``check_compatible`` compares a checkpoint's fingerprint and config with the current run's before
any array is read and names every difference that forbids the restore. ``checksums`` are a 64-bit
digest per saved array, computed on device and equal on every sharding, which a restore compares
(a flipped byte in an array file otherwise loads silently).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlx.models.stack import LayerSlice, per_layer_tree

# config fields that change no saved array: a run resumes a checkpoint whatever their values
NOT_SAVED = ("scan_layers",)  # config.model.scan_layers: files are per layer either way


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message says which and why."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint belongs to another model, base or config than the current run."""


@dataclasses.dataclass(frozen=True)
class BaseRef:
    """A reference to the frozen base a checkpoint was trained on (the base itself is not saved)."""

    source: str  # where it was loaded from (path of the GGUF file / safetensors folder)
    format: str  # e.g. "gguf", "hf", "int8"
    sha256: str  # hash of every frozen leaf: path, dtype, shape and bytes, in tree order
    num_leaves: int
    num_bytes: int


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """What a checkpoint holds, compared with the current run before anything is restored."""

    version: int
    leaves: dict[str, tuple[tuple[int, ...], str]]  # saved leaf path -> (shape, dtype)
    model: dict[str, Any]  # model hyper-parameters (ModelConfig as a dict); {} if not given
    base: BaseRef | None  # frozen part of the state; None when there is none
    rng_impl: str  # PRNG implementation of the saved key

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["leaves"] = {k: [list(s), d] for k, (s, d) in self.leaves.items()}
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Fingerprint":
        base = d.get("base")
        return cls(version=d["version"],
                   leaves={k: (tuple(s), dt) for k, (s, dt) in d["leaves"].items()},
                   model=d.get("model") or {}, base=None if base is None else BaseRef(**base),
                   rng_impl=d["rng_impl"])


def _key_name(k) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def leaf_paths(tree) -> list[tuple[str, Any]]:
    """(path, leaf) per leaf of a pytree; paths like ``params/layers/0/mlp/up_proj/kernel``."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = [_key_name(k) for k in path]
        if names and names[-1] == "value":  # the nnx.Variable wrapper
            names = names[:-1]
        out.append(("/".join(names), leaf))
    return out


def _host_array(x) -> np.ndarray:
    if isinstance(x, LayerSlice):
        x = x.value()
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def base_reference(frozen, *, source: str = "", format: str = "") -> BaseRef | None:
    """Hash the frozen part of a state (one leaf on the host at a time; a scanned model's stacked
    leaves one layer at a time, under the unrolled model's paths); None when it is empty."""
    leaves = leaf_paths(per_layer_tree(frozen, take=LayerSlice))
    if not leaves:
        return None
    h, total = hashlib.sha256(), 0
    for path, leaf in leaves:
        a = np.ascontiguousarray(_host_array(leaf))
        h.update(f"{path}|{a.dtype}|{a.shape}|".encode())
        h.update(a.tobytes())
        total += a.nbytes
    return BaseRef(source=source, format=format, sha256=h.hexdigest(), num_leaves=len(leaves),
                   num_bytes=total)


def _leaf_words(x: jax.Array) -> jax.Array:
    """The bits of `x` as a flat uint32 vector (narrower types zero-extended)."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    elif jnp.issubdtype(x.dtype, jnp.integer) and jnp.iinfo(x.dtype).bits < 8:
        x = x.astype(jnp.int32)  # int4 / uint4: exact as int32
    elif jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 8:
        x = x.astype(jnp.float32)  # 4-bit floats: exact as float32
    width = {1: jnp.uint8, 2: jnp.uint16}.get(x.dtype.itemsize, jnp.uint32)
    return jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32).reshape(-1)


@jax.jit
def _checksums(tree):
    """Two position-weighted uint32 sums per leaf; exact, so equal on every sharding.

    Each word is multiplied by an odd weight, so flipping any bit changes the sum mod 2**32.
    """
    def one(x):
        w = _leaf_words(x)
        i = jnp.arange(w.shape[0], dtype=jnp.uint32)
        odd_a, odd_b = 2 * i + 1, (i * jnp.uint32(0x9E3779B1)) | jnp.uint32(1)
        return jnp.stack([jnp.sum(w * odd_a, dtype=jnp.uint32),
                          jnp.sum(w * odd_b, dtype=jnp.uint32)])
    return jax.tree.map(one, tree)


def checksums(tree) -> dict[str, str]:
    """A 64-bit hex digest per leaf path of a pytree of arrays, computed on device."""
    sums = jax.device_get(_checksums(tree))
    return {p: f"{int(v[0]):08x}{int(v[1]):08x}" for p, v in leaf_paths(sums)}


def leaf_map(tree) -> dict[str, tuple[tuple[int, ...], str]]:
    return {p: (tuple(x.shape), str(x.dtype)) for p, x in leaf_paths(tree)}


def _diff_leaves(saved: Mapping, current: Mapping) -> list[str]:
    out = []
    for path in sorted(set(saved) | set(current), key=lambda p: (not p.startswith("params/"), p)):
        if path not in current:
            out.append(f"{path}: in the checkpoint {saved[path]}, absent from the current state")
        elif path not in saved:
            out.append(f"{path}: in the current state {current[path]}, absent from the checkpoint")
        elif tuple(saved[path][0]) != tuple(current[path][0]) or saved[path][1] != current[path][1]:
            (s0, d0), (s1, d1) = saved[path], current[path]
            out.append(f"{path}: checkpoint shape {tuple(s0)} {d0}, current {tuple(s1)} {d1}")
    return out


def _diff_dicts(saved: Any, current: Any, prefix: str) -> list[str]:
    if isinstance(saved, Mapping) and isinstance(current, Mapping):
        out = []
        for k in sorted((set(saved) | set(current)) - set(NOT_SAVED), key=str):
            out += _diff_dicts(saved.get(k, "<absent>"), current.get(k, "<absent>"),
                               f"{prefix}.{k}")
        return out
    norm = lambda v: list(v) if isinstance(v, tuple) else v  # JSON turns tuples into lists
    if norm(saved) == norm(current):
        return []
    return [f"{prefix}: checkpoint {saved!r}, current {current!r}"]


def _base_diff(saved: BaseRef | None, current: BaseRef | None) -> list[str]:
    if saved is None and current is None:
        return []
    if saved is None or current is None:
        which = "the checkpoint" if current is None else "the current run"
        return [f"frozen base: only {which} has one"]
    if saved.sha256 == current.sha256:
        return []
    return [f"frozen base hash: checkpoint {saved.sha256[:16]}... ({saved.format} from "
            f"{saved.source or '?'}, {saved.num_leaves} leaves, {saved.num_bytes} bytes), current "
            f"{current.sha256[:16]}... ({current.format} from {current.source or '?'}, "
            f"{current.num_leaves} leaves, {current.num_bytes} bytes)"]


def check_compatible(saved: Fingerprint, current: Fingerprint, saved_config: Mapping,
                     config: Mapping, must_match: Sequence[str], where: str) -> None:
    """Raise ``CheckpointMismatchError`` listing every difference that forbids a restore."""
    if saved.version != current.version:
        raise CheckpointMismatchError(f"checkpoint {where} has layout version {saved.version}; "
                                      f"this rlx reads version {current.version}")
    diffs = []
    if saved.model and current.model:
        diffs += _diff_dicts(saved.model, current.model, "model")
    diffs += _base_diff(saved.base, current.base)
    diffs += _diff_leaves(saved.leaves, current.leaves)
    for section in must_match:
        diffs += _diff_dicts(saved_config.get(section, "<absent>"), config.get(section, "<absent>"),
                             f"config.{section}")
    if saved.rng_impl != current.rng_impl:
        diffs.append(f"rng impl: checkpoint {saved.rng_impl}, current {current.rng_impl}")
    if diffs:
        shown = "\n  ".join(diffs[:20]) + ("\n  ..." if len(diffs) > 20 else "")
        raise CheckpointMismatchError(
            f"checkpoint {where} was written by another model or config ({len(diffs)} "
            f"difference(s)):\n  {shown}")


def config_changes(saved: Mapping, current: Mapping) -> list[str]:
    return _diff_dicts(dict(saved), dict(current), "config") if saved and current else []
