"""Architectures of known checkpoints, offline: the ``config.json`` values of their public releases.

Recipes in ``configs/`` name a checkpoint a user downloads (``model.path``); a machine without
it (CI, a laptop) still needs the architecture to build a shrunken random copy
(``model.shrink``) or to plan memory. ``write_preset_folder`` writes a weightless HF folder
(``config.json`` + optionally a tokenizer) that ``model.shrink`` and ``rlx.plan`` read like the
real checkpoint folder. Only architecture fields are kept; values are those of the published
``config.json`` files (Qwen2.5 Instruct releases, Qwen3 hybrid-thinking releases, DeepSeek-V3,
Kimi-K2-Instruct, GLM-4.5-Air), each kept in its family's module (``rlx.models.families``).
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

# the published config.json values by checkpoint id, kept beside their family (FamilySpec.presets)
from rlx.models.families import BY_ARCHITECTURE, PRESETS


def find_preset(path: str) -> str | None:
    """The preset a ``model.path`` names: an exact id, or a folder ending in the id or its name.

    ``"Qwen/Qwen3-8B"``, ``"/ckpt/Qwen/Qwen3-8B"`` and ``"~/models/qwen3-8b/"`` all give
    ``"Qwen/Qwen3-8B"``; anything else gives None.
    """
    tail = path.rstrip("/").lower()
    for name in PRESETS:
        low = name.lower()
        if tail == low or tail.endswith("/" + low) or os.path.basename(tail) == low.split("/")[-1]:
            return name
    return None


def preset_config(name: str) -> dict[str, Any]:
    """A copy of the ``config.json`` dict of preset ``name`` (KeyError lists the known ones)."""
    if name not in PRESETS:
        raise KeyError(f"no architecture preset {name!r}; known: {sorted(PRESETS)}")
    return copy.deepcopy(PRESETS[name])


def write_preset_folder(name: str, folder: str, *, tokenizer=None,
                        overrides: dict[str, Any] | None = None) -> str:
    """Write ``config.json`` of preset ``name`` (with ``overrides``) into ``folder``, plus
    ``tokenizer`` (an ``rlx.models.tokenizer.Tokenizer``) when given; returns ``folder``.

    With a stand-in tokenizer pass ``overrides={"vocab_size": tok.vocab_size, "bos_token_id": ...,
    "eos_token_id": ...}`` (``tokenizer_overrides`` builds that dict) so ids stay in range; a
    vision-language preset takes them in its language model's section (``text_config``).
    """
    cfg = {**preset_config(name), "_name_or_path": name}
    language_model_section(cfg).update(overrides or {})
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    if tokenizer is not None:
        tokenizer.save(folder)
    return folder


def language_model_section(cfg: dict[str, Any]) -> dict[str, Any]:
    """The dict of a ``config.json`` that holds its language model's fields: the file itself, or
    a vision-language checkpoint's text config (``FamilySpec.multimodal``)."""
    spec = next((BY_ARCHITECTURE[a] for a in cfg.get("architectures") or []
                 if a in BY_ARCHITECTURE), None)
    if spec is None or spec.multimodal is None:
        return cfg
    return cfg[spec.multimodal.text_config]


def tokenizer_overrides(tokenizer) -> dict[str, Any]:
    """``config.json`` fields that make a preset consistent with a stand-in tokenizer."""
    return {"vocab_size": tokenizer.vocab_size, "bos_token_id": tokenizer.bos_id,
            "eos_token_id": tokenizer.eos_id}


__all__ = ["PRESETS", "find_preset", "preset_config", "write_preset_folder", "language_model_section",
           "tokenizer_overrides"]
