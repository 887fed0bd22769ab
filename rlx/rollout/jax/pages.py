"""The host side of the built-in engine's paged KV cache: which pages hold which tokens.

The device cache (one buffer per layer) is a pool of ``pages`` pages of ``page_size`` token slots.
A sequence holds the pages its tokens fill, in order (``SequencePages``): token ``j`` lives in
page ``pages[j // page_size]`` at offset ``j % page_size``. Pages are reference counted, so
sequences share the pages of a common prefix:

* the ``n`` samples of one prompt share the prompt's full pages (prefilled once); each sample
  gets its own copy of the last, partial page (``fork``: copy on write, before anyone writes
  into it);
* a finished sequence's full pages stay indexed by the tokens they hold (``PrefixIndex``, keyed
  by a hash chained over the page contents), so a later request that starts with those tokens
  (an episode's next turn, another sample of the same prompt) takes them instead of prefilling
  them; an indexed page that no sequence holds is evicted, least recently used first, when the
  free list runs dry.

Page 0 is never handed out: it is where writes of padding tokens go.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Sequence


class OutOfPages(RuntimeError):
    """No free page is left (the engine preempts a sequence, or refuses a request)."""


class PagePool:
    """Reference-counted pages ``1 .. pages - 1`` (page 0 is the padding sink)."""

    def __init__(self, pages: int, page_size: int):
        if pages < 2 or page_size < 1:
            raise ValueError(f"a paged cache needs >= 2 pages of >= 1 slot, got {pages} x "
                             f"{page_size}")
        self.pages, self.page_size = pages, page_size
        self.refs = [0] * pages
        self._free = collections.deque(range(1, pages))

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        """``n`` free pages, each held once; ``OutOfPages`` (nothing taken) if fewer are free."""
        if n > len(self._free):
            raise OutOfPages(f"{n} pages asked, {len(self._free)} free of {self.pages - 1}")
        out = [self._free.popleft() for _ in range(n)]
        for p in out:
            self.refs[p] = 1
        return out

    def hold(self, pages: Sequence[int]) -> None:
        """One more holder of each of ``pages``."""
        for p in pages:
            if self.refs[p] < 1 and p not in self._free:
                raise ValueError(f"page {p} is neither held nor free")
            if self.refs[p] == 0:
                self._free.remove(p)
            self.refs[p] += 1

    def drop(self, pages: Sequence[int]) -> list[int]:
        """One holder less of each of ``pages``; returns the pages nobody holds now (freed)."""
        freed = []
        for p in pages:
            if self.refs[p] < 1:
                raise ValueError(f"page {p} dropped more often than held")
            self.refs[p] -= 1
            if self.refs[p] == 0:
                freed.append(p)
                self._free.append(p)
        return freed

    def grow(self, pages: int) -> None:
        """Extend the pool to ``pages`` pages (the new ones free; held pages keep their ids)."""
        self._free.extend(range(self.pages, pages))
        self.refs += [0] * max(0, pages - self.pages)
        self.pages = max(self.pages, pages)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)


@dataclasses.dataclass
class SequencePages:
    """The pages of one sequence's tokens (``length`` of them written so far)."""

    pages: list[int] = dataclasses.field(default_factory=list)
    length: int = 0

    def grow(self, pool: PagePool, length: int) -> None:
        """Hold pages for ``length`` tokens (``OutOfPages``, nothing taken, if short)."""
        more = pool.pages_for(length) - len(self.pages)
        if more > 0:
            self.pages += pool.take(more)

    def fork(self, pool: PagePool) -> tuple["SequencePages", tuple[int, int] | None]:
        """A second sequence continuing this one's tokens: full pages shared, the last partial
        page copied. Returns it and the copy to make on the device, ``(source, target)`` page,
        or None when the tokens end on a page boundary."""
        full = self.length // pool.page_size
        partial = full < len(self.pages) and self.length % pool.page_size != 0
        copy = pool.take(1) if partial else []  # first: OutOfPages leaves nothing held
        pool.hold(self.pages[:full])
        out = SequencePages(self.pages[:full] + copy, self.length)
        return out, (self.pages[full], copy[0]) if partial else None

    def release(self, pool: PagePool) -> list[int]:
        """Drop every page; returns those now free."""
        freed = pool.drop(self.pages)
        self.pages, self.length = [], 0
        return freed


def page_keys(tokens: Sequence[int], page_size: int) -> list[bytes]:
    """A key per *full* page of ``tokens``: a hash of every token up to that page's end
    (chained, so equal keys mean equal prefixes, not only equal pages)."""
    keys, prev = [], b""
    for start in range(0, len(tokens) - page_size + 1, page_size):
        chunk = ",".join(map(str, tokens[start:start + page_size])).encode()
        prev = hashlib.blake2b(prev + chunk, digest_size=16).digest()
        keys.append(prev)
    return keys


class PrefixIndex:
    """Full pages of finished sequences, by ``page_keys``, for later requests that start with the
    same tokens. The index holds each page once (a pool reference); ``evict`` drops the least
    recently used pages that only the index holds."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self._pages: collections.OrderedDict[bytes, int] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._pages)

    def put(self, tokens: Sequence[int], pages: Sequence[int]) -> None:
        """Index the full pages of a sequence whose ``tokens`` are written in ``pages``."""
        for key, page in zip(page_keys(tokens, self.pool.page_size), pages):
            if key in self._pages:
                self._pages.move_to_end(key)
                continue
            self.pool.hold([page])
            self._pages[key] = page

    def match(self, tokens: Sequence[int], hold: bool = True,
              keys: Sequence[bytes] | None = None) -> list[int]:
        """The pages of the longest indexed prefix of ``tokens`` (whole pages), each held once
        more for the caller (``hold``; else only looked up). At least one token is left
        unmatched (its logits start the completion): ``keys``, where the caller has them, are
        ``page_keys`` of ``tokens[:-1]``."""
        out = []
        for key in page_keys(tokens[:-1], self.pool.page_size) if keys is None else keys:
            page = self._pages.get(key)
            if page is None:
                break
            if hold:
                self._pages.move_to_end(key)
            out.append(page)
        if hold:
            self.pool.hold(out)
        return out

    def evict(self, want: int) -> int:
        """Drop index entries, least recently used first, until ``want`` pages are free or none
        is left whose only holder is the index; returns the pages freed."""
        freed = 0
        for key in list(self._pages):
            if self.pool.free >= want:
                break
            page = self._pages[key]
            if self.pool.refs[page] == 1:
                del self._pages[key]
                freed += len(self.pool.drop([page]))
        return freed

    def clear(self) -> None:
        """Drop everything (a weight update makes the cached keys and values stale)."""
        self.pool.drop(list(self._pages.values()))
        self._pages.clear()
