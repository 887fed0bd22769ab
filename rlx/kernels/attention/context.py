"""Context parallelism: each sequence's tokens split over the ``context`` mesh axis (logical
``seq``), for the learner's forward and backward passes and the engine's prefill and scoring.

**All-gathered keys and values, not a ring.** Each device keeps its share of the queries and,
per layer, gathers the whole sequence's keys and values (``attend_gathered``); the gradient of
the gather is a reduce-scatter of the keys' and values' gradients. Why this and not ring
attention (keys passed around with ``ppermute``, one partial softmax per step):

* rlx's mask is a function of per-token segment ids and positions, so a device's queries over
  the gathered keys is one ordinary call of the same kernels (``blockwise``, ``dense``), packing,
  padding, windows and sinks included. A ring would merge ``c`` partial softmaxes forward and
  backward, a second implementation of every mask feature.
* What is gathered is small next to the queries: grouped-query models have a few key/value
  heads (8 against 64 query heads is common), and MLA gathers its per-token latent and shared
  rotary key (576 numbers at DeepSeek-V3's shape) and expands it on each device, never every
  head's 192-wide key and 128-wide value. A layer's gathered keys are ``O(t)`` per device; the
  scores stay blockwise.
* Its cost against a ring is that the gather is not overlapped with attention compute by
  construction. At the context sizes an 8-chip node uses (2 to 8), the gathered bytes per layer
  are those of the layer's key/value projection outputs.

**Load balance: zig-zag order.** Causal attention gives the last tokens the most keys. With the
sequence cut into ``2c`` chunks, device ``i`` holds chunks ``i`` and ``2c - 1 - i`` (``ZigZag``):
every device holds one early and one late chunk, so the key blocks its queries see (and that
``blockwise`` does not skip) are the same in number on every device. The model puts the tokens
in this order once before the first layer and back after the last (``Transformer.forward``);
no layer depends on the order of tokens, since masks come from positions and segments.

**Folded rows.** Between those two points each row's ``c`` shares are rows of their own
(``ContextSplit``: ``[b, t, d]`` -> ``[c * b, t / c, d]``, split over ``(context, *batch
axes)``). Code that flattens rows and tokens into one axis (a LoRA or quantized product, MoE
routing and dispatch) then keeps each device's tokens on it; with ``t`` split in place, a device
holding several rows would see its tokens scattered over the flattened axis, and XLA would
gather them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec


@dataclasses.dataclass(frozen=True)
class ZigZag:
    """The zig-zag token order over ``shards`` devices, and its inverse, on axis 1 of ``[b, t,
    ...]`` arrays whose ``t`` is a multiple of ``2 * shards`` (``padding`` says how many
    columns to add)."""

    shards: int

    def padding(self, t: int) -> int:
        """Columns to add to ``t`` for it to split into ``2 * shards`` equal chunks."""
        return -t % (2 * self.shards)

    def permute(self, x: jax.Array) -> jax.Array:
        """Natural order -> zig-zag: chunks ``0, 2c-1, 1, 2c-2, ...``."""
        b, t, *rest = x.shape
        c = self.shards
        halves = x.reshape(b, 2, c, t // (2 * c), *rest)
        pairs = jnp.stack([halves[:, 0], jnp.flip(halves[:, 1], axis=1)], axis=2)
        return pairs.reshape(b, t, *rest)

    def restore(self, x: jax.Array) -> jax.Array:
        """Zig-zag -> natural order (``permute``'s inverse)."""
        b, t, *rest = x.shape
        c = self.shards
        pairs = x.reshape(b, c, 2, t // (2 * c), *rest)
        halves = jnp.stack([pairs[:, :, 0], jnp.flip(pairs[:, :, 1], axis=1)], axis=1)
        return halves.reshape(b, t, *rest)

    def fold(self, x: jax.Array) -> jax.Array:
        """``[b, t, ...]`` -> ``[c * b, t / c, ...]``: row ``i * b + r`` is row ``r``'s ``i``-th
        share of tokens (``ContextSplit``)."""
        b, t, *rest = x.shape
        c = self.shards
        return jnp.swapaxes(x.reshape(b, c, t // c, *rest), 0, 1).reshape(c * b, t // c, *rest)

    def unfold(self, x: jax.Array) -> jax.Array:
        """``fold``'s inverse."""
        cb, n, *rest = x.shape
        c = self.shards
        return jnp.swapaxes(x.reshape(c, cb // c, n, *rest), 0, 1).reshape(cb // c, c * n, *rest)


@dataclasses.dataclass(frozen=True)
class ContextSplit:
    """How the layers hold a batch under context parallelism: the tokens in zig-zag order, each
    row's ``c`` shares *folded* into rows (``[b, t, d]`` -> ``[c * b, t / c, d]``, ``ZigZag.
    fold``), the folded rows split over ``(context, *batch axes)``. Every device then holds whole
    rows of the folded batch, so the layers' per-token code (projections and their LoRA and
    quantized products, MoE routing and dispatch, which flatten rows and tokens into one axis)
    stays split with no exchange; only attention sees whole sequences (``attend_gathered``)."""

    sharding: Any  # an AttentionSharding with a context axis

    @property
    def order(self) -> ZigZag:
        return ZigZag(self.sharding.context_shards)

    def folded_spec(self, ndim: int) -> PartitionSpec:
        """Folded ``[c * b, t / c, ...]``: rows over the context axis, then the batch axes."""
        return PartitionSpec((self.sharding.context, *self.sharding.batch), *(None,) * (ndim - 1))

    def whole_spec(self, ndim: int) -> PartitionSpec:
        """``[b, t, ...]`` whole along ``t``: rows over the batch axes only."""
        return PartitionSpec(tuple(self.sharding.batch) or None, *(None,) * (ndim - 1))

    def _place(self, x: jax.Array, spec: PartitionSpec) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.sharding.mesh, spec))

    def split(self, x: jax.Array) -> jax.Array:
        """A folded array constrained to its devices."""
        return self._place(x, self.folded_spec(x.ndim))

    def enter(self, x: jax.Array, fill=0) -> jax.Array:
        """``[b, t, ...]`` in natural order -> folded zig-zag rows (``t`` padded with ``fill``
        to whole chunks; segment id 0 marks padding, which attends and is attended by
        nothing)."""
        pad = self.order.padding(x.shape[1])
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        return self.split(self.order.fold(self.order.permute(x)))

    def leave(self, x: jax.Array, t: int) -> jax.Array:
        """``enter``'s inverse: folded rows -> ``[b, t, ...]`` in natural order."""
        return self.order.restore(self.order.unfold(x))[:, :t]

    def whole(self, x: jax.Array) -> jax.Array:
        """Folded rows -> ``[b, t, ...]`` (zig-zag order) whole on every context device of its
        rows: an all-gather over the context axis (its gradient a reduce-scatter)."""
        return self._place(self.order.unfold(x), self.whole_spec(x.ndim))

    def in_slot_order(self, x: jax.Array) -> jax.Array:
        """New tokens' keys or values (folded) in slot order, whole on every context device (to
        be written into a KV cache that every context device holds)."""
        return self._place(self.order.restore(self.order.unfold(x)), self.whole_spec(x.ndim))


def attend_gathered(sharding, local, q, k, v, q_segments, kv_segments, q_positions,
                    kv_positions, sinks=None, kv_major: bool = False):
    """``local(q, k, v, q_segments, kv_segments, q_positions, kv_positions, sinks)`` run per
    device on its folded rows of queries (``ContextSplit``) and its KV heads
    (``AttentionSharding.heads_for``), over every slot's keys and values. ``k``/``v`` and
    their segments and positions are whole ``[b, s, ...]`` (a cache's ``[b, kv, ...]`` with
    ``kv_major``) or, with as many rows as ``q`` (a sequence over itself; MLA's keys come whole,
    expanded from gathered latents, its segments and positions folded), folded like it and
    gathered here (``ContextSplit.whole``). ``local`` must mask by positions (no column
    causality): in zig-zag order a query's column says nothing about its position."""
    split = ContextSplit(sharding)
    folded = lambda a: a.shape[0] == q.shape[0]  # noqa: E731  (a whole array has b < c * b rows)
    if not kv_major and folded(k):
        k, v = split.whole(k), split.whole(v)
    if folded(kv_segments):
        kv_segments, kv_positions = split.whole(kv_segments), split.whole(kv_positions)
    heads = sharding.heads_for(k.shape[1] if kv_major else k.shape[2])
    rows = tuple(sharding.batch) or None
    q_spec = PartitionSpec((sharding.context, *sharding.batch), None, heads)
    kv_spec = PartitionSpec(rows, heads) if kv_major else PartitionSpec(rows, None, heads)
    q_vec, kv_vec = PartitionSpec(q_spec[0]), PartitionSpec(rows)
    args = (q, k, v, q_segments, kv_segments, q_positions, kv_positions)
    specs = (q_spec, kv_spec, kv_spec, q_vec, kv_vec, q_vec, kv_vec)
    if sinks is not None:
        args, specs = args + (sinks,), specs + (PartitionSpec(heads),)
    else:
        local = _without_sinks(local)
    return jax.shard_map(local, mesh=sharding.mesh, in_specs=specs, out_specs=q_spec,
                         check_vma=False)(*args)


def _without_sinks(local):
    return lambda *args: local(*args, None)
