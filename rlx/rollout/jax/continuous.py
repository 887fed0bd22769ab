"""Device programs of the built-in engine's continuous batching over a paged KV cache.

The engine keeps ``S`` decode slots. Their state is arrays (``Slots``); which request a slot
serves, which pages it holds and when it is refilled is the host's (``rlx.rollout.jax.scheduler``),
between calls of three compiled programs, each on the shared page pools
(``rlx.models.paged_kv.PagedKVCache``, donated and returned):

* ``prefill_chunk``: up to ``C`` prompt tokens of each of ``R`` sequences written into their
  pages (chunked prefill: a long prompt takes several calls, interleaved with decode bursts),
  returning each row's hidden state at its last token;
* ``first_tokens``: a prompt's ``n`` samples' first tokens drawn from its last hidden state (the
  samples then share its pages);
* ``decode_burst``: up to ``K`` decode steps of every live slot, as one ``while_loop`` that stops
  early when every slot is done, when a slot finishes while requests wait (``stop_on_free``):
  the host refills it at once, or when the live slots fit the next smaller slot bucket
  (``shrink_at``, ``slot_buckets``): the host packs them into it.

Host scheduling between fixed-length bursts rather than a scheduler inside the program: admission
(which request, which pages, sharing a prefix by its tokens, preempting when pages run out), stop
strings' bookkeeping and multi-turn continuations are irregular, data-dependent work that would
need every waiting prompt on the device in fixed-size queues; a burst of ``K`` steps amortises
the dispatch. A slot that finishes mid-burst idles for the rest of it (at most ``K - 1`` steps),
and with ``stop_on_free`` not even that when requests wait.

A slot's token ``j`` is drawn with the key of its request (``row_keys``: seed, prompt uid,
sample index) folded with ``j``, and every row's arithmetic is its own, so a request's tokens and
log-probs do not depend on the slots beside it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Bool, Float, Int, UInt32

from rlx.mesh import LogicalRules, batch_sharding
from rlx.models.hparams import ModelConfig
from rlx.models.paged_kv import PagedKVCache, copy_pages
from rlx.models.stack import decode_model
from rlx.rollout.jax.cache_layout import page_sharding
from rlx.rollout.jax.sampler import Knobs, SamplerSpec, next_tokens, row_keys
from rlx.rollout.jax.sampling import ROUTE_DTYPE
from rlx.rollout.jax.stops import Stops


# the fewest rows of a program: one row's products run another kernel than several rows', and
# a sample's numbers must not change when it is left alone
MIN_ROWS = 2


def slot_buckets(slots: int, per_octave: int = 1) -> tuple[int, ...]:
    """Row counts a burst's program may have, largest first: ``slots`` and its halves while
    they divide evenly, none under ``MIN_ROWS``; with ``per_octave`` 2 also three quarters of
    each (64: 64, 48, 32, 24, 16, 12, 8, 6, 4, 3, 2). A bucket leaves fewer than half its rows
    idle (a third with ``per_octave`` 2); every bucket is a program to compile
    (``PlatformPolicy.slot_buckets_per_octave``)."""
    if per_octave not in (1, 2):
        raise ValueError(f"slot buckets per octave must be 1 or 2, got {per_octave}")
    out, b = [slots], slots
    while b % 2 == 0 and b // 2 >= MIN_ROWS:
        if per_octave == 2 and b % 4 == 0:
            out.append(3 * b // 4)
        b //= 2
        out.append(b)
    return tuple(out)


@struct.dataclass
class Slots:
    """The decode slots' state (``S`` rows)."""

    table: Int[Array, "s m"]  # each slot's pages in token order
    length: Int[Array, " s"]  # tokens in its cache (the prompt and every fed token)
    last: Int[Array, " s"]  # the last drawn token, fed next
    generated: Int[Array, " s"]  # tokens drawn so far (the next one's step)
    limit: Int[Array, " s"]  # max tokens to draw
    live: Bool[Array, " s"]  # drawing
    text: Int[Array, " s"]  # stop-string automaton state
    uid_hash: UInt32[Array, " s"]
    sample_index: Int[Array, " s"]


@dataclasses.dataclass
class Programs:
    """The compiled programs (``rlx.rollout.jax.continuous``)."""

    # (state, pools, ids, positions, segments, table, lengths) -> (pools, h, dropped)
    prefill: Callable
    first: Callable  # (state, h, uid_hash, sample_index, seed, knobs, stops) -> (tokens, ...)
    # (state, pools, slots, seed, knobs, stops, stop_on_free, shrink_at) -> (pools, ...)
    burst: Callable
    copy: Callable  # (pools, source, target) -> pools
    # a row array (numpy or on a device) placed as the programs take them: a multi-process
    # job's jit takes no numpy array with a sharding other than replicated
    rows: Callable = lambda x: x


@dataclasses.dataclass(frozen=True)
class ContinuousStatic:
    """Hashable settings of the compiled programs."""

    graphdef: nnx.GraphDef
    spec: SamplerSpec
    burst: int = 16  # decode steps per burst (at most)
    adapter: bool = True
    shards: int = 1  # data shards: a program's rows are one equal block per shard
    record_routes: bool = False  # the programs also return each fed token's experts


def _model(static: ContinuousStatic, state: nnx.State):
    return decode_model(nnx.merge(static.graphdef, state))


def prefill_chunk(state: nnx.State, pools: PagedKVCache, ids: Int[Array, "r c"],
                  positions: Int[Array, "r c"], segments: Int[Array, "r c"],
                  table: Int[Array, "r m"], lengths: Int[Array, " r"], *,
                  static: ContinuousStatic
                  ) -> tuple[PagedKVCache, Float[Array, "r d"], Int[Array, ""]]:
    """Write ``ids`` (at ``positions``; segment 0: padding) into the rows' pages; returns the
    pools, each row's final-norm hidden state at its last real token of the chunk, the
    (token, expert) pairs a MoE dispatch capacity dropped and, with ``static.record_routes``,
    each token's experts ``[r, c, moe layers, k]``."""
    model = _model(static, state)
    view = pools.with_rows(table, lengths)
    h, out, routes = model.decode_routed(ids, positions, segments, view, static.adapter)
    last = jnp.maximum(jnp.sum(segments > 0, axis=1) - 1, 0)
    result = (out.with_rows(pools.table, pools.lengths), jnp.take_along_axis(
        h, last[:, None, None], axis=1)[:, 0], routes.dropped)
    return result + ((routes.experts.astype(ROUTE_DTYPE),) if static.record_routes else ())


def first_tokens(state: nnx.State, h: Float[Array, "n d"], uid_hash: UInt32[Array, " n"],
                 sample_index: Int[Array, " n"], seed: Int[Array, ""], knobs: Knobs,
                 stops: Stops, *, static: ContinuousStatic):
    """Each sample's first token and its raw-policy log-prob from its prompt's last hidden
    state (step 0 of its key), the stop automaton's state after it and whether it stops."""
    model = _model(static, state)
    keys = row_keys(seed, uid_hash, sample_index)
    tok, logp = next_tokens(model, h, keys, 0, knobs, static.spec, static.adapter)
    text, hit = stops.check(jnp.zeros_like(tok), tok)
    return tok, logp, text, hit


def decode_burst(state: nnx.State, pools: PagedKVCache, slots: Slots, seed: Int[Array, ""],
                 knobs: Knobs, stops: Stops, stop_on_free: Bool[Array, ""],
                 shrink_at: Int[Array, ""], *, static: ContinuousStatic):
    """Up to ``static.burst`` steps of every live slot: feed its last token, draw the next;
    the burst ends early once the fullest shard's live slots fit ``shrink_at`` rows (the next
    smaller slot bucket; 0: never).

    Returns (pools, slots, tokens [s, K], log-probs [s, K], drawn [s], stopped [s], dropped):
    slot ``r`` drew ``drawn[r]`` tokens in this burst (columns ``0 .. drawn - 1``); ``stopped``:
    it ended on a stop token or string (else a finished slot reached its limit); ``dropped``:
    the (token, expert) pairs a MoE dispatch capacity dropped, idle slots' included; with
    ``static.record_routes`` also the experts of each fed token ``[s, K, moe layers, k]`` (-1
    where a slot fed none)."""
    model = _model(static, state)
    s, k = slots.live.shape[0], static.burst
    keys = row_keys(seed, slots.uid_hash, slots.sample_index)

    def step(c):
        sl, live = c["slots"], c["slots"].live
        view = pools.replace(keys=c["kv"][0], values=c["kv"][1]).with_rows(sl.table, sl.length)
        h, out, routes = model.decode_routed(sl.last[:, None], sl.length[:, None],
                                             live[:, None].astype(jnp.int32), view,
                                             static.adapter)
        tok, logp = next_tokens(model, h[:, 0], keys, sl.generated, knobs, static.spec,
                                static.adapter)
        text, hit = stops.check(sl.text, tok)
        done = live & (hit | (sl.generated + 1 >= sl.limit))
        put = lambda buf, x: jax.lax.dynamic_update_index_in_dim(  # noqa: E731
            buf, jnp.where(live, x, 0).astype(buf.dtype), c["i"], axis=1)
        sl = sl.replace(length=sl.length + live, last=jnp.where(live, tok, sl.last),
                        generated=sl.generated + live, live=live & ~done,
                        text=jnp.where(live, text, sl.text))
        return dict(i=c["i"] + 1, kv=(out.keys, out.values), slots=sl,
                    tokens=put(c["tokens"], tok), logps=put(c["logps"], logp),
                    drawn=c["drawn"] + live, stopped=c["stopped"] | (live & hit),
                    freed=c["freed"] | jnp.any(done), dropped=c["dropped"] + routes.dropped,
                    routes=_put_routes(c["routes"], routes.experts[:, 0], live, c["i"])
                    if static.record_routes else c["routes"])

    def fullest(live):  # the live slots of the fullest shard's block
        return jnp.max(jnp.sum(live.reshape(static.shards, -1), axis=1))

    start = fullest(slots.live)

    def more(c):  # a burst also ends when its rows fit a smaller bucket: the host packs them
        live = fullest(c["slots"].live)
        shrunk = (live <= shrink_at) & (live < start)
        return (c["i"] < k) & (live > 0) & ~(stop_on_free & c["freed"]) & ~shrunk

    c = dict(i=jnp.zeros((), jnp.int32), kv=(pools.keys, pools.values), slots=slots,
             tokens=jnp.zeros((s, k), jnp.int32), logps=jnp.zeros((s, k), jnp.float32),
             drawn=jnp.zeros((s,), jnp.int32), stopped=jnp.zeros((s,), bool),
             freed=jnp.zeros((), bool), dropped=jnp.zeros((), jnp.int32),
             routes=_no_routes(model, s, k) if static.record_routes else jnp.zeros(()))
    c = jax.lax.while_loop(more, step, c)
    pools = pools.replace(keys=c["kv"][0], values=c["kv"][1])
    out = pools, c["slots"], c["tokens"], c["logps"], c["drawn"], c["stopped"], c["dropped"]
    return out + ((c["routes"],) if static.record_routes else ())


def _no_routes(model, s: int, k: int):
    """A burst's expert record before its steps: -1 everywhere, ``[s, K, moe layers, top k]``."""
    moe = model.config.moe
    return jnp.full((s, k, len(moe.sparse_layers), moe.top_k), -1, ROUTE_DTYPE)


def _put_routes(buf, experts, live, i):
    """Step ``i``'s experts ``[s, moe layers, k]`` of the live slots into column ``i``."""
    experts = jnp.where(live[:, None, None], experts, -1).astype(buf.dtype)
    return jax.lax.dynamic_update_index_in_dim(buf, experts, i, axis=1)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the programs' arguments and results lie on a mesh: the weights on the engine's
    shardings, the pools' pages over the batch axes (``rlx.rollout.jax.cache_layout.
    page_sharding``), every row array's rows over the batch axes, scalars whole."""

    mesh: Mesh
    rules: LogicalRules
    state: Any  # the weights' shardings (an nnx.State of them)
    pools: PagedKVCache  # of shardings

    @classmethod
    def of(cls, mesh: Mesh, rules: LogicalRules, config: ModelConfig, stacks, pages: int,
           page_size: int, state) -> "Placement":
        """The placement of pools of ``pages`` pages in all (every data shard's) for the model
        of ``config`` (``stacks``: a scanned one's layers per stack), weights on ``state``."""
        keys, values = page_sharding(mesh, config, rules, pages, page_size, stacks is not None)
        n = config.num_layers if stacks is None else len(stacks)
        whole = NamedSharding(mesh, PartitionSpec())
        return cls(mesh, rules, state, PagedKVCache((keys,) * n, (values,) * n, whole, whole,
                                                    stacks=stacks, page_size=page_size))

    def rows(self, ndim: int) -> NamedSharding:
        return batch_sharding(self.mesh, ndim, self.rules)

    @property
    def whole(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())


def compile_programs(graphdef: nnx.GraphDef, spec: SamplerSpec, *, burst: int,
                     adapter: bool = True, shards: int = 1, place: Placement | None = None,
                     record_routes: bool = False) -> Programs:
    """The three programs of ``graphdef``'s model jitted (each takes the weights' ``nnx.State``
    first; pools donated), and the page copy; on a mesh (``place``) with their shardings
    declared, over ``shards`` data shards. ``jax.jit`` compiles each once per shape: per slot
    bucket and page-table width."""
    static = ContinuousStatic(graphdef, spec, burst, adapter, shards, record_routes)
    fns = (functools.partial(prefill_chunk, static=static),
           functools.partial(first_tokens, static=static),
           functools.partial(decode_burst, static=static), copy_pages)
    donate = (1, (), 1, 0)
    if place is None:
        return Programs(*(jax.jit(f, donate_argnums=d) for f, d in zip(fns, donate)))
    r1, r2, w, pools, state = place.rows(1), place.rows(2), place.whole, place.pools, place.state
    slots = Slots(r2, *[r1] * 8)
    routes = (place.rows(4),) if record_routes else ()
    shardings = (((state, pools, r2, r2, r2, r2, r1), (pools, r2, w, *routes)),
                 ((state, r2, r1, r1, w, w, w), (r1,) * 4),
                 ((state, pools, slots, w, w, w, w, w),
                  (pools, slots, r2, r2, r1, r1, w, *routes)),
                 ((pools, w, w), pools))
    return Programs(*(jax.jit(f, donate_argnums=d, in_shardings=i, out_shardings=o)
                      for f, d, (i, o) in zip(fns, donate, shardings)),
                    rows=lambda x: jax.device_put(x, place.rows(x.ndim)))
