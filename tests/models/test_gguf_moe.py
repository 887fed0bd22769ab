"""qwen3moe / qwen2moe GGUF files: read as HF names, run with their experts kept as blocks.

Oracle: transformers' own GGUF loader. Its config mapping for these architectures drops
``expert_feed_forward_length`` / ``expert_shared_feed_forward_length`` and the gate
renormalization, so the test hands it those three values (as read from the file by rlx and as
llama.cpp runs qwen3moe: top-k gates renormalized; qwen2moe: not).
"""

from __future__ import annotations

import os

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.models.config import from_hf_config
from rlx.models.gguf import GGUFError, read_gguf
from rlx.models.hf import param_map
from rlx.quant import GGUFTensor, load_gguf_quantized
from rlx.quant.loading import node_at

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

D, HEADS, KV, HEAD_DIM, VOCAB, LAYERS = 64, 4, 2, 16, 96, 2
E, K, F, SHARED = 4, 2, 32, 64
TYPES = {"exps": "Q8_0", "attn_q": "Q4_1", "shexp": "Q4_0"}


def _tensors(arch: str) -> dict[str, tuple]:
    """GGUF name -> GGUF-order shape (rows last reversed: numpy shape of the data)."""
    out = {"token_embd.weight": (VOCAB, D), "output_norm.weight": (D,)}
    for i in range(LAYERS):
        b = f"blk.{i}."
        out |= {b + "attn_norm.weight": (D,), b + "ffn_norm.weight": (D,),
                b + "attn_q.weight": (HEADS * HEAD_DIM, D), b + "attn_k.weight": (KV * HEAD_DIM, D),
                b + "attn_v.weight": (KV * HEAD_DIM, D), b + "attn_output.weight": (D, HEADS * HEAD_DIM),
                b + "ffn_gate_inp.weight": (E, D), b + "ffn_gate_exps.weight": (E, F, D),
                b + "ffn_up_exps.weight": (E, F, D), b + "ffn_down_exps.weight": (E, D, F)}
        if arch == "qwen3moe":
            out |= {b + "attn_q_norm.weight": (HEAD_DIM,), b + "attn_k_norm.weight": (HEAD_DIM,)}
        else:
            out |= {b + f"attn_{p}.bias": (n * HEAD_DIM,) for p, n in (("q", HEADS), ("k", KV), ("v", KV))}
            out |= {b + "ffn_gate_shexp.weight": (SHARED, D), b + "ffn_up_shexp.weight": (SHARED, D),
                    b + "ffn_down_shexp.weight": (D, SHARED), b + "ffn_gate_inp_shexp.weight": (D,)}
    return out


def write_moe_gguf(path: str, arch: str, drop: str = "") -> None:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, arch)
    for key, value in {"block_count": LAYERS, "context_length": 64, "embedding_length": D,
                       "feed_forward_length": F, "attention.head_count": HEADS,
                       "attention.head_count_kv": KV, "attention.key_length": HEAD_DIM,
                       "vocab_size": VOCAB, "expert_count": E, "expert_used_count": K,
                       "expert_feed_forward_length": F, "expert_shared_feed_forward_length": SHARED,
                       }.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    for name, shape in _tensors(arch).items():
        if name == drop:
            continue
        value = rng.standard_normal(shape).astype(np.float32)
        if len(shape) == 1:
            value = 1 + 0.1 * value if "norm" in name else value
            w.add_tensor(name, value)
            continue
        qtype = next((t for part, t in TYPES.items() if part in name), "F32")
        if qtype == "F32":
            w.add_tensor(name, value)
        else:
            qt = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(value, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _transformers(path: str, arch: str):
    extra = dict(moe_intermediate_size=F, norm_topk_prob=arch == "qwen3moe")
    if arch == "qwen2moe":
        extra["shared_expert_intermediate_size"] = SHARED
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32, **extra).eval()


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_moe_gguf_runs_with_its_experts_as_blocks_like_transformers(tmp_path, arch):
    path = os.fspath(tmp_path / f"{arch}.gguf")
    write_moe_gguf(path, arch)
    ckpt = read_gguf(path)
    cfg = from_hf_config(ckpt.hf_config)
    assert cfg.moe.num_experts == E and cfg.moe.intermediate_size == F
    hf = _transformers(path, arch)
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    fused = state["model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2F, D]: gate rows, then up
    np.testing.assert_array_equal(ckpt.tensors["model.layers.1.mlp.experts.2.gate_proj.weight"],
                                  fused[2, :F])
    np.testing.assert_array_equal(ckpt.tensors["model.layers.1.mlp.experts.3.up_proj.weight"],
                                  fused[3, F:])

    loaded = load_gguf_quantized(path)
    kept = [p for p, s in param_map(loaded.model.config).items()
            if isinstance(node_at(loaded.model, p), GGUFTensor) and s.layout == "stack_T"]
    assert len(kept) == 3 * LAYERS  # every layer's gate / up / down experts stay Q8_0 blocks
    expert = node_at(loaded.model, "layers/0/mlp/experts/down_proj")
    raw = read_gguf(path).raw("model.layers.0.mlp.experts.1.down_proj.weight")
    assert expert.qtype == "Q8_0" and np.array_equal(np.asarray(expert.file_blocks())[1], raw.blocks)
    assert not any(isinstance(v, nnx.Param) and v.ndim == 3
                   for _, v in nnx.to_flat_state(nnx.state(loaded.model)))
    ids = np.random.default_rng(1).integers(0, VOCAB, size=(2, 10))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    out = np.asarray(loaded.model(jnp.asarray(ids)))
    assert np.abs(out - ref).max() <= 1e-4 * np.abs(ref).max()


def test_a_moe_gguf_missing_an_expert_tensor_is_refused_naming_it(tmp_path):
    path = os.fspath(tmp_path / "bad.gguf")
    write_moe_gguf(path, "qwen3moe", drop="blk.1.ffn_up_exps.weight")
    with pytest.raises(GGUFError, match=r"bad.gguf: required tensor 'model.layers.1.mlp.experts.0."
                                        r"up_proj.weight' \(GGUF 'blk.1.ffn_up_exps.weight'\) is missing"):
        read_gguf(path)
