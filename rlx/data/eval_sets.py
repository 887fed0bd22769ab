"""Named evaluation sets (``data.eval_sources``): held-out benchmarks scored beside training.

A set is spelled like a training source (``"mmath:aime24"``, ``"hf:NAME[:CONFIG][@SPLIT]"``,
``"jsonl:PATH"``), optionally named first: ``"aime24=mmath:aime24"``. Without a name it is the
last part of the source's argument, file extension dropped and other characters than letters,
digits, ``_ . -`` made ``_`` (``mmath:aime24`` -> ``aime24``, ``jsonl:/d/x.jsonl`` -> ``x``,
``hf:openai/gsm8k:main@test`` -> ``gsm8k_main_test``); names must differ. A set is read whole
(its ``"all"`` split, the record fields ``prompt`` and ``answer``), except a procedural source
(``arith:``, ``reasoning_gym:``), of which the first ``data.eval_size`` distinct problems are taken.

Each problem gets ``k`` samples (``data.eval_samples``), graded by the run's reward; a sample is
correct when its reward is at least 1. Per set: ``pass@1`` (the share of correct samples),
``mean@k`` (the mean reward of the samples: different from ``pass@1`` when the reward is not 0/1)
and, for k > 1, ``pass@k`` by the unbiased estimator of Chen et al. (2021) (``rlx.data.eval``),
which with exactly k samples per problem is the share of problems with a correct one; with more
samples than k (``python -m rlx.eval --n N``) it averages over every k-subset.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rlx.data.eval import EvalReport, distinct_examples, evaluate
from rlx.data.overlap import count_overlap
from rlx.data.sources import Example, ListSource, available_sources, get_source
from rlx.errors import ConfigError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
_FILE_EXTENSIONS = (".jsonl", ".json", ".parquet", ".pq")
FIELD = "config.data.eval_sources"


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """One named evaluation set and its problems."""

    name: str  # metrics are logged as eval/<name>/...
    spec: str  # the source it was read from
    examples: tuple[Example, ...]


def derived_name(spec: str) -> str:
    """The name of an unnamed set: the last part of the source's argument (see the module)."""
    prefix, _, argument = spec.partition(":")
    tail = os.path.basename(argument.rstrip("/")) or prefix
    for extension in _FILE_EXTENSIONS:
        tail = tail.removesuffix(extension)
    return _UNSAFE.sub("_", tail).strip("_") or prefix


def parse_eval_sources(specs: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """(name, source spec) of each entry; a ``ConfigError`` for a bad name, an unknown source
    prefix or two sets of one name."""
    parsed: list[tuple[str, str]] = []
    for entry in specs:
        name, equals, spec = entry.partition("=")
        if not equals or ":" in name or "/" in name:  # an '=' inside a path is not a name
            name, spec = "", entry
        spec = spec.strip()
        if not spec:
            raise ConfigError(f"{FIELD} entry {entry!r} names no source; write "
                              "'NAME=SOURCE' or 'SOURCE', e.g. 'aime24=mmath:aime24'")
        name = name.strip() or derived_name(spec)
        if not _NAME.fullmatch(name):
            raise ConfigError(f"{FIELD} entry {entry!r}: the name {name!r} must be letters, "
                              "digits, '_', '.' or '-' (it becomes the metric eval/<name>/...)")
        prefix = spec.partition(":")[0]
        if prefix not in available_sources():
            raise ConfigError(f"{FIELD} entry {entry!r}: unknown source prefix {prefix!r}; "
                              f"known: {', '.join(available_sources())} (a file: jsonl:PATH)")
        if name in (n for n, _ in parsed):
            raise ConfigError(f"{FIELD} names two sets {name!r}; name them apart, e.g. "
                              f"'{name}_2={spec}'")
        parsed.append((name, spec))
    return tuple(parsed)


def load_eval_sets(specs: Iterable[str], procedural_size: int) -> tuple[EvalSet, ...]:
    """Every set of ``data.eval_sources``: in-memory sources whole, procedural ones their first
    ``procedural_size`` distinct problems (``data.eval_size``)."""
    sets = []
    for name, spec in parse_eval_sources(specs):
        source = get_source(spec, "all")
        if isinstance(source, ListSource):
            examples = tuple(source)
        elif procedural_size:
            examples = tuple(distinct_examples(source, procedural_size))
        else:
            raise ConfigError(f"{FIELD}: {spec!r} is procedural (unlimited); set "
                              "config.data.eval_size to the number of its problems to evaluate")
        sets.append(EvalSet(name, spec, examples))
    return tuple(sets)


def evaluate_sets(sets: Sequence[EvalSet], k: int, **evaluate_args: Any) -> dict[str, float]:
    """Every set's metrics (``set_metrics``): ``evaluate(engine, examples, reward, k=k,
    sampling=..., tokenizer=..., ...)`` per set; ``sampling.n`` is the samples per problem."""
    metrics: dict[str, float] = {}
    for s in sets:
        metrics.update(set_metrics(s.name, evaluate(examples=s.examples, k=k, **evaluate_args), k))
    return metrics


def set_metrics(name: str, report: EvalReport, k: int) -> dict[str, float]:
    """``eval/<name>/pass@1``, ``eval/<name>/mean@<k>`` and (k > 1) ``eval/<name>/pass@<k>``."""
    metrics = {f"eval/{name}/pass@1": float(report.pass_at[1]),
               f"eval/{name}/mean@{k}": float(report.mean_score)}
    if k > 1:
        metrics[f"eval/{name}/pass@{k}"] = float(report.pass_at[k])
    return metrics


def contamination(train_name: str, train: Sequence[Example],
                  sets: Sequence[EvalSet]) -> dict[str, tuple[int, str]]:
    """Per set: (how many training problems share a normalised prompt with it, a log line)."""
    out = {}
    for s in sets:
        overlap = count_overlap(train, s.examples)
        out[s.name] = (overlap.count, overlap.describe(train_name, f"eval set {s.name!r}"))
    return out


def summary_lines(metrics: Iterable[Mapping[str, float]]) -> list[str]:
    """One line per evaluated step with each set's figures (``eval/<name>/...``), e.g.
    ``eval sets at step 0: aime24 pass@1 10.0% mean@4 0.10 pass@4 23.3%; aime25 ...``."""
    by_step = {}  # a step evaluated twice (the last of ``train``): its later figures
    for record in metrics:
        sets: dict[str, list[str]] = {}
        for key, value in record.items():
            if key.startswith("eval/") and key.count("/") == 2:
                name, what = key[5:].rsplit("/", 1)
                shown = f"{value:.2f}" if what.startswith("mean@") else f"{100 * value:.1f}%"
                sets.setdefault(name, []).append(f"{what} {shown}")
        if sets:
            by_step[record["step"]] = f"eval sets at step {record['step']}: " + "; ".join(
                f"{name} {' '.join(figures)}" for name, figures in sets.items())
    return list(by_step.values())
