"""TPU attention through JAX's Pallas splash-attention kernels
(``jax.experimental.pallas.ops.tpu.splash_attention``), for a sequence over itself.

The kernel masks by column (causal, or a local window) and by segment id, which is rlx's mask for
self-attention: a row's segments are contiguous and positions run along each segment's columns,
so a key of the same segment at an earlier column is one at an earlier position. Padding (segment
0) never meets a real token; a padding query still sees itself, so no row of the kernel's mask is
empty. Grouped-query heads run as the kernel's multi-query form, mapped over the KV heads and the
rows. The kernel wants lane-aligned shapes: the sequence is padded to its block and the head
dimensions to a multiple of 128 (zero key/query dimensions add nothing to a score, zero value
dimensions are cut off the output); the scale is applied to the queries. Under a mesh, a
``shard_map`` gives each device its rows and KV heads (``AttentionSharding``), as the kernel is
opaque to XLA's partitioner.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int

LANES = 128


def supported(causal_columns: bool, sinks, kv_major: bool, t: int, s: int) -> bool:
    """Whether the kernel computes this call: a sequence over itself without sinks."""
    return causal_columns and sinks is None and not kv_major and t == s


def splash_attention(
    q: Float[Array, "b t h d"], k: Float[Array, "b t kv d"], v: Float[Array, "b t kv dv"],
    segments: Int[Array, "b t"], *, scale: float | None = None, window: int | None = None,
    block: int = 512, sharding=None, interpret: bool = False,
) -> Float[Array, "b t h dv"]:
    """Causal (or ``window``-local) self-attention under ``segments``; ``interpret`` runs the
    Pallas kernels in the interpreter (any backend, for tests)."""
    b, t, h, d = q.shape
    kv, dv = k.shape[2], v.shape[-1]
    g = h // kv
    size = min(block, -(-t // LANES) * LANES)
    tp, width = -(-t // size) * size, -(-max(d, dv) // LANES) * LANES
    scale = 1 / math.sqrt(d) if scale is None else scale

    def pad(x, dims):  # [b, t, heads, dim] -> [b, heads, tp, width]
        x = jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, width - dims)))
        return jnp.transpose(x, (0, 2, 1, 3))

    qh = pad(q * jnp.asarray(scale, q.dtype), d).reshape(b, kv, g, tp, width)
    kh, vh = pad(k.astype(q.dtype), d), pad(v.astype(q.dtype), dv)
    seg = jnp.pad(segments.astype(jnp.int32), ((0, 0), (0, tp - t)))
    kernel = functools.partial(_kernel, _make(tp, g, size, window, interpret))
    if sharding is not None:
        kernel = sharding.map_rows_heads(kernel, kv)
    out = kernel(qh, kh, vh, seg)  # [b, kv, g, tp, width]
    out = jnp.transpose(out.reshape(b, h, tp, width), (0, 2, 1, 3))
    return out[:, :t, :, :dv]


@functools.lru_cache(maxsize=64)
def _make(t: int, heads: int, block: int, window: int | None, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as sk, splash_attention_mask as sm)
    one = (sm.CausalMask((t, t)) if window is None
           else sm.LocalMask((t, t), window_size=(window - 1, 0), offset=0))
    sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                          block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                          block_q_dq=block, block_kv_dq=block)
    return sk.make_splash_mqa_single_device(sm.MultiHeadMask([one] * heads), block_sizes=sizes,
                                            interpret=interpret)


def _kernel(splash, q, k, v, seg):
    """The kernel over every row and KV head: q ``[b, kv, g, t, w]``, k/v ``[b, kv, t, w]``."""
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import SegmentIds

    one = lambda qq, kk, vv, ss: splash(qq, kk, vv, segment_ids=SegmentIds(ss, ss))  # noqa: E731
    return jax.vmap(jax.vmap(one, (0, 0, 0, None)), (0, 0, 0, 0))(q, k, v, seg)


def rows_heads_specs(batch, heads) -> tuple[PartitionSpec, ...]:
    """shard_map specs of ``_kernel``'s operands: rows over ``batch``, KV heads over ``heads``."""
    rows = tuple(batch) or None
    return (PartitionSpec(rows, heads), PartitionSpec(rows, heads), PartitionSpec(rows, heads),
            PartitionSpec(rows))
