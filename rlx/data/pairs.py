"""Preference pairs for DPO (``train.algorithm="dpo"``): a prompt, a chosen and a rejected reply.

A pair is an ``Example`` (``rlx.data.sources``) whose ``messages`` are the prompt chat and whose
``fields["chosen"]`` / ``fields["rejected"]`` hold the two replies as JSON lists of messages, so
the prompt pipeline (shards, seeded shuffles, checkpointed position) serves pairs unchanged.

Sources (registered prefixes of ``rlx.data.sources.get_source``):

* ``pairs:PATH`` - a JSONL file, one pair per line: ``prompt`` (a string: the user turn, or a
  list of chat messages), ``chosen`` and ``rejected`` (a string: the assistant's reply, or a list
  of messages; TRL's "conversational preference" layout). A line with an empty side (an empty
  string or list, or empty message contents only) is refused, naming the line and the side.
* ``arith_pairs:NAME`` - pairs made from ``arith:NAME`` problems: the right answer in
  ``\\boxed{}`` is chosen, a wrong one rejected (a bundled set for the DPO recipe and tests).

``tokenize_pair`` renders prompt, prompt + chosen and prompt + rejected with the chat template and
splits them where they diverge from the rendered prompt (as TRL's DPO trainer does), so each reply
carries the template's end-of-turn tokens. Departure from TRL: a plain-string prompt is also
rendered as a chat (TRL tokenizes it raw and appends EOS).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from rlx.data.sources import (DEFAULT_EVAL_FRACTION, DataError, Example, ListSource, Message,
                              content_key, get_source, read_jsonl, select_split)
from rlx.models.tokenizer import Tokenizer

SIDES = ("chosen", "rejected")


def _turns(value: Any, role: str, name: str, where: str) -> tuple[Message, ...]:
    """A string (one ``role`` message) or a list of messages; refused when empty."""
    if isinstance(value, str):
        messages = (Message(role, value),)
    elif isinstance(value, Sequence) and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in value):
        messages = tuple(Message(m["role"], m["content"]) for m in value)
    else:
        raise DataError(f"{where}: field {name!r} must be a string or a list of "
                        "{'role', 'content'} messages")
    if not any(m.content.strip() for m in messages):
        raise DataError(f"{where}: field {name!r} is empty; every pair needs a prompt and two "
                        "non-empty replies")
    return messages


def record_to_pair(record: Mapping[str, Any], source: str, where: str) -> Example:
    """One JSONL record as a pair ``Example`` (split not yet assigned)."""
    for name in ("prompt", *SIDES):
        if name not in record:
            raise DataError(f"{where}: missing field {name!r} (fields: {', '.join(record)})")
    prompt = _turns(record["prompt"], "user", "prompt", where)
    sides = {s: _turns(record[s], "assistant", s, where) for s in SIDES}
    if sides["chosen"] == sides["rejected"]:
        raise DataError(f"{where}: 'chosen' and 'rejected' are the same reply")
    user = next((m.content for m in reversed(prompt) if m.role == "user"), "")
    key = content_key(prompt + sides["chosen"] + sides["rejected"])[:16]
    return Example(uid=f"{source}:{key}", source=source, split="all", prompt=user,
                   messages=prompt, fields={s: json.dumps([m.to_dict() for m in sides[s]])
                                            for s in SIDES})


def pairs_source(path: str, split: str, *, eval_fraction: float = DEFAULT_EVAL_FRACTION,
                 **_: Any) -> ListSource:
    """``pairs:PATH``: one split of a JSONL file of preference pairs."""
    examples = [record_to_pair(r, path, f"{path}: line {n}") for n, r in read_jsonl(path)]
    if not examples:
        raise DataError(f"{path}: no pairs")
    return select_split(path, examples, split, eval_fraction)


class ArithPairs:
    """``arith_pairs:NAME``: ``arith:NAME`` problems (procedural, read lazily), the right boxed
    answer chosen over a wrong one (the answer plus 1 to 9, by the problem's content hash)."""

    def __init__(self, name: str, split: str, **options: Any):
        self.name, self.split = f"arith_pairs:{name}", split
        self._problems = get_source(f"arith:{name}", split, **options)

    def __len__(self) -> int:
        return len(self._problems)

    def __getitem__(self, index: int) -> Example:
        e = self._problems[index]
        wrong = int(e.answer) + 1 + int(content_key(e.messages)[:8], 16) % 9
        sides = {"chosen": f"\\boxed{{{e.answer}}}", "rejected": f"\\boxed{{{wrong}}}"}
        return Example(uid=e.uid, source=self.name, split=e.split, prompt=e.prompt,
                       messages=e.messages, answer=e.answer,
                       fields={s: json.dumps([{"role": "assistant", "content": t}])
                               for s, t in sides.items()})


def arith_pairs_source(name: str, split: str, **options: Any) -> ArithPairs:
    return ArithPairs(name, split, **options)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def tokenize_pair(tokenizer: Tokenizer, prompt: Sequence[Message], example: Example
                  ) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen ids, rejected ids) of a pair, ``prompt`` being its rendered prompt
    chat (``rlx.data.chat.prompt_messages``): see the module docstring."""
    as_dicts = [m.to_dict() for m in prompt]
    prompt_ids = tokenizer.encode_chat(as_dicts, add_generation_prompt=True)
    full = [tokenizer.encode_chat(as_dicts + json.loads(example.fields[s]),
                                  add_generation_prompt=False) for s in SIDES]
    cut = min(_common_prefix(prompt_ids, f) for f in full)
    chosen, rejected = (f[cut:] for f in full)
    if not chosen or not rejected:
        raise DataError(f"pair {example.uid}: a reply renders to no tokens after the prompt")
    return prompt_ids[:cut], chosen, rejected


__all__ = ["SIDES", "ArithPairs", "arith_pairs_source", "pairs_source", "record_to_pair", "tokenize_pair"]
