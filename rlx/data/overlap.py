"""Contamination: training problems that are also evaluation problems, by normalised prompt hash.

A prompt is normalised before hashing, so that copies differing only in spelling details match:
the question text (`Example.prompt`) in Unicode NFKC form, case-folded, every run of whitespace
made one space, the ends stripped; its key is the SHA-256 of that text. Exact splits by content
(`rlx.data.sources.split_of`) keep a source's train and eval splits apart, but not two records
that differ only in case or spacing, nor a training source that holds another set's problems.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import unicodedata
from collections.abc import Iterable, Sequence

from rlx.data.sources import Example

_SPACES = re.compile(r"\s+")
SHOWN = 5  # uids named in a report


def normalise_prompt(text: str) -> str:
    """`text` in NFKC form, case-folded, with whitespace runs as one space and no ends."""
    return _SPACES.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def prompt_hash(example: Example) -> str:
    """The hex SHA-256 of the example's normalised question text."""
    return hashlib.sha256(normalise_prompt(example.prompt).encode("utf-8")).hexdigest()


@dataclasses.dataclass(frozen=True)
class Overlap:
    """Training examples whose normalised prompt is also an evaluation problem's."""

    count: int  # training examples that match
    checked: int  # training examples compared
    uids: tuple[str, ...]  # the first SHOWN matching training uids

    def describe(self, train: str, held: str) -> str:
        """One line for the run's log."""
        if not self.count:
            return f"{train}: none of {self.checked} training problems is in {held}"
        return (f"{train}: {self.count} of {self.checked} training problems are also in {held} "
                f"(same normalised prompt; e.g. {', '.join(self.uids)})")


def count_overlap(train: Iterable[Example], held: Sequence[Example]) -> Overlap:
    """How many of `train` have the normalised prompt of one of `held`."""
    keys = {prompt_hash(e) for e in held}
    checked, matches = 0, []
    for example in train:
        checked += 1
        if prompt_hash(example) in keys:
            matches.append(example.uid)
    return Overlap(len(matches), checked, tuple(matches[:SHOWN]))
