"""Reading and writing helpers the family modules share: required and refused ``config.json``
fields, the Qwen-style and the DeepSeek-V3-style (sigmoid-routed) MoE sections, and the special
token ids of the Qwen presets.

``Qwen2-MoE`` / ``Qwen3-MoE`` list their sparse layers by ``decoder_sparse_step`` and
``mlp_only_layers``; DeepSeek-V3 / GLM-4.5 use the sigmoid router with a correction bias,
group-limited top-k and ungated shared experts, their first ``first_k_dense_replace`` layers dense.
Optional fields take the defaults of the transformers config class.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlx.models.hparams import ModelConfig, ModelConfigError, MoEConfig

QWEN_SPECIAL_TOKENS = {"bos_token_id": 151643, "eos_token_id": 151645}  # Qwen2.5 / Qwen3 releases
# the only values the sigmoid-routed transformers classes implement
SIGMOID_CHOICES = (("scoring_func", ("sigmoid",)), ("topk_method", ("noaux_tc",)))


def req(hf: Mapping[str, Any], key: str, where: str = "") -> Any:
    """``hf[key]``, refused with ``ModelConfigError`` when missing or null."""
    if hf.get(key) is None:
        raise ModelConfigError(f"config.json is missing required field {where + key!r}")
    return hf[key]


def refuse_unless(field: str, value: Any, supported, arch: str = "") -> None:
    """Refuse ``value`` of config.json ``field`` unless it is one of ``supported``."""
    if value not in supported:
        scope = f" for {arch}" if arch else ""
        raise ModelConfigError(f"config.json {field}={value!r} is not supported{scope}; rlx "
                               f"supports {list(supported)}")


def qwen_moe_from_hf(hf: Mapping[str, Any], layers: int, *, shared: bool) -> MoEConfig:
    """Qwen2-MoE (``shared``: a sigmoid-gated shared expert) / Qwen3-MoE experts."""
    n = hf.get("num_experts") or hf.get("num_local_experts")
    if not n:
        raise ModelConfigError("config.json is missing required field 'num_experts'")
    step = int(hf.get("decoder_sparse_step", 1)) or 1
    dense_only = set(hf.get("mlp_only_layers") or [])
    sparse = tuple(i for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
    width = int(hf.get("shared_expert_intermediate_size", 0) or 0) if shared else 0
    return MoEConfig(
        num_experts=int(n),
        top_k=req(hf, "num_experts_per_tok"),
        intermediate_size=req(hf, "moe_intermediate_size"),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        shared_intermediate_size=width,
        shared_expert_gate=width > 0,
        sparse_layers=sparse,
    )


def qwen_moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The Qwen-MoE fields of ``cfg``'s sparse MLP (inverse of ``qwen_moe_from_hf``)."""
    m = cfg.moe
    return {
        "num_experts": m.num_experts,
        "num_experts_per_tok": m.top_k,
        "moe_intermediate_size": m.intermediate_size,
        "norm_topk_prob": m.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(cfg.num_layers) if i not in m.sparse_layers],
    }


def sigmoid_moe_from_hf(hf: Mapping[str, Any], layers: int, defaults: Mapping[str, Any]) -> MoEConfig:
    """DeepSeek-V3 / GLM-4.5: sigmoid router with correction bias, ungated shared experts and the
    first ``first_k_dense_replace`` layers dense (``defaults``: the config class's defaults)."""
    get = {k: hf.get(k) if hf.get(k) is not None else v for k, v in defaults.items()}
    width = int(req(hf, "moe_intermediate_size"))
    first_dense = int(get["first_k_dense_replace"])
    return MoEConfig(
        num_experts=int(hf.get("n_routed_experts") or req(hf, "num_local_experts")),
        top_k=int(req(hf, "num_experts_per_tok")),
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


def sigmoid_moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The sigmoid-routed MoE fields of ``cfg`` (inverse of ``sigmoid_moe_from_hf``); a MoE these
    classes cannot express is refused."""
    m = cfg.moe
    first_dense = cfg.first_k_dense_replace
    if first_dense is None or m.router != "sigmoid" or not m.correction_bias or m.shared_expert_gate:
        raise ModelConfigError(
            f"{cfg.architecture} needs a sigmoid router with correction bias, ungated shared "
            f"experts and sparse layers first_k_dense_replace..{cfg.num_layers - 1}; got {m}")
    return {
        "n_routed_experts": m.num_experts, "num_experts_per_tok": m.top_k,
        "moe_intermediate_size": m.intermediate_size, "n_shared_experts": m.num_shared_experts,
        "routed_scaling_factor": m.routed_scaling_factor, "n_group": m.n_group,
        "topk_group": m.topk_group, "norm_topk_prob": m.norm_topk_prob,
        "first_k_dense_replace": first_dense,
    }


__all__ = ["QWEN_SPECIAL_TOKENS", "SIGMOID_CHOICES", "req", "refuse_unless", "qwen_moe_from_hf",
           "qwen_moe_to_hf", "sigmoid_moe_from_hf", "sigmoid_moe_to_hf"]
