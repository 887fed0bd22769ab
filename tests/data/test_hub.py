"""`hf:` sources through the real `datasets.load_dataset`: local folders, `save_to_disk` folders,
the offline cache, field names from the config, and one-line refusals naming what is there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import datasets
import pandas as pd
import pytest

from rlx.config import parse_config
from rlx.data import DataError, FieldMap, get_source
from rlx.data.hub import HubSpec, parse_spec
from rlx.errors import ConfigError
from rlx.run.build import eval_examples, source_options
from tests.helpers import ROOT
from tests.helpers.runs import config_dict

TRAIN = {"question": [f"What is {i} + {i}?" for i in range(40)],
         "solution": [str(2 * i) for i in range(40)],
         "level": [i % 3 for i in range(40)],
         "subject": ["arithmetic"] * 40}
TEST = {"question": ["What is 7 * 6?"], "solution": ["42"], "level": [2], "subject": ["algebra"]}


@pytest.fixture
def folder(tmp_path):
    """A local data set folder as the Hub lays one out: data/<split>-*.parquet."""
    (tmp_path / "ds" / "data").mkdir(parents=True)
    pd.DataFrame(TRAIN).to_parquet(tmp_path / "ds" / "data" / "train-00000-of-00001.parquet")
    pd.DataFrame(TEST).to_parquet(tmp_path / "ds" / "data" / "test-00000-of-00001.parquet")
    return tmp_path / "ds"


Q = FieldMap(prompt_field="question", answer_field="solution")


def test_spec_parts():
    assert parse_spec("openai/gsm8k") == HubSpec("openai/gsm8k", None, "train")
    assert parse_spec("openai/gsm8k:main@test") == HubSpec("openai/gsm8k", "main", "test")
    assert parse_spec("/data/x@validation") == HubSpec("/data/x", None, "validation")
    for bad in ("", "name@", "name:@test", ":main"):
        with pytest.raises(DataError, match="NAME\\[:CONFIG\\]\\[@SPLIT\\]"):
            parse_spec(bad)


def test_local_folder_reads_fields_and_splits(folder):
    everything = get_source(f"hf:{folder}", "all", fields=Q)
    assert len(everything) == 40  # the data set's "train" split by default
    train, held = get_source(f"hf:{folder}", "train", fields=Q), get_source(f"hf:{folder}", "eval",
                                                                           fields=Q)
    assert len(train) + len(held) == 40 and len(held) > 0
    assert not {e.uid for e in train} & {e.uid for e in held}
    by_prompt = {e.prompt: e for e in everything}
    e = by_prompt["What is 5 + 5?"]
    assert e.answer == "10" and e.messages[-1].content == "What is 5 + 5?"
    # every other scalar column reaches the reward, as strings like FieldMap's extra fields
    assert e.reward_sample() == {"prompt": "What is 5 + 5?", "answer": "10", "level": "2",
                                 "subject": "arithmetic"}
    (test,) = get_source(f"hf:{folder}@test", "all", fields=Q)
    assert (test.prompt, test.answer, test.fields["subject"]) == ("What is 7 * 6?", "42", "algebra")


def test_explicit_extra_fields_are_kept(folder):
    fields = FieldMap(prompt_field="question", answer_field="solution", extra_fields=("level",))
    (test,) = get_source(f"hf:{folder}@test", "all", fields=fields)
    assert dict(test.fields) == {"level": "2"}


def test_save_to_disk_folder(tmp_path):
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(TRAIN),
                          "test": datasets.Dataset.from_dict(TEST)}).save_to_disk(tmp_path / "dd")
    datasets.Dataset.from_dict(TEST).save_to_disk(tmp_path / "one")
    (e,) = get_source(f"hf:{tmp_path / 'dd'}@test", "all", fields=Q)
    (f,) = get_source(f"hf:{tmp_path / 'one'}", "all", fields=Q)
    assert e.answer == f.answer == "42"


@pytest.mark.parametrize("spec, fields, message", [
    ("{d}@validation", Q, "has no split 'validation' (splits: train, test)"),
    ("{d}:nosuch", Q, "has no configuration 'nosuch' (configurations: default)"),
    ("{d}", FieldMap(prompt_field="problem", answer_field="solution"),
     "has no field 'problem' (fields: question, solution, level, subject)"),
    ("{d}", FieldMap(), "has no field 'prompt' (fields: question, solution, level, subject)"),
    ("{d}/../missing", Q, "not found locally, in the datasets cache or on the Hub"),
])
def test_refusals_name_what_is_there(folder, spec, fields, message):
    with pytest.raises(DataError) as info:
        get_source("hf:" + spec.format(d=folder), "all", fields=fields)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_config_fields_reach_the_source(folder, tmp_path):
    cfg = parse_config(config_dict("tiny", tmp_path / "run", **{
        "data.source": f"hf:{folder}", "data.prompt_field": "question",
        "data.answer_field": "solution", "data.eval_size": 2}))
    assert source_options(cfg) == {"fields": Q}
    held = eval_examples(cfg)
    assert len(held) == 2 and all(e.split == "eval" and e.answer for e in held)
    assert all(e.answer == str(2 * int(e.prompt.split()[2])) for e in held)


def test_config_fields_refused_for_sources_without_records(tmp_path):
    with pytest.raises(ConfigError, match="config.data.prompt_field / answer_field .*'arith:add2'"):
        parse_config(config_dict("tiny", tmp_path, **{"data.source": "arith:add2",
                                                      "data.prompt_field": "question"}))


OFFLINE = """
import os, shutil, sys, datasets
from rlx.data import DataError, FieldMap, get_source
folder, cache = sys.argv[1], os.environ["HF_DATASETS_CACHE"]
built = datasets.load_dataset(folder)  # datasets writes its cache of the folder
built = os.path.dirname(built["test"].cache_files[0]["filename"])
hub = os.path.join(cache, "someorg___tiny_math", "default", "0.0.0", "abc")
shutil.copytree(built, hub)  # the layout a Hub download leaves: NAME-SPLIT.arrow files
for f in os.listdir(hub):
    if f.endswith(".arrow"):
        os.rename(os.path.join(hub, f), os.path.join(hub, "tiny_math-" + f.split("-", 1)[1]))
fields = FieldMap(prompt_field="question", answer_field="solution")
(e,) = get_source("hf:someorg/tiny_math@test", "all", fields=fields)
try:
    get_source("hf:someorg/absent", "all", fields=fields)
except DataError as err:
    print(json.dumps([e.answer, e.uid, str(err)]))
"""


def test_offline_cache_is_used_and_a_missing_name_refused(folder, tmp_path):
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "cache"), "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", "import json" + OFFLINE, str(folder)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    answer, uid, error = json.loads(out.stdout.strip().splitlines()[-1])
    assert answer == "42" and uid.startswith("hf:someorg/tiny_math@test:")
    assert "'someorg/absent' not found" in error and "cached data sets: someorg/tiny_math" in error
