"""The learner's side of one RL step: rollouts and rewards -> a device batch -> the updates.

``prepare`` lays the kept rollouts out (``rlx.learner.batching.batch_layout``: packed several to a
row by default, ``train.pack``; micro-batched by ``train.micro_batches`` or the token budget
``train.tokens_per_micro_batch``) and fills in what the losses read besides the tokens:

1. reference log-probs (a KL term; LoRA mode: the adapter switched off) and the old log-probs:
   the learner's own at the start of the step when the batch takes several updates
   (``train.epochs`` x ``train.minibatches``) or the KL is a reward penalty, else none (or the
   sampler's with ``loss.old_logp="sampler"``);
2. with ``loss.kl_as="reward-penalty"`` the per-token KL(pi_old || pi_ref) (``loss.kl_estimator``)
   times ``loss.kl_coef``, subtracted from the rewards (``rlx.learner.advantages``);
3. advantages on the host in numpy: an outcome estimator over the rewards grouped by prompt uid,
   or (``train.advantage="gae"``) GAE over the critic's values at the start of the step, whose
   returns become the critic's targets. The estimators see one completion per row
   (``Layout.unpack``) whatever the layout, and their outputs go back in place (``Layout.pack``).

A rollout longer than the model's positions (``Compiled.max_positions``: ``max_position_embeddings``
or a scaled rope's extended length) is not trained on: it is left out of the batch and counted
(``rollout/skipped_too_long``); its reward still counts in its group's baseline.

``update`` runs the updates (``rlx.learner.updates``): the policy's train step on each minibatch
(not during ``critic.warmup_steps``) and, with a critic, the critic's; it returns the step's
``learner/*`` and ``critic/*`` records and ``train/*``: ``pack_efficiency`` (rollout tokens over
the tokens of the rows holding any), ``rows`` and ``row_tokens`` (the batch's shape) and
``micro_batches`` (per update, those holding a loss token: the ones the step computes).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from rlx.config import RunConfig
from rlx.learner.advantages import (TOKEN_ESTIMATORS, compute_advantages, explained_variance,
                                    gae_advantages, sequence_rewards)
from rlx.learner.batching import Batching, Layout, batch_layout, fill, micro_count, train_buckets
from rlx.learner.losses import kl_penalty
from rlx.learner.step import Compiled
from rlx.learner.updates import plan_minibatches, run_updates, summarise
from rlx.mesh import batch_shards
from rlx.run.hosts import Hosts
from rlx.types import Rollout, TrainBatch

log = logging.getLogger(__name__)


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
    record: dict[str, float]  # critic/*, reward/kl_penalty, rollout/skipped_too_long, train/*


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
        keep, skipped = self._fitting(rollouts, keep)
        host, layout = self._host_batch([rollouts[i] for i in keep])
        real = np.asarray(host.loss_mask).sum(axis=1) > 0
        record = {"rollout/skipped_too_long": float(skipped),
                  "train/pack_efficiency": layout.efficiency, "train/rows": float(host.shape[0]),
                  "train/row_tokens": float(host.shape[1])}
        mask = np.asarray(host.loss_mask)
        if not kl_in_reward(self.cfg) and self.cfg.train.advantage not in TOKEN_ESTIMATORS:
            advantages = compute_advantages(self.cfg.train.advantage, rewards, uids)[keep]
            host = host.replace(advantages=per_token(advantages, mask, layout))
            return Prepared(self._logprobs(self._device(host)), real, record)
        batch = self._logprobs(self._device(host))  # the advantages need these first
        kl = self._kl(batch)
        if self.cfg.train.advantage in TOKEN_ESTIMATORS:
            host, critic = self._gae(host, layout, batch, rewards[keep], kl)
            record.update(critic)
        else:
            penalised = sequence_rewards(rewards[keep], layout.unpack(mask),
                                         None if kl is None else layout.unpack(kl),
                                         self.cfg.loss.kl_coef)
            advantages = compute_advantages(self.cfg.train.advantage, penalised, uids[keep])
            host = host.replace(advantages=per_token(advantages, mask, layout))
        if kl is not None:
            on = layout.unpack(mask) > 0  # [n, W]
            sums = np.where(on, layout.unpack(kl), 0).sum(axis=1)[on.any(axis=1)]
            record["reward/kl_penalty"] = float(np.mean(self.cfg.loss.kl_coef * sums))
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
        record["train/micro_batches"] = micro_batches_run(
            prepared.real_rows, plan, prepared.batch.shape[1], batching(self.cfg, self.mesh))
        return {**record, **prepared.record}

    def _fitting(self, rollouts: Sequence[Rollout], keep: np.ndarray) -> tuple[np.ndarray, int]:
        """``keep`` without the rollouts longer than the model's positions, and how many those
        were (see the module docstring)."""
        limit = self.compiled.max_positions
        if limit is None:
            return keep, 0
        fits = np.array([len(rollouts[i].prompt_ids) + len(rollouts[i].completion_ids) <= limit
                         for i in keep], bool)
        if not fits.any():
            raise ValueError(f"every rollout of this step is longer than the {limit} positions the "
                             "model was built for; lower data.max_prompt_tokens and "
                             "rollout.max_new_tokens (env.max_episode_tokens) to fit them")
        if not fits.all():
            log.warning("%d rollouts longer than the model's %d positions left out of the update",
                        int((~fits).sum()), limit)
        return np.asarray(keep)[fits], int((~fits).sum())

    def _host_batch(self, rollouts: Sequence[Rollout]) -> tuple[TrainBatch, Layout]:
        lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in rollouts]
        layout = batch_layout(lengths, batching(self.cfg, self.mesh))
        return fill(rollouts, np.zeros(len(rollouts), np.float32), layout), layout

    def _device(self, host: TrainBatch) -> TrainBatch:
        return self.hosts.device_batch(host, self.mesh)

    def _logprobs(self, batch: TrainBatch) -> TrainBatch:
        """Reference log-probs (a KL term) and the old log-probs (see the module docstring)."""
        c = self.compiled
        if c.ref_step is not None:
            batch = batch.replace(ref_logp=c.reference_logprobs(batch).logp)
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

    def _gae(self, host: TrainBatch, layout: Layout, batch: TrainBatch, rewards: np.ndarray,
             kl: np.ndarray | None) -> tuple[TrainBatch, dict[str, float]]:
        """PPO: the critic's values, GAE advantages and returns (its targets) on the host."""
        values = self.hosts.to_numpy(self.compiled.value_step(self.compiled.state, batch))
        mask, c = np.asarray(host.loss_mask), self.cfg.critic
        advantages, returns = gae_advantages(
            rewards, layout.unpack(values), layout.unpack(mask), c.gamma, c.lam,
            None if kl is None else layout.unpack(kl), self.cfg.loss.kl_coef)
        advantages, returns = layout.pack(advantages), layout.pack(returns)
        on = mask > 0
        record = {"critic/returns_mean": float(returns[on].mean()) if on.any() else 0.0,
                  "critic/values_mean": float(values[on].mean()) if on.any() else 0.0}
        ev = explained_variance(values, returns, mask)
        if np.isfinite(ev):  # undefined when every target is the same
            record["critic/explained_variance"] = ev
        host = host.replace(advantages=advantages.astype(np.float32),
                            old_values=values.astype(np.float32),
                            returns=returns.astype(np.float32))
        return host, record


def per_token(advantages: np.ndarray, loss_mask: np.ndarray, layout: Layout) -> np.ndarray:
    """Per-completion advantages [n] over each completion's loss tokens: [B, T] (0 elsewhere)."""
    return (layout.spread(np.asarray(advantages, np.float32))
            * np.asarray(loss_mask, np.float32)).astype(np.float32)


def batching(cfg: RunConfig, mesh: Mesh) -> Batching:
    """How the run lays out a step's rollouts (``rlx.learner.batching.batch_layout``)."""
    t = cfg.train
    return Batching(pack=t.pack, buckets=buckets(cfg), shards=batch_shards(mesh),
                    minibatches=t.minibatches, micro_batches=t.micro_batches,
                    tokens=t.tokens_per_micro_batch)


def micro_batches_run(real_rows: np.ndarray, plan: Sequence[np.ndarray], row_tokens: int,
                      b: Batching) -> float:
    """Micro-batches per update that hold a loss token (the train step skips the others), mean
    over the updates of ``plan``; micro-batch j of an update is its rows j, j + k, ..."""
    counts = []
    for index in plan:
        k = micro_count((len(index), row_tokens), b.shards, b.micro_batches, b.tokens)
        counts.append(sum(bool(real_rows[index[j::k]].any()) for j in range(k)))
    return float(np.mean(counts)) if counts else 0.0


def buckets(cfg: RunConfig) -> tuple[int, ...]:
    """Padded lengths for train batches up to the prompt + completion caps (``train_buckets``)."""
    return train_buckets(cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens,
                         per_octave=cfg.train.length_buckets)


__all__ = ["Prepared", "StepLearner", "batching", "buckets", "kl_in_reward", "micro_batches_run",
           "needs_old_logprobs", "per_token", "updates_per_step"]
