"""PPO's critic (Schulman et al. 2017): a value head over a model's hidden states, trained with
the clipped value loss (``rlx.learner.losses.value_loss``), for ``train.advantage="gae"``.

Where its weights live (``config.critic``):

* LoRA mode: a second LoRA adapter (the policy's targets and rank) plus the value head, on the
  policy's frozen base. The critic's adapter has the tree structure of the policy's; merged into
  the policy's graph in its place it is the critic's body. One base in memory serves the policy
  (its adapter), the reference (adapters off) and the critic (the critic's adapter).
* full mode: a separate float model, a copy of the policy's initial weights or ``critic.path``
  (e.g. a smaller model with the policy's vocabulary; a value head it carries, HF's ``score``
  layer, is the head's start), plus the value head.

Values are aligned like log-probs (``rlx.types``): position t holds V(s_t), the value of the
state before token t, i.e. the head applied to the hidden state at t - 1; 0 where nothing
precedes. ``make_value_step`` computes them before a step's updates (for GAE, on the host);
``make_critic_step`` is one update of the critic on a minibatch: the value loss's token mean over
the minibatch, gradients accumulated over micro-batches like the policy's, the update skipped when
the loss or gradient norm is not finite. Both take and return the whole ``TrainState`` (the
critic is ``state.critic``; the step donates the state), sharded like the policy.

Departures: the head starts at zero (every value 0 at first); the critic trains in its own
compiled step on the policy's minibatches with its own learning rate, where the paper sums policy
and value losses into one update of shared weights.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Float

from rlx.errors import ConfigError
from rlx.learner.compiled import UpdatePerShape
from rlx.platform.compiled import CompiledPerShape
from rlx.learner.losses import value_loss
from rlx.learner.state import CriticState, TrainState, state_shardings
from rlx.learner.step import ApplyFn, model_forward, predicted, skip_empty, to_micro_batches
from rlx.mesh import TRAIN_RULES, LogicalRules, batch_sharding
from rlx.models.safetensors_io import SafetensorsFolder
from rlx.types import TrainBatch

Scalar = Float[Array, ""]


@dataclasses.dataclass(frozen=True)
class CriticSection:
    """The critic of PPO (``config.critic``), read when ``train.advantage="gae"``."""

    enabled: bool = False  # train a critic (train.advantage="gae" needs one, nothing else reads it)
    path: str = ""  # full mode: the critic model ("" = a copy of the policy); lora mode: "" only
    learning_rate: float = 1e-5  # the critic's AdamW peak rate (the schedule is config.optim's)
    value_clip: float = 0.2  # clipped value loss: values move at most this far from the step's
    gamma: float = 1.0  # GAE discount per token
    lam: float = 0.95  # GAE lambda (1: Monte Carlo returns as targets)
    warmup_steps: int = 0  # first RL steps that train only the critic (the policy waits)

    def validate(self) -> None:
        if self.learning_rate <= 0 or self.value_clip <= 0:
            raise ConfigError(f"config.critic.learning_rate={self.learning_rate} and value_clip="
                              f"{self.value_clip} must be > 0")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ConfigError(f"config.critic.gamma={self.gamma} and lam={self.lam} must be in "
                              "[0, 1]")
        if self.warmup_steps < 0:
            raise ConfigError(f"config.critic.warmup_steps={self.warmup_steps} must be >= 0")


class CriticMetrics(NamedTuple):
    """Scalars of one critic update."""

    value_loss: Scalar
    clip_frac: Scalar  # tokens whose clipped value's error is the larger one (clipped tokens only)
    value_mean: Scalar  # mean value over the update's loss tokens
    grad_norm: Scalar
    skipped: Scalar  # 1.0 when the update was skipped (non-finite loss or gradients)


# a value head a critic checkpoint may carry: HF's *ForTokenClassification with one label (the
# form TRL's and OpenRLHF's value models take): weight [1, D], optional bias [1]
HEAD_TENSORS = ("score.weight", "score.bias")


def _head_tensors(path: str) -> SafetensorsFolder | None:
    if not os.path.isdir(path):
        return None
    tensors = SafetensorsFolder(path)
    return tensors if HEAD_TENSORS[0] in tensors else None


def value_head_width(path: str) -> int | None:
    """The width of the value head a critic folder carries (headers only), or None."""
    tensors = _head_tensors(path)
    return None if tensors is None else tensors.shape(HEAD_TENSORS[0])[-1]


def read_value_head(path: str) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(kernel [D], bias) of the value head a critic folder carries; (None, None) if none."""
    tensors = _head_tensors(path)
    if tensors is None:
        return None, None
    kernel = np.asarray(tensors[HEAD_TENSORS[0]], np.float32).reshape(-1)
    bias = tensors.get(HEAD_TENSORS[1])
    return kernel, None if bias is None else np.asarray(bias, np.float32).reshape(())


def value_head(hidden_size: int, kernel=None, bias=None) -> dict[str, Array]:
    """The head's parameters, f32: zero, or ``kernel`` [D] and ``bias`` [] given."""
    k = jnp.zeros((hidden_size,), jnp.float32) if kernel is None else jnp.asarray(kernel, jnp.float32)
    b = jnp.zeros((), jnp.float32) if bias is None else jnp.asarray(bias, jnp.float32).reshape(())
    return {"kernel": k.reshape(hidden_size), "bias": b}


def init_critic(body: nnx.State, head: dict[str, Array], optimizer: optax.GradientTransformation,
                frozen: nnx.State | None = None) -> CriticState:
    """A critic whose body starts as a copy of ``body`` (the policy's trainable variables, or a
    separate model's, with that model's ``frozen`` variables)."""
    params = {"body": jax.tree.map(jnp.copy, body), "head": head}
    return CriticState(params=params, opt_state=optimizer.init(params), frozen=frozen,
                       optimizer=optimizer)


def values(graphdef: nnx.GraphDef, state: TrainState, batch: TrainBatch,
           apply_fn: ApplyFn = model_forward, params=None) -> Float[Array, "b t"]:
    """The critic's V(s_t) per token, aligned with ``input_ids`` (see the module docstring)."""
    critic = state.critic
    params = critic.params if params is None else params
    frozen = state.frozen if critic.frozen is None else critic.frozen
    hidden = apply_fn(nnx.merge(graphdef, params["body"], frozen), batch)[0]  # [B, T, D]
    head = params["head"]
    v = jnp.einsum("btd,d->bt", hidden.astype(jnp.float32), head["kernel"]) + head["bias"]
    return jnp.where(predicted(batch.segment_ids), jnp.pad(v[:, :-1], ((0, 0), (1, 0))), 0.0)


def _micro_loss(params, state, mb: TrainBatch, total_tokens, graphdef, clip, apply_fn):
    v = values(graphdef, state, mb, apply_fn, params)
    loss, m = value_loss(v, mb.old_values, mb.returns, mb.loss_mask, clip)
    tokens = jnp.sum(mb.loss_mask)
    return loss * tokens / jnp.maximum(total_tokens, 1.0), (m, tokens)


def _critic_step(state: TrainState, batch: TrainBatch, *, graphdef, clip: float, micro: int,
                 tokens: int, apply_fn, row_sharding):
    critic = state.critic
    mask = batch.loss_mask * predicted(batch.segment_ids)  # [B, T]
    batch = batch.replace(loss_mask=mask)
    total = jnp.sum(mask)
    grad_fn = jax.value_and_grad(_micro_loss, has_aux=True)

    def body(carry, mb):
        grads, loss, clip_tokens, value_sum = carry
        (l, (m, tokens)), g = skip_empty(
            lambda mb: grad_fn(critic.params, state, mb, total, graphdef, clip, apply_fn), mb)
        return (jax.tree.map(jnp.add, grads, g), loss + l, clip_tokens + m.clip_frac * tokens,
                value_sum + m.value_mean * tokens), None

    zero = jnp.zeros((), jnp.float32)
    init = (jax.tree.map(jnp.zeros_like, critic.params), zero, zero, zero)
    (grads, loss, clipped, value_sum), _ = jax.lax.scan(
        body, init, to_micro_batches(batch, micro, tokens, row_sharding))
    grad_norm = optax.global_norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, opt_state = critic.optimizer.update(grads, critic.opt_state, critic.params)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
    new = critic.replace(params=keep(optax.apply_updates(critic.params, updates), critic.params),
                         opt_state=keep(opt_state, critic.opt_state))
    n = jnp.maximum(total, 1.0)
    metrics = CriticMetrics(value_loss=loss, clip_frac=clipped / n, value_mean=value_sum / n,
                            grad_norm=grad_norm, skipped=(~ok).astype(jnp.float32))
    return state.replace(critic=new), metrics


def make_critic_step(graphdef: nnx.GraphDef, state: TrainState, mesh: Mesh,
                     optimizer: optax.GradientTransformation, *, value_clip: float,
                     micro_batches: int = 1, tokens_per_micro_batch: int = 0,
                     rules: LogicalRules = TRAIN_RULES, apply_fn: ApplyFn = model_forward
                     ) -> Callable[[TrainState, TrainBatch], tuple[TrainState, CriticMetrics]]:
    """Compile one critic update ``(state, batch) -> (state, metrics)`` (the state donated but its
    frozen part), micro-batched as the policy's train step (``micro_batches`` or the token budget
    ``tokens_per_micro_batch``).
    ``graphdef`` is the critic body's (the policy's own in LoRA mode); ``optimizer`` the
    policy's (it fixes the shardings of the policy's optimizer state)."""
    _check(state)
    shardings = state_shardings(state, optimizer, mesh, rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    step = functools.partial(_critic_step, graphdef=graphdef, clip=value_clip, micro=micro_batches,
                             tokens=tokens_per_micro_batch, apply_fn=apply_fn,
                             row_sharding=batch_sharding(mesh, 1, rules))
    return UpdatePerShape(step, in_shardings=(shardings, batch_sharding(mesh, 2, rules)),
                          out_shardings=(shardings, replicated))


def make_value_step(graphdef: nnx.GraphDef, state: TrainState, mesh: Mesh,
                    optimizer: optax.GradientTransformation, *, rules: LogicalRules = TRAIN_RULES
                    ) -> Callable[[TrainState, TrainBatch], Float[Array, "b t"]]:
    """Compile ``(state, batch) -> values [B, T]`` (no gradient; nothing donated)."""
    _check(state)
    rows = batch_sharding(mesh, 2, rules)
    shardings = state_shardings(state, optimizer, mesh, rules)
    return CompiledPerShape(jax.jit(functools.partial(values, graphdef),
                                    in_shardings=(shardings, rows), out_shardings=rows))


def _check(state: TrainState) -> None:
    if state.critic is None:
        raise ValueError("the train state has no critic (TrainState.critic is None)")


__all__ = ["HEAD_TENSORS", "CriticMetrics", "CriticSection", "init_critic", "make_critic_step",
           "make_value_step", "read_value_head", "value_head", "value_head_width", "values"]
