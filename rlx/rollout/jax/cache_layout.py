"""Where the built-in engine's KV caches lie on a mesh: the lockstep engine's dense caches and the
continuous engine's page pools."""

from __future__ import annotations

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlx.mesh import LogicalRules, named_sharding
from rlx.models.hparams import ModelConfig
from rlx.models.paged_kv import page_shapes


def cache_sharding(mesh: Mesh, cfg: ModelConfig, rules: LogicalRules, dp: int
                   ) -> tuple[NamedSharding, NamedSharding]:
    """Shardings of every layer's KV-cache keys and values (``rlx.models.kv_cache``): GQA keys
    ``[b, kv, d, s]`` and values ``[b, kv, s, d]`` over the batch and the KV heads; MLA's shared
    rotary keys ``[b, r, s]`` and latents ``[b, s, c]`` have no head axis and split over the
    batch. Under context parallelism the slots ``s`` split over the context devices as well: a
    decode step's one-row attention reduces over them where they lie, and a prefill or scored
    chunk gathers one layer's slots at a time (``rlx.kernels.attention.context``)."""
    c = mesh.shape.get("context", 1)
    if cfg.mla is not None:
        return (named_sharding(mesh, ("batch", None, "seq"), rules, (dp, 1, c)),
                named_sharding(mesh, ("batch", "seq", None), rules, (dp, c, 1)))
    kv = cfg.num_kv_heads
    return (named_sharding(mesh, ("batch", "kv_heads", None, "seq"), rules, (dp, kv, 1, c)),
            named_sharding(mesh, ("batch", "kv_heads", "seq", None), rules, (dp, kv, c, 1)))


def stacked(kv: tuple[NamedSharding, NamedSharding]) -> tuple[NamedSharding, NamedSharding]:
    """``cache_sharding``'s (keys, values) for a scanned model's stacked buffers: the layer
    axis first, whole."""
    return tuple(NamedSharding(x.mesh, PartitionSpec(None, *x.spec)) for x in kv)


def page_sharding(mesh: Mesh, cfg: ModelConfig, rules: LogicalRules, pages: int, page_size: int,
                  stacked_layers: bool = False) -> tuple[NamedSharding, NamedSharding]:
    """Shardings of every layer's page pools (``rlx.models.paged_kv``: GQA ``[P, kv, d, page]``
    / ``[P, kv, page, d]``, MLA ``[P, r, page]`` / ``[P, page, c]``): the pages over the batch
    axes, one pool per data shard (``pages`` of them all together), GQA's KV heads over the
    tensor axis where they divide; a scanned model's stacks have the layer axis first,
    whole."""
    shapes = page_shapes(cfg, pages, page_size)
    axes = ("batch", None, None) if cfg.mla is not None else ("batch", "kv_heads", None, None)
    out = tuple(named_sharding(mesh, axes, rules, shape) for shape in shapes)
    return stacked(out) if stacked_layers else out
