"""DPO (Rafailov et al. 2023, "Direct Preference Optimization") as a learner step.

``train_step(state, batch) -> (state, metrics)`` is one optimizer update on a batch of P pairs:
rows ``0..P-1`` hold prompt + chosen reply, rows ``P..2P-1`` prompt + rejected reply, in the same
pair order (``pair_batch`` builds it), ``loss_mask`` 1 on the reply tokens and ``ref_logp`` the
reference policy's per-token log-probs. The loss is ``rlx.learner.losses.dpo_loss`` (with
conservative-DPO label smoothing) on each reply's summed log-probs, averaged over the pairs;
gradients accumulate over micro-batches of whole pairs (micro-batch j holds pairs j, j + k, ...,
chosen and rejected together), each scaled by its share of the pairs, so the sum is exactly the
whole batch's loss. A non-finite loss or gradient norm skips the update, as in the RL step.

The reference is the policy's frozen base with its LoRA adapter switched off (LoRA mode): no
second model in memory, as TRL does for a fresh PEFT adapter; in full mode a frozen copy of the
initial parameters (``TrainState.ref``, passed through the update unchanged). Departures from
the paper: none in the loss; the pairs are tokenized by the chat template (``rlx.data.pairs``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Float

from rlx.learner.batching import pad_rollouts
from rlx.learner.compiled import UpdatePerShape
from rlx.learner.losses import DPOMetrics, dpo_loss
from rlx.learner.state import OptimizerConfig, TrainState, make_optimizer, state_shardings
from rlx.learner.step import (ApplyFn, StepConfig, for_mesh, model_forward, predicted,
                              sequence_logprobs)
from rlx.mesh import TRAIN_RULES, LogicalRules, batch_sharding
from rlx.types import Rollout, TrainBatch

Scalar = Float[Array, ""]
# config.train.algorithm: "rl" policy-gradient RL on sampled rollouts (train.advantage),
# "dpo" direct preference optimisation on pairs (this module)
ALGORITHMS = ("rl", "dpo")


class PreferenceMetrics(NamedTuple):
    """Scalars of one DPO update (rewards are beta * (log pi - log pi_ref) of a reply)."""

    loss: Scalar
    reward_chosen: Scalar
    reward_rejected: Scalar
    reward_margin: Scalar  # mean (chosen reward - rejected reward)
    reward_accuracy: Scalar  # pairs whose chosen reward is the larger
    grad_norm: Scalar
    skipped: Scalar


def pair_batch(pairs: Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]], *,
               buckets: Sequence[int] = (), rows_multiple: int = 1) -> TrainBatch:
    """Host batch of (prompt, chosen, rejected) token ids: chosen rows, then rejected rows."""
    if (2 * len(pairs)) % rows_multiple:
        raise ValueError(f"{len(pairs)} pairs do not fill rows in multiples of {rows_multiple}")
    rows = [Rollout(str(i), np.asarray(p), np.asarray(side[k]), np.zeros(len(side[k]), np.float32))
            for k in (0, 1) for i, (p, *side) in enumerate(pairs)]
    return pad_rollouts(rows, np.zeros(len(rows), np.float32), buckets=buckets)


def _split_pairs(batch: TrainBatch, k: int, row_sharding) -> TrainBatch:
    """[2P, T] -> [k, 2P / k, T]: micro-batch j = chosen then rejected rows of pairs j, j + k..."""
    pairs = batch.shape[0] // 2
    if pairs % k:
        raise ValueError(f"{pairs} pairs do not split into {k} micro-batches")

    def split(x):
        x = x.reshape(2, pairs // k, k, *x.shape[1:])  # [2, P / k, k, T]
        x = jnp.moveaxis(x, 2, 0).reshape(k, 2 * (pairs // k), *x.shape[3:])  # [k, 2P / k, T]
        if row_sharding is not None:
            spec = PartitionSpec(None, *row_sharding.spec)
            x = jax.lax.with_sharding_constraint(x, NamedSharding(row_sharding.mesh, spec))
        return x

    return jax.tree.map(split, batch)


def _micro_loss(params, frozen, mb: TrainBatch, total_pairs, graphdef, cfg: StepConfig,
                beta: float, smoothing: float, apply_fn):
    model = nnx.merge(graphdef, params, frozen)
    mask = mb.loss_mask > 0  # [2p, T]
    logp = jnp.sum(jnp.where(mask, sequence_logprobs(model, mb, cfg, apply_fn).logp, 0.0), -1)
    ref = jnp.sum(jnp.where(mask, mb.ref_logp, 0.0), -1)  # [2p]
    p = logp.shape[0] // 2
    loss, m = dpo_loss(logp[:p], logp[p:], ref[:p], ref[p:], beta, smoothing)
    scale = p / total_pairs
    return loss * scale, jax.tree.map(lambda x: x * scale, m)


def _dpo_step(state: TrainState, batch: TrainBatch, *, graphdef, cfg: StepConfig, beta: float,
              smoothing: float, optimizer, apply_fn, row_sharding):
    batch = batch.replace(loss_mask=batch.loss_mask * predicted(batch.segment_ids))
    grad_fn = jax.value_and_grad(_micro_loss, has_aux=True)
    total = batch.shape[0] // 2

    def body(carry, mb):
        grads, loss, metrics = carry
        (l, m), g = grad_fn(state.params, state.frozen, mb, total, graphdef, cfg, beta,
                            smoothing, apply_fn)
        return (jax.tree.map(jnp.add, grads, g), loss + l, jax.tree.map(jnp.add, metrics, m)), None

    zero = jnp.zeros((), jnp.float32)
    init = (jax.tree.map(jnp.zeros_like, state.params), zero,
            DPOMetrics(*[zero] * len(DPOMetrics._fields)))
    (grads, loss, m), _ = jax.lax.scan(body, init,
                                       _split_pairs(batch, cfg.micro_batches, row_sharding))
    grad_norm = optax.global_norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
    new = state.replace(step=state.step + 1, skipped=state.skipped + (~ok).astype(jnp.int32),
                        params=keep(optax.apply_updates(state.params, updates), state.params),
                        opt_state=keep(opt_state, state.opt_state))
    return new, PreferenceMetrics(loss=loss, **m._asdict(), grad_norm=grad_norm,
                                  skipped=(~ok).astype(jnp.float32))


def make_dpo_step(graphdef: nnx.GraphDef, state: TrainState, mesh: Mesh, cfg: StepConfig,
                  optimizer_cfg: OptimizerConfig, *, beta: float, label_smoothing: float = 0.0,
                  rules: LogicalRules = TRAIN_RULES, apply_fn: ApplyFn = model_forward
                  ) -> Callable[[TrainState, TrainBatch], tuple[TrainState, PreferenceMetrics]]:
    """Compile one DPO update ``(state, batch) -> (state, metrics)`` (the state donated but its
    frozen part)."""
    cfg = for_mesh(cfg, mesh)
    optimizer = make_optimizer(optimizer_cfg)
    shardings = state_shardings(state, optimizer, mesh, rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    step = functools.partial(_dpo_step, graphdef=graphdef, cfg=cfg, beta=beta,
                             smoothing=label_smoothing, optimizer=optimizer, apply_fn=apply_fn,
                             row_sharding=batch_sharding(mesh, 1, rules))
    return UpdatePerShape(step, in_shardings=(shardings, batch_sharding(mesh, 2, rules)),
                          out_shardings=(shardings, replicated))


__all__ = ["ALGORITHMS", "PreferenceMetrics", "make_dpo_step", "pair_batch"]
