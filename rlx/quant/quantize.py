"""Turning a float model into a frozen quantized base, and measuring what it occupies.

``quantize_model(model, cfg)`` replaces, in place, every linear kernel of the decoder layers (the
attention's projections, GQA or multi-head latent; dense MLP, shared experts, and the stacked MoE
experts) by a ``QTensor`` (see ``rlx.quant.tensors``); ``cfg.modules="experts"`` quantizes the
routed experts only. The token embedding and an untied lm_head follow ``cfg.quantize_embed`` /
``cfg.quantize_lm_head``. Routers (and a sigmoid router's f32 correction bias), the shared-expert
gate, norms and biases stay float (they are tiny and servers keep them float too). For W8A8
serving formats every quantized linear also gets the matching activation mode.
``format="gguf"`` cannot be produced from float weights (rlx never requantizes into llama.cpp
blocks): load it with ``rlx.quant.load_gguf_quantized``.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from rlx.mesh import TRAIN_RULES, LogicalRules, shard_variables
from rlx.models.decoder import Transformer
from rlx.models.layers import Linear
from rlx.models.moe import DenseMLP, SparseMoE
from rlx.quant.config import QuantConfig, QuantConfigError
from rlx.quant.tensors import QTensor, QuantWeight, quantize_array


def _quantize_param(var: nnx.Variable, cfg: QuantConfig, transposed: bool = False) -> QTensor:
    axes = var.get_metadata().get("logical_axes")
    return quantize_array(var[...], cfg.format, group_size=cfg.group_size, symmetric=cfg.symmetric,
                          fp8_granularity=cfg.fp8_granularity, scale_dtype=cfg.scale_dtype,
                          axes=axes, transposed=transposed)


def _quantize_linear(lin: Linear, cfg: QuantConfig) -> None:
    if isinstance(lin.kernel, nnx.Variable):
        lin.kernel = _quantize_param(lin.kernel, cfg)
    lin.act_quant = cfg.activation_mode


def linears(model: Transformer):
    """Every decoder-layer ``Linear`` (attention, dense MLP, shared expert), in layer order."""
    for layer in model.layers:
        yield from layer.self_attn.linears()
        mlp = layer.mlp
        dense = mlp if isinstance(mlp, DenseMLP) else mlp.shared_expert
        if dense is not None:
            yield from (dense.gate_proj, dense.up_proj, dense.down_proj)


def quantize_model(model: Transformer, cfg: QuantConfig, *, mesh: Mesh | None = None,
                   rules: LogicalRules = TRAIN_RULES) -> Transformer:
    """Replace the float base of ``model`` by ``cfg.format`` in place (and return it)."""
    fmt = cfg.spec
    if fmt.float_base:
        return model
    if fmt.keeps_file_blocks:
        raise QuantConfigError(f"format={cfg.format!r} keeps a GGUF file's blocks; load it with "
                               "rlx.quant.load_gguf_quantized instead of quantizing float weights")
    if fmt.from_checkpoint:
        raise QuantConfigError(f"format={cfg.format!r} is the checkpoint's own representation: "
                               "load it with rlx.quant.load_base, or resolve it "
                               "(rlx.quant.resolve_quant)")
    for lin in linears(model) if cfg.modules == "all" else ():
        _quantize_linear(lin, cfg)
    for layer in model.layers:
        if isinstance(layer.mlp, SparseMoE):
            ex = layer.mlp.experts
            for name in ("gate_proj", "up_proj", "down_proj"):
                if isinstance(getattr(ex, name), nnx.Variable):
                    setattr(ex, name, _quantize_param(getattr(ex, name), cfg))
            ex.act_quant = cfg.activation_mode
    if cfg.quantize_lm_head and model.lm_head is not None:
        _quantize_linear(model.lm_head, cfg)
    if cfg.quantize_embed and isinstance(model.embed, nnx.Variable):
        model.embed = _quantize_param(model.embed, cfg, transposed=True)
    if mesh is not None:
        shard_variables(model, QuantWeight, mesh, rules)
    return model


def _nbytes(leaves) -> int:
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in leaves))


def state_bytes(model: nnx.Module) -> dict[str, int]:
    """Bytes of the frozen quantized leaves, of the other frozen leaves (norms, routers, float
    kernels) and of the trainable LoRA state (global sizes, not per device)."""
    quant = _nbytes(jax.tree.leaves(nnx.state(model, QuantWeight)))
    lora = _nbytes(jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
    params = _nbytes(jax.tree.leaves(nnx.state(model, nnx.Param)))
    return {"quantized": quant, "float_frozen": params - lora, "base": quant + params - lora, "lora": lora}
