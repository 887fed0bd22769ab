"""Host-side batching of the built-in engine's requests (``rlx.rollout.jax.engine``): shape
buckets, left-padded prompt rows, the prompt rows that samples of one prompt share, seeds from
prompt uids, stop strings cut on the host, and a device row turned into a ``Rollout``."""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence

import numpy as np

from rlx.mesh import round_up
from rlx.types import Prompt, Rollout, SamplingParams


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Shape buckets: powers of two at least these minimums; ``max_rows`` rows per device call."""

    min_prompt: int = 16
    min_new_tokens: int = 16
    min_rows: int = 1
    max_rows: int = 256
    min_extend: int = 16  # a continued request's new tokens (``JaxEngine.prefix_cache``)

    def rows(self, n: int, multiple: int) -> int:
        return round_up(pow2(max(n, self.min_rows)), multiple)

    def prompt(self, n: int) -> int:
        return pow2(max(n, self.min_prompt))

    def new_tokens(self, n: int) -> int:
        return pow2(max(n, self.min_new_tokens))

    def extend(self, n: int) -> int:
        return pow2(max(n, self.min_extend))


def pow2(n: int) -> int:
    return 1 << (int(n) - 1).bit_length()


def uid_hash(uid) -> int:
    """A stable 32-bit hash of a prompt uid (seeds its samples)."""
    return zlib.crc32(str(uid).encode())


def stop_string_cut(tokenizer, ids: Sequence[int], stops: Sequence[str]) -> int | None:
    """Fewest leading tokens of ``ids`` whose decoded text contains one of ``stops``, or None.

    Binary search over prefixes: containment is monotone in the prefix length.
    """
    def hit(k: int) -> bool:
        text = tokenizer.decode(list(ids[:k]), skip_special_tokens=False)
        return any(s in text for s in stops)

    if not stops or not len(ids) or not hit(len(ids)):
        return None
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if hit(mid) else (mid + 1, hi)
    return lo


def pack_left(seqs: Sequence[Sequence[int]], rows: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded ids [rows, width] and lengths [rows]; missing rows have length 0."""
    ids = np.zeros((rows, width), np.int32)
    lens = np.zeros((rows,), np.int32)
    for r, s in enumerate(seqs):
        if len(s):
            ids[r, width - len(s):] = s
        lens[r] = len(s)
    return ids, lens


def shared_prompts(reqs: list[tuple[Prompt, int]], rows: int, bucket
                    ) -> tuple[list[Prompt], int, np.ndarray]:
    """The prompts to prefill, their row count (``bucket(len)``), and per row the index of its
    prompt (-1: a padding row). The samples of one prompt share its prefill; when that would not
    save a row bucket every request keeps its own prompt row, in order."""
    index: dict[tuple, int] = {}
    distinct: list[Prompt] = []
    of_row = np.full((rows,), -1, np.int32)
    for r, (p, _) in enumerate(reqs):
        key = (p.uid, tuple(p.token_ids))
        if key not in index:
            index[key] = len(distinct)
            distinct.append(p)
        of_row[r] = index[key]
    if bucket(len(distinct)) >= rows:
        of_row[:len(reqs)] = np.arange(len(reqs))
        return [p for p, _ in reqs], rows, of_row
    return distinct, bucket(len(distinct)), of_row


def row_rollout(prompt: Prompt, j: int, tokens, logps, length: int, stopped: bool,
                sampling: SamplingParams, tokenizer, version: int, routes=()) -> Rollout:
    """Row ``tokens`` of policy ``version`` as a Rollout (stop strings cut with ``tokenizer``);
    ``routes``: the row's prompt ([p, l, k], left-padded) and completion ([n, l, k]) experts
    when recorded."""
    ids, logp = tokens[:length], logps[:length]
    cut = stop_string_cut(tokenizer, ids, sampling.stop_strings) if sampling.stop_strings else None
    if cut is not None:
        ids, logp, stopped = ids[:cut], logp[:cut], True
    recorded = None
    if routes:  # the prompt's tokens end at its last slot
        prompt_routes, completion_routes = routes
        recorded = np.concatenate([prompt_routes[len(prompt_routes) - len(prompt.token_ids):],
                               completion_routes[:len(ids)]])
    return Rollout(prompt_uid=prompt.uid, prompt_ids=np.asarray(prompt.token_ids, np.int32),
                   completion_ids=np.asarray(ids, np.int32),
                   sampler_logp=np.asarray(logp, np.float32),
                   finish_reason="stop" if stopped else "length",
                   weight_version=version, sample_index=j,
                   has_logprobs=sampling.logprobs, routes=recorded)
