"""The compiled learner steps: `make_train_step` and `make_logprob_step`.

`train_step(state, batch) -> (state, metrics)` is one optimizer update on a `TrainBatch`:

1. The batch is split into k groups of rows (micro-batch j = rows j, j + k, ..., so each
   micro-batch stays spread over the data axes) and a `lax.scan` accumulates gradients; k is
   `micro_batches`, or with a token budget (`tokens_per_micro_batch`) the rows over the rows of one
   micro-batch (`rlx.learner.batching.micro_count`: one packed row per data-parallel shard). A
   micro-batch without a loss token (rows that only pad the batch) is skipped (`lax.cond`).
2. Each micro-batch computes `policy_loss` on learner log-probs from the chunked log-softmax
   (`token_logprobs`, no [B, T, V] tensor) and is rescaled by its share of the whole batch's
   normaliser (tokens for "token-mean", completions otherwise), so the sum over micro-batches is
   exactly the loss of the whole batch: DAPO's token mean is over the batch, not per micro-batch.
3. A non-finite loss or gradient norm skips the update: params and optimizer state are kept,
   `step` and `skipped` count up, `metrics.skipped` is 1.
4. Shardings (params / optimizer FSDP-sharded from logical axes, batch over the data axes) and
   donation of the state are declared at the `jax.jit`.

Log-prob alignment follows `rlx.types`: position t of the output is log p(input_ids[t] | <t); the
first token of each sequence has no prediction and gets 0 (and no loss).

`make_logprob_step` computes old or reference log-probs with the same code. The reference of mode
B (adapter off, same weights) is a different `apply_fn`; full mode's reference (the frozen copy of
the initial parameters, `TrainState.ref`) is a different `params` argument.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int

from rlx.learner.batching import micro_count
from rlx.learner.compiled import UpdatePerShape
from rlx.platform.compiled import CompiledPerShape
from rlx.platform.policy import policy_of
from rlx.kernels.logprobs import LMHead, Projection, token_logprobs
from rlx.learner.losses import LossConfig, LossMetrics, policy_loss, sequence_count
from rlx.learner.state import (OptimizerConfig, TrainState, make_optimizer, make_schedule,
                               state_shardings, variable_shardings)
from rlx.mesh import TRAIN_RULES, LogicalRules, batch_sharding
from rlx.models.layers import PROJECTION, weight_value
from rlx.models.mixed import is_low_precision
from rlx.types import LogProbs, StepMetrics, TrainBatch


class Forward(NamedTuple):
    """What an ``apply_fn`` returns: final hidden states, the lm-head as ``token_logprobs`` takes
    it, and the (token, expert) pairs a dispatch capacity dropped (``rlx.models.moe``; 0 when
    dropless). A plain ``(hidden, project)`` pair is accepted too (nothing dropped)."""

    hidden: Float[Array, "b t d"]
    project: Projection | LMHead
    dropped: Int[Array, ""]


ApplyFn = Callable[[nnx.Module, TrainBatch], Forward | tuple[Float[Array, "b t d"], Projection]]


def logprob_head(model: nnx.Module, adapter: bool = True) -> Projection | LMHead:
    """The lm-head of an rlx `Transformer` as `token_logprobs` takes it.

    A plain float weight (the tied embedding, or an untied `Linear` in its `[in, out]` layout
    without activation quantization and without an active LoRA adapter) becomes an `LMHead`:
    the log-softmax then runs over [chunk, vocab_block] tiles with a hand-written backward pass
    that skips dW for a frozen head (LoRA mode), instead of recomputing whole [chunk, V] logits
    and reducing them in XLA:CPU's slow fused `exp`-reductions over whole vocabulary rows. The
    products and roundings are those of `model.logits`. Anything else is `model.logits` itself,
    a quantized head included: the custom VJP would keep its dequantized copy from the forward to
    the backward pass, where the callable dequantizes it chunk by chunk.
    """
    logits = functools.partial(model.logits, adapter=adapter)
    head = model.lm_head
    if head is None:
        if model.tied_head_out_in or not isinstance(model.embed, nnx.Variable):
            return logits
        dtype = model.precision.dtype  # the final norm's output dtype
        out = jnp.float32 if is_low_precision(dtype) else dtype  # logits' f32 accumulator
        return LMHead(weight_value(model.embed, dtype), transposed=True, dtype=dtype,
                      out_dtype=out)
    if head.kernel_layout != "in_out" or head.act_quant != "none" or not isinstance(
            head.kernel, nnx.Variable) or (adapter and head.lora is not None):
        return logits
    bias = None if head.bias is None else head.bias[...]
    return LMHead(weight_value(head.kernel, head.dtype), bias, dtype=head.dtype,
                  out_dtype=head.dtype)


def model_forward(model: nnx.Module, batch: TrainBatch, adapter: bool = True) -> Forward:
    """Default `apply_fn`: final hidden states and the lm-head of an rlx `Transformer`, its MoE
    layers using the sampler's experts where ``batch.routes`` holds them (routing replay)."""
    return remat_forward(model, batch, adapter, remat=False)


def remat_forward(model: nnx.Module, batch: TrainBatch, adapter: bool = True, policy=None,
                  remat: bool = True) -> Forward:
    """`apply_fn` that keeps only each decoder layer's input for the backward pass and recomputes
    the rest of the layer there (``config.train.remat='layer'``): activation memory of one layer
    instead of all of them, for about one more forward pass of compute. With a checkpoint
    ``policy`` the layer also keeps what the policy saves (``'projections'``: the output of every
    ``Linear``, so the backward pass recomputes attention, norms, rotary embedding and the SwiGLU
    product but no projection; MoE experts are recomputed whole)."""
    hidden, routes = model.forward(batch.input_ids, batch.positions, batch.segment_ids, adapter,
                                   remat=remat, policy=policy, replay=batch.routes)
    # (scanned layers: the scan's body is the checkpoint)
    return Forward(hidden, logprob_head(model, adapter), routes.dropped)


FORWARDS = {  # config.train.remat -> apply_fn
    "none": model_forward,
    "layer": remat_forward,
    "projections": functools.partial(
        remat_forward, policy=jax.checkpoint_policies.save_only_these_names(PROJECTION)),
}
RECOMPUTING = (FORWARDS["layer"], FORWARDS["projections"])  # get compiler_options' scheduler


def reference_forward(model: nnx.Module, batch: TrainBatch):
    """LoRA mode reference policy: the same weights with the LoRA adapters switched off."""
    return model_forward(model, batch, adapter=False)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Learner step settings. Hashable (static under jit)."""

    loss: LossConfig = LossConfig()
    micro_batches: int = 1  # gradient-accumulation steps per update; must divide the rows
    # > 0: micro-batches by this many tokens per data-parallel shard instead (their count from the
    # batch's shape, rlx.learner.batching.micro_count; the host lays rows out to fit: batch_layout)
    tokens_per_micro_batch: int = 0
    logprob_chunk: int = 1024  # tokens per chunk of the chunked log-softmax
    # vocabulary columns per tile of a plain lm-head (`logprob_head`); 0: whole [chunk, V] rows
    # (what a vocabulary sharded over the "tensor" mesh axis gets: `for_mesh`)
    vocab_block: int = 4096
    compute_entropy: bool = True  # per-token entropy (metric; needed for entropy_coef > 0)

    def __post_init__(self):
        if (self.micro_batches < 1 or self.logprob_chunk < 1 or self.vocab_block < 0
                or self.tokens_per_micro_batch < 0):
            raise ValueError("StepConfig.micro_batches and logprob_chunk must be >= 1, "
                             "vocab_block and tokens_per_micro_batch >= 0")
        if self.loss.entropy_coef > 0 and not self.compute_entropy:
            raise ValueError("loss.entropy_coef > 0 needs the per-token entropy "
                             "(StepConfig.compute_entropy=True)")
        if self.loss.resolved_aggregation == "seq-mean-token-sum-norm" and (
                self.loss.norm_length is None):
            raise ValueError("loss.norm_length must be set for the aggregation "
                             "'seq-mean-token-sum-norm' (the generation budget, e.g. "
                             "rollout.max_new_tokens): the padded length depends on bucketing "
                             "and packing")


def sequence_logprobs(model: nnx.Module, batch: TrainBatch, cfg: StepConfig,
                      apply_fn: ApplyFn = model_forward) -> LogProbs:
    """Per-token log-probs (and entropies) aligned with `input_ids`; 0 where nothing predicts.

    With `batch.logp_columns` only those columns are scored (0 elsewhere): the lm-head and the
    log-softmax run on the [B, K] gathered hidden states instead of all [B, T]."""
    return _dropping_logprobs(model, batch, cfg, apply_fn)[0]


def _dropping_logprobs(model: nnx.Module, batch: TrainBatch, cfg: StepConfig, apply_fn: ApplyFn
                       ) -> tuple[LogProbs, Int[Array, ""]]:
    """``sequence_logprobs`` and the (token, expert) pairs the forward pass dropped."""
    hidden, project, *dropped = apply_fn(model, batch)  # [B, T, D]
    dropped = dropped[0] if dropped else jnp.zeros((), jnp.int32)
    is_predicted = predicted(batch.segment_ids)  # [B, T]
    if batch.logp_columns is not None:
        logp, entropy = _column_logprobs(hidden, project, batch, cfg)  # [B, T] each, aligned
        keep = lambda x: None if x is None else jnp.where(is_predicted, x, 0.0)  # noqa: E731
        return LogProbs(keep(logp), keep(entropy)), dropped
    targets = jnp.roll(batch.input_ids, -1, axis=1)  # [B, T]  token t + 1, predicted at t
    logp, entropy = _token_logprobs(hidden, project, targets, cfg)  # [B, T] each

    def align(x):  # value for token t lives at position t - 1
        if x is None:
            return None
        return jnp.where(is_predicted, jnp.pad(x[:, :-1], ((0, 0), (1, 0))), 0.0)  # [B, T]

    return LogProbs(align(logp), align(entropy)), dropped


def _column_logprobs(hidden, project, batch: TrainBatch, cfg: StepConfig):
    """Log-probs (and entropies) of the tokens at `batch.logp_columns`, scattered back to [B, T]
    (token t's value at column t); unused slots (column 0) add nothing."""
    cols = batch.logp_columns  # [B, K]
    h = jnp.take_along_axis(hidden, jnp.maximum(cols - 1, 0)[..., None], axis=1)  # [B, K, D]
    targets = jnp.take_along_axis(batch.input_ids, cols, axis=1)  # [B, K]
    outs = _token_logprobs(h, project, targets, cfg)
    rows = jnp.arange(cols.shape[0])[:, None]  # [B, 1]

    def scatter(x):  # [B, K] -> [B, T]
        if x is None:
            return None
        x = jnp.where(cols > 0, x, 0.0)
        return jnp.zeros(batch.input_ids.shape, x.dtype).at[rows, cols].add(x)

    return tuple(scatter(x) for x in outs)


def _token_logprobs(hidden, project, targets, cfg: StepConfig):
    if isinstance(project, LMHead) and cfg.vocab_block == 0:
        project = project.__call__  # whole rows of logits
    return token_logprobs(hidden, project, targets, cfg.logprob_chunk, cfg.compute_entropy,
                          max(cfg.vocab_block, 1))


def for_mesh(cfg: StepConfig, mesh: Mesh) -> StepConfig:
    """`cfg` for a step on `mesh`: with the vocabulary sharded over a "tensor" axis of size > 1,
    whole-row logits (`vocab_block=0`), which stay sharded over V, instead of vocabulary tiles
    (slicing a sharded vocabulary all-gathers the head)."""
    if dict(mesh.shape).get("tensor", 1) > 1 and cfg.vocab_block:
        return dataclasses.replace(cfg, vocab_block=0)
    return cfg


def predicted(segment_ids) -> jax.Array:
    """Tokens with a predecessor in the same sequence: [B, T] bool."""
    prev = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)))  # [B, T]
    return (segment_ids > 0) & (segment_ids == prev)


def _normaliser(mask, segment_ids, cfg: LossConfig):
    """The quantity `aggregate` divides by, up to a constant: tokens or completions."""
    if cfg.resolved_aggregation == "token-mean":
        return jnp.sum(mask)
    return sequence_count(mask, segment_ids)


def _micro_loss(params, frozen, mb: TrainBatch, total_norm, graphdef, cfg: StepConfig, apply_fn):
    """One micro-batch: its loss scaled to its share of the whole batch, and its metrics."""
    model = nnx.merge(graphdef, params, frozen)
    lp, dropped = _dropping_logprobs(model, mb, cfg, apply_fn)
    old = jax.lax.stop_gradient(lp.logp) if mb.old_logp is None else mb.old_logp
    loss, metrics = policy_loss(lp.logp, old, mb.advantages, mb.loss_mask, cfg.loss,
                                ref_logp=mb.ref_logp, sampler_logp=mb.sampler_logp,
                                entropy=lp.entropy, segment_ids=mb.segment_ids)
    scale = _normaliser(mb.loss_mask, mb.segment_ids, cfg.loss) / jnp.maximum(total_norm, 1.0)
    return loss * scale, (metrics, scale, jnp.sum(mb.loss_mask), dropped)


_MAX_FIELDS = ("ratio_max", "tis_weight_max", "mismatch_abs_max")
_MIN_FIELDS = ("ratio_min",)
_SCALED_FIELDS = ("pg_loss",)


def _combine(acc: LossMetrics, m: LossMetrics, scale, tokens) -> LossMetrics:
    """Fold one micro-batch's metrics in: loss terms by `scale`, token means by `tokens`."""
    out = {}
    for name, a, x in zip(LossMetrics._fields, acc, m):
        if name in _MAX_FIELDS:
            out[name] = jnp.maximum(a, jnp.where(tokens > 0, x, -jnp.inf))
        elif name in _MIN_FIELDS:
            out[name] = jnp.minimum(a, jnp.where(tokens > 0, x, jnp.inf))
        elif name in _SCALED_FIELDS:
            out[name] = a + x * scale
        else:
            out[name] = a + x * tokens
    return LossMetrics(**out)


def _finish(acc: LossMetrics, tokens) -> LossMetrics:
    out = {}
    for name, a in zip(LossMetrics._fields, acc):
        if name in _MAX_FIELDS + _MIN_FIELDS:
            out[name] = jnp.where(jnp.isfinite(a), a, 0.0)
        elif name in _SCALED_FIELDS:
            out[name] = a
        else:
            out[name] = a / jnp.maximum(tokens, 1.0)
    return LossMetrics(**out)


def split_micro(batch: TrainBatch, k: int, row_sharding) -> TrainBatch:
    """[B, T] fields -> [k, B / k, T]; micro-batch j holds rows j, j + k, ..."""
    rows = batch.shape[0]
    if rows % k:
        raise ValueError(f"{rows} batch rows do not split into {k} micro-batches; pad rows to a "
                         "multiple of micro_batches x data-parallel size (rows_multiple)")

    def split(x):
        x = x.reshape(rows // k, k, *x.shape[1:]).swapaxes(0, 1)  # [k, B / k, T]
        if row_sharding is not None:
            spec = PartitionSpec(None, *row_sharding.spec)
            x = jax.lax.with_sharding_constraint(x, NamedSharding(row_sharding.mesh, spec))
        return x

    return jax.tree.map(split, batch)


def to_micro_batches(batch: TrainBatch, micro: int, tokens: int, row_sharding) -> TrainBatch:
    """``batch`` as [k, B / k, T] micro-batches: ``micro`` of them, or by the token budget
    ``tokens`` (``micro_count``) over the shards of ``row_sharding``."""
    rows = batch.shape[0]
    shards = 1 if row_sharding is None else rows // row_sharding.shard_shape((rows,))[0]
    return split_micro(batch, micro_count(batch.shape, shards, micro, tokens), row_sharding)


def skip_empty(fn: Callable, mb: TrainBatch):
    """``fn(mb)``, or zeros of its output's shape when ``mb`` holds no loss token (rows that pad
    the batch: nothing to learn from, so no forward or backward pass)."""
    zeros = lambda _: jax.tree.map(  # noqa: E731
        lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, mb))
    return jax.lax.cond(jnp.sum(mb.loss_mask) > 0, fn, zeros, mb)


def compute_grads(params: nnx.State, frozen: nnx.State, batch: TrainBatch, *,
                  graphdef: nnx.GraphDef, cfg: StepConfig, apply_fn: ApplyFn = model_forward,
                  row_sharding: NamedSharding | None = None):
    """Gradient of the whole-batch loss wrt `params`, accumulated over micro-batches.

    Returns (grads, loss, LossMetrics, tokens, sequences, dropped (token, expert) pairs). Pure;
    jit it (the train step does).
    """
    mask = batch.loss_mask * predicted(batch.segment_ids)  # [B, T]  no loss without a prediction
    batch = batch.replace(loss_mask=mask)
    total_norm = _normaliser(mask, batch.segment_ids, cfg.loss)
    grad_fn = jax.value_and_grad(_micro_loss, has_aux=True)

    def body(carry, mb):
        grads, loss, acc, drops = carry
        (mb_loss, (metrics, scale, tokens, dropped)), mb_grads = skip_empty(
            lambda mb: grad_fn(params, frozen, mb, total_norm, graphdef, cfg, apply_fn), mb)
        grads = jax.tree.map(jnp.add, grads, mb_grads)
        return (grads, loss + mb_loss, _combine(acc, metrics, scale, tokens), drops + dropped), None

    zero = jnp.zeros((), jnp.float32)
    acc = LossMetrics(**{n: jnp.inf if n in _MIN_FIELDS else -jnp.inf if n in _MAX_FIELDS
                         else zero for n in LossMetrics._fields})
    init = (jax.tree.map(jnp.zeros_like, params), zero, acc, jnp.zeros((), jnp.int32))
    micro = to_micro_batches(batch, cfg.micro_batches, cfg.tokens_per_micro_batch, row_sharding)
    (grads, loss, acc, dropped), _ = jax.lax.scan(body, init, micro)
    tokens = jnp.sum(mask)
    return (grads, loss, _finish(acc, tokens), tokens, sequence_count(mask, batch.segment_ids),
            dropped)


def _where_tree(ok, new, old):
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)


def _train_step(state: TrainState, batch: TrainBatch, *, graphdef, cfg: StepConfig,
                optimizer: optax.GradientTransformation, schedule, apply_fn, row_sharding):
    grads, loss, lm, tokens, seqs, dropped = compute_grads(
        state.params, state.frozen, batch, graphdef=graphdef, cfg=cfg, apply_fn=apply_fn,
        row_sharding=row_sharding)
    grad_norm = optax.global_norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    lr = schedule(state.step - state.skipped)
    new_state = state.replace(
        step=state.step + 1,
        skipped=state.skipped + (~ok).astype(jnp.int32),
        params=_where_tree(ok, params, state.params),
        opt_state=_where_tree(ok, opt_state, state.opt_state),
        rng=jax.random.split(state.rng)[0],
    )
    metrics = StepMetrics(
        loss=loss, **lm._asdict(), grad_norm=grad_norm, skipped=(~ok).astype(jnp.float32),
        tokens=tokens, sequences=seqs, lr=jnp.where(ok, lr, 0.0).astype(jnp.float32),
        moe_dropped_pairs=dropped.astype(jnp.float32))
    return new_state, metrics


def make_train_step(
    graphdef: nnx.GraphDef,
    state: TrainState,
    mesh: Mesh,
    cfg: StepConfig,
    optimizer_cfg: OptimizerConfig,
    *,
    rules: LogicalRules = TRAIN_RULES,
    apply_fn: ApplyFn = model_forward,
) -> Callable[[TrainState, TrainBatch], tuple[TrainState, StepMetrics]]:
    """Compile `(state, batch) -> (state, metrics)`; `state` (concrete or abstract) fixes the
    shardings. The state argument is donated, except its frozen part (``UpdatePerShape``): do not
    reuse it after the call; its frozen arrays live on in the new state. One program per batch
    shape, compiled ahead of its first run (`rlx.platform.compiled.CompiledPerShape`)."""
    cfg = for_mesh(cfg, mesh)
    optimizer = make_optimizer(optimizer_cfg)
    shardings = state_shardings(state, optimizer, mesh, rules)
    rows = batch_sharding(mesh, 2, rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    step = functools.partial(
        _train_step, graphdef=graphdef, cfg=cfg, optimizer=optimizer,
        schedule=make_schedule(optimizer_cfg), apply_fn=apply_fn,
        row_sharding=batch_sharding(mesh, 1, rules))
    return UpdatePerShape(step, in_shardings=(shardings, rows),
                          out_shardings=(shardings, replicated),
                          compiler_options=compiler_options(mesh, apply_fn))


def compiler_options(mesh: Mesh, apply_fn: ApplyFn) -> dict[str, str | bool] | None:
    """XLA options of the train step, as the policy of ``mesh``'s platform gives them
    (``PlatformPolicy.compiler_options``), the step recomputing activations or not
    (``RECOMPUTING``). On CPU with recomputation: the memory-optimised scheduler. With XLA:CPU's
    default order the recomputed activations of every layer stay alive together inside the
    micro-batch loop, which undoes ``train.remat='layer'``; this scheduler restores the saving
    remat is for. Without remat it lowers the peak little and slows the update, so those steps
    keep the default (and the planner's calibration). GPU and TPU compilers schedule for memory
    already; TPU gets ``rlx.platform.policy.TPU_OPTIONS``."""
    return policy_of(mesh).compiler_options(recompute=apply_fn in RECOMPUTING)


def make_logprob_step(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    frozen: nnx.State,
    mesh: Mesh,
    cfg: StepConfig,
    *,
    rules: LogicalRules = TRAIN_RULES,
    apply_fn: ApplyFn = model_forward,
) -> Callable[[nnx.State, nnx.State, TrainBatch], LogProbs]:
    """Compile `(params, frozen, batch) -> LogProbs` (old or reference log-probs, no gradient).

    `params` / `frozen` (concrete or abstract) fix the shardings. For a reference that is a
    separate model, pass its params; for LoRA mode's adapter-off reference, pass an `apply_fn` that
    runs the model without adapters.
    """
    rows = batch_sharding(mesh, 2, rules)
    cfg = for_mesh(cfg, mesh)

    def run(p, f, batch):
        model = nnx.merge(graphdef, p, f)
        return sequence_logprobs(model, batch, cfg, apply_fn)

    return CompiledPerShape(jax.jit(
        run,
        in_shardings=(variable_shardings(params, mesh, rules),
                      variable_shardings(frozen, mesh, rules), rows),
        out_shardings=rows,
    ))


@dataclasses.dataclass
class Compiled:
    """The learner of a run: graph, state (donated each update), the compiled train step, with a
    KL term the reference log-prob step, and with several updates per batch the policy's own
    log-prob step (``rlx.run.build.compile_steps`` makes them)."""

    graphdef: nnx.GraphDef
    state: TrainState
    train_step: Callable[[TrainState, TrainBatch], tuple[TrainState, StepMetrics]]
    ref_step: Callable[..., LogProbs] | None
    old_step: Callable[..., LogProbs] | None = None  # (params, frozen, batch): pi_old, adapter on
    # PPO's critic (rlx.learner.critic, state.critic): its body's graph (the policy's own in LoRA
    # mode), (state, batch) -> values, and one update (state, batch) -> (state, metrics)
    critic_graphdef: nnx.GraphDef | None = None
    value_step: Callable[..., Array] | None = None
    critic_step: Callable[..., tuple[TrainState, Any]] | None = None
    # the longest sequence the model was built for (``ModelConfig.position_limit``); None: unknown
    max_positions: int | None = None

    def reference_logprobs(self, batch: TrainBatch) -> LogProbs:
        """The reference policy's log-probs of ``batch`` (``ref_step``): full mode's frozen copy
        of the initial parameters (``state.ref``), or LoRA mode's base with the adapter off."""
        state = self.state
        return self.ref_step(state.params if state.ref is None else state.ref, state.frozen, batch)

    def model(self) -> nnx.Module:
        """The current policy as a module (parameters and frozen base merged)."""
        return nnx.merge(self.graphdef, self.state.params, self.state.frozen)

    def critic(self) -> tuple[nnx.Module, Any] | None:
        """PPO's critic: its body as a module (the critic's adapter on the policy's frozen base,
        or its own model) and its value head ``{"kernel": [D], "bias": []}``; None without."""
        critic = self.state.critic
        if critic is None:
            return None
        frozen = self.state.frozen if critic.frozen is None else critic.frozen
        return nnx.merge(self.critic_graphdef, critic.params["body"], frozen), critic.params["head"]
