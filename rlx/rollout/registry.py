"""One registry of rollout backends: ``config.rollout.engine`` names one of ``ENGINES``, and
``make_engine`` builds it from an ``EngineRequest``.

A backend is a sub-package of ``rlx.rollout`` (``jax/``: the built-in engine; ``sglang/``: SGLang
servers) whose ``build(request)`` returns a ``rlx.types.RolloutEngine``. Adding a backend (a vLLM
one, say) is that sub-package and its line in ``BACKENDS``; the run config's choice list and
``rlx.run.engines`` both read this table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from flax import nnx
from jax.sharding import Mesh

from rlx.mesh import SAMPLE_RULES, LogicalRules
from rlx.rollout import jax as jax_backend
from rlx.rollout import sglang as sglang_backend
from rlx.rollout.jax.config import JaxSection
from rlx.rollout.serving import Serving
from rlx.types import RolloutEngine


@dataclasses.dataclass(frozen=True)
class EngineRequest:
    """What a run hands a backend's ``build``: the learner's policy and the settings that concern
    rollouts, each derived once from the run config (``rlx.run.engines.engine_request``)."""

    model: nnx.Module  # the learner's policy: the built-in engine samples from its arrays
    tokenizer: Any  # rlx.models.tokenizer.Tokenizer (stop ids, decoding)
    mesh: Mesh  # the learner's mesh
    seed: int  # sampling seed (samples are keyed by seed, prompt uid and sample index)
    weight_layout: str  # config.rollout.weight_layout (built-in engine)
    trainable: Any  # nnx filter of the trainable variables; everything else is shared, never copied
    copy_trainables: bool  # an asynchronous run samples while the learner updates: copy them
    record_routes: bool  # record MoE routing for replay (config.train.router_replay)
    capacity_factor: float | None  # MoE token-dispatch capacity (config.model.capacity_factor)
    serving: Serving  # what server backends export and serve
    jax: JaxSection = JaxSection()  # config.rollout.jax: the built-in engine's batching
    rules: LogicalRules = SAMPLE_RULES  # the built-in engine's sharding rules on ``mesh``


Builder = Callable[[EngineRequest], RolloutEngine]
# config.rollout.engine -> backend constructor
BACKENDS: dict[str, Builder] = {"jax": jax_backend.build, "sglang": sglang_backend.build}
ENGINES = tuple(BACKENDS)


def make_engine(request: EngineRequest, engine: str) -> RolloutEngine:
    """The backend ``engine`` (one of ``ENGINES``) serving ``request.model``."""
    return BACKENDS[engine](request)


__all__ = ["BACKENDS", "ENGINES", "EngineRequest", "make_engine"]
