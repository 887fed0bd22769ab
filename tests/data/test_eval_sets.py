"""Named eval sets: spelling and names, per-set pass@1 / mean@k / pass@k, contamination counts."""

from __future__ import annotations

import json
import math

import pytest

from rlx.data.eval_sets import (EvalSet, contamination, derived_name, evaluate_sets, load_eval_sets,
                                parse_eval_sources, summary_lines)
from rlx.data.sources import user_example
from rlx.errors import ConfigError
from rlx.rewards import RewardResult
from rlx.types import SamplingParams
from tests.helpers.replay import ReplayEngine
from tests.helpers.tokenizers import byte_tokenizer


def test_names_are_given_or_derived_from_the_source():
    assert parse_eval_sources(["aime=mmath:aime24", "mmath:aime25", "jsonl:/d/x=y/set.jsonl",
                               "hf:openai/gsm8k:main@test"]) == (
        ("aime", "mmath:aime24"), ("aime25", "mmath:aime25"),
        ("set", "jsonl:/d/x=y/set.jsonl"),  # an '=' inside a path names nothing
        ("gsm8k_main_test", "hf:openai/gsm8k:main@test"))
    assert derived_name("humaneval") == "humaneval"


@pytest.mark.parametrize("entries,message", [
    (["nope:x"], "unknown source prefix 'nope'"),
    (["a b=mmath:aime24"], "the name 'a b' must be letters"),
    (["aime24="], "names no source"),
    (["mmath:aime24", "aime24=mmath:math500"], "names two sets 'aime24'"),
])
def test_bad_entries_get_one_line(entries, message):
    with pytest.raises(ConfigError, match=message) as e:
        parse_eval_sources(entries)
    assert "\n" not in str(e.value) and str(e.value).startswith("config.data.eval_sources")


def test_ready_made_sets_load_whole():
    (math500, aime24, aime25) = load_eval_sets(["mmath:math500", "mmath:aime24",
                                                "mmath:aime25"], procedural_size=0)
    assert [len(s.examples) for s in (math500, aime24, aime25)] == [311, 30, 15]  # bundled.py
    (arith,) = load_eval_sets(["arith:add2"], procedural_size=5)
    assert len(arith.examples) == 5 and len({e.prompt for e in arith.examples}) == 5
    with pytest.raises(ConfigError, match="is procedural"):
        load_eval_sets(["arith:add2"], procedural_size=0)


def test_jsonl_set_is_read_from_a_file(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1", "answer": str(i + 1)}) + "\n"
                            for i in range(3)))
    (mine,) = load_eval_sets([f"jsonl:{path}"], procedural_size=0)
    assert mine.name == "mine" and [e.answer for e in mine.examples] == ["1", "2", "3"]


def exact(completion: str, sample) -> RewardResult:
    return RewardResult(float(completion.strip() == sample["answer"]))


def half_credit(completion: str, sample) -> RewardResult:
    """1 for the gold answer, 0.5 for anything else (never counted correct)."""
    return RewardResult(1.0 if completion.strip() == sample["answer"] else 0.5)


def test_per_set_metrics_against_math_comb():
    tok = byte_tokenizer()
    a = [user_example("p", "a", "1+1", answer="2"), user_example("q", "a", "2+2", answer="4")]
    b = [user_example("r", "b", "3+3", answer="6")]
    sets = (EvalSet("a", "x", tuple(a)), EvalSet("b", "y", tuple(b)))
    # n = 4 samples per problem, cycling the replies: p: 2, 3, 2, 3 -> c = 2; q: 5 x4 -> c = 0;
    # r: 6, 6, 6, 1 -> c = 3.
    engine = ReplayEngine(tok, {"p": ["2", "3"], "q": ["5"], "r": ["6", "6", "6", "1"]})
    got = evaluate_sets(sets, 2, engine=engine, reward=exact, sampling=SamplingParams(n=4),
                        tokenizer=tok)

    def unbiased(n, c, k):  # Chen et al. (2021): 1 - C(n - c, k) / C(n, k)
        return 1 - math.comb(n - c, k) / math.comb(n, k)

    # a: pass@1 = (2/4 + 0/4) / 2 = 0.25; pass@2 = (1 - C(2,2)/C(4,2) + 0) / 2 = (1 - 1/6) / 2
    # = 5/12; mean@2 = 2 correct of 8 samples, reward 0/1 -> 0.25.
    assert got["eval/a/pass@1"] == pytest.approx((unbiased(4, 2, 1) + unbiased(4, 0, 1)) / 2)
    assert got["eval/a/pass@2"] == pytest.approx((unbiased(4, 2, 2) + unbiased(4, 0, 2)) / 2)
    assert got["eval/a/pass@2"] == pytest.approx(5 / 12)
    assert got["eval/a/mean@2"] == pytest.approx(0.25)
    # b: c = 3 of 4: pass@1 = 3/4; pass@2 = 1 - C(1,2)/C(4,2) = 1 - 0/6 = 1.
    assert got["eval/b/pass@1"] == pytest.approx(0.75) and got["eval/b/pass@2"] == 1.0
    assert set(got) == {f"eval/{s}/{m}" for s in "ab" for m in ("pass@1", "pass@2", "mean@2")}
    # a reward that is not 0/1: mean@k is the mean reward, pass@1 counts rewards >= 1 only.
    # b: 6, 6, 6, 1 -> 1, 1, 1, 0.5: mean@1 = 3.5/4 = 0.875, pass@1 = 3/4; no pass@k for k = 1.
    got = evaluate_sets(sets[1:], 1, engine=engine, reward=half_credit,
                        sampling=SamplingParams(n=4), tokenizer=tok)
    assert got == {"eval/b/pass@1": 0.75, "eval/b/mean@1": 0.875}
    lines = summary_lines([{"step": 0, **got, "eval/a/pass@1": 0.25},
                           {"step": 3, "eval/accuracy": 0.5}])
    assert lines == ["eval sets at step 0: b pass@1 75.0% mean@1 0.88; a pass@1 25.0%"]


def test_contamination_counts_training_problems_of_each_set():
    held = (EvalSet("s", "x", (user_example("e1", "s", "What is 2+2?"),
                               user_example("e2", "s", "Name a prime."))),
            EvalSet("t", "y", (user_example("e3", "t", "Unrelated question"),)))
    # t1 and t3 are e1 up to case and spacing, t2 is e2 verbatim, t4 is new: 3 in s, 0 in t.
    train = [user_example("t1", "tr", "what  is 2+2?"), user_example("t2", "tr", "Name a prime."),
             user_example("t3", "tr", " WHAT IS 2+2? "), user_example("t4", "tr", "Other")]
    found = contamination("train-set", train, held)
    assert found["s"][0] == 3 and found["t"][0] == 0
    assert found["s"][1] == ("train-set: 3 of 4 training problems are also in eval set 's' "
                             "(same normalised prompt; e.g. t1, t2, t3)")
    assert found["t"][1] == "train-set: none of 4 training problems is in eval set 't'"
