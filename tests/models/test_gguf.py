"""Tests for rlx.models.gguf: parity with transformers' own GGUF loader, and the error paths.

Oracles: transformers dequantizes and renames a GGUF itself (`from_pretrained(dir, gguf_file=...)`);
on the real SmolLM2 file and on tiny synthetic files of every supported type and architecture our
tensors must equal its state dict exactly. The llama q/k un-permutation is also checked against
weights we permute ourselves, row by row, the way llama.cpp's converter does.
"""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

from rlx.models.gguf import SUPPORTED_TYPES, GGUFError, read_gguf
from tests.helpers import smollm2_dir

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONFIG_FIELDS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
    "bos_token_id", "eos_token_id", "pad_token_id",
)


# ------------------------------------------------------------------------------------------ helpers
def _smollm_dir() -> str:
    return smollm2_dir()


def _hf_load(directory: str, filename: str) -> tuple[dict[str, np.ndarray], dict]:
    """transformers' reading of a GGUF: (state dict as numpy, config dict)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename)
    state = {name: value.detach().numpy().copy() for name, value in model.state_dict().items()}
    return state, model.config.to_dict()


def _llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter order, written row by row: within each head, stored row 2*i + j is
    HF row j*half + i (half = head_dim / 2)."""
    head_dim = w.shape[0] // n_heads
    half = head_dim // 2
    out = np.empty_like(w)
    for h in range(n_heads):
        for i in range(half):
            for j in range(2):
                out[h * head_dim + 2 * i + j] = w[h * head_dim + j * half + i]
    return out


TINY = dict(vocab=64, hidden=64, inter=96, layers=2, heads=4, kv_heads=2, head_dim=16)


def _tiny_weights(arch: str, dims: dict, untied: bool, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random HF-layout weights, keyed by GGUF name."""
    h, inter, hd = dims["hidden"], dims["inter"], dims["head_dim"]
    q, kv = dims["heads"] * hd, dims["kv_heads"] * hd
    per_layer = {"attn_norm.weight": (h,), "attn_q.weight": (q, h), "attn_k.weight": (kv, h),
                 "attn_v.weight": (kv, h), "attn_output.weight": (h, q), "ffn_norm.weight": (h,),
                 "ffn_gate.weight": (inter, h), "ffn_up.weight": (inter, h), "ffn_down.weight": (h, inter)}
    if arch == "qwen2":
        per_layer.update({"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)})
    if arch == "qwen3":
        per_layer.update({"attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)})
    shapes = {"token_embd.weight": (dims["vocab"], h), "output_norm.weight": (h,)}
    for layer in range(dims["layers"]):
        shapes.update({f"blk.{layer}.{name}": shape for name, shape in per_layer.items()})
    if untied:
        shapes["output.weight"] = (dims["vocab"], h)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def _write_tiny(path, arch: str = "llama", *, types: dict[str, str] | None = None, drop: tuple[str, ...] = (),
                untied: bool = False, dims: dict | None = None, metadata: dict | None = None,
                seed: int = 0) -> dict[str, np.ndarray]:
    """Writes a tiny random model; `types` maps a GGUF-name substring to a type (default F32).
    Returns the HF-layout weights by GGUF name (q/k before llama.cpp's permutation)."""
    dims = {**TINY, **(dims or {})}
    weights = _tiny_weights(arch, dims, untied, np.random.default_rng(seed))
    head_key = "rope.dimension_count" if arch == "llama" else "attention.key_length"
    ints = {"block_count": dims["layers"], "context_length": 128, "embedding_length": dims["hidden"],
            "feed_forward_length": dims["inter"], "attention.head_count": dims["heads"],
            "attention.head_count_kv": dims["kv_heads"], "vocab_size": dims["vocab"], head_key: dims["head_dim"]}
    ints = {f"{arch}.{key}": value for key, value in ints.items()} | (metadata or {})
    writer = gguf.GGUFWriter(os.fspath(path), arch)
    for key, value in ints.items():
        writer.add_uint32(key, value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    for name, value in weights.items():
        if any(part in name for part in drop):
            continue
        if arch == "llama" and ".attn_q.weight" in name:
            value = _llamacpp_permute(value, dims["heads"])
        elif arch == "llama" and ".attn_k.weight" in name:
            value = _llamacpp_permute(value, dims["kv_heads"])
        qtype = next((t for part, t in (types or {}).items() if part in name), "F32")
        if qtype in ("F32", "F16"):
            writer.add_tensor(name, value.astype(np.float32 if qtype == "F32" else np.float16))
        else:
            qt = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(name, _quantized(value, qt), raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


def _quantized(value: np.ndarray, qt: gguf.GGMLQuantizationType) -> np.ndarray:
    """``value`` in blocks of ``qt``; random bytes where the gguf package cannot quantize to it."""
    try:
        return gguf.quants.quantize(value, qt)
    except NotImplementedError:
        block, nbytes = gguf.GGML_QUANT_SIZES[qt]
        size = (*value.shape[:-1], value.shape[-1] // block * nbytes)
        return np.random.default_rng(0).integers(0, 256, size=size, dtype=np.uint8)


# ------------------------------------------------------------------------------- the SmolLM2 file
@pytest.fixture(scope="module")
def smollm() -> tuple:
    directory = _smollm_dir()
    checkpoint = read_gguf(os.path.join(directory, SMOLLM_FILE))
    state, config = _hf_load(directory, SMOLLM_FILE)
    return checkpoint, state, config


def test_smollm_tensors_equal_transformers(smollm):
    checkpoint, state, _ = smollm
    assert checkpoint.hf_config["tie_word_embeddings"]
    # transformers lists the tied lm_head too; we list each stored tensor once.
    assert set(checkpoint.tensors) == set(state) - {"lm_head.weight"}
    assert len(checkpoint.tensors) == 272  # 1 embedding + 30 layers x 9 + final norm
    for name, ours in checkpoint.tensors.items():
        assert ours.dtype == np.float32, name
        assert ours.shape == state[name].shape, name
        np.testing.assert_array_equal(ours, state[name], err_msg=name)


def test_smollm_config_equals_transformers(smollm):
    checkpoint, _, config = smollm
    ours = checkpoint.hf_config
    for field in CONFIG_FIELDS:
        assert ours[field] == config[field], field
    assert ours["rope_parameters"]["rope_theta"] == config["rope_parameters"]["rope_theta"] == 100000.0
    assert ours["rope_theta"] == 100000.0
    assert ours["architectures"] == ["LlamaForCausalLM"]
    # The dict is a loadable config.json: transformers builds the same config from it.
    rebuilt = transformers.AutoConfig.for_model(**ours).to_dict()
    for field in CONFIG_FIELDS:
        assert rebuilt[field] == config[field], field
    assert rebuilt["rope_parameters"]["rope_theta"] == 100000.0


def test_smollm_tensor_types_and_raw_blocks(smollm):
    checkpoint, state, _ = smollm
    types = checkpoint.tensor_types
    assert types["model.embed_tokens.weight"] == "Q8_0"
    assert types["model.norm.weight"] == "F32"
    assert sorted(set(types.values())) == ["F32", "Q4_1", "Q8_0"]
    assert sum(t == "Q4_1" for t in types.values()) == 30 * 7  # every linear of every layer
    raw = checkpoint.raw("model.layers.3.self_attn.k_proj.weight")
    # k_proj: 3 kv heads x 64 = 192 rows of 576 inputs = 18 Q4_1 blocks of 20 bytes (2 f16 + 16 nibble bytes).
    assert (raw.qtype, raw.shape, raw.blocks.dtype, raw.blocks.shape) == ("Q4_1", (192, 576), np.uint8, (192, 360))
    np.testing.assert_array_equal(raw.dequantize(), state["model.layers.3.self_attn.k_proj.weight"])
    assert checkpoint.tensors.shape("model.layers.3.self_attn.k_proj.weight") == (192, 576)
    assert checkpoint.tensors.gguf_name("model.layers.3.self_attn.k_proj.weight") == "blk.3.attn_k.weight"
    embed = checkpoint.raw("model.embed_tokens.weight")
    assert embed.blocks.shape == (49152, 576 // 32 * 34)  # Q8_0: f16 scale + 32 int8


def test_smollm_tokenizer_and_template(smollm):
    checkpoint = smollm[0]
    assert checkpoint.tokenizer is not None
    assert (checkpoint.tokenizer.bos_id, checkpoint.tokenizer.eos_id, checkpoint.tokenizer.vocab_size) == (1, 2, 49152)
    assert checkpoint.chat_template == checkpoint.tokenizer.chat_template
    assert "<|im_start|>" in checkpoint.chat_template


def test_tensors_are_fresh_writable_copies(smollm):
    checkpoint = smollm[0]
    name = "model.norm.weight"  # F32: the one type whose decoding could hand back a view of the file
    first = checkpoint.tensors[name]
    expected = first.copy()
    first += 1.0
    np.testing.assert_array_equal(checkpoint.tensors[name], expected)


# ----------------------------------------------------------------------------- synthetic files
def test_llama_unpermutes_q_and_k(tmp_path):
    weights = _write_tiny(tmp_path / "tiny.gguf")
    checkpoint = read_gguf(tmp_path / "tiny.gguf")
    for layer in range(TINY["layers"]):
        for proj, gguf_name in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("o_proj", "attn_output")):
            np.testing.assert_array_equal(
                checkpoint.tensors[f"model.layers.{layer}.self_attn.{proj}.weight"],
                weights[f"blk.{layer}.{gguf_name}.weight"],
            )
    assert checkpoint.tokenizer is None and checkpoint.chat_template is None
    assert checkpoint.hf_config["head_dim"] == 16


QUANT_LAYOUT = {
    "attn_q.weight": "Q4_0", "attn_k.weight": "Q4_1", "attn_v.weight": "Q8_0", "attn_output.weight": "F16",
    "ffn_gate": "BF16", "ffn_up": "Q4_1", "ffn_down": "Q8_0", "token_embd": "Q5_0", "output.weight": "Q5_1",
}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_every_supported_type_equals_transformers(tmp_path, arch):
    # transformers' Qwen3 config ignores the file's key length and uses its default head_dim of 128.
    dims = {"heads": 2, "kv_heads": 1, "head_dim": 128} if arch == "qwen3" else {}
    weights = _write_tiny(tmp_path / "tiny.gguf", arch, types=QUANT_LAYOUT, untied=True, dims=dims)
    checkpoint = read_gguf(tmp_path / "tiny.gguf")
    state, config = _hf_load(os.fspath(tmp_path), "tiny.gguf")
    assert set(checkpoint.tensors) == set(state)
    # every supported type but the K-quants, whose 256-wide blocks need wider rows (their file is
    # tests/quant/test_gguf_kquants.py's)
    assert set(checkpoint.tensor_types.values()) == {t for t in SUPPORTED_TYPES if not t.endswith("_K")}
    for name, ours in checkpoint.tensors.items():
        np.testing.assert_array_equal(ours, state[name], err_msg=name)
    # Qwen2's config has no head_dim field: there it is hidden_size / num_attention_heads.
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    for field in CONFIG_FIELDS[:10]:
        assert checkpoint.hf_config[field] == config[field], field
    assert checkpoint.hf_config["architectures"][0].lower().startswith(arch)
    # Quantized, but still the weights we wrote (Q4_0 of N(0,1) data errs by at most ~0.5).
    q = checkpoint.tensors["model.layers.1.self_attn.q_proj.weight"]
    assert np.abs(q - weights["blk.1.attn_q.weight"]).max() < 0.6
    assert np.abs(q - weights["blk.1.attn_q.weight"]).mean() < 0.15


def test_raw_rows_follow_hf_order(tmp_path):
    _write_tiny(tmp_path / "tiny.gguf", types={"attn_q.weight": "Q8_0"})
    checkpoint = read_gguf(tmp_path / "tiny.gguf")
    raw = checkpoint.raw("model.layers.0.self_attn.q_proj.weight")
    assert raw.blocks.shape == (64, 2 * 34)
    # Decoding the un-permuted blocks row by row gives the HF rows.
    row = gguf.quants.dequantize(raw.blocks[5], gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(row, checkpoint.tensors["model.layers.0.self_attn.q_proj.weight"][5])


@pytest.mark.parametrize("qtype", ["IQ4_NL", "Q8_1"])
def test_unsupported_tensor_type(tmp_path, qtype):
    _write_tiny(tmp_path / "bad.gguf", types={"blk.1.ffn_up": qtype})
    with pytest.raises(GGUFError) as err:
        read_gguf(tmp_path / "bad.gguf")
    message = str(err.value)
    assert "blk.1.ffn_up.weight" in message and qtype in message
    assert all(t in message for t in SUPPORTED_TYPES)


def test_missing_tensor(tmp_path):
    _write_tiny(tmp_path / "bad.gguf", drop=("blk.1.ffn_down",))
    with pytest.raises(GGUFError, match=r"model\.layers\.1\.mlp\.down_proj\.weight.*blk\.1\.ffn_down\.weight"):
        read_gguf(tmp_path / "bad.gguf")


def test_missing_qwen2_bias(tmp_path):
    _write_tiny(tmp_path / "bad.gguf", "qwen2", drop=("blk.0.attn_k.bias",))
    with pytest.raises(GGUFError, match=r"model\.layers\.0\.self_attn\.k_proj\.bias"):
        read_gguf(tmp_path / "bad.gguf")


def test_unsupported_architecture(tmp_path):
    _write_tiny(tmp_path / "bad.gguf", "mamba")
    with pytest.raises(GGUFError, match="'mamba'"):
        read_gguf(tmp_path / "bad.gguf")


def test_metadata_contradicting_shapes(tmp_path):
    # The file says 4 kv heads, but k_proj has 2 x 16 rows.
    _write_tiny(tmp_path / "bad.gguf", metadata={"llama.attention.head_count_kv": 4})
    with pytest.raises(GGUFError, match=r"blk\.0\.attn_k\.weight.*\[32, 64\].*\[64, 64\]"):
        read_gguf(tmp_path / "bad.gguf")


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match="junk.gguf"):
        read_gguf(tmp_path / "junk.gguf")
    with pytest.raises(FileNotFoundError):
        read_gguf(tmp_path / "absent.gguf")


def test_a_file_rewritten_in_place_is_parsed_again(tmp_path):
    """``open_gguf`` hands back its kept reader while the file is unchanged, and parses the file
    again when its header bytes change in place (same path, same size, same modification time)."""
    from rlx.models.gguf_file import open_gguf

    path = tmp_path / "tiny.gguf"
    _write_tiny(path)
    first = open_gguf(path)
    assert open_gguf(str(path)) is first and read_gguf(path).hf_config["num_hidden_layers"] == 2
    stat, data = os.stat(path), bytearray(path.read_bytes())
    at = data.index(b"llama.block_count")
    data[at:at + 5] = b"LLAMA"  # the key no longer names the architecture's block count
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert open_gguf(path) is not first
    with pytest.raises(GGUFError, match="tiny.gguf"):
        read_gguf(path)
