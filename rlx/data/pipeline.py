"""The grain prompt pipeline: source -> host shard -> shuffle -> epochs -> chat-encode -> batches.

`make_prompt_pipeline` returns a `PromptIterator` of `PromptBatch`es. The order of operations:

1. shard: host `shard_index` of `shard_count` takes examples `shard_index::shard_count` of the
   source (disjoint shards that together cover it; sizes differ by at most one);
2. shuffle with `seed`, a new permutation each epoch (grain's lazy index shuffle, so a large or
   procedural source is never materialized), repeated for `num_epochs` (None: forever);
3. encode: the example's prompt chat (`rlx.data.chat.PromptFormat`) rendered with the model's
   chat template and tokenized; prompts longer than `max_prompt_tokens` are dropped and counted
   (`PromptIterator.stats.filtered_too_long`);
4. batch: `batch_size` prompts per batch; the last partial batch of a finite run is dropped
   unless `drop_remainder=False`.

The iterator is a `grain.DatasetIterator`: `get_state()` / `set_state()` (JSON-able dicts that
include the counters) resume exactly after the last returned batch, and it can be checkpointed
with `grain.checkpoint.CheckpointSave` under orbax.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import grain

from rlx.data.chat import PromptFormat, encode_prompt
from rlx.data.sources import DataError, Example, Source
from rlx.models.tokenizer import Tokenizer
from rlx.types import Prompt


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """Tokenized prompts and the examples they came from (same order)."""

    prompts: tuple[Prompt, ...]
    examples: tuple[Example, ...]
    epoch: int  # epoch of the last example in the batch (0-based)


@dataclasses.dataclass(frozen=True)
class PipelineStats:
    """Counters of one host's iterator since the start of training (checkpointed)."""

    batches: int = 0
    examples: int = 0  # examples yielded in batches
    filtered_too_long: int = 0  # examples dropped for exceeding max_prompt_tokens
    epoch: int = 0


@dataclasses.dataclass(frozen=True)
class _Encoded:
    example: Example
    token_ids: tuple[int, ...]
    too_long: bool
    epoch: int


class PromptIterator(grain.DatasetIterator):
    """Assembles batches from encoded examples, skipping and counting over-long ones."""

    def __init__(
        self, parent: grain.DatasetIterator, batch_size: int, drop_remainder: bool,
        shard_size: int,
    ):
        super().__init__(parent)
        self._batch_size, self._drop_remainder = batch_size, drop_remainder
        self._shard_size = shard_size
        self._counts = PipelineStats()

    @property
    def stats(self) -> PipelineStats:
        return self._counts

    def __next__(self) -> PromptBatch:
        items: list[_Encoded] = []
        filtered = run = 0  # run: too-long prompts in a row
        while len(items) < self._batch_size:
            try:
                item = next(self._parent)
            except StopIteration:
                if items and not self._drop_remainder:
                    break
                self._count([], filtered)  # a dropped partial batch is not counted
                raise
            if item.too_long:
                filtered, run = filtered + 1, run + 1
                # Two occurrences of one short prompt are at most 2 * shard_size - 2 apart (last
                # and first of two shuffled epochs): a longer run means there is none.
                if run >= 2 * self._shard_size:
                    raise DataError("every prompt of this shard is longer than max_prompt_tokens")
                continue
            run = 0
            items.append(item)
        self._count(items, filtered)
        return PromptBatch(
            prompts=tuple(Prompt(i.example.uid, i.token_ids) for i in items),
            examples=tuple(i.example for i in items),
            epoch=items[-1].epoch,
        )

    def _count(self, items: list[_Encoded], filtered: int) -> None:
        c = self._counts
        self._counts = PipelineStats(
            batches=c.batches + bool(items), examples=c.examples + len(items),
            filtered_too_long=c.filtered_too_long + filtered,
            epoch=items[-1].epoch if items else c.epoch,
        )

    def get_state(self) -> dict[str, Any]:
        return {"parent": self._parent.get_state(), "stats": dataclasses.asdict(self._counts)}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self._counts = PipelineStats(**state["stats"])


def make_prompt_pipeline(
    source: Source,
    tokenizer: Tokenizer,
    *,
    batch_size: int,
    seed: int = 0,
    shard_index: int = 0,
    shard_count: int = 1,
    max_prompt_tokens: int | None = None,
    prompt_format: PromptFormat = PromptFormat(),
    num_epochs: int | None = None,
    shuffle: bool = True,
    drop_remainder: bool = True,
    read_threads: int = 1,
) -> PromptIterator:
    """An iterator of `PromptBatch`es of host `shard_index`'s share of `source`."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index={shard_index} must be in [0, shard_count={shard_count})")
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens={max_prompt_tokens} must be >= 1")
    if len(source) == 0:
        raise DataError(f"source {getattr(source, 'name', source)!r} is empty")
    dataset = grain.MapDataset.source(source)[shard_index::shard_count]
    shard_size = len(dataset)
    if shard_size == 0:
        raise DataError(f"shard {shard_index} of {shard_count} of a {len(source)}-example "
                        "source is empty")
    if shuffle:
        dataset = dataset.shuffle(seed)
    dataset = dataset.repeat(num_epochs)

    def encode(index: int, example: Example) -> _Encoded:
        ids = tuple(encode_prompt(tokenizer, example, prompt_format))
        too_long = max_prompt_tokens is not None and len(ids) > max_prompt_tokens
        return _Encoded(example, ids, too_long, index // shard_size)

    options = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=4 * batch_size)
    elements = dataset.map_with_index(encode).to_iter_dataset(options)
    return PromptIterator(iter(elements), batch_size, drop_remainder, shard_size)
