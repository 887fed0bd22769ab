"""The built-in engine's prefix cache: the KV-cache rows of the sequences it just produced.

Inside ``JaxEngine.prefix_cache()`` every ``generate`` call keeps, for each completion it
returns, the cache row that produced it, indexed by the token ids of the whole sequence (prompt
and completion). A request of the next call whose prompt starts with such a sequence (a
multi-turn episode's next turn: the sequence so far, then the tool turn's tokens) continues from
that row: the cached keys and values of the sequence's tokens are gathered into the new batch's
cache and only the tokens after them are prefilled (the sequence's last sampled token, which the
decode loop never fed, and the appended ones). This is the multi-turn use of SGLang's radix
cache or vLLM's automatic prefix caching, restricted to what the engine produced last:

* a call keeps only its own rows: the rows of the previous call that no request continued are
  dropped when it returns, so finished episodes free their rows at the next turn, and leaving
  ``prefix_cache()`` drops the rest;
* a row belongs to the policy version that produced it: ``update_weights`` drops every row, and
  a row of another version is never looked up;
* a row records where each of its tokens sits (``CachedRow.slots``: the slot holding position
  i), because slots and positions differ (left padding; a continued row holds its kept tokens
  and its prefilled ones in two blocks); the gather puts them in position order.

The host side lives here (``PrefixCache``, the slot bookkeeping); the device side is
``rlx.rollout.jax.sampling.gather_prefix`` and ``KeptPrefix``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class CachedRow:
    """Where a produced sequence's keys and values are: row ``row`` of a finished batch's cache
    ``buffers`` (its keys and values, shared by the batch's rows), position i at slot
    ``slots[i]``; made by policy ``version``."""

    buffers: Any  # (keys, values): tuples of device arrays, one per layer or stack
    row: int
    slots: np.ndarray  # int32 [L]: the slots of the sequence's first L tokens (all but its last)
    version: int

    @property
    def length(self) -> int:
        return len(self.slots)


def prompt_slots(width: int, length: int, kept: int = 0, kept_width: int = 0) -> np.ndarray:
    """Slots of a row's prompt tokens in position order: ``kept`` tokens left padded in the
    first ``kept_width`` slots, then ``length`` prefilled ones left padded in the next
    ``width``."""
    return np.concatenate([np.arange(kept_width - kept, kept_width),
                           np.arange(kept_width + width - length, kept_width + width)]
                          ).astype(np.int32)


def row_slots(prompt: np.ndarray, completion_start: int, completion: int) -> np.ndarray:
    """Slots of every fed token of a row: its prompt's, then the first ``completion - 1`` sampled
    tokens' (sampled token j is fed at slot ``completion_start + j``; the last is never fed)."""
    fed = np.arange(completion_start, completion_start + max(completion - 1, 0), dtype=np.int32)
    return np.concatenate([prompt, fed])


def gather_plan(starts: Sequence[CachedRow | None], rows: int, width: int
                ) -> tuple[np.ndarray, list[tuple[Any, np.ndarray, np.ndarray, np.ndarray]]]:
    """How ``rows`` prompt rows gather the kept rows they continue (``starts``, None: nothing),
    left padded in ``width`` slots: the kept lengths [rows], and per batch they come from, its
    buffers and ``gather_prefix``'s row [rows], slots [rows, width] and take [rows] arrays."""
    lens = np.zeros((rows,), np.int32)
    sources: dict[int, list[int]] = {}  # id(buffers) -> prompt rows
    for i, start in enumerate(starts):
        if start is not None:
            lens[i] = start.length
            sources.setdefault(id(start.buffers), []).append(i)
    plan = []
    for members in sources.values():
        src, take = np.zeros((rows,), np.int32), np.zeros((rows,), bool)
        slots = np.zeros((rows, width), np.int32)  # padding slots read slot 0, never attended
        for i in members:
            src[i], take[i] = starts[i].row, True
            slots[i, width - lens[i]:] = starts[i].slots
        plan.append((starts[members[0]].buffers, src, slots, take))
    return lens, plan


class PrefixCache:
    """The rows kept between ``generate`` calls, by produced sequence (see the module docstring)."""

    def __init__(self):
        self.depth = 0  # open ``JaxEngine.prefix_cache()`` contexts: rows are kept while > 0
        self._rows: dict[bytes, CachedRow] = {}
        self._lengths: set[int] = set()  # lengths of the kept sequences

    def __len__(self) -> int:
        return len(self._rows)

    def put(self, sequence: Sequence[int], row: CachedRow) -> None:
        """Keep ``row`` as the cache of ``sequence`` (prompt and completion)."""
        key = np.asarray(sequence, np.int32)
        self._rows[key.tobytes()] = row
        self._lengths.add(len(key))

    def find(self, tokens: Sequence[int], version: int) -> CachedRow | None:
        """The longest kept sequence of policy ``version`` that ``tokens`` start with."""
        ids = np.asarray(tokens, np.int32)
        for n in sorted((n for n in self._lengths if n <= len(ids)), reverse=True):
            row = self._rows.get(ids[:n].tobytes())
            if row is not None and row.version == version:
                return row
        return None

    def keep(self, rollouts: Sequence[Any], buffers: tuple, slots: Sequence[np.ndarray],
             width: int, version: int) -> None:
        """Keep row r of a batch's cache ``buffers`` as the cache of ``rollouts[r]``'s sequence
        (``rlx.types.Rollout``s of policy ``version``): its prompt at ``slots[r]``, its
        completion from slot ``width`` on."""
        for r, (rollout, prompt) in enumerate(zip(rollouts, slots)):
            if len(rollout.completion_ids):
                sequence = np.concatenate([rollout.prompt_ids, rollout.completion_ids])
                fed = row_slots(prompt, width, len(rollout.completion_ids))
                self.put(sequence, CachedRow(buffers, r, fed, version))

    def take(self) -> "PrefixCache":
        """The kept rows as a new cache (for the running call to read); this one keeps none."""
        out = PrefixCache()
        out._rows, out._lengths = self._rows, self._lengths
        self._rows, self._lengths = {}, set()
        return out

    def clear(self) -> None:
        self._rows, self._lengths = {}, set()


__all__ = ["CachedRow", "PrefixCache", "gather_plan", "prompt_slots", "row_slots"]
