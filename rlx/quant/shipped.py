"""A checkpoint's own quantized representation (``config.quant.format="shipped"``), read as it is.

``layout(quantization_config)`` reads a HF folder's ``config.json`` ``quantization_config`` into
a ``Layout`` (or refuses it, naming the method and what rlx reads, before any weight is read):

=================================  ===============================================================
``quant_method`` / ``format``      tensors of a quantized linear ``X`` (HF ``[out, in]``)
=================================  ===============================================================
``fp8``, ``weight_block_size``     ``X.weight`` e4m3 ``[out, in]``, ``X.weight_scale_inv``
``[128, 128]``, dynamic            ``[ceil(out/128), ceil(in/128)]`` (DeepSeek-V3, Kimi-K2,
activations                        Qwen3-*-FP8; ``modules_to_not_convert`` stay float)
``w8a8_int8`` (SGLang)             ``X.weight`` int8, ``X.weight_scale`` ``[out, 1]``
compressed-tensors                 ``X.weight_packed`` int32 ``[out, ceil(in*bits/32)]`` (lowest bits
``pack-quantized`` int4 / int8     first, value + 2^(bits-1)), ``X.weight_scale`` ``[out, groups]``
(channel or group, symmetric or    (channel: 1), ``X.weight_shape`` ``[out, in]``, asymmetric:
not; Kimi-K2-Thinking)             ``X.weight_zero_point`` int32 ``[ceil(out*bits/32), groups]``
compressed-tensors                 ``X.weight`` e4m3, ``X.weight_scale`` ``[out, 1]`` (channel),
``float-quantized`` fp8            ``[1]`` (tensor) or ``[ceil(out/128), ceil(in/128)]`` (block)
compressed-tensors                 ``X.weight`` int8, ``X.weight_scale`` ``[out, 1]`` (W8A8 int8)
``int-quantized`` int8 channel
=================================  ===============================================================

Each quantized linear becomes a ``QTensor`` whose leaves hold the file's values bit for bit, in
rlx's storage orientation (``[in, out]``; int4 nibbles re-paired along ``in``, which changes no
value): ``w = (q - zero) * scale`` per block, exactly the formula of the format. Modules the
checkpoint leaves unquantized (compressed-tensors ``ignore``, transformers'
``modules_to_not_convert``, and what neither quantizes: embeddings, lm_head, routers, norms) load
as float parameters. A linear the config quantizes but the file holds otherwise, a missing or
misshapen scale, or a ``weight_shape`` that disagrees with ``config.json`` is refused naming the
file and the tensor, after reading only headers (and the 16-byte ``weight_shape`` tensors).

Loading streams (``load_shipped``): the model is built abstractly, then every parameter is read
one at a time in file order, each process reading only the distinct slices its devices hold
(``jax.make_array_from_callback``), so the host holds at most the arrays being built plus one
tensor's slice. On CPU devices the host writes each slice in rlx's layout
(``rlx.models.host_layout``); an accelerator transposes on the device.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlx.mesh import named_sharding
from rlx.models.hf import ParamSource, read_stored, swapped, to_layout
from rlx.models.host_layout import on_host, once_per_index, read_transposed
from rlx.models.safetensors_io import DTYPES, CheckpointError, SafetensorsFolder
from rlx.quant.config import QuantConfig, QuantConfigError
from rlx.quant.tensors import QTensor

SUPPORTED = (
    "quant_method 'fp8' with weight_block_size [128, 128], e4m3 and dynamic activations "
    "(DeepSeek-V3, Kimi-K2, Qwen3-*-FP8)",
    "quant_method 'w8a8_int8'",
    "compressed-tensors 'pack-quantized' int4 / int8, channel or group strategy, symmetric or not "
    "(Kimi-K2-Thinking)",
    "compressed-tensors 'float-quantized' fp8 (tensor, channel or 128x128 block strategy)",
    "compressed-tensors 'int-quantized' int8 (channel, symmetric)",
    "GGUF files (Q4_0 / Q4_1 / Q8_0 blocks)",
)
SCALE_DTYPES = ("F32", "BF16", "F16")
_SCALE_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def _refuse(method, why: str) -> QuantConfigError:
    return QuantConfigError(
        f"quantization_config quant_method={method!r}: {why}; rlx keeps these checkpoints as they "
        f"are: {'; '.join(SUPPORTED)}")


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one checkpoint stores its quantized linears (see the module docstring)."""

    method: str  # quant_method
    kind: str  # "float8" (e4m3 X.weight) | "int8" (int8 X.weight) | "packed" (X.weight_packed)
    bits: int  # 8 | 4
    strategy: str  # "block" | "channel" | "group" | "tensor"
    group: int | None  # values per scale along ``in`` (strategy "group")
    symmetric: bool
    act: str  # the activation mode (rlx.models.layers.quantize_activations)
    scale_key: str  # "weight_scale_inv" | "weight_scale"
    ignore: tuple[str, ...] = ()  # modules left float
    ignore_style: str = "ct"  # "ct": exact names or "re:" regexes | "hf": modules_to_not_convert
    targets: tuple[str, ...] = ("Linear",)

    @property
    def fmt(self) -> str:
        """rlx's QTensor format of the values."""
        return "fp8" if self.kind == "float8" else "int4" if self.bits == 4 else "int8"

    def quantizes(self, module: str) -> bool:
        """Whether linear ``module`` (HF name, no ``.weight``) is stored quantized."""
        if not any(t == "Linear" or _ct_match(t, module) for t in self.targets):
            return False
        if self.ignore_style == "hf":
            return not any(_hf_match(p, module) for p in self.ignore)
        return not any(_ct_match(p, module) for p in self.ignore)

    def block(self, k: int, n: int) -> tuple[int, int]:
        """The scale block ``(bk, bn)`` of a ``[k, n]`` kernel."""
        return {"block": (128, 128), "channel": (k, 1), "tensor": (k, n)}.get(self.strategy,
                                                                            (self.group, 1))

    def scale_shape(self, n: int, k: int) -> tuple[int, ...]:
        """The file's scale shape for a HF ``[n, k]`` weight (``tensor``: one of several)."""
        bk, bn = self.block(k, n)
        return (-(-n // bn), -(-k // bk))


def _ct_match(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name


def _hf_match(pattern: str, name: str) -> bool:
    """transformers' ``should_convert_module`` (a pattern from the start up to a module boundary,
    as a regex with that boundary, or as a suffix)."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return re.match(rf"(?:{pattern}){boundary}", name) is not None or name.endswith(pattern)


def layout(qc: dict) -> Layout:
    """The ``Layout`` of a ``quantization_config``, or ``QuantConfigError`` naming the method, what
    is not supported and what rlx reads."""
    method = qc.get("quant_method")
    if method == "fp8":
        if list(qc.get("weight_block_size") or []) != [128, 128]:
            raise _refuse(method, f"weight_block_size={qc.get('weight_block_size')} (rlx reads "
                                  "128x128 blocks)")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise _refuse(method, f"fmt={qc.get('fmt')!r} (rlx reads e4m3)")
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise _refuse(method, f"activation_scheme={qc.get('activation_scheme')!r} (static "
                                  "activation scales are not supported)")
        return Layout(method, "float8", 8, "block", None, True, "fp8_group128", "weight_scale_inv",
                      tuple(qc.get("modules_to_not_convert") or ()), "hf")
    if method == "w8a8_int8":
        return Layout(method, "int8", 8, "channel", None, True, "int8_token", "weight_scale",
                      tuple(qc.get("modules_to_not_convert") or qc.get("ignore") or ()), "hf")
    if method != "compressed-tensors":
        raise _refuse(method, "not a layout rlx reads")
    return _compressed_tensors(qc)


def _compressed_tensors(qc: dict) -> Layout:
    method, fmt = "compressed-tensors", qc.get("format")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise _refuse(method, f"quantization_status={qc.get('quantization_status')!r} (rlx reads "
                              "compressed checkpoints)")
    for key in ("kv_cache_scheme", "transform_config"):
        if qc.get(key):
            raise _refuse(method, f"{key} is set (rlx does not quantize the KV cache or rotate "
                                  "weights)")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise _refuse(method, f"sparsity format {sparsity.get('format')!r}")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse(method, f"{len(groups)} config_groups (rlx reads one scheme for all "
                              "quantized linears)")
    scheme = next(iter(groups.values()))
    w, a = scheme.get("weights") or {}, scheme.get("input_activations")
    if scheme.get("output_activations"):
        raise _refuse(method, "output_activations are quantized")
    kind = {("pack-quantized", "int"): "packed", ("float-quantized", "float"): "float8",
            ("naive-quantized", "float"): "float8", ("int-quantized", "int"): "int8",
            ("naive-quantized", "int"): "int8"}.get((fmt, w.get("type")))
    bits, strategy = w.get("num_bits"), w.get("strategy")
    what = f"format {fmt!r} with {bits}-bit {w.get('type')} weights, strategy {strategy!r}"
    ok = {"packed": bits in (4, 8) and strategy in ("channel", "group"),
          "float8": bits == 8 and strategy in ("channel", "tensor", "block"),
          "int8": bits == 8 and strategy == "channel" and w.get("symmetric", True)}.get(kind, False)
    if not ok:
        raise _refuse(method, what)
    if w.get("dynamic") or w.get("actorder"):
        raise _refuse(method, f"{what} and dynamic={w.get('dynamic')} actorder={w.get('actorder')}")
    group = w.get("group_size") if strategy == "group" else None
    if strategy == "group" and not (isinstance(group, int) and group >= 2 and group % 2 == 0):
        raise _refuse(method, f"group_size={group} (rlx reads even group sizes)")
    if strategy == "block" and list(w.get("block_structure") or []) != [128, 128]:
        raise _refuse(method, f"block_structure={w.get('block_structure')} (rlx reads 128x128)")
    if kind == "float8" and not w.get("symmetric", True):
        raise _refuse(method, "asymmetric fp8 weights")
    return Layout(method, kind, bits, strategy, group, bool(w.get("symmetric", True)),
                  _activations(a, method), "weight_scale", tuple(qc.get("ignore") or ()), "ct",
                  tuple(scheme.get("targets") or ("Linear",)))


def _activations(a: dict | None, method: str) -> str:
    if not a:
        return "none"
    kind = (a.get("type"), a.get("num_bits"), a.get("strategy"), bool(a.get("dynamic")),
            bool(a.get("symmetric", True)))
    modes = {("float", 8, "token", True, True): "fp8_token",
             ("int", 8, "token", True, True): "int8_token"}
    if kind[:4] == ("float", 8, "group", True) and a.get("group_size") == 128:
        return "fp8_group128"
    if kind not in modes:
        raise _refuse(method, f"input_activations {a} (rlx quantizes activations dynamically: fp8 "
                              "per token or per 128-group, int8 per token, symmetric)")
    return modes[kind]


def read_quantization_config(path: str) -> dict | None:
    """A HF folder's ``quantization_config`` (None for a float checkpoint or a GGUF file)."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        return json.load(f).get("quantization_config") or None


# --- which rlx parameters a checkpoint stores quantized ------------------------------------------
def candidates(cfg) -> dict[str, ParamSource]:
    """The rlx parameters rlx can hold quantized (what ``quantize_model`` quantizes with
    ``modules="all"``: every decoder linear's kernel and the routed experts), with their sources."""
    from rlx.models.hf import param_map

    skip = ("router", "shared_gate")
    return {p: s for p, s in param_map(cfg).items()
            if p.startswith("layers/") and s.layout in ("T", "stack_T")
            and not p.endswith(skip)}


def _module(hf_name: str) -> str:
    return hf_name[: -len(".weight")]


def quantized_params(cfg, lay: Layout) -> dict[str, ParamSource]:
    """The candidate parameters ``lay`` stores quantized; routed experts all or none."""
    out = {}
    for p, src in candidates(cfg).items():
        flags = {lay.quantizes(_module(n)) for n in src.hf_names}
        if len(flags) > 1:
            raise QuantConfigError(
                f"quantization_config quantizes some experts of {_module(src.hf_names[0])} but "
                "not others; rlx keeps a layer's routed experts in one representation")
        if flags.pop():
            out[p] = src
    return out


def modules_kind(cfg, quantized: dict) -> str | None:
    """``QuantConfig.modules`` for the set quantized: "all", "experts" or None (another set)."""
    every = candidates(cfg)
    experts = {p for p, s in every.items() if s.layout == "stack_T"}
    if set(quantized) == set(every):
        return "all"
    if set(quantized) == experts and experts:
        return "experts"
    return None


@dataclasses.dataclass(frozen=True)
class Shipped:
    """What ``format="shipped"`` resolves to for one checkpoint: the run-level ``QuantConfig``
    (serving format, activation mode) and whether that serving format writes the very values back
    (``exact``; else it is "hf", the dequantized base)."""

    quant: QuantConfig
    exact: bool
    layout: Layout | None = None


def shipped(path: str, cfg, scale_dtype: str = "float32") -> Shipped:
    """The ``Shipped`` of a (resolved, local) model path with architecture ``cfg``."""
    if path.endswith(".gguf"):
        return Shipped(QuantConfig(format="gguf", serving="gguf"), True)
    qc = read_quantization_config(path)
    if qc is None:
        return Shipped(QuantConfig(), True)
    lay = layout(qc)
    modules = modules_kind(cfg, quantized_params(cfg, lay))
    quant = _nearest(lay, modules, scale_dtype)
    if quant is not None:
        return Shipped(quant, True, lay)
    return Shipped(QuantConfig(format=lay.fmt, serving="hf", scale_dtype=scale_dtype), False, lay)


def _nearest(lay: Layout, modules: str | None, scale_dtype: str) -> QuantConfig | None:
    """The QuantConfig whose serving export writes ``lay``'s values back (same activation mode),
    or None."""
    if modules is None:
        return None
    base = dict(scale_dtype=scale_dtype, modules=modules)
    want = []
    if lay.kind == "float8" and lay.strategy in ("block", "channel"):
        gran = "block128" if lay.strategy == "block" else "channel"
        want = [QuantConfig(format="fp8", fp8_granularity=gran, serving=s, **base)
                for s in ("fp8", "compressed-tensors")]
    elif lay.kind == "int8" or (lay.kind == "packed" and lay.bits == 8 and lay.strategy == "channel"
                                and lay.symmetric):
        want = [QuantConfig(format="int8", serving=s, **base)
                for s in ("w8a8_int8", "compressed-tensors")]
    elif lay.kind == "packed" and lay.bits == 4 and lay.strategy == "group":
        want = [QuantConfig(format="int4", group_size=lay.group, symmetric=lay.symmetric,
                            serving="compressed-tensors", **base)]
    for q in want:
        if q.activation_mode == lay.act:
            return q
    return None


# --- checks of the tensors, headers only -------------------------------------------------------
def _hf_shape(src: ParamSource, shape) -> tuple[int, int]:
    """(out, in) of one HF matrix of a kernel / stacked experts of rlx ``shape``."""
    return (shape[-1], shape[-2])


def check_quantized(tensors, quantized: dict[str, ParamSource], shapes: dict, lay: Layout) -> None:
    """Every quantized linear has its tensors, with the dtypes and shapes ``lay`` and config.json
    imply; ``weight_shape`` equals config.json's. Errors name the file and the tensor."""
    for p, src in quantized.items():
        n, k = _hf_shape(src, shapes[p])
        for name in src.hf_names:
            _check_linear(tensors, _module(name), n, k, lay)


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

    per = 32 // lay.bits
    if lay.kind == "packed":
        if lay.bits == 4 and k % 2:
            raise CheckpointError(f"{m}: int4 weights with an odd input width {k} (rlx packs "
                                  "two per byte along the input)")
        need(f"{m}.weight_packed", ("I32",), [(n, -(-k // per))], "its packed values are needed")
        need(f"{m}.weight_shape", ("I64", "I32"), [(2,)], "its shape is needed")
        shape_name = f"{m}.weight_shape"
        got = [int(d) for d in np.asarray(tensors[shape_name])]
        if got != [n, k]:
            raise CheckpointError(
                f"{tensors.file_of(shape_name)}: tensor {shape_name!r} is {got}, but config.json "
                f"implies [out, in] = {[n, k]}; the weights and config.json disagree")
    else:
        dtype = ("F8_E4M3",) if lay.kind == "float8" else ("I8",)
        need(f"{m}.weight", dtype, [(n, k)], "")
    scale = lay.scale_shape(n, k)
    shapes = [scale] + ([(1,), ()] if lay.strategy == "tensor" else [])
    need(f"{m}.{lay.scale_key}", SCALE_DTYPES, shapes,
         f"the scales of its {lay.fmt} values are needed")
    if lay.kind == "packed" and not lay.symmetric:
        need(f"{m}.weight_zero_point", ("I32",), [(-(-n // per), scale[1])],
             "the zero points of its asymmetric values are needed")


# --- reading: each device copies its slice as stored, the device lays it out ---------------------
def _stored(tensors, names: list[str], stacked: bool, tensor_scale: bool):
    """Callback: the ``index`` slice of the tensors ``names`` as stored (HF orientation)."""
    def one(name, index, out=None):
        if tensor_scale:
            value = np.array(tensors[name]).reshape(1, 1)[index]
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
    kv = k // 2 if lay.fmt == "int4" else k
    out = {"values": lead + (kv, n), "scale": lead + (-(-k // bk), -(-n // bn))}
    if lay.kind == "packed" and not lay.symmetric:
        out["zero"] = lead + (-(-k // bk), n)
    return out


def _stored_shapes(lay: Layout, lead: tuple, n: int, k: int) -> dict[str, tuple]:
    """The file's shapes of each leaf's tensor (HF orientation, per matrix)."""
    per = 32 // lay.bits
    scale = lay.scale_shape(n, k)
    out = {"values": lead + ((n, -(-k // per)) if lay.kind == "packed" else (n, k)),
           "scale": lead + scale}
    if lay.kind == "packed" and not lay.symmetric:
        out["zero"] = lead + (-(-n // per), scale[1])
    return out


def read_qtensor(tensors, src: ParamSource, shape: tuple, axes, lay: Layout, mesh, rules) -> QTensor:
    """The ``QTensor`` of one quantized parameter (a kernel or stacked experts of rlx ``shape``),
    each distinct device slice read once: CPU devices get it laid out by the host
    (``rlx.models.host_layout``); otherwise (and for packed int32 words) each device copies its
    slice of the file's tensors as stored and lays it out itself (transposes; unpacks words)."""
    n, k = _hf_shape(src, shape)
    stacked = src.layout == "stack_T"
    modules = [_module(name) for name in src.hf_names]
    lead = (len(modules),) if stacked else ()
    stored = _stored_shapes(lay, lead, n, k)
    suffix = {"values": "weight_packed" if lay.kind == "packed" else "weight",
              "scale": lay.scale_key, "zero": "weight_zero_point"}
    leaves = {}
    for leaf, leaf_shape in _storage_shapes(lay, lead, n, k).items():
        sharding = (jax.sharding.SingleDeviceSharding(jax.local_devices()[0]) if mesh is None
                    else named_sharding(mesh, axes, rules, leaf_shape))
        names = [f"{m}.{suffix[leaf]}" for m in modules]
        tensor_scale = leaf == "scale" and lay.strategy == "tensor"
        fn = (_unpack_values(lay.bits, k) if leaf == "values" and lay.kind == "packed" else
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
                   lay.block(k, n), axes)


def _host_leaf(tensors: SafetensorsFolder, names: list[str], stacked: bool, shape: tuple):
    """Callback: a device's slice of one leaf (values or scales as stored, no cast), transposed
    into rlx's orientation on the host."""
    stored = DTYPES[tensors.dtype_name(names[0])]

    def read(name, index, out):
        return tensors.read(name, index, out=out)

    return lambda index: read_transposed(read, names, stacked, index, shape, stored, stored)


def file_position(tensors, src: ParamSource) -> tuple[str, int]:
    """Where the values of a quantized parameter's first matrix lie (file, offset)."""
    m = _module(src.hf_names[0])
    name = f"{m}.weight" if f"{m}.weight" in tensors else f"{m}.weight_packed"
    return tensors.position(name)


def scale_dtype_of(tensors, quantized: dict[str, ParamSource], lay: Layout) -> str:
    """The ``QuantConfig.scale_dtype`` name of the file's scales (float32 when none)."""
    for src in quantized.values():
        return _SCALE_NAMES[tensors.dtype_name(f"{_module(src.hf_names[0])}.{lay.scale_key}")]
    return "float32"


def shard_bytes(model: nnx.Module) -> int:
    """Bytes this process holds of ``model``'s arrays (every addressable shard)."""
    return sum(s.data.nbytes for x in jax.tree.leaves(nnx.state(model))
               if hasattr(x, "addressable_shards") for s in x.addressable_shards)


__all__ = ["Layout", "SUPPORTED", "Shipped", "check_quantized", "layout", "quantized_params",
           "read_qtensor", "read_quantization_config", "shipped"]
