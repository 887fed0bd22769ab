"""Losses: hand-worked goldens per mode / aggregation, a TRL-formula reference, masking, jit."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlx.learner import losses as L

# Golden batch, B = 2 completions, T = 3 positions. old_logp = log 0.5 everywhere and
# logp = log(0.5 * ratio), so the token ratios pi / pi_old are exactly the numbers below.
#   row 0: A = +1, ratios [1.5, 1.0, 0.9], mask [1, 1, 1]
#   row 1: A = -2, ratios [0.5, 1.1, 7.0], mask [1, 1, 0]   (the 7.0 is padding, ignored)
# With eps_low = eps_high = 0.2 the clip range is [0.8, 1.2]; per token -min(r A, clip(r) A):
#   row 0: -min(1.5, 1.2) = -1.2 ; -min(1.0, 1.0) = -1.0 ; -min(0.9, 0.9) = -0.9   sum -3.1
#   row 1: -min(-1.0, -1.6) = 1.6 ; -min(-2.2, -2.2) = 2.2                          sum  3.8
RATIOS = np.array([[1.5, 1.0, 0.9], [0.5, 1.1, 7.0]])
OLD = np.full((2, 3), math.log(0.5))
LOGP = np.log(0.5 * RATIOS)
ADV = np.array([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
MASK = np.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def _loss(cfg, **kw):
    loss, metrics = L.policy_loss(LOGP, OLD, ADV, MASK, cfg, **kw)
    return float(loss), metrics


@pytest.mark.parametrize(
    "aggregation, norm_length, expected",
    [
        ("token-mean", None, (-3.1 + 3.8) / 5),  # 0.14: sum over 5 valid tokens
        ("seq-mean-token-sum", None, (-3.1 + 3.8) / 2),  # 0.35
        ("seq-mean-token-mean", None, (-3.1 / 3 + 3.8 / 2) / 2),  # (-1.0333 + 1.9) / 2
        ("seq-mean-token-sum-norm", None, 0.7 / (2 * 3)),  # constant B * T = 6
        ("seq-mean-token-sum-norm", 4, 0.7 / (2 * 4)),  # constant B * L = 8
    ],
)
def test_ppo_golden_every_aggregation(aggregation, norm_length, expected):
    cfg = L.LossConfig(policy_loss="ppo", aggregation=aggregation, norm_length=norm_length)
    loss, m = _loss(cfg)
    assert loss == pytest.approx(expected, abs=1e-6)
    assert float(m.pg_loss) == pytest.approx(expected, abs=1e-6)


def test_ppo_golden_metrics():
    _, m = _loss(L.LossConfig())
    # low clip active: row 1 token 0 (r 0.5 < 0.8, A < 0); high: row 0 token 0 (r 1.5 > 1.2, A > 0)
    assert float(m.clip_frac_low) == pytest.approx(1 / 5)
    assert float(m.clip_frac_high) == pytest.approx(1 / 5)
    # ratio mean over valid tokens = (1.5 + 1.0 + 0.9 + 0.5 + 1.1) / 5 = 1.0; min 0.5, max 1.5
    assert float(m.ratio_mean) == pytest.approx(1.0, abs=1e-6)
    assert float(m.ratio_min) == pytest.approx(0.5, abs=1e-6)
    assert float(m.ratio_max) == pytest.approx(1.5, abs=1e-6)
    assert float(m.tis_weight_mean) == 1.0 and float(m.tis_clipped_frac) == 0.0
    assert float(m.kl) == 0.0 and float(m.mismatch_abs_max) == 0.0


def test_clip_fractions_count_exactly_the_tokens_without_gradient():
    # ratios [1.5, 0.5, 1.5, 0.5] with A [+1, +1, -1, -1], clip range [0.8, 1.2]:
    #   1.5, A>0: clipped (high)      0.5, A>0: r A = 0.5 < 0.8 A, unclipped term wins -> gradient
    #   1.5, A<0: r A = -1.5 < -1.2, unclipped wins -> gradient      0.5, A<0: clipped (low)
    ratios = np.array([[1.5, 0.5, 1.5, 0.5]])
    old = np.full((1, 4), math.log(0.5))
    adv = np.array([[1.0, 1.0, -1.0, -1.0]])
    mask = np.ones((1, 4))
    cfg = L.LossConfig(aggregation="token-mean")
    fn = lambda lp: L.policy_loss(lp, old, adv, mask, cfg)  # noqa: E731
    logp = jnp.asarray(np.log(0.5 * ratios), jnp.float32)
    _, m = fn(logp)
    assert float(m.clip_frac_high) == pytest.approx(1 / 4)
    assert float(m.clip_frac_low) == pytest.approx(1 / 4)
    g = jax.grad(lambda lp: fn(lp)[0])(logp)
    # d/dlogp (-r A / 4) = -r A / 4 where unclipped: token 1: -0.5/4, token 2: +1.5/4
    np.testing.assert_allclose(g, [[0.0, -0.125, 0.375, 0.0]], atol=1e-7)


# Dual-clip batch, one row, clip range [0.8, 1.2], clip_ratio_c = 3 (bound -A * 3 = 3 for A = -1):
#   r 4.0, A -1: -min(-4.0, -1.2) = 4.0 > 3 -> bounded to 3 (dual clip, no gradient)
#   r 2.5, A -1: -min(-2.5, -1.2) = 2.5 <= 3 -> 2.5 (gradient d(-r A)/dlogp = 2.5)
#   r 0.5, A -1: -min(-0.5, -0.8) = 0.8 (low clip, no gradient)
#   r 4.0, A +1: -min(4.0, 1.2) = -1.2 (high clip; the dual clip never acts on A > 0)
# token-mean: (3 + 2.5 + 0.8 - 1.2) / 4 = 1.275; without dual clip (4 + 2.5 + 0.8 - 1.2) / 4 = 1.525
DUAL_RATIOS = np.array([[4.0, 2.5, 0.5, 4.0]])
DUAL_ADV = np.array([[-1.0, -1.0, -1.0, 1.0]])


def _dual(clip_ratio_c):
    cfg = L.LossConfig(aggregation="token-mean", clip_ratio_c=clip_ratio_c)
    old, mask = np.full((1, 4), math.log(0.5)), np.ones((1, 4))
    fn = lambda lp: L.policy_loss(lp, old, DUAL_ADV, mask, cfg)  # noqa: E731
    logp = jnp.asarray(np.log(0.5 * DUAL_RATIOS), jnp.float32)
    return fn(logp), jax.grad(lambda lp: fn(lp)[0])(logp)


def test_dual_clip_golden():
    (loss, m), g = _dual(3.0)
    assert float(loss) == pytest.approx(5.1 / 4, abs=1e-6)
    assert float(m.clip_frac_dual) == pytest.approx(1 / 4)  # only the r 4.0, A < 0 token
    assert float(m.clip_frac_low) == pytest.approx(1 / 4)
    assert float(m.clip_frac_high) == pytest.approx(1 / 4)
    # gradient / 4 tokens: only the r 2.5 token keeps one, -r A / 4 = 0.625
    np.testing.assert_allclose(g, [[0.0, 0.625, 0.0, 0.0]], atol=1e-6)
    (off, m_off), g_off = _dual(None)  # off (the default): the r 4.0 token keeps -r A / 4 = 1.0
    assert float(off) == pytest.approx(6.1 / 4, abs=1e-6)
    assert float(m_off.clip_frac_dual) == 0.0
    np.testing.assert_allclose(g_off, [[1.0, 0.625, 0.0, 0.0]], atol=1e-6)


def _verl_dual_clip(logp, old, adv, mask, eps_low, eps_high, c):
    """Numpy (float64) transcription of verl's documented dual-clip token loss (token-mean) and
    its pg_clipfrac_lower: for A < 0, min(-A c, max(-A r, -A clip(r)))."""
    ratio = np.exp(logp - old)
    clip1 = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - eps_low, 1 + eps_high))
    bound = -adv * c
    per_token = np.where(adv < 0, np.minimum(bound, clip1), clip1)
    lower = (clip1 > bound) & (adv < 0)
    return (per_token * mask).sum() / mask.sum(), (lower * mask).sum() / mask.sum()


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("c", [1.5, 3.0])
def test_dual_clip_matches_verl_formula(seed, c):
    rng = np.random.default_rng(seed)
    b, t = 4, 9
    old = rng.normal(-1.5, 0.5, (b, t)).astype(np.float32)
    logp = (old + rng.normal(0, 0.8, (b, t))).astype(np.float32)  # ratios well past c
    adv = np.broadcast_to(rng.normal(0, 1, (b, 1)), (b, t)).astype(np.float32)
    mask = (np.arange(t)[None] < rng.integers(1, t + 1, (b, 1))).astype(np.float32)
    cfg = L.LossConfig(aggregation="token-mean", clip_eps_high=0.28, clip_ratio_c=c)
    got, m = L.policy_loss(logp, old, adv, mask, cfg)
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    want, lower = _verl_dual_clip(*map(f64, (logp, old, adv, mask)), 0.2, 0.28, c)
    assert abs(float(got) - want) <= 1e-6
    assert float(m.clip_frac_dual) == pytest.approx(lower, abs=1e-7)


def test_default_aggregation_per_mode():
    assert L.LossConfig(policy_loss="ppo").resolved_aggregation == "seq-mean-token-mean"
    assert L.LossConfig(policy_loss="dapo").resolved_aggregation == "token-mean"
    assert L.LossConfig(policy_loss="dr_grpo").resolved_aggregation == "seq-mean-token-sum-norm"
    assert L.LossConfig(policy_loss="gspo").resolved_aggregation == "seq-mean-token-mean"


def test_dapo_golden_clip_higher():
    # eps_high = 0.28: row 0 token 0 becomes -min(1.5, 1.28) = -1.28 -> row 0 sum -3.18
    # token-mean (DAPO default): (-3.18 + 3.8) / 5 = 0.124
    loss, m = _loss(L.LossConfig(policy_loss="dapo", clip_eps_high=0.28))
    assert loss == pytest.approx(0.62 / 5, abs=1e-6)
    assert float(m.clip_frac_high) == pytest.approx(1 / 5)  # 1.5 > 1.28 still clipped


def test_dr_grpo_golden():
    # sum of all valid token losses 0.7, divided by (2 completions * generation budget 10)
    loss, _ = _loss(L.LossConfig(policy_loss="dr_grpo", norm_length=10))
    assert loss == pytest.approx(0.7 / 20, abs=1e-7)


def test_gspo_golden():
    # sequence ratio = geometric mean of the valid token ratios:
    #   s0 = (1.5 * 1.0 * 0.9) ** (1/3) = 1.35 ** (1/3) = 1.1052 (inside [0.8, 1.2]) -> -s0 * 1
    #   s1 = (0.5 * 1.1) ** (1/2) = 0.55 ** 0.5 = 0.7416 < 0.8, A < 0 -> -min(-1.483, -1.6) = 1.6
    # seq-mean-token-mean (default): per-completion (constant) token loss, averaged: (-s0 + 1.6) / 2
    s0, s1 = 1.35 ** (1 / 3), 0.55**0.5
    loss, m = _loss(L.LossConfig(policy_loss="gspo"))
    assert loss == pytest.approx((-s0 + 1.6) / 2, abs=1e-6)
    # ratio stats are over tokens with the sequence ratio broadcast: (3 s0 + 2 s1) / 5
    assert float(m.ratio_mean) == pytest.approx((3 * s0 + 2 * s1) / 5, abs=1e-6)
    assert float(m.clip_frac_low) == pytest.approx(2 / 5)  # both tokens of row 1


def test_gspo_gradient_equals_sequence_level_objective():
    """GSPO-token with per-sequence advantages has GSPO's gradient (Zheng et al. 2025, eq. 12)."""
    rng = np.random.default_rng(3)
    logp = jnp.asarray(rng.normal(-1, 0.1, (4, 6)), jnp.float32)
    old = logp + jnp.asarray(rng.normal(0, 0.1, (4, 6)), jnp.float32)
    mask = jnp.asarray(np.arange(6)[None] < np.array([[6], [3], [1], [5]]), jnp.float32)
    a_seq = jnp.asarray([1.0, -0.5, 2.0, -1.0])
    cfg = L.LossConfig(policy_loss="gspo", clip_eps_low=0.05, clip_eps_high=0.05)

    def sequence_level(lp):
        s = jnp.exp(jnp.sum((lp - old) * mask, -1) / jnp.sum(mask, -1))  # [B]
        return jnp.mean(-jnp.minimum(s * a_seq, jnp.clip(s, 0.95, 1.05) * a_seq))

    a_tok = jnp.broadcast_to(a_seq[:, None], (4, 6))
    token_level = lambda lp: L.policy_loss(lp, old, a_tok, mask, cfg)[0]  # noqa: E731
    np.testing.assert_allclose(token_level(logp), sequence_level(logp), rtol=1e-6)
    np.testing.assert_allclose(
        jax.grad(token_level)(logp), jax.grad(sequence_level)(logp), atol=1e-6
    )


def test_kl_estimators_golden():
    # d = logp - ref = [ln 2, -ln 2, 0]
    # k1 = d ; k2 = d^2 / 2 ; k3 = exp(-d) + d - 1 = [0.5 + ln2 - 1, 2 - ln2 - 1, 0]
    ln2 = math.log(2)
    logp, ref = jnp.array([[ln2, -ln2, 0.0]]), jnp.zeros((1, 3))
    np.testing.assert_allclose(L.kl_penalty(logp, ref, "k1"), [[ln2, -ln2, 0.0]], atol=1e-7)
    half_sq = ln2**2 / 2
    np.testing.assert_allclose(L.kl_penalty(logp, ref, "k2"), [[half_sq, half_sq, 0]], atol=1e-7)
    np.testing.assert_allclose(L.kl_penalty(logp, ref, "k3"), [[ln2 - 0.5, 1 - ln2, 0]], atol=1e-7)


def test_kl_as_loss_and_as_reward_penalty():
    # ref = logp - ln 2 on every token => d = ln 2, k3 = ln2 - 0.5 everywhere, k1 = ln 2.
    # As a loss term with coef 0.1 and token-mean: 0.14 + 0.1 * (ln2 - 0.5)
    ln2 = math.log(2)
    ref = LOGP - ln2
    cfg = L.LossConfig(aggregation="token-mean", kl_coef=0.1)
    loss, m = _loss(cfg, ref_logp=ref)
    assert loss == pytest.approx(0.14 + 0.1 * (ln2 - 0.5), abs=1e-6)
    assert float(m.kl) == pytest.approx(ln2 - 0.5, abs=1e-6)
    cfg_k1 = L.LossConfig(aggregation="token-mean", kl_coef=0.1, kl_estimator="k1")
    loss_k1, _ = _loss(cfg_k1, ref_logp=ref)
    assert loss_k1 == pytest.approx(0.14 + 0.1 * ln2, abs=1e-6)
    # As a reward penalty the loss is the bare surrogate; the KL is only reported.
    cfg_rp = L.LossConfig(aggregation="token-mean", kl_coef=0.1, kl_as="reward-penalty")
    loss_rp, m_rp = _loss(cfg_rp, ref_logp=ref)
    assert loss_rp == pytest.approx(0.14, abs=1e-6)
    assert float(m_rp.kl) == pytest.approx(ln2 - 0.5, abs=1e-6)


def test_entropy_bonus_golden():
    # entropy 2.0 on valid tokens (padding 50.0 is ignored): loss = 0.14 - 0.01 * 2.0 = 0.12
    ent = np.where(MASK > 0, 2.0, 50.0)
    loss, m = _loss(L.LossConfig(aggregation="token-mean", entropy_coef=0.01), entropy=ent)
    assert loss == pytest.approx(0.12, abs=1e-6)
    assert float(m.entropy) == pytest.approx(2.0)


def test_tis_token_golden():
    # sampler_logp = old - log w_raw  =>  pi_old / pi_sampler = w_raw, capped at 2:
    #   row 0: w_raw [3.0, 1.0, 0.5] -> [2.0, 1.0, 0.5]
    #   row 1: w_raw [1.0, 4.0, 9.0(pad)] -> [1.0, 2.0, -]
    # weighted token losses: row 0: -1.2*2 - 1.0*1 - 0.9*0.5 = -3.85 ; row 1: 1.6*1 + 2.2*2 = 6.0
    # token-mean: (-3.85 + 6.0) / 5 = 0.43
    w_raw = np.array([[3.0, 1.0, 0.5], [1.0, 4.0, 9.0]])
    cfg = L.LossConfig(aggregation="token-mean", tis_mode="token", tis_cap=2.0)
    loss, m = _loss(cfg, sampler_logp=OLD - np.log(w_raw))
    assert loss == pytest.approx(2.15 / 5, abs=1e-6)
    assert float(m.tis_weight_mean) == pytest.approx((2 + 1 + 0.5 + 1 + 2) / 5, abs=1e-6)
    assert float(m.tis_weight_max) == pytest.approx(2.0)
    assert float(m.tis_clipped_frac) == pytest.approx(2 / 5)  # 3.0 and 4.0 truncated
    # mismatch |log w_raw| = [ln3, 0, ln2, 0, ln4]: mean (ln3 + ln2 + ln4) / 5, max ln4
    assert float(m.mismatch_abs_mean) == pytest.approx(math.log(24) / 5, abs=1e-6)
    assert float(m.mismatch_abs_max) == pytest.approx(math.log(4), abs=1e-6)
    # k3 KL(sampler || old) per token = w - ln w - 1: [2 - ln3, 0, ln2 - 0.5, 0, 3 - ln4]
    k3 = (2 - math.log(3)) + (math.log(2) - 0.5) + (3 - math.log(4))
    assert float(m.mismatch_kl) == pytest.approx(k3 / 5, abs=1e-6)
    # "off" ignores the sampler for the loss but still measures the mismatch
    cfg_off = L.LossConfig(aggregation="token-mean", tis_mode="off")
    loss_off, m_off = _loss(cfg_off, sampler_logp=OLD - np.log(w_raw))
    assert loss_off == pytest.approx(0.14, abs=1e-6)
    assert float(m_off.mismatch_abs_max) == pytest.approx(math.log(4), abs=1e-6)


def test_tis_sequence_mask_golden():
    # row 0: pi_old / pi_sampler = 3 on every token -> geometric mean 3 > 2 -> dropped
    # row 1: ratio 1 -> kept. token-mean keeps its denominator 5: (0 + 3.8) / 5 = 0.76
    sampler = OLD - np.log(np.array([[3.0, 3.0, 3.0], [1.0, 1.0, 100.0]]))
    cfg = L.LossConfig(aggregation="token-mean", tis_mode="sequence-mask", tis_seq_high=2.0)
    loss, m = _loss(cfg, sampler_logp=sampler)
    assert loss == pytest.approx(3.8 / 5, abs=1e-6)
    assert float(m.tis_clipped_frac) == pytest.approx(3 / 5)
    assert float(m.tis_weight_mean) == pytest.approx(2 / 5)


def test_on_policy_gradient_golden():
    # At logp == old (r = 1, no clipping), d/dlogp of token-mean -r A = -A / N on valid tokens.
    cfg = L.LossConfig(aggregation="token-mean")
    at_old = jnp.asarray(OLD, jnp.float32)
    g = jax.grad(lambda lp: L.policy_loss(lp, OLD, ADV, MASK, cfg)[0])(at_old)
    np.testing.assert_allclose(g, -ADV * MASK / 5, atol=1e-7)


def test_padding_garbage_does_not_leak():
    lp = np.where(MASK > 0, LOGP, np.nan)
    ref = np.where(MASK > 0, LOGP - 0.1, np.inf)
    cfg = L.LossConfig(kl_coef=0.1)
    clean, _ = L.policy_loss(LOGP, OLD, ADV, MASK, cfg, ref_logp=LOGP - 0.1)
    dirty_fn = lambda x: L.policy_loss(x, OLD, ADV, MASK, cfg, ref_logp=ref)[0]
    assert float(dirty_fn(jnp.asarray(lp, jnp.float32))) == pytest.approx(float(clean), abs=1e-6)
    g = jax.grad(dirty_fn)(jnp.asarray(lp, jnp.float32))
    assert np.all(np.isfinite(g)) and float(g[1, 2]) == 0.0


def test_jit_matches_eager_and_metrics_are_a_pytree():
    cfg = L.LossConfig(policy_loss="dapo", kl_coef=0.05, entropy_coef=0.01)
    kw = dict(ref_logp=LOGP - 0.2, sampler_logp=OLD + 0.05, entropy=np.ones((2, 3)))
    eager = L.policy_loss(LOGP, OLD, ADV, MASK, cfg, **kw)
    jitted = jax.jit(L.policy_loss, static_argnames="cfg")(LOGP, OLD, ADV, MASK, cfg=cfg, **kw)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert len(jax.tree.leaves(eager[1])) == len(L.LossMetrics._fields)


def test_bf16_inputs_computed_in_f32():
    bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (LOGP, OLD, ADV, MASK)]
    loss, m = L.policy_loss(*bf16, L.LossConfig())
    assert loss.dtype == jnp.float32 and m.ratio_mean.dtype == jnp.float32


def test_config_validation():
    with pytest.raises(ValueError, match=r"policy_loss='grpo2' is not one of \['ppo', 'dapo', 'dr_grpo', 'gspo'\]"):
        L.LossConfig(policy_loss="grpo2")
    with pytest.raises(ValueError, match="aggregation"):
        L.LossConfig(aggregation="sum")
    with pytest.raises(ValueError, match="kl_estimator"):
        L.LossConfig(kl_estimator="k4")
    with pytest.raises(ValueError, match="tis_seq_low"):
        L.LossConfig(tis_seq_low=3.0, tis_seq_high=2.0)
    for c in (1.0, 0.5, float("nan")):  # dual clip needs c > 1; None (the default) is off
        with pytest.raises(ValueError, match=r"clip_ratio_c=.* must be > 1 .*None turns"):
            L.LossConfig(clip_ratio_c=c)
    assert L.LossConfig().clip_ratio_c is None and L.LossConfig(clip_ratio_c=3.0).clip_ratio_c == 3
    with pytest.raises(ValueError, match="needs ref_logp"):
        L.policy_loss(LOGP, OLD, ADV, MASK, L.LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy"):
        L.policy_loss(LOGP, OLD, ADV, MASK, L.LossConfig(entropy_coef=0.1))


# ------------------------------------------------ independent reference: TRL GRPOTrainer formula


def _trl_formula(logp, old, ref, adv_seq, mask, eps_low, eps_high, beta, loss_type, max_len):
    """Numpy (float64) transcription of the documented GRPOTrainer loss."""
    ratio = np.exp(logp - old)
    a = adv_seq[:, None]
    per_token = -np.minimum(ratio * a, np.clip(ratio, 1 - eps_low, 1 + eps_high) * a)
    if beta != 0.0:
        per_token = per_token + beta * (np.exp(ref - logp) - (ref - logp) - 1)
    if loss_type == "grpo":
        return np.mean((per_token * mask).sum(-1) / np.maximum(mask.sum(-1), 1.0))
    if loss_type in ("dapo", "bnpo"):
        return (per_token * mask).sum() / max(mask.sum(), 1.0)
    assert loss_type == "dr_grpo"
    return (per_token * mask).sum() / (logp.shape[0] * max_len)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    loss_type=st.sampled_from(["grpo", "dapo", "dr_grpo"]),
    eps=st.sampled_from([(0.2, 0.2), (0.2, 0.28), (0.1, 0.3)]),
    beta=st.sampled_from([0.0, 0.04, 0.5]),
)
def test_matches_trl_grpo_formula(seed, loss_type, eps, beta):
    rng = np.random.default_rng(seed)
    b, t, max_len = 4, 9, 12
    old = rng.normal(-1.5, 0.5, (b, t)).astype(np.float32)
    logp = (old + rng.normal(0, 0.3, (b, t))).astype(np.float32)
    ref = (logp + rng.normal(0, 0.2, (b, t))).astype(np.float32)
    adv_seq = rng.normal(0, 1, b).astype(np.float32)
    lengths = rng.integers(1, t + 1, b)
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
    mode = {"grpo": "ppo", "dapo": "dapo", "dr_grpo": "dr_grpo"}[loss_type]
    cfg = L.LossConfig(
        policy_loss=mode, clip_eps_low=eps[0], clip_eps_high=eps[1], kl_coef=beta,
        kl_estimator="k3", norm_length=max_len,
    )
    adv_tok = np.broadcast_to(adv_seq[:, None], (b, t))
    got, _ = L.policy_loss(logp, old, adv_tok, mask, cfg, ref_logp=ref)
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    arrays = [f64(x) for x in (logp, old, ref, adv_seq, mask)]
    want = _trl_formula(*arrays, *eps, beta, loss_type, max_len)
    assert abs(float(got) - want) <= 1e-6


# ------------------------------------------------------------------------ value and DPO


def test_value_loss_golden():
    # values [1.0, 2.0, 9(pad)], old [0.5, 2.0, 0], returns [2.0, 1.0, 0], clip 0.2
    # token 0: (1 - 2)^2 = 1 ; clipped v = 0.5 + 0.2 = 0.7 -> (0.7 - 2)^2 = 1.69 ; max 1.69
    # token 1: (2 - 1)^2 = 1 ; clipped v = 2.0 (no move) -> 1 ; max 1
    # loss = 0.5 * (1.69 + 1) / 2 = 0.6725 ; clipped term larger on 1 of 2 tokens
    loss, m = L.value_loss(
        jnp.array([[1.0, 2.0, 9.0]]), jnp.array([[0.5, 2.0, 0.0]]), jnp.array([[2.0, 1.0, 0.0]]),
        jnp.array([[1.0, 1.0, 0.0]]), clip=0.2,
    )
    assert float(loss) == pytest.approx(0.6725, abs=1e-6)
    assert float(m.clip_frac) == pytest.approx(0.5)
    assert float(m.value_mean) == pytest.approx(1.5)


def test_value_clip_frac_counts_exactly_the_clipped_tokens():
    # clip 0.2, three tokens (values, old, returns):
    # token 0: v -0.04, old -0.2, R -0.04: |v - old| = 0.16 < 0.2, v stays itself: errors 0 and 0.
    #   (In f32, old + (v - old) is -0.04 - 7.45e-9, whose error 5.6e-17 > 0 counted it clipped.)
    # token 1: v 1.0, old 0.5, R 2.0: clipped to 0.7, error 1.69 > 1 -> counted (the clip acts)
    # token 2: v 1.0, old 0.5, R 0.0: clipped to 0.7, error 0.49 < 1 -> not counted (the
    #   unclipped error is the larger: verl's and TRL's vf_clipfrac count it neither)
    # loss = 0.5 * (0 + 1.69 + 1) / 3 = 0.448333 ; clip_frac 1 / 3
    values, old, returns = (jnp.array([x], jnp.float32) for x in (
        [-0.04, 1.0, 1.0], [-0.2, 0.5, 0.5], [-0.04, 2.0, 0.0]))
    loss, m = L.value_loss(values, old, returns, jnp.ones((1, 3)), clip=0.2)
    assert float(loss) == pytest.approx(0.5 * 2.69 / 3, abs=1e-6)
    assert float(m.clip_frac) == pytest.approx(1 / 3)
    _, alone = L.value_loss(values[:, :1], old[:, :1], returns[:, :1], jnp.ones((1, 1)), clip=0.2)
    assert float(alone.clip_frac) == 0.0


def test_dpo_loss_golden():
    # beta 0.1: chosen reward 0.1 * (-10 - -12) = 0.2 ; rejected 0.1 * (-15 - -14) = -0.1
    # h = 0.3 ; loss = -log sigmoid(0.3) = log(1 + e^-0.3) = 0.5543552
    # label smoothing 0.1: 0.9 * log(1 + e^-0.3) + 0.1 * log(1 + e^0.3)
    args = [jnp.array([x]) for x in (-10.0, -15.0, -12.0, -14.0)]
    loss, m = L.dpo_loss(*args, beta=0.1)
    assert float(loss) == pytest.approx(math.log1p(math.exp(-0.3)), abs=1e-6)
    assert float(m.reward_chosen) == pytest.approx(0.2, abs=1e-6)
    assert float(m.reward_rejected) == pytest.approx(-0.1, abs=1e-6)
    assert float(m.reward_margin) == pytest.approx(0.3, abs=1e-6)
    assert float(m.reward_accuracy) == 1.0
    loss_ls, _ = L.dpo_loss(*args, beta=0.1, label_smoothing=0.1)
    want = 0.9 * math.log1p(math.exp(-0.3)) + 0.1 * math.log1p(math.exp(0.3))
    assert float(loss_ls) == pytest.approx(want, abs=1e-6)
