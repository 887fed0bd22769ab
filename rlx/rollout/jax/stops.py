"""Stop strings matched on the device, token by token.

A stop string ends a completion at the first token whose bytes complete it (that token is kept
whole, as the host-side check ``rlx.rollout.jax.batching.stop_string_cut`` cuts). On the device a
sequence cannot decode its text, so the strings are compiled into a finite automaton over
*tokens*: ``StopTable.next[state, token]`` is the state after feeding the token's bytes to an
Aho-Corasick automaton of every stop string (a state is the longest suffix of the bytes so far that
is a prefix of some stop string), or ``StopTable.hit`` where one of the strings is completed
inside the token. A decode step reads one entry per row: ``advance``.

Exact where the tokenizer's text is the concatenation of its tokens' bytes: byte-level BPE (GPT-2,
Llama 3, Qwen, SmolLM, DeepSeek, Kimi: the token's characters through GPT-2's byte alphabet) and
SentencePiece vocabularies (``"▁"`` for a space, ``<0xNN>`` byte-fallback tokens). Matching runs on
those bytes as the model produced them: a stop string spans any token boundaries, and a
character cut between tokens matches once its last byte is out. For any other decoder
``Tokenizer.token_bytes`` gives None and stop strings are checked on the host only.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Int

@dataclasses.dataclass(frozen=True)
class StopTable:
    """The token-level automaton of a set of stop strings (state 0: nothing matched)."""

    next: np.ndarray  # int32 [states, vocab]: the state after a token; ``hit`` completes a string

    @property
    def hit(self) -> int:
        return self.next.shape[0]


def _automaton(stops: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Aho-Corasick over bytes, as a full table: (goto [states, 256], accepting [states])."""
    children: list[dict[int, int]] = [{}]
    accept = [False]
    for s in stops:
        node = 0
        for b in s:
            if b not in children[node]:
                children.append({})
                accept.append(False)
                children[node][b] = len(children) - 1
            node = children[node][b]
        accept[node] = True
    n = len(children)
    goto, fail = np.zeros((n, 256), np.int32), np.zeros(n, np.int32)
    order, head = [0], 0
    while head < len(order):  # breadth first: a node's failure state is done before its children
        node = order[head]
        head += 1
        accept[node] = accept[node] or accept[fail[node]]
        for b in range(256):
            child = children[node].get(b)
            if child is None:
                goto[node, b] = goto[fail[node], b] if node else 0
            else:
                fail[child] = goto[fail[node], b] if node else 0
                goto[node, b] = child
                order.append(child)
    return goto, np.asarray(accept)


def stop_table(tokenizer, stops: tuple[str, ...], vocab: int) -> StopTable | None:
    """The automaton of ``stops`` over a model's ``vocab`` token ids (ids past the tokenizer's
    vocabulary have no bytes); None without stop strings or where the tokenizer cannot give its
    tokens' bytes (``rlx.models.tokenizer.Tokenizer.token_bytes``)."""
    pieces = getattr(tokenizer, "token_bytes", lambda: None)() if stops else None
    if pieces is None:
        return None
    if any(not s for s in stops):
        raise ValueError("stop_strings holds an empty string, which would stop every completion")
    goto, accept = _automaton([s.encode() for s in stops])
    width = max(1, max(map(len, pieces)))
    mat = np.full((vocab, width), -1, np.int32)  # token bytes, -1 past a token's end
    for i, p in enumerate(pieces[:vocab]):
        mat[i, :len(p)] = np.frombuffer(p, np.uint8)
    hit_state = goto.shape[0]
    table = np.empty((goto.shape[0], vocab), np.int32)
    for state in range(goto.shape[0]):
        cur, hit = np.full(vocab, state, np.int32), np.zeros(vocab, bool)
        for j in range(width):
            live = mat[:, j] >= 0
            cur = np.where(live, goto[cur, np.maximum(mat[:, j], 0)], cur)
            hit |= live & accept[cur]
        table[state] = np.where(hit, hit_state, cur)
    return StopTable(table)


def advance(table: Int[Array, "n v"], state: Int[Array, " b"], token: Int[Array, " b"]
            ) -> tuple[Int[Array, " b"], Bool[Array, " b"]]:
    """Every row's automaton after its new ``token``: (next state, whether a stop string was
    completed); ``table`` is ``StopTable.next`` on the device."""
    nxt = table[state, token]
    hit = nxt == table.shape[0]
    return jnp.where(hit, 0, nxt), hit


@struct.dataclass
class Stops:
    """What ends a sequence on the device: stop token ids and the stop strings' automaton."""

    ids: Int[Array, " k"]  # stop token ids, -1 for none
    table: Int[Array, "n v"] | None = None  # StopTable.next (rows padded), None: no strings

    def start(self, rows: int) -> Int[Array, " b"]:
        """Every row's automaton state before its completion's first token."""
        return jnp.zeros((rows,), jnp.int32)

    def check(self, state: Int[Array, " b"], token: Int[Array, " b"]
              ) -> tuple[Int[Array, " b"], Bool[Array, " b"]]:
        """(next automaton state, whether ``token`` ends the row: a stop id or the last token
        of a stop string)."""
        hit = jnp.isin(token, self.ids)
        if self.table is None:
            return state, hit
        state, text = advance(self.table, state, token)
        return state, hit | text


def padded_table(table: StopTable, multiple: int = 16) -> np.ndarray:
    """``table.next`` with unreachable rows appended up to a multiple of ``multiple`` states (so
    stop sets of similar sizes share a compiled program); the hit marker moves with the rows."""
    n = -(-table.hit // multiple) * multiple
    out = np.zeros((n, table.next.shape[1]), np.int32)
    out[:table.hit] = np.where(table.next == table.hit, n, table.next)
    return out


def device_stops(stop_ids, table: StopTable | None) -> Stops:
    """``Stops`` of host values: the ids padded with -1 to a power of two (at least 4), the
    table's rows padded (``padded_table``)."""
    ids = list(dict.fromkeys(stop_ids))
    out = np.full((1 << max(2, (len(ids) - 1).bit_length()),), -1, np.int32)
    out[:len(ids)] = ids
    return Stops(out, None if table is None else padded_table(table))
