"""NVFP4 as ModelOpt exports it (``quant_method: modelopt``, ``quant_algo: NVFP4``): the format's
quantizer against ModelOpt's formula (numpy, ``tests/helpers/fp4.py``) and compressed-tensors'
packing, a shipped folder read as stored and written back byte for byte, logits against
transformers on the same values in f32 (transformers reads no NVFP4), the engine against the
learner, a float checkpoint quantized while read, and bad files refused."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
from compressed_tensors.quantization.utils.helpers import generate_gparam
from flax import nnx

from rlx.mesh import MeshShape, make_mesh
from rlx.models import from_hf
from rlx.models.hf import read_hf_config
from rlx.models.loading import ModelSection
from rlx.models.safetensors_io import CheckpointError, SafetensorsFolder
from rlx.plan.memory import state_bytes
from rlx.plan.spec import PlanSpec, abstract_model
from rlx.quant import QTensor, QuantConfig, QuantConfigError, apply_lora, load_base, quantize_model
from rlx.quant.config import LoraConfig
from rlx.quant.formats.layouts.modelopt import write_back
from rlx.quant.formats.nvfp4 import NVFP4
from rlx.quant.loading import load_shipped
from rlx.quant.tensors import quantize_array
from tests.helpers.fp4 import NVFP4_CONFIG, nvfp4_dequantize, nvfp4_quantize, write_nvfp4
from tests.helpers.hf_zoo import hf_logits, make_hf_model
from tests.helpers.parity import TOL, parity
from tests.helpers.quant import randomize_lora_b
from tests.helpers.shipped import read_safetensors, write_safetensors

Q = "model.layers.1.self_attn.q_proj"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("nvfp4"))
    src = make_hf_model("llama", root)
    out = {"float": src, "nvfp4": os.path.join(root, "nvfp4"), "deq": os.path.join(root, "deq"),
           "hqc": os.path.join(root, "hqc")}
    write_nvfp4(src, out["nvfp4"], out["deq"])
    write_nvfp4(src, out["hqc"], os.path.join(root, "deq2"), hf_quant_config=True)
    return out


def test_nvfp4_quantizes_as_modelopt_and_packs_as_compressed_tensors():
    w = np.random.default_rng(0).normal(size=(24, 64)).astype(np.float32)  # HF [N, K]
    w[3, :16] = 0  # a zero block: scale 1
    want = nvfp4_quantize(w)
    qt = quantize_array(w.T, "nvfp4")  # rlx's kernel [K, N]
    leaves = {k: np.asarray(v) for k, v in qt.leaves().items()}
    for name, array in write_back(leaves, "x").items():
        assert array.tobytes() == want[name.split(".")[-1]].tobytes(), name
    values = nvfp4_dequantize({**want, "weight_scale": np.ones_like(want["weight_scale"]),
                               "weight_scale_2": np.float32(1)})  # the E2M1 values [N, K]
    assert np.array_equal(pack_fp4_to_uint8(torch.from_numpy(values)).numpy(), want["weight"])
    unpacked = unpack_fp4_from_uint8(torch.from_numpy(want["weight"]), 24, 64, torch.float32)
    np.testing.assert_array_equal(unpacked.numpy(), np.asarray(qt.decode()).T)
    amax = torch.tensor(np.abs(w).max())
    gparam = generate_gparam(-amax, amax).item()  # compressed-tensors: 448 * 6 / amax
    np.testing.assert_allclose(1.0 / gparam, leaves["scale2"].item(), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(qt.dequantize()).T, nvfp4_dequantize(want), rtol=1e-6)
    assert NVFP4.bytes_per_param(QuantConfig(format="nvfp4"), 64, 64) * 8 == pytest.approx(4.5, abs=0.01)


def test_frozen_leaves_are_the_files_bytes(folders):
    model = load_shipped(folders["nvfp4"])[0].model
    files = read_safetensors(os.path.join(folders["nvfp4"], "model.safetensors"))
    checked = 0
    for i, layer in enumerate(model.layers):
        for part, lin in [("self_attn", x) for x in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
                         [("mlp", x) for x in ("gate_proj", "up_proj", "down_proj")]:
            k = getattr(getattr(layer, part), lin).kernel
            name = f"model.layers.{i}.{part}.{lin}"
            if lin == "down_proj":  # exclude_modules "*.mlp.down_proj": float
                assert not isinstance(k, QTensor)
                continue
            assert k.values[...].dtype == jnp.uint8 and k.scale[...].dtype == jnp.float8_e4m3fn
            leaves = {n: np.asarray(v) for n, v in k.leaves().items()}
            for t, array in write_back(leaves, name).items():
                assert array.dtype == files[t].dtype and array.tobytes() == files[t].tobytes(), t
                checked += 1
    assert checked == 2 * 6 * 3


@pytest.mark.parametrize("which", ["nvfp4", "hqc"])
def test_logits_equal_transformers_on_the_same_values(folders, which):
    ids = np.random.default_rng(0).integers(0, 97, size=(2, 12))
    loaded, info = load_shipped(folders[which])
    assert (info.quant.format, info.quant.serving) == ("nvfp4", "hf")
    ours = np.asarray(loaded.model(jnp.asarray(ids)))
    theirs = np.asarray(hf_logits(folders["deq"], ids))
    err = np.abs(ours - theirs).max() / np.abs(theirs).max()
    print(f"nvfp4 llama logits vs transformers on the dequantized values (f32): {err:.2e}")
    assert err <= 1e-4


@pytest.mark.slow  # 40 s on 2 cores (the engine's programs compile)
def test_engine_logprobs_equal_the_learners(folders):
    model = load_shipped(folders["nvfp4"])[0].model
    apply_lora(model, LoraConfig(rank=3, alpha=5.0), nnx.Rngs(0))
    randomize_lora_b(model)
    sampled, scored, _ = parity(model)
    print(f"nvfp4 llama + LoRA f32: sampler {sampled:.2e}, score {scored:.2e}")
    assert sampled <= TOL and scored <= TOL


def test_quantized_linears_are_read_once_as_packed_bytes(folders):
    tensors = SafetensorsFolder(folders["nvfp4"])
    load_shipped(folders["nvfp4"], tensors=tensors)
    packed = [n for n in tensors if n.endswith(("weight_scale", "weight_scale_2"))
              or tensors.dtype_name(n) == "U8"]
    assert len(packed) == 3 * 6 * 2
    for n in packed:
        assert tensors.bytes_read[n] == tensors.nbytes(n), n


def test_the_planner_counts_4_5_bits_per_weight(folders):
    arch = read_hf_config(folders["float"])
    plain = PlanSpec(model=arch, quant=QuantConfig(), param_dtype="float32", dtype="float32")
    spec = dataclasses.replace(plain, quant=QuantConfig(format="nvfp4"))
    kernels = [t for _, t in nnx.iter_graph(abstract_model(spec)) if isinstance(t, QTensor)]
    assert kernels and all(t.fmt == "nvfp4" for t in kernels)
    # per [K, N] kernel: 4 bytes a weight in f32; 0.5 + 1/16 in nvfp4, plus its 4-byte scale_2
    saved = sum(t.kn[0] * t.kn[1] * 4 - (t.kn[0] * t.kn[1] * (0.5 + 1 / 16) + 4) for t in kernels)
    assert state_bytes(plain)["frozen"] - state_bytes(spec)["frozen"] == pytest.approx(saved)


def test_float_checkpoint_quantized_while_read(folders):
    """quant.format="nvfp4" quantizes each linear as it is read: the bytes ModelOpt's formula
    gives (the helper's folder), and on 8 devices the very leaves quantize_model gives."""
    q = QuantConfig(format="nvfp4")
    files = read_safetensors(os.path.join(folders["nvfp4"], "model.safetensors"))
    got = load_base(ModelSection(path=folders["float"]), q)[0].model
    k = got.layers[1].self_attn.q_proj.kernel
    for t, array in write_back({n: np.asarray(v) for n, v in k.leaves().items()}, Q).items():
        assert array.tobytes() == files[t].tobytes(), t
    mesh = make_mesh(MeshShape(fsdp=2, tensor=2, expert=2))
    ref = quantize_model(from_hf(folders["float"], mesh=mesh), q, mesh=mesh)
    got = load_base(ModelSection(path=folders["float"]), q, mesh)[0].model
    a, b = dict(nnx.to_flat_state(nnx.state(ref))), dict(nnx.to_flat_state(nnx.state(got)))
    assert a.keys() == b.keys()
    for key in a:
        assert np.asarray(a[key][...]).tobytes() == np.asarray(b[key][...]).tobytes(), key


def _edit(src: str, dst: str, fn) -> str:
    shutil.copytree(src, dst)
    file = os.path.join(dst, "model.safetensors")
    tensors = dict(read_safetensors(file))
    fn(tensors)
    write_safetensors(file, tensors)
    return dst


BAD = {
    "missing-global-scale": (lambda t: t.pop(f"{Q}.weight_scale_2"),
                             rf"model.safetensors: tensor '{Q}.weight_scale_2' is missing"),
    "scale-dtype": (lambda t: t.update({f"{Q}.weight_scale": t[f"{Q}.weight_scale"]
                                        .astype(np.float32)}),
                    rf"model.safetensors: tensor '{Q}.weight_scale' is F32 \[32, 2\], but"),
    "scale-shape": (lambda t: t.update({f"{Q}.weight_scale": np.ascontiguousarray(
        t[f"{Q}.weight_scale"][:, :1])}),
        rf"model.safetensors: tensor '{Q}.weight_scale' is F8_E4M3 \[32, 1\], but .* \[32, 2\]"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused_naming_file_and_tensor(folders, tmp_path, case):
    edit, match = BAD[case]
    with pytest.raises(CheckpointError, match=match) as e:
        load_shipped(_edit(folders["nvfp4"], str(tmp_path / "ckpt"), edit))
    assert "\n" not in str(e.value)


def test_a_group_size_other_than_16_is_refused(folders, tmp_path):
    path = str(tmp_path / "g32")
    shutil.copytree(folders["nvfp4"], path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = dict(NVFP4_CONFIG, group_size=32)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(QuantConfigError, match=r"quant_method='modelopt': group_size=32"):
        load_shipped(path)
