"""Contamination report: training problems that share a normalised prompt with an evaluation
problem are counted, and the count is logged once when the run's evaluation set is built."""

from __future__ import annotations

import hashlib
import json
import logging

from rlx.config import parse_config
from rlx.data.overlap import count_overlap, normalise_prompt, prompt_hash
from rlx.data.sources import load_file, split_of, user_example
from rlx.run.build import checked_eval_examples, run_source
from tests.helpers.runs import config_dict


def test_normalisation():
    # NFKC turns the full-width "Ｗ" and "２" into "W" and "2", casefold lowers, spaces collapse
    assert normalise_prompt("  Ｗhat IS\t２ +\n 2? ") == "what is 2 + 2?"
    assert normalise_prompt("Straße") == "strasse"  # casefold, unlike lower()
    e = user_example("u", "s", "What is 2 + 2?")
    assert prompt_hash(e) == hashlib.sha256(b"what is 2 + 2?").hexdigest()


def test_count_overlap():
    held = [user_example("e1", "s", "What is 2 + 2?"), user_example("e2", "s", "Name a prime.")]
    train = [user_example("t1", "s", "what is 2  +  2?"), user_example("t2", "s", "What is 3 + 3?"),
             user_example("t3", "s", "NAME A PRIME."), user_example("t4", "s", "Name a prime")]
    overlap = count_overlap(train, held)  # t1 and t3 match; t4 lacks the "." and does not
    assert (overlap.count, overlap.checked, overlap.uids) == (2, 4, ("t1", "t3"))
    assert "2 of 4 training problems are also in x" in overlap.describe("src", "x")
    assert count_overlap(train[1:2], held).describe("src", "x") == (
        "src: none of 1 training problems is in x")


def _near_duplicate() -> tuple[str, str]:
    """A prompt of the eval split and a case variant of it that lands in the train split (the
    split hashes the exact text)."""
    for i in range(1000):
        held, variant = f"What is {i} + 7?", f"WHAT IS {i} + 7?"
        if (split_of(user_example("", "", held).messages, 0.1),
                split_of(user_example("", "", variant).messages, 0.1)) == ("eval", "train"):
            return held, variant
    raise AssertionError("no near-duplicate pair among 1000 prompts")


def test_build_logs_the_count_once(tmp_path, caplog):
    held, variant = _near_duplicate()
    prompts = [f"What is {i} - 3?" for i in range(30)] + [held, variant]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
    cfg = parse_config(config_dict("tiny", tmp_path / "run", **{
        "data.source": f"jsonl:{path}", "data.eval_size": len(load_file(path, "eval"))}))
    with caplog.at_level(logging.INFO, logger="rlx.run.build"):
        examples = checked_eval_examples(cfg, run_source(cfg, "train"))
    assert held in {e.prompt for e in examples}
    lines = [r.getMessage() for r in caplog.records if "contamination" in r.getMessage()]
    assert len(lines) == 1 and "1 of " in lines[0] and "also in the evaluation set" in lines[0]
    assert caplog.records[-1].levelno == logging.WARNING
