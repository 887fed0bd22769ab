"""Loading a base that is already quantized, keeping its values as they are.

- ``load_gguf_quantized(file)``: the block-quantized tensors of a GGUF file go to device as their
  blocks (``GGUFTensor``); F32/F16/BF16 tensors (norms, ...) load as float parameters.
- ``load_quantized(folder)``: a HF folder whose ``config.json`` carries one of the
  ``quantization_config`` layouts of ``rlx.quant.serving`` (what ``rlx.io.export`` writes: w8a8_int8,
  compressed-tensors pack-/float-quantized, block-fp8 as DeepSeek/Qwen FP8 checkpoints ship) is read
  into ``QTensor``s without requantizing. Plain HF folders load as float models.

Both build the model abstractly, read every float parameter slice-wise (``rlx.models.hf.load_model``)
and only then place the quantized leaves, sharded by their logical axes when a mesh is given.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from rlx.mesh import TRAIN_RULES, LogicalRules, named_sharding, shard_variables
from rlx.models.config import from_hf_config
from rlx.models.decoder import Precision, Transformer
from rlx.models.hf import (ParamSource, abstract_model, check_float_checkpoint, check_tensors,
                           load_model, param_map, read_hf_config, read_order,
                           stored_param_map)
from rlx.models.loading import LoadedModel, ModelSection, load_from_section, resolve_path
from rlx.models.moe import SparseMoE
from rlx.models.safetensors_io import CheckpointError, SafetensorsFolder
from rlx.models.tokenizer import Tokenizer
from rlx.quant import formats
from rlx.quant.config import QuantConfig, QuantConfigError
from rlx.quant.formats.gguf.blocks import BLOCK_BYTES, GGUFTensor
from rlx.quant.quantize import linears, quantize_model
from rlx.quant.shipped import (Shipped, layout, quantized_params, read_quantization_config,
                               shipped)
from rlx.quant.shipped_read import check_quantized, file_position, read_qtensor, scale_dtype_of
from rlx.quant.tensors import QTensor, QuantWeight, quantize_array


def node_at(model: nnx.Module, path: str):
    node = model
    for part in path.split("/"):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


def set_node(model: nnx.Module, path: str, value) -> None:
    parent, _, last = path.rpartition("/")
    setattr(node_at(model, parent) if parent else model, last, value)


def _abstract_axes(cfg, precision) -> dict[str, tuple]:
    abstract = abstract_model(cfg, precision)
    return {"/".join(map(str, k)): v.get_metadata().get("logical_axes")
            for k, v in nnx.to_flat_state(nnx.state(abstract))}


def load_gguf_quantized(path: str, dtype=jnp.float32, mesh: Mesh | None = None, *,
                        rules: LogicalRules = TRAIN_RULES, moe_impl: str = "ragged") -> LoadedModel:
    """A GGUF file with its block-quantized tensors (``rlx.quant.formats.gguf.blocks.KEPT``) kept
    block for block on device; a MoE file's experts as one ``[experts, rows, bytes]`` tensor per
    projection."""
    from rlx.models.gguf import read_gguf

    ckpt = read_gguf(path)
    cfg = from_hf_config(ckpt.hf_config)
    precision = Precision(dtype=dtype, param_dtype=dtype, moe_impl=moe_impl)
    kept = {p: s for p, s in param_map(cfg).items() if s.layout in ("T", "copy", "stack_T")
            and ckpt.tensor_types[s.hf_names[0]] in BLOCK_BYTES}
    model = load_model(cfg, ckpt.tensors, precision=precision, mesh=mesh, rules=rules, skip=frozenset(kept))
    axes = _abstract_axes(cfg, precision)
    for p, src in kept.items():
        set_node(model, p, _gguf_tensor(ckpt, src, axes[p]))
    if mesh is not None:
        shard_variables(model, QuantWeight, mesh, rules)
    return LoadedModel(model, ckpt.tokenizer, path, "gguf")


def _gguf_tensor(ckpt, src, ax) -> GGUFTensor:
    """One parameter's stored blocks (experts: the slices of one 3-D GGUF tensor, stacked)."""
    raws = [ckpt.raw(name) for name in src.hf_names]
    if src.layout == "stack_T":
        blocks, shape = np.stack([r.blocks for r in raws]), (len(raws), *raws[0].shape)
        storage = None if ax is None else (ax[0], ax[-1], None)
    else:
        blocks, shape = raws[0].blocks, raws[0].shape
        storage = None if ax is None else ((ax[-1] if src.layout == "T" else ax[0]), None)
    return GGUFTensor(raws[0].qtype, shape, jnp.asarray(blocks), storage, kernel=src.layout != "copy")


def load_shipped(path: str, dtype=jnp.float32, mesh: Mesh | None = None, *, param_dtype=None,
                 rules: LogicalRules = TRAIN_RULES, moe_impl: str = "ragged",
                 tensors: SafetensorsFolder | None = None, text_only: bool = False,
                 ) -> tuple[LoadedModel, Shipped]:
    """A HF folder with its quantized linears kept as the file stores them
    (``rlx.quant.shipped_read``): headers checked first, then every parameter read in file order,
    each device its slice (``tensors``: the folder's ``SafetensorsFolder`` when the caller has
    one, e.g. to count the bytes read; ``text_only``: ``from_hf_config``)."""
    with open(os.path.join(path, "config.json")) as f:
        hf_cfg = json.load(f)
    cfg = from_hf_config(hf_cfg, text_only=text_only)
    qc = read_quantization_config(path)
    if not qc:
        raise CheckpointError(f"{path}: config.json has no quantization_config; load it as a float "
                              "checkpoint (config.quant.format='none' or a format to quantize to)")
    lay = layout(qc)
    precision = Precision(dtype=dtype, param_dtype=param_dtype or dtype, moe_impl=moe_impl)
    tensors = SafetensorsFolder(path) if tensors is None else tensors
    quantized = quantized_params(cfg, lay)
    abstract = abstract_model(cfg, precision)
    flat = [("/".join(map(str, k)), v) for k, v in nnx.to_flat_state(nnx.state(abstract))]
    shapes = {p: tuple(v.shape) for p, v in flat}
    axes = {p: v.get_metadata().get("logical_axes") for p, v in flat}
    check_quantized(tensors, quantized, shapes, lay)  # headers (and weight_shape) only
    model = load_model(cfg, tensors, precision=precision, mesh=mesh, rules=rules,
                       skip=frozenset(quantized), abstract=abstract)
    for p in sorted(quantized, key=lambda p: file_position(tensors, quantized[p], lay)):
        src = quantized[p]
        set_node(model, p, read_qtensor(tensors, src, shapes[p], axes[p], lay, mesh, rules))
        node_at(model, p.rpartition("/")[0]).act_quant = lay.act
    info = shipped(path, cfg, scale_dtype_of(tensors, quantized, lay))
    has_tok = os.path.exists(os.path.join(path, "tokenizer.json"))
    return LoadedModel(model, Tokenizer.from_dir(path) if has_tok else None, path, "hf"), info


def load_quantized(path: str, dtype=jnp.float32, mesh: Mesh | None = None, *,
                   rules: LogicalRules = TRAIN_RULES, moe_impl: str = "ragged") -> tuple[LoadedModel, QuantConfig]:
    """A GGUF file or a (quantized) HF folder, with its quantized values kept; returns the
    ``QuantConfig`` the checkpoint implies (serving format and activation mode included)."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        return load_gguf_quantized(path, dtype, mesh, rules=rules, moe_impl=moe_impl), \
            QuantConfig(format="gguf", serving="gguf")
    loaded, info = load_shipped(path, dtype, mesh, rules=rules, moe_impl=moe_impl)
    return loaded, info.quant


# --- float checkpoints quantized while they are read --------------------------------------------
def quantized_paths(abstract: Transformer, q: QuantConfig) -> dict[str, bool]:
    """rlx parameter path -> transposed, for every parameter ``quantize_model(model, q)`` would
    quantize (the same selection, read off the abstract model)."""
    where = {id(node): "/".join(map(str, p)) for p, node in nnx.iter_graph(abstract)}
    out = {}
    for lin in linears(abstract) if q.modules == "all" else ():
        out[f"{where[id(lin)]}/kernel"] = False
    for i, layer in enumerate(abstract.layers):
        if isinstance(layer.mlp, SparseMoE):
            out.update({f"layers/{i}/mlp/experts/{m}": False for m in ("gate_proj", "up_proj", "down_proj")})
    if q.quantize_lm_head and abstract.lm_head is not None:
        out["lm_head/kernel"] = False
    if q.quantize_embed:
        out["embed"] = True
    return out


def _hf_rows(tensors, src: ParamSource, name: str, lo: int, hi: int, dtype) -> np.ndarray:
    """Rows ``lo:hi`` of HF tensor ``name`` in the rlx parameter's logical orientation, cast to
    the parameter dtype as the float loader stores it (``[in, rows]`` for a kernel, ``[rows, d]``
    for an embedding)."""
    rows = np.asarray(tensors[name][lo:hi]).astype(dtype)
    return rows if src.layout == "copy" else rows.T


def quantize_streamed(tensors, src: ParamSource, var, q: QuantConfig, transposed: bool, mesh,
                      rules) -> QTensor:
    """One float parameter quantized as it is read: for each matrix this process needs (a stacked
    parameter: only its devices' experts), the rows (outputs) its devices hold, widened to whole
    scale blocks, are read, cast to the parameter dtype and quantized (``quantize_array``: the
    values ``quantize_model`` gives); the leaves are placed slice by slice. The host holds one
    matrix's rows in float at a time."""
    shape, axes = tuple(var.shape), var.get_metadata().get("logical_axes")
    kw = dict(group_size=q.group_size, symmetric=q.symmetric, fp8_granularity=q.fp8_granularity,
              scale_dtype=q.scale_dtype, axes=axes, transposed=transposed)
    abstract = nnx.eval_shape(lambda: quantize_array(jnp.zeros(shape, var.dtype), q.format, **kw))
    leaves = {k: getattr(abstract, k) for k in ("values", "scale", "zero", "scale2")
              if getattr(abstract, k) is not None}
    stacked = src.layout == "stack_T"
    n = shape[-2] if transposed else shape[-1]
    bn = abstract.block[1]
    shardings = {k: (jax.sharding.SingleDeviceSharding(jax.local_devices()[0]) if mesh is None
                     else named_sharding(mesh, abstract_axes(v), rules, v.shape))
                 for k, v in leaves.items()}
    experts, lo, hi = set(), n, 0
    for k, v in leaves.items():
        per_col = 1 if v.shape[-1] == n else bn
        for idx in shardings[k].addressable_devices_indices_map(v.shape).values():
            if stacked:
                experts.update(range(*idx[0].indices(v.shape[0])))
            c0, c1 = _bounds(idx[-1], v.shape[-1])
            lo, hi = min(lo, c0 * per_col), max(hi, min(n, c1 * per_col))
    lo, hi = lo // bn * bn, min(n, -(-hi // bn) * bn)
    if "scale2" in leaves:  # a scale over the whole matrix: every row is read
        lo, hi = 0, n
    parts = {}
    for e in sorted(experts) if stacked else [None]:
        x = _hf_rows(tensors, src, src.hf_names[0 if e is None else e], lo, hi, var.dtype)
        qt = quantize_array(x, q.format, **kw)
        parts[e] = {k: np.asarray(a) for k, a in qt.leaves().items()}
    offsets = {k: lo if v.shape[-1] == n else lo // bn for k, v in leaves.items()}

    def cut(part, k, idx):
        c0, c1 = _bounds(idx[-1], leaves[k].shape[-1])
        return part[k][(*idx[len(idx) - 2:-1], slice(c0 - offsets[k], c1 - offsets[k]))]

    arrays = {}
    for k, v in leaves.items():
        if stacked:
            def cb(idx, k=k):
                return np.stack([cut(parts[e], k, idx) for e in range(*idx[0].indices(v.shape[0]))])
        else:
            def cb(idx, k=k):
                return cut(parts[None], k, idx)
        arrays[k] = jax.make_array_from_callback(tuple(v.shape), shardings[k], cb)
    return QTensor(q.format, shape, arrays["values"], arrays["scale"], arrays.get("zero"),
                   abstract.block, abstract_axes(abstract.values), transposed, arrays.get("scale2"))


def abstract_axes(var):
    return None if var is None else var.get_metadata().get("logical_axes")


def _bounds(s: slice, size: int) -> tuple[int, int]:
    lo, hi, _ = s.indices(size)
    return lo, hi


def load_quantizing(cfg, tensors, q: QuantConfig, *, precision: Precision, mesh: Mesh | None = None,
                    rules: LogicalRules = TRAIN_RULES) -> Transformer:
    """A float checkpoint read into a model whose base is ``q`` (``format`` int8 / int4 / fp8 /
    nf4), each linear quantized tensor by tensor while it is read; the float model never exists
    whole. Equal, value for value, to ``quantize_model(load_model(...), q)``."""
    if not q.spec.quantizes:
        allowed = " / ".join(f for f in formats.names() if formats.get(f).quantizes)
        raise QuantConfigError(f"load_quantizing quantizes to {allowed}, not {q.format!r}")
    abstract = abstract_model(cfg, precision)
    which = quantized_paths(abstract, q)
    sources = stored_param_map(cfg)
    streamed = {p: t for p, t in which.items() if _streams(sources[p], node_at(abstract, p))}
    check_tensors(cfg, tensors, {p: tuple(node_at(abstract, p).shape) for p in streamed})
    model = load_model(cfg, tensors, precision=precision, mesh=mesh, rules=rules,
                       skip=frozenset(streamed), abstract=abstract)
    for p in read_order(streamed, sources, tensors):
        var = _variable(abstract, p)
        set_node(model, p, quantize_streamed(tensors, sources[p], var, q, which[p], mesh, rules))
    for p in (p for p in which if p not in streamed):  # a fused stack: read whole, then quantized
        set_node(model, p, quantize_array(
            _variable(model, p)[...], q.format, group_size=q.group_size, symmetric=q.symmetric,
            fp8_granularity=q.fp8_granularity, scale_dtype=q.scale_dtype,
            axes=_variable(abstract, p).get_metadata().get("logical_axes"), transposed=which[p]))
    for p in which:
        if p != "embed":
            node_at(model, p.rpartition("/")[0]).act_quant = q.activation_mode
    if mesh is not None and len(streamed) < len(which):
        shard_variables(model, QuantWeight, mesh, rules)
    return model


def _streams(src: ParamSource, var) -> bool:
    """Whether ``quantize_streamed`` reads this parameter (linears, per-expert tensors, the
    embedding); a fused expert stack (gpt-oss's interleaved ``gate_up_proj``, its ``[E, f, d]``
    ``down_proj``) is read whole in float instead, one layer's projection at a time."""
    return src.layout in ("T", "stack_T") or (src.layout == "copy" and len(var.shape) == 2)


def _variable(model, path: str) -> nnx.Variable:
    parent, _, last = path.rpartition("/")
    owner = node_at(model, parent) if parent else model
    return getattr(owner, last)


# --- the base of a run ------------------------------------------------------------------------
def resolve_quant(q: QuantConfig, section: ModelSection) -> Shipped:
    """What ``q`` means for the checkpoint ``section`` names: a format resolved from the
    checkpoint (``from_checkpoint``: "shipped") becomes the checkpoint's own representation
    (``rlx.quant.shipped.shipped``; reads config.json or the GGUF header only); any other format
    is itself (``exact``)."""
    if not q.spec.from_checkpoint:
        return Shipped(q, True)
    return shipped(resolve_path(section.path), gguf=section.is_gguf)


def check_shrink(q: QuantConfig, resolved: QuantConfig, section: ModelSection) -> None:
    """A base kept as a file's blocks needs the file's weights: ``model.shrink`` (random
    weights) is refused for it (``q``: the configured format, ``resolved``: what it resolved to
    for this checkpoint, ``resolve_quant``). The one place this is checked, for the run checks
    before anything is loaded and for ``load_base``."""
    if section.shrink.enabled and resolved.spec.keeps_file_blocks:
        raise QuantConfigError(
            f"config.quant.format={q.format!r} keeps the file's own blocks, but config."
            "model.shrink.enabled=True builds random weights; disable shrink or use "
            "quant.format='int8'/'int4' for a shrunken test model")


def load_base(section: ModelSection, q: QuantConfig, mesh: Mesh | None = None, *,
              rules: LogicalRules = TRAIN_RULES, seed: int = 0) -> tuple[LoadedModel, QuantConfig]:
    """The model of a run (``config.model``) with its base in representation ``q``
    (``config.quant``): ``"none"`` float; ``"shipped"`` the checkpoint's own (quantized HF folders
    as stored, GGUF blocks as stored, float checkpoints float); ``"gguf"`` a GGUF file's blocks;
    int8 / int4 / fp8 / nf4 a float checkpoint quantized tensor by tensor while it is read
    (``model.shrink``: random weights, then quantized). Returns the resolved ``QuantConfig``."""
    resolved = resolve_quant(q, section).quant
    p = section.precision
    check_shrink(q, resolved, section)
    if section.shrink.enabled:
        loaded = load_from_section(section, mesh, rules, seed)
        return LoadedModel(quantize_model(loaded.model, resolved, mesh=mesh, rules=rules),
                           loaded.tokenizer, loaded.source, loaded.format), resolved
    path = resolve_path(section.path)
    kw = dict(mesh=mesh, rules=rules, moe_impl=p.moe_impl)
    if resolved.spec.keeps_file_blocks:
        return load_gguf_quantized(path, **kw), resolved
    if resolved.spec.float_base:
        return load_from_section(section, mesh, rules, seed), resolved
    if q.spec.from_checkpoint:
        loaded, _ = load_shipped(path, p.dtype, param_dtype=p.param_dtype,
                                 text_only=section.text_only, **kw)
        return loaded, resolved
    precision = Precision(dtype=p.dtype, param_dtype=p.param_dtype, moe_impl=p.moe_impl)
    if section.is_gguf:
        from rlx.models.gguf import read_gguf

        ckpt = read_gguf(path)
        cfg, tensors, tokenizer = from_hf_config(ckpt.hf_config), ckpt.tensors, ckpt.tokenizer
    else:
        cfg = read_hf_config(path, text_only=section.text_only)
        check_float_checkpoint(path)
        tensors = SafetensorsFolder(path)
        has_tok = os.path.exists(os.path.join(path, "tokenizer.json"))
        tokenizer = Tokenizer.from_dir(path) if has_tok else None
    model = load_quantizing(cfg, tensors, resolved, precision=precision, mesh=mesh, rules=rules)
    return LoadedModel(model, tokenizer, path, section.resolved_format), resolved


__all__ = ["load_base", "load_gguf_quantized", "load_quantized", "load_quantizing", "load_shipped",
           "check_shrink", "node_at", "quantized_paths", "resolve_quant", "set_node"]
