"""DeepSeek-V4's tensor names and layouts: where each weight of ``rlx.models.deepseek_v4.model.DeepseekV4``
sits in a checkpoint, and its conversion both ways.

Names are DeepSeek's (``layers.{i}.attn.wq_a.weight``, ``attn.attn_sink``, ``ffn.gate.tid2eid``,
``ffn.experts.{e}.w1.weight``, ``hc_attn_fn``, ``head.weight``), under ``model.`` as transformers
saves them (``model.embed_tokens.weight``, ``model.hc_head.hc_fn``; ``head.weight`` at the top).
A checkpoint in DeepSeek's own layout (``embed.weight``, ``norm.weight``, ``hc_head_fn``, no
``model.`` prefix) is read too (``stored_name``). Layouts: ``linear`` (stored ``[out, in]``, held
``[in, out]``), ``raw`` (as stored), ``grouped`` (``wo_a``: stored ``[G * R, in_g]``, held
``[G, in_g, R]``), ``expert`` (one stored ``[out, in]`` per expert, held stacked ``[E, in, out]``),
``table`` (the int64 ``tid2eid``, held int32).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from rlx.models.deepseek_v4.attention import CSA, SLIDING
from rlx.models.deepseek_v4.model import HASH, V4Config

MTP_PREFIXES = ("mtp.", "model.mtp.")  # multi-token-prediction layers: never part of the model
# transformers' saved name -> DeepSeek's own, for the tensors outside the layers
_RAW_TOP = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
            "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
            "model.hc_head.hc_scale": "hc_head_scale"}


@dataclasses.dataclass(frozen=True)
class Entry:
    """One held weight: its attribute path in the model, its checkpoint name(s), its layout."""

    path: str  # dotted attribute path below the model ("layers.0.attn.q_a_proj.kernel")
    name: str  # checkpoint name; an ``expert`` entry's holds ``{e}``
    layout: str  # "linear" | "raw" | "grouped" | "expert" | "table"


def _compressor(us: str, hf: str) -> list[Entry]:
    return [Entry(f"{us}.wkv", f"{hf}.wkv.weight", "linear"),
            Entry(f"{us}.wgate", f"{hf}.wgate.weight", "linear"),
            Entry(f"{us}.ape", f"{hf}.ape", "raw"), Entry(f"{us}.norm", f"{hf}.norm.weight", "raw")]


def _attention(cfg: V4Config, i: int, us: str, hf: str) -> list[Entry]:
    out = [Entry(f"{us}.{a}.kernel", f"{hf}.{b}.weight", "linear")
           for a, b in (("q_a_proj", "wq_a"), ("q_b_proj", "wq_b"), ("kv_proj", "wkv"),
                        ("o_b_proj", "wo_b"))]
    out += [Entry(f"{us}.q_norm.weight", f"{hf}.q_norm.weight", "raw"),
            Entry(f"{us}.kv_norm.weight", f"{hf}.norm.weight", "raw"),
            Entry(f"{us}.wo_a", f"{hf}.wo_a.weight", "grouped"),
            Entry(f"{us}.attn_sink", f"{hf}.attn_sink", "raw")]
    kind = cfg.layer_types[i]
    if kind != SLIDING:
        out += _compressor(f"{us}.compressor", f"{hf}.compressor")
    if kind == CSA:
        out += _compressor(f"{us}.indexer.compressor", f"{hf}.indexer.compressor")
        out += [Entry(f"{us}.indexer.wq_b", f"{hf}.indexer.wq_b.weight", "linear"),
                Entry(f"{us}.indexer.weights_proj", f"{hf}.indexer.weights_proj.weight", "linear")]
    return out


def _moe(cfg: V4Config, i: int, us: str, hf: str) -> list[Entry]:
    out = [Entry(f"{us}.gate", f"{hf}.gate.weight", "linear")]
    if cfg.mlp_layer_types[i] == HASH:
        out.append(Entry(f"{us}.tid2eid", f"{hf}.gate.tid2eid", "table"))
    else:
        out.append(Entry(f"{us}.bias", f"{hf}.gate.bias", "raw"))
    for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
        out.append(Entry(f"{us}.experts.{ours}", f"{hf}.experts.{{e}}.{theirs}.weight", "expert"))
        out.append(Entry(f"{us}.shared_expert.{ours}.kernel",
                         f"{hf}.shared_experts.{theirs}.weight", "linear"))
    return out


def entries(cfg: V4Config) -> list[Entry]:
    """Every held weight of a model of ``cfg``, in transformers' saved names."""
    out = [Entry("embed", "model.embed_tokens.weight", "raw"),
           Entry("norm.weight", "model.norm.weight", "raw"),
           Entry("head.kernel", "head.weight", "linear")]
    out += [Entry(f"hc_head.{k}", f"model.hc_head.{k}", "raw") for k in ("hc_fn", "hc_base", "hc_scale")]
    for i in range(cfg.num_layers):
        us, hf = f"layers.{i}", f"model.layers.{i}"
        out += [Entry(f"{us}.attn_norm.weight", f"{hf}.attn_norm.weight", "raw"),
                Entry(f"{us}.ffn_norm.weight", f"{hf}.ffn_norm.weight", "raw")]
        out += [Entry(f"{us}.{s}_hc.{k}", f"{hf}.hc_{s}_{k}", "raw")
                for s in ("attn", "ffn") for k in ("fn", "base", "scale")]
        out += _attention(cfg, i, f"{us}.self_attn", f"{hf}.attn")
        out += _moe(cfg, i, f"{us}.mlp", f"{hf}.ffn")
    return out


def stored_name(tensors: Mapping, name: str) -> str:
    """``name`` as ``tensors`` holds it: transformers' form, or DeepSeek's own (no ``model.``)."""
    if name in tensors:
        return name
    raw = _RAW_TOP.get(name, name.removeprefix("model."))
    return raw if raw in tensors else name


def from_stored(entry: Entry, tensors: Mapping, experts: int, groups: int) -> np.ndarray:
    """The held value of ``entry`` read from ``tensors`` (KeyError naming a missing tensor)."""
    get = lambda n: np.asarray(tensors[stored_name(tensors, n)])  # noqa: E731
    if entry.layout == "expert":
        return np.stack([get(entry.name.format(e=e)).T for e in range(experts)])
    value = get(entry.name)
    if entry.layout == "linear":
        return value.T
    if entry.layout == "table":
        return value.astype(np.int32)
    if entry.layout == "grouped":  # [G * R, in_g] -> [G, in_g, R]
        return value.reshape(groups, -1, value.shape[-1]).transpose(0, 2, 1)
    return value


def to_stored(entry: Entry, value: np.ndarray) -> dict[str, np.ndarray]:
    """``entry``'s checkpoint tensor(s) from its held value."""
    if entry.layout == "expert":
        return {entry.name.format(e=e): np.ascontiguousarray(v.T) for e, v in enumerate(value)}
    if entry.layout == "linear":
        return {entry.name: np.ascontiguousarray(value.T)}
    if entry.layout == "table":
        return {entry.name: value.astype(np.int64)}
    if entry.layout == "grouped":
        g, i, r = value.shape
        return {entry.name: np.ascontiguousarray(value.transpose(0, 2, 1).reshape(g * r, i))}
    return {entry.name: value}

