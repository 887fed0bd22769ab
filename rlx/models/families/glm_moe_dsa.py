"""GLM-5 (``GlmMoeDsaForCausalLM``): DeepSeek-V3.2's attention (MLA with the DSA indexer,
``rlx.models.dsa``) with interleaved rotary pairs in the indexer, GLM's sizes and one expert
group. transformers' class also has cross-layer index sharing: ``indexer_types`` "shared" layers
without an indexer reuse the top-k of the previous "full" layer; without ``indexer_types`` the
pattern is derived from ``index_topk_pattern`` ("F" / "S" per layer), else from
``index_topk_freq`` and ``index_skip_topk_offset`` (every layer "full" by default, as in GLM-5's
release). rlx derives the pattern the same way; its "shared" layers are
``DSAConfig.shared_layers`` (``rlx.models.dsa``: no indexer weights; the selection of the most
recent full layer), and ``to_hf`` writes ``indexer_types`` back.

Refused before any weight is read: an ``indexer_types`` entry (given or derived) other than
"full" or "shared", a "shared" first layer (no full layer before it to reuse; transformers fails
there in its forward pass), a list whose length is not ``num_hidden_layers``, and what
DeepSeek-V3.2 refuses (``rlx.models.families.deepseek_v32``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from rlx.models.families.common import refuse_unless, req, sigmoid_moe_from_hf, sigmoid_moe_to_hf
from rlx.models.families.deepseek_v32 import MLA_CHOICES, dsa_fields, dsa_to_hf
from rlx.models.families.spec import MLA_TARGETS, FamilySpec, MoENames
from rlx.models.hparams import ModelConfig, ModelConfigError

# transformers' defaults for the optional fields of GlmMoeDsaConfig
_DEFAULTS = {"n_shared_experts": 1, "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1,
             "first_k_dense_replace": 3, "norm_topk_prob": True}
INDEXER_TYPES = ("full", "shared")  # indexer_types values rlx implements

PRESETS = {
    # 78 layers (the first 3 dense), 64 MLA heads (q latent 2048, key 192 + 64, value 256), 256
    # experts of 2048 in one group, a 32-head indexer keeping 2048 keys per query in every layer;
    # its one multi-token-prediction layer is not part of rlx's model
    "zai-org/GLM-5": {
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
        "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288,
        "moe_intermediate_size": 2048, "num_hidden_layers": 78, "num_attention_heads": 64,
        "num_key_value_heads": 64, "q_lora_rank": 2048, "kv_lora_rank": 512,
        "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1,
        "topk_group": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
        "num_nextn_predict_layers": 1, "max_position_embeddings": 202752, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu",
        "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": [154820, 154827, 154829],
    },
}


def indexer_types(hf: Mapping[str, Any]) -> list[str]:
    """``indexer_types`` as transformers fills it in, checked."""
    layers = int(req(hf, "num_hidden_layers"))
    types, pattern = hf.get("indexer_types"), hf.get("index_topk_pattern")
    if types is None and pattern is not None:
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
    if types is None:
        freq = max(int(hf.get("index_topk_freq") or 1), 1)
        offset = int(hf.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    for t in types:
        refuse_unless("indexer_types[...]", t, INDEXER_TYPES, "GlmMoeDsaForCausalLM")
    if len(types) != layers:
        raise ModelConfigError(f"config.json indexer_types has {len(types)} entries; "
                               f"num_hidden_layers={layers} needs one per layer")
    if types and types[0] == "shared":
        raise ModelConfigError("config.json indexer_types[0]='shared' has no earlier 'full' layer "
                               "whose top-k selection it could reuse; make the first layer 'full'")
    return list(types)


def _extra_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    shared = tuple(i for i, t in enumerate(indexer_types(hf)) if t == "shared")
    out = dsa_fields(hf, "GlmMoeDsaForCausalLM", _DEFAULTS, heads=32, interleave=True)
    return out | {"dsa": dataclasses.replace(out["dsa"], shared_layers=shared)}


def _extra_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    shared = cfg.dsa.shared_layers
    return dsa_to_hf(cfg) | {"indexer_types": ["shared" if i in shared else "full"
                                               for i in range(cfg.num_layers)]}


SPEC = FamilySpec(
    model_type="glm_moe_dsa",
    architectures=("GlmMoeDsaForCausalLM",),
    attention="dsa",
    mlp="moe",
    lora_targets=MLA_TARGETS,
    presets=PRESETS,
    choices=MLA_CHOICES,
    moe_from_hf=functools.partial(sigmoid_moe_from_hf, defaults=_DEFAULTS),
    extra_from_hf=_extra_from_hf,
    extra_to_hf=_extra_to_hf,
    moe_to_hf=sigmoid_moe_to_hf,
    moe_names=MoENames(shared="shared_experts"),
    peft_remaps_mlp_names=True,
)
