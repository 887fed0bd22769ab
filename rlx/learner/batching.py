"""Host-side batching: variable-length rollouts -> a `TrainBatch` of [B, T] numpy arrays.

A `Layout` says where each rollout sits (its row, first column and tokens); `fill` writes the
rollouts there. Layouts, which the learner treats identically (it is segment-aware):

* `pad_layout` - one sequence per row, right-padded to a bucketed length (the smallest entry of
  `buckets` that fits, else the longest rollout rounded up to `length_multiple`), so a run
  compiles a handful of shapes, not one per batch.
* `pack_layout` - several sequences per row of a fixed `row_len` (first-fit decreasing), with
  segment ids 1, 2, ... and positions restarting per sequence. Less padding for long-tailed
  completion lengths.
* `batch_layout` - the run's choice (`Batching`, from `config.train`): packed (`train.pack`) or
  padded rows, as many as a whole number of micro-batches of every minibatch needs. Micro-batches
  are a fixed count (`train.micro_batches`) or formed by a token budget
  (`train.tokens_per_micro_batch`, `micro_count`): each holds, on every data-parallel shard,
  packed rows of the budget's length (one) or padded rows as many as fit in it. A rollout longer
  than the budget makes that step's rows its bucketed length (one update compiles one shape): its
  micro-batch holds it in a row of that length (shorter ones fill the rest of the row, first-fit
  decreasing). The micro-batch count is rounded up to a few values per doubling (`count_bucket`)
  so the train step compiles a handful of programs; the rows that adds are padding, and the step
  skips micro-batches without a loss token.

`pad_rollouts` / `pack_rollouts` are a layout and `fill` in one call. Rows are added (all
padding: segment 0, loss mask 0) until B is a multiple of `rows_multiple`, which should be the
data-parallel size times the number of micro-batches.

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

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each of n rollouts sits in a [B, T] batch: row ``rows[i]`` from column ``starts[i]``,
    ``lengths[i]`` tokens (prompt + completion), segment ``segments[i]`` of its row."""

    rows: np.ndarray  # [n] int
    starts: np.ndarray  # [n] int
    lengths: np.ndarray  # [n] int
    segments: np.ndarray  # [n] int, 1, 2, ... within a row
    shape: tuple[int, int]  # (B, T)

    def with_rows(self, multiple: int) -> "Layout":
        """The same placements with the rows rounded up to a multiple of ``multiple``."""
        rows, length = self.shape
        return dataclasses.replace(self, shape=(round_up(rows, multiple), length))

    @property
    def efficiency(self) -> float:
        """Rollout tokens over the tokens of the rows that hold any (1: no padding)."""
        used = len(np.unique(self.rows))
        return float(self.lengths.sum() / max(used * self.shape[1], 1))

    def _spans(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """[n, W] (W: the longest rollout) row and column of each rollout's token j, and whether
        it has a token j."""
        j = np.arange(int(self.lengths.max(initial=1)))[None, :]  # [1, W]
        valid = j < self.lengths[:, None]  # [n, W]
        cols = np.where(valid, self.starts[:, None] + j, 0)
        return np.broadcast_to(self.rows[:, None], valid.shape), cols, valid

    def unpack(self, x: np.ndarray) -> np.ndarray:
        """[B, T] -> [n, W]: rollout i's tokens in row i from column 0, 0 after them (the padded
        layout of the host-side estimators, whatever this layout is)."""
        rows, cols, valid = self._spans()
        return np.where(valid, np.asarray(x)[rows, cols], 0)

    def pack(self, y: np.ndarray) -> np.ndarray:
        """The inverse of ``unpack``: [n, >= W] -> [B, T], 0 off every rollout."""
        rows, cols, valid = self._spans()
        y = np.asarray(y)
        out = np.zeros(self.shape, y.dtype)
        out[rows[valid], cols[valid]] = y[:, :valid.shape[1]][valid]
        return out

    def spread(self, values: np.ndarray) -> np.ndarray:
        """Per-rollout values [n] over each rollout's tokens: [B, T], 0 on padding."""
        width = int(self.lengths.max(initial=1))
        return self.pack(np.repeat(np.asarray(values)[:, None], width, axis=1))


def _lengths(rollouts) -> np.ndarray:
    return np.array([len(r.prompt_ids) + len(r.completion_ids) for r in rollouts], np.int64)


def row_length(longest: int, buckets: Sequence[int] = (), length_multiple: int = 8) -> int:
    """The padded length of a row holding ``longest`` tokens: the smallest bucket that fits, else
    ``longest`` rounded up to ``length_multiple``."""
    fitting = sorted(b for b in buckets if b >= longest)
    return fitting[0] if fitting else round_up(longest, length_multiple)


def pad_layout(lengths: Sequence[int], *, buckets: Sequence[int] = (), length_multiple: int = 8,
               rows_multiple: int = 1) -> Layout:
    """One rollout per row (row i = rollout i), right-padded to ``row_length``."""
    lengths = np.asarray(lengths, np.int64)
    n = len(lengths)
    shape = (n, row_length(int(lengths.max()), buckets, length_multiple))
    return Layout(np.arange(n), np.zeros(n, np.int64), lengths, np.ones(n, np.int64),
                  shape).with_rows(rows_multiple)


def pack_layout(lengths: Sequence[int], *, row_len: int, rows_multiple: int = 1) -> Layout:
    """Rollouts into rows of ``row_len`` tokens, longest first, each into the first row with room
    (first-fit decreasing; ties keep their order, so every process packs alike)."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.max() > row_len:
        raise ValueError(f"a rollout of {lengths.max()} tokens does not fit row_len={row_len}")
    n = len(lengths)
    rows, starts, segments = (np.zeros(n, np.int64) for _ in range(3))
    used: list[int] = []  # tokens used per row
    held: list[int] = []  # rollouts per row so far (the next one's segment id - 1)
    for i in sorted(range(n), key=lambda i: -lengths[i]):
        row = next((j for j, u in enumerate(used) if u + lengths[i] <= row_len), len(used))
        if row == len(used):
            used.append(0)
            held.append(0)
        held[row] += 1
        rows[i], starts[i], segments[i] = row, used[row], held[row]
        used[row] += int(lengths[i])
    return Layout(rows, starts, lengths, segments, (len(used), row_len)).with_rows(rows_multiple)


def fill(rollouts: Sequence[Rollout], advantages: np.ndarray, layout: Layout, *,
         old_logp: Sequence[np.ndarray] | None = None, ref_logp: Sequence[np.ndarray] | None = None,
         columns: bool = True) -> TrainBatch:
    """The batch of ``rollouts`` placed as ``layout`` says. `old_logp` / `ref_logp`:
    per-completion arrays [C_i]. `columns`: list the loss-mask columns (`loss_columns`)."""
    advantages = _check_inputs(rollouts, advantages, old_logp, ref_logp)
    if len(layout.rows) != len(rollouts):
        raise ValueError(f"a layout of {len(layout.rows)} rollouts for {len(rollouts)} rollouts")
    arrays = _empty(*layout.shape, old_logp is not None, ref_logp is not None,
                    _route_shape(rollouts))
    uids, versions = _tags(rollouts)
    for i, r in enumerate(rollouts):
        _place(arrays, layout.rows[i], layout.starts[i], layout.segments[i], r, advantages[i],
               _nth(old_logp, i), _nth(ref_logp, i), (uids[i], versions[i]))
    return _with_columns(arrays, columns)


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
    """One rollout per row, right-padded (`pad_layout`, `fill`)."""
    _check_inputs(rollouts, advantages, old_logp, ref_logp)
    layout = pad_layout(_lengths(rollouts), buckets=buckets, length_multiple=length_multiple,
                        rows_multiple=rows_multiple)
    return fill(rollouts, advantages, layout, old_logp=old_logp, ref_logp=ref_logp,
                columns=columns)


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
    """Several rollouts per row of `row_len` tokens (`pack_layout`, `fill`)."""
    _check_inputs(rollouts, advantages, old_logp, ref_logp)
    layout = pack_layout(_lengths(rollouts), row_len=row_len, rows_multiple=rows_multiple)
    return fill(rollouts, advantages, layout, old_logp=old_logp, ref_logp=ref_logp,
                columns=columns)


def count_bucket(n: int, per_octave: int = 4) -> int:
    """``n`` rounded up to one of ``per_octave`` counts per doubling (1, 2, ..., 8, 10, 12, 14,
    16, 20, ... for 4): at most ``1 / per_octave`` more, a handful of values per doubling."""
    step = 1
    while n > 2 * per_octave * step:
        step *= 2
    return round_up(max(n, 1), step)


def micro_rows(length: int, tokens: int) -> int:
    """Rows of ``length`` tokens per data-parallel shard in a micro-batch of ``tokens`` tokens per
    shard: as many as fit, at least one."""
    return max(1, tokens // length)


def micro_count(shape: tuple[int, int], shards: int, micro_batches: int, tokens: int = 0) -> int:
    """The micro-batches of an update on a [B, T] batch split over ``shards`` data-parallel
    shards: ``micro_batches``, or with a token budget ``tokens`` > 0 one per ``shards x
    micro_rows(T, tokens)`` rows (see the module docstring)."""
    if not tokens:
        return micro_batches
    rows, per = shape[0], shards * micro_rows(shape[1], tokens)
    if rows % per:
        raise ValueError(f"{rows} rows of {shape[1]} tokens do not split into micro-batches of "
                         f"{per} rows ({shards} shards x {micro_rows(shape[1], tokens)} per "
                         f"{tokens}-token budget); lay the batch out with batch_layout")
    return rows // per


@dataclasses.dataclass(frozen=True)
class Batching:
    """How a run lays out a step's rollouts (``rlx.run.learn`` builds it from the config)."""

    pack: bool  # several rollouts per row (train.pack) or one
    buckets: tuple[int, ...]  # padded row lengths (train_buckets)
    shards: int  # data-parallel shards the rows are split over
    minibatches: int = 1  # updates per pass over the batch, each over its share of the rows
    micro_batches: int = 1  # fixed micro-batches per update (tokens == 0)
    tokens: int = 0  # token budget per micro-batch and shard (train.tokens_per_micro_batch)


def batch_layout(lengths: Sequence[int], b: Batching) -> Layout:
    """The layout of a step's rollouts of ``lengths`` tokens (see the module docstring)."""
    lengths = np.asarray(lengths, np.int64)
    longest = int(lengths.max())
    padded = row_length(longest, b.buckets)
    if not b.tokens:
        layout = (pack_layout(lengths, row_len=padded) if b.pack
                  else pad_layout(lengths, buckets=b.buckets))
        return layout.with_rows(b.shards * b.micro_batches * b.minibatches)
    if b.pack:
        layout = pack_layout(lengths, row_len=b.tokens if longest <= b.tokens else padded)
    else:
        layout = pad_layout(lengths, buckets=b.buckets)
    per_micro = b.shards * micro_rows(layout.shape[1], b.tokens)
    count = count_bucket(-(-layout.shape[0] // (per_micro * b.minibatches)))
    return layout.with_rows(per_micro * b.minibatches * count)


def _nth(seq, i):
    return None if seq is None else seq[i]


def shard_batch(batch: TrainBatch, mesh: Mesh, rules: LogicalRules = TRAIN_RULES) -> TrainBatch:
    """Put a host batch on the mesh, rows split over the batch axes."""
    sharding = batch_sharding(mesh, 2, rules)
    return jax.tree.map(lambda x: jax.device_put(np.asarray(x), sharding), batch)
