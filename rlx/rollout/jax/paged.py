"""The built-in engine's continuous batching: its page pool, programs and scheduler.

``PagedServing`` is what ``JaxEngine.generate`` runs (``config.rollout.jax.batching =
"continuous"``): ``slots`` decode slots (``JaxSection.slots``, else the platform's
``decode_slots``) over one pool of KV-cache pages per layer (``rlx.models.paged_kv``), the
programs of ``rlx.rollout.jax.continuous`` compiled once per sampler setting, and the host's
``Scheduler`` (``rlx.rollout.jax.scheduler``). The pool is sized by ``JaxSection.kv_pages``, or,
left at 0, for every slot's longest sequence of the call (grown, and its programs compiled anew,
when a later call needs more). Inside ``JaxEngine.prefix_cache()`` finished sequences' pages stay
indexed by their tokens (``rlx.rollout.jax.pages.PrefixIndex``), so an episode's next turn writes
only its new tokens; a weight update drops them.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from flax import nnx

from rlx.models.hparams import ModelConfig
from rlx.models.paged_kv import PagedKVCache, grow_pools
from rlx.rollout.jax.config import JaxSection
from rlx.rollout.jax.continuous import Programs, compile_programs
from rlx.rollout.jax.pages import PagePool, PrefixIndex
from rlx.rollout.jax.sampler import Knobs, SamplerSpec
from rlx.rollout.jax.scheduler import Scheduler, Stats
from rlx.types import Prompt, Rollout, SamplingParams


class PagedServing:
    """Pool, programs and scheduler of one engine (module docstring)."""

    def __init__(self, config: ModelConfig, graphdef: nnx.GraphDef, stacks, dtype,
                 section: JaxSection, slots: int, device: jax.Device, adapter: bool = True):
        self.config, self.graphdef, self.stacks, self.dtype = config, graphdef, stacks, dtype
        self.device = device  # the pools' (one device: meshes of several run lockstep)
        self.section, self.slots, self.adapter = section, slots, adapter
        self._programs: dict[SamplerSpec, Programs] = {}
        self._scheduler: Scheduler | None = None
        self.keep = False  # finished sequences' pages stay indexed (prefix_cache)
        self.prefilled = self.preempted = 0  # so far

    @property
    def stats(self) -> Stats:
        return Stats() if self._scheduler is None else self._scheduler.stats

    def compilations(self) -> int:
        """Programs compiled so far (per sampler setting, slot bucket and table width)."""
        return sum(f._cache_size() for p in self._programs.values()
                   for f in (p.prefill, p.first, p.burst, p.copy))

    def cached_sequences(self) -> int:
        """Pages the prefix index holds."""
        s = self._scheduler
        return 0 if s is None or s.index is None else len(s.index)

    def clear(self) -> None:
        """Drop the indexed prefixes (a weight update, leaving the prefix cache)."""
        if self._scheduler is not None and self._scheduler.index is not None:
            self._scheduler.index.clear()

    def _pages(self, tokens: int) -> int:
        """The pool's pages for sequences of up to ``tokens`` tokens in every slot."""
        if self.section.kv_pages:
            return self.section.kv_pages
        return self.slots * -(-tokens // self.section.page_size) + 1

    def _ready(self, spec: SamplerSpec, tokens: int) -> Scheduler:
        """The scheduler, its pool large enough for ``tokens``-token sequences, on ``spec``'s
        programs."""
        if spec not in self._programs:
            self._programs[spec] = compile_programs(self.graphdef, spec, burst=self.section.burst,
                                                    adapter=self.adapter)
        pages, s = self._pages(tokens), self._scheduler
        if s is None:
            size = self.section.page_size
            pools = jax.device_put(  # committed, as every call returns them
                PagedKVCache.zeros(self.config, pages, size, self.dtype, self.stacks),
                self.device)
            s = self._scheduler = Scheduler(
                self._programs[spec], pools, PagePool(pages, size), slots=self.slots,
                chunk=self.section.prefill_chunk, rows=self.section.prefill_rows,
                burst=self.section.burst)
        elif s.pool.pages < pages:  # the pages held (kept prefixes) keep their ids
            s.pools = grow_pools(s.pools, pages)
            s.pool.grow(pages)
        s.programs = self._programs[spec]
        if self.keep and s.index is None:
            s.index = PrefixIndex(s.pool)
        elif not self.keep and s.index is not None:
            s.index.clear()
            s.index = None
        return s

    def run(self, state: nnx.State, prompts: Sequence[Prompt], sampling: SamplingParams,
            seed: int, stops, tokenizer, version: int) -> list[Rollout]:
        if not prompts:
            return []
        longest = max(len(p.token_ids) for p in prompts) + sampling.max_new_tokens
        s = self._ready(SamplerSpec.of(sampling), longest)
        out = s.run(state, prompts, sampling, seed, Knobs.of_sampling(sampling), stops, tokenizer,
                    version)
        self.prefilled += s.stats.prefilled
        self.preempted += s.stats.preempted
        return out
