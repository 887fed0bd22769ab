"""The host side of continuous batching: requests into decode slots, pages to sequences.

``Scheduler.run(prompts, sampling)`` serves every sample of every prompt through the programs of
``rlx.rollout.jax.continuous``. Each turn of its loop:

1. **admit**: the next waiting prompt whose samples fit the free slots takes pages for its
   tokens and is queued for prefill;
2. **prefill**: one ``prefill_chunk`` call writes up to ``chunk`` more tokens of up to ``rows``
   queued prompts (chunked prefill: bounded tokens between decode bursts);
3. **start**: a prompt whose tokens are all written forks into its samples (full pages shared,
   the last partial page copied: ``SequencePages.fork``), each drawing its first token
   (``first_tokens``) into a free slot;
4. **decode**: every live slot gets the pages its next ``burst`` tokens need and one
   ``decode_burst`` runs; slots that finish free their pages and are refilled next turn.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlx.rollout.jax.batching import row_rollout, uid_hash
from rlx.rollout.jax.continuous import Programs, Slots
from rlx.rollout.jax.pages import PagePool, SequencePages
from rlx.types import Prompt, Rollout, SamplingParams


@dataclasses.dataclass
class _Prefill:
    """A prompt being written into its pages."""

    index: int  # the prompt's position in the call
    seq: SequencePages
    samples: list[int]  # sample indices still to start
    h: Any = None  # its last token's hidden state, once every token is written


@dataclasses.dataclass
class _Running:
    """A sample in a decode slot."""

    index: int
    sample: int
    seq: SequencePages
    tokens: list[int] = dataclasses.field(default_factory=list)
    logps: list[float] = dataclasses.field(default_factory=list)


class Scheduler:
    """Decode slots, page pool and the turn loop (module docstring)."""

    def __init__(self, programs: Programs, pools, pool: PagePool, *, slots: int,
                 pages_per_seq: int, chunk: int, rows: int, burst: int):
        self.programs, self.pools, self.pool = programs, pools, pool
        self.slots, self.pages_per_seq, self.chunk, self.rows = slots, pages_per_seq, chunk, rows
        self.burst = burst

    @property
    def max_tokens(self) -> int:
        return self.pages_per_seq * self.pool.page_size

    def run(self, prompts: Sequence[Prompt], sampling: SamplingParams, seed: int, knobs, stops,
            tokenizer=None, version: int = 0) -> list[Rollout]:
        for p in prompts:
            if len(p.token_ids) + sampling.max_new_tokens > self.max_tokens:
                raise ValueError(f"prompt {p.uid!r}: {len(p.token_ids)} tokens + max_new_tokens "
                                 f"{sampling.max_new_tokens} exceed the {self.max_tokens} "
                                 "tokens a sequence's pages can hold")
        self._prompts, self._sampling, self._seed = prompts, sampling, np.int32(seed)
        self._knobs, self._stops = knobs, stops
        waiting = collections.deque(range(len(prompts)))
        prefilling: list[_Prefill] = []
        ready: list[_Prefill] = []
        running: dict[int, _Running] = {}
        done: dict[tuple[int, int], Rollout] = {}
        state = self._empty_slots()
        while waiting or prefilling or ready or running:
            free = self.slots - len(running) - sum(len(r.samples) for r in prefilling + ready)
            while waiting and free >= min(sampling.n, self.slots):
                i = waiting.popleft()
                seq = SequencePages()
                seq.grow(self.pool, len(prompts[i].token_ids))
                prefilling.append(_Prefill(i, seq, list(range(sampling.n))))
                free -= sampling.n
            if prefilling:
                ready += self._prefill(prefilling)
                prefilling = [p for p in prefilling if p not in ready]
            state = self._start(ready, running, state, done, tokenizer, version)
            ready = [r for r in ready if r.samples]
            if running:
                state = self._decode(running, state, done, bool(waiting or ready), tokenizer,
                                     version)
        n = sampling.n
        return [done[i, j] for i in range(len(prompts)) for j in range(n)]

    # --- the turn's steps --------------------------------------------------------------------
    def _empty_slots(self) -> dict[str, np.ndarray]:
        s, z = self.slots, np.zeros(self.slots, np.int32)
        return dict(table=np.zeros((s, self.pages_per_seq), np.int32), length=z.copy(),
                    last=z.copy(), generated=z.copy(), limit=z + 1, live=np.zeros(s, bool),
                    text=z.copy(), uid_hash=np.zeros(s, np.uint32), sample_index=z.copy())

    def _table(self, seq: SequencePages) -> np.ndarray:
        out = np.zeros(self.pages_per_seq, np.int32)
        out[:len(seq.pages)] = seq.pages
        return out

    def _prefill(self, prefilling: list[_Prefill]) -> list[_Prefill]:
        """One chunk of up to ``rows`` prompts; returns those now fully written (``h`` set)."""
        batch = prefilling[:self.rows]
        ids, pos, seg = (np.zeros((self.rows, self.chunk), np.int32) for _ in range(3))
        table = np.zeros((self.rows, self.pages_per_seq), np.int32)
        lengths = np.zeros(self.rows, np.int32)
        for r, p in enumerate(batch):
            tokens = self._prompts[p.index].token_ids
            start = p.seq.length
            n = min(self.chunk, len(tokens) - start)
            ids[r, :n], pos[r, :n], seg[r, :n] = tokens[start:start + n], range(start, start + n), 1
            table[r], lengths[r] = self._table(p.seq), start
            p.seq.length += n
        self.pools, h = self.programs.prefill(self.pools, ids, pos, seg, table, lengths)
        out = []
        for r, p in enumerate(batch):
            if p.seq.length == len(self._prompts[p.index].token_ids):
                p.h = h[r]
                out.append(p)
        return out

    def _start(self, ready: list[_Prefill], running: dict[int, _Running], state, done,
               tokenizer, version):
        """Fork ready prompts into free slots and draw their samples' first tokens."""
        free = [s for s in range(self.slots) if s not in running]
        starts = []  # (slot, prefill, sample, seq)
        copies = []
        for p in ready:
            while p.samples and free:
                j = p.samples.pop(0)
                seq, copy = (p.seq, None) if not p.samples else p.seq.fork(self.pool)
                copies += [copy] if copy else []
                starts.append((free.pop(0), p, j, seq))
        if not starts:
            return state
        if copies:
            src, dst = np.zeros((2, self.slots), np.int32)
            src[:len(copies)], dst[:len(copies)] = zip(*copies)
            self.pools = self.programs.copy(self.pools, src, dst)
        h = jnp.stack([p.h for _, p, _, _ in starts] + [starts[0][1].h] * (
            self.slots - len(starts)))
        hashes = np.zeros(self.slots, np.uint32)
        index = np.zeros(self.slots, np.int32)
        for n, (_, p, j, _) in enumerate(starts):
            hashes[n], index[n] = uid_hash(self._prompts[p.index].uid), j
        tok, logp, text, hit = jax.device_get(self.programs.first(
            h, hashes, index, self._seed, self._knobs, self._stops))
        limit = self._sampling.max_new_tokens
        for n, (slot, p, j, seq) in enumerate(starts):
            run = _Running(p.index, j, seq, [int(tok[n])], [float(logp[n])])
            if hit[n] or limit == 1:
                self._finish(run, bool(hit[n]), done, tokenizer, version)
                continue
            running[slot] = run
            state["table"][slot] = self._table(seq)
            for k, v in (("length", seq.length), ("last", tok[n]), ("generated", 1),
                         ("limit", limit), ("live", True), ("text", text[n]),
                         ("uid_hash", hashes[n]), ("sample_index", j)):
                state[k][slot] = v
        return state

    def _decode(self, running: dict[int, _Running], state, done, waiting: bool, tokenizer,
                version):
        """Pages for every live slot's next ``burst`` tokens, then one burst."""
        for slot, run in running.items():
            run.seq.grow(self.pool, min(state["length"][slot] + self.burst, self.max_tokens))
            run.seq.length = int(state["length"][slot])
            state["table"][slot] = self._table(run.seq)
        slots = Slots(**{k: jnp.asarray(v) for k, v in state.items()})
        self.pools, after, tokens, logps, drawn, stopped = self.programs.burst(
            self.pools, slots, self._seed, self._knobs, self._stops, np.bool_(waiting))
        after, tokens, logps, drawn, stopped = jax.device_get(
            (after, tokens, logps, drawn, stopped))
        state = {k: np.array(getattr(after, k)) for k in state}
        for slot in list(running):
            run = running[slot]
            run.tokens += tokens[slot, :drawn[slot]].tolist()
            run.logps += logps[slot, :drawn[slot]].tolist()
            run.seq.length = int(state["length"][slot])
            if not state["live"][slot]:
                self._finish(running.pop(slot), bool(stopped[slot]), done, tokenizer, version)
        return state

    def _finish(self, run: _Running, stopped: bool, done, tokenizer, version) -> None:
        prompt = self._prompts[run.index]
        done[run.index, run.sample] = row_rollout(
            prompt, run.sample, np.asarray(run.tokens, np.int32),
            np.asarray(run.logps, np.float32), len(run.tokens), stopped, self._sampling,
            tokenizer, version)
        run.seq.release(self.pool)
