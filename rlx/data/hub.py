"""Hugging Face `datasets` sources: `get_source("hf:NAME[:CONFIG][@SPLIT]", split)`.

NAME is a data set name on the Hub ("openai/gsm8k") or a local folder of data files
("/data/math", read by `datasets.load_dataset` as a folder of Parquet/JSON/CSV files, or a
folder written by `Dataset.save_to_disk`); CONFIG picks a configuration ("main"), SPLIT the
data set's own split (default "train"). rlx's "train"/"eval" split is then taken from those
records by prompt hash, like every source (`rlx.data.sources.select_split`).

`datasets` decides where records come from: its cache (`HF_DATASETS_CACHE`), and with
`HF_DATASETS_OFFLINE=1` nothing but the cache and local folders. A `FieldMap` names the prompt
and answer fields (default "prompt" and "answer"; `config.data.prompt_field`/`answer_field`);
every other column of scalars (text, numbers, booleans) reaches the reward as an extra field
(`Example.fields`), unless the map lists its own `extra_fields`.

A data set, configuration, split or field that is not there is refused in one line naming it and
the ones there are.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from rlx.data.sources import (DEFAULT_EVAL_FRACTION, DataError, FieldMap, ListSource,
                              record_to_example, select_split)

DEFAULT_SPLIT = "train"


@dataclasses.dataclass(frozen=True)
class HubSpec:
    """The parts of an `hf:` source name."""

    name: str  # Hub name or local folder
    config: str | None  # None: the data set's default configuration
    split: str  # the data set's own split


def parse_spec(argument: str) -> HubSpec:
    """`NAME[:CONFIG][@SPLIT]` (what follows "hf:") as a `HubSpec`."""
    head, at, split = argument.rpartition("@") if "@" in argument else (argument, "", "")
    name, _, config = head.partition(":")
    if not name or (at and not split) or (":" in head and not config):
        raise DataError(f"hf source {argument!r} must read NAME[:CONFIG][@SPLIT], "
                        "e.g. hf:openai/gsm8k:main@train or hf:/data/folder@test")
    return HubSpec(name, config or None, split or DEFAULT_SPLIT)


def _cached_names() -> list[str]:
    """Hub data sets in the `datasets` cache ("org___name" folders)."""
    import datasets

    root = datasets.config.HF_DATASETS_CACHE
    if not os.path.isdir(root):
        return []
    return sorted(d.replace("___", "/") for d in os.listdir(root)
                  if "___" in d and os.path.isdir(os.path.join(root, d)))


def _config_names(name: str) -> list[str]:
    import datasets

    try:
        return list(datasets.get_dataset_config_names(name))
    except Exception:  # noqa: BLE001 - only used to word an error
        return []


def load_splits(spec: HubSpec) -> Any:
    """The `datasets.DatasetDict` of `spec`'s data set and configuration."""
    import datasets

    if os.path.isdir(spec.name) and os.path.exists(os.path.join(spec.name, "dataset_dict.json")):
        return datasets.load_from_disk(spec.name)
    if os.path.isdir(spec.name) and os.path.exists(os.path.join(spec.name, "state.json")):
        return datasets.DatasetDict({DEFAULT_SPLIT: datasets.load_from_disk(spec.name)})
    try:
        return datasets.load_dataset(spec.name, spec.config)
    except ValueError as e:
        if spec.config is None or "BuilderConfig" not in str(e):
            raise DataError(f"hf data set {spec.name!r} cannot be read: {e}") from None
        raise DataError(f"hf data set {spec.name!r} has no configuration {spec.config!r} "
                        f"(configurations: {', '.join(_config_names(spec.name)) or 'none'})"
                        ) from None
    except (FileNotFoundError, ConnectionError) as e:
        cached = ", ".join(_cached_names()) or "none"
        raise DataError(f"hf data set {spec.name!r} not found locally, in the datasets cache or "
                        f"on the Hub ({type(e).__name__}); cached data sets: {cached}; "
                        "a local folder must hold data files") from None


def _scalar_columns(features: Any, skip: Sequence[str]) -> tuple[str, ...]:
    import datasets

    return tuple(c for c, f in features.items()
                 if c not in skip and isinstance(f, datasets.Value))


def hub_fields(fields: FieldMap, columns: Sequence[str], features: Any, where: str) -> FieldMap:
    """`fields` checked against the data set's columns, with every other scalar column as an
    extra field when `fields` lists none."""
    named = [f for f in (fields.prompt_field, fields.messages_field, fields.answer_field,
                         fields.uid_field, fields.tests_field, fields.tools_field) if f]
    for name in (*named, *fields.extra_fields):
        if name not in columns:
            raise DataError(f"{where} has no field {name!r} (fields: {', '.join(columns)}); "
                            "set config.data.prompt_field / answer_field to one of them")
    if fields.extra_fields:
        return fields
    return dataclasses.replace(fields, extra_fields=_scalar_columns(features, named))


def hf_source(
    argument: str,
    split: str,
    *,
    fields: FieldMap = FieldMap(),
    eval_fraction: float = DEFAULT_EVAL_FRACTION,
) -> ListSource:
    """The `split` of the data set named by `argument` (`NAME[:CONFIG][@SPLIT]`)."""
    spec = parse_spec(argument)
    splits = load_splits(spec)
    if spec.split not in splits:
        raise DataError(f"hf data set {spec.name!r} has no split {spec.split!r} "
                        f"(splits: {', '.join(splits)}); name one with hf:NAME@SPLIT")
    table = splits[spec.split]
    name = f"hf:{argument}"
    fields = hub_fields(fields, table.column_names, table.features, name)
    examples = [record_to_example(record, fields, name, f"{name}: row {number}")
                for number, record in enumerate(table, start=1)]
    if not examples:
        raise DataError(f"{name}: no records")
    return select_split(name, examples, split, eval_fraction)
