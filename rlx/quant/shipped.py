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
compressed-tensors                 ``X.weight_packed`` uint8 ``[out, in/2]`` (E2M1 pairs),
``nvfp4-pack-quantized``           ``X.weight_scale`` e4m3 ``[out, in/16]``, ``X.weight_global_scale``
(group 16)                         f32 ``[1]`` (divides the scales)
``mxfp4`` (gpt-oss; only the       fused stacks ``X_blocks`` uint8 ``[E, out, in/32, 16]`` (E2M1
routed experts; ``modules_to_not_  pairs, even input low), ``X_scales`` E8M0 uint8 ``[E, out, in/32]``
convert`` stay float)              (``rlx.quant.shipped_fused``)
``modelopt``, ``quant_algo:        ``X.weight`` uint8 ``[out, in/2]`` (E2M1 pairs, even input low),
NVFP4``, ``group_size: 16``        ``X.weight_scale`` e4m3 ``[out, in/16]``, ``X.weight_scale_2`` f32
(config.json or                    (one per matrix); ``exclude_modules`` / ``ignore`` (fnmatch)
``hf_quant_config.json``)          stay float
=================================  ===============================================================

Each row is a layout reader (``rlx.quant.formats.layouts``: ``hf_fp8``, ``w8a8_int8``,
``compressed_tensors``, ``mxfp4``, ``modelopt``) declaring what it recognises, the tensors it reads and the rlx format its
values become; ``layout`` asks their registry. A GGUF file's reader is the gguf format's
(``rlx.quant.formats.gguf.file``).

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

from rlx.models.config import quantization_config
from rlx.models.hf import ParamSource
from rlx.quant import formats
from rlx.quant.config import QuantConfig, QuantConfigError
from rlx.quant.formats.gguf import file as gguf_file
from rlx.quant.formats.layouts import FileReader, Layout
from rlx.quant.formats.layouts.registry import SUPPORTED, file_reader, layout


def read_quantization_config(path: str) -> dict | None:
    """A HF folder's ``quantization_config`` (None for a float checkpoint or a GGUF file; a
    vision-language checkpoint's may sit in its text config; a ModelOpt export may keep it in
    ``hf_quant_config.json`` instead: its ``quantization`` with ``quant_method: modelopt``)."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        qc = quantization_config(json.load(f))
    modelopt = os.path.join(path, "hf_quant_config.json")
    if not qc and os.path.isfile(modelopt):
        with open(modelopt) as f:
            return {"quant_method": "modelopt", **json.load(f).get("quantization", {})}
    return qc


# --- which rlx parameters a checkpoint stores quantized ------------------------------------------
def candidates(cfg) -> dict[str, ParamSource]:
    """The rlx parameters rlx can hold quantized (what ``quantize_model`` quantizes with
    ``modules="all"``: every decoder linear's kernel and the routed experts), with their sources."""
    from rlx.models.hf import stored_param_map

    skip = ("router", "shared_gate")
    return {p: s for p, s in stored_param_map(cfg).items()
            if p.startswith("layers/") and s.layout in ("T", "stack_T")
            and not p.endswith(skip)}


def fused_candidates(cfg) -> dict[str, ParamSource]:
    """The routed experts' projections a family stores fused, one tensor per layer and projection
    (gpt-oss's interleaved ``experts.gate_up_proj`` halves and ``experts.down_proj``)."""
    from rlx.models.hf import stored_param_map

    return {p: s for p, s in stored_param_map(cfg).items()
            if p.startswith("layers/") and "/mlp/experts/" in p and p.endswith("_proj")
            and s.layout not in ("T", "stack_T")}


def fused_module(src: ParamSource) -> str:
    """The HF module of a fused expert stack (``...mlp.experts.gate_up_proj`` -> ``...mlp.experts``)."""
    return src.hf_names[0].rpartition(".")[0]


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
    if lay.fused:
        out.update({p: s for p, s in fused_candidates(cfg).items() if lay.quantizes(fused_module(s))})
    return out


def modules_kind(cfg, quantized: dict) -> str | None:
    """``QuantConfig.modules`` for the set quantized: "all", "experts" or None (another set)."""
    every = {**candidates(cfg), **fused_candidates(cfg)}
    experts = {p for p, s in every.items() if s.layout == "stack_T" or "/mlp/experts/" in p}
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
    reader = file_reader(path) if gguf is None else (gguf_file.READER if gguf else None)
    if reader is not None:
        return _file_shipped(reader, path)
    qc = read_quantization_config(path)
    if qc is None:
        return Shipped(QuantConfig(), True)
    if cfg is None:
        from rlx.models.hf import read_hf_config

        # the language model's quantized linears; a vision tower is refused or skipped by the
        # load itself (config.model.text_only), not by this resolution
        cfg = read_hf_config(path, text_only=True)
    lay = layout(qc)
    modules = modules_kind(cfg, quantized_params(cfg, lay))
    quant = _nearest(lay, modules, scale_dtype)
    if quant is not None:
        return Shipped(quant, True, lay)
    return Shipped(QuantConfig(format=lay.fmt, serving="hf", scale_dtype=scale_dtype), False, lay)


def _file_shipped(reader: FileReader, path: str) -> Shipped:
    """A file that is its own layout (a GGUF file): its blocks where its linear weights are
    block-quantized (``reader.quantized``), else its floats."""
    quantized = reader.quantized(path)
    return Shipped(QuantConfig(format=reader.format.name, serving=reader.serving) if quantized
                   else QuantConfig(), True)


def _nearest(lay: Layout, modules: str | None, scale_dtype: str) -> QuantConfig | None:
    """The QuantConfig whose serving export writes ``lay``'s values back (``lay.quant_fields``,
    the same activation mode; the candidates: the quantized serving layouts ``lay.format``
    carries, in its order), or None."""
    if modules is None or lay.quant_fields is None:
        return None
    fields = dict(lay.quant_fields)
    layouts = [s for s in lay.format.serving if not formats.serving(s).dequantized]
    want = [QuantConfig(format=lay.fmt, serving=s, scale_dtype=scale_dtype, modules=modules,
                        **fields) for s in layouts]
    for q in want:
        if q.activation_mode == lay.act:
            return q
    return None


__all__ = ["Layout", "SUPPORTED", "Shipped", "candidates", "fused_candidates", "fused_module",
           "layout", "module_of", "modules_kind",
           "quantized_params", "read_quantization_config", "shipped"]
