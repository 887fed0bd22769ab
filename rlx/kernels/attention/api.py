"""``attend``: the one attention entry point of the decoder's layers (the learner's forward and
backward, the engine's prefill, scoring and decode), and the choice of kernel behind it.

The platform policy (``rlx.platform.policy``) chooses: a call over at most
``dense_attention_slots`` key slots, or one query per row over a cache (a decode step, whose
scores are one row), materialises its scores (``dense``); a sequence over itself runs the
platform's Pallas kernel where ``attention_kernel`` names one that computes the call
(``splash`` on TPU); everything else runs ``blockwise`` in plain XLA with blocks of
``attention_block`` tokens. All compute the same function of the same inputs: the mask is given
as per-token segment ids and positions (``rlx.kernels.attention.blockwise``'s docstring), never as
a ``[t, s]`` tensor. Under context parallelism (a mesh whose ``context`` axis splits the tokens,
``AttentionSharding.context``) each device runs one of these on its queries over the gathered
keys (``rlx.kernels.attention.context``). Over a paged KV cache the layers call
``rlx.kernels.attention.paged`` instead, which reads the cache's pages in place.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from rlx.kernels.attention import context, splash
from rlx.kernels.attention.blockwise import blockwise_attention
from rlx.kernels.attention.dense import attention_mask, causal_attention, gqa_attention
from rlx.kernels.attention.local import in_window
from rlx.mesh import LogicalRules, batch_axes, logical_to_spec
from rlx.platform.policy import PlatformPolicy, current


@dataclasses.dataclass(frozen=True)
class AttentionSharding:
    """Where a kernel that XLA cannot partition runs: each device its ``batch`` rows and its
    share of the KV heads over ``heads`` (None: every device all heads); with ``context``, the
    mesh axis that splits each row's tokens (context parallelism), its share of the queries."""

    mesh: Mesh
    batch: tuple[str, ...]
    heads: str | None
    context: str | None = None

    @classmethod
    def of(cls, mesh: Mesh | None, rules: LogicalRules) -> "AttentionSharding | None":
        """The layout of activations on ``mesh`` under ``rules``; None for no mesh or one
        device."""
        if mesh is None or mesh.size == 1:
            return None
        rows = tuple(a for a in batch_axes(rules) if mesh.shape[a] > 1)
        heads = logical_to_spec(("kv_heads",), rules, mesh)[0]
        seq = logical_to_spec(("seq",), rules, mesh)[0]
        return cls(mesh, rows, heads if isinstance(heads, str) else None,
                   seq if isinstance(seq, str) else None)

    @property
    def context_shards(self) -> int:
        """Devices each row's tokens are split over (1: no context parallelism)."""
        return self.mesh.shape[self.context] if self.context else 1

    def heads_for(self, kv_heads: int) -> str | None:
        """The mesh axis a kernel's ``kv_heads`` KV heads (and their query groups) split over
        inside a ``shard_map``: ``heads`` where it divides them, else None (whole)."""
        if self.heads is None or kv_heads % self.mesh.shape[self.heads]:
            return None
        return self.heads

    def map_rows_heads(self, fn, kv_heads: int):
        """``fn(q [b, kv, ...], k [b, kv, ...], v [b, kv, ...], segments [b, t])`` run per
        device on its rows and KV heads."""
        specs = splash.rows_heads_specs(self.batch, self.heads_for(kv_heads))
        return jax.shard_map(fn, mesh=self.mesh, in_specs=specs, out_specs=specs[0],
                             check_vma=False)


def attend(
    q: Float[Array, "b t h d"], k: Float[Array, "b s kv d"], v: Float[Array, "b s kv dv"],
    q_segments: Int[Array, "b t"], kv_segments: Int[Array, "b s"],
    q_positions: Int[Array, "b t"], kv_positions: Int[Array, "b s"], *,
    scale: float | None = None, causal_columns: bool = False, window: int | None = None,
    sinks: Float[Array, " h"] | None = None, kv_major: bool = False,
    sharding: AttentionSharding | None = None, policy: PlatformPolicy | None = None,
) -> Float[Array, "b t h dv"]:
    """Softmax attention of ``q`` over ``k``/``v``: a query attends a key of its own non-zero
    segment at a position not after its own; ``causal_columns`` (a sequence over itself) also
    requires an earlier or equal column, ``window`` fewer than ``window`` positions back.
    ``sinks``: per-head logits of attention sinks. ``scale`` multiplies the scores (default
    ``1 / sqrt(d)``). ``kv_major``: keys ``[b, kv, d, s]``, values ``[b, kv, s, dv]`` (the KV
    cache's layouts). ``policy``: by default ``rlx.platform.current()``. A ``sharding`` with a
    ``context`` axis: the queries' tokens are split over it (in any order; the mask comes from
    positions), the keys gathered (``rlx.kernels.attention.context``)."""
    policy = policy or current()
    if sharding is not None and sharding.context is not None:
        local = lambda *a: attend(*a[:7], scale=scale, window=window, sinks=a[7],  # noqa: E731
                                  kv_major=kv_major, policy=policy)
        return context.attend_gathered(sharding, local, q, k, v, q_segments, kv_segments,
                                       q_positions, kv_positions, sinks, kv_major)
    t = q.shape[1]
    s = k.shape[-1] if kv_major else k.shape[1]
    if s <= policy.dense_attention_slots or (t == 1 and kv_major):
        return _dense(q, k, v, q_segments, kv_segments, q_positions, kv_positions, scale,
                      causal_columns, window, sinks, kv_major)
    if (policy.attention_kernel == "splash"
            and splash.supported(causal_columns, sinks, kv_major, t, s)):
        return splash.splash_attention(q, k, v, q_segments, scale=scale, window=window,
                                       block=policy.attention_block, sharding=sharding,
                                       interpret=policy.pallas_interpret)
    return blockwise_attention(
        q, k, v, q_segments, kv_segments, q_positions, kv_positions, scale=scale,
        causal_columns=causal_columns, window=window, sinks=sinks, kv_major=kv_major,
        block_q=policy.attention_block, block_k=policy.attention_block)


def _dense(q, k, v, q_segments, kv_segments, q_positions, kv_positions, scale, causal_columns,
           window, sinks, kv_major):
    mask = attention_mask(q_segments, kv_segments, q_positions, kv_positions)
    mask &= in_window(q_positions[:, :, None], kv_positions[:, None, :], window)
    if causal_columns and not kv_major:
        return causal_attention(q, k, v, mask, scale=scale, sinks=sinks)
    return gqa_attention(q, k, v, mask, kv_major=kv_major, scale=scale, sinks=sinks)
