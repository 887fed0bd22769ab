"""Key/value cache for incremental decoding with the learner's own ``Transformer``.

``KVCache`` holds, per layer, two buffers, ``keys`` (slots minor: the slot axis last) and
``values`` (slots major: the slot axis second to last), plus the position and segment id of every
slot ``[B, S]`` (segment 0 = empty or padding, never attended to):

* a GQA layer: the rotated keys ``[B, KV, D, S]`` and the values ``[B, KV, S, D]``, KV-head major,
  so attention reads each head's slots contiguously, with no transposed copy of the whole cache per
  decode step. Keys are held with the slots minor so that a decode step's query-key product runs
  along the slots like its probability-value product, which XLA:CPU computes faster than the same
  product over ``[S, D]`` keys; a prefill's is the same either way.
* a multi-head latent attention layer (``rlx.models.mla``): what DeepSeek's inference caches, the
  rotated key shared by all heads ``[B, R, S]`` (``qk_rope_head_dim`` wide) as its ``keys`` and the
  normalised latent ``[B, S, C]`` (``kv_lora_rank`` wide) as its ``values``: ``C + R`` numbers per
  token and layer instead of every head's key and value. There is no head axis. A decode step
  reads the latent twice, as the values (``probs @ latent``) and, with ``kv_b_proj``'s key block
  folded into the query, as the keys (``q_latent @ latent^T``); slots major serves the first
  product as a value cache is served, and XLA:CPU ran the pair no slower than over ``[B, C, S]``.

A scanned model (``rlx.models.stack``) keeps one buffer per stack of layers, ``[n, b, ...]`` with
the stack's layer axis first (``stacks`` records the counts), which its decode scans over with
the layer's variables; one whose decode unstacks its layers (the engine on XLA:CPU,
``rlx.models.stack.decode_model``) keeps one buffer per layer, as an unrolled model does.

A gated DeltaNet layer (``rlx.models.deltanet``, Qwen3-Next's linear attention) holds no slots:
its ``keys`` buffer is the convolution's state, each row's last ``conv_kernel - 1`` inputs
``[B, K - 1, C]``, and its ``values`` buffer the recurrent state ``[B, HV, DK, DV]`` (f32), both
carried per row from call to call (``linear`` marks these buffers; ``grow`` leaves them).

All rows write at the same slot ``index``; rows differ only in their positions, so left-padded
prompts of different lengths decode exactly: a row's padding slots carry segment 0 and its tokens
carry their own positions (rotary embedding and causality use positions, not slots).

``Transformer.decode(ids [B, T], positions, segment_ids, cache)`` runs the same ``Attention``,
``Block`` and MLP/MoE modules as the training forward pass; the only difference is that keys and
values (or latents) are written into the cache (``store``: at ``index .. index + T``) and queries
attend to the whole cache (``view``) under the usual position/segment mask
(``rlx.kernels.attention``). ``rlx.models.paged_kv.PagedKVCache`` keeps the same interface over
pages.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float, Int

from rlx.models.hparams import ModelConfig
from rlx.models.mixed import is_low_precision
from rlx.platform.policy import PlatformPolicy, current


@struct.dataclass
class KVCache:
    """Keys/values per layer and per-slot positions/segments; a pytree (a ``while_loop`` carry)."""

    keys: tuple[Float[Array, "... s"], ...]  # slots minor: GQA [b, kv, d, s], MLA [b, r, s]
    values: tuple[Float[Array, "... s d"], ...]  # slots major: GQA [b, kv, s, d], MLA [b, s, c]
    positions: Int[Array, "b s"]  # position of the token held in each slot
    segment_ids: Int[Array, "b s"]  # 0: empty slot or padding
    index: Int[Array, ""]  # next slot to write, shared by all rows
    # layers per buffer: None, one buffer per layer; else one [n, ...] buffer per stack of n layers
    stacks: tuple[int, ...] | None = struct.field(pytree_node=False, default=None)
    # per buffer: True for a gated DeltaNet layer's states (no slots); () when there are none
    linear: tuple[bool, ...] = struct.field(pytree_node=False, default=())

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, length: int, dtype,
              stacks: tuple[int, ...] | None = None) -> "KVCache":
        """An empty cache of ``length`` slots for ``batch`` rows of a decode in compute ``dtype``;
        buffers in ``cache_dtype(dtype)`` (f32 for a 16-bit float on a CPU), shaped by
        ``layer_shapes``; with ``stacks`` (a scanned model's layers per stack,
        ``rlx.models.stack.layer_counts``) each stack's buffers stacked on a leading axis."""
        dtype = cache_dtype(dtype)
        counts = [1] * cfg.num_layers if stacks is None else list(stacks)
        firsts = [sum(counts[:i]) for i in range(len(counts))]
        linear = tuple(cfg.is_linear_layer(i) for i in firsts)
        keys, values = [], []
        for n, lin in zip(counts, linear):
            lead = () if stacks is None else (n,)
            (key_shape, value_shape) = (recurrent_shapes(cfg, batch) if lin
                                        else layer_shapes(cfg, batch, length))
            keys.append(jnp.zeros(lead + key_shape, dtype))
            values.append(jnp.zeros(lead + value_shape, jnp.float32 if lin else dtype))
        slots = jnp.zeros((batch, length), jnp.int32)
        return cls(tuple(keys), tuple(values), slots, slots, jnp.zeros((), jnp.int32), stacks,
                   linear if any(linear) else ())

    def is_linear(self, unit: int) -> bool:
        """Buffer ``unit`` holds a gated DeltaNet layer's states, not keys and values."""
        return bool(self.linear) and self.linear[unit]

    def previous_segments(self) -> Int[Array, " b"]:
        """Each row's segment id in the slot before ``index`` (-1 at slot 0): a gated DeltaNet
        layer's state continues across a call only within one segment."""
        prev = jax.lax.dynamic_index_in_dim(self.segment_ids, jnp.maximum(self.index - 1, 0),
                                            axis=1, keepdims=False)
        return jnp.where(self.index > 0, prev, -1)

    @property
    def length(self) -> int:
        return self.positions.shape[1]

    def record(self, positions: Int[Array, "b t"], segment_ids: Int[Array, "b t"]) -> "KVCache":
        """Write the positions and segment ids of ``t`` new tokens at ``index`` (index
        unchanged)."""
        pos = jax.lax.dynamic_update_slice_in_dim(self.positions, positions.astype(jnp.int32),
                                                  self.index, axis=1)
        seg = jax.lax.dynamic_update_slice_in_dim(self.segment_ids, segment_ids.astype(jnp.int32),
                                                  self.index, axis=1)
        return self.replace(positions=pos, segment_ids=seg)

    def grow(self, length: int) -> "KVCache":
        """The same cache with empty slots (segment 0) appended up to ``length`` slots."""
        extra = length - self.length
        if extra < 0:
            raise ValueError(f"cannot grow a cache of {self.length} slots to {length}")

        def pad(x, slot_axis: int):  # zeros after the last slot
            widths = [(0, 0)] * x.ndim
            widths[slot_axis] = (0, extra)
            return jnp.pad(x, widths)

        slots = ((0, 0), (0, extra))
        keep = [self.is_linear(i) for i in range(len(self.keys))]  # states: no slots to add
        return self.replace(keys=tuple(k if s else pad(k, -1) for k, s in zip(self.keys, keep)),
                            values=tuple(v if s else pad(v, -2) for v, s in zip(self.values, keep)),
                            positions=jnp.pad(self.positions, slots),
                            segment_ids=jnp.pad(self.segment_ids, slots))

    def take_rows(self, rows: Int[Array, " n"]) -> "KVCache":
        """The cache of rows ``rows`` (repeats allowed: samples of one prompt share its prefill)."""
        take = lambda x, axis=0: jnp.take(x, rows, axis=axis)  # noqa: E731
        layer = functools.partial(take, axis=0 if self.stacks is None else 1)
        return self.replace(keys=tuple(map(layer, self.keys)),
                            values=tuple(map(layer, self.values)),
                            positions=take(self.positions), segment_ids=take(self.segment_ids))

    def store(self, kv: tuple, new: tuple) -> tuple:
        """One layer's (keys, values) buffers with ``new`` (keys, values) written at ``index``,
        in the projections' layout (``write_slots``)."""
        return (write_slots(kv[0], new[0], self.index, keys=True),
                write_slots(kv[1], new[1], self.index, keys=False))

    def view(self, kv: tuple) -> tuple:
        """One layer's buffers as attention reads them: as they are (a paged cache gathers its
        pages into this layout, ``rlx.models.paged_kv``)."""
        return kv

    def advance(self, keys, values, steps: int) -> "KVCache":
        """The cache after a call that wrote ``steps`` tokens into every layer."""
        return self.replace(keys=tuple(keys), values=tuple(values), index=self.index + steps)


def cache_dtype(dtype, policy: PlatformPolicy | None = None) -> jnp.dtype:
    """Element type of the keys/values a decode in compute ``dtype`` caches: f32 for a 16-bit
    float compute dtype where the platform's ``policy`` widens the cache (``wide_kv_cache``:
    XLA:CPU), ``dtype`` elsewhere (``policy``: by default ``rlx.platform.current()``).

    XLA:CPU evaluates a bf16 / f16 ``dynamic_update_slice`` in f32: writing one slot converted the
    whole cache to f32 and back, a copy of every layer's keys and values per decode step (a large
    share of a bf16 generation's time). An f32 cache is written in place;
    it holds the compute dtype's values exactly (attention reads them as such, see
    ``rlx.kernels.attention``), at twice the bytes."""
    wide = (policy or current()).wide_kv_cache
    return jnp.dtype(jnp.float32) if wide and is_low_precision(dtype) else jnp.dtype(dtype)


def layer_shapes(cfg: ModelConfig, batch: int, length: int) -> tuple[tuple[int, ...], ...]:
    """Shapes of one layer's (keys, values) buffers: GQA ``[b, kv, head_dim, s]`` and ``[b, kv, s,
    value_head_dim]``; MLA (``cfg.mla``) the shared rotary key ``[b, qk_rope_head_dim, s]`` and
    the latent ``[b, s, kv_lora_rank]`` (DSA: and the indexer's key, ``latent_cache_width``)."""
    if cfg.mla is not None:
        return (batch, cfg.mla.qk_rope_head_dim, length), (batch, length, cfg.latent_cache_width)
    kv = cfg.num_kv_heads
    return (batch, kv, cfg.head_dim, length), (batch, kv, length, cfg.value_head_dim)


def recurrent_shapes(cfg: ModelConfig, batch: int) -> tuple[tuple[int, ...], ...]:
    """Shapes of a gated DeltaNet layer's (convolution, recurrent) states: ``[b, conv_kernel - 1,
    conv channels]`` and ``[b, value heads, key_head_dim, value_head_dim]``."""
    la = cfg.linear_attention
    return ((batch, la.conv_kernel - 1, la.conv_dim),
            (batch, la.num_value_heads, la.key_head_dim, la.value_head_dim))


def write_slots(cache: Float[Array, "b ..."], new: Float[Array, "b t ..."],
                index: Int[Array, ""], *, keys: bool) -> Float[Array, "b ..."]:
    """Store ``new`` (in the projections' layout, tokens on axis 1: GQA ``[b, t, kv, d]``, MLA
    ``[b, t, r]`` / ``[b, t, c]``) at slots ``index .. index + t`` of one layer's keys
    (``keys=True``: slots last, ``[b, kv, d, s]`` / ``[b, r, s]``) or values (slots second to
    last, ``[b, kv, s, d]`` / ``[b, s, c]``)."""
    axis = cache.ndim - 1 if keys else cache.ndim - 2
    new = jnp.moveaxis(new, 1, axis).astype(cache.dtype)  # [b, kv, d, t], [b, kv, t, d], ...
    return jax.lax.dynamic_update_slice_in_dim(cache, new, index, axis=axis)
