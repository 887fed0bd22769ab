"""Model hyper-parameters read from and written to transformers ``config.json`` dicts.

``from_hf_config`` turns a ``config.json`` dict into a ``ModelConfig`` (the records live in
``rlx.models.hparams`` and are re-exported here); ``to_hf_config`` is its inverse and writes what
transformers 5.x itself saves for the class. Every option rlx interprets is checked here, before
any weight is read: an architecture, rope type, router scoring function, top-k method or
activation rlx does not implement is refused with ``ModelConfigError`` naming the field and the
supported values. Optional fields take the defaults of the transformers config class, so a
``config.json`` means what it means to transformers.

What differs between families is read from their specs (``rlx.models.families``, chosen by the
``architectures`` class): the options they refuse or restrict (``choices``, ``output_biased``,
``partial_rotary``), their defaults (``qkv_bias_default``, ``qk_norm``) and their MoE sections
(``moe_from_hf`` / ``moe_to_hf``) and extra fields (``extra_to_hf``). Multi-head latent attention
(the ``mla`` layer kind) reads and writes its own fields here. E.g. DeepSeek-V3 and GLM-4.5 use the
sigmoid router with ``scoring_func="sigmoid"`` and ``topk_method="noaux_tc"``, the only values
their transformers classes implement; GLM-4.5's ``partial_rotary_factor`` defaults to 0.5 as in
transformers, and the other GQA families rotate whole heads and refuse a partial factor.
"""

from __future__ import annotations

import logging
from typing import Any

from rlx.models.families import (BY_ARCHITECTURE, FAMILIES, OWN_DECODERS,
                                 SUPPORTED_ARCHITECTURES, FamilySpec, written_architecture)
from rlx.models.families.common import refuse_unless, req
from rlx.models.hparams import (ROPE_KINDS, MLAConfig, ModelConfig, ModelConfigError, MoEConfig,
                                RopeConfig, yarn_get_mscale)

ACTIVATIONS = ("silu", "swish")  # hidden_act values rlx implements (both are x * sigmoid(x))
log = logging.getLogger(__name__)


def from_hf_config(hf: dict[str, Any], *, text_only: bool = False) -> ModelConfig:
    """Translate a transformers ``config.json`` dict into a ``ModelConfig`` (``text_only``: a
    vision-language checkpoint's vision tower is skipped instead of refused)."""
    arch = _architecture(hf)
    spec = BY_ARCHITECTURE[arch]
    if spec.multimodal is not None:
        hf = language_model_config(hf, arch, spec, text_only)
    _check_choices(hf, arch, spec)
    heads = req(hf, "num_attention_heads")
    hidden = req(hf, "hidden_size")
    layers = req(hf, "num_hidden_layers")
    mla = _mla_from_hf(hf) if spec.attention in ("mla", "dsa") else None  # DSA is MLA + indexer
    fields = dict(
        architecture=arch,
        vocab_size=req(hf, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=req(hf, "intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads if mla else hf.get("num_key_value_heads") or heads,
        head_dim=mla.qk_head_dim if mla else hf.get("head_dim") or hidden // heads,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_hf(hf, arch, spec),
        qkv_bias=bool(hf.get("qkv_bias", spec.qkv_bias_default))
        or bool(hf.get("attention_bias", False)),
        qk_norm=_qk_norm(hf, spec),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        moe=spec.moe_from_hf(hf, layers) if spec.moe_from_hf is not None else None,
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos := hf.get("eos_token_id"), list) else eos,
        hidden_act=hf.get("hidden_act", "silu"),
        mla=mla,
    )
    if spec.extra_from_hf is not None:
        fields.update(spec.extra_from_hf(hf))
    return ModelConfig(**fields)


def _architecture(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    own = next((a for a in archs if a in OWN_DECODERS), None)
    if arch is None and own is not None:
        raise ModelConfigError(f"config.json architectures={archs!r}: {own} has a decoder of its "
                               "own, not a ModelConfig; load its folder with rlx.models.from_hf")
    if arch is None:
        raise ModelConfigError(
            f"config.json architectures={archs!r} is not supported; rlx supports "
            f"{sorted(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def language_model_config(hf: dict[str, Any], arch: str, spec: FamilySpec,
                          text_only: bool) -> dict[str, Any]:
    """The ``config.json`` fields of a vision-language checkpoint's language model: its text
    config with the wrapper's ``Multimodal.top_level`` fields over it. The vision tower is refused
    unless ``text_only``, then skipped with a logged note."""
    mm = spec.multimodal
    text = hf.get(mm.text_config)
    if not isinstance(text, dict):
        raise ModelConfigError(f"config.json of {arch} has no {mm.text_config!r} section; it holds "
                               "the language model's config")
    refuse_unless(f"{mm.text_config}.model_type", text.get("model_type"), mm.text_model_types, arch)
    vision = [f for f in mm.vision_fields if hf.get(f)]
    if vision and not text_only:
        raise ModelConfigError(
            f"config.json {vision[0]}: the vision tower of {arch} (tensors "
            f"{', '.join(w + '*' for w in mm.vision_weights)}) is not supported; rlx trains its "
            "language model on text: set config.model.text_only=True to load the language model "
            "and skip the vision tower")
    if vision:
        log.info("%s: text-only RL, skipping the vision tower (%s; tensors %s are not read)",
                 arch, ", ".join(vision), ", ".join(w + "*" for w in mm.vision_weights))
    return {**text, **{k: hf.get(k, default) for k, default in mm.top_level}}


def quantization_config(hf: dict[str, Any]) -> dict[str, Any] | None:
    """A ``config.json``'s ``quantization_config`` (None for a float checkpoint): at its top
    level, or in a vision-language checkpoint's text config (``Multimodal.text_config``)."""
    spec = next((BY_ARCHITECTURE[a] for a in hf.get("architectures") or []
                 if a in BY_ARCHITECTURE), None)
    text = hf.get(spec.multimodal.text_config) if spec and spec.multimodal else None
    return hf.get("quantization_config") or (text or {}).get("quantization_config") or None


def _qk_norm(hf: dict[str, Any], spec: FamilySpec) -> bool:
    """The family's constant, or the ``config.json`` field that switches the q/k norms."""
    return bool(hf.get(spec.qk_norm)) if isinstance(spec.qk_norm, str) else spec.qk_norm


def _check_choices(hf: dict[str, Any], arch: str, spec: FamilySpec) -> None:
    """Options with alternatives rlx does not implement (checked before anything else is read)."""
    refuse_unless("hidden_act", hf.get("hidden_act", "silu"), ACTIVATIONS)
    if spec.output_biased:  # their attention_bias also biases o_proj, which rlx's GQA lacks
        refuse_unless("attention_bias", bool(hf.get("attention_bias", False)), (False,), arch)
    for field, supported in spec.choices:
        refuse_unless(field, hf.get(field, supported[0]), supported, arch)


def _rope_params(hf: dict[str, Any]) -> dict[str, Any]:
    """The rope dict as transformers resolves it: ``rope_scaling`` (older files) over
    ``rope_parameters``, ``rope_theta`` from either level."""
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    return params


def _rope_from_hf(hf: dict[str, Any], arch: str, spec: FamilySpec) -> RopeConfig:
    params = _rope_params(hf)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    refuse_unless("rope_parameters.rope_type", rope_type, ROPE_KINDS)
    partial = float(params.get("partial_rotary_factor", hf.get(
        "partial_rotary_factor", 1.0 if spec.partial_rotary is None else spec.partial_rotary)))
    if spec.partial_rotary is None and partial != 1.0:
        partial_archs = ", ".join(a for s in FAMILIES.values() if s.partial_rotary is not None
                                  for a in s.architectures)
        raise ModelConfigError(f"config.json partial_rotary_factor={partial} is not supported for "
                               f"{arch}; rlx rotates part of a head only for {partial_archs}")
    original = params.get("original_max_position_embeddings", hf.get("max_position_embeddings", 8192))
    return RopeConfig(
        theta=float(params["rope_theta"]),
        kind=rope_type,
        factor=float(req(params, "factor", "rope_parameters.") if rope_type == "yarn"
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
        kv_lora_rank=int(req(hf, "kv_lora_rank")),
        qk_nope_head_dim=int(req(hf, "qk_nope_head_dim")),
        qk_rope_head_dim=int(req(hf, "qk_rope_head_dim")),
        v_head_dim=int(req(hf, "v_head_dim")),
        rope_interleave=bool(hf.get("rope_interleave", True)),
    )


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """A transformers ``config.json`` dict for ``cfg`` (inverse of ``from_hf_config``; the language
    model of a vision-language checkpoint as its causal-LM class): the fields every family has,
    then the family's own (``FamilySpec.extra_to_hf``), the latent attention's and the sparse
    MLP's (``FamilySpec.moe_to_hf``)."""
    arch = written_architecture(cfg)  # a vision-language model's language model: its own class
    spec = BY_ARCHITECTURE[arch]
    hf: dict[str, Any] = {
        "architectures": [arch],
        "model_type": spec.model_type,
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
    if spec.extra_to_hf is not None:
        hf.update(spec.extra_to_hf(cfg))
    if cfg.mla is not None:
        hf.update(_mla_to_hf(cfg))
    if cfg.moe is not None:
        hf.update(spec.moe_to_hf(cfg))
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


__all__ = ["SUPPORTED_ARCHITECTURES", "ACTIVATIONS", "ModelConfig", "ModelConfigError", "MoEConfig",
           "MLAConfig", "RopeConfig", "from_hf_config", "to_hf_config", "language_model_config",
           "quantization_config", "yarn_get_mscale"]
