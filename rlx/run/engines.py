"""The rollout engine a run config names (``config.rollout.engine``), serving the learner's policy.

The names are ``rlx.rollout.config.ENGINES``; ``ENGINE_BUILDERS`` holds one constructor per name.
``serving(cfg)`` is what a run asks SGLang to serve (checked before build by ``rlx.run.checks``).
"""

from __future__ import annotations

from flax import nnx
from jax.sharding import Mesh

from rlx.config import RunConfig
from rlx.learner.state import MODES
from rlx.learner.step import Compiled
from rlx.models.tokenizer import Tokenizer
from rlx.quant.loading import resolve_quant
from rlx.rollout.jax_engine import JaxEngine
from rlx.rollout.sglang_policy import Serving, SGLangPolicy
from rlx.types import RolloutEngine


def serving(cfg: RunConfig) -> Serving:
    """What SGLang serves for this run (``rollout.engine="sglang"``); ``quant.format="shipped"``
    serves the checkpoint's own layout (``rlx.quant.resolve_quant``)."""
    return Serving(sglang=cfg.rollout.sglang, model=cfg.model,
                   quant=resolve_quant(cfg.quant, cfg.model).quant,
                   lora=cfg.lora if cfg.train.mode == "lora" else None, output_dir=cfg.output_dir)


def _sglang_engine(cfg: RunConfig, compiled: Compiled, tokenizer: Tokenizer, mesh: Mesh):
    return SGLangPolicy(serving(cfg), compiled.model())  # exports, launches or attaches servers


def _jax_engine(cfg: RunConfig, compiled: Compiled, tokenizer: Tokenizer, mesh: Mesh):
    """The built-in engine on the learner's own frozen arrays (no update donates them): LoRA mode
    holds its base once. A synchronous run (``train.max_staleness = 0``) shares the trainable
    variables too: the loop generates only after the sync that follows each update (which hands
    the engine the update's new arrays), so nothing samples from what an update donates; an
    asynchronous run samples while the learner updates, so its engine copies them."""
    return JaxEngine(compiled.model(), tokenizer=tokenizer, mesh=mesh, seed=cfg.seed,
                     weight_layout=cfg.rollout.weight_layout,
                     copy_weights=cfg.train.max_staleness > 0,
                     shared=nnx.Not(MODES[cfg.train.mode]),
                     record_routes=cfg.train.router_replay,
                     capacity_factor=cfg.model.capacity_factor)


# config.rollout.engine -> constructor; the names are rlx.rollout.config.ENGINES
ENGINE_BUILDERS = {"jax": _jax_engine, "sglang": _sglang_engine}


def make_engine(cfg: RunConfig, compiled: Compiled, tokenizer: Tokenizer, mesh: Mesh) -> RolloutEngine:
    """The rollout engine ``config.rollout.engine`` names, serving the learner's current policy."""
    return ENGINE_BUILDERS[cfg.rollout.engine](cfg, compiled, tokenizer, mesh)


__all__ = ["ENGINE_BUILDERS", "make_engine", "serving"]
