"""Stop strings on the device (``rlx.rollout.jax.stops``) against the tokenizer's own decoding.

Oracle: ``stop_string_cut``, which decodes prefixes with the Hugging Face ``tokenizers`` backend and
looks for the strings in the text. The automaton must end every sequence at the same token.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models

from rlx.models.tokenizer import Tokenizer
from rlx.rollout.jax.batching import stop_string_cut
from rlx.rollout.jax.stops import advance, stop_table
from tests.helpers.tokenizers import smollm2_tokenizer

STOPS = ("</answer>", "\n\nQuestion:", "→", "ééa", "aab", "}}")
TEXTS = ("The answer is <answer>42</answer> and more", "step 1\n\nQuestion: next", "x → y",
         "caf\u00e9\u00e9aab", "{{x}} done", "aaab", "no stop here at all", "</ans wer>")


def _first_hits(table, seqs: np.ndarray) -> list[int | None]:
    """The automaton run on device over ``seqs [b, n]``: 1 + the index of each row's first hit."""
    dev, state = jnp.asarray(table.next), jnp.zeros(seqs.shape[0], jnp.int32)
    first = [None] * seqs.shape[0]
    for j in range(seqs.shape[1]):
        state, hit = advance(dev, state, jnp.asarray(seqs[:, j]))
        for r in np.flatnonzero(np.asarray(hit)):
            first[r] = j + 1 if first[r] is None else first[r]
    return first


def _sequences(tok: Tokenizer, rng: np.random.Generator, n: int, width: int) -> np.ndarray:
    """Rows mixing the tokens of texts around the stop strings, shuffled pieces and random ids."""
    pieces = [tok.encode(t) for t in TEXTS] + [tok.encode(s) for s in STOPS]
    rows = []
    for _ in range(n):
        row: list[int] = []
        while len(row) < width:
            kind = rng.integers(3)
            if kind == 0:
                row += pieces[rng.integers(len(pieces))]
            elif kind == 1:  # a text cut at a random token (characters split across tokens)
                p = pieces[rng.integers(len(pieces))]
                row += p[rng.integers(len(p) + 1):]
            else:
                row += list(rng.integers(0, tok.vocab_size, 3))
        rows.append(row[:width])
    return np.asarray(rows, np.int32)


def test_stop_strings_end_where_the_decoded_text_first_holds_one():
    tok = smollm2_tokenizer()
    table = stop_table(tok, STOPS, tok.vocab_size)
    assert table is not None and table.next.shape == (table.hit, tok.vocab_size)
    seqs = _sequences(tok, np.random.default_rng(0), 48, 24)
    got = _first_hits(table, seqs)
    want = [stop_string_cut(tok, list(row), STOPS) for row in seqs]
    assert got == want
    assert sum(w is not None for w in want) >= 24  # most rows stop, at varied tokens
    assert len({w for w in want if w is not None}) >= 6


def test_sentencepiece_bytes_and_unknown_decoders():
    """A SentencePiece vocabulary ("▁" spaces, ``<0xNN>`` byte fallback) matches across a
    character split into byte tokens; a decoder of unknown text gives no table (host only)."""
    vocab = {"<unk>": 0, "▁stop": 1, "▁go": 2, "<0xE2>": 3, "<0x86>": 4, "<0x92>": 5, "x": 6}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True,
                                              unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    tok = Tokenizer(backend, unk_token="<unk>")
    stops = (" stop", "→x")
    table = stop_table(tok, stops, 8)  # one id past the vocabulary (a padded embedding)
    seqs = np.asarray([[2, 1, 6, 6], [3, 4, 2, 2], [3, 4, 5, 6], [7, 6, 2, 2]], np.int32)
    want = [stop_string_cut(tok, list(r), stops) for r in seqs]
    assert want == [2, None, 4, None]
    assert _first_hits(table, seqs) == want
    backend.decoder = decoders.WordPiece()
    assert stop_table(tok, stops, 8) is None
    with pytest.raises(ValueError, match="empty string"):
        stop_table(smollm2_tokenizer(), ("",), 10)


class _DeviceOnly:
    """The byte tokenizer with a decode that never shows a stop string: only the device can
    stop a row."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok

    def token_bytes(self):
        return self.tok.token_bytes()

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return ""


def test_the_engine_ends_a_row_on_the_device_at_a_stop_string(tmp_path):
    from rlx.models import from_hf
    from rlx.rollout.jax.engine import JaxEngine
    from rlx.types import SamplingParams
    from tests.helpers.hf_zoo import make_hf_model
    from tests.helpers.parity import sample_prompts
    from tests.helpers.tokenizers import byte_tokenizer

    tok, model = byte_tokenizer(), from_hf(make_hf_model("llama", str(tmp_path)))
    prompts = sample_prompts((4, 7), seed=2)
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0)
    free = JaxEngine(model, tokenizer=tok).generate(prompts, greedy)
    ids = free[0].completion_ids.tolist()
    k = next(i for i in range(2, 20) if all(t < 94 for t in ids[i:i + 3]))  # 3 ASCII bytes
    stop = tok.decode(ids[k:k + 3])
    first = stop_string_cut(tok, ids, (stop,))
    engine = JaxEngine(model, tokenizer=_DeviceOnly(tok))
    cut = engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0.0,
                                                  stop_strings=(stop,)))
    assert first <= k + 3 and cut[0].completion_ids.tolist() == ids[:first]
    assert cut[0].finish_reason == "stop"
    other = free[1].completion_ids.tolist()
    want = stop_string_cut(tok, other, (stop,))
    assert cut[1].completion_ids.tolist() == other[:want or len(other)]
