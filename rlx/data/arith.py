"""Procedural sources: seeded, unlimited problem generators with content-hash splits.

`ProceduralSource` turns a generator `(index, attempt) -> Problem` into a random-access source:
example `i` of a split is the first draw `(i, 0), (i, 1), ...` whose prompt hashes into that
split (see `rlx.data.sources.split_of`), so train and eval never share a prompt even though
they come from one generator, and every example depends only on (seed, index). Its uid is
`"<name>:<seed>:<split>:<index>"`: unique within the stream although a small problem space
repeats prompts (2-term addition has under 10^4 of them); use `rlx.data.eval.distinct_examples` to
take duplicate-free eval sets.

rlx's own arithmetic generators ("arith:<kind>"):
- `add2`: a + b with a, b in 1..99;
- `mul`: a * b with a in 10..99, b in 2..9;
- `mul3x2`: a * b with a in 100..999, b in 10..99 (beyond a small model's mental arithmetic: the
  tool-use quickstart's task);
- `basic`: 2 or 3 terms in 1..99 joined by +, - or * (usual precedence), e.g.
  "Calculate 12 - 7 * 3." -> "-9" (the shape of reasoning-gym's `basic_arithmetic` with 2-3
  terms of 1-2 digits, without its parentheses and divisions).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence

from rlx.data.sources import (
    DEFAULT_EVAL_FRACTION,
    DataError,
    Example,
    Message,
    check_split,
    split_of,
)

UNLIMITED = 2**31 - 1
_MAX_ATTEMPTS = 4096


@dataclasses.dataclass(frozen=True)
class Problem:
    """One generated problem: question text and gold answer."""

    question: str
    answer: str
    fields: dict[str, str] = dataclasses.field(default_factory=dict)


Generator = Callable[[int, int], Problem]


class ProceduralSource(Sequence[Example]):
    """`size` examples of one split drawn from a deterministic generator."""

    def __init__(
        self,
        name: str,
        split: str,
        generate: Generator,
        *,
        seed: int,
        size: int = UNLIMITED,
        eval_fraction: float = DEFAULT_EVAL_FRACTION,
    ):
        check_split(split, eval_fraction)
        if size < 1:
            raise ValueError(f"size={size} must be >= 1")
        if split == "eval" and eval_fraction == 0 or split == "train" and eval_fraction == 1:
            raise DataError(f"the {split!r} split of {name!r} is empty "
                            f"(eval_fraction={eval_fraction})")
        self.name, self.split, self.seed = name, split, seed
        self._generate, self._size, self._eval_fraction = generate, size, eval_fraction

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._size))]
        if index < 0:
            index += self._size
        if not 0 <= index < self._size:
            raise IndexError(f"index {index} out of range for {self._size} examples")
        for attempt in range(_MAX_ATTEMPTS):
            problem = self._generate(index, attempt)
            messages = (Message("user", problem.question),)
            assigned = split_of(messages, self._eval_fraction)
            if self.split in ("all", assigned):
                return Example(
                    uid=f"{self.name}:{self.seed}:{self.split}:{index}", source=self.name,
                    split=assigned, prompt=problem.question, messages=messages,
                    answer=problem.answer, fields=dict(problem.fields),
                )
        raise DataError(f"{self.name}: no {self.split} example after {_MAX_ATTEMPTS} draws "
                        f"(eval_fraction={self._eval_fraction} too extreme?)")

    def __repr__(self) -> str:
        return f"ProceduralSource({self.name!r}, split={self.split!r}, seed={self.seed})"


# --------------------------------------------------------------------------- arithmetic kinds
def _rng(kind: str, seed: int, index: int, attempt: int) -> random.Random:
    # A string seed is hashed with SHA-512: the same on every host and Python process.
    return random.Random(f"arith/{kind}/{seed}/{index}/{attempt}")


def evaluate_terms(terms: Sequence[int], ops: Sequence[str]) -> int:
    """Value of `terms[0] ops[0] terms[1] ...` with * before + and -."""
    sums = [terms[0]]  # signed addends; a product extends the last one
    for op, term in zip(ops, terms[1:]):
        if op == "*":
            sums[-1] *= term
        elif op == "+":
            sums.append(term)
        elif op == "-":
            sums.append(-term)
        else:
            raise ValueError(f"unknown operator {op!r}")
    return sum(sums)


def _add2(rng: random.Random) -> Problem:
    a, b = rng.randint(1, 99), rng.randint(1, 99)
    return Problem(f"What is {a} + {b}?", str(a + b))


def _mul(rng: random.Random) -> Problem:
    a, b = rng.randint(10, 99), rng.randint(2, 9)
    return Problem(f"What is {a} * {b}?", str(a * b))


def _mul3x2(rng: random.Random) -> Problem:
    a, b = rng.randint(100, 999), rng.randint(10, 99)
    return Problem(f"What is {a} * {b}?", str(a * b))


def _basic(rng: random.Random) -> Problem:
    terms = [rng.randint(1, 99) for _ in range(rng.choice((2, 3)))]
    ops = [rng.choice("+-*") for _ in terms[1:]]
    expression = " ".join([str(terms[0])] + [f"{o} {t}" for o, t in zip(ops, terms[1:])])
    return Problem(f"Calculate {expression}.", str(evaluate_terms(terms, ops)),
                   {"expression": expression})


ARITH_KINDS: dict[str, Callable[[random.Random], Problem]] = {
    "add2": _add2,
    "mul": _mul,
    "mul3x2": _mul3x2,
    "basic": _basic,
}


def arith_source(
    kind: str,
    split: str = "train",
    *,
    seed: int = 0,
    size: int = UNLIMITED,
    eval_fraction: float = DEFAULT_EVAL_FRACTION,
) -> ProceduralSource:
    """The "arith:<kind>" source; `kind` is one of `ARITH_KINDS`."""
    if kind not in ARITH_KINDS:
        raise KeyError(f"unknown arithmetic kind {kind!r}; known: {', '.join(ARITH_KINDS)}")
    make = ARITH_KINDS[kind]

    def generate(index: int, attempt: int) -> Problem:
        return make(_rng(kind, seed, index, attempt))

    return ProceduralSource(f"arith:{kind}", split, generate, seed=seed, size=size,
                            eval_fraction=eval_fraction)
