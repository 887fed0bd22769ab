"""Typed records passed between the stages of an RL step.

* `Prompt` - a tokenized prompt with the uid that groups its samples; `SamplingParams` - how to
  sample it; `RolloutEngine` - the protocol every rollout engine implements.
* `Rollout` - one sampled completion on the host (numpy), tagged with its prompt uid and the
  version of the weights that produced it.
* `TrainBatch` - what the learner consumes: [B, T] rows (padded, or packed with several sequences
  per row), one array per field, all of them batch-major so one `NamedSharding` shards the lot.
* `StepMetrics` - the scalars one train step reports.

Token alignment: every per-token field of `TrainBatch` is aligned with `input_ids`; position t
holds the quantity of token `input_ids[t]` given the tokens before it (its log-prob, advantage,
...). Prompt tokens, padding and tool/environment tokens have `loss_mask` 0. The learner shifts
its own log-probs to this alignment. `logp_columns` (optional, `[B, K]`) lists each row's
loss-mask columns, so that the learner projects to the vocabulary there only.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np
from flax import nnx, struct
from jaxtyping import Array, Float, Int

PerToken = Float[Array, "b t"]
Scalar = Float[Array, ""]

BATCH_FIELDS = (
    "input_ids", "positions", "segment_ids", "loss_mask", "advantages", "sampler_logp",
    "old_logp", "ref_logp", "uid", "weight_version", "old_values", "returns",
)


@dataclasses.dataclass(frozen=True)
class Rollout:
    """One completion of one prompt, on the host; what every rollout engine returns.

    `sampler_logp[i]` is the engine's log-prob of `completion_ids[i]`; with `has_logprobs` False
    the engine skipped them (`SamplingParams(logprobs=False)`) and they are NaN.
    `completion_mask` (default: all ones) is 0 on completion tokens the policy did not generate
    (tool outputs, environment turns); they are fed to the model but carry no loss.
    """

    prompt_uid: str  # groups for advantages are formed by this uid (any hashable works)
    prompt_ids: np.ndarray  # [P] int
    completion_ids: np.ndarray  # [C] int
    sampler_logp: np.ndarray  # [C] float
    finish_reason: str = "length"  # "stop" (eos / stop string) | "length"
    weight_version: int = 0  # policy version (learner step) that sampled it
    sample_index: int = 0  # which of the n samples of its prompt
    completion_mask: np.ndarray | None = None  # [C] {0, 1}; None: all generated
    reward: float | None = None
    has_logprobs: bool = True  # False: sampler_logp was not computed (NaN); no batch takes it
    # [C] the weight version that sampled each token (a partial rollout continued across a weight
    # sync, rlx.run.rollouts); None: every token weight_version's
    token_versions: np.ndarray | None = None
    # [P + C, moe layers, k] int16: the experts each prompt and completion token went to in every
    # MoE layer when the engine sampled it (routing replay, config.train.router_replay), -1 where
    # the engine never fed the token (a completion's last one); None: not recorded
    routes: np.ndarray | None = None

    def __post_init__(self):
        c = len(self.completion_ids)
        if self.routes is not None and (self.routes.ndim != 3 or
                                        len(self.routes) != len(self.prompt_ids) + c):
            raise ValueError(f"Rollout.routes has shape {self.routes.shape}, expected "
                             f"[{len(self.prompt_ids) + c}, moe layers, k] (prompt + completion)")
        if len(self.prompt_ids) < 1:
            raise ValueError("Rollout.prompt_ids must hold at least one token")
        if len(self.sampler_logp) != c:
            raise ValueError(f"Rollout.sampler_logp has {len(self.sampler_logp)} entries for {c} "
                             "completion tokens")
        if self.token_versions is not None and len(self.token_versions) != c:
            raise ValueError(f"Rollout.token_versions has {len(self.token_versions)} entries for "
                             f"{c} completion tokens")
        if self.completion_mask is not None and len(self.completion_mask) != c:
            raise ValueError(f"Rollout.completion_mask has {len(self.completion_mask)} entries "
                             f"for {c} completion tokens")

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@struct.dataclass
class TrainBatch:
    """A learner batch: every field is [B, T] (host numpy or device arrays).

    Padded rows carry one sequence each (segment id 1, padding 0); packed rows carry several
    (segment ids 1, 2, ..., positions restarting at 0 per segment). `old_logp` None means the
    policy has not moved since sampling (ratio 1, on-policy); `ref_logp` None: no KL term;
    `old_values` / `returns` (PPO with a critic) the value loss's inputs, None without a critic.
    """

    input_ids: Int[Array, "b t"]
    positions: Int[Array, "b t"]
    segment_ids: Int[Array, "b t"]  # 1, 2, ... per sequence in the row; 0 = padding
    loss_mask: PerToken  # 1 on generated completion tokens only
    advantages: PerToken  # per-completion advantage broadcast over its tokens
    sampler_logp: PerToken  # rollout engine's log-probs (0 off the loss mask)
    old_logp: PerToken | None = None  # learner log-probs before this update
    ref_logp: PerToken | None = None  # reference policy log-probs
    uid: Int[Array, "b t"] | None = None  # prompt uid of each token's sequence; -1 on padding
    weight_version: Int[Array, "b t"] | None = None  # sampling weight version; -1 on padding
    old_values: PerToken | None = None  # the critic's values before this step's updates (PPO)
    returns: PerToken | None = None  # the critic's targets: GAE advantages + old_values
    # columns t whose log-prob the loss reads, ascending per row, 0 in unused slots (column 0 is
    # never predicted); None: every column. The lm-head then runs on B x K tokens, not B x T.
    logp_columns: Int[Array, "b k"] | None = None
    # the experts of every token in every MoE layer as the sampler chose them, [B, T, moe layers,
    # k], -1 where unknown (the router then picks; padding too); None: the learner routes freely
    routes: Int[Array, "b t l k"] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)

    def validate(self) -> None:
        """Host check: every present field is [B, T], `routes` [B, T, L, k], `logp_columns`
        [B, K] with K <= T and columns in [0, T). Raises ValueError naming the field."""
        for name in BATCH_FIELDS:
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != self.shape:
                raise ValueError(f"TrainBatch.{name} has shape {tuple(value.shape)}, expected "
                                 f"{self.shape} like input_ids")
        b, t = self.shape
        if self.routes is not None and (self.routes.ndim != 4 or
                                        tuple(self.routes.shape[:2]) != (b, t)):
            raise ValueError(f"TrainBatch.routes has shape {tuple(self.routes.shape)}, expected "
                             f"[{b}, {t}, moe layers, k]")
        cols = self.logp_columns
        if cols is None:
            return
        if cols.ndim != 2 or cols.shape[0] != b or not 1 <= cols.shape[1] <= t:
            raise ValueError(f"TrainBatch.logp_columns has shape {tuple(cols.shape)}, expected "
                             f"[{b}, K] with 1 <= K <= {t}")
        if np.any((np.asarray(cols) < 0) | (np.asarray(cols) >= t)):
            raise ValueError(f"TrainBatch.logp_columns holds a column outside [0, {t})")

    def rows(self, index) -> "TrainBatch":
        """The rows `index` (a slice or an index array) of every field."""
        return self.replace(**{
            n: None if getattr(self, n) is None else getattr(self, n)[index]
            for n in (*BATCH_FIELDS, "logp_columns", "routes")
        })


class LogProbs(NamedTuple):
    """Output of a log-prob step, aligned with `input_ids` (position 0 of each sequence is 0)."""

    logp: PerToken
    entropy: PerToken | None


class StepMetrics(NamedTuple):
    """Scalars of one train step. Token statistics are means over loss-mask tokens of the batch."""

    loss: Scalar  # total loss (policy + KL - entropy bonus)
    pg_loss: Scalar  # policy-gradient term
    kl: Scalar  # KL estimate to the reference (0 without ref_logp)
    entropy: Scalar  # policy entropy per token
    clip_frac_low: Scalar
    clip_frac_high: Scalar
    clip_frac: Scalar  # tokens whose gradient the clip removed (low + high)
    clip_frac_dual: Scalar  # A < 0 tokens whose loss the dual clip bounded (loss.clip_ratio_c)
    approx_kl: Scalar  # k3 estimate of KL(pi_old || pi) over the update's tokens
    ratio_mean: Scalar
    ratio_min: Scalar
    ratio_max: Scalar
    tis_weight_mean: Scalar
    tis_weight_max: Scalar
    tis_clipped_frac: Scalar
    mismatch_abs_mean: Scalar  # |log pi_learner - log pi_sampler|
    mismatch_abs_max: Scalar
    mismatch_kl: Scalar  # k3 KL(sampler || learner)
    grad_norm: Scalar  # global norm before clipping
    skipped: Scalar  # 1.0 when the update was skipped (non-finite loss or gradients)
    tokens: Scalar  # loss-mask tokens in the batch
    sequences: Scalar  # completions in the batch
    lr: Scalar  # learning rate applied this step
    # (token, expert) pairs a MoE dispatch capacity dropped in the step's forward passes, summed
    # over layers and micro-batches (0 when dropless: config.model.moe_capacity_factor = 0)
    moe_dropped_pairs: Scalar


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` is greedy; ``top_k``/``top_p``/``min_p`` None means
    off (applied in that order: ``rlx.rollout.jax.sampler``)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None  # keep tokens at least min_p x as likely as the likeliest
    n: int = 1  # completions per prompt
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False  # generate exactly max_new_tokens: no stop ids, strings or EOS
    # the sampler log-prob of every token (what RL trains with). False: an engine may skip them,
    # for evaluation or samples to look at (the built-in one does: Rollout.has_logprobs False,
    # sampler_logp NaN, and a training batch refuses it; SGLang returns them anyway)
    logprobs: bool = True

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k={self.top_k} must be >= 1")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1")
        if self.ignore_eos and (self.stop_token_ids or self.stop_strings):
            raise ValueError("ignore_eos=True generates max_new_tokens whatever comes; drop "
                             "stop_token_ids and stop_strings")


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A tokenized prompt with the uid that groups its samples (GRPO groups by uid)."""

    uid: str
    token_ids: tuple[int, ...]


@typing.runtime_checkable
class RolloutEngine(Protocol):
    """What the run asks of a rollout engine (``rlx.rollout``: the built-in ``JaxEngine`` and
    SGLang's ``SGLangPolicy``); nothing else is called on one.

    ``generate(prompts, sampling)`` returns, for every prompt, ``sampling.n`` completions in
    prompt order (prompt 0's samples first), each with per-token sampler log-probs, a finish
    reason and the ``weight_version`` of the policy that produced it.
    """

    name: str  # "jax" | "sglang": names the engine in reports (the parity preflight)
    weight_version: int  # the policy version the engine serves now

    def generate(self, prompts: Sequence[Prompt], sampling: SamplingParams) -> list[Rollout]: ...

    def score(self, sequences: Sequence[tuple[Sequence[int], int]]) -> list[np.ndarray]:
        """Log-probs the engine assigns to given tokens: (token ids, prompt length) -> [len-P]."""
        ...

    def update_weights(self, weights: nnx.Module | nnx.State, version: int) -> None:
        """Serve ``weights`` as policy ``version``: a whole model, or (several processes) new
        values of the trainable variables."""
        ...

    def close(self) -> None:
        """Stop what the engine started (servers, threads); idempotent."""
        ...
