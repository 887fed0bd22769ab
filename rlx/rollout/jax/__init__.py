"""The built-in JAX rollout engine: the learner's own model code and kernels sampling from the
learner's own arrays (``engine``: ``JaxEngine``; ``config``: ``config.rollout.jax``).

Continuous batching over a paged KV cache (``paged``: what the engine runs): the compiled slot
programs (``continuous``), the host's turn loop (``scheduler``) and page bookkeeping (``pages``).
Lockstep batching (meshes, routing replay, MoE capacity, and ``batching="lockstep"``): request
bucketing (``batching``), the compiled prefill / decode loop (``sampling``) and the KV prefix
cache of multi-turn episodes (``prefix_cache``). Both use the token sampler (``sampler``: greedy,
temperature, top-k, top-p, min-p), stop strings matched on the device (``stops``) and the
engine copy's weight layout (``decode_layout``).
"""

from __future__ import annotations

from flax import nnx

from rlx.rollout.jax.engine import JaxEngine


def build(request) -> JaxEngine:
    """The built-in engine on the learner's own frozen arrays (no update donates them): LoRA mode
    holds its base once. A synchronous run shares the trainable variables too: the loop generates
    only after the sync that follows each update (which hands the engine the update's new
    arrays), so nothing samples from what an update donates; an asynchronous run samples while
    the learner updates, so its engine copies them (``request.copy_trainables``)."""
    return JaxEngine(request.model, tokenizer=request.tokenizer, mesh=request.mesh,
                     seed=request.seed, weight_layout=request.weight_layout,
                     copy_weights=request.copy_trainables, shared=nnx.Not(request.trainable),
                     record_routes=request.record_routes, capacity_factor=request.capacity_factor,
                     settings=request.jax, rules=request.rules)


__all__ = ["JaxEngine", "build"]
