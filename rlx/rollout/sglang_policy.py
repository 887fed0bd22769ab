"""The policy served by SGLang for the coordinator (``rollout.engine = "sglang"``).

At build the policy is exported into ``<output_dir>/serving/`` (``rlx.io.export``, each folder
published atomically with its version):

- mode B (``train.mode = "lora"``): the frozen base once, in the serving format ``quant.serving``
  (``serving/base``; a GGUF base is its file), and the adapter as PEFT (``serving/adapter-0``);
- mode A (``train.mode = "full"``): every weight as HF safetensors (``serving/policy``).

Servers are launched from that folder (``rollout.sglang.python``, ``num_servers`` of
``tp_size`` GPUs each; LoRA flags from ``config.lora``) or attached (``rollout.sglang.urls``); an
attached server is first given rlx's export with ``/update_weights_from_disk`` (``sync_base``), so
it holds the learner's values exactly, not its own quantization of some other checkpoint.

After every update (``update_weights(model, version)``) mode B exports the new adapter to
``serving/adapter-<version>``, hot-loads it as ``policy-<version>`` and unloads (and deletes) the
previous one; mode A re-exports ``serving/policy`` and reloads it with
``/update_weights_from_disk``. ``SGLangEngine`` checks the ``weight_version`` of every response.
``close()`` stops the servers this object launched (their whole process groups); launched
from the main thread they also die with the rlx process if it is killed (``sglang_server``).
A server that dies, hangs or serves other weights mid-run is handled by ``SGLangEngine``
(``rlx.rollout.sglang_dispatch``): its requests go to the other servers and it is re-synced
when it answers again; with none left the run stops with a ``RolloutError``.

Multi-host runs are refused for now: every JAX process would send its own requests; use the
built-in engine there (``rollout.engine = "jax"``).
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
from collections.abc import Sequence

import jax
import numpy as np

from rlx.config import ConfigError, RunConfig, resolve_path
from rlx.io.export import export_base, export_merged, export_peft
from rlx.models.config import ModelConfig
from rlx.rollout.base import Prompt, SamplingParams
from rlx.rollout.sglang_engine import SGLangEngine
from rlx.rollout.sglang_server import SGLangServer, ServerSpec
from rlx.types import Rollout

# SGLang serves MoE LoRA only on these bases (bf16 weights or fp8).
_MOE_LORA_SERVING = ("hf", "fp8")


def check_servable(cfg: RunConfig, model: ModelConfig, process_count: int = 1) -> None:
    """Refuse, as a ``ConfigError`` naming the fields, what SGLang cannot serve for this run."""
    if process_count > 1:
        raise ConfigError(f"config.rollout.engine='sglang' with {process_count} JAX processes: "
                          "multi-host runs drive the built-in engine (rollout.engine='jax'); "
                          "SGLang needs a single learner process for now")
    if cfg.quant.serving == "gguf" and (cfg.model.shrink.enabled or cfg.quant.format != "gguf"):
        raise ConfigError("config.quant.serving='gguf' serves the GGUF file the base was loaded "
                          "from; it needs quant.format='gguf' and no model.shrink (a random "
                          "shrunken copy has no file): use quant.serving='hf'")
    adapts_experts = (cfg.train.mode == "lora" and model.moe is not None and cfg.lora.experts
                      and any(t in cfg.lora.targets for t in ("gate", "up", "down")))
    if adapts_experts and cfg.quant.serving not in _MOE_LORA_SERVING:
        raise ConfigError(f"SGLang serves LoRA on MoE experts only over a {list(_MOE_LORA_SERVING)} "
                          f"base, not config.quant.serving={cfg.quant.serving!r}: set "
                          "config.lora.experts=False (adapters on attention only), serve "
                          "quant.serving='hf', or use rollout.engine='jax'")


def lora_server_args(cfg: RunConfig, model: ModelConfig) -> tuple[str, ...]:
    """``--enable-lora`` flags for an adapter of ``cfg.lora`` on ``model``."""
    modules = [f"{t}_proj" for t in cfg.lora.targets]
    fused = model.moe is not None and cfg.lora.experts and {"gate", "up"} <= set(cfg.lora.targets)
    rank = 2 * cfg.lora.rank if fused else cfg.lora.rank  # experts' gate+up export as one rank-2r
    return ("--enable-lora", "--max-lora-rank", str(rank), "--lora-target-modules", *modules)


def server_args(cfg: RunConfig, model: ModelConfig, index: int) -> tuple[str, ...]:
    """``sglang.launch_server`` flags of launched server ``index`` (before ``--model-path``'s)."""
    s = cfg.rollout.sglang
    # rlx sends and reads token ids; an idle scheduler waits on its sockets instead of spinning
    # (otherwise each server holds a host core busy during every learner update)
    args: tuple[str, ...] = ("--skip-tokenizer-init", "--sleep-on-idle")
    if s.tp_size > 1:
        args += ("--tp-size", str(s.tp_size))
    if s.num_servers > 1:
        args += ("--base-gpu-id", str(index * s.tp_size))
    if cfg.train.mode == "lora" and "--enable-lora" not in s.extra_args:
        args += lora_server_args(cfg, model)
    return args + tuple(s.extra_args)  # last: the user's flags win


class SGLangPolicy:
    """``generate`` / ``score`` / ``update_weights(model, version)`` / ``health`` / ``close``
    on SGLang servers serving the learner's policy (see the module docstring)."""

    name = "sglang"

    def __init__(self, cfg: RunConfig, model):
        check_servable(cfg, model.config, jax.process_count())
        self.cfg, self.lora = cfg, cfg.train.mode == "lora"
        self.dir = os.path.abspath(os.path.join(cfg.output_dir, "serving"))
        self.dtype = np.float32 if cfg.model.param_dtype == "float32" else _bfloat16()
        self.servers: list[SGLangServer] = []
        self.engine: SGLangEngine | None = None
        self._adapter_dir: str | None = None
        try:
            self._start(model)
        except BaseException:
            self.close()
            raise

    # --- build ----------------------------------------------------------------------------
    def _start(self, model) -> None:
        s = self.cfg.rollout.sglang
        served = self._export_served(model)
        urls = list(s.urls) or self._launch(served, model.config)
        common = dict(request_timeout_s=s.request_timeout_s,
                      processes={server.url: server for server in self.servers})
        if s.urls and s.sync_base:
            self.engine = SGLangEngine(urls, **common)
            self.engine.update_weights_from_disk(served, version=0)
        else:
            self.engine = SGLangEngine(urls, weight_version=0, **common)
            if not s.urls and os.path.isdir(served):  # a re-sync can load rlx's export again
                self.engine.record_served(served)
        if self.lora:
            self._load_adapter(model, 0)

    def _export_served(self, model) -> str:
        """Mode B: the frozen base; mode A: all weights. Returns the path servers load."""
        if not self.lora:
            return export_merged(model, os.path.join(self.dir, "policy"), "0", self.dtype)
        q = self.cfg.quant
        gguf = resolve_path(self.cfg.model.path) if q.serving == "gguf" else None
        path = export_base(model, q, os.path.join(self.dir, "base"), "0", self.dtype, gguf_file=gguf)
        return os.path.join(path, os.path.basename(gguf)) if gguf else path

    def _launch(self, model_path: str, model: ModelConfig) -> list[str]:
        s = self.cfg.rollout.sglang
        env = tuple(tuple(e.split("=", 1)) for e in s.env)
        self.servers = [SGLangServer(ServerSpec(
            python=os.path.expanduser(s.python), model_path=model_path,
            extra_args=server_args(self.cfg, model, i), env=env,
            startup_timeout_s=s.startup_timeout_s,
            log_path=os.path.join(self.dir, f"sglang-{i}.log"))) for i in range(s.num_servers)]
        for server in self.servers:  # on this thread: servers die with it (sglang_server)
            server.spawn()
        with concurrent.futures.ThreadPoolExecutor(len(self.servers)) as pool:
            starts = [pool.submit(server.wait_healthy) for server in self.servers]  # in parallel
            try:
                for f in starts:
                    f.result()
            except BaseException:  # one failed: the others stop waiting for /health
                for server in self.servers:
                    server.stop()
                raise
        return [server.url for server in self.servers]

    # --- weights --------------------------------------------------------------------------
    def update_weights(self, model, version: int) -> None:
        """Serve ``model`` (an ``nnx.Module``) as policy ``version``."""
        if self.lora:
            self._load_adapter(model, version)
            return
        path = export_merged(model, os.path.join(self.dir, "policy"), str(version), self.dtype)
        self.engine.update_weights_from_disk(path, version)

    def _load_adapter(self, model, version: int) -> None:
        path = export_peft(model, self.cfg.lora, os.path.join(self.dir, f"adapter-{version}"),
                           str(version), base_model_name_or_path=self.cfg.model.path)
        self.engine.load_adapter(path, version)
        old, self._adapter_dir = self._adapter_dir, path
        if old is not None and old != path:
            shutil.rmtree(old, ignore_errors=True)

    @property
    def weight_version(self) -> int:
        return int(self.engine.weight_version)

    # --- rollouts -------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], sampling: SamplingParams) -> list[Rollout]:
        return self.engine.generate(prompts, sampling)

    def score(self, sequences: Sequence[tuple[Sequence[int], int]]) -> list[np.ndarray]:
        return self.engine.score(sequences)

    def health(self) -> bool:
        return self.engine is not None and self.engine.health()

    def close(self) -> None:
        """Stop the client and every server this policy launched (idempotent)."""
        if self.engine is not None:
            self.engine.close()
        if self.servers:
            with concurrent.futures.ThreadPoolExecutor(len(self.servers)) as pool:
                list(pool.map(lambda server: server.stop(), self.servers))  # in parallel


def _bfloat16():
    import ml_dtypes

    return ml_dtypes.bfloat16


__all__ = ["SGLangPolicy", "check_servable", "lora_server_args", "server_args"]
