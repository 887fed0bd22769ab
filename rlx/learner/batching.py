"""Host-side batching: variable-length rollouts -> a `TrainBatch` of [B, T] numpy arrays.

Two layouts, which the learner treats identically (it is segment-aware):

* `pad_rollouts` - one sequence per row, right-padded to a bucketed length (the smallest entry of
  `buckets` that fits, else the longest rollout rounded up to `length_multiple`), so a run
  compiles a handful of shapes, not one per batch.
* `pack_rollouts` - several sequences per row of a fixed `row_len` (first-fit decreasing), with
  segment ids 1, 2, ... and positions restarting per sequence. Less padding for long-tailed
  completion lengths.

Rows are added (all padding: segment 0, loss mask 0) until B is a multiple of `rows_multiple`,
which should be the data-parallel size times the number of micro-batches.

Both also list each row's loss-mask columns (`TrainBatch.logp_columns`, `loss_columns`), padded
to a bucketed count, so the learner runs its vocabulary projection on completion tokens only
(like TRL's `logits_to_keep`): with 64 prompt and 128 completion tokens per row that is a third of
the lm-head's work, forward and backward. `columns=False` leaves the field out (log-probs at
every column).

Rollouts are read by attribute: `prompt_ids`, `completion_ids`, `sampler_logp`, optionally
`completion_mask`, a prompt uid (`uid` or `prompt_uid`, any hashable) and `weight_version`. Uids
become int indices in first-seen order; integer-like weight versions are kept, others indexed.
When a rollout carries `routes` (the sampler's experts, routing replay) the batch gets
`TrainBatch.routes` `[B, T, moe layers, k]`, aligned with `input_ids`, -1 on padding, in
unused slots and for rollouts without routes (the learner's router picks there).
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from rlx.mesh import TRAIN_RULES, LogicalRules, batch_sharding, round_up
from rlx.types import BATCH_FIELDS, Rollout, TrainBatch

_FLOAT_FIELDS = ("loss_mask", "advantages", "sampler_logp", "old_logp", "ref_logp")


def _route_shape(rollouts) -> tuple[int, int] | None:
    """``(moe layers, k)`` of the rollouts' recorded routes; None when none has any."""
    shapes = {tuple(r.routes.shape[1:]) for r in rollouts if getattr(r, "routes", None) is not None}
    if len(shapes) > 1:
        raise ValueError(f"rollouts carry routes of different shapes {sorted(shapes)} [moe layers, "
                         "k]; batch rollouts of one model together")
    return shapes.pop() if shapes else None


def _empty(rows: int, length: int, with_old: bool, with_ref: bool,
           routes: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
    out = {} if routes is None else {"routes": np.full((rows, length, *routes), -1, np.int16)}
    for name in BATCH_FIELDS:
        if (name == "old_logp" and not with_old) or (name == "ref_logp" and not with_ref) or \
                name in ("old_values", "returns"):  # filled in on device (rlx.learner.critic)
            continue
        if name in _FLOAT_FIELDS:
            out[name] = np.zeros((rows, length), np.float32)
        else:
            fill = -1 if name in ("uid", "weight_version") else 0
            out[name] = np.full((rows, length), fill, np.int32)
    return out


def _check_inputs(rollouts, advantages, old_logp, ref_logp) -> np.ndarray:
    if not len(rollouts):
        raise ValueError("cannot batch zero rollouts")
    advantages = np.asarray(advantages, np.float32).reshape(-1)
    if len(advantages) != len(rollouts):
        raise ValueError(f"got {len(advantages)} advantages for {len(rollouts)} rollouts")
    for name, extra in (("old_logp", old_logp), ("ref_logp", ref_logp)):
        if extra is not None and len(extra) != len(rollouts):
            raise ValueError(f"got {len(extra)} {name} arrays for {len(rollouts)} rollouts")
    missing = [i for i, r in enumerate(rollouts) if not getattr(r, "has_logprobs", True)]
    if missing:
        raise ValueError(f"rollouts {missing[:5]} have no sampler log-probs: they were generated "
                         "with SamplingParams(logprobs=False); generate the rollouts to train on "
                         "with logprobs=True")
    return advantages


def _index(values) -> np.ndarray:
    """Hashable values -> int32 indices in first-seen order."""
    seen: dict = {}
    return np.array([seen.setdefault(v, len(seen)) for v in values], np.int32)


def _tags(rollouts) -> tuple[np.ndarray, np.ndarray]:
    """Per-rollout int uid and weight version."""
    uids = _index([r.prompt_uid for r in rollouts])
    versions = [getattr(r, "weight_version", 0) for r in rollouts]
    if all(str(v).lstrip("-").isdigit() for v in versions):
        return uids, np.array([int(v) for v in versions], np.int32)
    return uids, _index(versions)


def _place(arrays, row: int, start: int, segment: int, r: Rollout, adv: float, old, ref,
           tags: tuple[int, int]) -> None:
    """Write rollout `r` into row `row` from column `start` as segment `segment`."""
    p, c = len(r.prompt_ids), len(r.completion_ids)
    span = slice(start, start + p + c)
    done = slice(start + p, start + p + c)  # the completion tokens
    arrays["input_ids"][row, span] = np.concatenate([r.prompt_ids, r.completion_ids])
    arrays["positions"][row, span] = np.arange(p + c)
    arrays["segment_ids"][row, span] = segment
    mask = getattr(r, "completion_mask", None)
    mask = np.ones(c) if mask is None else np.asarray(mask)
    arrays["loss_mask"][row, done] = mask
    arrays["advantages"][row, done] = adv * mask
    arrays["sampler_logp"][row, done] = np.asarray(r.sampler_logp) * mask
    if old is not None:
        arrays["old_logp"][row, done] = np.asarray(old) * mask
    if ref is not None:
        arrays["ref_logp"][row, done] = np.asarray(ref) * mask
    arrays["uid"][row, span], arrays["weight_version"][row, span] = tags
    if "routes" in arrays and getattr(r, "routes", None) is not None:
        arrays["routes"][row, span] = r.routes
    versions = getattr(r, "token_versions", None)
    if versions is not None:  # a partial rollout: each token's own version
        arrays["weight_version"][row, done] = np.asarray(versions)


def train_buckets(top: int, smallest: int = 64, per_octave: int = 4) -> tuple[int, ...]:
    """Padded row lengths for ``pad_rollouts``: ``per_octave`` evenly spaced lengths in every
    doubling from ``smallest`` (64, 80, 96, 112, 128, 160, ... for 4), multiples of 8, then ``top``.

    A batch then pads its longest row by at most ``1 / per_octave`` (25% for 4), where powers of
    two alone padded up to 2x (a 168-token batch to 256), and the train step compiles at most
    ``per_octave`` shapes per doubling of the length, plus one for ``top``. The coordinator uses
    ``config.train.length_buckets`` (8: 174-token rows train as 176, not 192).
    """
    if top < 1 or smallest < 8 or per_octave < 1:
        raise ValueError(f"train_buckets: top={top}, smallest={smallest} (>= 8), "
                         f"per_octave={per_octave} (>= 1)")
    out, octave = [], smallest
    while octave < top:
        step = octave // per_octave
        out += [octave + i * step for i in range(per_octave)]
        octave *= 2
    return tuple(sorted({m for m in (-(-n // 8) * 8 for n in out) if m < top})) + (top,)


def loss_columns(loss_mask: np.ndarray, smallest: int = 16) -> np.ndarray | None:
    """Each row's columns with ``loss_mask > 0``, ascending, zero-filled to ``[B, K]``.

    ``K`` is the smallest of ``train_buckets(T, smallest)`` that holds the fullest row, so a run
    compiles a few values of ``K`` per ``T``. None when that is all ``T`` columns (no saving).
    """
    mask = np.asarray(loss_mask) > 0
    rows, length = mask.shape
    if length <= smallest:
        return None
    most = max(int(mask.sum(axis=1).max(initial=0)), 1)
    k = next(n for n in train_buckets(length, smallest) if n >= most)
    if k >= length:
        return None
    out = np.zeros((rows, k), np.int32)
    for r in range(rows):
        cols = np.flatnonzero(mask[r])
        out[r, :len(cols)] = cols
    return out


def _with_columns(arrays: dict[str, np.ndarray], wanted: bool) -> TrainBatch:
    columns = loss_columns(arrays["loss_mask"]) if wanted else None
    return TrainBatch(**arrays, logp_columns=columns)


def pad_rollouts(
    rollouts: Sequence[Rollout],
    advantages: np.ndarray,
    *,
    buckets: Sequence[int] = (),
    length_multiple: int = 8,
    rows_multiple: int = 1,
    old_logp: Sequence[np.ndarray] | None = None,
    ref_logp: Sequence[np.ndarray] | None = None,
    columns: bool = True,
) -> TrainBatch:
    """One rollout per row, right-padded. `old_logp` / `ref_logp`: per-completion arrays [C_i].
    `columns`: list the loss-mask columns (`loss_columns`) for the learner."""
    advantages = _check_inputs(rollouts, advantages, old_logp, ref_logp)
    longest = max(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
    fitting = sorted(b for b in buckets if b >= longest)
    length = fitting[0] if fitting else round_up(longest, length_multiple)
    rows = round_up(len(rollouts), rows_multiple)
    arrays = _empty(rows, length, old_logp is not None, ref_logp is not None,
                    _route_shape(rollouts))
    uids, versions = _tags(rollouts)
    for i, r in enumerate(rollouts):
        _place(arrays, i, 0, 1, r, advantages[i], _nth(old_logp, i), _nth(ref_logp, i),
               (uids[i], versions[i]))
    return _with_columns(arrays, columns)


def pack_rollouts(
    rollouts: Sequence[Rollout],
    advantages: np.ndarray,
    *,
    row_len: int,
    rows_multiple: int = 1,
    old_logp: Sequence[np.ndarray] | None = None,
    ref_logp: Sequence[np.ndarray] | None = None,
    columns: bool = True,
) -> TrainBatch:
    """Pack rollouts into rows of `row_len` tokens, longest first, each into the first row with
    room (first-fit decreasing)."""
    advantages = _check_inputs(rollouts, advantages, old_logp, ref_logp)
    lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in rollouts]
    too_long = [n for n in lengths if n > row_len]
    if too_long:
        raise ValueError(f"a rollout of {max(too_long)} tokens does not fit row_len={row_len}")
    order = sorted(range(len(rollouts)), key=lambda i: -lengths[i])
    used: list[int] = []  # tokens used per row
    slots: list[tuple[int, int, int, int]] = []  # (rollout, row, start, segment)
    segments: list[int] = []
    for i in order:
        row = next((j for j, u in enumerate(used) if u + lengths[i] <= row_len), None)
        if row is None:
            row = len(used)
            used.append(0)
            segments.append(0)
        segments[row] += 1
        slots.append((i, row, used[row], segments[row]))
        used[row] += lengths[i]
    arrays = _empty(round_up(len(used), rows_multiple), row_len,
                    old_logp is not None, ref_logp is not None, _route_shape(rollouts))
    uids, versions = _tags(rollouts)
    for i, row, start, seg in slots:
        _place(arrays, row, start, seg, rollouts[i], advantages[i], _nth(old_logp, i),
               _nth(ref_logp, i), (uids[i], versions[i]))
    return _with_columns(arrays, columns)


def _nth(seq, i):
    return None if seq is None else seq[i]


def shard_batch(batch: TrainBatch, mesh: Mesh, rules: LogicalRules = TRAIN_RULES) -> TrainBatch:
    """Put a host batch on the mesh, rows split over the batch axes."""
    sharding = batch_sharding(mesh, 2, rules)
    return jax.tree.map(lambda x: jax.device_put(np.asarray(x), sharding), batch)
