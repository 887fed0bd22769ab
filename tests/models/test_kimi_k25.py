"""Kimi-K2.5 / K2.6's language model loaded from its vision-language checkpoint
(``Kimi_K25ForConditionalGeneration``) against transformers' own class on text-only input, f32.

Tolerances: max |logit difference| <= 1e-4 relative to the largest oracle logit (about 1 here,
hf_zoo makes logits O(1)) for HF -> rlx; 1e-5 for the rlx -> to_hf -> transformers / rlx round
trip. ``to_hf`` writes the language model alone, as ``DeepseekV3ForCausalLM``: rlx never reads
the vision tower, so it has nothing of it to write (``rlx.models.families.kimi_k25``).
"""

import json
import logging
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from rlx.models import ModelConfigError, from_hf, to_hf
from rlx.models.hf import param_map, read_hf_config, stored_param_map
from rlx.models.loading import ModelSection
from rlx.quant import QTensor, QuantConfig, load_base
from tests.helpers.hf_zoo import hf_logits, load_hf_model, make_hf_model
from tests.helpers.shipped import KIMI_IGNORE, Scheme, write_dequantized, write_shipped

TOL = 1e-4


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return make_hf_model("kimi_k25", str(tmp_path_factory.mktemp("zoo")))


def _ids(b=3, t=9, seed=0):
    return np.random.RandomState(seed).randint(0, 97, (b, t))


@pytest.mark.parametrize("length", [9, 100])
def test_language_model_logits_match_transformers(kimi, length):
    ids = _ids(t=length)
    ref = hf_logits(kimi, ids)  # Kimi_K25ForConditionalGeneration, text-only input
    scale = np.abs(ref).max()
    assert scale > 0.5, "oracle logits too small to make the test meaningful"
    out = np.asarray(from_hf(kimi, text_only=True)(jnp.asarray(ids)))
    assert np.abs(out - ref).max() <= TOL * scale


def test_the_checkpoint_stores_the_language_model_under_its_prefix(kimi):
    """The tensors rlx reads are the language model's under ``language_model.``, as the file
    holds them; the vision tower's and the projector's are in the file and not read."""
    cfg = read_hf_config(kimi, text_only=True)
    stored = {n for s in stored_param_map(cfg).values() for n in s.hf_names}
    with open(os.path.join(kimi, "model.safetensors"), "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    names = set(header) - {"__metadata__"}
    assert stored <= names and "language_model.lm_head.weight" in stored
    assert all(n.startswith(("vision_tower.", "mm_projector.", "model.mm_projector."))
               for n in names - stored)
    assert {n for s in param_map(cfg).values() for n in s.hf_names} == {
        n.removeprefix("language_model.") for n in stored}


def test_num_params_is_the_language_model(kimi):
    hf = load_hf_model(kimi)
    language = sum(p.numel() for n, p in hf.named_parameters()
                   if n.startswith(("model.language_model.", "lm_head.")))
    assert read_hf_config(kimi, text_only=True).num_params() == language
    assert language < hf.num_parameters()  # the vision tower and the projector are the rest


def test_round_trip_writes_the_language_model(kimi, tmp_path):
    ids = _ids(2, 6, seed=4)
    model = from_hf(kimi, text_only=True)
    ours = np.asarray(model(jnp.asarray(ids)))
    out = str(tmp_path / "export")
    to_hf(model, out)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["architectures"] == ["DeepseekV3ForCausalLM"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(ids)).logits.numpy()
    assert np.abs(theirs - ours).max() <= 1e-5
    again = np.asarray(from_hf(out)(jnp.asarray(ids)))
    assert np.abs(again - ours).max() <= 1e-5


def test_the_vision_tower_is_refused_unless_text_only(kimi, caplog):
    with pytest.raises(ModelConfigError, match=r"vision_config.*Kimi_K25ForConditionalGeneration"
                       r".*vision_tower.*text_only=True"):
        from_hf(kimi)
    with caplog.at_level(logging.INFO, logger="rlx.models.config"):
        read_hf_config(kimi, text_only=True)
    assert "skipping the vision tower" in caplog.text


def _config_only(tmp_path, kimi, **text) -> str:
    """A folder with the zoo model's config.json, ``text`` set in its text_config, no weights."""
    with open(os.path.join(kimi, "config.json")) as f:
        hf = json.load(f)
    hf["text_config"].update(text)
    folder = tmp_path / "config_only"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf))
    return str(folder)


@pytest.mark.parametrize("field, value, supported", [
    ("scoring_func", "softmax", r"\['sigmoid'\]"),
    ("model_type", "qwen3", r"\['deepseek_v3', 'kimi_k2'\]"),
])
def test_an_option_rlx_lacks_is_refused_before_any_weight(kimi, tmp_path, field, value, supported):
    """The folder holds no weights: the refusal comes from config.json alone."""
    path = _config_only(tmp_path, kimi, **{field: value})
    with pytest.raises(ModelConfigError, match=rf"{field}='{value}' is not supported.*{supported}"):
        from_hf(path, text_only=True)


def test_int4_experts_load_as_shipped(kimi, tmp_path):
    """The release's layout: routed experts in compressed-tensors pack-quantized int4 (symmetric,
    groups of 32; attention, dense and shared MLPs, lm_head and the vision tower float), its
    ``quantization_config`` in the text config. ``quant.format="shipped"`` keeps the experts as
    the file's int4 and gives transformers' logits on the dequantized float model (1e-4)."""
    s = Scheme("pack", bits=4, group=32, ignore=KIMI_IGNORE)
    path = write_shipped(kimi, str(tmp_path / "int4"), s)
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    hf["text_config"]["quantization_config"] = hf.pop("quantization_config")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    loaded, q = load_base(ModelSection(path=path, text_only=True), QuantConfig(format="shipped"))
    assert q.modules == "experts" and q.serving == "compressed-tensors"
    quantized = {"/".join(map(str, p)) for p, n in nnx.iter_graph(loaded.model)
                 if isinstance(n, QTensor)}
    assert quantized and all("/mlp/experts/" in p for p in quantized), quantized
    ids = _ids(2, 7, seed=5)
    ref = hf_logits(write_dequantized(kimi, path, str(tmp_path / "deq"), s), ids)
    out = np.asarray(loaded.model(jnp.asarray(ids)))
    assert np.abs(out - ref).max() <= TOL * np.abs(ref).max()
