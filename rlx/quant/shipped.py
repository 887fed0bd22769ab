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

Modules the checkpoint leaves unquantized (compressed-tensors ``ignore``, transformers'
``modules_to_not_convert``, and what neither quantizes: embeddings, lm_head, routers, norms) load
as float parameters. ``shipped`` resolves a checkpoint to the run-level ``QuantConfig`` whose
serving export writes its values back, where one does. Checking and reading the tensors of the
quantized linears is ``rlx.quant.shipped_read``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

from rlx.models.hf import ParamSource
from rlx.quant import formats
from rlx.quant.config import QuantConfig, QuantConfigError

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


def module_of(hf_name: str) -> str:
    """The HF module of a weight's name (``X.weight`` -> ``X``)."""
    return hf_name[: -len(".weight")]


def quantized_params(cfg, lay: Layout) -> dict[str, ParamSource]:
    """The candidate parameters ``lay`` stores quantized; routed experts all or none."""
    out = {}
    for p, src in candidates(cfg).items():
        flags = {lay.quantizes(module_of(n)) for n in src.hf_names}
        if len(flags) > 1:
            raise QuantConfigError(
                f"quantization_config quantizes some experts of {module_of(src.hf_names[0])} but "
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


def shipped(path: str, cfg=None, scale_dtype: str = "float32", *, gguf: bool | None = None
            ) -> Shipped:
    """The ``Shipped`` of a (resolved, local) model path with architecture ``cfg`` (read from
    config.json when None): the one resolution of ``format="shipped"``. ``gguf``: whether the
    path is a GGUF file (default: by its extension); a GGUF file resolves to its blocks
    (``format="gguf"``) when its linear weights are block-quantized, else to floats (only its
    header is read)."""
    if path.endswith(".gguf") if gguf is None else gguf:
        return _gguf_shipped(path)
    qc = read_quantization_config(path)
    if qc is None:
        return Shipped(QuantConfig(), True)
    if cfg is None:
        from rlx.models.hf import read_hf_config

        cfg = read_hf_config(path)
    lay = layout(qc)
    modules = modules_kind(cfg, quantized_params(cfg, lay))
    quant = _nearest(lay, modules, scale_dtype)
    if quant is not None:
        return Shipped(quant, True, lay)
    return Shipped(QuantConfig(format=lay.fmt, serving="hf", scale_dtype=scale_dtype), False, lay)


def _gguf_shipped(path: str) -> Shipped:
    """A GGUF file's own representation: its blocks where its linear weights are block-quantized
    (``rlx.quant.formats.gguf.blocks.BLOCK_BYTES``), else its floats."""
    from rlx.models.gguf import read_gguf
    from rlx.quant.formats.gguf.blocks import BLOCK_BYTES

    types = read_gguf(path).tensor_types
    blocks = any(t in BLOCK_BYTES for n, t in types.items() if n.endswith("_proj.weight"))
    return Shipped(QuantConfig(format="gguf", serving="gguf") if blocks else QuantConfig(), True)


def _nearest(lay: Layout, modules: str | None, scale_dtype: str) -> QuantConfig | None:
    """The QuantConfig whose serving export writes ``lay``'s values back (same activation mode;
    the candidates: the quantized serving layouts ``lay.fmt``'s format carries, in its order), or
    None."""
    if modules is None:
        return None
    if lay.kind == "float8" and lay.strategy in ("block", "channel"):
        fields = dict(fp8_granularity="block128" if lay.strategy == "block" else "channel")
    elif lay.kind == "int8" or (lay.kind == "packed" and lay.bits == 8 and lay.strategy == "channel"
                                and lay.symmetric):
        fields = {}
    elif lay.kind == "packed" and lay.bits == 4 and lay.strategy == "group":
        fields = dict(group_size=lay.group, symmetric=lay.symmetric)
    else:
        return None
    layouts = [s for s in formats.get(lay.fmt).serving if not formats.serving(s).dequantized]
    want = [QuantConfig(format=lay.fmt, serving=s, scale_dtype=scale_dtype, modules=modules,
                        **fields) for s in layouts]
    for q in want:
        if q.activation_mode == lay.act:
            return q
    return None


__all__ = ["Layout", "SUPPORTED", "Shipped", "candidates", "layout", "module_of", "modules_kind",
           "quantized_params", "read_quantization_config", "shipped"]
