"""The ``config.rollout`` section: how completions are sampled, by which engine (``ENGINES``), and
the SGLang servers (``config.rollout.sglang``) when that engine is SGLang."""

from __future__ import annotations

import dataclasses
import os

from rlx.errors import ConfigError, one_of
from rlx.rollout.decode_layout import LAYOUTS

# config.rollout.engine: the built-in JAX engine (rlx.rollout.jax_engine, the learner's own
# kernels) or SGLang servers (rlx.rollout.sglang_policy); rlx.run.build constructs each by name
ENGINES = ("jax", "sglang")


@dataclasses.dataclass(frozen=True)
class SGLangSection:
    """SGLang servers (``rollout.engine="sglang"``): attach to ``urls`` or launch ``num_servers``
    from ``python``. See ``rlx.rollout.sglang_policy`` for what is exported and synced."""

    urls: tuple[str, ...] = ()  # running servers to attach to; empty: launch them
    python: str = ""  # interpreter of the SGLang environment (it pins its own torch)
    num_servers: int = 1  # servers to launch when urls is empty
    tp_size: int = 1  # GPUs per launched server (--tp-size); server i starts at GPU i * tp_size
    extra_args: tuple[str, ...] = ()  # passed to sglang.launch_server (e.g. --mem-fraction-static)
    env: tuple[str, ...] = ()  # "NAME=value" entries added to the launched servers' environment
    startup_timeout_s: float = 900.0  # a launched server must answer /health within this
    request_timeout_s: float = 600.0  # per HTTP request (a whole completion)
    sync_base: bool = True  # attached servers: load rlx's exported base/weights at start

    def validate(self, engine: str) -> None:
        if self.num_servers < 1 or self.tp_size < 1:
            raise ConfigError("config.rollout.sglang.num_servers and tp_size must be >= 1")
        if self.startup_timeout_s <= 0 or self.request_timeout_s <= 0:
            raise ConfigError("config.rollout.sglang.startup_timeout_s and request_timeout_s "
                              "must be > 0")
        bad = [e for e in self.env if "=" not in e or not e.split("=", 1)[0]]
        if bad:
            raise ConfigError(f"config.rollout.sglang.env entry {bad[0]!r} must be 'NAME=value'")
        if engine != "sglang" or self.urls:
            return
        if not self.python:
            raise ConfigError("config.rollout.engine='sglang' needs running servers or an interpreter "
                              "to launch them: set config.rollout.sglang.urls=['http://host:port', "
                              "...] or config.rollout.sglang.python to the SGLang environment's "
                              "python (e.g. ~/sglang-venv/bin/python)")
        if not os.path.exists(os.path.expanduser(self.python)):
            raise ConfigError(f"config.rollout.sglang.python={self.python!r} does not exist; point it "
                              "at the python of an environment with sglang installed, or attach to "
                              "running servers with config.rollout.sglang.urls")


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    """How completions are sampled."""

    engine: str = "jax"  # "jax": built-in engine (same kernels as the learner) | "sglang": servers
    group_size: int = 8  # completions per prompt (the GRPO group)
    max_new_tokens: int = 128  # completion length cap
    temperature: float = 1.0  # sampling temperature for training rollouts
    top_p: float = 1.0  # nucleus sampling (1.0 = off)
    eval_temperature: float = 0.0  # 0 = greedy evaluation
    preflight_threshold: float = 1e-3  # max |log-prob diff| learner vs engine (stop above it)
    preflight_every: int = 0  # steps between parity preflights (0 = only before training)
    ignore_eos: bool = False  # training rollouts run to max_new_tokens past EOS (benchmarks only)
    # built-in engine's copy of float projection weights: "auto" ([out, in] on CPU, where decode
    # products run faster so), "out_in" or "in_out" (the learner's); see rlx.rollout.decode_layout
    weight_layout: str = "auto"
    # with train.max_staleness = k >= 1: generate each batch in k + 1 segments, one per step, so a
    # completion spanning a weight sync continues with the new weights (rlx.run.rollouts)
    partial: bool = False
    sglang: SGLangSection = SGLangSection()  # servers, used when engine == "sglang"

    def validate(self) -> None:
        one_of("config.rollout.engine", self.engine, ENGINES)
        one_of("config.rollout.weight_layout", self.weight_layout, LAYOUTS)
        self.sglang.validate(self.engine)
        if self.group_size < 1 or self.max_new_tokens < 1:
            raise ConfigError("config.rollout.group_size and max_new_tokens must be >= 1")
        if self.temperature < 0 or self.eval_temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError("config.rollout temperatures must be >= 0 and top_p in (0, 1]")
