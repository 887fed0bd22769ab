"""The rollout-engine protocol and the records it exchanges.

``generate(prompts, sampling) -> list[Rollout]`` returns, for every prompt, ``sampling.n``
completions in prompt order (prompt 0's samples first), each with per-token sampler log-probs, a
finish reason and the ``weight_version`` of the policy that produced it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from rlx.types import Rollout


class RolloutError(RuntimeError):
    """A rollout engine failed in a way rlx cannot hide (all servers dead, version mismatch...)."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` is greedy; ``top_k``/``top_p`` None means off."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1  # completions per prompt
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False  # generate exactly max_new_tokens: no stop ids, strings or EOS
    # the sampler log-prob of every token (what RL trains with). False: an engine may skip them,
    # for evaluation or samples to look at (the built-in one does: Rollout.has_logprobs False,
    # sampler_logp NaN, and a training batch refuses it; SGLang returns them anyway)
    logprobs: bool = True

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k={self.top_k} must be >= 1")
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1")
        if self.ignore_eos and (self.stop_token_ids or self.stop_strings):
            raise ValueError("ignore_eos=True generates max_new_tokens whatever comes; drop "
                             "stop_token_ids and stop_strings")


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A tokenized prompt with the uid that groups its samples (GRPO groups by uid)."""

    uid: str
    token_ids: tuple[int, ...]


class RolloutEngine(Protocol):
    """What the coordinator needs from an engine."""

    def generate(self, prompts: Sequence[Prompt], sampling: SamplingParams) -> list[Rollout]: ...

    def score(self, sequences: Sequence[tuple[Sequence[int], int]]) -> list[np.ndarray]:
        """Log-probs the engine assigns to given tokens: (token ids, prompt length) -> [len-P]."""
        ...

    def health(self) -> bool: ...

    def close(self) -> None: ...
