"""Warm start from a HF PEFT LoRA adapter folder (``config.lora.init_from``), e.g. an SFT adapter.

``peft_lora_config`` takes rank, alpha and targets from the folder's ``adapter_config.json`` and
the modules its ``adapter_model.safetensors`` adapts (rsLoRA's ``alpha / sqrt(r)`` becomes the
same scale as ``alpha' / r`` with ``alpha' = alpha * sqrt(r)``); ``check_peft_adapter`` holds the
folder against the adapters ``apply_lora`` puts on the base (shapes only, before any weight is
read), and ``load_peft_adapter`` copies its tensors in: PEFT's ``base_model.model.<module>.lora_A
.weight [r, in]`` / ``lora_B.weight [out, r]`` are rlx's ``lora_a [in, r]`` / ``lora_b [r, out]``
transposed (the layout ``rlx.io.export.export_peft`` writes). What rlx's adapters cannot hold is
refused naming it: DoRA, per-module ranks or alphas, adapted biases, saved full modules, expert
parameters, a module or layer the base lacks, a shape of another base.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import numpy as np
from flax import nnx

from rlx.errors import ConfigError
from rlx.models.decoder import Transformer
from rlx.models.hf import param_map
from rlx.quant.config import LORA_TARGETS, LoraConfig
from rlx.quant.lora import LoRA, lora_targets

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
# adapter_config.json keys whose non-default values rlx's adapters cannot hold
UNSUPPORTED = {"use_dora": False, "rank_pattern": {}, "alpha_pattern": {}, "bias": "none",
               "modules_to_save": None, "target_parameters": None, "layers_to_transform": None,
               "fan_in_fan_out": False, "lora_bias": False, "trainable_token_indices": None}


@dataclasses.dataclass(frozen=True)
class PeftAdapter:
    """What rlx reads from a PEFT LoRA folder."""

    path: str
    rank: int
    alpha: float
    rslora: bool
    targets: tuple[str, ...]  # rlx target names (LORA_TARGETS order)
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]  # HF module -> (A, B) shapes

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def _target(module: str) -> str:
    """rlx's target name of a HF module name (``q_proj`` -> ``q``, ``kv_a_proj_with_mqa`` ->
    ``kv_a``)."""
    return module.removesuffix("_with_mqa").removesuffix("_proj")


def read_peft_adapter(path: str) -> PeftAdapter:
    """The adapter config and tensor shapes of the PEFT folder ``path`` (no tensor is read)."""
    where = f"config.lora.init_from={path!r}"
    cfg_file, weights = os.path.join(path, ADAPTER_CONFIG), os.path.join(path, ADAPTER_WEIGHTS)
    if not (os.path.isfile(cfg_file) and os.path.isfile(weights)):
        raise ConfigError(f"{where} is not a PEFT adapter folder: it needs {ADAPTER_CONFIG} and "
                          f"{ADAPTER_WEIGHTS} (what peft's save_pretrained writes)")
    with open(cfg_file, encoding="utf-8") as f:
        config = json.load(f)
    if config.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{where}: peft_type={config['peft_type']!r}; rlx warm-starts LoRA "
                          "adapters only")
    bad = [f"{k}={config[k]!r}" for k, default in UNSUPPORTED.items()
           if config.get(k, default) not in (default, None, {}, [], False, "none")]
    if bad:
        raise ConfigError(f"{where}: rlx's LoRA cannot hold {', '.join(bad)} (one rank and alpha "
                          "for every adapted linear, no biases, no saved modules)")
    shapes, others = _shapes(weights, where)
    unknown = sorted({m.rsplit(".", 1)[-1] for m in shapes
                      if _target(m.rsplit(".", 1)[-1]) not in LORA_TARGETS})
    if unknown:
        raise ConfigError(f"{where} adapts {unknown}, which rlx's LoRA does not target (targets: "
                          f"{[f'{t}_proj' for t in LORA_TARGETS]})")
    if others:
        raise ConfigError(f"{where} holds tensors that are no LoRA A / B weights ({others[:3]}"
                          f"{' ...' if len(others) > 3 else ''}): saved full modules rlx cannot hold")
    found = {_target(m.rsplit(".", 1)[-1]) for m in shapes}
    return PeftAdapter(path=path, rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                       rslora=bool(config.get("use_rslora", False)),
                       targets=tuple(t for t in LORA_TARGETS if t in found), shapes=shapes)


def _shapes(weights: str, where: str):
    """(HF module -> (lora_A shape, lora_B shape), the names of any other tensors), from the
    safetensors header."""
    from safetensors import safe_open

    parts: dict[str, dict[str, tuple[int, ...]]] = {}
    others = []
    with safe_open(weights, "np") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            module, _, kind = name.removeprefix(PREFIX).replace(".default", "").rpartition(".lora_")
            if kind in ("A.weight", "B.weight"):
                parts.setdefault(module, {})[kind[0]] = tuple(f.get_slice(name).get_shape())
            else:
                others.append(name.removeprefix(PREFIX))
    half = sorted(m for m, p in parts.items() if len(p) != 2)
    if half:
        raise ConfigError(f"{where}: modules {half[:3]} have only one of lora_A / lora_B")
    return {m: (p["A"], p["B"]) for m, p in parts.items()}, sorted(others)


def peft_lora_config(lora: LoraConfig) -> LoraConfig:
    """``lora`` with the rank, alpha and targets of the PEFT folder ``lora.init_from`` (rsLoRA as
    the equal ``alpha * sqrt(r)`` over ``r``); dropout, experts and dtype stay ``lora``'s."""
    a = read_peft_adapter(lora.init_from)
    alpha = a.alpha * math.sqrt(a.rank) if a.rslora else a.alpha
    return dataclasses.replace(lora, rank=a.rank, alpha=alpha, targets=a.targets)


def peft_modules(model: Transformer) -> dict[str, LoRA]:
    """HF module name (``model.layers.0.self_attn.q_proj``) -> adapter, for every adapted linear
    of ``model`` (expert stacks are not PEFT modules)."""
    sources = param_map(model.config)
    out = {}
    for path, lo in lora_targets(model):
        if lo.lora_a.ndim == 2:
            kernel = path.rsplit("/", 1)[0] + "/kernel"
            out[sources[kernel].hf_names[0].removesuffix(".weight")] = lo
    return out


def check_peft_adapter(adapter: PeftAdapter, model: Transformer) -> None:
    """Refuse ``adapter`` unless it holds exactly the adapters of ``model`` (an abstract model
    from ``nnx.eval_shape`` will do), shape for shape; names what differs."""
    where = f"config.lora.init_from={adapter.path!r}"
    mine = {m: (tuple(lo.lora_a.shape[::-1]), tuple(lo.lora_b.shape[::-1]))
            for m, lo in peft_modules(model).items()}
    extra, missing = sorted(set(adapter.shapes) - set(mine)), sorted(set(mine) - set(adapter.shapes))
    if extra or missing:
        raise ConfigError(f"{where} does not fit this base: " + "; ".join(
            [f"modules the base lacks: {extra[:3]}{' ...' if len(extra) > 3 else ''}"] * bool(extra)
            + [f"adapted modules it lacks: {missing[:3]}{' ...' if len(missing) > 3 else ''}"]
            * bool(missing)) + " (an adapter of another base?)")
    wrong = [f"{m} lora_A {adapter.shapes[m][0]} / lora_B {adapter.shapes[m][1]} (the base's: "
             f"{mine[m][0]} / {mine[m][1]})" for m in sorted(mine) if adapter.shapes[m] != mine[m]]
    if wrong:
        raise ConfigError(f"{where} does not fit this base: {wrong[0]}"
                          f"{f' and {len(wrong) - 1} more' if len(wrong) > 1 else ''} (an adapter "
                          "of another base?)")


def load_peft_adapter(model: Transformer, path: str) -> None:
    """Copy the PEFT adapter at ``path`` into the adapters of ``model`` (in place, keeping each
    parameter's dtype and sharding); checked first with ``check_peft_adapter``."""
    from safetensors.numpy import load_file

    check_peft_adapter(read_peft_adapter(path), model)
    tensors = {k.removeprefix(PREFIX).replace(".default", ""): v
               for k, v in load_file(os.path.join(path, ADAPTER_WEIGHTS)).items()}
    for module, lo in peft_modules(model).items():
        for var, name in ((lo.lora_a, "A"), (lo.lora_b, "B")):
            value = np.ascontiguousarray(tensors[f"{module}.lora_{name}.weight"].T)
            old = var[...]
            var[...] = jax.device_put(value.astype(old.dtype), old.sharding)


def abstract_lora_model(arch, precision, lora: LoraConfig) -> Transformer:
    """The shapes of ``arch`` with ``lora``'s adapters, nothing allocated (for the checks)."""
    from rlx.quant.lora import apply_lora

    return nnx.eval_shape(lambda: apply_lora(Transformer(arch, precision, rngs=nnx.Rngs(0)),
                                             lora, nnx.Rngs(0)))


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "PeftAdapter", "abstract_lora_model",
           "check_peft_adapter", "load_peft_adapter", "peft_lora_config", "peft_modules",
           "read_peft_adapter"]
