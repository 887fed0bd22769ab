"""The built-in engine's continuous batching: its page pool, programs and scheduler.

``PagedServing`` is what ``JaxEngine.generate`` runs (``config.rollout.jax.batching =
"continuous"``): ``slots`` decode slots (``JaxSection.slots``, else the platform's
``decode_slots``) over one pool of KV-cache pages per layer (``rlx.models.paged_kv``), the
programs of ``rlx.rollout.jax.continuous`` compiled once per sampler setting, and the host's
``Scheduler`` (``rlx.rollout.jax.scheduler``). The pool is sized by ``JaxSection.kv_pages``, or,
left at 0, for the call's sequences at its longest (``pool_pages``; grown when a later call needs
more). Inside ``JaxEngine.prefix_cache()`` finished sequences' pages stay
indexed by their tokens (``rlx.rollout.jax.pages.PrefixIndex``), so an episode's next turn writes
only its new tokens; a weight update drops them. On a mesh each data shard (the batch axes'
devices) has a pool of its own and a block of the slots; the programs declare their shardings
(``rlx.rollout.jax.continuous.Placement``) and the layers read their shard's pages in place
(``rlx.models.paged_kv.per_device``); ``kv_pages`` counts one shard's pages.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from flax import nnx
from jax.sharding import Mesh

from rlx.models.hparams import ModelConfig
from rlx.mesh import SAMPLE_RULES, LogicalRules, batch_shards
from rlx.models.paged_kv import PagedKVCache, grow_pools
from rlx.rollout.jax.config import JaxSection
from rlx.rollout.jax.continuous import Placement, Programs, compile_programs
from rlx.rollout.jax.pages import PagePool, PrefixIndex
from rlx.rollout.jax.sampler import Knobs, SamplerSpec
from rlx.rollout.jax.scheduler import Scheduler, Shard, Stats, longest
from rlx.types import Prompt, Rollout, SamplingParams


def pool_pages(sequences: int, n: int, tokens: int, slots: int, shards: int,
               page_size: int) -> int:
    """Pages of each data shard's pool sized for a call of ``sequences`` sequences (``n``
    samples per prompt, which share a shard) of up to ``tokens`` tokens: as many sequences per
    shard as the call spreads over the ``shards`` (a prompt's samples together), at most the
    shard's ``slots / shards`` slots, each with its pages, and the padding page."""
    per_shard = min(slots // shards, max(-(-sequences // shards), n))
    return per_shard * -(-tokens // page_size) + 1


class PagedServing:
    """Pool, programs and scheduler of one engine (module docstring)."""

    def __init__(self, config: ModelConfig, graphdef: nnx.GraphDef, stacks, dtype,
                 section: JaxSection, slots: int, device: jax.Device | None, adapter: bool = True,
                 mesh: Mesh | None = None, rules: LogicalRules = SAMPLE_RULES, state_shardings=None,
                 record_routes: bool = False, per_octave: int = 1):
        self.config, self.graphdef, self.stacks, self.dtype = config, graphdef, stacks, dtype
        self.device, self.mesh, self.rules = device, mesh, rules  # one device, or a mesh
        self.state_shardings, self.record_routes = state_shardings, record_routes
        self.shards = 1 if mesh is None else batch_shards(mesh, rules)
        self.section, self.adapter = section, adapter
        self.per_octave = per_octave  # slot buckets (rlx.rollout.jax.continuous.slot_buckets)
        self.slots = -(-slots // self.shards) * self.shards  # a block of slots per data shard
        self._programs: dict[SamplerSpec, Programs] = {}
        self._scheduler: Scheduler | None = None
        self.keep = False  # finished sequences' pages stay indexed (prefix_cache)
        self.prefilled = self.preempted = self.dropped = 0  # so far (dropped: MoE pairs)

    @property
    def stats(self) -> Stats:
        return Stats() if self._scheduler is None else self._scheduler.stats

    def compilations(self) -> int:
        """Programs compiled so far (per sampler setting, slot bucket and table width)."""
        return sum(f._cache_size() for p in self._programs.values()
                   for f in (p.prefill, p.first, p.burst, p.copy))

    def cached_sequences(self) -> int:
        """Pages the prefix indexes hold."""
        s = self._scheduler
        return 0 if s is None else sum(len(d.index) for d in s.shards if d.index is not None)

    def clear(self) -> None:
        """Drop the indexed prefixes (a weight update, leaving the prefix cache)."""
        for d in [] if self._scheduler is None else self._scheduler.shards:
            if d.index is not None:
                d.index.clear()

    def _pages(self, tokens: int, sequences: int, n: int) -> int:
        """Pages of each data shard's pool: ``kv_pages``, else ``pool_pages`` of a call of
        ``sequences`` sequences (``n`` per prompt) of up to ``tokens`` tokens; inside
        ``prefix_cache()`` every slot's (kept pages stay beside the call's)."""
        sequences = self.slots if self.keep else sequences
        return self.section.kv_pages or pool_pages(sequences, n, tokens, self.slots,
                                                   self.shards, self.section.page_size)

    def _placement(self, pages: int) -> Placement | None:
        """The programs' shardings on the mesh for pools of ``pages`` pages per shard."""
        if self.mesh is None:
            return None
        return Placement.of(self.mesh, self.rules, self.config, self.stacks,
                            pages * self.shards, self.section.page_size, self.state_shardings)

    def _place_pools(self, pools: PagedKVCache, pages: int) -> PagedKVCache:
        """``pools`` committed where the programs take them (every call returns them so)."""
        place = self._placement(pages)
        return jax.device_put(pools, self.device if place is None else place.pools)

    def _ready(self, spec: SamplerSpec, pages: int) -> Scheduler:
        """The scheduler, its pools of at least ``pages`` pages per shard, on ``spec``'s
        programs."""
        if spec not in self._programs:
            self._programs[spec] = compile_programs(
                self.graphdef, spec, burst=self.section.burst, adapter=self.adapter,
                shards=self.shards, place=self._placement(pages), record_routes=self.record_routes)
        s, size = self._scheduler, self.section.page_size
        if s is None:
            pools = PagedKVCache.zeros(self.config, pages * self.shards, size, self.dtype,
                                       self.stacks)
            s = self._scheduler = Scheduler(
                self._programs[spec], self._place_pools(pools, pages),
                [Shard(PagePool(pages, size)) for _ in range(self.shards)], slots=self.slots,
                chunk=self.section.prefill_chunk, rows=self.section.prefill_rows,
                burst=self.section.burst, record_routes=self.record_routes,
                per_octave=self.per_octave)
        elif s.shards[0].pool.pages < pages:  # the pages held (kept prefixes) keep their ids
            s.pools = self._place_pools(grow_pools(s.pools, pages, self.shards), pages)
            for d in s.shards:
                d.pool.grow(pages)
        s.programs = self._programs[spec]
        keep = self.keep and not self.record_routes  # recorded routes: every token prefilled
        for d in s.shards:
            if keep and d.index is None:
                d.index = PrefixIndex(d.pool)
            elif not keep and d.index is not None:
                d.index.clear()
                d.index = None
        return s

    def run(self, state: nnx.State, prompts: Sequence[Prompt], sampling: SamplingParams,
            seed: int, stops, tokenizer, version: int) -> list[Rollout]:
        if not prompts:
            return []
        s = self._ready(SamplerSpec.of(sampling), self._pages(
            longest(prompts, sampling), len(prompts) * sampling.n, sampling.n))
        out = s.run(state, prompts, sampling, seed, Knobs.of_sampling(sampling), stops, tokenizer,
                    version)
        self.prefilled += s.stats.prefilled
        self.preempted += s.stats.preempted
        self.dropped += s.stats.dropped
        return out
