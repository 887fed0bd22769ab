"""Advantage estimators: hand-worked goldens, a GAE loop reference, grouping by uid, validation."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlx.learner import advantages as adv

# Two prompts, three completions each, interleaved on purpose (groups are by uid, not position):
#   position: 0    1    2    3    4    5
#   uid:      a    b    a    b    a    b
#   reward:   1    2    0    4    2    0
# group a = {1, 0, 2}: mean 1, sum sq dev = 0 + 1 + 1 = 2
# group b = {2, 4, 0}: mean 2, sum sq dev = 0 + 4 + 4 = 8
UIDS = ["a", "b", "a", "b", "a", "b"]
REWARDS = np.array([1.0, 2.0, 0.0, 4.0, 2.0, 0.0])


def test_dr_grpo_golden():
    # r - group mean: a: 1-1=0, 0-1=-1, 2-1=1 ; b: 2-2=0, 4-2=2, 0-2=-2
    expected = [0.0, 0.0, -1.0, 2.0, 1.0, -2.0]
    np.testing.assert_allclose(adv.dr_grpo(REWARDS, UIDS), expected, atol=1e-7)


def test_grpo_golden_unbiased_std():
    # ddof=1: std_a = sqrt(2 / 2) = 1, std_b = sqrt(8 / 2) = 2
    # (r - mean) / std: a: 0/1, -1/1, 1/1 ; b: 0/2, 2/2, -2/2
    expected = [0.0, 0.0, -1.0, 1.0, 1.0, -1.0]
    out = adv.grpo(REWARDS, UIDS, eps=0.0)
    np.testing.assert_allclose(out, expected, atol=1e-7)
    assert out.dtype == np.float32


def test_grpo_golden_population_std_and_eps():
    # ddof=0: std_a = sqrt(2/3), std_b = sqrt(8/3); eps = 0.1 is added to the std
    sa, sb = math.sqrt(2 / 3) + 0.1, math.sqrt(8 / 3) + 0.1
    expected = [0.0, 0.0, -1 / sa, 2 / sb, 1 / sa, -2 / sb]
    out = adv.grpo(REWARDS, UIDS, eps=0.1, std_ddof=0)
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_grpo_without_std_equals_dr_grpo():
    np.testing.assert_array_equal(
        adv.grpo(REWARDS, UIDS, normalize_std=False), adv.dr_grpo(REWARDS, UIDS)
    )


def test_rloo_golden():
    # leave-one-out mean of the other two in the group:
    # a: r=1 -> (0+2)/2=1 -> 0 ; r=0 -> (1+2)/2=1.5 -> -1.5 ; r=2 -> (1+0)/2=0.5 -> 1.5
    # b: r=2 -> (4+0)/2=2 -> 0 ; r=4 -> (2+0)/2=1 -> 3    ; r=0 -> (2+4)/2=3 -> -3
    expected = [0.0, 0.0, -1.5, 3.0, 1.5, -3.0]
    np.testing.assert_allclose(adv.rloo(REWARDS, UIDS), expected, atol=1e-7)


def test_reinforce_pp_group_baseline_golden():
    # centred by group mean = [0, 0, -1, 2, 1, -2]; batch mean 0;
    # population var = (0 + 0 + 1 + 4 + 1 + 4) / 6 = 5/3 -> std sqrt(5/3)
    s = math.sqrt(5 / 3)
    expected = [0.0, 0.0, -1 / s, 2 / s, 1 / s, -2 / s]
    out = adv.reinforce_pp(REWARDS, UIDS, baseline="group", eps=0.0)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-7)


def test_reinforce_pp_batch_baseline_golden():
    # batch mean = 9/6 = 1.5; deviations [-0.5, 0.5, -1.5, 2.5, 0.5, -1.5]
    # var = (0.25 + 0.25 + 2.25 + 6.25 + 0.25 + 2.25) / 6 = 11.5 / 6 = 23/12
    s = math.sqrt(23 / 12)
    expected = np.array([-0.5, 0.5, -1.5, 2.5, 0.5, -1.5]) / s
    out = adv.reinforce_pp(REWARDS, UIDS, baseline="batch", eps=0.0)
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_unequal_groups_and_singleton():
    # uid 7 = {1, 3}: mean 2 -> dr_grpo [-1, 1]; ddof=1 std = sqrt((1 + 1) / 1) = sqrt(2)
    # uid 9 = {5} alone: no relative signal -> 0 for grpo, dr_grpo and rloo
    rewards, uids = [1.0, 5.0, 3.0], [7, 9, 7]
    np.testing.assert_allclose(adv.dr_grpo(rewards, uids), [-1.0, 0.0, 1.0], atol=1e-7)
    r2 = math.sqrt(2)
    np.testing.assert_allclose(adv.grpo(rewards, uids, eps=0.0), [-1 / r2, 0.0, 1 / r2], rtol=1e-6)
    # rloo: 1 - 3 = -2 ; 3 - 1 = 2
    np.testing.assert_allclose(adv.rloo(rewards, uids), [-2.0, 0.0, 2.0], atol=1e-7)


def test_identical_rewards_give_zero_grpo_advantage():
    out = adv.grpo([1.0, 1.0, 1.0, 0.0, 0.0], ["x", "x", "x", "y", "y"])
    np.testing.assert_array_equal(out, np.zeros(5, np.float32))


@settings(max_examples=40, deadline=None)
@given(
    rewards=st.lists(st.floats(-10, 10), min_size=1, max_size=20),
    data=st.data(),
    name=st.sampled_from(sorted(adv.ESTIMATORS)),
)
def test_permutation_equivariance(rewards, data, name):
    """Shuffling completions (with their uids) shuffles the advantages the same way."""
    n = len(rewards)
    uids = data.draw(st.lists(st.sampled_from("pqrs"), min_size=n, max_size=n))
    perm = np.array(data.draw(st.permutations(range(n))))
    r = np.array(rewards)
    base = adv.compute_advantages(name, r, uids)
    shuffled = adv.compute_advantages(name, r[perm], [uids[i] for i in perm])
    np.testing.assert_allclose(shuffled, base[perm], rtol=1e-5, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(rewards=st.lists(st.floats(-10, 10), min_size=2, max_size=12), data=st.data())
def test_group_mean_baselines_sum_to_zero(rewards, data):
    """dr_grpo and rloo advantages sum to 0 within each group of size >= 2."""
    uids = data.draw(st.lists(st.sampled_from("ab"), min_size=len(rewards), max_size=len(rewards)))
    uids_arr = np.array(uids)
    for fn in (adv.dr_grpo, adv.rloo):
        out = fn(rewards, uids)
        for u in set(uids):
            if np.sum(uids_arr == u) > 1:
                assert abs(out[uids_arr == u].sum()) < 1e-4


def test_registry_matches_functions():
    np.testing.assert_array_equal(
        adv.compute_advantages("grpo", REWARDS, UIDS, eps=0.0), adv.grpo(REWARDS, UIDS, eps=0.0)
    )
    np.testing.assert_array_equal(
        adv.compute_advantages("rloo", REWARDS, UIDS), adv.rloo(REWARDS, UIDS)
    )


def test_unknown_estimator_lists_known_names():
    with pytest.raises(ValueError) as err:
        adv.compute_advantages("ppo2", REWARDS, UIDS)
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "ppo2"):
        assert name in str(err.value)


def test_length_mismatch_names_inputs():
    with pytest.raises(ValueError, match=r"uids.*5 uids for 6 rewards"):
        adv.grpo(REWARDS, UIDS[:5])


def test_nan_reward_names_index():
    bad = REWARDS.copy()
    bad[3] = np.nan
    with pytest.raises(ValueError, match=r"reward\[3\] = nan"):
        adv.compute_advantages("rloo", bad, UIDS)


def test_bad_reward_shape_and_baseline():
    with pytest.raises(ValueError, match="1-D"):
        adv.grpo(np.zeros((2, 3)), ["a", "b"])
    with pytest.raises(ValueError, match="baseline"):
        adv.reinforce_pp(REWARDS, UIDS, baseline="critic")


# ---------------------------------------------------------------- GAE


def test_gae_golden_with_bootstrap_and_masked_middle():
    # One row, T = 3, the middle token masked (e.g. a tool observation), gamma = 0.9, lam = 0.5.
    # rewards [0, 99, 1] (the 99 is masked, ignored), values [0.5, 42, 0.7] + bootstrap 0.2.
    # t=2: delta = 1 + 0.9*0.2 - 0.7 = 0.48            A2 = 0.48
    # t=1: masked -> A1 = 0, the recursion carries over it
    # t=0: delta = 0 + 0.9*0.7 - 0.5 = 0.13;  A0 = 0.13 + 0.9*0.5*0.48 = 0.346
    # returns = A + V on unmasked: [0.846, 0, 1.18]
    a, ret = adv.gae(
        np.array([[0.0, 99.0, 1.0]]),
        np.array([[0.5, 42.0, 0.7, 0.2]]),
        np.array([[1, 0, 1]]),
        gamma=0.9,
        lam=0.5,
    )
    np.testing.assert_allclose(a, [[0.346, 0.0, 0.48]], rtol=1e-6)
    np.testing.assert_allclose(ret, [[0.846, 0.0, 1.18]], rtol=1e-6)


def test_gae_terminal_values_t_columns():
    # values with T columns => bootstrap 0. gamma = lam = 1, rewards [0, 1], values [0.25, 0.5]:
    # t=1: delta = 1 + 0 - 0.5 = 0.5; t=0: delta = 0 + 0.5 - 0.25 = 0.25, A0 = 0.25 + 0.5 = 0.75
    a, ret = adv.gae(np.array([[0.0, 1.0]]), np.array([[0.25, 0.5]]), np.ones((1, 2)))
    np.testing.assert_allclose(a, [[0.75, 0.5]], rtol=1e-6)
    np.testing.assert_allclose(ret, [[1.0, 1.0]], rtol=1e-6)  # Monte-Carlo return


def _gae_loop_reference(rewards, values, mask, gamma, lam):
    """Row by row over the list of unmasked positions, in plain Python."""
    b, t = rewards.shape
    out = np.zeros((b, t))
    for row in range(b):
        idx = [i for i in range(t) if mask[row, i]]
        last_v = values[row, t] if values.shape[1] == t + 1 else 0.0
        running = 0.0
        for k in reversed(range(len(idx))):
            i = idx[k]
            v_next = values[row, idx[k + 1]] if k + 1 < len(idx) else last_v
            delta = rewards[row, i] + gamma * v_next - values[row, i]
            running = delta + gamma * lam * running
            out[row, i] = running
    return out


@pytest.mark.parametrize("bootstrap", [True, False])
def test_gae_matches_loop_reference_random_mask(bootstrap):
    rng = np.random.default_rng(0)
    b, t = 5, 13
    rewards = rng.normal(size=(b, t))
    values = rng.normal(size=(b, t + 1 if bootstrap else t))
    mask = rng.random((b, t)) < 0.7
    mask[0] = False  # an empty row
    got, ret = adv.gae(rewards, values, mask, gamma=0.97, lam=0.9)
    ref = _gae_loop_reference(rewards, values, mask, 0.97, 0.9)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ret, np.where(mask, ref + values[:, :t], 0.0), rtol=1e-5, atol=1e-6)


def test_gae_full_mask_matches_closed_form():
    # A_t = sum_l (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t
    rng = np.random.default_rng(1)
    r, v = rng.normal(size=(2, 6)), rng.normal(size=(2, 7))
    gamma, lam = 0.95, 0.8
    delta = r + gamma * v[:, 1:] - v[:, :-1]
    closed = np.stack(
        [sum((gamma * lam) ** (k - s) * delta[:, k] for k in range(s, 6)) for s in range(6)], 1
    )
    got, _ = adv.gae(r, v, np.ones((2, 6)), gamma, lam)
    np.testing.assert_allclose(got, closed, rtol=1e-5, atol=1e-6)


def test_gae_validation():
    with pytest.raises(ValueError, match="values"):
        adv.gae(np.zeros((2, 3)), np.zeros((2, 5)), np.ones((2, 3)))
    with pytest.raises(ValueError, match="mask"):
        adv.gae(np.zeros((2, 3)), np.zeros((2, 3)), np.ones((2, 4)))
