"""Kimi-K2.5 / K2.6 (``Kimi_K25ForConditionalGeneration``, transformers' ``kimi_k25``; Moonshot's
own code calls the class ``KimiK25ForConditionalGeneration``): a vision tower (MoonViT) and a
projector in front of Kimi-K2's language model, which is DeepSeek-V3's decoder (multi-head latent
attention, sigmoid-routed experts). rlx loads and trains the language model alone: its config is
``config.json``'s ``text_config`` (a ``deepseek_v3`` / ``kimi_k2`` config, read by
``rlx.models.families.deepseek_v3``'s rules), its tensors are the causal LM's names under
``language_model.`` (``language_model.model.layers.0...``, ``language_model.lm_head.weight``, as
Moonshot ships them and transformers reads them; transformers 5.25's ``save_pretrained`` writes
the layers as ``language_model.model.blocks.N``, reversing its vision tower's rename on every
name, which no release holds and rlx does not read), and the top-level ``tie_word_embeddings``
decides the head, as for transformers' wrapper. The vision tower (``vision_tower.*``) and the
projector (``mm_projector.*``) are refused unless the run asks for text-only RL
(``config.model.text_only``), then skipped with a logged note. ``to_hf`` writes the language
model alone as ``DeepseekV3ForCausalLM`` (``Multimodal.text_architecture``)."""

from __future__ import annotations

import dataclasses

from rlx.models.families import deepseek_v3
from rlx.models.families.spec import Multimodal

# the language-model config types the wrapper may hold (transformers rewrites kimi_k2 as
# deepseek_v3 when it reads the config)
TEXT_MODEL_TYPES = ("deepseek_v3", "kimi_k2")

PRESETS = {
    # Kimi-K2's language model (61 layers, 384 experts, 64 MLA heads) with 262,144 positions
    # (YaRN factor 64 over 4,096), MoonViT (27 layers of width 1152, 14-pixel patches merged 2x2;
    # the values of transformers' Kimi_K25VisionConfig, whose reference checkpoint this is) and
    # its projector; the release stores the routed experts in compressed-tensors int4
    "moonshotai/Kimi-K2.6": {
        "architectures": ["Kimi_K25ForConditionalGeneration"], "model_type": "kimi_k25",
        "tie_word_embeddings": False, "projection_hidden_size": 1152,
        "projection_layer_norm_eps": 1e-5, "image_token_id": 163605, "video_token_id": 163840,
        "vision_start_token_id": 163602, "vision_end_token_id": 163604,
        "text_config": {
            **deepseek_v3.PRESETS["moonshotai/Kimi-K2-Instruct"],
            "max_position_embeddings": 262144, "rope_scaling": {
                "type": "yarn", "factor": 64.0, "beta_fast": 1.0, "beta_slow": 1.0,
                "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}},
        "vision_config": {
            "model_type": "kimi_k25_vision", "patch_size": 14, "pos_emb_height": 64,
            "pos_emb_width": 64, "pos_emb_time": 4, "num_attention_heads": 16,
            "num_hidden_layers": 27, "hidden_size": 1152, "intermediate_size": 4304,
            "hidden_act": "gelu_pytorch_tanh", "merge_kernel_size": [2, 2]},
        "torch_dtype": "bfloat16",
    },
}

SPEC = dataclasses.replace(
    deepseek_v3.SPEC,
    model_type="kimi_k25",
    architectures=("Kimi_K25ForConditionalGeneration", "KimiK25ForConditionalGeneration"),
    presets=PRESETS,
    aliases=(),
    multimodal=Multimodal(text_architecture=deepseek_v3.SPEC.architectures[0],
                          text_model_types=TEXT_MODEL_TYPES),
)
