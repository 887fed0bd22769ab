"""Policy, value and preference losses: pure jnp, jit-able, f32 throughout.

Per-token inputs are [B, T] over the completion positions, with `loss_mask` 1 on generated tokens
(0 on prompt, padding and tool/environment tokens). Advantages are per token (a per-completion
advantage broadcast over its tokens).

Policy losses (`LossConfig.policy_loss`); all use the clipped surrogate
`-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)` per token:

* "ppo" - PPO-clip (Schulman et al. 2017) as used by GRPO (Shao et al. 2024): r = pi / pi_old per
  token. Default aggregation "seq-mean-token-mean" as in the GRPO paper. Departure from the GRPO
  paper: the KL term is opt-in (`kl_coef`) and may be a reward penalty instead of a loss term.
* "dapo" - DAPO (Yu et al. 2025): the same token surrogate with decoupled clip ("clip-higher": set
  `clip_eps_high` above `clip_eps_low`, the paper uses 0.2 / 0.28) and token-level aggregation
  ("token-mean") by default. Its dynamic sampling and overlong shaping are data-side, not here.
* "dr_grpo" - Dr. GRPO (Liu et al. 2025): the same surrogate, summed over tokens and divided by a
  constant (the number of completions times `norm_length`, the generation budget) instead of each
  completion's length ("seq-mean-token-sum-norm"). Its other half, no std in the advantage, is in
  `advantages.dr_grpo`.
* "gspo" - GSPO (Zheng et al. 2025): the ratio is the sequence-level geometric mean
  s_i = exp(mean_t log(pi / pi_old)), clipped per sequence. Implemented in the paper's GSPO-token
  form, s_it = sg[s_i] * pi_t / sg[pi_t], which has the value and gradient of GSPO when advantages
  are per sequence and the aggregation is "seq-mean-token-mean" (the default). GSPO's paper uses
  much smaller clip ranges (3e-4 / 4e-4) than token-level PPO; set them in the config.

Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games"; verl's and OpenRLHF's
`clip_ratio_c`), opt-in with `clip_ratio_c`: for a token with A < 0 the clipped surrogate
`-min(r A, clip(r) A)` grows without bound as r grows; dual clip caps it at `-A * clip_ratio_c`
(> 1), so such a token's loss is `min(-min(r A, clip(r) A), -A c)` and its gradient is 0 once
r > c. Any policy loss above takes it. Departure from verl: verl applies it always (c = 3 by
default); here it is off unless set. `clip_frac_dual` (verl's `pg_clipfrac_lower`) counts the
tokens it bounded.

Regularisers: KL to a reference policy with the k1 / k2 / k3 estimators (Schulman, "Approximating
KL divergence", 2020) either as a loss term or, with `kl_as="reward-penalty"`, left to the caller to
subtract from rewards (`kl_penalty`) - then it is only reported here. Entropy bonus `entropy_coef`.
KL and entropy are aggregated like the policy term.

Truncated importance sampling against the sampler (Yao et al. 2025, "Your efficient RL framework
secretly brings you off-policy RL training"): when sampler log-probs are given, "token" mode weights
each token's policy term by sg[min(pi_old / pi_sampler, tis_cap)]; "sequence-mask" mode instead
drops (weight 0) completions whose geometric-mean ratio exp(mean_t log(pi_old / pi_sampler)) lies
outside [tis_seq_low, tis_seq_high] (masked importance sampling); the denominators of the
aggregation are unchanged, so dropped completions count as zero-weight samples.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from rlx.errors import one_of

PerToken = Float[Array, "b t"]
Scalar = Float[Array, ""]

POLICY_LOSSES = ("ppo", "dapo", "dr_grpo", "gspo")
AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
DEFAULT_AGGREGATION = {
    "ppo": "seq-mean-token-mean",
    "dapo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "gspo": "seq-mean-token-mean",
}
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_AS = ("loss", "reward-penalty")
TIS_MODES = ("off", "token", "sequence-mask")
# whose log-probs the ratio's denominator pi_old is when one rollout batch takes several updates:
# "learner" the policy's own at the start of the step (computed once), "sampler" the engine's
OLD_LOGP = ("learner", "sampler")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Learner loss settings; validated on construction. Hashable, so usable as a static jit arg."""

    policy_loss: str = "ppo"  # one of POLICY_LOSSES
    clip_eps_low: float = 0.2  # ratio floor 1 - clip_eps_low
    clip_eps_high: float = 0.2  # ratio ceiling 1 + clip_eps_high (DAPO clip-higher: 0.28)
    # dual-clip PPO: a token with A < 0 loses at most -A * clip_ratio_c (> 1; verl and OpenRLHF
    # use 3.0); None: off
    clip_ratio_c: float | None = None
    aggregation: str | None = None  # one of AGGREGATIONS; None: DEFAULT_AGGREGATION[policy_loss]
    norm_length: int | None = None  # constant of "seq-mean-token-sum-norm"; None: the padded T
    # weight of KL(pi || pi_ref); 0 turns it off. pi_ref: LoRA mode the base with the adapter
    # off; full mode a frozen copy of the initial parameters (one more copy in memory)
    kl_coef: float = 0.0
    kl_estimator: str = "k3"  # one of KL_ESTIMATORS
    kl_as: str = "loss"  # one of KL_AS
    entropy_coef: float = 0.0  # weight of the entropy bonus (subtracted from the loss)
    tis_mode: str = "token"  # one of TIS_MODES; only acts when sampler log-probs are given
    tis_cap: float = 2.0  # "token": per-token weight min(pi_old / pi_sampler, tis_cap)
    tis_seq_low: float = 0.5  # "sequence-mask": keep if geo-mean ratio >= this
    tis_seq_high: float = 2.0  # "sequence-mask": keep if geo-mean ratio <= this
    old_logp: str = "learner"  # one of OLD_LOGP: pi_old of the clipped ratio
    dpo_beta: float = 0.1  # DPO (train.algorithm="dpo"): scale of the implicit reward
    dpo_label_smoothing: float = 0.0  # DPO: assumed share of flipped labels (conservative DPO)

    def __post_init__(self):
        one_of("policy_loss", self.policy_loss, POLICY_LOSSES)
        if self.aggregation is not None:
            one_of("aggregation", self.aggregation, AGGREGATIONS)
        one_of("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        one_of("kl_as", self.kl_as, KL_AS)
        one_of("tis_mode", self.tis_mode, TIS_MODES)
        one_of("old_logp", self.old_logp, OLD_LOGP)
        for name in ("clip_eps_low", "clip_eps_high", "kl_coef", "entropy_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"LossConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.dpo_beta <= 0 or not 0 <= self.dpo_label_smoothing < 0.5:
            raise ValueError(f"LossConfig.dpo_beta must be > 0 and dpo_label_smoothing in "
                             f"[0, 0.5), got {self.dpo_beta}, {self.dpo_label_smoothing}")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            raise ValueError(f"LossConfig.clip_ratio_c={self.clip_ratio_c} must be > 1 (the "
                             "dual clip bounds a token with A < 0 at -A * clip_ratio_c, e.g. "
                             "3.0); None turns dual clip off")
        if self.clip_eps_low >= 1:
            raise ValueError(f"LossConfig.clip_eps_low must be < 1, got {self.clip_eps_low}")
        if self.tis_cap <= 0:
            raise ValueError(f"LossConfig.tis_cap must be > 0, got {self.tis_cap}")
        if not 0 <= self.tis_seq_low <= self.tis_seq_high:
            raise ValueError(
                f"LossConfig needs 0 <= tis_seq_low <= tis_seq_high, got "
                f"{self.tis_seq_low}, {self.tis_seq_high}"
            )
        if self.norm_length is not None and self.norm_length < 1:
            raise ValueError(f"LossConfig.norm_length must be >= 1, got {self.norm_length}")

    @property
    def resolved_aggregation(self) -> str:
        return self.aggregation or DEFAULT_AGGREGATION[self.policy_loss]


class LossMetrics(NamedTuple):
    """Scalars from `policy_loss` (a pytree). Token statistics are over `loss_mask` tokens."""

    pg_loss: Scalar  # aggregated (TIS-weighted) policy term
    kl: Scalar  # token-mean KL estimate to the reference (0 without ref_logp)
    entropy: Scalar  # token-mean entropy (0 without entropy)
    clip_frac_low: Scalar  # tokens with r < 1 - eps_low and A < 0 (gradient clipped away)
    clip_frac_high: Scalar  # tokens with r > 1 + eps_high and A > 0
    clip_frac: Scalar  # clip_frac_low + clip_frac_high: tokens whose gradient the clip removed
    clip_frac_dual: Scalar  # A < 0 tokens the dual clip bounded (verl's pg_clipfrac_lower; 0 off)
    approx_kl: Scalar  # token mean of (r - 1) - log r, the k3 estimate of KL(pi_old || pi)
    ratio_mean: Scalar
    ratio_min: Scalar
    ratio_max: Scalar
    tis_weight_mean: Scalar
    tis_weight_max: Scalar
    tis_clipped_frac: Scalar  # tokens whose TIS weight was truncated or zeroed
    mismatch_abs_mean: Scalar  # |log pi_old - log pi_sampler|, token mean
    mismatch_abs_max: Scalar
    mismatch_kl: Scalar  # k3 estimate of KL(pi_sampler || pi_old), token mean


class ValueMetrics(NamedTuple):
    value_loss: Scalar
    clip_frac: Scalar  # tokens whose clipped value's error is the larger one (clipped tokens only)
    value_mean: Scalar


class DPOMetrics(NamedTuple):
    reward_chosen: Scalar  # mean beta * (log pi - log pi_ref) on chosen
    reward_rejected: Scalar
    reward_margin: Scalar
    reward_accuracy: Scalar  # fraction of pairs with chosen reward > rejected reward


def _masked_mean(x: PerToken, mask: PerToken) -> Scalar:
    return jnp.sum(jnp.where(mask > 0, x, 0.0)) / jnp.maximum(jnp.sum(mask), 1.0)


def _masked_extreme(x: PerToken, mask: PerToken, largest: bool) -> Scalar:
    fill = -jnp.inf if largest else jnp.inf
    picked = jnp.where(mask > 0, x, fill)  # [B, T]
    value = jnp.max(picked) if largest else jnp.min(picked)
    return jnp.where(jnp.any(mask > 0), value, 0.0)


def _per_sequence(
    x: PerToken, mask: PerToken, segment_ids: Int[Array, "b t"] | None
) -> tuple[Array, Array]:
    """Masked sums of x and token counts per completion: [B] (one per row) without segment ids,
    else [B, T + 1] indexed by the packed segment id (0 = padding, never counted)."""
    masked = jnp.where(mask > 0, x.astype(jnp.float32), 0.0)  # [B, T]
    if segment_ids is None:
        return jnp.sum(masked, axis=-1), jnp.sum(mask, axis=-1)
    b, t = segment_ids.shape
    flat = (jnp.arange(b, dtype=jnp.int32)[:, None] * (t + 1) + segment_ids).reshape(-1)  # [B*T]
    seg_sum = lambda v: jax.ops.segment_sum(v.reshape(-1), flat, b * (t + 1))  # noqa: E731
    real = (segment_ids > 0).astype(jnp.float32)  # [B, T]
    return (seg_sum(masked * real).reshape(b, t + 1),  # [B, T + 1]
            seg_sum(mask * real).reshape(b, t + 1))


def sequence_count(mask: PerToken, segment_ids: Int[Array, "b t"] | None = None) -> Scalar:
    """Number of completions with at least one unmasked token (rows, or packed segments)."""
    mask = mask.astype(jnp.float32)
    _, seq_len = _per_sequence(mask, mask, segment_ids)
    return jnp.sum(seq_len > 0).astype(jnp.float32)


def aggregate(
    per_token: PerToken,
    mask: PerToken,
    mode: str,
    norm_length: int | None = None,
    segment_ids: Int[Array, "b t"] | None = None,
) -> Scalar:
    """Reduce a per-token loss to a scalar. Completions with no unmasked token are not counted.

    token-mean:              sum_bt x m / sum_bt m                       (DAPO)
    seq-mean-token-sum:      mean_b sum_t x m
    seq-mean-token-mean:     mean_b (sum_t x m / sum_t m)                (GRPO)
    seq-mean-token-sum-norm: sum_bt x m / (n_seq * norm_length or T)     (Dr. GRPO)

    A completion is a row, or with `segment_ids` (packed rows) one non-zero segment of a row.
    """
    one_of("aggregation", mode, AGGREGATIONS)
    mask = mask.astype(jnp.float32)
    seq_sum, seq_len = _per_sequence(per_token, mask, segment_ids)  # [B] or [B, T + 1]
    n_seq = jnp.maximum(jnp.sum(seq_len > 0), 1).astype(jnp.float32)  # []
    if mode == "token-mean":
        return jnp.sum(seq_sum) / jnp.maximum(jnp.sum(seq_len), 1.0)
    if mode == "seq-mean-token-sum":
        return jnp.sum(seq_sum) / n_seq
    if mode == "seq-mean-token-mean":
        return jnp.sum(seq_sum / jnp.maximum(seq_len, 1.0)) / n_seq
    length = norm_length if norm_length is not None else per_token.shape[-1]
    return jnp.sum(seq_sum) / (n_seq * length)


def kl_penalty(logp: PerToken, ref_logp: PerToken, estimator: str = "k3") -> PerToken:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (k1, k2 or k3).

    Departure from verl's "low_var_kl" (its k3): nothing is clamped here, where verl clamps
    log(pi_ref / pi) to [-20, 20] and the k3 value to [-10, 10]; the two agree inside those bounds.
    """
    one_of("kl_estimator", estimator, KL_ESTIMATORS)
    log_ratio = logp.astype(jnp.float32) - ref_logp.astype(jnp.float32)  # log pi / pi_ref
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * jnp.square(log_ratio)
    return jnp.exp(-log_ratio) + log_ratio - 1.0  # k3: r - log r - 1, r = pi_ref / pi


def _seq_mean(x: PerToken, mask: PerToken, segment_ids=None) -> Float[Array, "b _"]:
    """Per-completion mean of x over its unmasked tokens: a [B, 1] column, or with segment ids
    each token's own segment mean, [B, T]."""
    if segment_ids is None:
        return jnp.sum(jnp.where(mask > 0, x, 0.0), axis=-1, keepdims=True) / jnp.maximum(
            jnp.sum(mask, axis=-1, keepdims=True), 1.0
        )
    seq_sum, seq_len = _per_sequence(x, mask, segment_ids)  # [B, T + 1]
    means = seq_sum / jnp.maximum(seq_len, 1.0)  # [B, T + 1]
    return jnp.take_along_axis(means, segment_ids, axis=1)  # [B, T]


def _k3(log_r: PerToken) -> PerToken:
    """(r - 1) - log r per token: the k3 estimate of KL(pi_old || pi) from samples of pi_old."""
    return jnp.expm1(log_r) - log_r


def _log_ratio(
    logp: PerToken, old_logp: PerToken, mask: PerToken, cfg: LossConfig, segment_ids=None
) -> PerToken:
    """log r per token: token-level for ppo/dapo/dr_grpo, GSPO-token form for gspo."""
    log_ratio = logp - old_logp  # [B, T]
    if cfg.policy_loss != "gspo":
        return log_ratio
    seq_log_ratio = _seq_mean(log_ratio, mask, segment_ids)  # [B, 1] or [B, T]  log s_i
    return jax.lax.stop_gradient(seq_log_ratio) + logp - jax.lax.stop_gradient(logp)


def _tis_weights(
    old_logp: PerToken, sampler_logp: PerToken | None, mask: PerToken, cfg: LossConfig,
    segment_ids=None,
) -> tuple[PerToken, Scalar]:
    """Stop-gradient importance weights and the fraction of tokens truncated or dropped."""
    if sampler_logp is None or cfg.tis_mode == "off":
        return jnp.ones_like(old_logp), jnp.zeros((), jnp.float32)
    log_w = old_logp - sampler_logp  # [B, T]  log pi_old / pi_sampler
    if cfg.tis_mode == "token":
        raw = jnp.exp(log_w)  # [B, T]
        weights = jnp.minimum(raw, cfg.tis_cap)
        altered = raw > cfg.tis_cap
    else:
        seq_ratio = jnp.exp(_seq_mean(log_w, mask, segment_ids))  # [B, 1] or [B, T]
        keep = (seq_ratio >= cfg.tis_seq_low) & (seq_ratio <= cfg.tis_seq_high)
        weights = jnp.broadcast_to(keep, log_w.shape).astype(jnp.float32)
        altered = weights == 0
    weights = jax.lax.stop_gradient(weights)
    return weights, _masked_mean(altered.astype(jnp.float32), mask)


def _mismatch(
    old_logp: PerToken, sampler_logp: PerToken | None, mask: PerToken
) -> tuple[Scalar, Scalar, Scalar]:
    """How far the sampler's log-probs are from the learner's (old) ones."""
    if sampler_logp is None:
        zero = jnp.zeros((), jnp.float32)
        return zero, zero, zero
    diff = old_logp - sampler_logp  # [B, T]
    k3 = jnp.exp(diff) - diff - 1.0  # KL(sampler || old), samples from the sampler
    abs_diff = jnp.abs(diff)
    return (
        _masked_mean(abs_diff, mask),
        _masked_extreme(abs_diff, mask, largest=True),
        _masked_mean(k3, mask),
    )


def _clipped_surrogate(
    ratio: PerToken, advantages: PerToken, cfg: LossConfig
) -> tuple[PerToken, PerToken, PerToken, PerToken]:
    """-min(r A, clip(r) A) per token (bounded by -A c for A < 0 under dual clip), and where the
    low / high clip removed the gradient and where the dual clip bounded the loss."""
    low, high = 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high
    unclipped = ratio * advantages
    clipped = jnp.clip(ratio, low, high) * advantages
    per_token = -jnp.minimum(unclipped, clipped)  # [B, T]
    clip_low = (ratio < low) & (advantages < 0)
    clip_high = (ratio > high) & (advantages > 0)
    dual = jnp.zeros_like(clip_low)
    if cfg.clip_ratio_c is not None:
        bound = -advantages * cfg.clip_ratio_c  # [B, T]  the dual clip's ceiling where A < 0
        dual = (advantages < 0) & (per_token > bound)
        per_token = jnp.where(dual, bound, per_token)
    as_f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return per_token, as_f32(clip_low), as_f32(clip_high), as_f32(dual)


def _f32(x):
    return None if x is None else jnp.asarray(x, jnp.float32)


def _on_mask(x, mask: PerToken):
    """x in f32 with masked positions replaced by 0, so padding garbage (inf, nan) cannot leak
    into values or gradients (a `where` here, not a product, keeps the cotangent finite)."""
    return None if x is None else jnp.where(mask > 0, jnp.asarray(x, jnp.float32), 0.0)


def _check_terms(cfg: LossConfig, ref_logp, entropy) -> None:
    """The loss terms ``cfg`` asks for have their inputs."""
    if cfg.kl_coef > 0 and cfg.kl_as == "loss" and ref_logp is None:
        raise ValueError("LossConfig.kl_coef > 0 with kl_as='loss' needs ref_logp")
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError("LossConfig.entropy_coef > 0 needs the per-token entropy")


def policy_loss(
    logp: PerToken,
    old_logp: PerToken,
    advantages: PerToken,
    loss_mask: PerToken,
    cfg: LossConfig,
    ref_logp: PerToken | None = None,
    sampler_logp: PerToken | None = None,
    entropy: PerToken | None = None,
    segment_ids: Int[Array, "b t"] | None = None,
) -> tuple[Scalar, LossMetrics]:
    """Scalar policy loss (surrogate + KL + entropy, see module doc) and its metrics.

    `segment_ids` (packed rows: 1, 2, ... per completion, 0 = padding) make every per-completion
    quantity (aggregation, GSPO ratio, sequence-mask TIS) per segment instead of per row.
    """
    mask = _f32(loss_mask)
    logp, old_logp, advantages = (_on_mask(x, mask) for x in (logp, old_logp, advantages))
    ref_logp, sampler_logp, entropy = (_on_mask(x, mask) for x in (ref_logp, sampler_logp, entropy))
    _check_terms(cfg, ref_logp, entropy)
    agg = lambda x: aggregate(  # noqa: E731
        x, mask, cfg.resolved_aggregation, cfg.norm_length, segment_ids)

    ratio = jnp.exp(_log_ratio(logp, old_logp, mask, cfg, segment_ids))  # [B, T]
    surrogate, clip_low, clip_high, dual = _clipped_surrogate(ratio, advantages, cfg)
    tis_w, tis_altered = _tis_weights(old_logp, sampler_logp, mask, cfg, segment_ids)
    pg_loss = agg(surrogate * tis_w)
    loss = pg_loss

    kl_tok = jnp.zeros_like(logp)
    if ref_logp is not None:
        kl_tok = kl_penalty(logp, ref_logp, cfg.kl_estimator)  # [B, T]
    if cfg.kl_coef > 0 and cfg.kl_as == "loss":
        loss = loss + cfg.kl_coef * agg(kl_tok)
    ent_tok = jnp.zeros_like(logp) if entropy is None else entropy
    if cfg.entropy_coef > 0:
        loss = loss - cfg.entropy_coef * agg(ent_tok)

    mismatch_mean, mismatch_max, mismatch_kl = _mismatch(old_logp, sampler_logp, mask)
    metrics = LossMetrics(
        pg_loss=pg_loss,
        kl=_masked_mean(kl_tok, mask),
        entropy=_masked_mean(ent_tok, mask),
        clip_frac_low=_masked_mean(clip_low, mask),
        clip_frac_high=_masked_mean(clip_high, mask),
        clip_frac=_masked_mean(clip_low + clip_high, mask),
        clip_frac_dual=_masked_mean(dual, mask),
        approx_kl=_masked_mean(_k3(jax.lax.stop_gradient(logp - old_logp)), mask),
        ratio_mean=_masked_mean(ratio, mask),
        ratio_min=_masked_extreme(ratio, mask, largest=False),
        ratio_max=_masked_extreme(ratio, mask, largest=True),
        tis_weight_mean=_masked_mean(tis_w, mask),
        tis_weight_max=_masked_extreme(tis_w, mask, largest=True),
        tis_clipped_frac=tis_altered,
        mismatch_abs_mean=mismatch_mean,
        mismatch_abs_max=mismatch_max,
        mismatch_kl=mismatch_kl,
    )
    return loss, metrics


def value_loss(
    values: PerToken,
    old_values: PerToken,
    returns: PerToken,
    mask: PerToken,
    clip: float,
    aggregation: str = "token-mean",
) -> tuple[Scalar, ValueMetrics]:
    """PPO clipped value loss (Schulman et al. 2017, as in the OpenAI baselines ppo2 code):

    0.5 * max((v - R)^2, (clip(v, v_old - clip, v_old + clip) - R)^2), aggregated over the mask.

    The clipped value is v itself inside the band (clipped to the band's edges, not rebuilt as
    v_old + clip(v - v_old), which in f32 can miss v by an ulp), so ``clip_frac`` counts exactly
    the tokens whose v left the band and whose clipped error is the larger (verl's and TRL's
    ``vf_clipfrac``).
    """
    mask = _f32(mask)
    values, old_values, returns = (_on_mask(x, mask) for x in (values, old_values, returns))
    v_clipped = jnp.clip(values, old_values - clip, old_values + clip)  # [B, T]
    err = jnp.square(values - returns)  # [B, T]
    err_clipped = jnp.square(v_clipped - returns)  # [B, T]
    loss = aggregate(0.5 * jnp.maximum(err, err_clipped), mask, aggregation)
    metrics = ValueMetrics(
        value_loss=loss,
        clip_frac=_masked_mean((err_clipped > err).astype(jnp.float32), mask),
        value_mean=_masked_mean(values, mask),
    )
    return loss, metrics


def dpo_loss(
    policy_chosen_logp: Float[Array, " b"],
    policy_rejected_logp: Float[Array, " b"],
    ref_chosen_logp: Float[Array, " b"],
    ref_rejected_logp: Float[Array, " b"],
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[Scalar, DPOMetrics]:
    """DPO (Rafailov et al. 2023) on per-completion summed log-probs, with conservative-DPO label
    smoothing (Mitchell 2023): -(1 - eps) log sig(beta h) - eps log sig(-beta h),
    h = (log pi_c - log ref_c) - (log pi_r - log ref_r). eps = 0 is the paper's loss.
    """
    pc, pr, rc, rr = map(
        _f32, (policy_chosen_logp, policy_rejected_logp, ref_chosen_logp, ref_rejected_logp)
    )
    chosen_reward = beta * (pc - rc)  # [B]
    rejected_reward = beta * (pr - rr)  # [B]
    logits = chosen_reward - rejected_reward  # [B]
    losses = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(logits) - label_smoothing * (
        jax.nn.log_sigmoid(-logits)
    )
    metrics = DPOMetrics(
        reward_chosen=jnp.mean(chosen_reward),
        reward_rejected=jnp.mean(rejected_reward),
        reward_margin=jnp.mean(logits),
        reward_accuracy=jnp.mean((logits > 0).astype(jnp.float32)),
    )
    return jnp.mean(losses), metrics
