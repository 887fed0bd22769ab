"""The ``config.rollout`` section: how completions are sampled, by which engine (a name of
``rlx.rollout.registry.ENGINES``), and each backend's own section (``config.rollout.sglang``,
``rlx.rollout.sglang.config``; ``config.rollout.jax``, ``rlx.rollout.jax.config``)."""

from __future__ import annotations

import dataclasses

from rlx.errors import ConfigError, one_of
from rlx.rollout.jax.config import JaxSection
from rlx.rollout.jax.decode_layout import LAYOUTS
from rlx.rollout.registry import ENGINES
from rlx.rollout.sglang.config import SGLangSection


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    """How completions are sampled."""

    engine: str = "jax"  # "jax": built-in engine (same kernels as the learner) | "sglang": servers
    group_size: int = 8  # completions per prompt (the GRPO group)
    max_new_tokens: int = 128  # completion length cap
    temperature: float = 1.0  # sampling temperature for training rollouts
    top_p: float = 1.0  # nucleus sampling (1.0 = off)
    top_k: int = 0  # keep the k likeliest tokens (0 = off)
    min_p: float = 0.0  # keep tokens at least min_p x as likely as the likeliest (0 = off)
    eval_temperature: float = 0.0  # 0 = greedy evaluation
    preflight_threshold: float = 1e-3  # max |log-prob diff| learner vs engine (stop above it)
    preflight_every: int = 0  # steps between parity preflights (0 = only before training)
    # built-in engine's copy of float projection weights: "auto" ([out, in] on CPU, where decode
    # products run faster so), "out_in" or "in_out" (the learner's); see rlx.rollout.jax.decode_layout
    weight_layout: str = "auto"
    # with train.max_staleness = k >= 1: generate each batch in k + 1 segments, one per step, so a
    # completion spanning a weight sync continues with the new weights (rlx.run.rollouts)
    partial: bool = False
    sglang: SGLangSection = SGLangSection()  # servers, used when engine == "sglang"
    jax: JaxSection = JaxSection()  # the built-in engine's batching (slots, pages)

    def validate(self) -> None:
        one_of("config.rollout.engine", self.engine, ENGINES)
        one_of("config.rollout.weight_layout", self.weight_layout, LAYOUTS)
        self.sglang.validate(self.engine)
        self.jax.validate()
        if self.group_size < 1 or self.max_new_tokens < 1:
            raise ConfigError("config.rollout.group_size and max_new_tokens must be >= 1")
        if self.temperature < 0 or self.eval_temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError("config.rollout temperatures must be >= 0 and top_p in (0, 1]")
        if self.top_k < 0 or not 0 <= self.min_p <= 1:
            raise ConfigError(f"config.rollout.top_k={self.top_k} must be >= 0 (0: off) and "
                              f"min_p={self.min_p} in [0, 1] (0: off)")

    def cuts(self) -> dict:
        """The ``SamplingParams`` fields of the top-p, top-k and min-p settings (None: off)."""
        return {"top_p": None if self.top_p >= 1.0 else self.top_p,
                "top_k": self.top_k or None, "min_p": self.min_p or None}
