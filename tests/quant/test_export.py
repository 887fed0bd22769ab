"""Export: quantize -> export -> reload is bit-identical per serving layout; merged HF export;
atomic, versioned publishing."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.io.export import export_base, export_merged, publish, read_version
from rlx.models import from_hf
from rlx.quant import QuantConfig, QuantWeight, load_quantized, quantize_model
from rlx.quant.serving import pack_int32, unpack_int32
from tests.helpers.hf_zoo import make_hf_model
from tests.helpers.quant import ids, quantized_lora_model


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zoo"))


CONFIGS = {
    "int8-w8a8": QuantConfig(format="int8", serving="w8a8_int8"),
    "int8-ct": QuantConfig(format="int8", serving="compressed-tensors"),
    "int4-ct": QuantConfig(format="int4", group_size=8, serving="compressed-tensors"),
    "int4-asym-ct": QuantConfig(format="int4", group_size=8, symmetric=False, serving="compressed-tensors"),
    "int4-bf16-scales": QuantConfig(format="int4", group_size=8, scale_dtype="bfloat16",
                                    serving="compressed-tensors"),
    "fp8-channel": QuantConfig(format="fp8", serving="fp8"),
    "fp8-block128": QuantConfig(format="fp8", fp8_granularity="block128", serving="fp8"),
}


def _bits(x) -> np.ndarray:
    return np.asarray(x).view(np.uint8)


@pytest.mark.parametrize("family", ["llama", "qwen2_moe"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_round_trip_bit_identical(zoo, tmp_path, family, name):
    q = CONFIGS[name]
    model = quantize_model(from_hf(make_hf_model(family, zoo)), q)
    out = export_base(model, q, str(tmp_path / "base"), "step-7")
    loaded, q2 = load_quantized(out)
    before = nnx.to_flat_state(nnx.state(model, QuantWeight))
    after = dict(nnx.to_flat_state(nnx.state(loaded.model, QuantWeight)))
    assert len(before) == len(after) > 0
    for path, var in before:
        assert after[path][...].dtype == var[...].dtype, path
        assert np.array_equal(_bits(after[path][...]), _bits(var[...])), path
    assert q2.activation_mode == q.activation_mode and read_version(out) == "step-7"
    x = jnp.asarray(ids())
    assert np.array_equal(np.asarray(model(x)), np.asarray(loaded.model(x)))


def test_serving_config_names_the_layout(zoo, tmp_path):
    q = CONFIGS["fp8-block128"]
    model = quantize_model(from_hf(make_hf_model("llama", zoo)), q)
    out = export_base(model, q, str(tmp_path / "b"), "v1")
    with open(os.path.join(out, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [128, 128]}


def test_int32_packing_golden():
    # 8 nibbles 1..8, lowest bits first: 0x87654321
    packed = pack_int32(np.arange(1, 9, dtype=np.uint8)[None], 4)
    assert packed.view(np.uint32)[0, 0] == 0x87654321
    u = np.random.RandomState(0).randint(0, 16, (3, 20)).astype(np.uint8)
    assert np.array_equal(unpack_int32(pack_int32(u, 4), 4, 20), u)


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_merged_export_loads_in_transformers(zoo, tmp_path, family):
    import torch
    import transformers

    model = quantized_lora_model(zoo, family)
    out = export_merged(model, str(tmp_path / "merged"), "v3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = ids()
    with torch.no_grad():
        ref = hf(torch.tensor(x)).logits.numpy()
    assert np.abs(np.asarray(model(jnp.asarray(x))) - ref).max() <= 1e-4
    assert read_version(out) == "v3"


def test_publish_is_atomic_and_replaces(tmp_path):
    target = str(tmp_path / "pub")
    publish(target, "1", "peft", lambda d: open(os.path.join(d, "a.txt"), "w").write("one") and None)
    with pytest.raises(RuntimeError):
        def broken(d):
            open(os.path.join(d, "a.txt"), "w").write("half")
            raise RuntimeError("disk full")
        publish(target, "2", "peft", broken)
    assert read_version(target) == "1" and open(os.path.join(target, "a.txt")).read() == "one"
    publish(target, "3", "peft", lambda d: open(os.path.join(d, "a.txt"), "w").write("three") and None)
    assert read_version(target) == "3" and open(os.path.join(target, "a.txt")).read() == "three"
    assert sorted(os.listdir(tmp_path)) == ["pub"]  # no temp or old folders left behind
