"""rlx logits vs HF transformers (the oracle) for every supported family, in float32.

Tolerances: 1e-4 max |logit difference| for HF -> rlx (logits are O(1) by construction, see
hf_zoo); 1e-5 for the rlx -> to_hf -> rlx/transformers round trip and for packed vs separate
sequences.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from rlx.models import from_hf, to_hf
from rlx.models.hf import read_hf_config
from rlx.models.moe import CorrectionBias
from rlx.platform.policy import CPU, active
from tests.helpers.hf_zoo import FAMILIES, SIGMOID_ROUTED, hf_logits, make_hf_model

TOL = 1e-4
# attention under the CPU policy (sequences of up to 512 slots attend densely) and forced blockwise
# in 16-token blocks (rlx.kernels.attention): the same logits either way
ATTENTION = {"dense": CPU, "blockwise": dataclasses.replace(CPU, dense_attention_slots=0,
                                                            attention_block=16)}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zoo"))


def _ids(b=3, t=9, seed=0):
    return np.random.RandomState(seed).randint(0, 97, (b, t))


def _ci(family: str, *args, fast: bool = False, short: bool = False):
    """A parameter case; gpt-oss's are ``slow`` unless ``fast`` (the CI runs its long
    blockwise cases, where window and sinks meet the query blocks, and the round trip), and so
    is every family's ``short`` case that a longer case of the same test covers (the CI runs the
    long ones, the slow marker both)."""
    marks = pytest.mark.slow if short or family == "gpt_oss" and not fast else ()
    return pytest.param(family, *args, marks=marks)


LOGITS = [_ci(f, n, a, fast=a == "blockwise", short=n < 100) for f in FAMILIES
          for n, a in [(9, "dense"), (100, "dense"), (100, "blockwise")]]


@pytest.mark.parametrize("family, length, attention", LOGITS)
def test_logits_match_hf(zoo, family, length, attention):
    path = make_hf_model(family, zoo)
    ids = _ids(t=length)
    ref = hf_logits(path, ids)
    assert np.abs(ref).max() > 0.5, "oracle logits too small to make the test meaningful"
    with active(ATTENTION[attention]):
        out = np.asarray(from_hf(path)(jnp.asarray(ids)))
    assert np.abs(out - ref).max() <= TOL


# the long batch (3 query blocks) once per attention kind of the DeepSeek / GLM / YaRN variants
_SHORT_ONLY = ("deepseek_v2_lite", "kimi_k2", "glm4_moe_plain", "qwen3_yarn")
_PADDED = [(f, lengths, "dense", lengths[0] < 100 and f not in _SHORT_ONLY)
           for f in FAMILIES for lengths in [(8, 5, 3), (100, 70, 37)]
           if lengths[0] < 100 or f not in _SHORT_ONLY]
_PADDED += [(f, (100, 70, 37), "blockwise", False) for f in FAMILIES if f not in _SHORT_ONLY]
# each case runs both sides; the CI runs one: dense right-padded (the learner's batches),
# blockwise left-padded (the engine's prompts)
PADDED = [_ci(f, side, lengths, a, fast=a == "blockwise",
              short=short or side != ("right" if a == "dense" else "left"))
          for f, lengths, a, short in _PADDED for side in ("right", "left")]


@pytest.mark.parametrize("family, side, lengths, attention", PADDED)
def test_padded_batch_matches_hf(zoo, family, side, lengths, attention):
    path = make_hf_model(family, zoo)
    ids = _ids(3, lengths[0], seed=1)
    lengths = np.array(lengths)
    mask = np.zeros_like(ids)
    for r, n in enumerate(lengths):
        if side == "right":
            mask[r, :n] = 1
        else:
            mask[r, -n:] = 1
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    ref = hf_logits(path, ids, attention_mask=mask, position_ids=positions)
    with active(ATTENTION[attention]):
        out = np.asarray(from_hf(path)(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
    real = mask.astype(bool)
    assert np.abs(out[real] - ref[real]).max() <= TOL
    # each padded row equals the same sequence run alone, unpadded
    for r, n in enumerate(lengths):
        alone = ids[r][real[r]][None]
        assert np.abs(out[r][real[r]] - hf_logits(path, alone)[0]).max() <= TOL


# the CI runs the 3-block blockwise case of each family and qwen3_moe's dense one
PACKED = [_ci(f, *case, fast=case[2] == "blockwise",
              short=case[0] < 60 or case[2] == "dense" and f != "qwen3_moe")
          for f in ["qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss"]
          for case in [(5, 4, "dense"), (60, 50, "dense"), (60, 50, "blockwise")]]  # 112: 3 blocks


@pytest.mark.parametrize("family, n_a, n_b, attention", PACKED)
def test_packed_equals_separate(zoo, family, n_a, n_b, attention):
    with active(ATTENTION[attention]):
        _packed_equals_separate(zoo, family, n_a, n_b)


def _packed_equals_separate(zoo, family, n_a, n_b):
    path = make_hf_model(family, zoo)
    model = from_hf(path)
    a, b = _ids(1, n_a, seed=2)[0], _ids(1, n_b, seed=3)[0]
    packed = np.concatenate([a, b, [0, 0]])[None]
    segments = np.array([[1] * n_a + [2] * n_b + [0, 0]])
    positions = np.array([list(range(n_a)) + list(range(n_b)) + [0, 0]])
    forward = jax.jit(lambda m, ids, pos=None, seg=None: m(ids, positions=pos, segment_ids=seg))
    out = np.asarray(forward(model, jnp.asarray(packed), jnp.asarray(positions),
                             jnp.asarray(segments)))
    sep_a = np.asarray(forward(model, jnp.asarray(a[None])))[0]
    sep_b = np.asarray(forward(model, jnp.asarray(b[None])))[0]
    assert np.abs(out[0, :n_a] - sep_a).max() <= 1e-5
    assert np.abs(out[0, n_a:n_a + n_b] - sep_b).max() <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_through_to_hf(zoo, family, tmp_path):
    path = make_hf_model(family, zoo)
    ids = _ids(2, 6, seed=4)
    model = from_hf(path)
    ours = np.asarray(model(jnp.asarray(ids)))
    to_hf(model, str(tmp_path / "export"))
    theirs = hf_logits(str(tmp_path / "export"), ids)
    assert np.abs(theirs - ours).max() <= 1e-5
    again = np.asarray(from_hf(str(tmp_path / "export"))(jnp.asarray(ids)))
    assert np.abs(again - ours).max() <= 1e-5


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3", "glm4_moe", _ci("gpt_oss")])
def test_moe_ragged_equals_dense(zoo, family):
    path = make_hf_model(family, zoo)
    ids = jnp.asarray(_ids(2, 7, seed=5))
    forward = jax.jit(lambda m, x: m(x))
    ragged = np.asarray(forward(from_hf(path, moe_impl="ragged"), ids))
    dense = np.asarray(forward(from_hf(path, moe_impl="dense"), ids))
    assert np.abs(ragged - dense).max() <= 1e-5


@pytest.mark.parametrize("family", SIGMOID_ROUTED)
def test_correction_bias_decides_the_experts(zoo, family):
    """The zoo's correction bias changes which experts run: without it rlx is far from HF, so
    the parity tests above check the bias's use (selection only; the gates ignore it)."""
    path = make_hf_model(family, zoo)
    ids = _ids(2, 12, seed=6)
    model = from_hf(path)
    for _, var in nnx.iter_graph(model):
        if isinstance(var, CorrectionBias):
            assert np.abs(np.asarray(var[...])).max() > 0.1
            var.set_value(jnp.zeros_like(var[...]))
    unbiased = np.asarray(jax.jit(lambda m, x: m(x))(model, jnp.asarray(ids)))
    assert np.abs(unbiased - hf_logits(path, ids)).max() > 0.1


@pytest.mark.parametrize("family", FAMILIES)
def test_num_params_matches_transformers(zoo, family):
    path = make_hf_model(family, zoo)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert read_hf_config(path).num_params() == hf.num_parameters()
