"""Qwen3-Next (``Qwen3NextForCausalLM``): gated DeltaNet layers (``rlx.models.deltanet``) among
gated full-attention ones, against transformers 5.25's class (its torch fallbacks for the chunked
gated delta rule and the causal convolution), f32, on the zoo's tiny model: linear layers 0, 1,
3, full layers 2, 4, 2 key heads serving 4 value heads through a 4-tap convolution, a quarter of
each full head rotating, top-2 of 4 experts plus the gated shared expert.

Tolerances: max |logit difference| <= 1e-4 relative to the largest oracle logit (about 5 here)
for HF -> rlx (padded rows compared on their real tokens); 1e-5 for a padded or packed row
against its sequence alone (rlx against rlx) and for the rlx -> to_hf -> transformers / rlx round
trip, for a cached decode against the forward pass, and for the built-in engine's sampled and
scored log-probs against the learner's (``tests.helpers.parity``).
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.mesh import MeshShape, batch_sharding, make_mesh
from rlx.models import ModelConfigError, from_hf, from_hf_config, to_hf, to_hf_config
from rlx.models.deltanet import gated_delta_rule, l2_normalize
from rlx.models.kv_cache import KVCache
from rlx.models.stack import layer_counts, stack_layers
from rlx.quant import LoraConfig, QuantConfig
from tests.helpers.hf_zoo import hf_config, hf_logits, load_hf_model, make_hf_model
from tests.helpers.parity import TOL as ENGINE_TOL
from tests.helpers.parity import decoded_logits, parity
from tests.helpers.quant import quantized_lora_model

TOL = 1e-4
ARCH = "Qwen3NextForCausalLM"


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_hf_model("qwen3_next", str(tmp_path_factory.mktemp("zoo")))


@pytest.fixture(scope="module")
def model(path):
    return from_hf(path)


def _ids(b=3, t=9, seed=0):
    return np.random.RandomState(seed).randint(0, 97, (b, t))


def _forward(model, ids, **kw):
    return np.asarray(jax.jit(lambda m, x, kw: m(x, **kw))(model, jnp.asarray(ids), kw))


def test_logits_match_transformers(path, model):
    ids = _ids()
    ref = hf_logits(path, ids)
    scale = np.abs(ref).max()
    assert scale > 0.5, "oracle logits too small to make the test meaningful"
    assert np.abs(_forward(model, ids) - ref).max() <= TOL * scale
    cfg = model.config
    assert cfg.linear_attention.layers == (0, 1, 3) and cfg.moe.sparse_layers == (0, 1, 2, 4)
    assert cfg.rotary_dim == 4 and cfg.attention_output_gate and cfg.centered_norms


def test_padded_batch_matches_transformers_and_unpadded(path, model):
    """Left padding: transformers zeroes the pad tokens' inputs to the linear layers; rlx keeps
    them out of the convolution and the state, which gives the row alone."""
    ids = _ids(b=2, t=11, seed=1)
    mask = np.array([[1] * 11, [0] * 4 + [1] * 7])
    ref = hf_logits(path, ids, attention_mask=mask)
    out = _forward(model, ids, attention_mask=jnp.asarray(mask))
    real = mask.astype(bool)
    assert np.abs(out[real] - ref[real]).max() <= TOL * np.abs(ref[real]).max()
    alone = _forward(model, ids[1:, 4:])[0]
    np.testing.assert_allclose(out[1, 4:], alone, rtol=0, atol=1e-5 * np.abs(alone).max())


def test_packed_row_equals_each_sequence_alone(model):
    """Two sequences (7 and 5 tokens) and 2 pads in one row: the convolution's taps and the
    recurrent state restart at the second sequence's first token."""
    ids = _ids(b=1, t=14, seed=2)
    seg = jnp.asarray([[1] * 7 + [2] * 5 + [0] * 2])
    pos = jnp.asarray([list(range(7)) + list(range(5)) + [0, 0]])
    packed = _forward(model, ids, positions=pos, segment_ids=seg)[0]
    for lo, hi in ((0, 7), (7, 12)):
        alone = _forward(model, ids[:, lo:hi])[0]
        np.testing.assert_allclose(packed[lo:hi], alone, rtol=0, atol=1e-5 * np.abs(alone).max())


def test_delta_rule_equals_the_recurrence_written_out():
    """The chunked, rematerialised scan (3 chunks of 64 over 150 steps, a reset at step 100)
    against the per-token loop in numpy, with the state carried in and out."""
    rng = np.random.RandomState(3)
    b, t, h, dk, dv = 2, 150, 3, 4, 5
    q, k = (np.asarray(l2_normalize(jnp.asarray(rng.randn(b, t, h, dk)))) for _ in range(2))
    v = rng.randn(b, t, h, dv)
    g, beta = -rng.rand(b, t, h), rng.rand(b, t, h)
    reset = np.zeros((b, t), bool)
    reset[:, 100] = True
    s0 = rng.randn(b, h, dk, dv)
    out, last = gated_delta_rule(*(jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta)),
                                 jnp.asarray(reset), jnp.asarray(s0, jnp.float32))
    s, want = s0.copy(), np.zeros((b, t, h, dv))
    for i in range(t):
        s = np.where(reset[:, i, None, None, None], 0.0, s) * np.exp(g[:, i])[..., None, None]
        delta = (v[:, i] - np.einsum("bhk,bhkv->bhv", k[:, i], s)) * beta[:, i, :, None]
        s = s + k[:, i, :, :, None] * delta[:, :, None, :]
        want[:, i] = np.einsum("bhk,bhkv->bhv", q[:, i], s)
    np.testing.assert_allclose(np.asarray(out), want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(last), s, rtol=0, atol=1e-5)


def test_round_trip_through_to_hf(path, model, tmp_path):
    to_hf(model, str(tmp_path / "out"))
    ids = _ids()
    ref = _forward(model, ids)
    hf = hf_logits(str(tmp_path / "out"), ids)  # loadable, no tensor missing or left over
    again = _forward(from_hf(str(tmp_path / "out")), ids)
    assert np.abs(hf - ref).max() <= 1e-5 * np.abs(ref).max()
    assert np.abs(again - ref).max() <= 1e-5 * np.abs(ref).max()


def test_parameter_count_matches_transformers(path, model):
    assert model.config.num_params() == load_hf_model(path).num_parameters()


def test_config_round_trips_and_derives_the_layer_kinds():
    hf = hf_config("qwen3_next").to_dict() | {"architectures": [ARCH]}
    cfg = from_hf_config(hf)
    assert from_hf_config(to_hf_config(cfg)) == cfg
    # without layer_types: every full_attention_interval-th layer full, as transformers derives
    derived = from_hf_config(hf | {"layer_types": None, "full_attention_interval": 2})
    assert derived.linear_attention.layers == (0, 2, 4)
    assert dataclasses.replace(cfg, linear_attention=None).is_linear_layer(0) is False


@pytest.mark.parametrize("field,value,named", [
    ("layer_types", ["linear_attention", "sliding_attention"] + ["full_attention"] * 3,
     "layer_types"),
    ("layer_types", ["full_attention"] * 4, "layer_types"),
    ("attention_bias", True, "attention_bias"),
    ("linear_num_value_heads", 3, "linear_num_value_heads"),
    ("shared_expert_intermediate_size", 0, "shared_expert_intermediate_size"),
    ("hidden_act", "gelu", "hidden_act"),
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 100.0, "factor": 2.0},
     "rope_type")])
def test_unsupported_options_are_refused_naming_the_field(field, value, named):
    hf = hf_config("qwen3_next").to_dict() | {"architectures": [ARCH]}
    with pytest.raises(ModelConfigError, match=named):
        from_hf_config(hf | {field: value})


def test_refused_before_any_weight_is_read(path, tmp_path):
    """A folder whose config.json asks for an unsupported option and whose weights are absent:
    the error names the option, not a missing tensor."""
    import json

    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    os.makedirs(tmp_path / "bad")
    with open(tmp_path / "bad" / "config.json", "w") as f:
        json.dump(hf | {"attention_bias": True}, f)
    with pytest.raises(ModelConfigError, match="attention_bias"):
        from_hf(str(tmp_path / "bad"))


def test_decode_over_the_cache_equals_forward(model):
    """Left-padded prompts of 11 and 8 tokens: 7 slots prefilled, then 4 one-token steps, each
    continuing every linear layer's convolution and recurrent state from the cache."""
    ids = jnp.asarray(_ids(b=2, t=11))
    mask = jnp.asarray(np.array([[1] * 11, [0] * 3 + [1] * 8]))
    full = _forward(model, ids, attention_mask=mask)
    cache = KVCache.zeros(model.config, 2, 11, jnp.float32)
    la = model.config.linear_attention
    assert cache.keys[0].shape == (2, la.conv_kernel - 1, la.conv_dim) and cache.is_linear(0)
    assert cache.values[0].shape == (2, 4, 8, 6) and not cache.is_linear(2)
    decoded = decoded_logits(model, ids, mask, cache, prefill=7)
    real = np.asarray(mask).astype(bool)
    assert np.abs(decoded[real] - full[real]).max() <= 1e-5 * np.abs(full[real]).max()


@pytest.mark.slow  # 95 s measured on a loaded 2-core machine (compiles dominate)
def test_engine_logprobs_equal_learner_mode_a(model):
    """The built-in engine (lockstep for this model: prompts of 3, 11 and 6 tokens, 12 sampled
    tokens each, 2 samples sharing each prompt's prefilled states) samples, and scores, what
    the learner's log-prob step computes."""
    sampled, scored, preflight = parity(model)
    assert sampled <= ENGINE_TOL and scored <= ENGINE_TOL and preflight <= ENGINE_TOL


@pytest.mark.slow  # 150 s measured on a loaded 2-core machine
def test_engine_logprobs_equal_learner_mode_b(path):
    """Mode B: an int8 base with random LoRA adapters on the full layers' q/k/v/o and on the
    experts' (routed and shared) projections; the DeltaNet's projections quantized, frozen."""
    root = os.path.dirname(path)
    model = quantized_lora_model(root, "qwen3_next", QuantConfig(format="int8", group_size=8),
                                 LoraConfig(rank=3, alpha=5.0, experts=True))
    assert model.layers[2].self_attn.q_proj.lora is not None
    assert model.layers[0].mlp.experts.gate_lora is not None
    sampled, scored, _ = parity(model)
    assert sampled <= ENGINE_TOL and scored <= ENGINE_TOL


@pytest.mark.slow  # 52 s measured on a loaded 2-core machine (four compiles)
def test_scanned_layers_equal_the_unrolled_model(path):
    """Stacks of same-kind layers (DeltaNet 0-1, attention 2, DeltaNet 3, attention 4) scanned:
    the forward pass and a cached decode (prefill of 6, one step) give the unrolled logits."""
    ids = jnp.asarray(_ids(b=2, t=7, seed=4))
    model = from_hf(path)
    want = _forward(model, ids)
    stacked = stack_layers(from_hf(path))
    assert layer_counts(stacked) == (2, 1, 1, 1)
    np.testing.assert_allclose(_forward(stacked, ids), want, rtol=0,
                               atol=1e-5 * np.abs(want).max())
    cache = KVCache.zeros(stacked.config, 2, 7, jnp.float32, layer_counts(stacked))
    step = jax.jit(lambda m, x, p, s, c: (lambda h, c: (m.logits(h), c))(*m.decode(x, p, s, c)))
    pos, seg = jnp.broadcast_to(jnp.arange(7), (2, 7)), jnp.ones((2, 7), jnp.int32)
    first, cache = step(stacked, ids[:, :6], pos[:, :6], seg[:, :6], cache)
    last, _ = step(stacked, ids[:, 6:], pos[:, 6:], seg[:, 6:], cache)
    decoded = np.concatenate([np.asarray(first), np.asarray(last)], axis=1)
    np.testing.assert_allclose(decoded, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_context_parallelism_is_refused(model):
    from rlx.kernels.attention import AttentionSharding
    from rlx.mesh import TRAIN_RULES

    layer = model.layers[0].self_attn
    layer.sharding = AttentionSharding.of(make_mesh(MeshShape(context=2),
                                                    devices=jax.devices()[:2]), TRAIN_RULES)
    try:
        with pytest.raises(ValueError, match="context parallelism"):
            layer(jnp.zeros((1, 4, 32)), None, jnp.ones((1, 4), jnp.int32), None)
    finally:
        layer.sharding = None


def test_a_run_with_context_parallelism_is_refused_by_name(tmp_path):
    """configs/qwen3_next_80b.py on a mesh with a context axis: refused before anything is
    built, naming config.mesh.context."""
    from rlx.commandline import load_config_file
    from rlx.config import ConfigError, parse_config
    from rlx.models.presets import write_preset_folder
    from rlx.run.checks import check_before_build
    from tests.helpers import ROOT

    raw = load_config_file(os.path.join(ROOT, "configs", "qwen3_next_80b.py")).to_dict()
    raw["model"]["path"] = write_preset_folder("Qwen/Qwen3-Next-80B-A3B-Instruct",
                                               str(tmp_path / "preset"))
    raw["output_dir"] = str(tmp_path / "run")
    raw["mesh"].update(context=2, expert=4)
    with pytest.raises(ConfigError, match="config.mesh.context=2: .*DeltaNet"):
        check_before_build(parse_config(raw), 8)


def test_sharded_logits_equal_unsharded(path, model):
    """fsdp x tensor x expert on 8 fake CPU devices: the DeltaNet's projections and convolution
    split over ``tensor`` (by their heads axis), the experts over ``expert``; the logits within
    1e-5 relative of one device's (the same compiled program)."""
    ids = jnp.asarray(_ids(b=8, t=6, seed=5))
    forward = jax.jit(lambda m, x: m(x))
    single = np.asarray(forward(model, ids))
    mesh = make_mesh(MeshShape(fsdp=2, tensor=2, expert=2))
    sharded = from_hf(path, mesh=mesh)
    out = np.asarray(forward(sharded, jax.device_put(ids, batch_sharding(mesh, 2))))
    assert np.abs(out - single).max() <= 1e-5 * np.abs(single).max()
    linear = sharded.layers[0].self_attn
    for w in (linear.in_proj_qkvz.kernel[...], linear.conv1d[...]):
        assert "tensor" in jax.tree.leaves(tuple(w.sharding.spec)), w.sharding.spec
    experts = sharded.layers[0].mlp.experts.gate_proj[...]
    assert experts.addressable_shards[0].data.shape[0] == experts.shape[0] // 2
