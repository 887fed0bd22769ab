"""Learner state and optimizer: `TrainState`, `make_optimizer`, and their shardings.

The model is split with an nnx filter into trainable params and frozen state:

* full mode (full-parameter): `trainable=nnx.Param`; every parameter is trained.
* LoRA mode (frozen base + LoRA): `trainable=nnx.LoRAParam`; the base (plain `nnx.Param` or a
  quantized non-Param `nnx.Variable`, integer leaves included) lands in `frozen`, is passed
  through the step unchanged and is never differentiated.

The graphdef is static and kept outside the state. Every variable with `logical_axes` metadata
is sharded by the rules table (`rlx.mesh.TRAIN_RULES`: FSDP over `embed`, tensor over heads /
mlp / vocab); variables without it, scalars and the rng are replicated. Optimizer moments follow
their parameter's sharding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Int, Key

from rlx.errors import one_of
from rlx.mesh import TRAIN_RULES, LogicalRules, variable_shardings
from rlx.models.parallel import parallelize

SCHEDULES = ("cosine", "constant")
# config.train.mode -> the variables that train: "lora" a frozen base with LoRA adapters (the
# adapters train), "full" every parameter
MODES = {"lora": nnx.LoRAParam, "full": nnx.Param}


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup, then cosine decay or a constant rate; global-norm clipping."""

    learning_rate: float = 1e-6  # peak rate, reached at the end of warmup
    schedule: str = "cosine"  # one of SCHEDULES
    warmup_steps: int = 0  # linear ramp from 0 over this many updates
    decay_steps: int = 1000  # cosine: updates after warmup to reach the floor
    min_lr_ratio: float = 0.1  # cosine floor as a fraction of learning_rate
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0  # decoupled, on matrices only (ndim >= 2), not norms / biases
    max_grad_norm: float | None = 1.0  # clip the global gradient norm; None: no clipping

    def __post_init__(self):
        one_of("schedule", self.schedule, SCHEDULES)
        if self.learning_rate < 0 or self.warmup_steps < 0 or self.weight_decay < 0:
            raise ValueError("OptimizerConfig learning_rate, warmup_steps and weight_decay must "
                             "be >= 0")
        if self.decay_steps < 1:
            raise ValueError(f"OptimizerConfig.decay_steps must be >= 1, got {self.decay_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"OptimizerConfig.min_lr_ratio must be in [0, 1], "
                             f"got {self.min_lr_ratio}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"OptimizerConfig.max_grad_norm must be > 0 or None, "
                             f"got {self.max_grad_norm}")


def make_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """Learning rate as a function of the number of applied updates."""
    if cfg.schedule == "constant":
        main = optax.constant_schedule(cfg.learning_rate)
    else:
        main = optax.cosine_decay_schedule(cfg.learning_rate, cfg.decay_steps, cfg.min_lr_ratio)
    if cfg.warmup_steps == 0:
        return main
    warmup = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
    return optax.join_schedules([warmup, main], [cfg.warmup_steps])


def _decay_mask(params):
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """clip_by_global_norm -> AdamW(schedule) with weight decay on matrices only."""
    adamw = optax.adamw(make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mask=_decay_mask)
    if cfg.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)


@struct.dataclass
class CriticState:
    """PPO's critic (``rlx.learner.critic``): its trainable variables, optimizer state and, for a
    separate critic model, that model's own frozen variables."""

    params: Any  # {"body": nnx.State (a LoRA adapter or a whole float model), "head": {...}}
    opt_state: Any  # optax state of `params`
    frozen: nnx.State | None = None  # None: the critic's body runs on the policy's frozen base
    optimizer: Any = struct.field(pytree_node=False, default=None)  # its optax transformation


@struct.dataclass
class TrainState:
    """Everything a train step reads and writes; a pytree (the graphdef is kept apart)."""

    step: Int[Array, ""]  # train-step calls so far
    skipped: Int[Array, ""]  # of which skipped by the non-finite guard
    params: nnx.State  # trainable variables
    frozen: nnx.State  # everything else in the model, passed through unchanged
    opt_state: Any  # optax state of `params`
    rng: Key[Array, ""]
    critic: CriticState | None = None  # PPO with a learned critic; None without
    # full mode with a KL term or DPO: the initial `params`, frozen (never differentiated, never
    # updated), sharded as `params` are; None otherwise (LoRA mode's reference is the adapter off)
    ref: nnx.State | None = None


def state_shardings(
    state: TrainState, optimizer: optax.GradientTransformation, mesh: Mesh,
    rules: LogicalRules = TRAIN_RULES,
) -> TrainState:
    """Shardings of a (possibly abstract) `TrainState`, as a TrainState-shaped prefix tree."""
    replicated = NamedSharding(mesh, PartitionSpec())
    params = variable_shardings(state.params, mesh, rules)
    opt = _optimizer_shardings(optimizer, state.opt_state, params, mesh)
    return TrainState(step=replicated, skipped=replicated, params=params,
                      frozen=variable_shardings(state.frozen, mesh, rules), opt_state=opt,
                      rng=replicated, critic=_critic_shardings(state.critic, mesh, rules),
                      ref=None if state.ref is None else params)


def _optimizer_shardings(optimizer, opt_state, params, mesh: Mesh):
    """Optimizer moments on their parameter's sharding, everything else replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return optax.tree_map_params(optimizer, lambda _, s: s, opt_state, params,
                                 transform_non_params=lambda _: replicated, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _critic_shardings(critic: CriticState | None, mesh: Mesh, rules: LogicalRules):
    if critic is None:
        return None
    params = variable_shardings(critic.params, mesh, rules)
    frozen = None if critic.frozen is None else variable_shardings(critic.frozen, mesh, rules)
    return critic.replace(params=params, frozen=frozen,
                          opt_state=_optimizer_shardings(critic.optimizer, critic.opt_state,
                                                         params, mesh))


def create_train_state(
    model: nnx.Module,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    trainable: nnx.filterlib.Filter = nnx.Param,
    rules: LogicalRules = TRAIN_RULES,
    seed: int = 0,
    capacity_factor: float | None = None,
) -> tuple[nnx.GraphDef, TrainState]:
    """Split `model` into (graphdef, TrainState) and place the state on `mesh`; the graphdef's MoE
    layers dispatch tokens to experts split over the mesh (``rlx.models.parallel.parallelize``,
    dropless, or with ``capacity_factor``; ``model`` itself is left as it is)."""
    graphdef, params, frozen = nnx.split(model, trainable, ...)
    graphdef = nnx.graphdef(parallelize(nnx.merge(graphdef, params, frozen), mesh, rules,
                                            capacity_factor))
    if not jax.tree.leaves(params):
        raise ValueError(f"the trainable filter {trainable!r} selects no variable of the model")
    bad = [x.dtype for x in jax.tree.leaves(params) if not jnp.issubdtype(x.dtype, jnp.floating)]
    if bad:
        raise ValueError(f"trainable variables must be floating point, found "
                         f"{sorted(set(map(str, bad)))}; quantized bases belong in the frozen "
                         "state (use trainable=nnx.LoRAParam)")
    abstract = jax.eval_shape(lambda p, f: _fresh_state(p, f, optimizer, seed), params, frozen)
    shardings = state_shardings(abstract, optimizer, mesh, rules)
    params = jax.device_put(params, shardings.params)
    frozen = jax.device_put(frozen, shardings.frozen)  # the model's own arrays where placed so
    # the frozen part stays out of the jit: an output passing an input through is a new buffer,
    # a second copy of the base while the first is alive
    init = jax.jit(lambda p: _fresh_state(p, None, optimizer, seed),
                   out_shardings=shardings.replace(frozen=None))
    return graphdef, init(params).replace(frozen=frozen)


def with_reference(state: TrainState, optimizer: optax.GradientTransformation, mesh: Mesh,
                   rules: LogicalRules = TRAIN_RULES) -> TrainState:
    """``state`` holding a frozen copy of its current ``params`` as ``ref`` (full mode's reference
    policy for the KL term and DPO), placed on the shardings of ``params``."""
    shardings = state_shardings(state.replace(ref=state.params), optimizer, mesh, rules)
    copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=shardings.ref)
    return state.replace(ref=copy(state.params))


def _fresh_state(params, frozen, optimizer, seed) -> TrainState:
    zero = jnp.zeros((), jnp.int32)
    return TrainState(step=zero, skipped=zero, params=params, frozen=frozen,
                      opt_state=optimizer.init(params), rng=jax.random.key(seed))
