"""One MoE layer with random weights, float or with quantized experts and per-expert LoRA, and its
placement on a mesh with the experts split over the ``expert`` axis; a tiny DeepSeek-V3 model."""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from rlx.mesh import TRAIN_RULES, shard_variables
from rlx.models import Transformer, from_hf_config
from rlx.models.hparams import MoEConfig
from rlx.models.moe import CorrectionBias, SparseMoE, expert_parallel
from rlx.quant import LoraConfig
from rlx.quant.lora import LoRA
from rlx.quant.tensors import QuantWeight, quantize_array
from tests.helpers.hf_zoo import hf_config

D, F = 16, 8
SOFTMAX = MoEConfig(num_experts=8, top_k=2, intermediate_size=F, norm_topk_prob=False,
                    shared_intermediate_size=12, shared_expert_gate=True)
SIGMOID = MoEConfig(num_experts=16, top_k=3, intermediate_size=F, norm_topk_prob=True,
                    shared_intermediate_size=8, router="sigmoid", correction_bias=True, n_group=4,
                    topk_group=2, routed_scaling_factor=1.5)
# gpt-oss: biased router and experts, the clamped SwiGLU (a limit the projections cross), no
# shared expert
GPT_OSS = MoEConfig(num_experts=8, top_k=2, intermediate_size=F, norm_topk_prob=True,
                    router_bias=True, expert_bias=True, swiglu_limit=0.5, swiglu_alpha=1.702)


def make_layer(m: MoEConfig, fmt: str, seed: int = 0) -> SparseMoE:
    """A layer with random weights; ``fmt`` int8/int4: quantized experts with random LoRA."""
    rngs = nnx.Rngs(seed)
    layer = SparseMoE(D, m, dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs)
    layer.router.set_value(layer.router[...] * 50)  # spread the router's choices
    if layer.correction_bias is not None:
        layer.correction_bias.set_value(jax.random.normal(rngs.params(), (m.num_experts,)) * 0.1)
    for bias in (layer.router_bias, layer.experts.gate_bias, layer.experts.up_bias,
                 layer.experts.down_bias):
        if bias is not None:
            bias.set_value(0.5 * jax.random.normal(rngs.params(), bias.shape))
    if fmt == "float":
        return layer
    ex, axes = layer.experts, {"gate": ("embed", "expert_mlp"), "up": ("embed", "expert_mlp"),
                               "down": ("expert_mlp", "embed")}
    for t in ("gate", "up", "down"):
        var = getattr(ex, f"{t}_proj")
        setattr(ex, f"{t}_proj", quantize_array(var[...] * 20, fmt, group_size=8,
                                               axes=var.get_metadata()["logical_axes"]))
        e, d_in, d_out = var.shape
        lora = LoRA(d_in, d_out, LoraConfig(rank=3, alpha=5.0), axes[t], dtype=jnp.float32,
                    rngs=rngs, experts=e)
        lora.lora_b.set_value(0.3 * jax.random.normal(rngs.params(), lora.lora_b.shape))
        setattr(ex, f"{t}_lora", lora)
    return layer


def on_mesh(layer: SparseMoE, mesh) -> SparseMoE:
    for kind in (nnx.Param, nnx.LoRAParam, QuantWeight, CorrectionBias):
        shard_variables(layer, kind, mesh, TRAIN_RULES)
    return expert_parallel(layer, mesh, TRAIN_RULES)


def tiny_deepseek(layers: int = 4, seed: int = 0) -> Transformer:
    """A tiny DeepSeek-V3 (MLA, a dense first layer, MoE after it) with a spread router (x50)."""
    hf = hf_config("deepseek_v3")
    cfg = from_hf_config(hf.to_dict() | {"architectures": ["DeepseekV3ForCausalLM"]})
    cfg = dataclasses.replace(cfg, num_layers=layers, moe=dataclasses.replace(
        cfg.moe, sparse_layers=tuple(range(1, layers))))
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    for _, node in nnx.iter_graph(model):
        if isinstance(node, SparseMoE):
            node.router.set_value(node.router[...] * 50)
    return model
