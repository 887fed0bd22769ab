"""The host side of continuous batching: requests into decode slots, pages to sequences.

``Scheduler.run(state, prompts, sampling, ...)`` serves every sample of every prompt through the
programs of ``rlx.rollout.jax.continuous``. Each turn of its loop:

1. **admit**: the next waiting request takes pages for its tokens (those a ``PrefixIndex``
   already holds are shared, not written again) and is queued for prefill, when the decode
   slots can take its samples;
2. **prefill**: one ``prefill_chunk`` call writes up to ``chunk`` more tokens of up to ``rows``
   queued requests (chunked prefill: bounded tokens between decode bursts; its rows are
   ``rows``, a quarter of it ... as many as are queued);
3. **start**: a prompt whose tokens are all written forks into its samples (full pages shared,
   the last partial page copied: ``SequencePages.fork``), each drawing its first token
   (``first_tokens``) into a slot;
4. **decode**: every live sample gets the pages its next ``burst`` tokens need and one
   ``decode_burst`` runs over them, packed into the smallest slot bucket that holds them
   (``slot_buckets``: ``slots``, three quarters, a half, three eighths ...), its page table
   as wide as the call's longest sequence needs (attention reads a row's pages only up to the
   longest live row's end, ``rlx.kernels.attention.paged``): the long tail of a call runs a
   small program, not the full one with most rows masked. Samples that finish free their
   pages; their slots are refilled next turn.

On a mesh the rows of every program split over the data shards (the mesh's batch axes), and
each shard has a page pool of its own (``rlx.models.paged_kv.per_device``): a request is admitted
to one shard (the one holding the longest prefix of its tokens, else the one with the most free
slots), its samples decode in that shard's rows and its pages are that shard's, so a program's
rows are ``shards`` equal blocks, one per shard, each bucketed as above.

When a pool runs out of pages for a decode burst, the latest started sample of its shard is
preempted: its pages are released and it waits again with the tokens it drew; when it is
admitted anew its prompt and tokens are prefilled again (recomputed) and it goes on drawing
from where it was, with the same keys, so its tokens are those it would have drawn undisturbed. ``stats.preempted``
counts these.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlx.rollout.jax.batching import pow2, row_rollout, uid_hash
from rlx.rollout.jax.continuous import MIN_ROWS, Programs, Slots, slot_buckets
from rlx.rollout.jax.pages import OutOfPages, PagePool, PrefixIndex, SequencePages, page_keys
from rlx.rollout.errors import RolloutError
from rlx.types import Prompt, Rollout, SamplingParams


def longest(prompts: Sequence[Prompt], sampling: SamplingParams) -> int:
    """Tokens of a call's longest sequence: its longest prompt and every new token."""
    return max(len(p.token_ids) for p in prompts) + sampling.max_new_tokens


def _bucket(n: int, buckets: Sequence[int]) -> int:
    """Rows of a burst of ``n`` samples: the smallest of ``buckets`` (``slot_buckets``, the
    largest first) that holds ``n`` (at least ``MIN_ROWS``), a program per bucket."""
    return min(b for b in buckets if b >= max(n, MIN_ROWS) or b == buckets[0])


@dataclasses.dataclass
class _Sample:
    """One sample being drawn: in a slot, or preempted (pages released, tokens kept)."""

    index: int  # its prompt's position in the call
    sample: int
    uid: int  # the prompt uid's hash (its key, with ``sample``)
    seq: SequencePages
    tokens: list[int]
    logps: list[float]
    text: int = 0  # the stop-string automaton's state
    started: int = 0  # start order: the latest started is preempted first
    shard: int = 0  # the data shard whose pool holds its pages
    routes: list = dataclasses.field(default_factory=list)  # experts of its fed tokens, in order


@dataclasses.dataclass
class _Prefill:
    """A request being written into its pages: a prompt, or a preempted sample resuming."""

    index: int
    seq: SequencePages
    tokens: Sequence[int]  # what its pages must hold
    samples: list[int]  # sample indices still to start
    resume: _Sample | None = None
    h: Any = None  # the last token's hidden state, once every token is written
    shard: int = 0
    routes: list = dataclasses.field(default_factory=list)  # experts of its written tokens


@dataclasses.dataclass
class Shard:
    """One data shard's page pool and, inside ``prefix_cache()``, its index of kept pages."""

    pool: PagePool
    index: PrefixIndex | None = None


@dataclasses.dataclass
class Stats:
    """What the last ``run`` did."""

    slots: int = 1  # the scheduler's decode slots
    steps: int = 0  # decode steps (each of every burst)
    drawn: int = 0  # tokens drawn by them (one per live slot and step)
    prefilled: int = 0  # tokens written by prefill chunks
    preempted: int = 0
    bursts: int = 0
    dropped: int = 0  # (token, expert) pairs a MoE dispatch capacity dropped

    @property
    def occupancy(self) -> float:
        """Live slots per decode step over the slots."""
        return self.drawn / max(1, self.steps * self.slots)


@dataclasses.dataclass(frozen=True)
class _Call:
    """One ``run``'s inputs."""

    state: Any
    prompts: Sequence[Prompt]
    sampling: SamplingParams
    seed: np.int32
    knobs: Any
    stops: Any
    tokenizer: Any
    version: int


class Scheduler:
    """Decode slots, page pool and the turn loop (module docstring)."""

    def __init__(self, programs: Programs, pools, shards: Sequence[Shard], *, slots: int,
                 chunk: int, rows: int, burst: int, record_routes: bool = False,
                 per_octave: int = 1):
        self.programs, self.pools, self.shards = programs, pools, list(shards)
        self.record_routes = record_routes  # the programs return the fed tokens' experts
        if slots % len(self.shards):
            raise ValueError(f"{slots} decode slots do not split over {len(self.shards)} shards")
        self.slots, self.chunk, self.rows, self.burst = slots, chunk, rows, burst
        self.buckets = slot_buckets(self.per_shard, per_octave)  # a burst's rows per shard
        self.stats = Stats(slots)
        self._started = 0

    @property
    def per_shard(self) -> int:
        """Decode slots of each data shard."""
        return self.slots // len(self.shards)

    @property
    def capacity(self) -> int:
        """Tokens one sequence's cache can ever hold: its shard's whole pool."""
        pool = self.shards[0].pool
        return (pool.pages - 1) * pool.page_size

    def _pool(self, shard: int) -> PagePool:
        return self.shards[shard].pool

    @property
    def _indexed(self) -> bool:
        """Whether kept prefixes are indexed (inside ``prefix_cache()``)."""
        return any(d.index is not None for d in self.shards)

    def _blocks(self, items: Sequence, buckets: Sequence[int]) -> tuple[int, list[int]]:
        """Rows per shard of a program over ``items`` (each with a ``shard``), the smallest of
        ``buckets`` that holds them, and each item's row: its shard's block, in order."""
        counts, where = [0] * len(self.shards), []
        for x in items:
            where.append(counts[x.shard])
            counts[x.shard] += 1
        block = _bucket(max(counts), buckets)
        return block, [x.shard * block + i for x, i in zip(items, where)]

    def run(self, state, prompts: Sequence[Prompt], sampling: SamplingParams, seed: int, knobs,
            stops, tokenizer=None, version: int = 0) -> list[Rollout]:
        """``sampling.n`` samples of each prompt, prompt-major."""
        for p in prompts:
            need = len(p.token_ids) + sampling.max_new_tokens - 1
            if need > self.capacity:
                raise ValueError(
                    f"prompt {p.uid!r}: {len(p.token_ids)} tokens + max_new_tokens "
                    f"{sampling.max_new_tokens} need {need} cache slots, more than the "
                    f"{self.capacity} the engine's cache holds (rollout.kv_pages x "
                    "rollout.page_size): shorten it or give the cache more pages")
        self._call = _Call(state, prompts, sampling, np.int32(seed), knobs, stops, tokenizer,
                           version)
        self._longest = longest(prompts, sampling)
        self.stats = Stats(self.slots)
        waiting: collections.deque = collections.deque(range(len(prompts)))
        prefilling: list[_Prefill] = []
        running: list[_Sample] = []
        done: dict[tuple[int, int], Rollout] = {}
        while waiting or prefilling or running:
            moved = self._admit(waiting, prefilling, running)
            moved = (self._start(prefilling, running, done) if prefilling else False) or moved
            if running:
                self._decode(running, waiting, done, bool(waiting) or any(
                    p.samples for p in prefilling))
            elif not moved:
                pool = self._pool(0)
                raise RolloutError(f"the engine's cache ({pool.pages - 1} pages of "
                                   f"{pool.page_size} tokens per data shard) cannot hold the "
                                   "next request: give it more pages (rollout.kv_pages)")
        n = sampling.n
        return [done[i, j] for i in range(len(prompts)) for j in range(n)]

    # --- pages ---------------------------------------------------------------------------
    def _taking(self, take, want: int, shard: int):
        """``take()``, which holds free pages of ``shard``; short of them, its kept prefixes are
        evicted first until ``want`` pages are free (``OutOfPages`` if still short)."""
        try:
            return take()
        except OutOfPages:
            index = self.shards[shard].index
            if index is None:
                raise
            index.evict(want)
            return take()

    def _grow(self, seq: SequencePages, length: int, shard: int) -> None:
        """Pages of ``shard`` for ``length`` tokens."""
        pool = self._pool(shard)
        self._taking(lambda: seq.grow(pool, length), pool.pages_for(length) - len(seq.pages),
                     shard)

    def _fork(self, seq: SequencePages, shard: int):
        return self._taking(lambda: seq.fork(self._pool(shard)), 1, shard)

    def _place(self, tokens: Sequence[int], keys, free: list[int], want: int) -> int | None:
        """The shard a request of ``tokens`` (``keys``: their ``page_keys``, the last token
        left out) whose ``want`` samples need free slots goes to: the one whose index holds the
        longest prefix of its tokens, then the one with the most free slots; None (it waits) if
        that one has no room, so that an episode's next turn stays with its kept pages."""
        kept = [len(d.index.match(tokens, False, keys)) if d.index else 0 for d in self.shards]
        best = max(range(len(self.shards)), key=lambda d: (kept[d], free[d]))
        return best if free[best] >= want else None

    # --- the turn's steps ----------------------------------------------------------------
    def _admit(self, waiting: collections.deque, prefilling: list[_Prefill],
               running: list[_Sample]) -> bool:
        """Queue waiting requests for prefill while their samples fit the free slots and their
        tokens the free pages; returns whether any was."""
        call, admitted = self._call, False
        free = [self.per_shard] * len(self.shards)
        for x in running + [p for p in prefilling for _ in p.samples]:
            free[x.shard] -= 1
        while waiting:
            item = waiting[0]
            resume = item if isinstance(item, _Sample) else None
            index = item.index if resume else item
            tokens = tuple(call.prompts[index].token_ids)
            if resume:
                tokens += tuple(resume.tokens[:-1])
            samples = [resume.sample] if resume else list(range(call.sampling.n))
            keys = page_keys(tokens[:-1], self._pool(0).page_size) if self._indexed else None
            d = self._place(tokens, keys, free, min(len(samples), self.per_shard))
            if d is None:
                break
            kept, pool = self.shards[d].index, self._pool(d)
            matched = kept.match(tokens, keys=keys) if kept is not None else []
            seq = SequencePages(matched, len(matched) * pool.page_size)
            try:
                self._grow(seq, len(tokens), d)
            except OutOfPages:
                seq.release(pool)
                break
            waiting.popleft()
            prefilling.append(_Prefill(index, seq, tokens, samples, resume, shard=d))
            free[d] -= len(samples)
            admitted = True
        return admitted

    def _prefill(self, prefilling: list[_Prefill]) -> bool:
        """One chunk of the first ``rows`` requests still being written (False: none is)."""
        per = max(1, self.rows // len(self.shards))  # rows per shard
        batch, counts = [], [0] * len(self.shards)
        for p in prefilling:
            if p.h is None and counts[p.shard] < per:
                batch.append(p)
                counts[p.shard] += 1
        if not batch:
            return False
        longest = max(len(p.tokens) - p.seq.length for p in batch)
        width = min(self.chunk, -(-longest // 16) * 16)  # tokens per row: a multiple of 16
        block, where = self._blocks(batch, slot_buckets(per))
        rows = block * len(self.shards)
        ids, pos, seg = (np.zeros((rows, width), np.int32) for _ in range(3))
        m = max(len(p.seq.pages) for p in batch)
        table = np.zeros((rows, pow2(m)), np.int32)
        lengths = np.zeros(rows, np.int32)
        written = []
        for r, p in zip(where, batch):
            start = p.seq.length
            n = min(width, len(p.tokens) - start)
            written.append(n)
            ids[r, :n], pos[r, :n], seg[r, :n] = p.tokens[start:start + n], range(start,
                                                                                  start + n), 1
            table[r, :len(p.seq.pages)], lengths[r] = p.seq.pages, start
            p.seq.length += n
            self.stats.prefilled += n
        put = self.programs.rows  # placed as the program takes them (a mesh's rows)
        self.pools, h, dropped, *experts = self.programs.prefill(
            self._call.state, self.pools, *map(put, (ids, pos, seg, table, lengths)))
        self.stats.dropped += int(dropped)
        if experts:
            experts = np.asarray(jax.device_get(experts[0]))
            for r, p, n in zip(where, batch, written):
                p.routes.append(experts[r, :n])
        for r, p in zip(where, batch):
            if p.seq.length == len(p.tokens):
                p.h = h[r]
        return True

    def _start(self, prefilling: list[_Prefill], running: list[_Sample], done) -> bool:
        """Prefill a chunk, then start the samples of every fully written request that fit
        the free slots (resumed ones go straight back to decoding). Returns whether anything
        was written or started."""
        moved = self._prefill(prefilling)
        free = [self.per_shard] * len(self.shards)
        for run in running:
            free[run.shard] -= 1
        starts: list[tuple[_Prefill, int, SequencePages]] = []
        copies = []
        for p in [p for p in prefilling if p.h is not None]:
            while p.samples and free[p.shard]:
                if p.resume is not None:
                    p.resume.seq, p.resume.shard, p.samples = p.seq, p.shard, []
                    running.append(p.resume)
                    free[p.shard], moved = free[p.shard] - 1, True
                    break
                try:
                    seq, copy = ((p.seq, None) if len(p.samples) == 1
                                 else self._fork(p.seq, p.shard))
                except OutOfPages:
                    break
                pages = self._pool(p.shard).pages  # copies name pages of the pools together
                copies += [(p.shard * pages + copy[0], p.shard * pages + copy[1])] if copy else []
                starts.append((p, p.samples.pop(0), seq))
                free[p.shard] -= 1
        prefilling[:] = [p for p in prefilling if p.samples]
        if copies:
            src, dst = np.zeros((2, pow2(len(copies))), np.int32)
            src[:len(copies)], dst[:len(copies)] = zip(*copies)
            self.pools = self.programs.copy(self.pools, src, dst)
        if starts:
            self._first(starts, running, done)
        return moved or bool(starts)

    def _first(self, starts: list[tuple[_Prefill, int, SequencePages]], running: list[_Sample],
               done) -> None:
        """Draw the first token of each started sample."""
        call, d = self._call, len(self.shards)
        n = d * max(MIN_ROWS, pow2(-(-len(starts) // d)))  # rows over the shards
        h = self.programs.rows(jnp.stack([p.h for p, _, _ in starts]
                                         + [starts[0][0].h] * (n - len(starts))))
        hashes, index = np.zeros(n, np.uint32), np.zeros(n, np.int32)
        for k, (p, j, _) in enumerate(starts):
            hashes[k], index[k] = uid_hash(call.prompts[p.index].uid), j
        tok, logp, text, hit = jax.device_get(self.programs.first(
            call.state, h, self.programs.rows(hashes), self.programs.rows(index), call.seed,
            call.knobs, call.stops))
        for k, (p, j, seq) in enumerate(starts):
            self._started += 1
            run = _Sample(p.index, j, int(hashes[k]), seq, [int(tok[k])], [float(logp[k])],
                          int(text[k]), self._started, p.shard, list(p.routes))
            if hit[k] or call.sampling.max_new_tokens == 1:
                self._finish(run, bool(hit[k]), done)
            else:
                running.append(run)

    def _reserve(self, running: list[_Sample], waiting: collections.deque) -> None:
        """Pages for every sample's next burst; out of pages, the latest started samples are
        preempted (back to the front of ``waiting``) until the others fit."""
        limit = self._call.sampling.max_new_tokens
        for run in sorted(running, key=lambda r: r.started):
            want = run.seq.length + min(self.burst, limit - len(run.tokens))
            while run in running:
                try:
                    self._grow(run.seq, want, run.shard)
                    break
                except OutOfPages:  # the latest started of the same shard (its pool)
                    victim = max((r for r in running if r.shard == run.shard),
                                 key=lambda r: r.started)
                    running.remove(victim)
                    victim.seq.release(self._pool(victim.shard))
                    waiting.appendleft(victim)
                    self.stats.preempted += 1

    def _decode(self, running: list[_Sample], waiting: collections.deque, done,
                pending: bool) -> None:
        """One burst of every running sample, packed into its slot bucket."""
        self._reserve(running, waiting)
        if not running:
            return
        call = self._call
        block, where = self._blocks(running, self.buckets)
        b = block * len(self.shards)
        m = self._pool(0).pages_for(self._longest)  # one width a call: attention stops at ends
        table = np.zeros((b, m), np.int32)
        z = np.zeros(b, np.int32)
        length, last, generated, limit, text, index = (z.copy() for _ in range(6))
        hashes, live = np.zeros(b, np.uint32), np.zeros(b, bool)
        for r, run in zip(where, running):
            table[r, :len(run.seq.pages)] = run.seq.pages
            length[r], last[r], generated[r] = run.seq.length, run.tokens[-1], len(run.tokens)
            limit[r], text[r], index[r] = call.sampling.max_new_tokens, run.text, run.sample
            hashes[r], live[r] = run.uid, True
        slots = jax.tree.map(self.programs.rows,
                             Slots(table, length, last, generated, limit, live, text, hashes,
                                   index))
        smaller = [n for n in self.buckets if n < block]  # live rows that end the burst
        self.pools, *outs = self.programs.burst(call.state, self.pools, slots, call.seed,
                                                call.knobs, call.stops, np.bool_(pending),
                                                np.int32(max(smaller, default=0)))
        after, tokens, logps, drawn, stopped, dropped, *experts = jax.device_get(outs)
        self.stats.dropped += int(dropped)
        self.stats.bursts += 1
        self.stats.steps += int(drawn.max())
        self.stats.drawn += int(drawn.sum())
        for r, run in zip(where, list(running)):
            run.tokens += tokens[r, :drawn[r]].tolist()
            run.logps += logps[r, :drawn[r]].tolist()
            run.routes += [experts[0][r, :drawn[r]]] if experts else []
            run.seq.length, run.text = int(after.length[r]), int(after.text[r])
            if not after.live[r]:
                running.remove(run)
                self._finish(run, bool(stopped[r]), done)

    def _routes(self, run: _Sample, prompt: int) -> tuple:
        """``row_rollout``'s routes of a finished sample: its prompt's and its completion's
        experts, -1 on the last token (never fed); () when not recorded."""
        if not self.record_routes:
            return ()
        fed = np.concatenate(run.routes)  # the prompt, then every completion token but the last
        last = np.full((1, *fed.shape[1:]), -1, fed.dtype)
        return fed[:prompt], np.concatenate([fed[prompt:], last])

    def _finish(self, run: _Sample, stopped: bool, done) -> None:
        call = self._call
        prompt = call.prompts[run.index]
        done[run.index, run.sample] = row_rollout(
            prompt, run.sample, np.asarray(run.tokens, np.int32),
            np.asarray(run.logps, np.float32), len(run.tokens), stopped, call.sampling,
            call.tokenizer, call.version, self._routes(run, len(prompt.token_ids)))
        index = self.shards[run.shard].index
        if index is not None:  # what the pages hold: the prompt and every fed token
            index.put(tuple(prompt.token_ids) + tuple(run.tokens[:-1]), run.seq.pages)
        run.seq.release(self._pool(run.shard))
