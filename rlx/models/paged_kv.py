"""Paged key/value cache: every sequence's tokens in fixed-size pages of one shared pool.

``PagedKVCache`` holds, per layer (or per stack of layers, leading axis ``n``), a pool of
``pages`` pages of ``page_size`` token slots, in the layouts of ``rlx.models.kv_cache`` with the
pages in front and the slots of a page where the dense cache has its slots:

* GQA: keys ``[P, kv, d, page]`` (slots minor), values ``[P, kv, page, d]``;
* multi-head latent attention: shared rotary keys ``[P, r, page]``, latents ``[P, page, c]``.

A call's rows are sequences: ``table [b, m]`` lists each row's pages in token order (token ``j``
of a row sits in page ``table[r, j // page_size]`` at offset ``j % page_size``; a sequence's
position is its slot, no padding precedes it) and ``lengths [b]`` how many tokens it has written
before the call. The new tokens (``record``) are written at their positions (``store``; padding
tokens, segment 0, go to page 0, which no sequence holds). Attention reads a row's pages where
they lie (``rlx.kernels.attention.paged``: grouped-query attention, and multi-head latent
attention's absorbed decode step), block by block up to the longest row's end; a call that needs
per-head keys (MLA's prefill) sees the pages gathered into the dense layout instead (``view``,
``m x page_size`` slots, with their ``positions`` and ``segment_ids``: 1 for a slot before the
row's end, else 0), so that code is the dense cache's. Which pages a row holds, their sharing
between sequences and the free list are the host's (``rlx.rollout.jax.pages``).

On a mesh every data shard has a pool of its own: the pools' page axis splits over the mesh's
batch axes as the rows do, a row's table lists pages of its shard's pool by their ids there, and
the layers write and read the pages inside a ``shard_map`` (``per_device``), each device on its
rows, its pages and (GQA) its KV heads.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int

from rlx.kernels.attention import AttentionSharding
from rlx.models.hparams import ModelConfig
from rlx.models.kv_cache import cache_dtype


def page_shapes(cfg: ModelConfig, pages: int, page_size: int) -> tuple[tuple[int, ...], ...]:
    """One layer's (keys, values) pool shapes (module docstring)."""
    if cfg.mla is not None:
        return (pages, cfg.mla.qk_rope_head_dim, page_size), (pages, page_size,
                                                              cfg.latent_cache_width)
    kv = cfg.num_kv_heads
    return (pages, kv, cfg.head_dim, page_size), (pages, kv, page_size, cfg.value_head_dim)


@struct.dataclass
class PagedKVCache:
    """Page pools per layer and one call's view of them; a pytree."""

    keys: tuple[Float[Array, "..."], ...]
    values: tuple[Float[Array, "..."], ...]
    table: Int[Array, "b m"]  # each row's pages in token order
    lengths: Int[Array, " b"]  # tokens each row wrote before this call
    new_positions: Int[Array, "b t"] | None = None  # this call's tokens (``record``)
    new_segments: Int[Array, "b t"] | None = None
    stacks: tuple[int, ...] | None = struct.field(pytree_node=False, default=None)
    page_size: int = struct.field(pytree_node=False, default=16)

    @classmethod
    def zeros(cls, cfg: ModelConfig, pages: int, page_size: int, dtype,
              stacks: tuple[int, ...] | None = None) -> "PagedKVCache":
        """Empty pools of ``pages`` pages in ``cache_dtype(dtype)``, with an empty view (no
        rows: ``with_rows`` gives one)."""
        dtype = cache_dtype(dtype)
        key_shape, value_shape = page_shapes(cfg, pages, page_size)
        lead = [()] * cfg.num_layers if stacks is None else [(n,) for n in stacks]
        keys = tuple(jnp.zeros(n + key_shape, dtype) for n in lead)
        values = tuple(jnp.zeros(n + value_shape, dtype) for n in lead)
        empty = jnp.zeros((0, 1), jnp.int32)
        return cls(keys, values, empty, empty[:, 0], stacks=stacks, page_size=page_size)

    @property
    def length(self) -> int:
        """Slots of a row's view: its table's pages times their size."""
        return self.table.shape[1] * self.page_size

    def with_rows(self, table: Int[Array, "b m"], lengths: Int[Array, " b"]) -> "PagedKVCache":
        """The same pools seen by rows of ``table`` that wrote ``lengths`` tokens."""
        return self.replace(table=table.astype(jnp.int32), lengths=lengths.astype(jnp.int32),
                            new_positions=None, new_segments=None)

    def record(self, positions: Int[Array, "b t"], segment_ids: Int[Array, "b t"]
               ) -> "PagedKVCache":
        """Note the positions and segments of the ``t`` tokens this call writes."""
        return self.replace(new_positions=positions.astype(jnp.int32),
                            new_segments=segment_ids.astype(jnp.int32))

    @property
    def ends(self) -> Int[Array, " b"]:
        """Each row's length after this call's tokens."""
        if self.new_positions is None:
            return self.lengths
        last = jnp.max(jnp.where(self.new_segments > 0, self.new_positions + 1, 0), axis=1)
        return jnp.maximum(self.lengths, last)

    @property
    def positions(self) -> Int[Array, "b s"]:
        return jnp.broadcast_to(jnp.arange(self.length, dtype=jnp.int32),
                                (self.table.shape[0], self.length))

    @property
    def segment_ids(self) -> Int[Array, "b s"]:
        return (self.positions < self.ends[:, None]).astype(jnp.int32)

    def _where(self) -> tuple[Int[Array, "b t"], Int[Array, "b t"]]:
        """(page, offset) of every new token; padding tokens at page 0."""
        p = self.page_size
        pos = jnp.clip(self.new_positions, 0, self.length - 1)
        page = jnp.take_along_axis(self.table, pos // p, axis=1)
        return jnp.where(self.new_segments > 0, page, 0), pos % p

    def store(self, kv: tuple, new: tuple) -> tuple:
        """One layer's pools with this call's ``new`` (keys, values) written, in the
        projections' layout (tokens on axis 1: GQA ``[b, t, kv, d]``, MLA ``[b, t, r]`` /
        ``[b, t, c]``)."""
        page, off = self._where()
        keys, values = kv
        k, v = (x.astype(keys.dtype) for x in new)
        if keys.ndim == 4:  # GQA: [P, kv, d, page] <- [b, t, kv, d]; [P, kv, page, d]
            keys = keys.at[page, :, :, off].set(k)
            values = values.at[page, :, off, :].set(v)
        else:  # MLA: [P, r, page] <- [b, t, r]; [P, page, c] <- [b, t, c]
            keys = keys.at[page, :, off].set(k)
            values = values.at[page, off, :].set(v)
        return keys, values

    def view(self, kv: tuple) -> tuple:
        """One layer's (keys, values) as the dense cache lays them out for these rows (GQA
        ``[b, kv, d, s]`` / ``[b, kv, s, d]``, MLA ``[b, r, s]`` / ``[b, s, c]``)."""
        keys, values = kv
        k, v = keys[self.table], values[self.table]  # [b, m, ...]
        b, m = self.table.shape
        if keys.ndim == 4:  # [b, m, kv, d, page] -> [b, kv, d, m * page]; values likewise
            k = jnp.moveaxis(k, 1, 3).reshape(b, *keys.shape[1:3], -1)
            v = jnp.moveaxis(v, 1, 2).reshape(b, values.shape[1], -1, values.shape[3])
        else:  # [b, m, r, page] -> [b, r, m * page]; [b, m, page, c] -> [b, m * page, c]
            k = jnp.moveaxis(k, 1, 2).reshape(b, keys.shape[1], -1)
            v = v.reshape(b, -1, values.shape[2])
        return k, v

    def advance(self, keys, values, steps: int) -> "PagedKVCache":
        """The cache after a call: new pools, each row's length past its new tokens."""
        return self.replace(keys=tuple(keys), values=tuple(values), lengths=self.ends,
                            new_positions=None, new_segments=None)


def grow_pools(cache: PagedKVCache, pages: int, shards: int = 1) -> PagedKVCache:
    """``cache`` with every data shard's pool (``shards`` equal blocks of the page axis)
    extended to ``pages`` pages, zeros after the old ones: the held pages keep their ids."""
    axis = 0 if cache.stacks is None else 1

    def one(x):
        split = x.reshape(*x.shape[:axis], shards, -1, *x.shape[axis + 1:])
        pad = [(0, 0)] * split.ndim
        pad[axis + 1] = (0, pages - split.shape[axis + 1])
        grown = jnp.pad(split, pad)
        return grown.reshape(*x.shape[:axis], -1, *x.shape[axis + 1:])

    return cache.replace(keys=tuple(map(one, cache.keys)), values=tuple(map(one, cache.values)))


def copy_pages(cache: PagedKVCache, source: Int[Array, " n"], target: Int[Array, " n"]
               ) -> PagedKVCache:
    """Every pool with pages ``source`` copied onto pages ``target`` (copy on write of a shared
    sequence's last page; pairs with source == target change nothing)."""
    axis = 0 if cache.stacks is None else 1

    def one(x):
        taken = jnp.take(x, source, axis=axis)
        idx = (slice(None),) * axis + (target,)
        return x.at[idx].set(taken)

    return cache.replace(keys=tuple(map(one, cache.keys)), values=tuple(map(one, cache.values)))


def per_device(fn: Callable, sharding: AttentionSharding | None, cache: PagedKVCache, kv: tuple,
               args: tuple, specs: tuple, out_specs, heads: str | None = None):
    """``fn(cache, kv, *args)`` with ``kv`` one layer's pools, run on each device's rows and
    pages (module docstring): ``specs`` / ``out_specs`` are the ``shard_map`` specs of ``args``
    and of the result (``rows_spec`` gives a row-major one), the pools split their pages over
    the batch axes and GQA's KV heads over ``heads``. Without a mesh (``sharding`` None) it is
    ``fn`` itself."""
    if sharding is None:
        return fn(cache, kv, *args)

    def local(table, lengths, positions, segments, kv, *args):
        return fn(cache.replace(keys=(), values=(), table=table, lengths=lengths,
                                new_positions=positions, new_segments=segments), kv, *args)

    row = rows_spec(sharding, 2)
    in_specs = (row, rows_spec(sharding, 1), row, row, pool_specs(sharding, kv, heads), *specs)
    return jax.shard_map(local, mesh=sharding.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)(cache.table, cache.lengths, cache.new_positions,
                                          cache.new_segments, kv, *args)


def pool_specs(sharding: AttentionSharding, kv: tuple, heads: str | None = None) -> tuple:
    """``per_device``'s specs of one layer's pools ``kv`` (to return them from ``fn``): pages
    over the batch axes, GQA's KV heads (``[P, kv, ...]``) over ``heads``."""
    rows = sharding.batch or None
    return tuple(PartitionSpec(rows, heads if x.ndim == 4 else None, *[None] * (x.ndim - 2))
                 for x in kv)


def rows_spec(sharding: AttentionSharding, ndim: int, heads: tuple[int, str | None] = (0, None)
              ) -> PartitionSpec:
    """A ``shard_map`` spec of a row-major array of ``ndim`` axes: rows over the batch axes,
    axis ``heads[0]`` over ``heads[1]``."""
    axes = [sharding.batch or None] + [None] * (ndim - 1)
    if heads[1] is not None:
        axes[heads[0]] = heads[1]
    return PartitionSpec(*axes)
