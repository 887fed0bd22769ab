"""The BFCL-style call reward on the bundled BFCL v4 data (`bfcl-eval`'s `possible_answer` files).

For every problem of four single-turn categories the reference answer itself, written as the
calls a model would emit (`<tool_call>` blocks; the parallel categories in reversed order), scores
1.0; the same calls with one argument corrupted (an int + 1, a float + 1.5, a string with "zz"
appended, a flipped bool, a list with one more element, a dict with one more key) score 0; so do a
missing required argument, an unexpected argument, an int given as a string, a call too few and
a malformed call.
"""

from __future__ import annotations

import json
import random

import pytest

from rlx.rewards import get_reward

pytest.importorskip("bfcl_eval")

CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple")


def examples(category: str):
    from rlx.data.bundled import bfcl_source

    return [e for e in bfcl_source(category) if e.answer is not None]


def reference_calls(truth) -> list[dict]:
    """Each ground-truth call with every parameter's first allowed value ("" first: left out)."""
    out = []
    for call in truth:
        (name, params), = call.items()
        args = {k: pick(v[0]) for k, v in params.items() if v[0] != ""}
        out.append({"name": name, "arguments": args})
    return out


def pick(value):
    """A value with every nested dict's first allowed values (BFCL nests option lists there)."""
    if isinstance(value, dict):
        return {k: pick(v[0] if isinstance(v, list) else v) for k, v in value.items()
                if not (isinstance(v, list) and v[0] == "")}
    if isinstance(value, list):
        return [pick(v) for v in value]
    return value


def completion(calls: list[dict]) -> str:
    return "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)


def corrupt(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value + 1.5
    if isinstance(value, str):
        return value + "zz"
    if isinstance(value, list):
        return [*value, value[0] if value else 1]
    if isinstance(value, dict):
        return {**value, "zz_extra": 1}
    raise AssertionError(f"no corruption for {value!r}")


@pytest.fixture(scope="module")
def reward():
    return get_reward("tool_call")


@pytest.mark.parametrize("category", CATEGORIES)
def test_reference_answers_score_one_and_corrupted_arguments_zero(category, reward):
    rng = random.Random(0)
    data = examples(category)
    assert len(data) >= 200
    corrupted = 0
    for example in data:
        truth = json.loads(example.answer)
        calls = reference_calls(truth)
        emitted = calls[::-1] if category.startswith("parallel") else calls
        result = reward(completion(emitted), example.reward_sample())
        assert result.score == 1.0, (example.uid, result.reason, emitted)
        # arguments whose corrupted value is not itself allowed (e.g. a bool allowing both)
        choices = [(i, key) for i, c in enumerate(calls) for key, value in c["arguments"].items()
                   if corrupt(value) not in next(iter(truth[i].values()))[key]]
        if not choices:
            continue
        i, key = rng.choice(choices)
        bad = [dict(c, arguments=dict(c["arguments"])) for c in calls]
        bad[i]["arguments"][key] = corrupt(bad[i]["arguments"][key])
        result = reward(completion(bad), example.reward_sample())
        assert result.score == 0.0, (example.uid, key, bad[i])
        corrupted += 1
    assert corrupted >= 0.9 * len(data)


def test_each_kind_of_wrong_call_scores_zero_with_its_reason(reward):
    example = next(e for e in examples("simple_python") if e.uid == "bfcl:simple_python_0")
    sample = example.reward_sample()  # calculate_triangle_area(base=10, height=5[, unit])
    good = {"name": "calculate_triangle_area", "arguments": {"base": 10, "height": 5}}
    assert reward(completion([good]), sample).score == 1.0
    # BFCL's string normalisation: case, spaces and , . / - _ * ^ are ignored
    unit = {**good, "arguments": {**good["arguments"], "unit": "Units"}}
    assert reward(completion([unit]), sample).score == 1.0
    cases = {
        "missing required argument 'height'": {**good, "arguments": {"base": 10}},
        "unexpected argument 'side'": {**good, "arguments": {**good["arguments"], "side": 1}},
        "'base'='10' is not one of [10]": {**good, "arguments": {"base": "10", "height": 5}},
        "'base'=10.5 is not one of [10]": {**good, "arguments": {"base": 10.5, "height": 5}},
        "called 'area', expected": {**good, "name": "area"},
    }
    for reason, call in cases.items():
        result = reward(completion([call]), sample)
        assert result.score == 0.0 and reason in result.reason, (reason, result.reason)
    assert "2 calls, expected 1" in reward(completion([good, good]), sample).reason
    assert "malformed call" in reward("<tool_call>{oops</tool_call>", sample).reason
    # the OpenAI-style object and a JSON list in one block are calls too
    openai = {"type": "function", "function": {"name": good["name"],
                                               "arguments": json.dumps(good["arguments"])}}
    assert reward(json.dumps(openai), sample).score == 1.0
    assert reward(f"<tool_call>{json.dumps([good])}</tool_call>", sample).score == 1.0


def test_no_answer_means_no_call_is_right(reward):
    assert reward("I cannot help with that.", {}).score == 1.0
    assert reward(completion([{"name": "f", "arguments": {}}]), {}).score == 0.0


def in_format(calls: list[dict], fmt: str) -> str:
    """Several calls in one turn, written in a family's format (``render_call`` per call; one
    DeepSeek section holds them all, harmony writes one message each)."""
    from rlx.rewards.tool_formats import FORMATS
    from rlx.rewards.tool_formats.deepseek_v3 import CALLS_BEGIN, CALLS_END

    written = [FORMATS[fmt].render_call(c["name"], c["arguments"]) for c in calls]
    if fmt == "deepseek_v3":
        inner = [w.removeprefix(CALLS_BEGIN).removesuffix(CALLS_END) for w in written]
        return CALLS_BEGIN + "\n".join(inner) + CALLS_END
    return {"hermes": "\n", "llama3_json": "; ", "harmony": "<|start|>assistant"}[fmt].join(written)


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "deepseek_v3", "harmony"])
def test_parallel_answers_in_each_family_format(fmt):
    reward = get_reward("tool_call", tool_format=fmt)
    hermes = get_reward("tool_call")
    for example in examples("parallel")[:40]:
        calls = reference_calls(json.loads(example.answer))[::-1]
        text = in_format(calls, fmt)
        result = reward(text, example.reward_sample())
        assert result.score == 1.0, (example.uid, result.reason, text)
        if fmt != "hermes":  # read as Hermes, another family's calls are no calls
            assert hermes(text, example.reward_sample()).score == 0.0
