"""GLM-5's cross-layer index sharing (``indexer_types`` "shared", ``rlx.models.dsa``) against
transformers 5.25's ``GlmMoeDsaForCausalLM``, f32, on the zoo's ``glm_moe_dsa_shared``: 5 layers
"full", "full", "full", "shared", "shared", an indexer keeping 4 keys per query (fewer than the
sequences and caches, so the selection binds); layers 3 and 4 attend under layer 2's selection.
Scanned (``stack_layers``: stacks of layers 0, 1-2 and 3-4, the selection in the scans' carry)
and unrolled.

Tolerances as ``tests/models/test_dsa.py``: max |logit difference| <= 1e-4 relative to the
largest oracle logit for HF -> rlx; 1e-5 for the to_hf round trip, a cached decode against the
forward pass and the engine's log-probs against the learner's (``tests.helpers.parity``).

Slow-marked (each over 20 s on the CI's 2 cores), with the CI cases that cover them: the padded
batch (``test_dsa.py``'s padded ``glm_moe_dsa`` case for the masks, ``test_logits_match_
transformers`` here for the sharing), the unrolled decode (the scanned decode here, which runs
the same layers and carries the selection within and between stacks) and the engine
(``test_dsa.py``'s ``glm_moe_dsa`` engine cases for the paged cache, the scanned decode here for
the sharing under a cache).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from rlx.models import ModelConfigError, from_hf, from_hf_config, to_hf
from rlx.models.dsa import Indexer
from rlx.models.kv_cache import KVCache
from rlx.models.stack import layer_counts, stack_layers
from tests.helpers.hf_zoo import hf_config, hf_logits, load_hf_model, make_hf_model
from tests.helpers.parity import TOL as ENGINE_TOL
from tests.helpers.parity import decoded_logits, parity

TOL = 1e-4
ZOO = "glm_moe_dsa_shared"


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_hf_model(ZOO, str(tmp_path_factory.mktemp("zoo")))


def _ids(b=3, t=9, seed=0):
    return np.random.RandomState(seed).randint(0, 97, (b, t))


def _own_indexers(model, topk: int):
    """``model`` with an indexer of its own (random weights, ``topk`` keys) in each shared
    layer: the alternatives to sharing that the oracle must tell apart."""
    for layer in model.layers[3:]:
        layer.self_attn.indexer = nnx.data(Indexer(model.config, jnp.float32, nnx.Rngs(7)))
        layer.self_attn.index_topk = topk
    return model


@pytest.mark.parametrize("scanned", [False, True])
def test_logits_match_transformers(path, scanned):
    model = from_hf(path)
    assert [b.self_attn.indexer is None for b in model.layers] == [False] * 3 + [True] * 2
    ids = jnp.asarray(_ids())
    ref = hf_logits(path, np.asarray(ids))
    scale = np.abs(ref).max()
    assert scale > 0.5, "oracle logits too small to make the test meaningful"
    run = stack_layers(model) if scanned else model
    if scanned:
        assert layer_counts(run) == (1, 2, 2)
    assert np.abs(np.asarray(run(ids)) - ref).max() <= TOL * scale


@pytest.mark.parametrize("topk", [4, 10 ** 6])
def test_shared_layers_without_the_shared_selection_differ(path, topk):
    """The shared layers under their own selection (top 4 of a random indexer) or under none
    (every key kept) give logits far from transformers': the test above binds the sharing."""
    ids = _ids()
    ref = hf_logits(path, ids)
    out = np.asarray(_own_indexers(from_hf(path), topk)(jnp.asarray(ids)))
    assert np.abs(out - ref).max() > 100 * TOL * np.abs(ref).max()


@pytest.mark.slow
def test_padded_batch_matches_transformers_and_unpadded(path):
    ids = _ids(b=2, t=11, seed=1)
    mask = np.array([[1] * 11, [0] * 4 + [1] * 7])
    ref = hf_logits(path, ids, attention_mask=mask)
    model = from_hf(path)
    out = np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
    real = mask.astype(bool)
    assert np.abs(out[real] - ref[real]).max() <= TOL * np.abs(ref[real]).max()
    alone = np.asarray(model(jnp.asarray(ids[1:, 4:])))[0]
    np.testing.assert_allclose(out[1, 4:], alone, rtol=0, atol=1e-5 * np.abs(alone).max())


def test_round_trip_through_to_hf(path, tmp_path):
    """Shared layers write no indexer tensors and ``indexer_types`` back; transformers loads the
    folder with no tensor missing or left over (``load_hf_model``)."""
    model = from_hf(path)
    out = str(tmp_path / "out")
    to_hf(model, out)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["indexer_types"] == ["full"] * 3 + ["shared"] * 2
    names = set()
    for file in (f for f in os.listdir(out) if f.endswith(".safetensors")):
        with safe_open(os.path.join(out, file), "np") as f:
            names |= set(f.keys())
    indexed = {int(n.split(".")[2]) for n in names if ".self_attn.indexer." in n}
    assert indexed == {0, 1, 2}
    ids = _ids()
    ref = np.asarray(model(jnp.asarray(ids)))
    hf = hf_logits(out, ids)
    again = np.asarray(from_hf(out)(jnp.asarray(ids)))
    assert np.abs(hf - ref).max() <= 1e-5 * np.abs(ref).max()
    assert np.abs(again - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("scanned", [pytest.param(False, marks=pytest.mark.slow), True])
def test_decode_over_the_cache_equals_forward(path, scanned):
    """Left-padded prompts of 11 and 8 tokens: 7 slots prefilled, then 4 one-token steps; each
    shared layer attends under the same step's selection of layer 2 (scanned: carried out of
    the stack of layers 1-2 into that of layers 3-4)."""
    model = from_hf(path)
    model = stack_layers(model) if scanned else model
    ids = jnp.asarray(_ids(b=2, t=11))
    mask = jnp.asarray(np.array([[1] * 11, [0] * 3 + [1] * 8]))
    full = np.asarray(jax.jit(lambda m, x, a: m(x, attention_mask=a))(model, ids, mask))
    cache = KVCache.zeros(model.config, 2, 11, jnp.float32, layer_counts(model))
    decoded = decoded_logits(model, ids, mask, cache, prefill=7)
    real = np.asarray(mask).astype(bool)
    assert np.abs(decoded[real] - full[real]).max() <= 1e-5 * np.abs(full[real]).max()


@pytest.mark.slow
def test_engine_logprobs_equal_learner(path):
    """The built-in engine (paged KV cache, continuous batching, prompts of 3, 11 and 6 tokens,
    12 sampled tokens each) samples and scores what the learner's log-prob step computes."""
    sampled, scored, preflight = parity(from_hf(path))
    assert sampled <= ENGINE_TOL and scored <= ENGINE_TOL and preflight <= ENGINE_TOL


def test_parameter_count_matches_transformers(path):
    assert from_hf(path).config.num_params() == load_hf_model(path).num_parameters()


@pytest.mark.parametrize("types,field", [
    (["shared", "full", "full", "shared", "shared"], r"indexer_types\[0\]='shared'"),
    (["full", "sparse", "full", "shared", "shared"], "indexer_types"),
    (["full", "shared"], "indexer_types has 2 entries")])
def test_unsupported_sharing_is_refused_naming_the_field(types, field):
    hf = hf_config(ZOO).to_dict() | {"architectures": ["GlmMoeDsaForCausalLM"]}
    with pytest.raises(ModelConfigError, match=field):
        from_hf_config(hf | {"indexer_types": types})


def test_sharing_derived_from_index_topk_freq():
    """transformers' derivation: ``index_topk_freq`` 2 with the default offset 2 makes layers 2
    and 4 of 5 "shared" (``max(i - 1, 0) % 2``: 0, 0, 1, 2, 3 -> F F S F S)."""
    hf = hf_config(ZOO).to_dict() | {"architectures": ["GlmMoeDsaForCausalLM"]}
    hf.pop("indexer_types")
    assert from_hf_config(hf | {"index_topk_freq": 2}).dsa.shared_layers == (2, 4)
    assert from_hf_config(hf | {"index_topk_pattern": "FSFFS"}).dsa.shared_layers == (1, 4)
