"""Advantage estimators, on the host in numpy.

Outcome-reward estimators take one scalar reward per completion and the uid of the prompt it
answers; groups are formed by uid, never by position, so completions may arrive in any order and
groups may have different sizes. Each returns one float32 advantage per completion (computed in
float64; the learner broadcasts it over the completion's tokens).

* `grpo` - GRPO (Shao et al. 2024, DeepSeekMath, "outcome supervision"): A_i = (r_i - mean_g) /
  (std_g + eps). Departure: the std uses `std_ddof=1` (unbiased) by default, the convention of the
  common open-source trainers; the paper does not say. `normalize_std=False` gives mean-only.
* `dr_grpo` - Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): A_i = r_i - mean_g,
  no std division. (Its other half, the constant length normaliser, lives in the loss.)
* `rloo` - RLOO (Ahmadian et al. 2024, "Back to Basics"): A_i = r_i - mean_{j != i, j in g} r_j,
  which equals n/(n-1) * (r_i - mean_g).
* `reinforce_pp` - REINFORCE++ (Hu 2025). `baseline="group"` is the paper's "REINFORCE++-baseline"
  variant for several samples per prompt: subtract the group mean, then whiten over the whole batch
  (A - mean_batch) / (std_batch + eps). `baseline="batch"` is plain REINFORCE++ on outcome rewards:
  whiten the raw rewards over the batch. Departure: the per-token KL penalty that the paper folds
  into the return is not added here; use `LossConfig(kl_as="reward-penalty")` upstream of this.

Conventions where verl 0.9.1's `core_algos` differs (for the loss side, k3 left unclamped and
dual clip off by default, see `rlx.learner.losses`):

* Whitening (REINFORCE++) is per completion: each completion counts once in the batch mean and
  std. verl whitens the advantage broadcast over the tokens (`masked_whiten`), so a completion
  weighs by its length; with equal lengths the two agree up to the std convention below.
* Population vs sample std: REINFORCE++'s and GAE's whitening use the population std (ddof=0);
  verl's `masked_whiten` Bessel-corrects (n / (n - 1) over the tokens). GRPO's group std is the
  sample std (`std_ddof=1`), as verl's `torch.std`; `std_ddof=0` gives the population one.
* Singleton groups: a group of one completion carries no relative signal, so its advantage is 0
  for grpo, dr_grpo and rloo (RLOO's leave-one-out mean is undefined there; the paper assumes
  k >= 2), and its group-centred reward is 0 before REINFORCE++-baseline's whitening. verl keeps
  a singleton's raw reward instead (group mean 0 and, for GRPO, std 1).

`gae` is Generalized Advantage Estimation (Schulman et al. 2016) for PPO with a critic, per token.
Masked positions (padding, or tool/environment tokens inside a multi-turn completion) are skipped:
they get advantage 0 and the recursion carries over them as if they were absent. `gae_advantages`
is what a run with `train.advantage="gae"` calls: the outcome reward lands on each completion's
last loss token (`token_rewards`), a completion's end is terminal (bootstrap 0, also when it was
cut at the length cap, as in verl and TRL's PPO), and the advantages are whitened over the batch's
loss tokens (PPO's usual normalisation; the paper's GAE has none).

KL in the reward (`LossConfig(kl_as="reward-penalty")`, verl's `use_kl_in_reward`, TRL's PPO):
`token_rewards` subtracts `kl_coef * KL_t` from every loss token's reward before GAE; for the
outcome estimators `sequence_rewards` subtracts `kl_coef * sum_t KL_t` from each completion's
reward before the group statistics.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
from jaxtyping import Float, Shaped

Rewards = Float[np.ndarray, " n"]
Uids = Shaped[np.ndarray, " n"] | Sequence


def _validate(rewards: np.ndarray, uids) -> tuple[np.ndarray, np.ndarray]:
    """Float64 rewards [n] and an int group id per completion [n] (first-seen order)."""
    rewards = np.asarray(rewards)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [n], got shape {rewards.shape}")
    if not np.issubdtype(rewards.dtype, np.number) and rewards.dtype != np.bool_:
        raise ValueError(f"rewards must be numeric, got dtype {rewards.dtype}")
    rewards = rewards.astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(rewards))
    if bad.size:
        raise ValueError(
            f"rewards must be finite; reward[{bad[0]}] = {rewards[bad[0]]} "
            f"({bad.size} non-finite in total)"
        )
    uid_list = list(uids)
    if len(uid_list) != rewards.shape[0]:
        raise ValueError(
            f"uids and rewards must have the same length; got {len(uid_list)} uids "
            f"for {rewards.shape[0]} rewards"
        )
    first_seen: dict = {}
    group = np.array([first_seen.setdefault(u, len(first_seen)) for u in uid_list], np.int64)
    return rewards, group


def _group_stats(
    rewards: np.ndarray, group: np.ndarray, ddof: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-completion group size, group mean and group std (with `ddof`), each [n]."""
    n_groups = int(group.max()) + 1 if group.size else 0
    count = np.bincount(group, minlength=n_groups).astype(np.float64)  # [G]
    mean = np.bincount(group, weights=rewards, minlength=n_groups) / np.maximum(count, 1)  # [G]
    sq_dev = (rewards - mean[group]) ** 2  # [n]
    dof = np.maximum(count - ddof, 1)  # [G]
    std = np.sqrt(np.bincount(group, weights=sq_dev, minlength=n_groups) / dof)  # [G]
    return count[group], mean[group], std[group]


def grpo(
    rewards: Rewards, uids: Uids, normalize_std: bool = True, eps: float = 1e-6, std_ddof: int = 1
) -> Rewards:
    """GRPO: (r - group mean) / (group std + eps), or r - group mean when `normalize_std=False`."""
    rewards, group = _validate(rewards, uids)
    count, mean, std = _group_stats(rewards, group, std_ddof)
    adv = np.where(count > 1, rewards - mean, 0.0)  # [n]
    if normalize_std:
        denom = np.where(count > 1, std + eps, 1.0)  # [n]
        adv = adv / np.where(denom > 0, denom, 1.0)  # a constant group with eps=0 stays 0
    return adv.astype(np.float32)


def dr_grpo(rewards: Rewards, uids: Uids) -> Rewards:
    """Dr. GRPO: r - group mean (no std normalisation)."""
    return grpo(rewards, uids, normalize_std=False)


def rloo(rewards: Rewards, uids: Uids) -> Rewards:
    """RLOO: r_i minus the mean reward of the other completions of the same prompt."""
    rewards, group = _validate(rewards, uids)
    count, mean, _ = _group_stats(rewards, group, ddof=0)
    others = np.maximum(count - 1, 1)
    loo_mean = (mean * count - rewards) / others  # [n]
    return np.where(count > 1, rewards - loo_mean, 0.0).astype(np.float32)


def reinforce_pp(
    rewards: Rewards, uids: Uids, baseline: str = "group", eps: float = 1e-6
) -> Rewards:
    """REINFORCE++: subtract the group mean ("group") or nothing ("batch"), then whiten over the
    batch's completions with the population std (per completion, not per token as verl)."""
    rewards, group = _validate(rewards, uids)
    if baseline == "group":
        _, mean, _ = _group_stats(rewards, group, ddof=0)
        centred = rewards - mean
    elif baseline == "batch":
        centred = rewards
    else:
        raise ValueError(f"baseline must be 'group' or 'batch', got {baseline!r}")
    if centred.size == 0:
        return centred.astype(np.float32)
    return ((centred - centred.mean()) / (centred.std() + eps)).astype(np.float32)


ESTIMATORS: dict[str, Callable[..., np.ndarray]] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
}
# per-token estimators: they need a critic's values (config.train.advantage also takes these)
TOKEN_ESTIMATORS = ("gae",)


def compute_advantages(name: str, rewards: Rewards, uids: Uids, **kw) -> Rewards:
    """Run the outcome-reward estimator `name` (see ESTIMATORS); kw go to the estimator.

    GAE needs per-token rewards and critic values and is called directly as `gae(...)`.
    """
    if name not in ESTIMATORS:
        hint = " (GAE takes values and a mask: call gae() directly)" if name == "gae" else ""
        raise ValueError(
            f"unknown advantage estimator {name!r}{hint}; known: {', '.join(sorted(ESTIMATORS))}"
        )
    return ESTIMATORS[name](rewards, uids, **kw)


def gae(
    rewards: Float[np.ndarray, "b t"],
    values: Float[np.ndarray, "b t1"],
    mask: Float[np.ndarray, "b t"],
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Float[np.ndarray, "b t"], Float[np.ndarray, "b t"]]:
    """GAE advantages and returns (= advantages + values), both zero where `mask` is 0.

    values: [B, T + 1] where the last column bootstraps a truncated completion, or [B, T] meaning
    every completion terminated (bootstrap 0). Masked tokens are skipped by the recursion:
    delta_t = r_t + gamma * V(next unmasked) - V_t, A_t = delta_t + gamma * lam * A(next unmasked).
    """
    rewards = np.asarray(rewards, np.float64)
    values = np.asarray(values, np.float64)
    mask = np.asarray(mask).astype(bool)
    if rewards.ndim != 2 or mask.shape != rewards.shape:
        raise ValueError(f"rewards and mask must both be [B, T]; got {rewards.shape}, {mask.shape}")
    b, t = rewards.shape
    if values.shape not in ((b, t), (b, t + 1)):
        raise ValueError(f"values must be [B, T] or [B, T + 1] = {(b, t + 1)}; got {values.shape}")
    if not np.all(np.isfinite(rewards[mask])):
        raise ValueError("rewards must be finite on unmasked tokens")
    next_value = values[:, t] if values.shape[1] == t + 1 else np.zeros(b)  # [B]
    next_adv = np.zeros(b)  # [B]
    advantages = np.zeros((b, t))  # [B, T]
    for i in reversed(range(t)):
        m = mask[:, i]  # [B]
        delta = rewards[:, i] + gamma * next_value - values[:, i]  # [B]
        adv = delta + gamma * lam * next_adv  # [B]
        advantages[:, i] = np.where(m, adv, 0.0)
        next_value = np.where(m, values[:, i], next_value)
        next_adv = np.where(m, adv, next_adv)
    returns = np.where(mask, advantages + values[:, :t], 0.0)  # [B, T]
    return advantages.astype(np.float32), returns.astype(np.float32)


def _kl_sums(kl, mask: np.ndarray, n: int) -> np.ndarray:
    if kl is None:
        return np.zeros(n)
    return np.where(mask > 0, np.asarray(kl, np.float64), 0.0).sum(axis=1)[:n]  # [n]


def sequence_rewards(rewards: Rewards, mask: Float[np.ndarray, "b t"],
                     kl: Float[np.ndarray, "b t"] | None = None, kl_coef: float = 0.0) -> Rewards:
    """Each completion's reward minus ``kl_coef`` times its summed per-token KL (row i of the
    [B, T] arrays is completion i; rows past n are padding)."""
    rewards = np.asarray(rewards, np.float64)
    mask = np.asarray(mask)
    return rewards - kl_coef * _kl_sums(kl, mask, len(rewards))


def token_rewards(rewards: Rewards, mask: Float[np.ndarray, "b t"],
                  kl: Float[np.ndarray, "b t"] | None = None,
                  kl_coef: float = 0.0) -> Float[np.ndarray, "b t"]:
    """[B, T] per-token rewards: completion i's reward on the last loss token of row i, minus
    ``kl_coef * kl`` on every loss token; 0 elsewhere and on rows past ``len(rewards)``."""
    mask = np.asarray(mask) > 0
    out = np.zeros(mask.shape, np.float64)
    if kl is not None:
        out -= kl_coef * np.where(mask, np.asarray(kl, np.float64), 0.0)
    for i, r in enumerate(np.asarray(rewards, np.float64)):
        cols = np.flatnonzero(mask[i])
        if len(cols):
            out[i, cols[-1]] += r
    return out


def whiten(x: Float[np.ndarray, "b t"], mask: Float[np.ndarray, "b t"],
           eps: float = 1e-8) -> Float[np.ndarray, "b t"]:
    """(x - mean) / sqrt(var + eps) over the masked entries; 0 elsewhere. ``var`` is the
    population variance (verl's ``masked_whiten`` multiplies it by n / (n - 1))."""
    on = np.asarray(mask) > 0
    x = np.asarray(x, np.float64)
    if not on.any():
        return np.zeros_like(x)
    mean, var = x[on].mean(), x[on].var()
    return np.where(on, (x - mean) / np.sqrt(var + eps), 0.0)


def gae_advantages(rewards: Rewards, values: Float[np.ndarray, "b t"],
                   mask: Float[np.ndarray, "b t"], gamma: float = 1.0, lam: float = 1.0,
                   kl: Float[np.ndarray, "b t"] | None = None, kl_coef: float = 0.0
                   ) -> tuple[Float[np.ndarray, "b t"], Float[np.ndarray, "b t"]]:
    """PPO's advantages for a padded batch (row i = completion i): whitened GAE over
    ``token_rewards`` and the critic's ``values``, and the critic's targets (GAE + values)."""
    adv, returns = gae(token_rewards(rewards, mask, kl, kl_coef), values, mask, gamma, lam)
    return whiten(adv, mask).astype(np.float32), returns


def explained_variance(values: Float[np.ndarray, "b t"], returns: Float[np.ndarray, "b t"],
                       mask: Float[np.ndarray, "b t"]) -> float:
    """1 - Var(returns - values) / Var(returns) over the masked tokens (nan when Var(returns)
    is 0): 1 for a critic that predicts its targets, 0 for one that predicts their mean."""
    on = np.asarray(mask) > 0
    r, v = np.asarray(returns, np.float64)[on], np.asarray(values, np.float64)[on]
    var = r.var() if r.size else 0.0
    return float(1.0 - (r - v).var() / var) if var > 0 else float("nan")
