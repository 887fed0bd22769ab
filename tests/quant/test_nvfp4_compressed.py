"""compressed-tensors' ``nvfp4-pack-quantized`` (written by compressed-tensors 0.20.0 itself,
``tests/helpers/fp4.py``): read as stored and written back byte for byte, logits against
transformers on compressed-tensors' own f32 dequantization, the engine against the learner, bad
files refused."""

from __future__ import annotations

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.models.safetensors_io import CheckpointError
from rlx.quant import QTensor, QuantConfigError, apply_lora
from rlx.quant.config import LoraConfig
from rlx.quant.formats.layouts.compressed_tensors import write_back_nvfp4
from rlx.quant.loading import load_shipped
from tests.helpers.fp4 import ct_nvfp4_config, write_ct_nvfp4
from tests.helpers.hf_zoo import hf_logits, make_hf_model
from tests.helpers.parity import TOL, parity
from tests.helpers.quant import randomize_lora_b
from tests.helpers.shipped import read_safetensors, write_safetensors

Q = "model.layers.1.self_attn.q_proj"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ctfp4"))
    out = {"ct": os.path.join(root, "ct"), "deq": os.path.join(root, "deq")}
    write_ct_nvfp4(make_hf_model("llama", root), out["ct"], out["deq"])
    return out


def test_frozen_leaves_are_the_files_bytes(folders):
    loaded, info = load_shipped(folders["ct"])
    assert (info.quant.format, info.quant.serving) == ("nvfp4-ct", "hf")
    files = read_safetensors(os.path.join(folders["ct"], "model.safetensors"))
    checked = 0
    for i, layer in enumerate(loaded.model.layers):
        for part, lin in [("self_attn", x) for x in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
                         [("mlp", x) for x in ("gate_proj", "up_proj", "down_proj")]:
            k = getattr(getattr(layer, part), lin).kernel
            assert isinstance(k, QTensor) and k.fmt == "nvfp4-ct"
            leaves = {n: np.asarray(v) for n, v in k.leaves().items()}
            for t, array in write_back_nvfp4(leaves, f"model.layers.{i}.{part}.{lin}").items():
                assert array.dtype == files[t].dtype and array.shape == files[t].shape, t
                assert array.tobytes() == files[t].tobytes(), t
                checked += 1
    assert checked == 2 * 7 * 3


def test_logits_equal_transformers_on_compressed_tensors_dequantization(folders):
    ids = np.random.default_rng(0).integers(0, 97, size=(2, 12))
    ours = np.asarray(load_shipped(folders["ct"])[0].model(jnp.asarray(ids)))
    theirs = np.asarray(hf_logits(folders["deq"], ids))
    err = np.abs(ours - theirs).max() / np.abs(theirs).max()
    print(f"nvfp4-pack-quantized llama logits vs transformers (f32): {err:.2e}")
    assert err <= 1e-4


@pytest.mark.slow  # 40 s on 2 cores (the engine's programs compile)
def test_engine_logprobs_equal_the_learners(folders):
    model = load_shipped(folders["ct"])[0].model
    apply_lora(model, LoraConfig(rank=3, alpha=5.0), nnx.Rngs(0))
    randomize_lora_b(model)
    sampled, scored, _ = parity(model)
    print(f"nvfp4-pack-quantized llama + LoRA f32: sampler {sampled:.2e}, score {scored:.2e}")
    assert sampled <= TOL and scored <= TOL


def test_a_missing_global_scale_is_refused_naming_file_and_tensor(folders, tmp_path):
    path = str(tmp_path / "ckpt")
    shutil.copytree(folders["ct"], path)
    file = os.path.join(path, "model.safetensors")
    tensors = dict(read_safetensors(file))
    del tensors[f"{Q}.weight_global_scale"]
    write_safetensors(file, tensors)
    with pytest.raises(CheckpointError, match=rf"model.safetensors: tensor "
                                              rf"'{Q}.weight_global_scale' is missing"):
        load_shipped(path)


def test_a_group_size_other_than_16_is_refused(folders, tmp_path):
    path = str(tmp_path / "g32")
    shutil.copytree(folders["ct"], path)
    qc = ct_nvfp4_config()
    qc["config_groups"]["group_0"]["weights"]["group_size"] = 32
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(config, quantization_config=qc), f)
    with pytest.raises(QuantConfigError, match=r"nvfp4 group_size=32"):
        load_shipped(path)
