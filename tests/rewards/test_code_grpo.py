"""configs/code_grpo.py's data and reward: MBPP-format tasks a user brings ("mbpp:<path>") are
graded by their own asserts in the sandbox (the reference solution scores 1, a wrong one 0), and the
config's shrunken one-step run on HumanEval is tests/test_configs.py's (every config runs one)."""

from __future__ import annotations

import json

import pytest

from rlx.data.sources import DataError, get_source
from rlx.rewards import get_reward

TASKS = [
    {"task_id": 11, "text": "Write a python function to remove first and last occurrence of a "
     "given character from the string.", "code": "def remove_Occ(s, ch):\n    i = s.find(ch)\n"
     "    if i >= 0:\n        s = s[:i] + s[i + 1:]\n    j = s.rfind(ch)\n    if j >= 0:\n"
     "        s = s[:j] + s[j + 1:]\n    return s",
     "test_list": ['assert remove_Occ("hello","l") == "heo"',
                   'assert remove_Occ("abcda","a") == "bcd"'], "test_setup_code": ""},
    {"task_id": 12, "text": "Write a function to add two numbers.",
     "code": "def add(a, b):\n    return a + b", "test_list": ["assert add(2, 3) == 5"],
     "test_setup_code": "import math"},
]


def test_mbpp_tasks_are_graded_by_their_tests_in_the_sandbox(tmp_path):
    path = tmp_path / "mbpp.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    examples = list(get_source(f"mbpp:{path}", "all"))
    assert [e.uid for e in examples] == ["mbpp:11", "mbpp:12"]
    assert "assert remove_Occ" in examples[0].messages[0].content
    reward = get_reward("code")
    try:
        for task, example in zip(TASKS, examples):
            right = f"```python\n{task['code']}\n```"
            assert reward(right, example.reward_sample()).score == 1.0
            wrong = right.replace("return", "return None and")
            assert reward(wrong, example.reward_sample()).score == 0.0
    finally:
        reward.close()
    path.write_text(json.dumps({"text": "no tests"}) + "\n")
    with pytest.raises(DataError, match="test_list"):
        get_source(f"mbpp:{path}", "all")
