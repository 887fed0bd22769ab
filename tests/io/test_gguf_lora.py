"""A trained adapter exported as a GGUF LoRA file runs in llama.cpp as it runs in rlx.

Oracle: llama.cpp itself (llama-cpp-python, in its own environment: ``python -m
rlx.bench.peer_envs llama.cpp``; where that is missing, the llama.cpp test skips naming it):
SmolLM2-135M-Instruct's weights + rlx's adapter file compute rlx's logits and greedy-decode the
tokens of rlx's built-in engine. (On the Q4_1 file itself llama.cpp quantizes activations to 8 bits
inside its products: 1.4 logits from rlx's on the bare base, so greedy tokens part at near ties;
the adapter file is the same tensors for either base.)
Without llama.cpp, the file's layout is still checked with the gguf package's reader.
"""

from __future__ import annotations

import json
import os
import subprocess

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.bench.peer_envs import LLAMA_CPP
from rlx.io.gguf_lora import FILE, export_gguf_lora
from rlx.models.gguf import read_gguf
from rlx.quant import apply_lora, load_gguf_quantized
from rlx.quant.config import LoraConfig, QuantConfigError
from rlx.rollout.jax.engine import JaxEngine
from rlx.types import Prompt, SamplingParams
from tests.helpers import SMOLLM2_FILE, smollm2_dir

BASE = os.path.join(smollm2_dir(), SMOLLM2_FILE)
QUESTIONS = ("What is 12 + 7?", "Name a colour.", "Write one word about the sea.")
NEW = 12
LORA = LoraConfig(rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"))


@pytest.fixture(scope="module")
def adapted():
    loaded = load_gguf_quantized(BASE)
    model = apply_lora(loaded.model, LORA, nnx.Rngs(0))
    keys = iter(jax.random.split(jax.random.key(1), 512))
    for _, lo in nnx.iter_graph(model):  # a trained-looking adapter: B away from zero
        if hasattr(lo, "lora_b") and isinstance(lo.lora_b, nnx.Variable):
            lo.lora_b[...] = 0.05 * jax.random.normal(next(keys), lo.lora_b.shape)
    return model, loaded.tokenizer


def test_the_adapter_file_names_the_base_tensors_with_their_rows_as_stored(adapted, tmp_path):
    model, _ = adapted
    out = export_gguf_lora(model, BASE, str(tmp_path / "lora"), "7")
    reader = gguf.GGUFReader(os.path.join(out, FILE))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert fields["general.type"] == "adapter" and fields["adapter.type"] == "lora"
    assert fields["general.architecture"] == "llama" and fields["adapter.lora.alpha"] == 8.0
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    assert len(tensors) == 2 * 7 * 30
    lo = model.layers[3].self_attn.q_proj.lora
    b = np.asarray(lo.lora_b[...]).T  # [out, r] in HF row order
    # lora_b's rows follow the base's: stored row i patches the base's stored row i, which is HF
    # row order[i] (found by matching the file's rows against the HF-ordered ones)
    stored = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(BASE).tensors}["blk.3.attn_q.weight"]
    hf_rows = read_gguf(BASE).raw("model.layers.3.self_attn.q_proj.weight").blocks
    index = {row.tobytes(): j for j, row in enumerate(hf_rows)}
    order = [index[row.tobytes()] for row in stored.reshape(hf_rows.shape)]
    assert sorted(order) == list(range(576)) and order != list(range(576))
    np.testing.assert_array_equal(tensors["blk.3.attn_q.weight.lora_b"], b[order])
    np.testing.assert_array_equal(tensors["blk.3.attn_q.weight.lora_a"], np.asarray(lo.lora_a[...]).T)
    o = model.layers[3].self_attn.o_proj.lora
    np.testing.assert_array_equal(tensors["blk.3.attn_output.weight.lora_b"], np.asarray(o.lora_b[...]).T)
    assert json.load(open(os.path.join(out, "rlx_export.json")))["version"] == "7"


def test_another_base_is_refused_naming_the_missing_tensor(adapted, tmp_path):
    from tests.helpers.bad_files import write_tiny_gguf

    other = tmp_path / "other.gguf"
    write_tiny_gguf(other)
    with pytest.raises(QuantConfigError, match=r"other.gguf(: blk.0.\w+.weight is \[\d+, \d+\], the "
                                               r"adapter on| has no tensor 'model.layers.1)"):
        export_gguf_lora(adapted[0], str(other), str(tmp_path / "lora"), "1")
    assert not os.path.exists(tmp_path / "lora")


_F32 = """
import ctypes, sys, llama_cpp as l
p = l.llama_model_quantize_default_params()
p.ftype, p.allow_requantize = l.LLAMA_FTYPE_ALL_F32, True
sys.exit(l.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))
"""

_LLAMA = """
import json, sys, numpy as np, llama_cpp
base, lora, new, out = sys.argv[1], sys.argv[2] or None, int(sys.argv[3]), sys.argv[4]
llm = llama_cpp.Llama(model_path=base, lora_path=lora, n_ctx=256, n_threads=2, logits_all=True,
                      type_k=0, type_v=0, verbose=False)  # an f32 KV cache, as rlx's
tokens, logits = [], []
for i, prompt in enumerate(json.loads(sys.stdin.read())):
    llm.reset()
    gen = llm.generate(prompt, temp=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
    tokens.append([next(gen) for _ in range(new)])
    np.save(f"{out}{i}.npy", np.asarray(llm.scores[:len(prompt) + new - 1]))
print(json.dumps(tokens))
"""


def _llama_cpp(base: str, prompts, lora: str, out: str) -> tuple[list[list[int]], list[np.ndarray]]:
    run = subprocess.run([LLAMA_CPP.interpreter(), "-c", _LLAMA, base, lora, str(NEW), out],
                         input=json.dumps(prompts), capture_output=True, text=True, timeout=600,
                         check=True)
    tokens = json.loads(run.stdout.strip().splitlines()[-1])
    return tokens, [np.load(f"{out}{i}.npy") for i in range(len(prompts))]


@pytest.mark.slow  # kept out of CI's 30 minutes; `python -m pytest -m slow` runs it
def test_llama_cpp_with_the_adapter_computes_rlx_logits_and_tokens(adapted, tmp_path):
    """On the SmolLM2 weights in f32 (the Q4_1 file dequantized by llama.cpp's own quantizer, so
    llama.cpp multiplies in f32 too): logits within 1e-3 (measured 1.1e-4, as without the adapter)
    while the adapter moves them by several units, and the same greedy tokens as rlx's engine. The
    Q4_1 base's adapter file holds the same tensors."""
    missing = LLAMA_CPP.unavailable()
    if missing:
        pytest.skip(missing)
    f32 = os.fspath(tmp_path / "smollm2-f32.gguf")
    subprocess.run([LLAMA_CPP.interpreter(), "-c", _F32, BASE, f32], check=True,
                   capture_output=True, timeout=600)
    model = apply_lora(load_gguf_quantized(f32).model, LORA, nnx.Rngs(0))
    nnx.update(model, nnx.state(adapted[0], nnx.LoRAParam))  # the same adapter values
    out = export_gguf_lora(model, f32, str(tmp_path / "lora"), "1")
    q4 = export_gguf_lora(adapted[0], BASE, str(tmp_path / "lora-q4"), "1")
    ours_t = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(os.path.join(out, FILE)).tensors}
    q4_t = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(os.path.join(q4, FILE)).tensors}
    assert ours_t.keys() == q4_t.keys() and all(np.array_equal(ours_t[k], q4_t[k]) for k in ours_t)

    tokenizer = adapted[1]
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in QUESTIONS]
    ours = JaxEngine(model).generate([Prompt(f"p{i}", tuple(p)) for i, p in enumerate(prompts)],
                                     SamplingParams(max_new_tokens=NEW, temperature=0.0))
    ours = [r.completion_ids.tolist() for r in ours]
    theirs, logits = _llama_cpp(f32, prompts, os.path.join(out, FILE), str(tmp_path / "lora-"))
    _, bare = _llama_cpp(f32, prompts, "", str(tmp_path / "bare-"))
    for prompt, toks, ref, ref_bare in zip(prompts, theirs, logits, bare):
        seq = jnp.asarray([list(prompt) + toks[:-1]])
        assert np.abs(np.asarray(model(seq))[0] - ref).max() <= 1e-3
        assert np.abs(ref - ref_bare).max() > 1.0  # the adapter is there
    assert theirs == ours
