"""Tiny randomly initialised HF transformers models of every family rlx supports.

Weights are drawn with a large init range so that logits are O(1) and a wrong layout, a missing
bias or a wrong routing rule shows up far above the parity tolerance. Sigmoid routers (DeepSeek-V3,
Kimi-K2, GLM-4.5) get a random ``e_score_correction_bias`` about as large as the spread of their
scores, so the experts it selects differ from the plain top-k.
"""

from __future__ import annotations

import os

import torch
import transformers

_COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
               max_position_embeddings=256)


def _configs() -> dict[str, transformers.PretrainedConfig]:
    llama3 = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    return {
        "llama": transformers.LlamaConfig(**_COMMON, rope_parameters=llama3, tie_word_embeddings=False),
        "llama_tied": transformers.LlamaConfig(**_COMMON, tie_word_embeddings=True,
                                               rope_parameters={"rope_type": "default", "rope_theta": 100.0}),
        "qwen2": transformers.Qwen2Config(**_COMMON, tie_word_embeddings=False),
        "qwen3": transformers.Qwen3Config(**_COMMON, head_dim=16, tie_word_embeddings=True),
        "mixtral": transformers.MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2),
        "qwen2_moe": transformers.Qwen2MoeConfig(
            **_COMMON, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4,
            num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1]),
        "qwen3_moe": transformers.Qwen3MoeConfig(
            **_COMMON, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, head_dim=8,
            norm_topk_prob=True),
        **_sigmoid_routed_configs(),
        "gpt_oss": _gpt_oss_config(),
    }


def _gpt_oss_config() -> transformers.PretrainedConfig:
    """gpt-oss with every feature binding: a 6-token window on layers 0 and 2 (shorter than the
    tests' sequences and the engine's caches), full layers 1 and 3, sinks, q/k/v/o, router and
    expert biases, a SwiGLU clamp (1.5) that the projections cross, YaRN over 16 original
    positions without truncation, top-2 of 4 experts in every layer."""
    yarn = {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 16.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}
    return transformers.GptOssConfig(
        **{**_COMMON, "num_hidden_layers": 4, "intermediate_size": 16}, head_dim=8,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=6, swiglu_limit=1.5,
        rope_parameters=yarn, tie_word_embeddings=False)


def _sigmoid_routed_configs() -> dict[str, transformers.PretrainedConfig]:
    """DeepSeek-V3 (MLA) and GLM-4.5 shapes: 8 experts, the first layer dense."""
    mla = dict(_COMMON, num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=8,
               first_k_dense_replace=1, kv_lora_rank=16)
    yarn = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "original_max_position_embeddings": 16, "mscale": 1.0,
            "mscale_all_dim": 0.8}  # mscale != mscale_all_dim: a cos/sin and a softmax temperature
    glm = dict(_COMMON, moe_intermediate_size=16, n_routed_experts=8, first_k_dense_replace=1)
    return {
        "deepseek_v3": transformers.DeepseekV3Config(  # group-limited top-2, interleaved rope
            **mla, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
            n_group=4, topk_group=2, num_experts_per_tok=2, n_shared_experts=1,
            routed_scaling_factor=2.5, rope_parameters={"rope_type": "default", "rope_theta": 100.0}),
        "deepseek_v2_lite": transformers.DeepseekV3Config(  # plain q_proj, biases, rotate-half rope
            **mla, q_lora_rank=None, qk_nope_head_dim=12, qk_rope_head_dim=4, v_head_dim=8,
            n_group=1, topk_group=1, num_experts_per_tok=3, n_shared_experts=2,
            routed_scaling_factor=1.0, norm_topk_prob=False, attention_bias=True,
            rope_interleave=False, rope_parameters={"rope_type": "default", "rope_theta": 100.0}),
        "kimi_k2": transformers.DeepseekV3Config(  # one expert group, 2.827, YaRN (factor 32)
            **{**mla, "max_position_embeddings": 512}, q_lora_rank=24, qk_nope_head_dim=8,
            qk_rope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1, num_experts_per_tok=2,
            n_shared_experts=1, routed_scaling_factor=2.827, rope_parameters=yarn),
        "glm4_moe": transformers.Glm4MoeConfig(  # partial rotary 0.5, q/k norm, qkv bias
            **glm, head_dim=16, use_qk_norm=True, attention_bias=True, n_group=2, topk_group=1,
            num_experts_per_tok=3, n_shared_experts=1, routed_scaling_factor=1.5,
            rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                             "partial_rotary_factor": 0.5}),
        "glm4_moe_plain": transformers.Glm4MoeConfig(  # partial rotary by the class default
            **glm, use_qk_norm=False, attention_bias=False, num_experts_per_tok=2,
            norm_topk_prob=False, rope_parameters={"rope_type": "default", "rope_theta": 100.0}),
        "qwen3_yarn": transformers.Qwen3Config(  # long-context YaRN of a GQA family
            **{**_COMMON, "max_position_embeddings": 128}, head_dim=16, tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0,
                             "original_max_position_embeddings": 32}),
    }


FAMILIES = tuple(_configs())
SIGMOID_ROUTED = ("deepseek_v3", "deepseek_v2_lite", "kimi_k2", "glm4_moe", "glm4_moe_plain")


def _extra_configs() -> dict[str, transformers.PretrainedConfig]:
    """Shapes for servers whose CPU kernels want widths in multiples of 64 (SGLang's LoRA pool)."""
    wide = dict(_COMMON, hidden_size=64, intermediate_size=128)
    # DeepSeek-V3's attention (MLA) with every MLP dense, the kind of its first layers: attention
    # checks without the routed experts' gates amplifying f32 rounding
    mla_dense = {**_sigmoid_routed_configs()["deepseek_v3"].to_dict(), "first_k_dense_replace": 2}
    return {"llama_wide": transformers.LlamaConfig(**wide, tie_word_embeddings=False),
            "deepseek_v3_dense": transformers.DeepseekV3Config(**mla_dense),
            "kimi_k25": _kimi_k25_config(), **_dsa_configs(), "qwen3_next": _qwen3_next_config()}


def _dsa_configs() -> dict[str, transformers.PretrainedConfig]:
    """DeepSeek-V3.2 and GLM-5 (MLA + the DSA indexer): an indexer of 8 heads of 16 keeping 4
    keys per query (fewer than the tests' sequences and caches, so the selection binds), its
    first 8 dimensions rotating; 8 experts, the first layer dense. V3.2 with YaRN (a cos/sin and
    a softmax temperature the indexer's rope shares) and 4 groups; GLM-5 with one group and a
    default rope. ``glm_moe_dsa_shared``: GLM-5 with cross-layer index sharing, 5 layers
    "full", "full", "full", "shared", "shared" (the last two reuse layer 2's selection; layers
    1-2 and 3-4 each one scanned stack)."""
    base = dict(_sigmoid_routed_configs()["deepseek_v3"].to_dict(), index_topk=4,
                index_head_dim=16, index_n_heads=8)
    for k in ("architectures", "model_type", "transformers_version", "rope_interleave"):
        base.pop(k, None)
    yarn = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "original_max_position_embeddings": 16, "mscale": 1.0,
            "mscale_all_dim": 0.8}
    glm = {**base, "n_group": 1, "topk_group": 1}
    shared = {**glm, "num_hidden_layers": 5, "indexer_types": ["full"] * 3 + ["shared"] * 2}
    return {"deepseek_v32": transformers.DeepseekV32Config(**{**base, "rope_parameters": yarn}),
            "glm_moe_dsa": transformers.GlmMoeDsaConfig(**glm),
            "glm_moe_dsa_shared": transformers.GlmMoeDsaConfig(**shared)}


def _kimi_k25_config() -> transformers.PretrainedConfig:
    """Kimi-K2.5's vision-language wrapper around the zoo's Kimi-K2 language model, with a
    one-layer vision tower (width 8, 2-pixel patches merged 2x2) and its projector; the wrapper's
    untied head (its own ``tie_word_embeddings``, which transformers ties by, defaults to True)."""
    vision = dict(patch_size=2, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2,
                  num_attention_heads=2, num_hidden_layers=1, hidden_size=8, intermediate_size=16,
                  merge_kernel_size=[2, 2])
    return transformers.Kimi_K25Config(
        text_config=_sigmoid_routed_configs()["kimi_k2"].to_dict(), vision_config=vision,
        projection_hidden_size=8, tie_word_embeddings=False)


def _qwen3_next_config() -> transformers.PretrainedConfig:
    """Qwen3-Next with every feature binding: linear-attention layers 0, 1, 3 and full layers 2,
    4; 2 key heads of 8 serving 4 value heads of 6 through a 4-tap convolution; full attention
    of 4 heads of 16 (2 KV heads), 4 dimensions rotating; top-2 of 4 experts and a gated shared
    expert in every layer but layer 3 (dense). Drawn at half the zoo's init range: at 0.2 this
    model's own f32 forward differs from its f64 one by 2.8e-4 in log-probs (the delta rule's
    ``v - k S`` cancels, the gated norm rescales the rest), so f32 comparisons at 1e-5 would
    measure rounding; at 0.1, 1.4e-5 over the whole vocabulary, logits still about 2."""
    return transformers.Qwen3NextConfig(
        **{**_COMMON, "num_hidden_layers": 5, "initializer_range": 0.1}, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, mlp_only_layers=[3],
        layer_types=["linear_attention"] * 2 + ["full_attention", "linear_attention",
                                                "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                         "partial_rotary_factor": 0.25}, tie_word_embeddings=False)


def hf_model_class(config: transformers.PretrainedConfig):
    """The transformers class that runs ``config`` on text: its causal LM, or the vision-language
    class of a wrapper config (Kimi-K2.5), which takes text-only input."""
    causal = transformers.AutoModelForCausalLM
    return causal if type(config) in causal._model_mapping else transformers.AutoModelForImageTextToText


def hf_config(family: str) -> transformers.PretrainedConfig:
    """The transformers config of the zoo's ``family``."""
    return {**_configs(), **_extra_configs()}[family]


def make_hf_model(family: str, root: str) -> str:
    """Create, save and return the folder of a tiny HF model of ``family`` (cached under root)."""
    path = os.path.join(root, family)
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        config = hf_config(family)
        model = hf_model_class(config).from_config(config)
        with torch.no_grad():  # norms are initialised to exactly 1; perturb them to catch mix-ups
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(0.1 * torch.randn_like(p))
                if name.endswith("bias"):
                    p.add_(0.5 * torch.randn_like(p))
                if name.endswith("sinks"):  # O(1) sink logits: a visible share of each softmax
                    p.add_(torch.randn_like(p))
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(0.3 * torch.randn_like(b))
        model.save_pretrained(path)
        if family == "kimi_k25":
            _as_moonshot_ships(path)
    return path


def _as_moonshot_ships(path: str) -> None:
    """Rename the language model's layers of a saved Kimi-K2.5 folder back to Moonshot's
    ``language_model.model.layers.N``: transformers 5.25 reverses its load-time rename of the
    vision tower's ``blocks`` to ``layers`` on every name, so it saves the text layers as
    ``blocks.N``, which it reads back but no release holds."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    renamed = {k.replace("language_model.model.blocks.", "language_model.model.layers."): v
               for k, v in tensors.items()}
    save_file(renamed, file, metadata={"format": "pt"})


def load_hf_model(path: str):
    """The saved zoo model at ``path`` in f32, eval mode, by its class (``hf_model_class``);
    every weight must come from the file (none missing, none left over)."""
    config = transformers.AutoConfig.from_pretrained(path)
    model, info = hf_model_class(config).from_pretrained(path, dtype=torch.float32,
                                                        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def hf_logits(path: str, ids, attention_mask=None, position_ids=None):
    model = load_hf_model(path)
    kw = {}
    if attention_mask is not None:
        kw["attention_mask"] = torch.tensor(attention_mask)
    if position_ids is not None:
        kw["position_ids"] = torch.tensor(position_ids)
    with torch.no_grad():
        return model(torch.tensor(ids), **kw).logits.float().numpy()
