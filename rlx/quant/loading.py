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

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from rlx.mesh import TRAIN_RULES, LogicalRules, shard_variables
from rlx.models.config import from_hf_config
from rlx.models.decoder import Precision, Transformer
from rlx.models.hf import load_model, param_map
from rlx.models.loading import LoadedModel
from rlx.models.safetensors_io import SafetensorsFolder
from rlx.quant.config import QuantConfig
from rlx.quant.gguf_blocks import BLOCK_BYTES, GGUFTensor
from rlx.quant.serving import config_from_hf, from_serving, is_quantized
from rlx.quant.tensors import QTensor, QuantWeight


def node_at(model: nnx.Module, path: str):
    node = model
    for part in path.split("/"):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


def set_node(model: nnx.Module, path: str, value) -> None:
    parent, _, last = path.rpartition("/")
    setattr(node_at(model, parent) if parent else model, last, value)


def _abstract_axes(cfg, precision) -> dict[str, tuple]:
    abstract = nnx.eval_shape(lambda: Transformer(cfg, precision, rngs=nnx.Rngs(0)))
    return {"/".join(map(str, k)): v.get_metadata().get("logical_axes")
            for k, v in nnx.to_flat_state(nnx.state(abstract))}


def load_gguf_quantized(path: str, dtype=jnp.float32, mesh: Mesh | None = None, *,
                        rules: LogicalRules = TRAIN_RULES, moe_impl: str = "ragged") -> LoadedModel:
    """A GGUF file with its block-quantized tensors (``rlx.quant.gguf_blocks.KEPT``) kept block for
    block on device; a MoE file's experts as one ``[experts, rows, bytes]`` tensor per projection."""
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


def _block(q: QuantConfig, k: int) -> tuple[int, int]:
    if q.format in ("int4", "nf4"):
        return (q.group_size, 1)
    if q.format == "fp8" and q.fp8_granularity == "block128":
        return (128, 128)
    return (k, 1)


def _read_qtensor(tensors, src, q: QuantConfig, shape, axes) -> QTensor:
    names = [n[: -len(".weight")] for n in src.hf_names]
    parts = [from_serving(tensors, n, q) for n in names]
    leaves = {k: np.stack([p[k] for p in parts]) if src.layout == "stack_T" else parts[0][k] for k in parts[0]}
    k = shape[-2]
    return QTensor(q.format, shape, jnp.asarray(leaves["values"]), jnp.asarray(leaves["scale"]),
                   jnp.asarray(leaves["zero"]) if "zero" in leaves else None, _block(q, k), axes)


def load_quantized(path: str, dtype=jnp.float32, mesh: Mesh | None = None, *,
                   rules: LogicalRules = TRAIN_RULES, moe_impl: str = "ragged") -> tuple[LoadedModel, QuantConfig]:
    """A GGUF file or a (quantized) HF folder, with its quantized values kept; returns the
    ``QuantConfig`` the checkpoint implies (serving format and activation mode included)."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        return load_gguf_quantized(path, dtype, mesh, rules=rules, moe_impl=moe_impl), \
            QuantConfig(format="gguf", serving="gguf")
    with open(os.path.join(path, "config.json")) as f:
        hf_cfg = json.load(f)
    q = config_from_hf(hf_cfg.get("quantization_config"))
    cfg = from_hf_config(hf_cfg)
    precision = Precision(dtype=dtype, param_dtype=dtype, moe_impl=moe_impl)
    tensors = SafetensorsFolder(path)
    quantized = {p: s for p, s in param_map(cfg).items() if s.layout in ("T", "stack_T")
                 and is_quantized(tensors, s.hf_names[0][: -len(".weight")])}
    model = load_model(cfg, tensors, precision=precision, mesh=mesh, rules=rules, skip=frozenset(quantized))
    axes = _abstract_axes(cfg, precision)
    shapes = {"/".join(map(str, k)): v.shape for k, v in nnx.to_flat_state(nnx.state(model))}
    for p, src in quantized.items():
        set_node(model, p, _read_qtensor(tensors, src, q, tuple(shapes[p]), axes[p]))
        owner = node_at(model, p.rpartition("/")[0])
        owner.act_quant = q.activation_mode
    if mesh is not None:
        shard_variables(model, QuantWeight, mesh, rules)
    return LoadedModel(model, None, path, "hf"), q


__all__ = ["load_gguf_quantized", "load_quantized", "node_at", "set_node"]
