"""The policy served by SGLang for the coordinator (``rollout.engine = "sglang"``).

At build the policy is exported into ``<output_dir>/serving/`` (``rlx.io.export``, each folder
published atomically with its version):

- ``train.mode = "lora"``: the frozen base once, in the serving format ``quant.serving``
  (``serving/base``; a GGUF base is its file), and the adapter as PEFT (``serving/adapter-0``);
- ``train.mode = "full"``: every weight as HF safetensors (``serving/policy``).

Servers are launched from that folder (``rollout.sglang.python``, ``num_servers`` of
``tp_size`` GPUs each; LoRA flags from ``config.lora``) or attached (``rollout.sglang.urls``); an
attached server is first given rlx's export with ``/update_weights_from_disk`` (``sync_base``), so
it holds the learner's values exactly, not its own quantization of some other checkpoint.

After every update (``update_weights(model, version)``) mode "lora" exports the new adapter to
``serving/adapter-<version>``, hot-loads it as ``policy-<version>`` and unloads (and deletes) the
previous one; mode "full" sends every weight in memory, in buckets through shared memory
(``rollout.sglang.weight_sync="memory"``, ``rlx.rollout.sglang.tensors``), or re-exports
``serving/policy`` and reloads it with ``/update_weights_from_disk`` (``"disk"``).
``SGLangEngine`` checks the ``weight_version`` of every response.
``close()`` stops the servers this object launched (their whole process groups); launched
from the main thread they also die with the rlx process if it is killed (``rlx.rollout.sglang.server``).
A server that dies, hangs or serves other weights mid-run is handled by ``SGLangEngine``
(``rlx.rollout.dispatch``): its requests go to the other servers and it is re-synced
when it answers again; with none left the run stops with a ``RolloutError``.

With several JAX processes (``distributed.rollouts="primary"``) process 0 holds this policy: it
launches the servers on its host and sends every request. Mode "lora" builds it from a host copy
of the base gathered to process 0 alone (exported once, then dropped: the policy keeps the
adapters beside an abstract base) and ships each new adapter from process 0 (the adapters are
gathered, nothing else). Mode "full" starts the servers from ``config.json`` with dummy weights
and every process streams the weights in memory (``rlx.run.hosts``: one weight gathered at a
time, process 0 sending the buckets): no host holds the model and nothing goes to disk.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence

import jax
import numpy as np
from flax import nnx

from rlx.errors import ConfigError
from rlx.io.export import (export_base, export_merged, export_peft, merged_tensors, publish,
                           write_config)
from rlx.models.config import ModelConfig
from rlx.models.loading import resolve_path
from rlx.quant import formats
from rlx.quant.config import MLP_TARGETS, TARGET_MODULES, LoraConfig
from rlx.rollout.serving import Serving
from rlx.rollout.sglang.engine import SGLangEngine
from rlx.rollout.sglang.server import ServerSpec, SGLangServer
from rlx.rollout.sglang.tensors import SharedStaging, payloads
from rlx.types import Prompt, Rollout, SamplingParams


def check_servable(serving: Serving, model: ModelConfig, process_count: int = 1) -> None:
    """Refuse, as a ``ConfigError`` naming the fields, what SGLang cannot serve for this run."""
    q, lora = serving.quant, serving.lora
    if lora is not None and lora.kind == "oft":
        raise ConfigError("config.rollout.engine='sglang' cannot serve config.lora.kind='oft': "
                          "SGLang loads LoRA adapters only, no OFT rotation; use "
                          "rollout.engine='jax' or serve a merged export (python -m rlx.export "
                          "--to merged)")
    if process_count > 1 and lora is None and serving.sglang.weight_sync == "disk":
        raise ConfigError(f"config.rollout.sglang.weight_sync='disk' with {process_count} JAX "
                          "processes would gather the whole model to one host to export it: "
                          "use weight_sync='memory' (the processes stream it to the servers)")
    if q.serving_spec.source_file and (serving.model.shrink.enabled
                                       or not q.spec.keeps_file_blocks):
        raise ConfigError("config.quant.serving='gguf' serves the GGUF file the base was loaded "
                          "from; it needs quant.format='gguf' and no model.shrink (a random "
                          "shrunken copy has no file): use quant.serving='hf'")
    adapts_experts = (lora is not None and model.moe is not None and lora.experts
                      and any(t in lora.targets for t in MLP_TARGETS))
    if adapts_experts and not q.serving_spec.moe_lora:
        moe_lora = [s for s in formats.serving_names() if formats.serving(s).moe_lora]
        raise ConfigError(f"SGLang serves LoRA on MoE experts only over a float or fp8 base "
                          f"(config.quant.serving one of {moe_lora}), not "
                          f"config.quant.serving={q.serving!r}: set config.lora.experts=False "
                          "(adapters on attention only), serve quant.serving='hf', or use "
                          "rollout.engine='jax'")


def lora_server_args(lora: LoraConfig, model: ModelConfig) -> tuple[str, ...]:
    """``--enable-lora`` flags for an adapter ``lora`` on ``model``."""
    modules = [TARGET_MODULES[t] for t in lora.targets]
    rank = lora.served_rank(model.moe is not None)  # experts' gate+up export as one adapter
    return ("--enable-lora", "--max-lora-rank", str(rank), "--lora-target-modules", *modules)


def server_args(serving: Serving, model: ModelConfig, index: int) -> tuple[str, ...]:
    """``sglang.launch_server`` flags of launched server ``index`` (before ``--model-path``'s)."""
    s = serving.sglang
    # rlx sends and reads token ids; an idle scheduler waits on its sockets instead of spinning
    # (otherwise each server holds a host core busy during every learner update)
    args: tuple[str, ...] = ("--skip-tokenizer-init", "--sleep-on-idle")
    if s.tp_size > 1:
        args += ("--tp-size", str(s.tp_size))
    if s.num_servers > 1:
        args += ("--base-gpu-id", str(index * s.tp_size))
    if serving.lora is not None and "--enable-lora" not in s.extra_args:
        args += lora_server_args(serving.lora, model)
    if weight_sync(serving)[0] == "memory":  # it starts from config.json; weights come in memory
        args += ("--load-format", "dummy")
    return args + tuple(s.extra_args)  # last: the user's flags win


def launch_specs(serving: Serving, model: ModelConfig, model_path: str) -> list[ServerSpec]:
    """The servers to launch for ``serving`` (none when it attaches to ``sglang.urls``), each
    loading ``model_path``; their logs go to ``<output_dir>/serving/sglang-<i>.log``."""
    s = serving.sglang
    if s.urls:
        return []
    folder = os.path.abspath(os.path.join(serving.output_dir, "serving"))
    env = tuple(tuple(e.split("=", 1)) for e in s.env)
    return [ServerSpec(python=os.path.expanduser(s.python), model_path=model_path,
                       extra_args=server_args(serving, model, i), env=env,
                       startup_timeout_s=s.startup_timeout_s,
                       log_path=os.path.join(folder, f"sglang-{i}.log")) for i in range(s.num_servers)]


def loads_export(serving: Serving) -> bool:
    """Whether the servers are given rlx's export at start: attached ones with ``sync_base``
    (launched ones start from it)."""
    return bool(serving.sglang.urls) and serving.sglang.sync_base


def weight_sync(serving: Serving) -> tuple[str, int]:
    """How an update reaches the servers: LoRA mode ``("adapter", 0)``; full mode
    ``("memory", bucket bytes)`` or ``("disk", 0)`` (``rollout.sglang.weight_sync``)."""
    if serving.lora is not None:
        return "adapter", 0
    s = serving.sglang
    return (("memory", int(s.sync_bucket_mb * 2**20)) if s.weight_sync == "memory"
            else ("disk", 0))


def client_options(serving: Serving) -> dict:
    """``SGLangEngine`` settings of this policy's client: the request timeout, and the policy
    version the servers hold (none known yet for servers about to load rlx's export)."""
    return {"request_timeout_s": serving.sglang.request_timeout_s,
            "weight_version": None if loads_export(serving) else 0}


class SGLangPolicy:
    """The ``rlx.types.RolloutEngine`` on SGLang servers serving the learner's policy (see the
    module docstring); ``health()`` also asks every server."""

    name = "sglang"

    def __init__(self, serving: Serving, model):
        check_servable(serving, model.config, jax.process_count())
        self.serving, self.lora = serving, serving.lora is not None
        self.dir = os.path.abspath(os.path.join(serving.output_dir, "serving"))
        self.dtype = np.float32 if serving.model.param_dtype == "float32" else _bfloat16()
        self.servers: list[SGLangServer] = []
        self.engine: SGLangEngine | None = None
        self._adapter_dir: str | None = None
        # full mode: weight updates in memory through shared memory (rlx.rollout.sglang.tensors)
        sync, self.bucket_bytes = weight_sync(serving)
        self.staging = SharedStaging() if sync == "memory" else None
        try:
            self._start(model)
        except BaseException:
            self.close()
            raise

    # --- build ----------------------------------------------------------------------------
    def _start(self, model) -> None:
        s = self.serving.sglang
        served = self._served(model)
        urls = list(s.urls) or self._launch(served, model.config)
        self.engine = SGLangEngine(urls, **client_options(self.serving),
                                   processes={server.url: server for server in self.servers})
        if self.staging is not None:
            # several processes: the run sends them, a collective of every process (rlx.run.hosts)
            if (not s.urls or s.sync_base) and jax.process_count() == 1:
                self.update_weights(model, 0)
        elif loads_export(self.serving):
            self.engine.update_weights_from_disk(served, version=0)
        elif not s.urls and os.path.isdir(served):  # a re-sync can load rlx's export again
            self.engine.record_served(served)
        if self.lora:
            self._load_adapter(model, 0)
            if jax.process_count() > 1:  # adapters come as nnx.State: kept beside an abstract base
                self._model = _adapters_only(model)

    def _served(self, model) -> str:
        """What servers load at start: mode "lora" the frozen base; "full" all weights, or with
        ``weight_sync="memory"`` only ``config.json`` (launched with ``--load-format dummy``:
        the weights then come in memory). Returns the path."""
        if not self.lora:
            path = os.path.join(self.dir, "policy")
            if self.staging is None:
                return export_merged(model, path, "0", self.dtype)
            return publish(path, "0", "config", lambda tmp: write_config(tmp, model, self.dtype))
        q = self.serving.quant
        gguf = resolve_path(self.serving.model.path) if q.serving_spec.source_file else None
        path = export_base(model, q, os.path.join(self.dir, "base"), "0", self.dtype, gguf_file=gguf)
        return os.path.join(path, os.path.basename(gguf)) if gguf else path

    def _launch(self, model_path: str, model: ModelConfig) -> list[str]:
        specs = launch_specs(self.serving, model, model_path)
        self.servers = [SGLangServer(spec) for spec in specs]
        for server in self.servers:  # on this thread: servers die with it (rlx.rollout.sglang.server)
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
    def update_weights(self, weights, version: int) -> None:
        """Serve ``weights`` as policy ``version``: the whole model (an ``nnx.Module``), or in
        LoRA mode with several processes the adapters (an ``nnx.State`` on the host)."""
        if self.lora:
            if isinstance(weights, nnx.State):
                nnx.update(self._model, weights)
                weights = self._model
            self._load_adapter(weights, version)
            return
        if self.staging is None:
            path = export_merged(weights, os.path.join(self.dir, "policy"), str(version),
                                 self.dtype)
            self.engine.update_weights_from_disk(path, version)
            return
        self.engine.load_tensors(self._payloads(weights), version, self.serving.sglang.tp_size)
        self.engine.reload = lambda: (self._payloads(weights), version,
                                      self.serving.sglang.tp_size)

    def _payloads(self, weights):
        """Buckets of ``weights``' merged HF tensors, staged in shared memory one at a time."""
        return self.payloads(merged_tensors(weights, self.dtype))

    def payloads(self, tensors: Iterable[tuple[str, np.ndarray]]) -> Iterator[str]:
        """``/update_weights_from_tensor`` payloads of HF-named host tensors (memory mode)."""
        return payloads(self.staging, tensors, self.bucket_bytes)

    def send_tensors(self, tensors: Iterable[tuple[str, np.ndarray]], version: int) -> None:
        """Full mode in memory: serve HF-named host ``tensors`` (every weight, consumed in order)
        as policy ``version``. A re-sync after this sends ``tensors`` again only if the run has
        sent nothing since: with several processes a server that lost its weights is taken out
        of rotation until the next update reaches it (``rlx.run.hosts``)."""
        self.engine.load_tensors(self.payloads(tensors), version, self.serving.sglang.tp_size)
        self.engine.reload = None

    def _load_adapter(self, model, version: int) -> None:
        path = export_peft(model, self.serving.lora, os.path.join(self.dir, f"adapter-{version}"),
                           str(version), base_model_name_or_path=self.serving.model.path)
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


def stream_weights(policy: SGLangPolicy | None, model, version: int) -> None:
    """Full mode in memory with several processes; every process calls it, in the same order:
    each reads ``model``'s merged weights one at a time (``rlx.io.export.merged_tensors``: an
    all-gather per weight), process 0 (``policy`` not None) sends them as policy ``version``.
    The weights process 0 did not take after an error are still read, then the error raised."""
    dtype = policy.dtype if policy is not None else np.float32
    tensors = merged_tensors(model, dtype)
    try:
        if policy is not None:
            policy.send_tensors(tensors, version)
    finally:
        for _ in tensors:  # every weight on the other processes
            pass


def _adapters_only(model):
    """``model`` with every variable but its adapters abstract (shapes only): what a LoRA export
    reads, without the host copy of the base."""
    graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)
    rest = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), rest)
    return nnx.merge(graphdef, adapters, rest)


def _bfloat16():
    import ml_dtypes

    return ml_dtypes.bfloat16


__all__ = ["SGLangPolicy", "check_servable", "client_options", "launch_specs", "loads_export",
           "lora_server_args", "server_args", "stream_weights", "weight_sync"]
