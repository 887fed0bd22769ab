"""gpt-oss with MXFP4 experts as it ships (``quant_method: mxfp4``): read as stored, equal to
transformers' dequantized model, written back byte for byte, streamed, and bad files refused.
The folder is written by ``tests/helpers/fp4.py`` (its own quantizer, checked here against
transformers' MXFP4 dequantizer)."""

from __future__ import annotations

import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from rlx.models.hf import param_map, read_hf_config
from rlx.models.loading import ModelSection
from rlx.models.safetensors_io import CheckpointError, SafetensorsFolder
from rlx.quant import QTensor, QuantConfig, apply_lora, load_base
from rlx.quant.config import LoraConfig
from rlx.quant.loading import load_shipped
from rlx.quant.shipped import layout, read_quantization_config
from rlx.quant.shipped_fused import write_back
from tests.helpers.fp4 import make_gpt_oss, mxfp4_dequantize
from tests.helpers.parity import TOL, parity
from tests.helpers.quant import randomize_lora_b
from tests.helpers.shipped import read_safetensors, write_safetensors

X = "model.layers.1.mlp.experts"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_gpt_oss(str(tmp_path_factory.mktemp("fp4")))


def _transformers(path: str):
    model, info = transformers.GptOssForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True),
        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def test_transformers_dequantizes_the_folder_to_the_helpers_values(folder):
    """The layout check of the test folder: transformers' own MXFP4 reader gives each expert
    stack the values the helper's decoding of its blocks and scales gives ([E, K, N])."""
    tensors = read_safetensors(os.path.join(folder, "model.safetensors"))
    experts = _transformers(folder).model.layers[1].mlp.experts
    for proj in ("gate_up_proj", "down_proj"):
        want = mxfp4_dequantize(tensors[f"{X}.{proj}_blocks"], tensors[f"{X}.{proj}_scales"])
        np.testing.assert_array_equal(getattr(experts, proj).detach().numpy(),
                                      np.swapaxes(want, -1, -2))


def test_frozen_leaves_are_the_files_bytes(folder):
    loaded, info = load_shipped(folder)
    assert (info.quant.format, info.quant.serving, info.exact) == ("mxfp4", "hf", False)
    files = read_safetensors(os.path.join(folder, "model.safetensors"))
    lay = layout(read_quantization_config(folder))
    sources = param_map(loaded.model.config)
    for i, layer in enumerate(loaded.model.layers):
        ex = layer.mlp.experts
        for parts, src in (({"even": ex.gate_proj, "odd": ex.up_proj},
                            sources[f"layers/{i}/mlp/experts/gate_proj"]),
                           ({"copy": ex.down_proj}, sources[f"layers/{i}/mlp/experts/down_proj"])):
            assert all(isinstance(q, QTensor) and q.values[...].dtype == jnp.uint8
                       and q.scale[...].dtype == jnp.uint8 for q in parts.values())
            for name, array in write_back(parts, src, lay).items():
                assert array.dtype == files[name].dtype and array.shape == files[name].shape
                assert array.tobytes() == files[name].tobytes(), name
    assert not isinstance(loaded.model.layers[0].self_attn.q_proj.kernel, QTensor)


def test_logits_equal_transformers_dequantized(folder):
    ids = np.random.default_rng(0).integers(0, 97, size=(2, 14))
    loaded, _ = load_shipped(folder)
    ours = np.asarray(loaded.model(jnp.asarray(ids)))
    with torch.no_grad():
        theirs = _transformers(folder)(torch.tensor(ids)).logits.numpy()
    err = np.abs(ours - theirs).max() / np.abs(theirs).max()
    print(f"mxfp4 gpt-oss logits vs transformers (f32): {err:.2e} relative")
    assert err <= 1e-4


@pytest.mark.slow  # 90 s on 2 cores: the engine's and the learner's gpt-oss programs compile
def test_engine_logprobs_equal_the_learners(folder):
    """Mode B over the MXFP4 experts (LoRA on attention, random B): the built-in engine's
    sampler and scorer log-probs against the learner's step, within 1e-5."""
    model = load_shipped(folder)[0].model
    apply_lora(model, LoraConfig(rank=3, alpha=5.0), nnx.Rngs(0))
    randomize_lora_b(model)
    sampled, scored, _ = parity(model)
    print(f"mxfp4 gpt-oss + LoRA f32: sampler {sampled:.2e}, score {scored:.2e}")
    assert sampled <= TOL <= 1e-5 and scored <= TOL


def test_experts_are_read_once_as_packed_bytes(folder):
    """Streamed: every blocks / scales tensor is read once, as its bytes (a float copy of an
    expert stack would be 7.5x them), and lands in uint8 leaves."""
    tensors = SafetensorsFolder(folder)
    load_shipped(folder, tensors=tensors)
    packed = [n for n in tensors if n.endswith(("_blocks", "_scales"))]
    assert len(packed) == 4 * 4
    for n in packed:
        assert tensors.bytes_read[n] == tensors.nbytes(n), n


def test_float_checkpoint_quantized_while_read_is_the_shipped_layout(folder):
    """quant.format="mxfp4" on the float folder quantizes each expert stack as it is read, to
    the bytes the helper's independent quantizer wrote into the MXFP4 folder."""
    src = os.path.join(os.path.dirname(folder), "gpt_oss_f32")
    got = load_base(ModelSection(path=src), QuantConfig(format="mxfp4", modules="experts"))[0].model
    ref = load_shipped(folder)[0].model
    a, b = dict(nnx.to_flat_state(nnx.state(ref))), dict(nnx.to_flat_state(nnx.state(got)))
    assert a.keys() == b.keys()
    for k in a:
        x, y = np.asarray(a[k][...]), np.asarray(b[k][...])
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), k


def _edit(folder: str, dst: str, fn) -> str:
    shutil.copytree(folder, dst)
    file = os.path.join(dst, "model.safetensors")
    tensors = dict(read_safetensors(file))
    fn(tensors)
    write_safetensors(file, tensors)
    return dst


def _block16(t):
    """Blocks of 16 values (8 bytes) with a scale each: the tiny model's inputs are 32 wide."""
    for proj in ("gate_up_proj", "down_proj"):
        b, s = t[f"{X}.{proj}_blocks"], t[f"{X}.{proj}_scales"]
        t[f"{X}.{proj}_blocks"] = b.reshape(*b.shape[:2], -1, 8)
        t[f"{X}.{proj}_scales"] = np.repeat(s, 2, axis=-1)


BAD = {
    "missing-scales": (lambda t: t.pop(f"{X}.down_proj_scales"),
                       rf"model.safetensors: tensor '{X}.down_proj_scales' is missing"),
    "scale-dtype": (lambda t: t.update({f"{X}.down_proj_scales": t[f"{X}.down_proj_scales"]
                                        .astype(np.float32)}),
                    rf"model.safetensors: tensor '{X}.down_proj_scales' is F32 \[4, 32, 1\], but"),
    "scale-shape": (lambda t: t.update({f"{X}.down_proj_scales": np.concatenate(
        [t[f"{X}.down_proj_scales"]] * 2, axis=-1)}),
        rf"model.safetensors: tensor '{X}.down_proj_scales' is U8 \[4, 32, 2\], but .* \[4, 32, 1\]"),
    "block-16": (_block16, rf"model.safetensors: tensor '{X}.gate_up_proj_blocks' is U8 "
                           r"\[4, 64, 2, 8\].*\(16 values a block; mxfp4 has 32\)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused_naming_file_and_tensor(folder, tmp_path, case):
    edit, match = BAD[case]
    path = _edit(folder, str(tmp_path / "ckpt"), edit)
    with pytest.raises(CheckpointError, match=match) as e:
        load_shipped(path)
    assert "\n" not in str(e.value)
    assert read_hf_config(path).moe.num_experts == 4


def test_the_host_never_holds_an_expert_stack_in_float(tmp_path):
    """Streamed: loading an MXFP4 gpt-oss with 8 experts of 256 x 512 allocates on the host
    (tracemalloc's peak over what the loaded model keeps) less than twice the largest tensor of
    the file, while one layer's gate_up stack in f32 is 7.5x that tensor."""
    import tracemalloc

    import torch

    from tests.helpers.fp4 import gpt_oss_config, write_mxfp4

    config = gpt_oss_config()
    config.hidden_size, config.intermediate_size, config.num_local_experts = 256, 256, 8
    config.num_hidden_layers, config.layer_types = 2, ["sliding_attention", "full_attention"]
    torch.manual_seed(0)
    src, path = str(tmp_path / "f32"), str(tmp_path / "mx")
    transformers.GptOssForCausalLM(config).save_pretrained(src)
    write_mxfp4(src, path)
    folder = SafetensorsFolder(path)
    largest = max(folder.nbytes(n) for n in folder)
    stack = 8 * 256 * 512 * 4  # one layer's gate_up experts in f32
    tracemalloc.start()
    load_shipped(path, tensors=folder)
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"mxfp4 load: host peak over kept {peak - kept} B, largest tensor {largest} B, "
          f"an f32 gate_up stack {stack} B")
    assert peak - kept < 2 * largest < stack / 3, (peak, kept, largest, stack)


@pytest.mark.slow  # 55 s on 2 busy cores (two transformers loads, one more compile)
def test_exported_for_serving_as_its_dequantized_floats(folder, tmp_path):
    """The base's serving layout ("hf"): float weights transformers loads, the experts the very
    values transformers dequantizes from the MXFP4 folder (the same logits within 1e-4)."""
    from rlx.io.export import export_base

    loaded, info = load_shipped(folder)
    out = export_base(loaded.model, info.quant, str(tmp_path / "base"), "v1")
    served = read_safetensors(os.path.join(out, "model.safetensors"))
    experts = _transformers(folder).model.layers[1].mlp.experts
    np.testing.assert_array_equal(served[f"{X}.gate_up_proj"],
                                  experts.gate_up_proj.detach().numpy())
    ids = np.random.default_rng(1).integers(0, 97, size=(1, 10))
    ours = np.asarray(loaded.model(jnp.asarray(ids)))
    with torch.no_grad():
        theirs = transformers.GptOssForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(
            torch.tensor(ids)).logits.numpy()
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() <= 1e-4
