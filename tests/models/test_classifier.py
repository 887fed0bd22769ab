"""Sequence classifiers (``rlx.models.classifier``) against transformers' ``*ForSequenceClassification``:
the pooled logits of a right-padded batch of variable lengths agree within 1e-4 (f32, O(1)
logits), a row ending in real pad-id tokens is scored where transformers scores it, an 8-device
mesh gives one device's logits, and what is not such a checkpoint is refused in one line."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from rlx.mesh import MeshShape, make_mesh
from rlx.models.classifier import Scorer, classify, load_classifier
from rlx.models.safetensors_io import CheckpointError
from tests.helpers.classifiers import hf_classifier_logits, make_classifier
from tests.helpers.hf_zoo import make_hf_model

PAD = 0
LENGTHS = (7, 19, 3, 12, 16)


def _batch(vocab: int):
    """Token lists of ``LENGTHS`` (ids 1..vocab-1; the fourth ends in two real pad-id tokens,
    which transformers skips: it scores the rightmost non-pad token), and the same right-padded
    with its attention mask."""
    rng = np.random.default_rng(0)
    tokens = [rng.integers(1, vocab, n).tolist() for n in LENGTHS]
    tokens[3][-2:] = [PAD, PAD]
    ids = np.full((len(tokens), max(LENGTHS)), PAD, np.int64)
    mask = np.zeros_like(ids)
    for i, t in enumerate(tokens):
        ids[i, :len(t)], mask[i, :len(t)] = t, 1
    return tokens, ids, mask


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_logits_equal_transformers_on_a_padded_batch(family, tmp_path):
    path = make_classifier(family, str(tmp_path), num_labels=3, pad_token_id=PAD)
    model = load_classifier(path)
    tokens, ids, mask = _batch(model.body.config.vocab_size)
    want = hf_classifier_logits(path, ids, mask)  # [5, 3]
    got = classify(Scorer(model), tokens, batch_size=2, max_length=64)  # 3 batches of 2 rows
    assert got.shape == want.shape == (5, 3)
    assert np.abs(want).max() > 0.1  # O(1) logits: a wrong token or layout shows far above 1e-4
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_an_eight_device_mesh_gives_one_devices_logits(tmp_path):
    path = make_classifier("llama", str(tmp_path))
    tokens, _, _ = _batch(97)
    single = classify(Scorer(load_classifier(path)), tokens, batch_size=4, max_length=64)
    mesh = make_mesh(MeshShape(data=2, fsdp=2, tensor=2))
    model = load_classifier(path, mesh)
    embed, score = model.body.embed[...], model.score[...]
    assert len(embed.sharding.device_set) == 8 and embed.addressable_shards[0].data.shape == (97, 16)
    assert score.addressable_shards[0].data.shape == (16, 3)  # hidden split over fsdp
    sharded = classify(Scorer(model, mesh), tokens, batch_size=4, max_length=64)
    np.testing.assert_allclose(sharded, single, atol=1e-5, rtol=0)


def test_what_is_no_sequence_classifier_is_refused(tmp_path):
    causal = make_hf_model("llama", str(tmp_path))
    with pytest.raises(CheckpointError, match=r"architectures=\['LlamaForCausalLM'\] is not a "
                                              r"sequence classifier.*'Qwen3ForSequenceClassification'"):
        load_classifier(causal)
    path = make_classifier("qwen2", str(tmp_path))
    headless = str(tmp_path / "headless")
    shutil.copytree(path, headless)
    file = os.path.join(headless, "model.safetensors")
    tensors = load_file(file)
    save_file({k: v for k, v in tensors.items() if k != "score.weight"}, file, {"format": "pt"})
    with pytest.raises(CheckpointError, match=r"no 'score.weight' tensor") as e:
        load_classifier(headless)
    assert "\n" not in str(e.value)
    save_file({**tensors, "score.weight": tensors["score.weight"][:2]}, file, {"format": "pt"})
    with pytest.raises(CheckpointError, match=r"has shape \[2, 32\], but config.json implies \[3, 32\]"):
        load_classifier(headless)
