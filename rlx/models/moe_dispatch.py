"""Expert parallelism by token dispatch: tokens travel to the devices that hold their experts.

With the ``expert`` mesh axis of size ``P > 1``, each device holds ``E / P`` experts (the leading
``expert`` dimension of every expert weight, quantized leaves and per-expert LoRA included) and the
tokens of its batch shard. Inside ``jax.shard_map``, per device (GShard / Switch style):

1. every (token, slot) pair of the router's top-k goes to device ``expert // (E / P)`` of the
   device's expert group: pairs are given a row in a ``[P, C, d]`` send buffer, ``C`` rows for
   each destination, and one ``all_to_all`` over the ``expert`` axis exchanges the buffers (the
   pairs' local expert ids travel beside them in a second, integer one);
2. the received rows are sorted by local expert and run through the experts as grouped
   ``jax.lax.ragged_dot`` products (``Experts.grouped``), rows of unused buffer slots last and
   outside every group;
3. a second ``all_to_all`` brings each row's output back to the device of its token, where it is
   weighted by its gate and summed over the token's k slots.

Capacity. ``jax.lax.ragged_all_to_all`` would send exactly the rows routed, but XLA:CPU does not
implement it (jax 0.10.2: "HLO opcode ragged-all-to-all is not supported by XLA:CPU"), so the
exchange is a fixed-size ``all_to_all`` with ``C`` rows per (source, destination) pair:

- ``capacity_factor=None`` (the model's setting): **dropless**. ``C`` is the worst case,
  ``n_loc * min(k, E / P)`` (a token's k experts are distinct, so at most ``min(k, E / P)`` of
  them live on one device): every pair is computed and the result equals the one-device
  ``Experts.ragged`` path. Dropless is what RL needs by default: which pairs a capacity drops
  depends on the batch's make-up, which differs between the engine's decode steps and the
  learner's batches, so drops would add sampler/learner mismatch.
  The price is buffer rows: ``P * C`` per device against ``n_loc * k`` routed pairs, i.e.
  ``P * min(k, E / P) / k`` times the routed rows in the exchange and in the grouped products (at
  most the dense path's ``E / k``, equal to it when ``k >= E / P``).
- ``capacity_factor=c``: ``C = ceil(c * n_loc * k / P)`` (at most the worst case): ``c`` times the
  routed rows. Pairs beyond a destination's ``C`` rows are dropped (their output is zero, as in
  GShard / Switch) and counted: ``dispatch`` returns the number of dropped pairs with the output.

Rows that pad the token count to a multiple of the token shards are marked invalid and never sent.
Other mesh axes (``tensor``) see replicated tokens and whole experts inside the map: expert weights
enter it split over ``expert`` only (XLA gathers their ``fsdp`` / ``tensor`` shards, as a ZeRO-3
layer does).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, Float, Int

from rlx.mesh import LogicalRules, batch_axes, logical_to_spec


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """Where experts and tokens live: ``mesh``, its ``expert`` axis and the token axes (the
    context axis, then the batch axes: ``rlx.kernels.attention.context.ContextSplit``)."""

    mesh: Mesh
    expert_axis: str
    token_axes: tuple[str, ...]
    capacity_factor: float | None = None  # None: dropless (see the module docstring)

    @classmethod
    def of(cls, mesh: Mesh, rules: LogicalRules, capacity_factor: float | None = None
           ) -> "ExpertParallel | None":
        """The dispatch layout of ``mesh`` under ``rules``, or None when experts are not split."""
        spec = logical_to_spec(("expert",), rules, mesh)[0]
        if spec is None:
            return None
        if not isinstance(spec, str):
            raise ValueError(f"the logical 'expert' axis maps to several mesh axes {spec}; "
                             "token dispatch needs exactly one (the rules' ('expert', 'expert'))")
        tokens = tuple(a for a in batch_axes(rules) if mesh.shape[a] > 1)
        seq = logical_to_spec(("seq",), rules, mesh)[0]  # context parallelism: the layers'
        # rows are folded, split over the context axis first (rlx.kernels.attention.context)
        tokens = ((seq,) if isinstance(seq, str) else ()) + tokens
        if spec not in tokens:
            raise ValueError(f"mesh axis {spec!r} holds experts but not tokens: add it to the "
                             "rules' 'batch' axes so that each device dispatches its own tokens")
        return cls(mesh, spec, tokens, capacity_factor)

    @property
    def experts_split(self) -> int:
        return self.mesh.shape[self.expert_axis]

    @property
    def token_shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.token_axes)

    def capacity(self, n_loc: int, k: int, local_experts: int) -> int:
        """Rows per (source, destination) pair of the exchange (see the module docstring)."""
        return capacity(n_loc, k, local_experts, self.experts_split, self.capacity_factor)


def capacity(n_loc: int, k: int, local_experts: int, split: int,
             capacity_factor: float | None) -> int:
    """Rows per (source, destination) pair of the exchange for ``n_loc`` tokens of top-``k``
    routing over ``split`` devices of ``local_experts`` experts each: the worst case (dropless,
    ``capacity_factor`` None) or ``ceil(c * n_loc * k / split)``, at most the worst case."""
    worst = n_loc * min(k, local_experts)
    if capacity_factor is None:
        return worst
    return max(1, min(worst, math.ceil(capacity_factor * n_loc * k / split)))


def _spec(ep: ExpertParallel, var) -> PartitionSpec:
    axes = var.get_metadata().get("logical_axes") or ()
    return PartitionSpec(ep.expert_axis) if axes[:1] == ("expert",) else PartitionSpec()


def dispatch(experts: nnx.Module, ep: ExpertParallel, x: Float[Array, "n d"],
             idx: Int[Array, "n k"], gates: Float[Array, "n k"], adapter: bool = True
             ) -> tuple[Float[Array, "n d"], Int[Array, ""]]:
    """``Experts.ragged(x, idx, gates)`` with the experts split over ``ep``'s expert axis; returns
    (output, number of dropped (token, slot) pairs: 0 when dropless)."""
    n, d = x.shape
    pad = -n % ep.token_shards
    valid = jnp.arange(n + pad) < n  # [n + pad]
    x, idx, gates = (jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) for a in (x, idx, gates))
    graphdef, state = nnx.split(experts)
    is_var = lambda v: isinstance(v, nnx.Variable)  # noqa: E731
    state_specs = jax.tree.map(lambda v: _spec(ep, v), state, is_leaf=is_var)
    rows = PartitionSpec(ep.token_axes)

    def local(state, x, idx, gates, valid):
        return _local(nnx.merge(graphdef, state), ep, x, idx, gates, valid, adapter)

    out, dropped = jax.shard_map(
        local, mesh=ep.mesh, in_specs=(state_specs, rows, rows, rows, rows),
        out_specs=(rows, PartitionSpec()))(state, x, idx, gates, valid)
    return out[:n], dropped


def _local(experts, ep: ExpertParallel, x, idx, gates, valid, adapter: bool):
    """One device's part: send pairs to their experts' devices, run them, bring them back."""
    n_loc, k = idx.shape
    p = ep.experts_split
    e_loc = experts.num_local_experts()
    cap = ep.capacity(n_loc, k, e_loc)
    pair_valid = jnp.repeat(valid, k)  # [n_loc*k]
    flat = idx.reshape(-1)
    dest = jnp.where(pair_valid, flat // e_loc, p)  # device in the expert group; p = not sent
    slot = _rank_within(dest, p)  # [n_loc*k] row of the pair in its destination's buffer
    keep = pair_valid & (slot < cap)
    row = jnp.where(keep, dest * cap + slot, p * cap)  # p * cap: a trash row, cut off below
    pairs = n_loc * k
    src = jnp.full((p * cap + 1,), pairs, jnp.int32).at[row].set(jnp.arange(pairs))[:-1]
    send_x = permute_rows(jnp.repeat(x, k, axis=0), src, row)  # [p*cap, d]; empty rows 0
    send_e = jnp.full((p * cap + 1,), e_loc, jnp.int32).at[row].set(flat % e_loc)[:-1]
    recv_x = jax.lax.all_to_all(send_x, ep.expert_axis, 0, 0, tiled=True)  # [p*cap, d] by source
    recv_e = jax.lax.all_to_all(send_e, ep.expert_axis, 0, 0, tiled=True)  # e_loc = unused row
    y = _grouped(experts, recv_x, recv_e, e_loc, adapter)  # [p*cap, d]
    back = jax.lax.all_to_all(y, ep.expert_axis, 0, 0, tiled=True)  # [p*cap, d] by destination
    y_pairs = permute_rows(back, row, src)  # [n_loc*k, d]; dropped pairs 0
    y_pairs = y_pairs * gates.reshape(-1)[:, None].astype(y_pairs.dtype)
    out = jnp.sum(y_pairs.reshape(n_loc, k, -1), axis=1)  # a token's k pairs are adjacent
    dropped = jax.lax.psum(jnp.sum(pair_valid & ~keep, dtype=jnp.int32), ep.token_axes)
    return out, dropped


def _rank_within(dest: Int[Array, " m"], buckets: int) -> Int[Array, " m"]:
    """For each entry, how many earlier entries share its ``dest`` (stable order)."""
    order = jnp.argsort(dest, stable=True)
    counts = jnp.bincount(dest, length=buckets + 1)
    starts = jnp.cumsum(counts) - counts
    ranks_sorted = jnp.arange(dest.shape[0]) - starts[dest[order]]
    return jnp.zeros_like(dest).at[order].set(ranks_sorted)


def _grouped(experts, rows: Float[Array, "m d"], local_e: Int[Array, " m"], e_loc: int,
             adapter: bool) -> Float[Array, "m d"]:
    """The local experts on received rows (``local_e == e_loc``: an unused row, output 0)."""
    order = jnp.argsort(local_e, stable=True)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    group_sizes = jnp.bincount(local_e, length=e_loc).astype(jnp.int32)  # unused rows: no group
    y_sorted = experts.grouped(permute_rows(rows, order, inverse), group_sizes, adapter)
    y = permute_rows(y_sorted, inverse, order)
    return jnp.where((local_e < e_loc)[:, None], y, 0)


@jax.custom_vjp
def permute_rows(x: Float[Array, "n d"], take: Int[Array, " m"], put: Int[Array, " n"]
                 ) -> Float[Array, "m d"]:
    """Row ``take[i]`` of ``x`` for each ``i`` (``take[i] == n``: a zero row), where no row of
    ``x`` is taken twice and ``put`` is the inverse map (``put[j]``: the output row holding row
    ``j``, ``m`` where none does). Its gradient is the gather ``ct[put]``, not the scatter-add
    of the gather's own rule: XLA:TPU scatters bf16 rows as 32-bit words, a copy of the
    dispatch buffer at twice its size in the forward and the backward pass."""
    return _take_rows(x, take)


def _take_rows(x, take):
    return jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[take]


def _permute_fwd(x, take, put):
    return _take_rows(x, take), (take, put)


def _permute_bwd(res, ct):
    take, put = res
    return _take_rows(ct, put), None, None


permute_rows.defvjp(_permute_fwd, _permute_bwd)
