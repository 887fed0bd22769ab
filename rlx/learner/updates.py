"""Several optimizer updates per rollout batch: ``epochs`` passes of ``minibatches`` updates each.

PPO (Schulman et al. 2017) reuses each batch of samples for several epochs of minibatch updates;
the clipped ratio ``pi / pi_old`` then keeps every later update near the policy that sampled.
Here ``pi_old`` is fixed for the whole step before its first update: the learner's own log-probs
at the start of the step (``old_logp``, one pass of the log-prob step), or the sampler's
(``loss.old_logp="sampler"``). With one update per batch (the default) neither is needed: the
ratio is 1 in value, ``old_logp`` stays None and the train step uses its own log-probs.

* ``plan_minibatches`` - which rows each update trains on: per epoch the rows with a loss token
  are shuffled (seeded by run seed, step and epoch: a resumed run draws the same plan) and dealt
  round-robin to the minibatches, padding rows after them, so the real rows spread evenly and
  every minibatch has the same shape (one compiled program). A minibatch without a loss token is
  skipped: a zero-gradient Adam step would still move the parameters by its momentum.
* ``run_updates`` - the updates in order, each one call of the compiled train step (which itself
  accumulates gradients over ``train.micro_batches`` or token-budget micro-batches) and, with a
  critic, of the critic's step, on each minibatch's rows gathered on device.
* ``summarise`` - one record for the step: the mean of every metric over the updates, the largest
  ``skipped``, and with several updates each one's ``clip_frac`` and ``approx_kl``.

Departure from the paper: PPO sums the policy and value losses into one update; here the critic
(``rlx.learner.critic``) takes its own compiled update on each of the policy's minibatches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh

from rlx.mesh import TRAIN_RULES, LogicalRules, batch_sharding
from rlx.types import TrainBatch

PER_UPDATE = ("clip_frac", "approx_kl")  # reported for every update of a step


def plan_minibatches(real_rows: np.ndarray, epochs: int, minibatches: int,
                     seed: tuple[int, ...]) -> list[np.ndarray]:
    """Row indices of every update, in order: ``epochs`` x ``minibatches`` equal-sized index
    arrays over ``len(real_rows)`` rows (``real_rows``: bool per row, True with a loss token),
    minibatches without a real row left out."""
    real_rows = np.asarray(real_rows, bool)
    rows = len(real_rows)
    if rows % minibatches:
        raise ValueError(f"{rows} rows do not split into {minibatches} minibatches")
    real, padding = np.flatnonzero(real_rows), np.flatnonzero(~real_rows)
    plan = []
    for epoch in range(epochs):
        order = np.random.default_rng((*seed, epoch)).permutation(real)
        dealt = np.concatenate([order, padding])  # real rows first, then padding
        for j in range(minibatches):
            index = dealt[j::minibatches]
            if real_rows[index].any():
                plan.append(np.sort(index).astype(np.int32))
    return plan


@functools.lru_cache(maxsize=None)
def _gather(mesh: Mesh, rules: LogicalRules):
    rows = batch_sharding(mesh, 2, rules)
    return jax.jit(lambda batch, index: batch.rows(index), out_shardings=rows)


def take_rows(batch: TrainBatch, index: np.ndarray, mesh: Mesh,
              rules: LogicalRules = TRAIN_RULES) -> TrainBatch:
    """The rows ``index`` of a device batch, sharded over the batch axes like the batch."""
    if len(index) == batch.shape[0] and np.array_equal(index, np.arange(len(index))):
        return batch
    return _gather(mesh, rules)(batch, jax.numpy.asarray(index))


def run_updates(steps: Sequence[Callable], state, batch: TrainBatch, plan: Sequence[np.ndarray],
                mesh: Mesh) -> tuple[object, list[list]]:
    """For every entry of ``plan`` (see ``plan_minibatches``) in order, each of ``steps`` (the
    policy's train step, the critic's) on that minibatch; the metrics per step, per update."""
    metrics: list[list] = [[] for _ in steps]
    for index in plan:
        minibatch = take_rows(batch, index, mesh)
        for step, out in zip(steps, metrics):
            state, m = step(state, minibatch)
            out.append(m)
    return state, metrics


def summarise(updates: Sequence[NamedTuple]) -> dict[str, float]:
    """One record for a step's updates (see the module docstring): keys are the metrics' field
    names, without a prefix."""
    if not updates:
        return {}
    host = jax.device_get(list(updates))
    fields = type(updates[0])._fields
    out = {}
    for name in fields:
        values = np.array([float(getattr(m, name)) for m in host], np.float64)
        out[name] = float(values.max() if name == "skipped" else values.mean())
    if len(host) > 1:
        for i, m in enumerate(host):
            out.update({f"update_{i}/{name}": float(getattr(m, name))
                        for name in PER_UPDATE if name in fields})
    out["updates"] = float(len(host))
    return out


__all__ = ["PER_UPDATE", "plan_minibatches", "run_updates", "summarise", "take_rows"]
