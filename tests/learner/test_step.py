"""The compiled learner step: layouts, micro-batching, sharding, the guard, and learning itself."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.config import TrainSection
from rlx.errors import ConfigError
from rlx.learner.advantages import grpo
from rlx.learner.batching import (Batching, batch_layout, count_bucket, fill, loss_columns,
                                  micro_count, pack_rollouts, pad_rollouts, shard_batch)
from rlx.learner.losses import AGGREGATIONS, LossConfig
from rlx.learner.state import OptimizerConfig, create_train_state, make_optimizer
from rlx.learner.step import (FORWARDS, StepConfig, compute_grads, make_logprob_step,
                              make_train_step, model_forward, reference_forward)
from rlx.mesh import MeshShape, batch_sharding, make_mesh
from rlx.types import Rollout, StepMetrics
from tests.helpers.steps import TINY, add_qlora, random_rollouts, sample, tiny_model

TOL = 1e-5
PACKED_TOL = 1e-6  # packed vs padded rows, token budget vs fixed micro-batches (f32)
V = TINY.vocab_size


def _mesh(shape=MeshShape()):
    return make_mesh(shape, jax.devices()[: shape.num_devices])


def _model(mode: str, seed: int = 0, head_scale: float = 1.0):
    model = tiny_model(seed, head_scale=head_scale)
    if mode == "lora":
        return add_qlora(model), nnx.LoRAParam
    return model, nnx.Param


def _extras(rollouts, seed):
    """Old / reference log-probs near the sampler's, so ratios, TIS and KL are all non-trivial."""
    rs = np.random.RandomState(seed)
    old = [r.sampler_logp + rs.normal(0, 0.3, len(r.sampler_logp)) for r in rollouts]
    ref = [r.sampler_logp + rs.normal(0, 0.3, len(r.sampler_logp)) for r in rollouts]
    return old, ref


def _grads_fn(graphdef, cfg):
    return jax.jit(functools.partial(compute_grads, graphdef=graphdef, cfg=cfg))


def _max_tree_diff(a, b) -> float:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b))
    diffs = [np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y))) for x, y in pairs]
    return float(max(diffs, default=0.0))


@pytest.mark.parametrize("loss_cfg", [
    *(LossConfig("ppo", aggregation=a, kl_coef=0.1, entropy_coef=0.01, norm_length=12)
      for a in AGGREGATIONS),  # token TIS
    LossConfig("gspo", tis_mode="sequence-mask", tis_seq_low=0.8, tis_seq_high=1.25),
], ids=[*AGGREGATIONS, "gspo-seqmask"])
def test_packed_equals_padded(loss_cfg):
    """Every ``loss.aggregation`` (PPO + KL + entropy), and GSPO's sequence ratio with
    sequence-mask TIS: a packed batch's loss, metrics and gradients are the padded batch's
    within PACKED_TOL (f32)."""
    rollouts = random_rollouts(10, V, seed=1)
    adv = np.random.RandomState(2).normal(size=10)
    old, ref = _extras(rollouts, 3)
    padded = pad_rollouts(rollouts, adv, old_logp=old, ref_logp=ref)
    packed = pack_rollouts(rollouts, adv, row_len=16, old_logp=old, ref_logp=ref)
    assert packed.shape[0] < padded.shape[0] and packed.segment_ids.max() >= 2  # really packed
    model, _ = _model("full")
    graphdef, params, frozen = nnx.split(model, nnx.Param, ...)
    fn = _grads_fn(graphdef, StepConfig(loss=loss_cfg, logprob_chunk=7))
    g_pad, loss_pad, m_pad, tok_pad, seq_pad, _ = fn(params, frozen, padded)
    g_pack, loss_pack, m_pack, tok_pack, seq_pack, _ = fn(params, frozen, packed)
    assert float(tok_pad) == float(tok_pack) == sum(len(r.completion_ids) for r in rollouts)
    assert float(seq_pad) == float(seq_pack) == 10
    assert abs(float(loss_pad)) > 1e-3  # a loss that means something
    assert abs(float(loss_pad) - float(loss_pack)) <= PACKED_TOL
    assert _max_tree_diff(g_pad, jax.tree.map(jnp.zeros_like, g_pad)) > 1e-3
    assert _max_tree_diff(g_pad, g_pack) <= PACKED_TOL
    for name, a, b in zip(m_pad._fields, m_pad, m_pack):
        assert abs(float(a) - float(b)) <= PACKED_TOL, name


@pytest.mark.parametrize("pack,tokens", [(True, 12), (False, 32)], ids=["packed", "padded"])
def test_token_budget_micro_batches_give_the_fixed_rows_update(pack, tokens):
    """``tokens_per_micro_batch`` on 2 data-parallel shards: packed rows of the budget (a 15-token
    rollout, longer than 12, makes the rows its bucketed 16) one per shard per micro-batch, or
    padded 16-token rows two per shard in 32 tokens; the micro-batch count bucketed, micro-batches
    of padding rows skipped. Loss, metrics and gradients are those of the padded batch in two
    fixed micro-batches (the loss's normalisers are the whole batch's either way)."""
    rollouts = random_rollouts(14, V, seed=31, max_prompt=6, max_completion=9)
    assert max(r.length for r in rollouts) == 15
    adv = np.random.RandomState(32).normal(size=14)
    old, ref = _extras(rollouts, 33)
    mesh = _mesh(MeshShape(data=2))
    layout = batch_layout([r.length for r in rollouts],
                          Batching(pack=pack, buckets=(), shards=2, tokens=tokens))
    budget = fill(rollouts, adv, layout, old_logp=old, ref_logp=ref)
    fixed = pad_rollouts(rollouts, adv, old_logp=old, ref_logp=ref, rows_multiple=4)
    k = micro_count(budget.shape, 2, 1, tokens)
    assert budget.shape[1] == 16 and k == count_bucket(k) and k * 2 * (1 if pack else 2) == \
        budget.shape[0]
    assert (budget.shape[0] < fixed.shape[0]) == pack
    model, _ = _model("full")
    graphdef, params, frozen = nnx.split(model, nnx.Param, ...)
    loss_cfg = LossConfig("ppo", kl_coef=0.1, entropy_coef=0.01)

    def grads(batch, **kw):
        fn = jax.jit(functools.partial(compute_grads, graphdef=graphdef, row_sharding=batch_sharding(
            mesh, 1), cfg=StepConfig(loss=loss_cfg, logprob_chunk=7, **kw)))
        return fn(params, frozen, shard_batch(batch, mesh))

    (g_b, loss_b, m_b, *_), (g_f, loss_f, m_f, *_) = (
        grads(budget, tokens_per_micro_batch=tokens), grads(fixed, micro_batches=2))
    assert abs(float(loss_f)) > 1e-3 and abs(float(loss_b) - float(loss_f)) <= PACKED_TOL
    assert _max_tree_diff(g_b, g_f) <= PACKED_TOL
    for name, a, b in zip(m_f._fields, m_f, m_b):
        assert abs(float(a) - float(b)) <= PACKED_TOL, name


@pytest.mark.parametrize("policy_loss", ["dapo", "ppo"])
def test_micro_batches_equal_one_batch(policy_loss):
    """Rows of very different lengths and two empty rows, so micro-batches hold unequal token
    and sequence counts."""
    rollouts = random_rollouts(6, V, seed=4, max_completion=9)
    adv = np.random.RandomState(5).normal(size=6)
    old, _ = _extras(rollouts, 6)
    batch = pad_rollouts(rollouts, adv, old_logp=old, rows_multiple=8)
    model, _ = _model("full")
    graphdef, params, frozen = nnx.split(model, nnx.Param, ...)
    loss_cfg = LossConfig(policy_loss, clip_eps_high=0.28 if policy_loss == "dapo" else 0.2)
    one = _grads_fn(graphdef, StepConfig(loss=loss_cfg))(params, frozen, batch)
    four = _grads_fn(graphdef, StepConfig(loss=loss_cfg, micro_batches=4))(params, frozen, batch)
    assert abs(float(one[1]) - float(four[1])) <= TOL
    assert _max_tree_diff(one[0], four[0]) <= TOL
    for name, a, b in zip(one[2]._fields, one[2], four[2]):
        assert abs(float(a) - float(b)) <= TOL, name


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("mode", ["full", "lora"])
def test_scoring_only_the_loss_columns_gives_the_same_loss_and_gradients(mode, layout):
    """``TrainBatch.logp_columns``: the lm-head on the gathered loss tokens only. Long prompts, so
    the columns are fewer than the row; PPO + KL + entropy, two micro-batches."""
    rollouts = random_rollouts(8, V, seed=21, max_prompt=14, max_completion=5)
    adv = np.random.RandomState(22).normal(size=8)
    old, ref = _extras(rollouts, 23)
    kw = dict(old_logp=old, ref_logp=ref, rows_multiple=2, columns=False)
    whole = (pad_rollouts(rollouts, adv, **kw) if layout == "padded"
             else pack_rollouts(rollouts, adv, row_len=24, **kw))
    cols = loss_columns(whole.loss_mask, smallest=8)
    assert whole.logp_columns is None and cols.shape[1] < whole.shape[1]
    compact = whole.replace(logp_columns=cols)
    model, trainable = _model(mode)
    graphdef, params, frozen = nnx.split(model, trainable, ...)
    cfg = StepConfig(loss=LossConfig("ppo", kl_coef=0.1, entropy_coef=0.01), micro_batches=2,
                     logprob_chunk=7)
    fn = _grads_fn(graphdef, cfg)
    (g_all, loss_all, m_all, *_), (g_cols, loss_cols, m_cols, *_) = fn(params, frozen, whole), fn(
        params, frozen, compact)
    assert abs(float(loss_all)) > 1e-3 and abs(float(loss_all) - float(loss_cols)) <= TOL
    assert _max_tree_diff(g_all, g_cols) <= TOL
    for name, a, b in zip(m_all._fields, m_all, m_cols):
        assert abs(float(a) - float(b)) <= TOL, name
    mesh = _mesh(MeshShape(data=2, fsdp=2, tensor=2))
    step = make_logprob_step(graphdef, params, frozen, mesh, cfg)
    lp_all, lp_cols = (np.asarray(step(params, frozen, shard_batch(b, mesh)).logp)
                       for b in (whole, compact))
    np.testing.assert_allclose(lp_cols, lp_all * (whole.loss_mask > 0), atol=TOL)


def test_the_remat_choices_are_the_forwards_everywhere():
    """config.train.remat and the planner's remat take exactly the keys of FORWARDS."""
    from rlx.plan.spec import PlanSpec

    for remat in FORWARDS:
        assert TrainSection(remat=remat).remat == remat and PlanSpec(TINY, remat=remat).remat == remat
    with pytest.raises(ConfigError, match=re.escape(f"remat='full' is not one of {list(FORWARDS)}")):
        TrainSection(remat="full").validate()
    with pytest.raises(ConfigError, match=re.escape(f"plan.remat='full' is not one of {list(FORWARDS)}")):
        PlanSpec(TINY, remat="full")


@pytest.mark.parametrize("remat", ["layer", "projections"])
@pytest.mark.parametrize("mode", ["full", "lora"])
def test_remat_gives_the_same_loss_and_gradients(mode, remat):
    """``config.train.remat`` (recompute each layer, or all but the projections, in the backward
    pass) changes memory, not results: packed rows, two micro-batches, PPO + KL + entropy."""
    rollouts = random_rollouts(8, V, seed=11)
    adv = np.random.RandomState(12).normal(size=8)
    old, ref = _extras(rollouts, 13)
    batch = pack_rollouts(rollouts, adv, row_len=16, old_logp=old, ref_logp=ref, rows_multiple=2)
    model, trainable = _model(mode)
    graphdef, params, frozen = nnx.split(model, trainable, ...)
    cfg = StepConfig(loss=LossConfig("ppo", kl_coef=0.1, entropy_coef=0.01), micro_batches=2)
    runs = [jax.jit(functools.partial(compute_grads, graphdef=graphdef, cfg=cfg, apply_fn=f))(
        params, frozen, batch) for f in (model_forward, FORWARDS[remat])]
    (g_keep, loss_keep, *_), (g_remat, loss_remat, *_) = runs
    assert abs(float(loss_keep)) > 1e-3 and abs(float(loss_keep) - float(loss_remat)) <= TOL
    assert _max_tree_diff(g_keep, g_remat) <= TOL and _max_tree_diff(g_keep, jax.tree.map(jnp.zeros_like, g_keep)) > 1e-4


def test_remat_frees_the_activations_of_a_compiled_train_step():
    """``train.remat`` must lower the compiled step's buffer memory, not only its arithmetic:
    XLA's CPU scheduler once kept every layer's recomputed activations alive together inside the
    micro-batch loop (temp buffers with remat 1.05x those without). Layers of SmolLM2-135M's
    shape, LoRA mode, two micro-batches of 8 x 192 tokens."""
    cfg = dataclasses.replace(TINY, num_layers=4, vocab_size=64, hidden_size=576,
                              intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64)
    mesh = _mesh()
    rollouts = random_rollouts(16, cfg.vocab_size, seed=3, max_prompt=64, max_completion=128)
    batch = shard_batch(pad_rollouts(rollouts, np.ones(16)), mesh)
    opt = OptimizerConfig()
    temp = {}
    for remat in FORWARDS:
        graphdef, state = create_train_state(add_qlora(tiny_model(0, cfg)), make_optimizer(opt),
                                             mesh, trainable=nnx.LoRAParam)
        step = make_train_step(graphdef, state, mesh, StepConfig(micro_batches=2), opt,
                               apply_fn=FORWARDS[remat])
        temp[remat] = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
    assert temp["layer"] <= 0.5 * temp["none"], temp
    assert temp["layer"] < temp["projections"] < temp["none"], temp


def _step_once(mode, shape, batch_host, opt_cfg, step_cfg):
    mesh = _mesh(shape)
    model, trainable = _model(mode)
    graphdef, state = create_train_state(model, make_optimizer(opt_cfg), mesh, trainable=trainable)
    step = make_train_step(graphdef, state, mesh, step_cfg, opt_cfg)
    new_state, metrics = step(state, shard_batch(batch_host, mesh))
    return new_state, metrics


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_mesh_step_equals_single_device(mode):
    rollouts = random_rollouts(8, V, seed=7)
    old, ref = _extras(rollouts, 8)
    batch = pad_rollouts(rollouts, np.random.RandomState(9).normal(size=8), rows_multiple=8,
                         old_logp=old, ref_logp=ref)
    # eps 1e-5: Adam's first step is ~sign(g); a 1e-9 wobble in a ~0 gradient must not flip it
    opt_cfg = OptimizerConfig(learning_rate=1e-2, schedule="constant", eps=1e-5, weight_decay=0.01)
    loss_cfg = LossConfig("dapo", clip_eps_high=0.28, kl_coef=0.05)
    step_cfg = StepConfig(loss=loss_cfg, micro_batches=2)
    s1, m1 = _step_once(mode, MeshShape(), batch, opt_cfg, step_cfg)
    s8, m8 = _step_once(mode, MeshShape(data=2, fsdp=2, tensor=2), batch, opt_cfg, step_cfg)
    assert float(m1.skipped) == 0 and float(m1.grad_norm) > 0
    assert abs(float(m1.loss) - float(m8.loss)) <= TOL
    for f, a, b in zip(StepMetrics._fields, m1, m8):
        assert np.isfinite(float(a)) and abs(float(a) - float(b)) <= TOL, f
    assert _max_tree_diff(s1.params, s8.params) <= TOL
    _, fresh_params, fresh_frozen = nnx.split(*_model(mode), ...)
    assert _max_tree_diff(s1.params, fresh_params) > 1e-3  # the update did something
    assert _max_tree_diff(s8.frozen, fresh_frozen) == 0  # the frozen part never moves
    specs = {str(x.sharding.spec) for x in jax.tree.leaves(s8.params) + jax.tree.leaves(s8.frozen)}
    assert any("fsdp" in s for s in specs) and any("tensor" in s for s in specs), specs
    if mode == "lora":  # the int8 base passes through as integers
        assert any(x.dtype == jnp.int8 for x in jax.tree.leaves(s8.frozen))


def test_nonfinite_guard_skips_the_update():
    rollouts = random_rollouts(4, V, seed=10)
    opt_cfg = OptimizerConfig(learning_rate=1e-2, schedule="constant")
    mesh = _mesh()
    model, _ = _model("full")
    graphdef, state = create_train_state(model, make_optimizer(opt_cfg), mesh)
    step = make_train_step(graphdef, state, mesh, StepConfig(), opt_cfg)
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    bad = pad_rollouts(rollouts, np.array([1.0, np.nan, -1.0, 0.5]))
    state, metrics = step(state, shard_batch(bad, mesh))
    assert float(metrics.skipped) == 1.0 and not np.isfinite(float(metrics.loss))
    assert int(state.step) == 1 and int(state.skipped) == 1
    assert _max_tree_diff(before, (state.params, state.opt_state)) == 0
    good = pad_rollouts(rollouts, np.array([1.0, -0.5, -1.0, 0.5]))
    state, metrics = step(state, shard_batch(good, mesh))
    assert float(metrics.skipped) == 0.0 and int(state.step) == 2 and int(state.skipped) == 1
    assert float(metrics.lr) == pytest.approx(1e-2)
    assert _max_tree_diff(before[0], state.params) > 1e-3


def _dense_logp(model, batch, adapter=True):
    """Reference: full logits, log_softmax, gather of the next token, shifted to the token."""
    logits = model(jnp.asarray(batch.input_ids), jnp.asarray(batch.positions),
                   jnp.asarray(batch.segment_ids), adapter=adapter)  # [B, T, V]
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]),
                               jnp.asarray(batch.input_ids)[:, 1:, None], -1)[..., 0]  # [B, T-1]
    return np.asarray(logp) * batch.loss_mask[:, 1:]


def test_logprob_step_matches_dense_and_reference_is_adapter_off():
    rollouts = random_rollouts(6, V, seed=11)
    batch = pack_rollouts(rollouts, np.zeros(6), row_len=16)
    mesh = _mesh()
    model, _ = _model("lora")
    for path, lora in nnx.iter_graph(model):  # a trained-looking adapter: B != 0
        if path and path[-1] == "lora_b":
            lora.set_value(0.3 * jax.random.normal(jax.random.key(0), lora.shape))
    graphdef, params, frozen = nnx.split(model, nnx.LoRAParam, ...)
    cfg = StepConfig(logprob_chunk=5)
    policy = make_logprob_step(graphdef, params, frozen, mesh, cfg)
    reference = make_logprob_step(graphdef, params, frozen, mesh, cfg, apply_fn=reference_forward)
    device_batch = shard_batch(batch, mesh)
    lp = np.asarray(policy(params, frozen, device_batch).logp)[:, 1:] * batch.loss_mask[:, 1:]
    ref = np.asarray(reference(params, frozen, device_batch).logp)[:, 1:] * batch.loss_mask[:, 1:]
    assert np.abs(lp - _dense_logp(model, batch)).max() <= TOL
    assert np.abs(ref - _dense_logp(model, batch, adapter=False)).max() <= TOL
    assert np.abs(lp - ref).max() > 1e-2  # the adapter matters
    base, _ = _model("lora")  # the same base with fresh adapters (B = 0): the reference policy
    assert np.abs(ref - _dense_logp(base, batch)).max() <= TOL


def _emit7_run(mode, lr, steps=30, prompts=8, group=8, prompt_len=3, length=4):
    """GRPO from the model's own samples; reward = fraction of completion tokens equal to 7."""
    mesh = _mesh()
    model, trainable = _model(mode, head_scale=25.0)
    opt_cfg = OptimizerConfig(learning_rate=lr, schedule="constant")
    graphdef, state = create_train_state(model, make_optimizer(opt_cfg), mesh, trainable=trainable)
    step = make_train_step(graphdef, state, mesh, StepConfig(LossConfig("dapo")), opt_cfg)
    rs, key = np.random.RandomState(0), jax.random.key(0)
    uids = np.repeat(np.arange(prompts), group)
    rewards_per_step, mismatch = [], []
    for version in range(steps):
        key, sub = jax.random.split(key)
        prompt_ids = np.repeat(rs.randint(0, V, (prompts, prompt_len)), group, axis=0)
        comp, slogp = sample(state.params, state.frozen, jnp.asarray(prompt_ids), sub,
                             graphdef=graphdef, length=length)
        comp, slogp = np.asarray(comp), np.asarray(slogp)
        rewards = (comp == 7).mean(axis=1)
        rollouts = [Rollout(int(u), p, c, lp, weight_version=version)
                    for u, p, c, lp in zip(uids, prompt_ids, comp, slogp)]
        batch = pad_rollouts(rollouts, grpo(rewards, uids))
        state, metrics = step(state, shard_batch(batch, mesh))
        rewards_per_step.append(rewards.mean())
        mismatch.append(float(metrics.mismatch_abs_max))
    return rewards_per_step, mismatch


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_grpo_learns_to_emit_token_7(mode):
    rewards, mismatch = _emit7_run(mode, lr=1e-2)
    assert rewards[0] < 0.3, rewards
    assert np.mean(rewards[-3:]) > 0.9, rewards
    assert max(mismatch) < 1e-4  # sampler and learner log-probs agree token by token
