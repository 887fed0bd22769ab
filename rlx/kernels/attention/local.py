"""The two masks of local-attention layers, each defined once for every attention path (dense,
blockwise, paged, context-parallel): sliding windows and attention sinks (gpt-oss).

* A sliding window of ``w`` keeps the keys fewer than ``w`` positions before the query
  (``q_position - k_position < w``, transformers' sliding-window mask: the query and the
  ``w - 1`` keys before it). Positions, not columns, decide, so padded, packed and cached
  sequences see the same keys as alone (``in_window``).
* An attention sink is a learned per-head logit ``s_h`` that joins every query's softmax as a
  virtual key whose value is zero: ``p_j = exp(x_j) / (exp(s_h) + sum_i exp(x_i))``. The
  weights then sum to less than one, and a query that sees no key returns zeros. An online
  softmax starts from the sink (running maximum ``s_h``, normaliser 1: ``sink_start``); a
  dense one adds it to the denominator (``sink_softmax``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def in_window(q_positions: Int[Array, "..."], kv_positions: Int[Array, "..."],
              window: int | None) -> Bool[Array, "..."] | bool:
    """Whether each (query, key) pair of the broadcast positions lies within ``window`` (True
    everywhere for None: a full-attention layer)."""
    if window is None:
        return True
    return q_positions - kv_positions < window


def head_sinks(sinks: Float[Array, " h"], kv: int) -> Float[Array, "kv g"]:
    """Per-head sink logits in f32 as ``[kv, g]``: a KV head's ``g`` query heads (head
    ``k * g + i`` is row ``k``, column ``i``, as the grouped kernels order them)."""
    return sinks.astype(jnp.float32).reshape(kv, -1)


def sink_start(sinks: Float[Array, "..."], shape: tuple[int, ...]
               ) -> tuple[Float[Array, "..."], Float[Array, "..."]]:
    """An online softmax's (running maximum, normaliser) before any key: the sink's logit and
    ``exp(0) = 1``, broadcast to ``shape``."""
    return (jnp.broadcast_to(sinks, shape).astype(jnp.float32),
            jnp.ones(shape, jnp.float32))


def sink_softmax(scores: Float[Array, "... s"], sinks: Float[Array, "..."] | None
                 ) -> Float[Array, "... s"]:
    """``softmax(scores)`` over the last axis with the sinks' logits (broadcast to
    ``scores.shape[:-1]``) in the denominator; plain softmax for None. f32."""
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1)
    scores = scores.astype(jnp.float32)
    sink = jnp.broadcast_to(sinks, scores.shape[:-1])[..., None]
    top = jax.lax.stop_gradient(jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink))
    p = jnp.exp(scores - top)
    return p / (jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(sink - top))
