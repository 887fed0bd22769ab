"""Model hyper-parameters read from and written to transformers ``config.json`` dicts.

``from_hf_config`` turns a ``config.json`` dict into a ``ModelConfig`` (the records live in
``rlx.models.hparams`` and are re-exported here); ``to_hf_config`` is its inverse and writes what
transformers 5.x itself saves for the class. Every option rlx interprets is checked here, before
any weight is read: an architecture, rope type, router scoring function, top-k method or
activation rlx does not implement is refused with ``ModelConfigError`` naming the field and the
supported values. Optional fields take the defaults of the transformers config class, so a
``config.json`` means what it means to transformers.

DeepSeek-V3 (``DeepseekV3ForCausalLM``, also Kimi-K2 and DeepSeek-V2-Lite shapes) and GLM-4.5
(``Glm4MoeForCausalLM``) use the sigmoid router with a correction bias and group-limited top-k
(``scoring_func="sigmoid"``, ``topk_method="noaux_tc"``, the only values their transformers
classes implement). GLM-4.5's ``partial_rotary_factor`` defaults to 0.5 as in transformers; the
other GQA families rotate whole heads and refuse a partial factor.
"""

from __future__ import annotations

from typing import Any

from rlx.models.hparams import (ROPE_KINDS, SUPPORTED_ARCHITECTURES, MLAConfig, ModelConfig,
                                ModelConfigError, MoEConfig, RopeConfig, yarn_get_mscale)

ACTIVATIONS = ("silu", "swish")  # hidden_act values rlx implements (both are x * sigmoid(x))
SIGMOID_ROUTED = ("deepseek_v3", "glm4_moe")  # model types with the DeepSeek-V3 router
# transformers' defaults for the optional fields of the sigmoid-routed config classes
_SIGMOID_DEFAULTS = {
    "deepseek_v3": {"n_shared_experts": 1, "routed_scaling_factor": 2.5, "n_group": 8,
                    "topk_group": 4, "first_k_dense_replace": 3, "norm_topk_prob": True},
    "glm4_moe": {"n_shared_experts": 1, "routed_scaling_factor": 1.0, "n_group": 1,
                 "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True},
}
_SIGMOID_CHOICES = {"scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",)}


def from_hf_config(hf: dict[str, Any]) -> ModelConfig:
    """Translate a transformers ``config.json`` dict into a ``ModelConfig``."""
    arch = _architecture(hf)
    kind = SUPPORTED_ARCHITECTURES[arch]
    _check_choices(hf, arch, kind)
    heads = _req(hf, "num_attention_heads")
    hidden = _req(hf, "hidden_size")
    layers = _req(hf, "num_hidden_layers")
    mla = _mla_from_hf(hf) if kind == "deepseek_v3" else None
    return ModelConfig(
        architecture=arch,
        vocab_size=_req(hf, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_req(hf, "intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads if mla else hf.get("num_key_value_heads") or heads,
        head_dim=mla.qk_head_dim if mla else hf.get("head_dim") or hidden // heads,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_hf(hf, arch, kind),
        qkv_bias=bool(hf.get("qkv_bias", kind in ("qwen2", "qwen2_moe")))
        or bool(hf.get("attention_bias", False)),
        qk_norm=kind in ("qwen3", "qwen3_moe") or (kind == "glm4_moe" and bool(hf.get("use_qk_norm"))),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        moe=_moe_from_hf(hf, kind, layers),
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos := hf.get("eos_token_id"), list) else eos,
        hidden_act=hf.get("hidden_act", "silu"),
        mla=mla,
    )


def _architecture(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelConfigError(
            f"config.json architectures={archs!r} is not supported; rlx supports "
            f"{sorted(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _req(hf: dict[str, Any], key: str, where: str = "") -> Any:
    if hf.get(key) is None:
        raise ModelConfigError(f"config.json is missing required field {where + key!r}")
    return hf[key]


_OUTPUT_BIASED = ("llama", "qwen3", "qwen3_moe")  # HF: o_proj bias = attention_bias


def _refuse_unless(field: str, value: Any, supported, arch: str = "") -> None:
    """Refuse ``value`` of config.json ``field`` unless it is one of ``supported``."""
    if value not in supported:
        scope = f" for {arch}" if arch else ""
        raise ModelConfigError(f"config.json {field}={value!r} is not supported{scope}; rlx "
                               f"supports {list(supported)}")


def _check_choices(hf: dict[str, Any], arch: str, kind: str) -> None:
    """Options with alternatives rlx does not implement (checked before anything else is read)."""
    _refuse_unless("hidden_act", hf.get("hidden_act", "silu"), ACTIVATIONS)
    if kind in _OUTPUT_BIASED:  # their attention_bias also biases o_proj, which rlx's GQA lacks
        _refuse_unless("attention_bias", bool(hf.get("attention_bias", False)), (False,), arch)
    if kind in SIGMOID_ROUTED:
        for field, supported in _SIGMOID_CHOICES.items():
            _refuse_unless(field, hf.get(field, supported[0]), supported, arch)


def _rope_params(hf: dict[str, Any]) -> dict[str, Any]:
    """The rope dict as transformers resolves it: ``rope_scaling`` (older files) over
    ``rope_parameters``, ``rope_theta`` from either level."""
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    return params


def _rope_from_hf(hf: dict[str, Any], arch: str, kind: str) -> RopeConfig:
    params = _rope_params(hf)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    _refuse_unless("rope_parameters.rope_type", rope_type, ROPE_KINDS)
    partial = float(params.get("partial_rotary_factor", hf.get(
        "partial_rotary_factor", 0.5 if kind == "glm4_moe" else 1.0)))
    if kind != "glm4_moe" and partial != 1.0:
        raise ModelConfigError(f"config.json partial_rotary_factor={partial} is not supported for "
                               f"{arch}; rlx rotates part of a head only for Glm4MoeForCausalLM")
    original = params.get("original_max_position_embeddings", hf.get("max_position_embeddings", 8192))
    return RopeConfig(
        theta=float(params["rope_theta"]),
        kind=rope_type,
        factor=float(_req(params, "factor", "rope_parameters.") if rope_type == "yarn"
                     else params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=_opt_float(params.get("mscale")),
        mscale_all_dim=_opt_float(params.get("mscale_all_dim")),
        attention_factor=_opt_float(params.get("attention_factor")),
        truncate=bool(params.get("truncate", True)),
        partial_rotary_factor=partial,
    )


def _opt_float(x) -> float | None:
    return None if x is None else float(x)


def _mla_from_hf(hf: dict[str, Any]) -> MLAConfig:
    q_rank = hf.get("q_lora_rank")
    return MLAConfig(
        q_lora_rank=None if q_rank is None else int(q_rank),
        kv_lora_rank=int(_req(hf, "kv_lora_rank")),
        qk_nope_head_dim=int(_req(hf, "qk_nope_head_dim")),
        qk_rope_head_dim=int(_req(hf, "qk_rope_head_dim")),
        v_head_dim=int(_req(hf, "v_head_dim")),
        rope_interleave=bool(hf.get("rope_interleave", True)),
    )


def _moe_from_hf(hf: dict[str, Any], kind: str, layers: int) -> MoEConfig | None:
    if kind == "mixtral":
        return MoEConfig(
            num_experts=_req(hf, "num_local_experts"),
            top_k=_req(hf, "num_experts_per_tok"),
            intermediate_size=_req(hf, "intermediate_size"),
            norm_topk_prob=True,
            sparse_layers=tuple(range(layers)),
        )
    if kind in SIGMOID_ROUTED:
        return _sigmoid_moe_from_hf(hf, kind, layers)
    if kind not in ("qwen2_moe", "qwen3_moe"):
        return None
    n = hf.get("num_experts") or hf.get("num_local_experts")
    if not n:
        raise ModelConfigError("config.json is missing required field 'num_experts'")
    step = int(hf.get("decoder_sparse_step", 1)) or 1
    dense_only = set(hf.get("mlp_only_layers") or [])
    sparse = tuple(i for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
    shared = int(hf.get("shared_expert_intermediate_size", 0) or 0) if kind == "qwen2_moe" else 0
    return MoEConfig(
        num_experts=int(n),
        top_k=_req(hf, "num_experts_per_tok"),
        intermediate_size=_req(hf, "moe_intermediate_size"),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        shared_intermediate_size=shared,
        shared_expert_gate=shared > 0,
        sparse_layers=sparse,
    )


def _sigmoid_moe_from_hf(hf: dict[str, Any], kind: str, layers: int) -> MoEConfig:
    """DeepSeek-V3 / GLM-4.5: sigmoid router with correction bias, ungated shared experts and the
    first ``first_k_dense_replace`` layers dense."""
    get = {k: hf.get(k) if hf.get(k) is not None else v for k, v in _SIGMOID_DEFAULTS[kind].items()}
    width = int(_req(hf, "moe_intermediate_size"))
    first_dense = int(get["first_k_dense_replace"])
    return MoEConfig(
        num_experts=int(hf.get("n_routed_experts") or _req(hf, "num_local_experts")),
        top_k=int(_req(hf, "num_experts_per_tok")),
        intermediate_size=width,
        norm_topk_prob=bool(get["norm_topk_prob"]),
        shared_intermediate_size=int(get["n_shared_experts"]) * width,
        sparse_layers=tuple(range(first_dense, layers)),
        router="sigmoid",
        correction_bias=True,
        n_group=int(get["n_group"]),
        topk_group=int(get["topk_group"]),
        routed_scaling_factor=float(get["routed_scaling_factor"]),
    )


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """A transformers ``config.json`` dict for ``cfg`` (inverse of ``from_hf_config``)."""
    hf: dict[str, Any] = {
        "architectures": [cfg.architecture],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "hidden_act": cfg.hidden_act,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "rope_theta": cfg.rope.theta,
        "rope_parameters": _rope_to_hf(cfg.rope),
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "torch_dtype": "float32",
    }
    if cfg.model_type in ("llama",):
        hf["attention_bias"] = cfg.qkv_bias
        hf["mlp_bias"] = False
    if cfg.mla is not None:
        hf.update(_mla_to_hf(cfg))
    if cfg.model_type == "glm4_moe":
        hf.update(attention_bias=cfg.qkv_bias, use_qk_norm=cfg.qk_norm,
                  partial_rotary_factor=cfg.rope.partial_rotary_factor)
    if cfg.moe is not None:
        hf.update(_moe_to_hf(cfg))
    return hf


def _rope_to_hf(rope: RopeConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_theta": rope.theta, "rope_type": rope.kind}
    if rope.kind == "llama3":
        out.update(
            factor=rope.factor,
            low_freq_factor=rope.low_freq_factor,
            high_freq_factor=rope.high_freq_factor,
            original_max_position_embeddings=rope.original_max_position_embeddings,
        )
    elif rope.kind == "linear":
        out["factor"] = rope.factor
    elif rope.kind == "yarn":
        out.update(factor=rope.factor, beta_fast=rope.beta_fast, beta_slow=rope.beta_slow,
                   original_max_position_embeddings=rope.original_max_position_embeddings)
        optional = {"mscale": rope.mscale, "mscale_all_dim": rope.mscale_all_dim,
                    "attention_factor": rope.attention_factor}
        out.update({k: v for k, v in optional.items() if v is not None})
        if not rope.truncate:
            out["truncate"] = False
    if rope.partial_rotary_factor != 1.0:
        out["partial_rotary_factor"] = rope.partial_rotary_factor
    return out


def _mla_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    m = cfg.mla
    assert m is not None
    return {
        "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim, "rope_interleave": m.rope_interleave,
        "head_dim": m.qk_rope_head_dim,  # what transformers sets and saves
        "attention_bias": cfg.qkv_bias,
    }


def _moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    m = cfg.moe
    assert m is not None
    if cfg.model_type == "mixtral":
        return {"num_local_experts": m.num_experts, "num_experts_per_tok": m.top_k}
    if cfg.model_type in SIGMOID_ROUTED:
        return _sigmoid_moe_to_hf(cfg)
    out: dict[str, Any] = {
        "num_experts": m.num_experts,
        "num_experts_per_tok": m.top_k,
        "moe_intermediate_size": m.intermediate_size,
        "norm_topk_prob": m.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(cfg.num_layers) if i not in m.sparse_layers],
    }
    if cfg.model_type == "qwen2_moe":
        out["shared_expert_intermediate_size"] = m.shared_intermediate_size
        out["qkv_bias"] = cfg.qkv_bias
    return out


def _sigmoid_moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    m = cfg.moe
    first_dense = cfg.first_k_dense_replace
    if first_dense is None or m.router != "sigmoid" or not m.correction_bias or m.shared_expert_gate:
        raise ModelConfigError(
            f"{cfg.architecture} needs a sigmoid router with correction bias, ungated shared "
            f"experts and sparse layers first_k_dense_replace..{cfg.num_layers - 1}; got {m}")
    out = {
        "n_routed_experts": m.num_experts, "num_experts_per_tok": m.top_k,
        "moe_intermediate_size": m.intermediate_size, "n_shared_experts": m.num_shared_experts,
        "routed_scaling_factor": m.routed_scaling_factor, "n_group": m.n_group,
        "topk_group": m.topk_group, "norm_topk_prob": m.norm_topk_prob,
        "first_k_dense_replace": first_dense,
    }
    if cfg.model_type == "deepseek_v3":  # moe_layer_freq: SGLang's DeepseekV2 model reads it
        out.update({k: v[0] for k, v in _SIGMOID_CHOICES.items()}, moe_layer_freq=1)
    return out


__all__ = ["SUPPORTED_ARCHITECTURES", "ACTIVATIONS", "ModelConfig", "ModelConfigError", "MoEConfig",
           "MLAConfig", "RopeConfig", "from_hf_config", "to_hf_config", "yarn_get_mscale"]
