"""The error of a rollout engine. The engine protocol and the records it exchanges (``Prompt``,
``SamplingParams``, ``Rollout``, ``RolloutEngine``) live in ``rlx.types``."""

from __future__ import annotations


class RolloutError(RuntimeError):
    """A rollout engine failed in a way rlx cannot hide (all servers dead, version mismatch...)."""
