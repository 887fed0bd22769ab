"""Model hyper-parameters, read from and written to transformers ``config.json`` dicts.

One ``ModelConfig`` describes every supported decoder: Llama (incl. llama3 rope scaling), Qwen2
(qkv bias), Qwen3 (q/k RMSNorm), Mixtral, Qwen2-MoE (shared expert with a sigmoid gate) and
Qwen3-MoE. Unknown architectures are refused with the list of supported ones.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


class ModelConfigError(ValueError):
    """A model config that rlx cannot represent; the message names the field."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: ``default`` or ``llama3`` frequency scaling."""

    theta: float = 10000.0
    kind: str = "default"  # "default" | "llama3" | "linear"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Sparse MLP: ``num_experts`` experts, ``top_k`` per token, optional shared expert."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool  # renormalise the top-k softmax probabilities to sum to 1
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(x @ w) scales the shared expert
    sparse_layers: tuple[int, ...] = ()  # layer indices with a sparse MLP; the others are dense


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder hyper-parameters (HF names in comments where they differ)."""

    architecture: str  # HF class name, e.g. "Qwen3ForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int  # num_hidden_layers
    num_heads: int  # num_attention_heads
    num_kv_heads: int  # num_key_value_heads
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    qkv_bias: bool = False  # Qwen2 / Qwen2-MoE
    qk_norm: bool = False  # Qwen3 / Qwen3-MoE
    tie_word_embeddings: bool = False
    moe: MoEConfig | None = None
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    hidden_act: str = "silu"

    @property
    def model_type(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    def is_sparse_layer(self, i: int) -> bool:
        return self.moe is not None and i in self.moe.sparse_layers

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        d, v, hd = self.hidden_size, self.vocab_size, self.head_dim
        attn = d * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
        attn += hd * (self.num_heads + 2 * self.num_kv_heads) if self.qkv_bias else 0
        attn += 2 * hd if self.qk_norm else 0
        total = v * d * (1 if self.tie_word_embeddings else 2) + d
        for i in range(self.num_layers):
            total += attn + 2 * d + self._mlp_params(i)
        return total

    def _mlp_params(self, i: int) -> int:
        d = self.hidden_size
        if not self.is_sparse_layer(i):
            return 3 * d * self.intermediate_size
        m = self.moe
        n = m.num_experts * 3 * d * m.intermediate_size + d * m.num_experts
        n += 3 * d * m.shared_intermediate_size + (d if m.shared_expert_gate else 0)
        return n


def from_hf_config(hf: dict[str, Any]) -> ModelConfig:
    """Translate a transformers ``config.json`` dict into a ``ModelConfig``."""
    archs = hf.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelConfigError(
            f"config.json architectures={archs!r} is not supported; rlx supports "
            f"{sorted(SUPPORTED_ARCHITECTURES)}"
        )
    kind = SUPPORTED_ARCHITECTURES[arch]
    heads = _req(hf, "num_attention_heads")
    hidden = _req(hf, "hidden_size")
    head_dim = hf.get("head_dim") or hidden // heads
    layers = _req(hf, "num_hidden_layers")
    return ModelConfig(
        architecture=arch,
        vocab_size=_req(hf, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_req(hf, "intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_hf(hf),
        qkv_bias=bool(hf.get("qkv_bias", kind in ("qwen2", "qwen2_moe")))
        or bool(hf.get("attention_bias", False)),
        qk_norm=kind in ("qwen3", "qwen3_moe"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        moe=_moe_from_hf(hf, kind, layers),
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        hidden_act=hf.get("hidden_act", "silu"),
    )


def _req(hf: dict[str, Any], key: str) -> Any:
    if hf.get(key) is None:
        raise ModelConfigError(f"config.json is missing required field {key!r}")
    return hf[key]


def _rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "llama3", "linear"):
        raise ModelConfigError(
            f"rope_type={kind!r} is not supported; use 'default', 'llama3' or 'linear'"
        )
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", hf.get("max_position_embeddings", 8192))
        ),
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
    return out


def _moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    m = cfg.moe
    assert m is not None
    if cfg.model_type == "mixtral":
        return {"num_local_experts": m.num_experts, "num_experts_per_tok": m.top_k}
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
