"""The ``config.rollout.jax`` section: how the built-in engine batches its requests."""

from __future__ import annotations

import dataclasses

from rlx.errors import ConfigError, one_of

BATCHING = ("continuous", "lockstep")


@dataclasses.dataclass(frozen=True)
class JaxSection:
    """The built-in engine's batching (``rlx.rollout.jax.paged``)."""

    # "continuous": decode slots over a paged KV cache, a finished sequence's slot refilled at
    # once; "lockstep": each device batch runs until its longest row ends (routing replay runs
    # lockstep whatever this says, for now)
    batching: str = "continuous"
    slots: int = 0  # decode slots (0: the platform's default, PlatformPolicy.decode_slots)
    page_size: int = 16  # tokens per KV-cache page
    kv_pages: int = 0  # pages in the pool (0: enough for every slot's longest sequence)
    prefill_chunk: int = 512  # prompt tokens per row of a prefill call (chunked prefill)
    prefill_rows: int = 64  # prompts written per prefill call (at most)
    burst: int = 16  # decode steps per device call (the host refills slots between calls)

    def validate(self) -> None:
        one_of("config.rollout.jax.batching", self.batching, BATCHING)
        small = [k for k in ("page_size", "prefill_chunk", "prefill_rows", "burst")
                 if getattr(self, k) < 1] + [k for k in ("slots", "kv_pages")
                                             if getattr(self, k) < 0]
        if small:
            raise ConfigError(f"config.rollout.jax.{small[0]}={getattr(self, small[0])} must be "
                              ">= 1 (slots and kv_pages: >= 0, 0 = automatic)")
        if self.kv_pages == 1:
            raise ConfigError("config.rollout.jax.kv_pages=1: a pool needs >= 2 pages (page 0 "
                              "takes padding); 0 sizes it automatically")
