"""Checking and reading a shipped checkpoint's quantized linears (a ``Layout`` of
``rlx.quant.formats.layouts``), as the file stores them: the tensors its ``Tensors`` declares.

Each quantized linear becomes a ``QTensor`` whose leaves hold the file's values bit for bit, in
rlx's storage orientation (``[in, out]``; int4 nibbles re-paired along ``in``, which changes no
value): ``w = (q - zero) * scale`` per block, exactly the formula of the format. A linear the
config quantizes but the file holds otherwise, a missing or misshapen scale, or a ``weight_shape``
that disagrees with ``config.json`` is refused (``check_quantized``) naming the file and the
tensor, after reading only headers (and the 16-byte ``weight_shape`` tensors).

Loading streams (``rlx.quant.load_shipped``): the model is built abstractly, then every parameter
is read one at a time in file order, each process reading only the distinct slices its devices
hold (``jax.make_array_from_callback``), so the host holds at most the arrays being built plus one
tensor's slice. On CPU devices the host writes each slice in rlx's layout
(``rlx.platform.cpu.host_layout``); an accelerator transposes on the device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rlx.mesh import named_sharding
from rlx.models.hf import ParamSource, read_stored, swapped, to_layout
from rlx.platform.cpu.host_layout import on_host, once_per_index, read_transposed
from rlx.models.safetensors_io import DTYPES, CheckpointError, SafetensorsFolder
from rlx.quant.formats.layouts import Layout
from rlx.quant.shipped import module_of
from rlx.quant.shipped_fused import check_fused, names, read_fused
from rlx.quant.tensors import QTensor

SCALE_DTYPES = ("F32", "BF16", "F16")
_SCALE_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


# --- checks of the tensors, headers only -------------------------------------------------------
def _fused(src: ParamSource) -> bool:
    """A fused expert stack (``rlx.quant.shipped_fused``), not one linear or per-expert linears."""
    return src.layout not in ("T", "stack_T")


def _hf_shape(src: ParamSource, shape) -> tuple[int, int]:
    """(out, in) of one HF matrix of a kernel / stacked experts of rlx ``shape``."""
    return (shape[-1], shape[-2])


def check_quantized(tensors, quantized: dict[str, ParamSource], shapes: dict, lay: Layout) -> None:
    """Every quantized linear has its tensors, with the dtypes and shapes ``lay`` and config.json
    imply; ``weight_shape`` equals config.json's. Errors name the file and the tensor."""
    for p, src in quantized.items():
        if _fused(src):
            check_fused(tensors, src, shapes[p], lay)
            continue
        n, k = _hf_shape(src, shapes[p])
        for name in src.hf_names:
            _check_linear(tensors, module_of(name), n, k, lay)


def _check_linear(tensors, m: str, n: int, k: int, lay: Layout) -> None:
    def need(name: str, dtypes, shape, what: str):
        if name not in tensors:
            near = next((f"{m}.{s}" for s in ("weight", "weight_packed") if f"{m}.{s}" in tensors), None)
            where = f"{tensors.file_of(near)}: " if near else ""
            raise CheckpointError(
                f"{where}tensor {name!r} is missing: quantization_config ({lay.method}) stores "
                f"{m} quantized, and {what}")
        got, kind = tensors.shape(name), tensors.dtype_name(name)
        if kind not in dtypes or (shape is not None and tuple(got) not in shape):
            raise CheckpointError(
                f"{tensors.file_of(name)}: tensor {name!r} is {kind} {list(got)}, but "
                f"quantization_config ({lay.method}) and config.json imply "
                f"{'/'.join(dtypes)} {' or '.join(str(list(s)) for s in shape or [])}".rstrip())

    per, t = 32 // lay.bits, lay.tensors
    if t.packed:
        if lay.bits == 4 and k % 2:
            raise CheckpointError(f"{m}: int4 weights with an odd input width {k} (rlx packs "
                                  "two per byte along the input)")
        need(f"{m}.{t.values}", t.values_dtypes, [(n, -(-k // per))],
             "its packed values are needed")
        need(f"{m}.{t.shape}", ("I64", "I32"), [(2,)], "its shape is needed")
        shape_name = f"{m}.{t.shape}"
        got = [int(d) for d in np.asarray(tensors[shape_name])]
        if got != [n, k]:
            raise CheckpointError(
                f"{tensors.file_of(shape_name)}: tensor {shape_name!r} is {got}, but config.json "
                f"implies [out, in] = {[n, k]}; the weights and config.json disagree")
    else:
        need(f"{m}.{t.values}", t.values_dtypes, [(n, k // lay.format.values_per_byte)], "")
    scale = lay.scale_shape(n, k)
    shapes = [scale] + ([(1,), ()] if lay.strategy == "tensor" else [])
    need(f"{m}.{t.scale}", t.scale_dtypes, shapes,
         f"the scales of its {lay.fmt} values are needed")
    if t.scale2:
        need(f"{m}.{t.scale2}", ("F32",), [(), (1,)],
             f"the global scale of its {lay.fmt} block scales is needed")
    if t.zero:
        need(f"{m}.{t.zero}", ("I32",), [(-(-n // per), scale[1])],
             "the zero points of its asymmetric values are needed")


# --- reading: each device copies its slice as stored, the device lays it out ---------------------
def _stored(tensors, names: list[str], stacked: bool, tensor_scale: bool):
    """Callback: the ``index`` slice of the tensors ``names`` as stored (HF orientation)."""
    def one(name, index, out=None):
        if tensor_scale:
            value = np.array(read_stored(tensors, name, ())).reshape(1, 1)[index]
        elif out is not None and isinstance(tensors, SafetensorsFolder):
            return tensors.read(name, index, out=out)  # straight into the stacked buffer
        else:
            value = read_stored(tensors, name, index)
        if out is not None:
            out[...] = value
        return value

    def read(index):
        if not stacked:
            return one(names[0], index)
        chosen = names[index[0]]
        first = one(chosen[0], index[1:])
        out = np.empty((len(chosen),) + first.shape, first.dtype)
        out[0] = first
        for i, n in enumerate(chosen[1:], 1):
            one(n, index[1:], out[i])
        return out
    return read


@functools.lru_cache(maxsize=None)
def _unpack_values(bits: int, k: int):
    """``[..., n, words]`` int32 -> rlx's values ``[..., K', n]`` (int4: nibble pairs along K)."""
    per = 32 // bits

    def f(words):
        shifts = jnp.arange(per, dtype=jnp.uint32) * bits
        u = (jax.lax.bitcast_convert_type(words, jnp.uint32)[..., None] >> shifts) & ((1 << bits) - 1)
        u = u.reshape(*words.shape[:-1], -1)[..., :k]
        u = jnp.swapaxes(u, -1, -2).astype(jnp.uint8)  # [..., k, n]
        if bits == 4:
            return u[..., 0::2, :] | (u[..., 1::2, :] << 4)
        return (u.astype(jnp.int16) - 128).astype(jnp.int8)
    return f


@functools.lru_cache(maxsize=None)
def _unpack_zero(bits: int, n: int):
    """``[..., ceil(n*bits/32), groups]`` int32 -> signed zero points ``[..., groups, n]``."""
    per = 32 // bits

    def f(words):
        w = jnp.swapaxes(words, -1, -2)
        shifts = jnp.arange(per, dtype=jnp.uint32) * bits
        u = (jax.lax.bitcast_convert_type(w, jnp.uint32)[..., None] >> shifts) & ((1 << bits) - 1)
        u = u.reshape(*w.shape[:-1], -1)[..., :n]
        return (u.astype(jnp.int16) - (1 << (bits - 1))).astype(jnp.int8)
    return f


def _storage_shapes(lay: Layout, lead: tuple, n: int, k: int) -> dict[str, tuple]:
    bk, bn = lay.block(k, n)
    kv = k // lay.format.values_per_byte
    out = {"values": lead + (kv, n), "scale": lead + (-(-k // bk), -(-n // bn))}
    if lay.tensors.zero:
        out["zero"] = lead + (-(-k // bk), n)
    if lay.tensors.scale2:
        out["scale2"] = lead + (1, 1)
    return out


def _stored_shapes(lay: Layout, lead: tuple, n: int, k: int) -> dict[str, tuple]:
    """The file's shapes of each leaf's tensor (HF orientation, per matrix)."""
    per = 32 // lay.bits
    scale = lay.scale_shape(n, k)
    kv = k // lay.format.values_per_byte
    out = {"values": lead + ((n, -(-k // per)) if lay.tensors.packed else (n, kv)),
           "scale": lead + scale, "scale2": lead + (1, 1)}
    if lay.tensors.zero:
        out["zero"] = lead + (-(-n // per), scale[1])
    return out


def read_qtensor(tensors, src: ParamSource, shape: tuple, axes, lay: Layout, mesh, rules) -> QTensor:
    """The ``QTensor`` of one quantized parameter (a kernel or stacked experts of rlx ``shape``),
    each distinct device slice read once: CPU devices get it laid out by the host
    (``rlx.platform.cpu.host_layout``); otherwise (and for packed int32 words) each device copies its
    slice of the file's tensors as stored and lays it out itself (transposes; unpacks words)."""
    if _fused(src):
        return read_fused(tensors, src, shape, axes, lay, mesh, rules)
    n, k = _hf_shape(src, shape)
    stacked = src.layout == "stack_T"
    modules = [module_of(name) for name in src.hf_names]
    lead = (len(modules),) if stacked else ()
    stored = _stored_shapes(lay, lead, n, k)
    suffix = {"values": lay.tensors.values, "scale": lay.tensors.scale, "zero": lay.tensors.zero,
              "scale2": lay.tensors.scale2}
    leaves = {}
    for leaf, leaf_shape in _storage_shapes(lay, lead, n, k).items():
        sharding = (jax.sharding.SingleDeviceSharding(jax.local_devices()[0]) if mesh is None
                    else named_sharding(mesh, axes, rules, leaf_shape))
        names = [f"{m}.{suffix[leaf]}" for m in modules]
        tensor_scale = (leaf == "scale" and lay.strategy == "tensor") or leaf == "scale2"
        fn = (_unpack_values(lay.bits, k) if leaf == "values" and lay.tensors.packed else
              _unpack_zero(lay.bits, n) if leaf == "zero" else None)
        if fn is None and not tensor_scale and isinstance(tensors, SafetensorsFolder) \
                and on_host(sharding):  # CPU devices: laid out on the host, nothing compiled
            read = once_per_index(_host_leaf(tensors, names, stacked, leaf_shape))
            leaves[leaf] = jax.make_array_from_callback(leaf_shape, sharding, read)
            continue
        read = once_per_index(_stored(tensors, names, stacked, tensor_scale))
        raw = jax.make_array_from_callback(stored[leaf], swapped(sharding, stored[leaf]), read)
        leaves[leaf] = to_layout(raw.dtype, sharding, fn)(raw)
    return QTensor(lay.fmt, shape, leaves["values"], leaves["scale"], leaves.get("zero"),
                   lay.block(k, n), axes, scale2=leaves.get("scale2"))


def _host_leaf(tensors: SafetensorsFolder, names: list[str], stacked: bool, shape: tuple):
    """Callback: a device's slice of one leaf (values or scales as stored, no cast), transposed
    into rlx's orientation on the host."""
    stored = DTYPES[tensors.dtype_name(names[0])]

    def read(name, index, out):
        return tensors.read(name, index, out=out)

    return lambda index: read_transposed(read, names, stacked, index, shape, stored, stored)


def file_position(tensors, src: ParamSource, lay: Layout) -> tuple[str, int]:
    """Where the values of a quantized parameter's first matrix lie (file, offset)."""
    if _fused(src):
        return tensors.position(names(src, lay)["values"])
    m = module_of(src.hf_names[0])
    name = f"{m}.weight" if f"{m}.weight" in tensors else f"{m}.weight_packed"
    return tensors.position(name)


def scale_dtype_of(tensors, quantized: dict[str, ParamSource], lay: Layout) -> str:
    """The ``QuantConfig.scale_dtype`` name of the file's scales (float32 when none, or when
    the format stores them in its own encoding: E8M0 bytes)."""
    if lay.format.scale_encode is not None or lay.tensors.scale_dtypes != SCALE_DTYPES:
        return "float32"
    for src in quantized.values():
        return _SCALE_NAMES[tensors.dtype_name(f"{module_of(src.hf_names[0])}.{lay.tensors.scale}")]
    return "float32"


__all__ = ["SCALE_DTYPES", "check_quantized", "file_position", "read_qtensor", "scale_dtype_of"]
