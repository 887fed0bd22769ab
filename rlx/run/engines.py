"""The rollout engine a run config names (``config.rollout.engine``), serving the learner's policy.

The names and constructors are ``rlx.rollout.registry``'s (``ENGINES``, ``BACKENDS``); this module
derives their ``EngineRequest`` from the run config once. ``serving(cfg)`` is what a run asks
servers to serve (checked before build by ``rlx.run.checks``).
"""

from __future__ import annotations

from jax.sharding import Mesh

from rlx.config import RunConfig
from rlx.learner.state import MODES
from rlx.learner.step import Compiled
from rlx.mesh import sampling_rules
from rlx.models.tokenizer import Tokenizer
from rlx.quant.loading import resolve_quant
from rlx.rollout.registry import EngineRequest, make_engine as build_engine
from rlx.rollout.serving import Serving
from rlx.types import RolloutEngine


def serving(cfg: RunConfig) -> Serving:
    """What servers serve for this run (``rollout.engine="sglang"``); ``quant.format="shipped"``
    serves the checkpoint's own layout (``rlx.quant.resolve_quant``)."""
    return Serving(sglang=cfg.rollout.sglang, model=cfg.model,
                   quant=resolve_quant(cfg.quant, cfg.model).quant,
                   lora=cfg.lora if cfg.train.mode == "lora" else None, output_dir=cfg.output_dir)


def engine_request(cfg: RunConfig, compiled: Compiled, tokenizer: Tokenizer, mesh: Mesh) -> EngineRequest:
    """What every backend is handed, derived once from ``cfg``."""
    return EngineRequest(model=compiled.model(), tokenizer=tokenizer, mesh=mesh, seed=cfg.seed,
                         weight_layout=cfg.rollout.weight_layout, trainable=MODES[cfg.train.mode],
                         copy_trainables=cfg.engine_copies_trainables,
                         record_routes=cfg.train.router_replay,
                         capacity_factor=cfg.model.capacity_factor, serving=serving(cfg),
                         jax=cfg.rollout.jax, rules=sampling_rules(cfg.train.mode,
                                                                  cfg.engine_copies_trainables))


def make_engine(cfg: RunConfig, compiled: Compiled, tokenizer: Tokenizer, mesh: Mesh) -> RolloutEngine:
    """The rollout engine ``config.rollout.engine`` names, serving the learner's current policy."""
    return build_engine(engine_request(cfg, compiled, tokenizer, mesh), cfg.rollout.engine)


__all__ = ["engine_request", "make_engine", "serving"]
