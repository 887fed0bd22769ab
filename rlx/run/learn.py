"""The learner's side of one RL step: rollouts and rewards -> a device batch -> the updates.

``prepare`` builds the padded batch of the kept rollouts (one per row) and fills in what the
losses read besides the tokens:

1. reference log-probs (a KL term; LoRA mode: the adapter switched off) and the old log-probs:
   the learner's own at the start of the step when the batch takes several updates
   (``train.epochs`` x ``train.minibatches``) or the KL is a reward penalty, else none (or the
   sampler's with ``loss.old_logp="sampler"``);
2. with ``loss.kl_as="reward-penalty"`` the per-token KL(pi_old || pi_ref) (``loss.kl_estimator``)
   times ``loss.kl_coef``, subtracted from the rewards (``rlx.learner.advantages``);
3. advantages on the host in numpy: an outcome estimator over the rewards grouped by prompt uid,
   or (``train.advantage="gae"``) GAE over the critic's values at the start of the step, whose
   returns become the critic's targets.

``update`` runs the updates (``rlx.learner.updates``): the policy's train step on each minibatch
(not during ``critic.warmup_steps``) and, with a critic, the critic's; it returns the step's
``learner/*`` and ``critic/*`` records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from rlx.config import RunConfig
from rlx.learner.advantages import (TOKEN_ESTIMATORS, compute_advantages, explained_variance,
                                    gae_advantages, sequence_rewards)
from rlx.learner.batching import pad_rollouts, train_buckets
from rlx.learner.losses import kl_penalty
from rlx.learner.step import Compiled
from rlx.learner.updates import plan_minibatches, run_updates, summarise
from rlx.mesh import batch_shards
from rlx.run.hosts import Hosts
from rlx.types import Rollout, TrainBatch


def updates_per_step(cfg: RunConfig) -> int:
    return cfg.train.epochs * cfg.train.minibatches


def kl_in_reward(cfg: RunConfig) -> bool:
    return cfg.loss.kl_as == "reward-penalty" and cfg.loss.kl_coef > 0


def needs_old_logprobs(cfg: RunConfig) -> bool:
    """Whether a step computes the learner's log-probs before its first update."""
    return kl_in_reward(cfg) or (cfg.loss.old_logp == "learner" and updates_per_step(cfg) > 1)


@dataclasses.dataclass
class Prepared:
    """A step's device batch, which of its rows hold a loss token, and host-side figures."""

    batch: TrainBatch
    real_rows: np.ndarray  # [B] bool
    record: dict[str, float]  # critic/* (targets, explained variance), reward/kl_penalty


@dataclasses.dataclass
class StepLearner:
    """What the loop asks of the learner in a step (see the module docstring)."""

    cfg: RunConfig
    mesh: Mesh
    compiled: Compiled
    hosts: Hosts

    def prepare(self, rollouts: Sequence[Rollout], rewards: np.ndarray, uids: np.ndarray,
                keep: np.ndarray) -> Prepared:
        """The batch of ``rollouts[keep]`` ready for the updates (see the module docstring)."""
        host = self._host_batch([rollouts[i] for i in keep])
        real = np.asarray(host.loss_mask).sum(axis=1) > 0
        if not kl_in_reward(self.cfg) and self.cfg.train.advantage not in TOKEN_ESTIMATORS:
            advantages = compute_advantages(self.cfg.train.advantage, rewards, uids)[keep]
            host = host.replace(advantages=per_token(advantages, host.loss_mask))
            return Prepared(self._logprobs(self._device(host)), real, {})
        batch = self._logprobs(self._device(host))  # the advantages need these first
        kl = self._kl(batch)
        if self.cfg.train.advantage in TOKEN_ESTIMATORS:
            host, record = self._gae(host, batch, rewards[keep], kl)
        else:
            penalised = sequence_rewards(rewards[keep], host.loss_mask, kl, self.cfg.loss.kl_coef)
            advantages = compute_advantages(self.cfg.train.advantage, penalised, uids[keep])
            host, record = host.replace(advantages=per_token(advantages, host.loss_mask)), {}
        if kl is not None:
            record["reward/kl_penalty"] = float(np.mean(
                self.cfg.loss.kl_coef * np.where(host.loss_mask > 0, kl, 0).sum(axis=1)[real]))
        device = self._device(host).replace(ref_logp=batch.ref_logp, old_logp=batch.old_logp)
        return Prepared(device, real, record)

    def update(self, prepared: Prepared, step: int) -> dict[str, float]:
        """``train.epochs`` x ``train.minibatches`` updates; the step's learner / critic record."""
        t, c = self.cfg.train, self.compiled
        plan = plan_minibatches(prepared.real_rows, t.epochs, t.minibatches, (self.cfg.seed, step))
        steps = [c.train_step] if step >= self.cfg.critic.warmup_steps else []
        steps += [c.critic_step] if c.critic_step is not None else []
        state, metrics = run_updates(steps, c.state, prepared.batch, plan, self.mesh)
        c.state = jax.block_until_ready(state)
        names = (["learner"] if step >= self.cfg.critic.warmup_steps else []) + ["critic"]
        record = {f"{name}/{k}": v for name, m in zip(names, metrics)
                  for k, v in summarise(m).items()}
        return {**record, **prepared.record}

    def _host_batch(self, rollouts: Sequence[Rollout]) -> TrainBatch:
        t = self.cfg.train
        rows = batch_shards(self.mesh) * t.micro_batches * t.minibatches
        return pad_rollouts(rollouts, np.zeros(len(rollouts), np.float32),
                            buckets=buckets(self.cfg), rows_multiple=rows)

    def _device(self, host: TrainBatch) -> TrainBatch:
        return self.hosts.device_batch(host, self.mesh)

    def _logprobs(self, batch: TrainBatch) -> TrainBatch:
        """Reference log-probs (a KL term) and the old log-probs (see the module docstring)."""
        c = self.compiled
        if c.ref_step is not None:
            batch = batch.replace(ref_logp=c.ref_step(c.state.params, c.state.frozen, batch).logp)
        if c.old_step is not None:
            batch = batch.replace(old_logp=c.old_step(c.state.params, c.state.frozen, batch).logp)
        if self.cfg.loss.old_logp == "sampler" and updates_per_step(self.cfg) > 1:
            batch = batch.replace(old_logp=batch.sampler_logp)
        return jax.block_until_ready(batch)

    def _kl(self, batch: TrainBatch) -> np.ndarray | None:
        """Per-token KL(pi || pi_ref) at the start of the step, on the host (a reward penalty)."""
        if not kl_in_reward(self.cfg):
            return None
        logp = batch.sampler_logp if self.compiled.old_step is None else batch.old_logp
        return self.hosts.to_numpy(kl_penalty(logp, batch.ref_logp, self.cfg.loss.kl_estimator))

    def _gae(self, host: TrainBatch, batch: TrainBatch, rewards: np.ndarray,
             kl: np.ndarray | None) -> tuple[TrainBatch, dict[str, float]]:
        """PPO: the critic's values, GAE advantages and returns (its targets) on the host."""
        values = self.hosts.to_numpy(self.compiled.value_step(self.compiled.state, batch))
        mask, c = np.asarray(host.loss_mask), self.cfg.critic
        advantages, returns = gae_advantages(rewards, values, mask, c.gamma, c.lam, kl,
                                             self.cfg.loss.kl_coef)
        on = mask > 0
        record = {"critic/returns_mean": float(returns[on].mean()) if on.any() else 0.0,
                  "critic/values_mean": float(values[on].mean()) if on.any() else 0.0}
        ev = explained_variance(values, returns, mask)
        if np.isfinite(ev):  # undefined when every target is the same
            record["critic/explained_variance"] = ev
        host = host.replace(advantages=advantages, old_values=values.astype(np.float32),
                            returns=returns.astype(np.float32))
        return host, record


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


__all__ = ["Prepared", "StepLearner", "buckets", "kl_in_reward", "needs_old_logprobs",
           "per_token", "updates_per_step"]
