"""Prompt data sets as typed `Example` records: local JSONL/Parquet files and a name registry.

A source is a random-access sequence of `Example`s for one split ("train", "eval" or "all"),
so it can be fed straight to `grain.MapDataset.source`.

Splits. Every example is assigned to "train" or "eval" by a salted SHA-256 of its prompt
content (the chat messages), never by position: the assignment is the same on every host and
in every run, and two examples with the same prompt always land in the same split, so a train
split and an eval split of one source never share a uid nor a prompt. `eval_fraction` sets the
expected share of eval examples.

Files. A `FieldMap` names the fields to read. Lines (JSONL) or rows (Parquet) must all be
valid; reading stops with an error naming the file, the line or row number and the field for:
a line that is not UTF-8 or holds a lone surrogate escape (bad lines are refused, not skipped:
a silently shorter data set hides corruption), a line that is not a JSON object (or nests too
deeply, or holds a number too long to convert), a missing or mistyped field, a duplicate uid,
and an empty file; a `ListSource` refuses duplicate uids too. Blank lines are ignored. Without
a `uid_field` the uid is `"<source name>:<first 16 hex digits of the content hash>"`, so a file
may be reordered without changing its uids, and a prompt repeated in the file is refused as a
duplicate uid.

Hugging Face `datasets` sources ("hf:NAME[:CONFIG][@SPLIT]") live in `rlx.data.hub`.
Bundled sources (`rlx.data.bundled`, `rlx.data.arith`) are registered by prefix and loaded
only when asked for: `get_source("mmath:math500", "eval")`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, Protocol, overload

from rlx.rewards.base import CHAT_KEY

Split = Literal["train", "eval", "all"]
SPLITS = ("train", "eval", "all")
_SPLIT_SALT = b"rlx-split-v1\0"
DEFAULT_EVAL_FRACTION = 0.1


class DataError(ValueError):
    """A data set cannot be read or used (bad line, missing field, duplicate uid, empty)."""


@dataclasses.dataclass(frozen=True)
class Message:
    """One chat message."""

    role: str  # "system" | "user" | "assistant" | "tool"
    content: str

    def to_dict(self) -> dict[str, str]:
        """The `{"role", "content"}` dict chat templates expect."""
        return {"role": self.role, "content": self.content}


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt with its ground truth.

    `messages` is the prompt chat (at least one message; the last is usually the user's
    question); `prompt` is the question text alone (used by instruction templates).
    `answer` (math gold answer, BFCL ground truth as JSON), `tests` (assert statements) and
    `fields` (other ground-truth fields, e.g. HumanEval's prompt/test/entry_point) are what
    rewards grade against; `tools` are JSON-schema function specs offered to the model.
    """

    uid: str
    source: str
    split: str
    prompt: str
    messages: tuple[Message, ...]
    answer: str | None = None
    tests: tuple[str, ...] = ()
    tools: tuple[Mapping[str, Any], ...] = ()
    fields: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def reward_sample(self, chat: bool = False) -> dict[str, Any]:
        """The ground-truth mapping rewards take (`answer`, `tests`, and `fields`; `prompt`, the
        question text, unless a field has that name: what an LLM judge is shown; with `chat` also
        the prompt's messages under `rlx.rewards.base.CHAT_KEY`, for a reward model)."""
        sample: dict[str, Any] = {"prompt": self.prompt, **self.fields}
        if chat:
            sample[CHAT_KEY] = [m.to_dict() for m in self.messages]
        if self.answer is not None:
            sample["answer"] = self.answer
        if self.tests:
            sample["tests"] = list(self.tests)
        return sample


def user_example(
    uid: str, source: str, prompt: str, split: str = "all", **kwargs: Any
) -> Example:
    """An example whose prompt chat is the single user message `prompt`."""
    return Example(uid, source, split, prompt, (Message("user", prompt),), **kwargs)


class Source(Protocol):
    """A random-access sequence of examples of one split."""

    name: str
    split: str

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Example: ...


# ------------------------------------------------------------------------------------ splits
def content_key(messages: Sequence[Message]) -> str:
    """The hex SHA-256 of a prompt chat (what splits and default uids are derived from)."""
    text = json.dumps([[m.role, m.content] for m in messages], ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def split_of(messages: Sequence[Message], eval_fraction: float) -> str:
    """"eval" for a deterministic `eval_fraction` share of prompts, else "train"."""
    digest = hashlib.sha256(_SPLIT_SALT + content_key(messages).encode()).digest()
    bucket = int.from_bytes(digest[:8], "big") / 2.0**64
    return "eval" if bucket < eval_fraction else "train"


def check_split(split: str, eval_fraction: float) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not 0.0 <= eval_fraction <= 1.0:
        raise ValueError(f"eval_fraction={eval_fraction} must be in [0, 1]")


class ListSource(Sequence[Example]):
    """The examples of one split of a finite data set, held in memory."""

    def __init__(self, name: str, split: str, examples: Sequence[Example]):
        self.name, self.split = name, split
        self._examples = tuple(examples)
        uids: set[str] = set()
        for example in self._examples:  # advantages group rollouts by uid
            if example.uid in uids:
                raise DataError(f"data set {name!r} has the uid {example.uid!r} more than once")
            uids.add(example.uid)

    def __len__(self) -> int:
        return len(self._examples)

    @overload
    def __getitem__(self, index: int) -> Example: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Example]: ...

    def __getitem__(self, index):
        return self._examples[index]

    def __repr__(self) -> str:
        return f"ListSource({self.name!r}, split={self.split!r}, {len(self)} examples)"


def select_split(
    name: str, examples: Sequence[Example], split: str, eval_fraction: float
) -> ListSource:
    """The `split` part of `examples` (all of them for "all"), with `Example.split` set.

    Refuses duplicate uids and an empty result.
    """
    check_split(split, eval_fraction)
    if not examples:
        raise DataError(f"data set {name!r} is empty")
    seen: set[str] = set()
    chosen = []
    for example in examples:
        if example.uid in seen:
            raise DataError(f"data set {name!r} has the uid {example.uid!r} more than once")
        seen.add(example.uid)
        assigned = split_of(example.messages, eval_fraction)
        if split in ("all", assigned):
            chosen.append(dataclasses.replace(example, split=assigned))
    if not chosen:
        raise DataError(
            f"the {split!r} split of {name!r} is empty ({len(examples)} examples, "
            f"eval_fraction={eval_fraction}); use split='all' or another eval_fraction"
        )
    return ListSource(name, split, chosen)


# ------------------------------------------------------------------------------------- files
@dataclasses.dataclass(frozen=True)
class FieldMap:
    """Which record fields hold what. None: the data set has no such field."""

    prompt_field: str | None = "prompt"  # the question text
    messages_field: str | None = None  # a list of {"role", "content"} (replaces prompt_field)
    answer_field: str | None = "answer"  # gold answer (strings; numbers are converted)
    uid_field: str | None = None  # None: derived from the content hash
    tests_field: str | None = None  # a list of assert statements
    tools_field: str | None = None  # a list of JSON-schema function specs
    extra_fields: tuple[str, ...] = ()  # copied as strings into Example.fields

    def __post_init__(self):
        if (self.prompt_field is None) == (self.messages_field is None):
            raise ValueError("FieldMap needs exactly one of prompt_field and messages_field")


def read_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) for each non-blank line; errors name the file and line."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: line {number} is not valid UTF-8 ({e.reason})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: line {number} is not valid JSON ({e.msg})") from None
            except (ValueError, RecursionError) as e:  # a 5000-digit number, 10^5 nested brackets
                raise DataError(f"{path}: line {number} is not usable JSON ({e})") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}: line {number} is not a JSON object")
            if "\\u" in line:  # only a \uXXXX escape can make a lone surrogate, which no text holds
                try:
                    json.dumps(record, ensure_ascii=False).encode("utf-8")
                except UnicodeEncodeError:
                    raise DataError(f"{path}: line {number} holds a lone UTF-16 surrogate "
                                    "(a \\ud800-\\udfff escape), which is not text") from None
            yield number, record


def read_parquet(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row number from 1, record) for each row of a Parquet file (needs pyarrow)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("reading Parquet files needs the 'pyarrow' package") from None
    table = pq.read_table(os.fspath(path))
    for number, record in enumerate(table.to_pylist(), start=1):
        yield number, record


def _field(record: Mapping[str, Any], name: str, where: str, kind: type | tuple = str) -> Any:
    if name not in record or record[name] is None:
        raise DataError(f"{where}: missing field {name!r} (fields: {', '.join(record)})")
    value = record[name]
    if kind is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, kind):
        raise DataError(f"{where}: field {name!r} has type {type(value).__name__}")
    return value


def _messages(value: Sequence[Any], name: str, where: str) -> tuple[Message, ...]:
    messages = []
    for i, m in enumerate(value):
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: {name}[{i}] is not a {{'role', 'content'}} message")
        messages.append(Message(m["role"], m["content"]))
    if not messages:
        raise DataError(f"{where}: field {name!r} holds no messages")
    return tuple(messages)


def record_to_example(
    record: Mapping[str, Any], fields: FieldMap, source: str, where: str
) -> Example:
    """One file record as an `Example` (split not yet assigned)."""
    if fields.messages_field is not None:
        messages = _messages(_field(record, fields.messages_field, where, list),
                             fields.messages_field, where)
        prompt = next((m.content for m in reversed(messages) if m.role == "user"), "")
    else:
        prompt = _field(record, fields.prompt_field, where)
        messages = (Message("user", prompt),)
    tests = tools = ()
    if fields.tests_field is not None:
        tests = tuple(_field(record, fields.tests_field, where, list))
        if not all(isinstance(t, str) for t in tests):
            raise DataError(f"{where}: field {fields.tests_field!r} must hold strings")
    if fields.tools_field is not None:
        tools = tuple(_field(record, fields.tools_field, where, list))
        if not all(isinstance(t, Mapping) for t in tools):
            raise DataError(f"{where}: field {fields.tools_field!r} must hold JSON objects")
    if fields.uid_field is not None:
        uid = _field(record, fields.uid_field, where)
    else:
        uid = f"{source}:{content_key(messages)[:16]}"
    return Example(
        uid=uid, source=source, split="all", prompt=prompt, messages=messages,
        answer=None if fields.answer_field is None else _field(record, fields.answer_field, where),
        tests=tests, tools=tools,
        fields={name: str(_field(record, name, where)) for name in fields.extra_fields},
    )


def load_file(
    path: str | os.PathLike,
    split: str = "train",
    *,
    fields: FieldMap = FieldMap(),
    eval_fraction: float = DEFAULT_EVAL_FRACTION,
    name: str | None = None,
) -> ListSource:
    """One split of a `.jsonl` or `.parquet` file (by extension) as a source."""
    path = os.fspath(path)
    name = name or os.path.basename(path)
    if path.endswith((".parquet", ".pq")):
        reader, unit = read_parquet, "row"
    elif path.endswith((".jsonl", ".json")):
        reader, unit = read_jsonl, "line"
    else:
        raise DataError(f"{path}: unknown file type (expected .jsonl or .parquet)")
    examples, first = [], {}
    for number, record in reader(path):
        example = record_to_example(record, fields, name, f"{path}: {unit} {number}")
        if example.uid in first:
            how = ("the same uid field" if fields.uid_field else
                   "the same prompt and answer; give each record a uid field (FieldMap.uid_field)")
            raise DataError(f"{path}: {unit} {number} has the uid {example.uid!r} more than once "
                            f"(first at {unit} {first[example.uid]}: {how}, or remove the repeat)")
        first[example.uid] = number
        examples.append(example)
    if not examples:
        raise DataError(f"{path}: no records")
    return select_split(name, examples, split, eval_fraction)


# ---------------------------------------------------------------------------------- registry
SourceFactory = Callable[..., Source]

# prefix -> "module:function(argument, split, **options)"; imported on first use.
_BUILTIN: dict[str, str] = {
    "mmath": "rlx.data.bundled:mmath_source",
    "humaneval": "rlx.data.bundled:humaneval_source",
    "mbpp": "rlx.data.bundled:mbpp_source",
    "bfcl": "rlx.data.bundled:bfcl_source",
    "reasoning_gym": "rlx.data.bundled:reasoning_gym_source",
    "arith": "rlx.data.arith:arith_source",
    "arith_pairs": "rlx.data.pairs:arith_pairs_source",  # preference pairs (rlx.data.pairs)
    "pairs": "rlx.data.pairs:pairs_source",
    "jsonl": "rlx.data.sources:_file_source",
    "parquet": "rlx.data.sources:_file_source",
    "hf": "rlx.data.hub:hf_source",  # Hugging Face `datasets` (rlx.data.hub)
}
_REGISTRY: dict[str, SourceFactory] = {}


def _file_source(path: str, split: str, **options: Any) -> ListSource:
    return load_file(path, split, **options)


def register_source(prefix: str, factory: SourceFactory) -> None:
    """Makes `get_source("prefix:arg", split, **options)` call `factory(arg, split, **options)`."""
    if prefix in _REGISTRY or prefix in _BUILTIN:
        raise ValueError(f"source prefix {prefix!r} is already registered")
    _REGISTRY[prefix] = factory


def available_sources() -> list[str]:
    return sorted(set(_BUILTIN) | set(_REGISTRY))


def get_source(spec: str, split: str = "train", **options: Any) -> Source:
    """The `split` of the source named `spec`, e.g. "mmath:math500", "humaneval",
    "bfcl:simple_python", "arith:basic", "jsonl:/data/x.jsonl", "hf:openai/gsm8k:main" (options such as `fields=`,
    `eval_fraction=`, `seed=`, `size=` go to the source)."""
    prefix, _, argument = spec.partition(":")
    factory = _REGISTRY.get(prefix)
    if factory is None and prefix in _BUILTIN:
        module_name, attr = _BUILTIN[prefix].split(":")
        factory = getattr(importlib.import_module(module_name), attr)
    if factory is None:
        raise KeyError(f"unknown data source {spec!r}; known prefixes: "
                       f"{', '.join(available_sources())}")
    return factory(argument, split, **options)
