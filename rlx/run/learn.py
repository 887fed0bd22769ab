"""The learner's side of one RL step: rollouts and rewards -> a device batch -> the updates.

``prepare`` builds the padded batch of the kept rollouts and fills in what the loss reads besides
the tokens: reference log-probs (with a KL term; LoRA mode: the adapter switched off), the old
log-probs the clipped ratio divides by when the batch takes several updates (``train.epochs`` x
``train.minibatches``), and the advantages, computed on the host in numpy from the rewards of the
rollouts grouped by prompt uid (``train.advantage``). ``update`` runs the updates
(``rlx.learner.updates``) and returns the step's learner record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from rlx.config import RunConfig
from rlx.learner.advantages import compute_advantages
from rlx.learner.batching import pad_rollouts, train_buckets
from rlx.learner.step import Compiled
from rlx.learner.updates import plan_minibatches, run_updates, summarise
from rlx.mesh import batch_shards
from rlx.run.hosts import Hosts
from rlx.types import Rollout, TrainBatch


def updates_per_step(cfg: RunConfig) -> int:
    return cfg.train.epochs * cfg.train.minibatches


def needs_old_logprobs(cfg: RunConfig) -> bool:
    """Whether a step computes the learner's log-probs before its first update."""
    return cfg.loss.old_logp == "learner" and updates_per_step(cfg) > 1


@dataclasses.dataclass
class StepLearner:
    """What the loop asks of the learner in a step (see the module docstring)."""

    cfg: RunConfig
    mesh: Mesh
    compiled: Compiled
    hosts: Hosts

    def prepare(self, rollouts: Sequence[Rollout], rewards: np.ndarray, uids: np.ndarray,
                keep: np.ndarray) -> tuple[TrainBatch, np.ndarray]:
        """The device batch of ``rollouts[keep]`` (one per row, padding rows after them) with
        reference / old log-probs and advantages; and which rows hold a loss token."""
        host = self._host_batch([rollouts[i] for i in keep])
        advantages = compute_advantages(self.cfg.train.advantage, rewards, uids)[keep]
        host = host.replace(advantages=per_token(advantages, host.loss_mask))
        batch = self._logprobs(self.hosts.device_batch(host, self.mesh))
        return batch, np.asarray(host.loss_mask).sum(axis=1) > 0

    def update(self, batch: TrainBatch, real_rows: np.ndarray, step: int) -> dict[str, float]:
        """``train.epochs`` x ``train.minibatches`` updates; the step's ``learner/*`` record."""
        t = self.cfg.train
        plan = plan_minibatches(real_rows, t.epochs, t.minibatches, (self.cfg.seed, step))
        state, metrics = run_updates(self.compiled.train_step, self.compiled.state, batch, plan,
                                     self.mesh)
        self.compiled.state = jax.block_until_ready(state)
        return {f"learner/{k}": v for k, v in summarise(metrics).items()}

    def _host_batch(self, rollouts: Sequence[Rollout]) -> TrainBatch:
        t = self.cfg.train
        rows = batch_shards(self.mesh) * t.micro_batches * t.minibatches
        return pad_rollouts(rollouts, np.zeros(len(rollouts), np.float32),
                            buckets=buckets(self.cfg), rows_multiple=rows)

    def _logprobs(self, batch: TrainBatch) -> TrainBatch:
        """Reference log-probs (a KL term) and the old log-probs of several updates."""
        c = self.compiled
        if c.ref_step is not None:
            batch = batch.replace(ref_logp=c.ref_step(c.state.params, c.state.frozen, batch).logp)
        if self.cfg.loss.old_logp == "sampler" and updates_per_step(self.cfg) > 1:
            batch = batch.replace(old_logp=batch.sampler_logp)
        elif c.old_step is not None:
            batch = batch.replace(old_logp=c.old_step(c.state.params, c.state.frozen, batch).logp)
        return jax.block_until_ready(batch)


def per_token(advantages: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    """Per-completion advantages [n] broadcast over each row's loss tokens: [B, T] (rows past n,
    padding, get 0)."""
    mask = np.asarray(loss_mask, np.float32)
    rows = np.zeros(mask.shape[0], np.float32)
    rows[:len(advantages)] = advantages
    return rows[:, None] * mask


def buckets(cfg: RunConfig) -> tuple[int, ...]:
    """Padded lengths for train batches up to the prompt + completion caps (``train_buckets``)."""
    return train_buckets(cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens,
                         per_octave=cfg.train.length_buckets)


__all__ = ["StepLearner", "buckets", "needs_old_logprobs", "per_token", "updates_per_step"]
