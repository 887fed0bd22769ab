"""Tokenizer and chat-template layer.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust backend) together with the special tokens and the
chat template of a model. It is built from a Hugging Face tokenizer folder (`tokenizer.json` +
`tokenizer_config.json`, optionally `chat_template.jinja`) or from the `tokenizer.ggml.*` metadata of a
GGUF file, and it saves a folder that `transformers.AutoTokenizer` loads with identical encodings.

GGUF files describe byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) as a token list,
token types and merges. We rebuild the backend the way transformers does from the same file: BPE
over the byte-level alphabet, a ByteLevel pre-tokenizer (preceded by a regex split for the
vocabulary families whose split pattern is known), tokens of type CONTROL added as special tokens,
USER_DEFINED ones as plain added tokens, and a template post-processor adding BOS/EOS only when the
file asks for it. SentencePiece ("llama") vocabularies are not supported yet.

Chat templates are rendered with jinja2 the way transformers renders them: an immutable sandboxed
environment with `trim_blocks` and `lstrip_blocks`, a `tojson` filter that does not escape HTML, the
globals `raise_exception` and `strftime_now`, the `{% generation %}` tag (rendered as its body) and the
special tokens (`bos_token`, `eos_token`, ...) as variables.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from rlx.models.gguf_file import open_gguf

__all__ = ["Tokenizer", "TokenizerError"]

# GGUF token types (llama.cpp `llama_token_type`).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer split patterns by `tokenizer.ggml.pre`. Vocabularies not listed use the GPT-2 split
# built into the ByteLevel pre-tokenizer, which is what transformers does for them as well.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class TokenizerError(ValueError):
    """A tokenizer folder or GGUF vocabulary cannot be used, or a chat cannot be rendered."""


class Tokenizer:
    """A `tokenizers` backend plus special tokens and a chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        chat_template: str | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        """Wraps `backend` (not copied). When `add_bos_token`/`add_eos_token` is given, or the backend
        has no post-processor, the backend's post-processor is replaced in place so that
        `encode(..., add_special_tokens=True)` adds exactly those tokens; otherwise the backend's own
        post-processor decides."""
        self._backend = backend
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token, "unk_token": unk_token, "pad_token": pad_token}
        for name, token in self._tokens.items():
            if token is not None and backend.token_to_id(token) is None:
                raise TokenizerError(f"{name} {token!r} is not in the vocabulary")
        self.chat_template = chat_template
        self.add_bos_token = bool(add_bos_token)
        self.add_eos_token = bool(add_eos_token)
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        # Whether BOS/EOS addition is ours to describe, or left to the backend's own post-processor.
        self._owns_post_processor = add_bos_token is not None or add_eos_token is not None or (
            backend.post_processor is None)
        if self._owns_post_processor:
            backend.post_processor = self._template_processing()

    # ----------------------------------------------------------------------------------- properties
    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._backend

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """`{"bos_token": ..., "eos_token": ...}` for the special tokens that are set."""
        return {name: token for name, token in self._tokens.items() if token is not None}

    @property
    def bos_id(self) -> int | None:
        return self._id_of("bos_token")

    @property
    def eos_id(self) -> int | None:
        return self._id_of("eos_token")

    @property
    def pad_id(self) -> int | None:
        return self._id_of("pad_token")

    @property
    def unk_id(self) -> int | None:
        return self._id_of("unk_token")

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def _id_of(self, name: str) -> int | None:
        token = self._tokens[name]
        return None if token is None else self._backend.token_to_id(token)

    def _template_processing(self) -> processors.TemplateProcessing:
        bos, eos = self._tokens["bos_token"], self._tokens["eos_token"]
        add_bos = self.add_bos_token and bos is not None
        add_eos = self.add_eos_token and eos is not None
        single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
        pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
        specials = ([(bos, self.bos_id)] if add_bos else []) + ([(eos, self.eos_id)] if add_eos else [])
        return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    # --------------------------------------------------------------------------------- construction
    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Loads `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja` from a folder."""
        path = os.fspath(path)
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise TokenizerError(f"no tokenizer.json in {path!r}: a tokenizer folder needs {tokenizer_file!r}")
        backend = tokenizers.Tokenizer.from_file(tokenizer_file)
        config: dict[str, Any] = {}
        config_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(config_file):
            with open(config_file, encoding="utf-8") as f:
                config = json.load(f)
        return cls(
            backend,
            **{name: _token_content(config.get(name)) for name in _SPECIAL_NAMES},
            chat_template=_read_chat_template(path, config),
            add_bos_token=config.get("add_bos_token"),
            add_eos_token=config.get("add_eos_token"),
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        )

    @classmethod
    def from_gguf(cls, source: Any) -> Tokenizer:
        """Builds the tokenizer described by a GGUF file's `tokenizer.*` metadata.

        `source` is a path or an open `gguf.GGUFReader`. A path is bounds-checked by rlx before
        the `gguf` package parses it (a wrong declared length can make that parser loop); errors
        name the file: `GGUFError` for the container, `TokenizerError` for its vocabulary.
        """
        if not isinstance(source, (str, os.PathLike)):
            return cls._from_gguf_reader(source)
        path = os.fspath(source)
        reader = open_gguf(path)
        try:
            return cls._from_gguf_reader(reader)
        except TokenizerError as err:
            raise TokenizerError(f"{path}: {err}") from err

    @classmethod
    def _from_gguf_reader(cls, source: Any) -> Tokenizer:
        meta = _tokenizer_metadata(source)
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise TokenizerError(
                f"GGUF tokenizer model {model!r} is not supported; supported: 'gpt2' (byte-level BPE)"
            )
        tokens = _string_list(meta, "tokenizer.ggml.tokens")
        merges = _string_list(meta, "tokenizer.ggml.merges", [])
        if bad := next((m for m in merges if " " not in m), None):
            raise TokenizerError(f"GGUF merge {bad!r} is not two tokens separated by a space")
        token_types = meta.get("tokenizer.ggml.token_type", [])
        if not (isinstance(token_types, list) and all(type(t) is int for t in token_types)):
            raise TokenizerError("GGUF metadata 'tokenizer.ggml.token_type' is not a list of integers")
        pre = meta.get("tokenizer.ggml.pre")
        template = meta.get("tokenizer.chat_template")
        if not all(v is None or isinstance(v, str) for v in (pre, template)):
            raise TokenizerError("GGUF metadata 'tokenizer.ggml.pre' and 'tokenizer.chat_template' must be strings")

        def token_at(key: str) -> str | None:
            index = meta.get(f"tokenizer.ggml.{key}")
            if index is None:
                return None
            if type(index) is not int or not 0 <= index < len(tokens):
                raise TokenizerError(f"GGUF metadata 'tokenizer.ggml.{key}' = {index!r} is not a token id "
                                     f"(the vocabulary has {len(tokens)} tokens)")
            return tokens[index]

        try:
            return cls(
                _byte_level_backend(tokens, merges, token_types, pre),
                bos_token=token_at("bos_token_id"),
                eos_token=token_at("eos_token_id"),
                pad_token=token_at("padding_token_id"),
                unk_token=token_at("unknown_token_id"),
                chat_template=template,
                add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            )
        except TokenizerError:
            raise
        except Exception as err:  # the tokenizers library raises bare Exceptions for bad vocabularies
            raise TokenizerError(f"the GGUF vocabulary cannot be used: {err}") from err

    # -------------------------------------------------------------------------------------- codec
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; with `add_special_tokens` BOS/EOS are added as configured."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`.

        Never raises on what a model samples: bytes that are not valid UTF-8 (a character cut
        between tokens) decode to U+FFFD, and ids past the vocabulary (a padded embedding's extra
        rows) to nothing, as in transformers. An id below 0 or above 2**32 - 1 raises TokenizerError.
        """
        ids = list(ids)
        try:
            text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        except OverflowError:
            position, bad = next(((i, t) for i, t in enumerate(ids) if not 0 <= t < 2**32), (None, None))
            raise TokenizerError(f"cannot decode token id {bad} at position {position}: "
                                 "ids must be in [0, 2**32)") from None
        return _clean_up_spaces(text) if self.clean_up_tokenization_spaces else text

    def token_bytes(self) -> list[bytes] | None:
        """Every token id's bytes as `decode` joins them (before U+FFFD replacement and the space
        clean-up), or None where the decoder's text is not such a concatenation. Byte-level BPE:
        a token's characters through GPT-2's byte alphabet; SentencePiece: "▁" a space, `<0xNN>`
        that byte; added tokens their content."""
        decoder = repr(self._backend.decoder)
        added = {t.content for t in self._backend.get_added_tokens_decoder().values()}
        tokens = [self._backend.id_to_token(i) for i in range(self.vocab_size)]
        if decoder.startswith("ByteLevel"):
            byte_of = {c: b for b, c in _byte_alphabet().items()}
            return [b"" if t is None else t.encode() if t in added or not set(t) <= byte_of.keys()
                    else bytes(byte_of[c] for c in t) for t in tokens]
        if "Metaspace" in decoder or "▁" in decoder:
            return [b"" if t is None else t.encode() if t in added else _piece_bytes(t)
                    for t in tokens]
        return None

    # ------------------------------------------------------------------------------- chat template
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Renders `messages` (dicts with `role` and `content`) with the chat template.

        `tools` are JSON-schema dicts; extra keyword arguments become template variables and take
        precedence over the special-token variables.
        """
        if self.chat_template is None:
            raise TokenizerError("this tokenizer has no chat template; pass one or load a model that has one")
        if tools is not None and not all(isinstance(tool, Mapping) for tool in tools):
            raise TypeError("tools must be JSON-schema dicts")
        template = _compile_template(self.chat_template)
        variables = {**self.special_tokens_map, **kwargs}
        return template.render(
            messages=_with_reasoning_aliases(messages),
            tools=None if tools is None else [dict(tool) for tool in tools],
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered chat (the template writes its own special tokens)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
        return self.encode(text, add_special_tokens=False)

    # ---------------------------------------------------------------------------------------- save
    def save(self, path: str | os.PathLike) -> None:
        """Writes `tokenizer.json` and `tokenizer_config.json` (with the chat template) to `path`."""
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        self._backend.save(os.path.join(path, "tokenizer.json"))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **self.special_tokens_map,
            "clean_up_tokenization_spaces": self.clean_up_tokenization_spaces,
        }
        if self._owns_post_processor:
            config.update(add_bos_token=self.add_bos_token, add_eos_token=self.add_eos_token)
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
            f.write("\n")


# ------------------------------------------------------------------------------------ folder helpers
def _token_content(value: Any) -> str | None:
    """A special token as `tokenizer_config.json` stores it: a string or a serialized AddedToken."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


def _read_chat_template(path: str, config: Mapping[str, Any]) -> str | None:
    """`chat_template.jinja` when present (as transformers 5 writes it), else the config's entry."""
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {entry["name"]: entry["template"] for entry in template}
        template = named.get("default")
    return template


def _piece_bytes(piece: str) -> bytes:
    """A SentencePiece token's bytes: `<0xNN>` (byte fallback) that byte, else its text with "▁"
    for a space."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("▁", " ").encode()


def _clean_up_spaces(text: str) -> str:
    """Removes the space before punctuation and English contractions (transformers' clean-up)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


# -------------------------------------------------------------------------------------- GGUF helpers
def _tokenizer_metadata(reader: Any) -> dict[str, Any]:
    """The `tokenizer.*` fields of a `gguf.GGUFReader`, decoded to Python values."""
    try:
        meta = {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}
    except UnicodeDecodeError as err:
        raise TokenizerError(f"GGUF tokenizer metadata holds a string that is not UTF-8 ({err.reason})") from None
    if "tokenizer.ggml.tokens" not in meta:
        raise TokenizerError("the GGUF file has no tokenizer (no 'tokenizer.ggml.tokens' metadata)")
    return meta


def _string_list(meta: Mapping[str, Any], key: str, default: Any = None) -> list[str]:
    value = meta.get(key, default)
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise TokenizerError(f"GGUF metadata {key!r} is not a list of strings")
    return value


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-to-character table: printable Latin-1 bytes map to themselves, the other bytes
    to the code points from 256 upward, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_backend(
    tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int], pre: str | None
) -> tokenizers.Tokenizer:
    """A byte-level BPE backend from GGUF vocabulary arrays."""
    table = _byte_alphabet()
    alphabet = set(table.values())

    def spelled(token: str) -> str:
        return token if set(token) <= alphabet else "".join(table[b] for b in token.encode("utf-8"))

    vocab = {spelled(token): index for index, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    split = _SPLIT_BY_PRE.get(pre or "")
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()
    types = list(token_types)
    # Control tokens spelled outside the byte alphabet are mislabelled ordinary tokens: skip them.
    control = [t for t, k in zip(tokens, types) if k == _TOKEN_TYPE_CONTROL and set(t) <= alphabet]
    user = [t for t, k in zip(tokens, types) if k == _TOKEN_TYPE_USER_DEFINED and t in vocab]
    backend.add_special_tokens([tokenizers.AddedToken(t, normalized=False, special=True) for t in control])
    backend.add_tokens([tokenizers.AddedToken(t, normalized=False, special=False) for t in user])
    return backend


# ---------------------------------------------------------------------------------- jinja helpers
class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text; it renders as its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """`json.dumps` without jinja's HTML escaping, as chat templates expect."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _with_reasoning_aliases(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copies of `messages` where a reasoning text given under any common name is also available as
    `reasoning_content` and `thinking`, the names templates read."""
    out = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        message = dict(message)
        reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out
