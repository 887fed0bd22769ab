"""Bad data sets are refused with the file, line and field named, or skipped and counted.

Already covered in tests/data (not repeated here): a missing answer field (JSONL and Parquet), a
non-UTF-8 line, bad JSON, a non-object line, a file of blank lines, a duplicate uid field, a
repeated prompt, a mistyped prompt, over-long prompts dropped and counted, every prompt too long.

Here: 5 kinds of empty data set and an unknown file type, 11 kinds of unusable line (before the
fix 100k nested brackets, a 5000-digit number and a lone surrogate escape in the prompt crashed
with RecursionError, ValueError and UnicodeEncodeError, and one in the answer loaded silently),
17 missing or mistyped fields, 4 kinds of duplicate uid (an in-memory `ListSource` accepted them
before), 100 generated files of good records, JSON values and random bytes, and 80 generated
pipelines of prompts around the length limit (an endless run with fewer short prompts than the
batch size claimed "every prompt is too long" before).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlx.data import DataError, FieldMap, ListSource, load_file, make_prompt_pipeline
from rlx.data.chat import PromptFormat, encode_prompt
from rlx.data.sources import user_example
from tests.helpers.tokenizers import byte_tokenizer

FUZZ = dict(deadline=None, derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
GOOD = '{"prompt": "1+1?", "answer": "2"}\n'


def jsonl(tmp_path, text: str | bytes, name: str = "d.jsonl"):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return path


# ------------------------------------------------------------------------------ empty data
def test_zero_byte_file(tmp_path):
    path = jsonl(tmp_path, b"")
    with pytest.raises(DataError, match=f"{path}: no records"):
        load_file(path, "all")


def test_zero_row_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()),
                             "answer": pa.array([], pa.string())}), path)
    with pytest.raises(DataError, match=f"{path}: no records"):
        load_file(path, "all")


def test_empty_split(tmp_path):
    path = jsonl(tmp_path, GOOD)
    with pytest.raises(DataError, match="'eval' split of 'd.jsonl' is empty"):
        load_file(path, "eval", eval_fraction=0.0)


def test_empty_source_and_empty_shard_in_the_pipeline():
    tok = byte_tokenizer()
    with pytest.raises(DataError, match="'none' is empty"):
        make_prompt_pipeline(ListSource("none", "all", []), tok, batch_size=1)
    two = ListSource("two", "all", [user_example(f"t:{i}", "t", f"q{i}") for i in range(2)])
    with pytest.raises(DataError, match="shard 2 of 3 of a 2-example source is empty"):
        make_prompt_pipeline(two, tok, batch_size=1, shard_index=2, shard_count=3)


def test_unknown_file_type(tmp_path):
    path = jsonl(tmp_path, GOOD, "d.csv")
    with pytest.raises(DataError, match="d.csv: unknown file type"):
        load_file(path, "all")


# ---------------------------------------------------------------------------- unusable lines
BAD_LINES = {
    # crashed with RecursionError / ValueError / UnicodeEncodeError before the fix:
    "100k nested brackets": "[" * 100_000 + "\n",
    "5000-digit number": '{"prompt": "a", "answer": ' + "9" * 5000 + "}\n",
    "lone surrogate in the prompt": '{"prompt": "x \\ud800 y", "answer": "1"}\n',
    "lone surrogate in the answer": '{"prompt": "q", "answer": "\\udfff"}\n',
    # refused with a clear message before as well:
    "NUL inside a string": '{"prompt": "a\x00b", "answer": "1"}\n',
    "cut-off last line": '{"prompt": "b", "ans',
    "null": "null\n",
    "a bare string": '"just text"\n',
    "Latin-1 text": '{"prompt": "caf\xe9", "answer": "1"}\n'.encode("latin-1"),
}


@pytest.mark.parametrize("line", BAD_LINES.values(), ids=BAD_LINES.keys())
def test_unusable_line_names_file_and_line(tmp_path, line):
    path = jsonl(tmp_path, GOOD.encode() + (line if isinstance(line, bytes) else line.encode()))
    with pytest.raises(DataError, match=f"{path}: line 2 "):
        load_file(path, "all")


def test_utf8_bom_and_utf16_files_are_refused_at_line_1(tmp_path):
    bom = jsonl(tmp_path, "\ufeff" + GOOD, "bom.jsonl")
    with pytest.raises(DataError, match="bom.jsonl: line 1 is not valid JSON .*BOM"):
        load_file(bom, "all")
    utf16 = jsonl(tmp_path, GOOD.encode("utf-16"), "utf16.jsonl")
    with pytest.raises(DataError, match="utf16.jsonl: line 1 is not valid UTF-8"):
        load_file(utf16, "all")


def test_crlf_line_ends_and_escaped_text_load(tmp_path):
    path = jsonl(tmp_path, GOOD.replace("\n", "\r\n") + '{"prompt": "\\u00e9 \\ud83d\\ude00",'
                 ' "answer": "2"}\r\n\r\n')
    source = load_file(path, "all")
    assert [e.prompt for e in source] == ["1+1?", "é 😀"]


# --------------------------------------------------------------------- missing/mistyped fields
FULL = FieldMap(prompt_field=None, messages_field="chat", uid_field="id", tests_field="tests",
                tools_field="tools", extra_fields=("level",))
RECORD = {"chat": [{"role": "user", "content": "q"}], "answer": "1", "id": "u1",
          "tests": ["assert True"], "tools": [{"type": "function"}], "level": 3}
FIELD_CASES = [  # (field, value or "<absent>", expected message)
    ("chat", "<absent>", "missing field 'chat'"),
    ("chat", None, "missing field 'chat'"),
    ("chat", "q", "field 'chat' has type str"),
    ("chat", [], "field 'chat' holds no messages"),
    ("chat", [{"role": "user"}], r"chat\[0\] is not a \{'role', 'content'\} message"),
    ("chat", [{"role": 1, "content": "q"}], r"chat\[0\] is not"),
    ("chat", ["q"], r"chat\[0\] is not"),
    ("answer", None, "missing field 'answer'"),
    ("answer", ["1"], "field 'answer' has type list"),
    ("answer", True, "field 'answer' has type bool"),
    ("id", "<absent>", "missing field 'id'"),
    ("id", {"a": 1}, "field 'id' has type dict"),
    ("tests", "assert True", "field 'tests' has type str"),
    ("tests", [1], "field 'tests' must hold strings"),
    ("tools", [["x"]], "field 'tools' must hold JSON objects"),
    ("tools", {"type": "function"}, "field 'tools' has type dict"),
    ("level", "<absent>", "missing field 'level'"),
]


@pytest.mark.parametrize("field, value, message", FIELD_CASES)
def test_missing_or_mistyped_field_names_field_and_line(tmp_path, field, value, message):
    bad = dict(RECORD, id="u2")
    if value == "<absent>":
        del bad[field]
    else:
        bad[field] = value
    path = jsonl(tmp_path, json.dumps(RECORD) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(DataError, match=f"{path}: line 2: {message}"):
        load_file(path, "all", fields=FULL)


# -------------------------------------------------------------------------- duplicate uids
def test_in_memory_source_refuses_duplicate_uids():
    # Advantages group rollouts by uid: two prompts sharing one would be normalised together.
    examples = [user_example("u", "s", "first"), user_example("u", "s", "second")]
    with pytest.raises(DataError, match="'mine' has the uid 'u' more than once"):
        ListSource("mine", "all", examples)


def test_numeric_and_string_uids_collide(tmp_path):
    path = jsonl(tmp_path, '{"id": 1, "prompt": "a", "answer": "1"}\n'
                           '{"id": "1", "prompt": "b", "answer": "2"}\n')
    with pytest.raises(DataError, match="uid '1' more than once"):
        load_file(path, "all", fields=FieldMap(uid_field="id"))


def test_repeated_chat_is_a_duplicate_uid(tmp_path):
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    path = jsonl(tmp_path, "".join(json.dumps({"chat": chat, "answer": a}) + "\n" for a in "12"))
    with pytest.raises(DataError, match="more than once"):
        load_file(path, "all", fields=FieldMap(prompt_field=None, messages_field="chat"))


def test_a_repeated_record_names_the_file_and_both_lines(tmp_path):
    path = jsonl(tmp_path, GOOD + '{"prompt": "2+2?", "answer": "4"}\n' + GOOD)
    with pytest.raises(DataError) as e:
        load_file(path, "all")
    assert str(path) in str(e.value) and "line 3 has the uid" in str(e.value)
    assert "first at line 1" in str(e.value) and "uid field" in str(e.value)


def test_duplicate_uids_in_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": ["a", "a"], "prompt": ["x", "y"], "answer": ["1", "2"]}), path)
    with pytest.raises(DataError, match="uid 'a' more than once"):
        load_file(path, "all", fields=FieldMap(uid_field="id"))


# ------------------------------------------------------------------------- generated files
_TEXT = st.text(st.one_of(st.characters(exclude_categories=()),  # lone surrogates included
                          st.sampled_from(["\ud800", "\udfff", "\x00", "\\", '"', "\n", "é"])),
                max_size=12)
_VALUE = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | _TEXT,
                      lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(_TEXT, inner, max_size=3), max_leaves=6)
_RECORD = st.fixed_dictionaries({"prompt": _TEXT | _VALUE, "answer": _TEXT | _VALUE})
_LINE = st.one_of(
    _RECORD.map(lambda r: json.dumps(r).encode() + b"\n"),  # \ud800 escapes for surrogates
    _VALUE.map(lambda v: json.dumps(v).encode() + b"\n"),
    st.binary(max_size=30).map(lambda b: b + b"\n"),
    st.sampled_from([b"\n", b"\r\n", b"  \n"]),
)


@settings(max_examples=100, **FUZZ)
@given(lines=st.lists(_LINE, max_size=8))
def test_any_jsonl_file_loads_or_raises_a_data_error_naming_it(tmp_path, lines):
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(b"".join(lines))
    try:
        source = load_file(path, "all")
    except DataError as e:
        assert str(path) in str(e)
        return
    assert len({e.uid for e in source}) == len(source) > 0
    for example in source:
        example.prompt.encode("utf-8")  # text only: no lone surrogates got through
    it = make_prompt_pipeline(source, byte_tokenizer(), batch_size=1, num_epochs=1,
                              shuffle=False, drop_remainder=False)
    assert sum(len(b.prompts) for b in it) == len(source)


# ------------------------------------------------------------------ prompts over the limit
@settings(max_examples=60, **FUZZ)
@given(lengths=st.lists(st.integers(0, 60), min_size=1, max_size=24),
       limit=st.integers(20, 80), batch_size=st.integers(1, 5), shards=st.integers(1, 3),
       epochs=st.integers(1, 2), drop_remainder=st.booleans(), data=st.data())
def test_over_long_prompts_are_skipped_and_counted(lengths, limit, batch_size, shards, epochs,
                                                   drop_remainder, data):
    tok = byte_tokenizer()
    examples = [user_example(f"p:{i}", "p", "x" * n) for i, n in enumerate(lengths)]
    shard = data.draw(st.integers(0, min(shards, len(examples)) - 1))
    mine = examples[shard::shards]
    too_long = sum(len(encode_prompt(tok, e, PromptFormat())) > limit for e in mine)
    it = make_prompt_pipeline(ListSource("p", "all", examples), tok, batch_size=batch_size,
                              max_prompt_tokens=limit, shard_index=shard, shard_count=shards,
                              num_epochs=epochs, drop_remainder=drop_remainder)
    if too_long == len(mine):  # nothing to train on: an error, or (one epoch) no batch at all
        try:
            assert list(it) == [] and it.stats.filtered_too_long == too_long * epochs
        except DataError as e:
            assert "every prompt of this shard is longer" in str(e)
        return
    batches = list(it)
    kept = (len(mine) - too_long) * epochs
    assert all(len(p.token_ids) <= limit for b in batches for p in b.prompts)
    assert it.stats.filtered_too_long == too_long * epochs
    assert it.stats.examples == sum(len(b.prompts) for b in batches)
    assert it.stats.examples == (kept // batch_size * batch_size if drop_remainder else kept)


@settings(max_examples=20, **FUZZ)
@given(long=st.integers(1, 12), short=st.integers(0, 3), batch_size=st.integers(1, 6))
def test_an_endless_run_with_a_few_short_prompts_keeps_going(long, short, batch_size):
    # Before the fix: with fewer short prompts than the batch size the pipeline raised
    # "every prompt of this shard is longer than max_prompt_tokens" although some were not.
    examples = ([user_example(f"l:{i}", "p", "x" * 100) for i in range(long)]
                + [user_example(f"s:{i}", "p", "s") for i in range(short)])
    it = make_prompt_pipeline(ListSource("p", "all", examples), byte_tokenizer(),
                              batch_size=batch_size, max_prompt_tokens=40)
    if short == 0:
        with pytest.raises(DataError, match="every prompt of this shard is longer"):
            next(it)
        return
    for _ in range(3):
        assert len(next(it).prompts) == batch_size
    assert it.stats.filtered_too_long >= long
