"""The backend-neutral record of what a run asks rollout servers to serve (``Serving``): made once
from the run config by ``rlx.run.engines``, read by a server backend (``rlx.rollout.sglang``) to
export, launch or attach, and by the pre-build checks."""

from __future__ import annotations

import dataclasses

from rlx.models.loading import ModelSection
from rlx.quant.config import LoraConfig, QuantConfig
from rlx.rollout.sglang.config import SGLangSection


@dataclasses.dataclass(frozen=True)
class Serving:
    """What a run asks a serving backend to serve (``rlx.run.engines.serving`` makes it from the run
    config): the checkpoint, the base representation, the adapter, where exports go and the
    servers' own section."""

    sglang: SGLangSection  # config.rollout.sglang: servers to attach to or launch
    model: ModelSection  # config.model: the checkpoint (PEFT base name, a GGUF base's file)
    quant: QuantConfig  # config.quant: the base representation and its serving format
    lora: LoraConfig | None  # config.lora in train.mode "lora"; None in "full" (whole weights)
    output_dir: str  # exports go to <output_dir>/serving


__all__ = ["Serving"]
