"""Tests for rlx.models.tokenizer against transformers' tokenizers built from the same files.

Oracles: `AutoTokenizer.from_pretrained(dir, gguf_file=...)` on the SmolLM2 GGUF (ids, decoding, chat
template rendering) and on tiny synthetic GGUF vocabularies (regex-split families, BOS, user-defined
tokens); `AutoTokenizer.from_pretrained` on the folder our `save` writes.
"""

from __future__ import annotations

import os

import gguf
import jinja2
import pytest
import tokenizers

from rlx.models.tokenizer import Tokenizer, TokenizerError, _byte_alphabet
from tests.helpers import smollm2_dir

transformers = pytest.importorskip("transformers")

SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé façade — naïve café, Ελληνικά, русский, 中文字符, 日本語のテキスト, 한국어",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "  leading spaces, trailing spaces   ",
    "tabs\t\tand\nnewlines\n\n\nand\r\nCRLF   \n  mixed \t \n",
    "def f(x):\n    return {'a': [x ** 2 for _ in range(10)]}  # comment\n",
    "3.14159 and 1234567890 and 007, 1,000,000 and -42e-3",
    "I'm sure they'll say it's fine, don't you think? We've seen ya'll.",
    "a , b . c ! d ? e ' f",
    "<|im_start|>user\nhello<|im_end|>\n<|endoftext|>",
    "",
]

SYSTEM_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 × 3? Answer in 日本語 🙂"},
]
NO_SYSTEM_CHAT = SYSTEM_CHAT[1:]


# -------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def smollm_dir() -> str:
    return smollm2_dir()


@pytest.fixture(scope="module")
def ours(smollm_dir) -> Tokenizer:
    return Tokenizer.from_gguf(os.path.join(smollm_dir, SMOLLM_FILE))


@pytest.fixture(scope="module")
def theirs(smollm_dir):
    return transformers.AutoTokenizer.from_pretrained(smollm_dir, gguf_file=SMOLLM_FILE)


def _write_vocab(path, pre: str, *, add_bos: bool = False, model: str = "gpt2") -> None:
    """A tiny byte-level vocabulary: two specials, the 256 byte symbols, six merges."""
    alphabet = _byte_alphabet()
    merges = ["Ġ t", "h e", "Ġt he", "1 2", "i n", "Ġ in"]
    tokens = ["<|endoftext|>", "<think>", *(alphabet[b] for b in range(256)), "Ġt", "he", "Ġthe", "12", "in", "Ġin"]
    types = [3, 4] + [1] * (len(tokens) - 2)  # CONTROL, USER_DEFINED, then NORMAL
    writer = gguf.GGUFWriter(os.fspath(path), "qwen2")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ------------------------------------------------------------------------------ SmolLM2 encoding
@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours, theirs, text):
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=True) == theirs.encode(text, add_special_tokens=True)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers(ours, theirs, text):
    ids = theirs.encode(text, add_special_tokens=False)
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ids) == text  # byte-level BPE is lossless


def test_known_ids(ours):
    # Hand-checked against the SmolLM2 vocabulary: digits are separate tokens, " " before them is 216.
    assert ours.encode("Hello world 12345 ok") == [19556, 905, 216, 33, 34, 35, 36, 37, 10907]
    assert ours.encode("<|im_start|>") == [1]


def test_special_tokens_match_transformers(ours, theirs):
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.unk_id) == (
        theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id, theirs.unk_token_id)
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (1, 2, 2)
    assert ours.vocab_size == len(theirs) == 49152
    assert ours.special_tokens_map == theirs.special_tokens_map


# ------------------------------------------------------------------------------- chat templates
@pytest.mark.parametrize("chat", [SYSTEM_CHAT, NO_SYSTEM_CHAT], ids=["system", "no_system"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, theirs, chat, generation_prompt):
    rendered = ours.apply_chat_template(chat, add_generation_prompt=generation_prompt)
    expected = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation_prompt)
    assert rendered == expected
    assert rendered.endswith("<|im_start|>assistant\n") == generation_prompt
    assert ("You are a helpful AI assistant named SmolLM" in rendered) == (chat is NO_SYSTEM_CHAT)
    ids = theirs.apply_chat_template(chat, tokenize=True, add_generation_prompt=generation_prompt)["input_ids"]
    assert ours.encode_chat(chat, add_generation_prompt=generation_prompt) == ids


FEATURE_TEMPLATE = """\
{{ bos_token }}
{% if tools %}
TOOLS: {{ tools | tojson }}
{% endif %}
{% for m in messages %}
    {% if m.role == 'bad' %}{{ raise_exception('bad role') }}{% endif %}
    {% if loop.index > 3 %}{% break %}{% endif %}
    {% if m.role == 'assistant' %}{% generation %}<think>{{ m.reasoning_content }}</think>[{{ m.content }}]{% endgeneration %}
    {% else %}{{ m.role }}: {{ m.content | tojson(indent=2) }} {{ m | tojson(sort_keys=True) }}
    {% endif %}
{% endfor %}
{{ eos_token }}{{ custom_var }}
"""

TOOLS = [{"type": "function", "function": {"name": "add", "description": "a <b> & 'c' é",
                                           "parameters": {"type": "object", "properties": {}}}}]


def test_template_features_match_transformers(ours, theirs):
    chat = [{"role": "user", "content": "<b>x</b> & 'y' \"z\" é 😀"},
            {"role": "assistant", "content": "ok", "reasoning": "hm"},  # templates read it as reasoning_content
            {"role": "user", "content": "again"}, {"role": "user", "content": "cut by break"}]
    kwargs = dict(tools=TOOLS, custom_var="!", add_generation_prompt=False)
    rendered = Tokenizer(ours.backend, **ours.special_tokens_map, chat_template=FEATURE_TEMPLATE
                         ).apply_chat_template(chat, **kwargs)
    expected = theirs.apply_chat_template(chat, chat_template=FEATURE_TEMPLATE, tokenize=False, **kwargs)
    assert rendered == expected
    assert '"<b>x</b> & \'y\' \\"z\\" é 😀"' in rendered  # tojson escapes neither HTML nor non-ASCII
    assert "<think>hm</think>[ok]" in rendered and "cut by break" not in rendered


def test_raise_exception_in_template(ours):
    tok = Tokenizer(ours.backend, chat_template=FEATURE_TEMPLATE)
    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role"):
        tok.apply_chat_template([{"role": "bad", "content": "x"}])


def test_template_is_sandboxed(ours):
    tok = Tokenizer(ours.backend, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_no_template_is_an_error(ours):
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer(ours.backend).apply_chat_template([{"role": "user", "content": "x"}])


# -------------------------------------------------------------------------------- save / from_dir
def test_save_loads_in_transformers_identically(ours, theirs, tmp_path):
    ours.save(tmp_path)
    reloaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours_again = Tokenizer.from_dir(tmp_path)
    for text in TEXTS:
        expected = theirs.encode(text, add_special_tokens=False)
        assert reloaded.encode(text, add_special_tokens=False) == expected
        assert reloaded.encode(text, add_special_tokens=True) == theirs.encode(text, add_special_tokens=True)
        assert ours_again.encode(text) == expected
        assert reloaded.decode(expected) == ours_again.decode(expected) == theirs.decode(expected)
    assert reloaded.chat_template == ours_again.chat_template == theirs.chat_template
    assert reloaded.apply_chat_template(SYSTEM_CHAT, tokenize=False) == ours_again.apply_chat_template(
        SYSTEM_CHAT, add_generation_prompt=False)
    assert (reloaded.bos_token_id, reloaded.eos_token_id, reloaded.pad_token_id) == (1, 2, 2)
    assert (ours_again.bos_id, ours_again.eos_id, ours_again.pad_id) == (1, 2, 2)


def test_save_with_bos_round_trips(ours, tmp_path):
    backend = tokenizers.Tokenizer.from_str(ours.backend.to_str())
    tok = Tokenizer(backend, bos_token="<|im_start|>", eos_token="<|im_end|>", add_bos_token=True)
    assert tok.encode("hi", add_special_tokens=True) == [1, *tok.encode("hi")]
    tok.save(tmp_path)
    reloaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded.encode("hi there") == tok.encode("hi there", add_special_tokens=True)
    assert Tokenizer.from_dir(tmp_path).encode("hi there", add_special_tokens=True)[0] == 1


def test_from_dir_reads_transformers_folder(ours, theirs, tmp_path):
    theirs.save_pretrained(tmp_path)  # transformers 5 writes the template to chat_template.jinja
    assert (tmp_path / "chat_template.jinja").is_file()
    loaded = Tokenizer.from_dir(tmp_path)
    assert loaded.chat_template == theirs.chat_template
    assert [loaded.encode(t) for t in TEXTS] == [ours.encode(t) for t in TEXTS]
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (1, 2, 2)


def test_from_dir_without_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


# ---------------------------------------------------------------------------- synthetic vocabularies
@pytest.mark.parametrize(("pre", "twelve"), [("qwen2", ["1", "2"]), ("llama-bpe", ["12"]), ("smollm", ["12"])])
def test_split_families_match_transformers(tmp_path, pre, twelve):
    _write_vocab(tmp_path / "vocab.gguf", pre, add_bos=True)
    ours = Tokenizer.from_gguf(tmp_path / "vocab.gguf")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="vocab.gguf")
    text = "the 12 in<think>inx the<|endoftext|>12"
    ids = ours.encode(text, add_special_tokens=True)
    assert ids == theirs.encode(text, add_special_tokens=True)
    assert ids[0] == 0  # BOS, as the file asks
    assert ids[ids.index(1) - 1] != 1  # <think> (user-defined, id 1) stays whole
    # qwen2 splits every digit apart; llama3 keeps up to three; GPT-2 keeps runs.
    pieces = [ours.backend.id_to_token(i) for i in ours.encode("12")]
    assert pieces == twelve


def test_sentencepiece_vocab_is_refused(tmp_path):
    _write_vocab(tmp_path / "vocab.gguf", "default", model="llama")
    with pytest.raises(TokenizerError, match="'llama'"):
        Tokenizer.from_gguf(tmp_path / "vocab.gguf")
