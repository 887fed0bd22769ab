"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``) and GLM-5 (``GlmMoeDsaForCausalLM``): MLA with the
DSA indexer (``rlx.models.dsa``) against transformers 5.25's classes, f32, on the zoo's tiny
models whose indexer keeps 4 keys per query (fewer than the sequences, so the selection binds).

Tolerances: max |logit difference| <= 1e-4 relative to the largest oracle logit (about 4 here)
for HF -> rlx (padded rows compared on their real tokens); 1e-5 for the rlx -> to_hf ->
transformers / rlx round trip, for a cached decode (prefill, then one-token steps over the
latent and indexer-key cache) against the full forward pass, and for the built-in engine's
sampled and scored log-probs against the learner's (``tests.helpers.parity``). Keys tied at a query's k-th index
score would make the selection the backend's choice (transformers' ``topk``); the zoo's 8
indexer heads make an exact tie (every head's relu at zero for two keys) unlikely, and one would
fail these tests rather than pass them.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx

from rlx.learner.state import MODES
from rlx.models import ModelConfigError, from_hf, from_hf_config, to_hf, to_hf_config
from rlx.models.dsa import IndexerWeight
from rlx.models.kv_cache import KVCache
from rlx.quant import LoraConfig, QuantConfig
from tests.helpers.hf_zoo import hf_config, hf_logits, load_hf_model, make_hf_model
from tests.helpers.parity import TOL as ENGINE_TOL
from tests.helpers.parity import decoded_logits, parity
from tests.helpers.quant import quantized_lora_model

TOL = 1e-4
DSA = ("deepseek_v32", "glm_moe_dsa")
ARCH = {"deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zoo"))


def _ids(b=3, t=9, seed=0):
    return np.random.RandomState(seed).randint(0, 97, (b, t))


@pytest.mark.parametrize("family", DSA)
def test_logits_match_transformers(zoo, family):
    path = make_hf_model(family, zoo)
    ids = _ids()
    ref = hf_logits(path, ids)
    scale = np.abs(ref).max()
    assert scale > 0.5, "oracle logits too small to make the test meaningful"
    out = np.asarray(from_hf(path)(jnp.asarray(ids)))
    assert np.abs(out - ref).max() <= TOL * scale
    # the selection binds: with every key kept the logits differ far above the tolerance
    dense = from_hf(path)
    for layer in dense.layers:
        layer.self_attn.index_topk = 10 ** 6
    assert np.abs(np.asarray(dense(jnp.asarray(ids))) - ref).max() > 100 * TOL * scale


@pytest.mark.parametrize("family", [pytest.param("deepseek_v32", marks=pytest.mark.slow),
                                    "glm_moe_dsa"])
def test_padded_batch_matches_transformers_and_unpadded(zoo, family):
    path = make_hf_model(family, zoo)
    ids = _ids(b=2, t=11, seed=1)
    mask = np.array([[1] * 11, [0] * 4 + [1] * 7])
    ref = hf_logits(path, ids, attention_mask=mask)
    model = from_hf(path)
    out = np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
    real = mask.astype(bool)
    assert np.abs(out[real] - ref[real]).max() <= TOL * np.abs(ref[real]).max()
    alone = np.asarray(model(jnp.asarray(ids[1:, 4:])))[0]
    np.testing.assert_allclose(out[1, 4:], alone, rtol=0, atol=1e-5 * np.abs(alone).max())


@pytest.mark.parametrize("family", DSA)
def test_round_trip_through_to_hf(zoo, family, tmp_path):
    path = make_hf_model(family, zoo)
    model = from_hf(path)
    to_hf(model, str(tmp_path / "out"))
    ids = _ids()
    ref = np.asarray(model(jnp.asarray(ids)))
    hf = hf_logits(str(tmp_path / "out"), ids)  # loadable, no tensor missing or left over
    again = np.asarray(from_hf(str(tmp_path / "out"))(jnp.asarray(ids)))
    assert np.abs(hf - ref).max() <= 1e-5 * np.abs(ref).max()
    assert np.abs(again - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("family", [pytest.param("deepseek_v32", marks=pytest.mark.slow),
                                    "glm_moe_dsa"])
def test_decode_over_the_cache_equals_forward(zoo, family):
    """Left-padded prompts of 11 and 8 tokens: 7 slots prefilled, then 4 one-token steps, each
    selecting among cached indexer keys; more than 4 keys are allowed, so the selection binds."""
    model = from_hf(make_hf_model(family, zoo))
    ids = jnp.asarray(_ids(b=2, t=11))
    mask = jnp.asarray(np.array([[1] * 11, [0] * 3 + [1] * 8]))
    full = np.asarray(jax.jit(lambda m, x, a: m(x, attention_mask=a))(model, ids, mask))
    cache = KVCache.zeros(model.config, 2, 11, jnp.float32)
    assert cache.values[0].shape[-1] == model.config.latent_cache_width  # latent + indexer key
    decoded = decoded_logits(model, ids, mask, cache, prefill=7)
    real = np.asarray(mask).astype(bool)
    assert np.abs(decoded[real] - full[real]).max() <= 1e-5 * np.abs(full[real]).max()


@pytest.mark.parametrize("family", [pytest.param("deepseek_v32", marks=pytest.mark.slow),
                                    "glm_moe_dsa"])
def test_engine_logprobs_equal_learner_mode_a(zoo, family):
    """The built-in engine (paged KV cache, continuous batching: prompts of 3, 11 and 6 tokens,
    12 sampled tokens each) samples, and scores, what the learner's log-prob step computes."""
    sampled, scored, preflight = parity(from_hf(make_hf_model(family, zoo)))
    assert sampled <= ENGINE_TOL and scored <= ENGINE_TOL and preflight <= ENGINE_TOL


def test_engine_logprobs_equal_learner_mode_b(zoo):
    """Mode B: an int8 base with random LoRA adapters on every attention projection; the
    indexer stays float and frozen."""
    attention = LoraConfig(rank=3, alpha=5.0, targets=("q_a", "q_b", "kv_a", "kv_b", "o"))
    model = quantized_lora_model(zoo, "glm_moe_dsa", QuantConfig(format="int8", group_size=8),
                                 attention)
    assert model.layers[0].self_attn.q_a_proj.lora is not None
    _, lora, _ = nnx.split(model, nnx.LoRAParam, ...)
    assert not any("indexer" in "/".join(map(str, k)) for k, _ in nnx.to_flat_state(lora))
    sampled, scored, _ = parity(model)
    assert sampled <= ENGINE_TOL and scored <= ENGINE_TOL


def test_indexer_is_frozen_in_both_modes(zoo):
    model = from_hf(make_hf_model("glm_moe_dsa", zoo))
    assert isinstance(model.layers[0].self_attn.indexer.wq_b, IndexerWeight)
    for mode, trainable in MODES.items():
        _, params, frozen = nnx.split(model, trainable, ...)
        trained = {"/".join(map(str, k)) for k, _ in nnx.to_flat_state(params)}
        kept = {"/".join(map(str, k)) for k, _ in nnx.to_flat_state(frozen)}
        assert not any("/indexer/" in p for p in trained), mode
        assert "layers/0/self_attn/indexer/wq_b" in kept, mode


def test_parameter_count_matches_transformers(zoo):
    for family in DSA:
        hf = load_hf_model(make_hf_model(family, zoo))
        assert from_hf(make_hf_model(family, zoo)).config.num_params() == hf.num_parameters()


@pytest.mark.parametrize("field,value", [
    ("indexer_types", ["shared", "full"]), ("indexer_types", ["full", "dense"]),
    ("layer_types", ["x"] * 2), ("mlp_layer_types", ["sparse", "sparse"]),
    ("rope_interleave", False), ("indexer_rope_interleave", False), ("q_lora_rank", None)])
def test_unsupported_options_are_refused_naming_the_field(field, value):
    """(GLM-5's sharing itself: ``tests/models/test_dsa_shared.py``.)"""
    hf = hf_config("glm_moe_dsa").to_dict() | {"architectures": [ARCH["glm_moe_dsa"]]}
    with pytest.raises(ModelConfigError, match=field):
        from_hf_config(hf | {field: value})


@pytest.mark.parametrize("family", DSA)
@pytest.mark.parametrize("first_dense", [None, 0])
def test_config_round_trips(family, first_dense):
    """What transformers saves reads back; rlx writes what reads back the same (``first_dense``
    0: every layer sparse, as transformers derives ``mlp_layer_types``)."""
    hf = hf_config(family).to_dict()
    if first_dense is not None:
        hf = hf | {"first_k_dense_replace": first_dense, "mlp_layer_types": None}
        hf = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf).to_dict()
    cfg = from_hf_config(hf | {"architectures": [ARCH[family]]})
    first = 1 if first_dense is None else first_dense  # the zoo: the first layer dense
    assert cfg.moe.sparse_layers == tuple(range(first, cfg.num_layers))
    assert from_hf_config(to_hf_config(cfg)) == cfg
    assert dataclasses.replace(cfg, dsa=None).attention_kind == "mla"
