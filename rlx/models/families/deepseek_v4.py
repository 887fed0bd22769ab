"""DeepSeek-V4 (``DeepseekV4ForCausalLM``, ``model_type`` ``deepseek_v4``): its own decoder
(``rlx.models.deepseek_v4.model``), read and written here.

``config.json`` is read as transformers' ``DeepseekV4Config`` reads it: ``layer_types`` (or the
legacy per-layer ``compress_ratios`` 0 / 4 / 128, or the V4-Pro default: two heavily compressed
layers then compressed sparse / heavily compressed alternating), ``compress_rates`` (or legacy
``compress_rate_csa`` / ``compress_rate_hca``), ``mlp_layer_types`` (or the first
``num_hash_layers``, default 3, hashed), ``partial_rotary_factor`` (or legacy
``qk_rope_head_dim / head_dim``, default 64 / 512), and ``rope_parameters`` either nested
(``main`` / ``compress``) or flat (the ``compress`` table's scaling, at ``compress_rope_theta``;
``main`` plain at ``rope_theta``; a YaRN ``compress`` table leaves cos/sin unscaled unless
``attention_factor`` is given).

Refused before any weight is read, naming the field and the values rlx implements (``CHOICES``
and ``_check``): another ``hidden_act`` or ``scoring_func``; ``num_key_value_heads`` other than 1
(shared-KV attention); ``attention_bias`` / ``mlp_bias`` / ``tie_word_embeddings`` true;
``norm_topk_prob`` false and ``n_shared_experts`` other than 1 (transformers' class renormalises
and builds one shared expert whatever they say); a ``layer_types`` / ``mlp_layer_types`` entry or
a ``compress_ratios`` value outside the class's; ``o_groups`` not dividing the heads; a rope table
type other than ``default`` (``main``) or ``default`` / ``yarn`` (``compress``); a rotary width
that is odd or wider than ``index_head_dim``.

The multi-token-prediction layers (``num_nextn_predict_layers``; tensors under ``mtp.``) are not
part of rlx's model, as transformers does not build them: their tensors are skipped with a logged
note, and any other tensor rlx does not hold is refused.

Training: in mode B ``rlx.quant.apply_lora`` adapts the query projections (targets ``q_a``,
``q_b``), the shared key-value projection (``kv``), the grouped output's second projection
(``o_b``; the grouped ``wo_a`` takes none), the routed experts and the shared expert (``gate``,
``up``, ``down``); nothing else trains. In mode A every ``nnx.Param`` trains (attention, compressors, hyper-connections, router,
experts); the indexer's weights, the routers' correction biases and the hash tables are frozen
buffers in both modes (``rlx.models.deepseek_v4.compressor``: DeepSeek trains its indexer with its own KL
loss against the main attention, which rlx does not implement, so rlx keeps the released indexer).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlx.models.families.common import refuse_unless, req
from rlx.models.deepseek_v4.hash_moe import SCORING
from rlx.models.hparams import ModelConfigError, RopeConfig
from rlx.models.deepseek_v4.attention import CSA, HCA, LAYER_TYPES, SLIDING, V4Attn
from rlx.models.safetensors_io import SafetensorsFolder, save_sharded
from rlx.models.deepseek_v4.model import HASH, MLP_LAYER_TYPES, ROUTED, DeepseekV4, V4Config
from rlx.models.deepseek_v4.rope import inv_freq
from rlx.models.deepseek_v4.weights import MTP_PREFIXES, entries, from_stored, stored_name, to_stored

log = logging.getLogger(__name__)

ARCH = "DeepseekV4ForCausalLM"
MODEL_TYPE = "deepseek_v4"
# transformers' DeepseekV4Config defaults of the optional fields rlx reads
DEFAULTS = {"rope_theta": 10000.0, "compress_rope_theta": 160000.0, "hc_mult": 4,
            "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "swiglu_limit": 10.0, "sliding_window": 128,
            "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128,
            "index_topk": 512, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-6,
            "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "num_key_value_heads": 1,
            "num_experts_per_tok": 6, "n_routed_experts": 256, "n_shared_experts": 1}
DEFAULT_RATES = {CSA: 4, HCA: 128}
RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}  # legacy compress_ratios values
CHOICES = (("hidden_act", ("silu",)), ("scoring_func", tuple(SCORING)),
           ("num_key_value_heads", (1,)), ("attention_bias", (False,)), ("mlp_bias", (False,)),
           ("tie_word_embeddings", (False,)), ("norm_topk_prob", (True,)),
           ("n_shared_experts", (1,)))
_CLASS_DEFAULTS = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                   "tie_word_embeddings": False, "norm_topk_prob": True}

_FLASH_RATIOS = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(41)] + [0]  # + the MTP layer's
# The published sizes. DeepSeek-V4-Flash: transformers 5.25's DeepseekV4Config defaults (its
# docstring's checkpoint is deepseek-ai/DeepSeek-V4-Flash-Base) with the release's per-layer
# compress_ratios (two sliding layers, then compressed sparse / heavily compressed alternating);
# 284.3B parameters without the MTP layer, the published 284B. DeepSeek-V4-Pro: the published
# architecture (7168 wide, 61 layers, 128 heads of 512, q_lora_rank 1536, 16 output groups of
# 1024, 384 experts of 3072 with 6 routed, indexer top-1024, YaRN x16 from 65536 positions on the
# compress table) with transformers' default layer schedule (two heavily compressed layers, then
# alternating); 1.573T parameters and about 49.8B active, the published 1.6T / 49B.
_COMMON = {"architectures": [ARCH], "model_type": MODEL_TYPE, "vocab_size": 129280,
           "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
           "num_experts_per_tok": 6, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus",
           "norm_topk_prob": True, "routed_scaling_factor": 1.5, "num_hash_layers": 3,
           "sliding_window": 128, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
           "swiglu_limit": 10.0, "index_n_heads": 64, "index_head_dim": 128,
           "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
           "max_position_embeddings": 1048576, "num_nextn_predict_layers": 1,
           "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
           "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16"}
PRESETS = {
    "deepseek-ai/DeepSeek-V4-Flash": _COMMON | {
        "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64,
        "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "n_routed_experts": 256,
        "moe_intermediate_size": 2048, "index_topk": 512, "compress_ratios": _FLASH_RATIOS},
    "deepseek-ai/DeepSeek-V4-Pro": _COMMON | {
        "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
        "q_lora_rank": 1536, "o_groups": 16, "o_lora_rank": 1024, "n_routed_experts": 384,
        "moe_intermediate_size": 3072, "index_topk": 1024,
        "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1}},
}


def _get(hf: Mapping[str, Any], key: str) -> Any:
    value = hf.get(key)
    return DEFAULTS.get(key, _CLASS_DEFAULTS.get(key)) if value is None else value


def _layer_types(hf: Mapping[str, Any], n: int) -> tuple[str, ...]:
    types = hf.get("layer_types")
    if types is None and hf.get("compress_ratios") is not None:
        for r in hf["compress_ratios"]:
            refuse_unless("compress_ratios[...]", r, tuple(RATIO_TO_TYPE), ARCH)
        types = [RATIO_TO_TYPE[r] for r in hf["compress_ratios"]]
    if types is None:
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    return _per_layer("layer_types", types, LAYER_TYPES, n)


def _mlp_layer_types(hf: Mapping[str, Any], n: int) -> tuple[str, ...]:
    types = hf.get("mlp_layer_types")
    if types is None:
        k = hf.get("num_hash_layers")
        k = 3 if k is None else int(k)
        types = [HASH] * min(n, k) + [ROUTED] * max(0, n - k)
    return _per_layer("mlp_layer_types", types, MLP_LAYER_TYPES, n)


def _per_layer(field: str, types, allowed: tuple[str, ...], n: int) -> tuple[str, ...]:
    """The first ``n`` entries of a per-layer list, each one of ``allowed``; refused when there
    are fewer than ``n``."""
    for t in types:
        refuse_unless(f"{field}[...]", t, allowed, ARCH)
    if len(types) < n:
        raise ModelConfigError(f"config.json {field} has {len(types)} entries for "
                               f"num_hidden_layers={n}; give one per layer")
    return tuple(types[:n])


def _rates(hf: Mapping[str, Any]) -> dict[str, int]:
    rates = dict(hf.get("compress_rates") or DEFAULT_RATES)
    for key, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if hf.get(key) is not None:
            rates[kind] = hf[key]
    for kind in (CSA, HCA):
        if int(rates.get(kind, 0)) < 1:
            raise ModelConfigError(f"config.json compress_rates[{kind!r}]={rates.get(kind)!r} "
                                   "must be a positive integer")
    return {k: int(rates[k]) for k in (CSA, HCA)}


def _rope_tables(hf: Mapping[str, Any], partial: float) -> dict[str, dict[str, Any]]:
    """The nested ``{"main": ..., "compress": ...}`` tables as transformers builds them."""
    rp = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return {"main": dict(rp["main"]), "compress": dict(rp["compress"])}
    flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
    main = {"rope_type": "default", "rope_theta": _get(hf, "rope_theta"),
            "partial_rotary_factor": partial}
    compress = {**flat, "rope_theta": _get(hf, "compress_rope_theta"),
                "partial_rotary_factor": partial}
    compress["rope_type"] = compress.get("rope_type", compress.pop("type", "default"))
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return {"main": main, "compress": compress}


def _rope_config(table: Mapping[str, Any], field: str, kinds: tuple[str, ...], hf) -> RopeConfig:
    kind = table.get("rope_type", table.get("type", "default"))
    refuse_unless(f"rope_parameters[{field!r}].rope_type", kind, kinds, ARCH)
    if kind == "default":
        return RopeConfig(theta=float(table["rope_theta"]))
    return RopeConfig(
        theta=float(table["rope_theta"]), kind="yarn", factor=float(req(table, "factor", field)),
        original_max_position_embeddings=int(table.get("original_max_position_embeddings")
                                             or req(hf, "max_position_embeddings")),
        beta_fast=float(table.get("beta_fast", 32.0)), beta_slow=float(table.get("beta_slow", 1.0)),
        attention_factor=float(table.get("attention_factor", 1.0)))  # transformers: truncated


def _check(hf: Mapping[str, Any]) -> None:
    for field, allowed in CHOICES:
        refuse_unless(field, _get(hf, field), allowed, ARCH)
    heads, groups = int(req(hf, "num_attention_heads")), int(_get(hf, "o_groups"))
    if heads % groups:
        raise ModelConfigError(f"config.json o_groups={groups} must divide "
                               f"num_attention_heads={heads}")


def _partial(hf: Mapping[str, Any], head_dim: int) -> float:
    if hf.get("partial_rotary_factor") is not None:
        return float(hf["partial_rotary_factor"])
    if hf.get("qk_rope_head_dim") is not None:
        return int(hf["qk_rope_head_dim"]) / head_dim
    return 64 / 512


def _attn(hf: Mapping[str, Any], rates: dict[str, int]) -> tuple[V4Attn, dict]:
    head_dim = int(req(hf, "head_dim"))
    partial = _partial(hf, head_dim)
    rope_dim, index_dim = int(head_dim * partial), int(_get(hf, "index_head_dim"))
    if rope_dim % 2 or rope_dim > min(head_dim, index_dim):
        raise ModelConfigError(f"config.json partial_rotary_factor={partial} gives a rotary width "
                               f"of {rope_dim}; it must be even and at most head_dim={head_dim} "
                               f"and index_head_dim={index_dim}")
    tables = _rope_tables(hf, partial)
    main = _rope_config(tables["main"], "main", ("default",), hf)
    compress = _rope_config(tables["compress"], "compress", ("default", "yarn"), hf)
    attn = V4Attn(
        hidden=int(req(hf, "hidden_size")), heads=int(req(hf, "num_attention_heads")),
        head_dim=head_dim, rope_dim=rope_dim, q_lora_rank=int(req(hf, "q_lora_rank")),
        o_groups=int(_get(hf, "o_groups")), o_lora_rank=int(_get(hf, "o_lora_rank")),
        window=int(_get(hf, "sliding_window")), compress_rates=tuple(sorted(rates.items())),
        index_heads=int(_get(hf, "index_n_heads")), index_head_dim=index_dim,
        index_topk=int(_get(hf, "index_topk")), eps=float(_get(hf, "rms_norm_eps")),
        main_freqs=tuple(float(f) for f in inv_freq(main, rope_dim)),
        compress_freqs=tuple(float(f) for f in inv_freq(compress, rope_dim)),
        compress_scale=compress.cos_sin_scale())
    return attn, tables


def from_hf_config(hf: Mapping[str, Any]) -> V4Config:
    """The decoder's record from a ``DeepseekV4ForCausalLM`` ``config.json`` (module docstring);
    refuses what rlx does not implement before any weight is read."""
    archs = list(hf.get("architectures") or [ARCH])
    if ARCH not in archs:
        raise ModelConfigError(f"config.json architectures={archs!r} is not {ARCH!r}")
    _check(hf)
    n = int(req(hf, "num_hidden_layers"))
    rates = _rates(hf)
    attn, tables = _attn(hf, rates)
    mtp = int(_get(hf, "num_nextn_predict_layers"))
    if mtp:
        log.info("%s: the %d multi-token-prediction layer(s) (num_nextn_predict_layers, tensors "
                 "under 'mtp.') are not part of rlx's model and are not read, as transformers "
                 "does not build them", ARCH, mtp)
    return V4Config(
        vocab_size=int(req(hf, "vocab_size")), hidden_size=attn.hidden, attn=attn,
        layer_types=_layer_types(hf, n), mlp_layer_types=_mlp_layer_types(hf, n),
        moe_intermediate_size=int(req(hf, "moe_intermediate_size")),
        n_routed_experts=int(_get(hf, "n_routed_experts")),
        num_experts_per_tok=int(_get(hf, "num_experts_per_tok")),
        scoring_func=str(_get(hf, "scoring_func")),
        routed_scaling_factor=float(_get(hf, "routed_scaling_factor")),
        swiglu_limit=float(_get(hf, "swiglu_limit")), hc_mult=int(_get(hf, "hc_mult")),
        hc_sinkhorn_iters=int(_get(hf, "hc_sinkhorn_iters")), hc_eps=float(_get(hf, "hc_eps")),
        rms_norm_eps=attn.eps, num_nextn_predict_layers=mtp,
        rope_tables=tuple((k, tuple(sorted((f, _frozen(x)) for f, x in v.items())))
                          for k, v in sorted(tables.items())),
        extra=tuple((k, _frozen(hf[k])) for k in ("max_position_embeddings", "bos_token_id",
                                                  "eos_token_id", "pad_token_id") if k in hf))


def to_hf_config(cfg: V4Config) -> dict[str, Any]:
    """The ``config.json`` transformers reads back as ``cfg`` (inverse of ``from_hf_config``)."""
    a = cfg.attn
    return {
        "architectures": [ARCH], "model_type": MODEL_TYPE, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": a.heads,
        "num_key_value_heads": 1, "head_dim": a.head_dim, "q_lora_rank": a.q_lora_rank,
        "partial_rotary_factor": a.rope_dim / a.head_dim,
        "num_experts_per_tok": cfg.num_experts_per_tok, "n_routed_experts": cfg.n_routed_experts,
        "n_shared_experts": 1, "scoring_func": cfg.scoring_func, "norm_topk_prob": True,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "layer_types": list(cfg.layer_types), "compress_rates": dict(a.compress_rates),
        "hc_mult": cfg.hc_mult, "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps,
        "mlp_layer_types": list(cfg.mlp_layer_types), "swiglu_limit": cfg.swiglu_limit,
        "sliding_window": a.window, "o_groups": a.o_groups, "o_lora_rank": a.o_lora_rank,
        "index_n_heads": a.index_heads, "index_head_dim": a.index_head_dim,
        "index_topk": a.index_topk, "num_nextn_predict_layers": 0,
        "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu", "tie_word_embeddings": False,
        "rope_parameters": {k: {f: _thawed(x) for f, x in v} for k, v in cfg.rope_tables},
        **{k: _thawed(v) for k, v in cfg.extra},
    }


def _frozen(x):
    return tuple(x) if isinstance(x, list) else x


def _thawed(x):
    return list(x) if isinstance(x, tuple) else x


def _variable(model: DeepseekV4, path: str) -> nnx.Variable:
    node = model
    for part in path.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


def _check_names(cfg: V4Config, tensors: Mapping) -> None:
    """Refuse a tensor rlx would not read (MTP layers are skipped with a note)."""
    wanted = set()
    for e in entries(cfg):
        names = ([e.name.format(e=i) for i in range(cfg.n_routed_experts)]
                 if e.layout == "expert" else [e.name])
        wanted |= {stored_name(tensors, n) for n in names}
    mtp = [n for n in tensors if n.startswith(MTP_PREFIXES)]
    if mtp:
        log.info("%s: skipped %d multi-token-prediction tensor(s) (%s...): rlx's model has no "
                 "MTP layers", ARCH, len(mtp), mtp[0])
    unknown = sorted(n for n in tensors if n not in wanted and not n.startswith(MTP_PREFIXES))
    if unknown:
        raise ModelConfigError(f"{len(unknown)} tensor(s) of the checkpoint are not part of "
                               f"{ARCH} as config.json describes it, e.g. {unknown[:3]}")


def load(path: str, dtype=jnp.float32, param_dtype=jnp.float32) -> DeepseekV4:
    """A ``DeepseekV4`` with the weights of the HF folder at ``path`` (config checked first)."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = from_hf_config(json.load(f))
    tensors = SafetensorsFolder(path)
    _check_names(cfg, tensors)
    model = nnx.eval_shape(lambda: DeepseekV4(cfg, dtype=dtype, param_dtype=param_dtype,
                                              rngs=nnx.Rngs(0)))
    for e in entries(cfg):
        var = _variable(model, e.path)
        value = from_stored(e, tensors, cfg.n_routed_experts, cfg.attn.o_groups)
        if tuple(value.shape) != tuple(var.shape):
            raise ModelConfigError(f"tensor {e.name} holds shape {value.shape}; config.json "
                                   f"implies {tuple(var.shape)}")
        var.set_value(jnp.asarray(value, var.dtype))
    return model


def state_dict(model: DeepseekV4) -> dict[str, np.ndarray]:
    """Every weight under its checkpoint name, in transformers' layout (f32; tables int64)."""
    out: dict[str, np.ndarray] = {}
    for e in entries(model.cfg):
        value = np.asarray(_variable(model, e.path)[...])
        out |= to_stored(e, value if e.layout == "table" else value.astype(np.float32))
    return out


def to_hf(model: DeepseekV4, path: str) -> None:
    """Write ``model`` as an HF folder transformers loads (``config.json`` + safetensors)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(to_hf_config(model.cfg), f, indent=2)
    save_sharded(state_dict(model), path)
