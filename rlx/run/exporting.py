"""Exports of a run's checkpoint for serving and for other tools (``python -m rlx.export``).

A run's output folder and a step (default: the newest complete checkpoint) give the model: the
config that checkpoint recorded builds it (``load_policy``) and ``rlx.run.evaluation``'s
``restore_policy`` puts the trained parameters on it, as ``rlx.eval --checkpoint`` does. The
policy is then written by ``rlx.io.export`` (``KINDS``: one line each), published atomically with
the step as its version. The float exports stream one weight at a time into safetensors shards
(``rlx.io.export.write_shards``): no host holds the whole model. They are written in the dtype the
base checkpoint itself stores (``ModelSection.source_dtype``: a bf16 folder stays bf16) unless
another is asked.

An export that cannot apply to the run (an adapter from a full-mode run, a GGUF LoRA without a
GGUF base), a missing folder or step, a mesh the visible devices cannot hold: one-line
``ConfigError`` before any weight is read.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import jax
import numpy as np

from rlx.config import RunConfig, parse_config
from rlx.errors import ConfigError
from rlx.io.checkpoint import CheckpointConfig, Checkpointer, committed_steps
from rlx.io.fingerprint import CheckpointError
from rlx.io.export import (MAX_SHARD_BYTES, export_base, export_merged, export_peft, publish,
                           weight_count)
from rlx.io.gguf_lora import export_gguf_lora
from rlx.mesh import make_mesh
from rlx.models.loading import resolve_path
from rlx.quant.loading import resolve_quant
from rlx.run.build import load_policy
from rlx.run.checks import check_before_build
from rlx.run.evaluation import restore_policy
from rlx.run.lifecycle import CHECKPOINT_DIR

KINDS = {  # --to: one line each (``python -m rlx.export --help`` lists them)
    "hf": "a HF folder (config.json, safetensors, tokenizer) of the policy, adapter merged",
    "merged": "the same folder as hf",
    "peft": "the adapter (LoRA or OFT) as a PEFT folder on model.path (LoRA runs)",
    "quantized": "base/ in quant.serving's layout (a GGUF base: its file) + adapter/ as PEFT "
                 "(LoRA runs)",
    "gguf-lora": "the adapter as a llama.cpp GGUF LoRA file for its GGUF base (LoRA runs)",
}
MERGED = ("hf", "merged")  # the kinds that write the merged policy
STREAMED = (*MERGED, "quantized")  # the kinds that stream float weights (a progress bar)
DTYPES = ("base", "float32", "bfloat16", "float16")  # "base": the base checkpoint's own


@dataclasses.dataclass(frozen=True)
class ExportRequest:
    """What ``python -m rlx.export`` was asked."""

    run: str  # a run's output folder, its checkpoints/ folder or one step's folder
    to: str  # one of KINDS
    out: str  # the folder written (published atomically)
    step: int | None = None  # None: the newest complete checkpoint
    dtype: str = "base"  # one of DTYPES: the float dtype of hf / merged / quantized
    max_shard_bytes: int = MAX_SHARD_BYTES  # a safetensors shard, at most (one tensor may be more)

    def __post_init__(self):
        if self.to not in KINDS:
            raise ConfigError(f"--to {self.to!r} is no export; choose one of {', '.join(KINDS)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.step is not None and self.step < 0:
            raise ConfigError(f"--step {self.step} must be a saved step (>= 0)")
        if self.max_shard_bytes < 1:
            raise ConfigError(f"--max-shard-size {self.max_shard_bytes} must be at least 1 byte")
        if not self.out:
            raise ConfigError("give the output folder: python -m rlx.export --run DIR --to KIND OUT")


@dataclasses.dataclass(frozen=True)
class Exported:
    """What an export wrote."""

    kind: str
    step: int
    path: str  # the folder published
    dtype: str | None  # the float dtype written (None: adapters only, float32)


def find_checkpoint(run: str, step: int | None) -> tuple[str, int]:
    """(the run's checkpoints/ folder, the step to export) of ``--run`` / ``--step``."""
    path = os.path.abspath(run)
    name, parent = os.path.basename(path), os.path.dirname(path)
    if not os.path.isdir(path):
        raise ConfigError(f"--run {run!r}: no such folder; give a run's output folder "
                          f"(config.output_dir)")
    if name.isdigit() and os.path.basename(parent) == CHECKPOINT_DIR:  # one step's folder
        if step is not None and step != int(name):
            raise ConfigError(f"--run {run!r} is step {name}'s folder, and --step {step} asks "
                              "for another: give the run's output folder with --step")
        path, step = parent, int(name)
    elif name != CHECKPOINT_DIR:
        path = os.path.join(path, CHECKPOINT_DIR)
    steps = committed_steps(path)
    if not steps:
        raise ConfigError(f"--run {run!r}: no checkpoint in {path}; give a run's output folder "
                          "(config.output_dir) that has saved one")
    if step is not None and step not in steps:
        raise ConfigError(f"--step {step}: no checkpoint of that step in {path} (saved steps: "
                          f"{', '.join(map(str, steps))})")
    return path, steps[-1] if step is None else step


def saved_config(directory: str, step: int) -> RunConfig:
    """The run config checkpoint ``step`` in ``directory`` recorded, as the run parsed it."""
    checkpointer = Checkpointer(CheckpointConfig(directory))
    try:
        meta = checkpointer.read_meta(step)
    finally:
        checkpointer.close()
    return parse_config(meta.get("config") or {})


def check_applies(cfg: RunConfig, to: str) -> None:
    """Refuse an export the run has nothing for, naming one that applies."""
    if to in ("peft", "quantized", "gguf-lora") and cfg.train.mode != "lora":
        raise ConfigError(f"--to {to} exports a LoRA adapter, and this run trained in "
                          f"train.mode={cfg.train.mode!r} (no adapter): use --to hf")
    if to == "gguf-lora" and cfg.lora.kind == "oft":
        raise ConfigError("--to gguf-lora writes a LoRA adapter, and this run trained an OFT "
                          "adapter (lora.kind='oft'), which llama.cpp cannot load: use --to merged")
    if to == "gguf-lora" and not cfg.model.is_gguf:
        raise ConfigError(f"--to gguf-lora needs a GGUF base, and model.path={cfg.model.path!r} "
                          "is not a GGUF file: use --to peft")
    if to == "gguf-lora" and cfg.model.shrink.enabled:
        raise ConfigError("--to gguf-lora names the GGUF file's own tensors, and this run trained "
                          "a random shrunken copy (model.shrink.enabled): use --to peft")


def check_devices(cfg: RunConfig) -> None:
    """The run's mesh fits the devices visible here (the checkpoint restores onto it)."""
    need, have = cfg.mesh.num_devices, jax.device_count()
    if need != have:
        raise ConfigError(f"the run's mesh (config.mesh) spans {need} devices and {have} are "
                          f"visible: export where {need} are (on a CPU: XLA_FLAGS="
                          f"--xla_force_host_platform_device_count={need})")


def float_dtype(cfg: RunConfig, asked: str) -> np.dtype:
    """The numpy dtype of ``--dtype`` (``"base"``: the base checkpoint's own)."""
    import jax.numpy as jnp

    return np.dtype(jnp.dtype(cfg.model.source_dtype() if asked == "base" else asked))


def export_run(req: ExportRequest, progress: Callable[[int], Callable[[int], None]] | None = None
               ) -> Exported:
    """Restore ``req``'s checkpoint and write it as ``req.to`` (see the module docstring).
    ``progress(total)`` makes the callback a float export calls once per weight (``total``)."""
    directory, step = find_checkpoint(req.run, req.step)
    cfg = saved_config(directory, step)
    check_applies(cfg, req.to)
    check_devices(cfg)
    check_before_build(cfg, jax.device_count())
    mesh = make_mesh(cfg.mesh)
    model, tokenizer = load_policy(cfg, mesh)
    try:
        policy, step = restore_policy(cfg, model, mesh, os.path.join(directory, str(step)))
    except CheckpointError as e:  # corrupt, or not this config's: the message says which
        raise ConfigError(str(e)) from e
    model, version = policy.model(), str(step)
    dtype = float_dtype(cfg, req.dtype)
    tick = progress(weight_count(model)) if progress is not None and req.to in STREAMED else None
    floats = dict(progress=tick, max_shard_bytes=req.max_shard_bytes)
    if req.to in MERGED:
        path = export_merged(model, req.out, version, dtype, tokenizer=tokenizer, **floats)
    elif req.to == "peft":
        path = export_peft(model, cfg.lora, req.out, version, base_model_name_or_path=cfg.model.path)
    elif req.to == "gguf-lora":
        path = export_gguf_lora(model, resolve_path(cfg.model.path), req.out, version)
    else:
        def write(tmp: str) -> dict:
            q = resolve_quant(cfg.quant, cfg.model).quant
            gguf = resolve_path(cfg.model.path) if cfg.model.is_gguf else None
            export_base(model, q, os.path.join(tmp, "base"), version, dtype, gguf, **floats)
            export_peft(model, cfg.lora, os.path.join(tmp, "adapter"), version,
                        base_model_name_or_path=cfg.model.path)
            return {"serving": q.serving, "parts": ["base", "adapter"]}

        path = publish(req.out, version, "quantized", write)
    adapters_only = req.to in ("peft", "gguf-lora")
    return Exported(req.to, step, path, None if adapters_only else dtype.name)


__all__ = ["DTYPES", "KINDS", "ExportRequest", "Exported", "check_applies", "export_run",
           "find_checkpoint", "saved_config"]
