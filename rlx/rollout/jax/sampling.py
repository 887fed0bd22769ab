"""Device side of the built-in JAX engine: token sampling, batched generation, teacher-forced scores.

``generate_batch`` runs one bucket of left-padded prompts entirely on device: a prefill of the prompt
slots through ``Transformer.decode`` (the learner's own modules, writing a ``KVCache``; each distinct
prompt once, its cache then copied to its ``n`` samples' rows), then
``lax.while_loop``s that feed one token per row per iteration and exit as soon as every row has hit
a stop token or ``max_new`` tokens are out. There is no host round trip per token. The cache grows
between loops (``segment_ends``), so attention reads only the slots a segment can have filled.
A continued batch (``KeptPrefix``, gathered from earlier batches' caches by ``gather_prefix``)
starts from the kept tokens' slots and prefills only the prompt tokens after them.
With ``GenerateStatic.record_routes`` the prefill and every step run ``Transformer.decode_routed``
and keep the experts each fed token went to in every MoE layer (routing replay: the learner then
uses the sampler's experts); without it nothing is recorded and nothing else changes.

Tokens are chosen by ``rlx.rollout.jax.sampler`` (greedy, or a draw after temperature, top-k,
top-p and min-p; every row keyed by its request, so a request's samples do not depend on how
requests were batched or padded), with the raw policy's log-prob of each: what the learner's
``token_logprobs`` computes for the same sequence.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import NamedSharding
from jaxtyping import Array, Bool, Float, Int, UInt32

from rlx.kernels.logprobs import token_logprobs
from rlx.models.kv_cache import KVCache
from rlx.models.stack import decode_model, layer_counts
from rlx.rollout.jax.cache_layout import stacked
from rlx.rollout.jax.sampler import Knobs, SamplerSpec, next_tokens, row_keys
from rlx.rollout.jax.stops import Stops


def _constrain(cache: KVCache, kv: tuple[NamedSharding, NamedSharding] | None,
               rows: NamedSharding | None) -> KVCache:
    """``cache`` on its shardings: ``kv`` the keys' and the values' (``rlx.rollout.jax.engine.
    cache_sharding``), ``rows`` the slots' positions and segment ids."""
    if kv is None:
        return cache
    if cache.stacks is not None:  # a scanned model's buffers
        kv = stacked(kv)
    put = jax.lax.with_sharding_constraint
    lin = [cache.is_linear(i) for i in range(len(cache.keys))]  # gated DeltaNet states: as they are
    return cache.replace(keys=tuple(k if s else put(k, kv[0]) for k, s in zip(cache.keys, lin)),
                         values=tuple(v if s else put(v, kv[1]) for v, s in zip(cache.values, lin)),
                         positions=put(cache.positions, rows), segment_ids=put(cache.segment_ids, rows))


def left_padded(lens: Int[Array, " b"], width: int):
    """Positions and segment ids [b, width] of rows whose ``lens`` tokens end at the last slot."""
    start = width - lens  # [b] first real slot
    slots = jnp.arange(width, dtype=jnp.int32)[None]  # [1, width]
    return jnp.maximum(slots - start[:, None], 0), (slots >= start[:, None]).astype(jnp.int32)


@struct.dataclass
class KeptPrefix:
    """Cached keys/values of the first ``lens`` tokens of each prompt row, left padded in ``k``
    slots (a row's tokens end at slot ``k - 1``, in position order), in the buffers'
    ``KVCache`` layout: a continued request prefills only the tokens after them."""

    keys: tuple[Float[Array, "... k"], ...]
    values: tuple[Float[Array, "... k d"], ...]
    lens: Int[Array, " u"]

    @property
    def width(self) -> int:
        return self.values[0].shape[-2]


def _start_cache(model, rows: int, length: int, kept: KeptPrefix | None, static) -> KVCache:
    """An empty cache of ``length`` slots, or ``kept``'s slots followed by empty ones: its
    positions and segments those of ``lens`` tokens left padded, the next slot to write its
    ``width``."""
    stacks = layer_counts(model)
    if kept is None:
        cache = KVCache.zeros(model.config, rows, length, model.precision.dtype, stacks)
    else:
        positions, segments = left_padded(kept.lens, kept.width)  # [u, k] each
        cache = KVCache(kept.keys, kept.values, positions, segments,
                        jnp.asarray(kept.width, jnp.int32), stacks).grow(length)
    return _constrain(cache, static.kv_sharding, static.row_sharding)


def _prefill(model, prompt_ids, prompt_lens, prompt_of_row, length: int, static,
             kept: KeptPrefix | None = None):
    """Left-padded prompts through the cached forward pass into a cache of ``length`` slots, then
    handed to the rows that continue them. Returns the rows' last hidden states [b, d], their
    cache, their prompt lengths [b] (0 for padding rows, marked ``prompt_of_row < 0``) and, with
    ``static.record_routes``, the experts of their prompt tokens ``[b, p, moe layers, k]`` (-1 on
    the left padding; else None), and the (token, expert) pairs a dispatch capacity dropped
    (counted with ``static.count_dropped``, else 0).

    With fewer prompts than rows (``n`` samples of each prompt) each prompt is prefilled once and
    its cache rows are copied to its samples: a GRPO group of 8 prefills 1 row, not 8.
    With ``kept`` the prompts are what follows each row's kept tokens: they are written after
    them, at positions ``kept.lens`` on, and a row's prompt length counts both."""
    u, p = prompt_ids.shape
    if kept is not None and static.record_routes:
        raise ValueError("a continued prefill records no routes of its kept tokens")
    cache = _start_cache(model, u, length, kept, static)
    positions, segments = left_padded(prompt_lens, p)  # [u, p] each
    before = jnp.zeros_like(prompt_lens) if kept is None else kept.lens  # [u]
    positions = positions + before[:, None]
    experts, dropped = None, jnp.zeros((), jnp.int32)
    if static.record_routes or static.count_dropped:
        h, cache, routes = model.decode_routed(prompt_ids, positions, segments, cache,
                                               static.adapter)
        dropped = routes.dropped
        if static.record_routes:
            experts = jnp.where(segments[:, :, None, None] > 0, routes.experts,
                                -1).astype(ROUTE_DTYPE)
    else:
        h, cache = model.decode(prompt_ids, positions, segments, cache, static.adapter)
    last, lens = h[:, -1], prompt_lens + before  # [u, d], [u]
    if u < prompt_of_row.shape[0]:  # else one row per prompt, in order (the host's packing)
        src = jnp.maximum(prompt_of_row, 0)  # [b]
        cache = _constrain(cache.take_rows(src), static.kv_sharding, static.row_sharding)
        last, lens = jnp.take(last, src, axis=0), lens[src]
        experts = None if experts is None else jnp.take(experts, src, axis=0)  # [b, p, l, k]
    return last, cache, jnp.where(prompt_of_row < 0, 0, lens), experts, dropped


def gather_prefix(keys: tuple, values: tuple, rows: Int[Array, " u"], slots: Int[Array, "u k"],
                  take: Bool[Array, " u"], prev: tuple | None = None, *, layers_stacked: bool,
                  kv_sharding: tuple[NamedSharding, NamedSharding] | None = None
                  ) -> tuple[tuple, tuple]:
    """The kept slots of a finished batch's cache buffers (``keys``, ``values``: one per layer or
    stack) as the ``KeptPrefix`` buffers of the rows of a new batch: row i holds slots
    ``slots[i]`` (in that order) of row ``rows[i]`` where ``take[i]``, elsewhere ``prev``'s row i
    (or those slots all the same, when there is no ``prev``: rows left for another source or
    with nothing kept, never attended to)."""
    row_axis = 1 if layers_stacked else 0

    def one(x, old, slot_axis: int, sharding):
        slot_axis %= x.ndim
        x = jnp.take(x, rows, axis=row_axis)  # [.., u, .., s, ..]
        shape = [1] * x.ndim
        shape[row_axis], shape[slot_axis] = slots.shape
        out = jnp.take_along_axis(x, slots.reshape(shape), axis=slot_axis)  # [.., u, .., k, ..]
        if old is not None:
            mask = [1] * x.ndim
            mask[row_axis] = take.shape[0]
            out = jnp.where(take.reshape(mask), out, old)
        return out if sharding is None else jax.lax.with_sharding_constraint(out, sharding)

    old_k, old_v = prev if prev is not None else ((None,) * len(keys), (None,) * len(values))
    if kv_sharding is not None and layers_stacked:
        kv_sharding = stacked(kv_sharding)
    key_s, value_s = kv_sharding if kv_sharding is not None else (None, None)
    return (tuple(one(k, o, -1, key_s) for k, o in zip(keys, old_k)),
            tuple(one(v, o, -2, value_s) for v, o in zip(values, old_v)))


@dataclasses.dataclass(frozen=True)
class GenerateStatic:
    """Hashable settings baked into one compiled generate function."""

    graphdef: nnx.GraphDef
    spec: SamplerSpec
    new_tokens: int  # output buffer length (the bucket of max_new_tokens)
    adapter: bool = True
    kv_sharding: tuple[NamedSharding, NamedSharding] | None = None  # keys', values' (engine)
    row_sharding: NamedSharding | None = None
    record_routes: bool = False  # also return each fed token's experts (routing replay)
    count_dropped: bool = False  # also return the (token, expert) pairs a MoE capacity dropped
    keep_cache: bool = False  # also return the final cache's keys and values (a prefix cache)


ROUTE_DTYPE = jnp.int16  # expert ids of recorded routes (fewer than 32768 experts)


def segment_ends(new_tokens: int, max_segments: int = 4, min_steps: int = 32) -> tuple[int, ...]:
    """Step counts at which the decode loop grows its KV cache: ``new_tokens`` split into at most
    ``max_segments`` equal segments of at least ``min_steps`` steps (one segment below that).

    Attention reads every slot of the cache at every step; a cache grown per segment reads only
    ``prompt + segment end`` slots instead of ``prompt + new_tokens`` (64 + 128 tokens in four
    segments: 144 slots per step on average instead of 192). Each segment is its own
    ``while_loop``, so a program holds one decode body per segment.
    """
    w = max(1, min(max_segments, new_tokens // min_steps))
    return tuple(new_tokens * (j + 1) // w for j in range(w))


def generate_batch(state: nnx.State, prompt_ids: Int[Array, "u p"], prompt_lens: Int[Array, " u"],
                   prompt_of_row: Int[Array, " b"], uid_hash: UInt32[Array, " b"],
                   sample_index: Int[Array, " b"], seed: Int[Array, ""], knobs: Knobs,
                   max_new: Int[Array, ""], stops: Stops,
                   kept: KeptPrefix | None = None, *, static: GenerateStatic):
    """Generate up to ``max_new`` tokens per row; row r continues prompt ``prompt_of_row[r]``
    (-1: a padding row). With as many prompts as rows, row r must continue prompt r. With
    ``kept``, prompt i is what follows the ``kept.lens[i]`` tokens cached for it (the cache
    holds ``kept.width`` more slots before the prompts': ``width`` below).

    Returns (tokens [b, n], raw-policy log-probs [b, n], lengths [b], stopped [b]); entries at or
    beyond a row's length are 0. ``stopped``: the row ended on a stop token or completed a stop
    string (``stops``; that token kept as its last).
    The cache starts at ``width + segment_ends(n)[0]`` slots and grows by a segment at a time;
    ``static.keep_cache`` adds its final keys and values (tuples, one per layer or stack).
    ``static.record_routes`` adds the experts every MoE layer chose for each token fed: the
    prompts' ``[b, p, l, k]`` (left-padded like ``prompt_ids``) and the completions' ``[b, n,
    l, k]``, -1 where nothing was fed (padding, a row's last token, which is never fed back).
    ``static.count_dropped`` adds the number of (token, expert) pairs that a MoE dispatch capacity
    dropped in the prefill and the decode steps (every row fed, padding rows included: they take
    capacity too).
    """
    model = decode_model(nnx.merge(static.graphdef, state))
    b = prompt_of_row.shape[0]
    p = prompt_ids.shape[1] + (0 if kept is None else kept.width)  # slots before the completions
    n = static.new_tokens
    ends = segment_ends(n)
    keys = row_keys(seed, uid_hash, sample_index)
    last, cache, prompt_lens, prompt_routes, dropped = _prefill(
        model, prompt_ids, prompt_lens, prompt_of_row, p + ends[0], static, kept)
    tok, logp = next_tokens(model, last, keys, 0, knobs, static.spec, static.adapter)
    inactive = prompt_lens == 0
    text, stopped = stops.check(stops.start(b), tok)
    stopped = stopped & ~inactive
    carry = dict(step=jnp.ones((), jnp.int32), cache=cache, last=tok,
                 tokens=jnp.zeros((b, n), jnp.int32).at[:, 0].set(tok),
                 logps=jnp.zeros((b, n), jnp.float32).at[:, 0].set(logp),
                 lengths=jnp.where(inactive, 0, 1).astype(jnp.int32), stopped=stopped,
                 done=stopped | inactive, text=text)
    if static.record_routes:
        carry["routes"] = jnp.full((b, n, *prompt_routes.shape[2:]), -1, ROUTE_DTYPE)
    if static.count_dropped:
        carry["dropped"] = dropped
    body = functools.partial(_decode_step, model=model, keys=keys, prompt_lens=prompt_lens,
                             knobs=knobs, stops=stops, static=static)
    limit = jnp.minimum(max_new, n)
    for end in ends:
        if carry["cache"].length < p + end:
            grown = carry["cache"].grow(p + end)
            carry["cache"] = _constrain(grown, static.kv_sharding, static.row_sharding)
        stop = jnp.minimum(limit, end)
        carry = jax.lax.while_loop(lambda c, stop=stop: (c["step"] < stop) & ~jnp.all(c["done"]),
                                   body, carry)
    return _outputs(carry, prompt_routes, static)


def _outputs(carry: dict, prompt_routes, static: GenerateStatic) -> tuple:
    """``generate_batch``'s results from its final carry (its docstring says which)."""
    out = carry["tokens"], carry["logps"], carry["lengths"], carry["stopped"]
    if static.record_routes:
        out = (*out, prompt_routes, carry["routes"])
    if static.count_dropped:
        out = (*out, carry["dropped"])
    if static.keep_cache:
        out = (*out, carry["cache"].keys, carry["cache"].values)
    return out


def _decode_step(c, *, model, keys, prompt_lens, knobs, stops: Stops, static):
    """Feed every row's last token, sample the next one; finished rows keep their outputs."""
    step = c["step"]
    positions = (prompt_lens + step - 1)[:, None]  # [b, 1]
    segments = jnp.ones_like(positions)
    live = ~c["done"]  # [b]
    out = {}
    if static.record_routes or static.count_dropped:
        h, cache, routes = model.decode_routed(c["last"][:, None], positions, segments,
                                               c["cache"], static.adapter)
        if static.record_routes:  # the fed token is the completion's token step - 1
            fed = jnp.where(live[:, None, None], routes.experts[:, 0], -1).astype(ROUTE_DTYPE)
            out["routes"] = jax.lax.dynamic_update_index_in_dim(c["routes"], fed, step - 1,
                                                                axis=1)
        if static.count_dropped:
            out["dropped"] = c["dropped"] + routes.dropped
    else:
        h, cache = model.decode(c["last"][:, None], positions, segments, c["cache"],
                                static.adapter)
    tok, logp = next_tokens(model, h[:, 0], keys, step, knobs, static.spec, static.adapter)
    put = functools.partial(jax.lax.dynamic_update_index_in_dim, index=step, axis=1)
    tokens = put(c["tokens"], jnp.where(live, tok, 0))
    logps = put(c["logps"], jnp.where(live, logp, 0.0))
    text, hit = stops.check(c["text"], tok)
    stopped = c["stopped"] | (live & hit)
    return dict(step=step + 1, cache=_constrain(cache, static.kv_sharding, static.row_sharding),
                last=tok, tokens=tokens, logps=logps,
                lengths=jnp.where(live, step + 1, c["lengths"]), stopped=stopped,
                done=c["done"] | stopped, text=text, **out)


def sequence_logprobs(state: nnx.State, ids: Int[Array, "b t"], lens: Int[Array, " b"], *,
                graphdef: nnx.GraphDef, adapter: bool = True, chunk: int = 256) -> Float[Array, "b t"]:
    """Teacher-forced raw-policy log-probs of left-padded rows through the cached forward pass.

    ``out[:, s]`` is log p(ids[:, s + 1] | ids[:, <= s]) for ``s < t - 1``; the last column is 0.
    """
    model = decode_model(nnx.merge(graphdef, state))
    b, t = ids.shape
    cache = KVCache.zeros(model.config, b, t, model.precision.dtype, layer_counts(model))
    positions, segments = left_padded(lens, t)
    h, _ = model.decode(ids, positions, segments, cache, adapter)
    project = functools.partial(model.logits, adapter=adapter)
    logp, _ = token_logprobs(h[:, :-1], project, ids[:, 1:], chunk)  # [b, t - 1]
    return jnp.pad(logp, ((0, 0), (0, 1)))
