"""The ``config.rollout.sglang`` section: the SGLang servers a run attaches to or launches."""

from __future__ import annotations

import dataclasses
import os

from rlx.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class SGLangSection:
    """SGLang servers (``rollout.engine="sglang"``): attach to ``urls`` or launch ``num_servers``
    from ``python``. See ``rlx.rollout.sglang.policy`` for what is exported and synced."""

    urls: tuple[str, ...] = ()  # running servers to attach to; empty: launch them
    python: str = ""  # interpreter of the SGLang environment (it pins its own torch)
    num_servers: int = 1  # servers to launch when urls is empty
    tp_size: int = 1  # GPUs per launched server (--tp-size); server i starts at GPU i * tp_size
    extra_args: tuple[str, ...] = ()  # passed to sglang.launch_server (e.g. --mem-fraction-static)
    env: tuple[str, ...] = ()  # "NAME=value" entries added to the launched servers' environment
    startup_timeout_s: float = 900.0  # a launched server must answer /health within this
    request_timeout_s: float = 600.0  # per HTTP request (a whole completion)
    sync_base: bool = True  # attached servers: load rlx's exported base/weights at start
    # full mode's weight updates: "memory" (buckets through shared memory, servers on this host;
    # needs torch) or "disk" (a safetensors export the servers reload)
    weight_sync: str = "memory"
    sync_bucket_mb: float = 512.0  # "memory": at most this much of the model staged at once

    def validate(self, engine: str) -> None:
        if self.num_servers < 1 or self.tp_size < 1:
            raise ConfigError("config.rollout.sglang.num_servers and tp_size must be >= 1")
        if self.startup_timeout_s <= 0 or self.request_timeout_s <= 0:
            raise ConfigError("config.rollout.sglang.startup_timeout_s and request_timeout_s "
                              "must be > 0")
        if self.weight_sync not in ("memory", "disk"):
            raise ConfigError(f"config.rollout.sglang.weight_sync={self.weight_sync!r}: use "
                              "'memory' (shared memory, servers on the learner's host) or 'disk'")
        if self.sync_bucket_mb <= 0:
            raise ConfigError("config.rollout.sglang.sync_bucket_mb must be > 0")
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
