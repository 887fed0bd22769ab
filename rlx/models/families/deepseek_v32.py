"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``): DeepSeek-V3's multi-head latent attention and
sigmoid-routed MoE with DeepSeek sparse attention (``rlx.models.dsa``): a lightning indexer in
every layer (``index_topk``, ``index_head_dim``, ``index_n_heads``) whose rotary pairs are
half-split. The reading and writing of the DSA fields live here and serve GLM-5 too.

Refused before any weight is read: a ``layer_types`` entry other than ``indexed_attention``,
``mlp_layer_types`` other than ``first_k_dense_replace`` dense layers then sparse ones, a null
``q_lora_rank`` (the indexer reads the query latent), ``rope_interleave`` false (transformers'
class always interleaves the MLA rotary pairs). The multi-token-prediction layer of the release
(``num_nextn_predict_layers``, tensors ``model.layers.61.*``) is not part of rlx's model and is
not read, as transformers skips it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from rlx.models.families.common import (SIGMOID_CHOICES, refuse_unless, req,
                                        sigmoid_moe_from_hf, sigmoid_moe_to_hf)
from rlx.models.families.spec import MLA_TARGETS, FamilySpec, MoENames
from rlx.models.hparams import DSAConfig, ModelConfig, ModelConfigError

# transformers' defaults for the optional fields of DeepseekV32Config
_DEFAULTS = {"n_shared_experts": 1, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
             "first_k_dense_replace": 3, "norm_topk_prob": True}
INDEX_DEFAULTS = {"index_topk": 2048, "index_head_dim": 128}  # both classes' defaults
LAYER_TYPE = "indexed_attention"  # the one layer_types value of both classes
MLA_CHOICES = SIGMOID_CHOICES + (("rope_interleave", (True,)),)

PRESETS = {
    # DeepSeek-V3's shapes (61 layers, 128 heads, 256 experts in 8 groups, first 3 layers dense)
    # with a 64-head indexer keeping 2048 keys per query
    "deepseek-ai/DeepSeek-V3.2": {
        "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8,
        "topk_group": 4, "first_k_dense_replace": 3, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "index_topk": 2048, "index_head_dim": 128,
        "index_n_heads": 64, "num_nextn_predict_layers": 1, "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6, "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 10000, "factor": 40, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096},
        "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu",
        "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
    },
}


def check_layer_types(hf: Mapping[str, Any], arch: str, first_dense: int) -> None:
    """``layer_types`` (all ``indexed_attention``) and ``mlp_layer_types`` (``first_dense``
    dense layers, then sparse ones), where given."""
    layers = int(req(hf, "num_hidden_layers"))
    for t in hf.get("layer_types") or []:
        refuse_unless("layer_types[...]", t, (LAYER_TYPE,), arch)
    mlp = hf.get("mlp_layer_types")
    want = ["dense"] * min(first_dense, layers) + ["sparse"] * max(layers - first_dense, 0)
    if mlp is not None and list(mlp) != want:
        raise ModelConfigError(f"config.json mlp_layer_types={mlp!r} is not supported for {arch}; "
                               f"rlx supports first_k_dense_replace dense layers then sparse "
                               f"ones ({want!r})")


def dsa_from_hf(hf: Mapping[str, Any], *, heads: int, interleave: bool) -> DSAConfig:
    """The indexer's fields (``heads``: the class's default ``index_n_heads``)."""
    get = lambda k, default: int(hf.get(k) if hf.get(k) is not None else default)  # noqa: E731
    topk = get("index_topk", INDEX_DEFAULTS["index_topk"])
    if topk < 1:
        raise ModelConfigError(f"config.json index_topk={topk} must be at least 1")
    return DSAConfig(index_topk=topk, index_head_dim=get("index_head_dim",
                                                        INDEX_DEFAULTS["index_head_dim"]),
                     index_n_heads=get("index_n_heads", heads), rope_interleave=interleave)


def dsa_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The DSA and layer-kind fields transformers saves for both classes."""
    x, k = cfg.dsa, cfg.first_k_dense_replace
    return {"index_topk": x.index_topk, "index_head_dim": x.index_head_dim,
            "index_n_heads": x.index_n_heads, "layer_types": [LAYER_TYPE] * cfg.num_layers,
            "mlp_layer_types": ["dense" if not cfg.is_sparse_layer(i) else "sparse"
                                for i in range(cfg.num_layers)],
            "first_k_dense_replace": cfg.num_layers if k is None else k}


def dsa_fields(hf: Mapping[str, Any], arch: str, defaults: Mapping[str, Any], *, heads: int,
               interleave: bool) -> dict[str, Any]:
    """Both classes' ``extra_from_hf``: the layer kinds checked (``first_k_dense_replace`` from
    ``defaults`` when absent), the indexer's rotary layout refused unless it is the class's
    (``interleave``), and its fields (``heads``: the default ``index_n_heads``)."""
    first = hf.get("first_k_dense_replace")
    check_layer_types(hf, arch, defaults["first_k_dense_replace"] if first is None else int(first))
    refuse_unless("indexer_rope_interleave", hf.get("indexer_rope_interleave", interleave),
                  (interleave,), arch)
    return {"dsa": dsa_from_hf(hf, heads=heads, interleave=interleave)}


def _extra_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    return dsa_fields(hf, "DeepseekV32ForCausalLM", _DEFAULTS, heads=64, interleave=False)


SPEC = FamilySpec(
    model_type="deepseek_v32",
    architectures=("DeepseekV32ForCausalLM",),
    attention="dsa",
    mlp="moe",
    lora_targets=MLA_TARGETS,
    presets=PRESETS,
    choices=MLA_CHOICES,
    moe_from_hf=functools.partial(sigmoid_moe_from_hf, defaults=_DEFAULTS),
    extra_from_hf=_extra_from_hf,
    extra_to_hf=dsa_to_hf,
    moe_to_hf=sigmoid_moe_to_hf,
    moe_names=MoENames(shared="shared_experts"),
    peft_remaps_mlp_names=True,
)
