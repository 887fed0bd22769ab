"""Run configuration: an ``ml_collections.ConfigDict`` turned into frozen, validated dataclasses.

Configs are Python files with ``get_config()`` (see ``configs/``); command-line overrides use
``--config.a.b=v``. ``parse_config`` walks the dataclass schema below, refuses unknown keys and
wrong types with the dotted field name, then each section validates its values once. Every error is
a ``ConfigError`` whose message is a single line naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
import types
import typing
from typing import Any

import ml_collections

from rlx.learner.losses import LossConfig
from rlx.learner.state import OptimizerConfig
from rlx.quant.config import LoraConfig, QuantConfig

REMAT = ("none", "layer", "projections")  # config.train.remat: the keys of rlx.learner.step.FORWARDS


class ConfigError(ValueError):
    """An invalid config; ``str(e)`` is one line naming the field and how to fix it."""


def _choice(field: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"config.{field}={value!r} is not one of {list(allowed)}")


@dataclasses.dataclass(frozen=True)
class ShrinkSection:
    """Random-initialise a shrunken copy of the checkpoint's architecture (tests, smoke runs).

    The tokenizer and every other architecture field come from ``model.path``; weights are random.
    """

    enabled: bool = False
    num_layers: int = 2
    hidden_size: int = 64
    intermediate_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    num_experts: int = 4  # MoE checkpoints only
    moe_intermediate_size: int = 32  # MoE checkpoints only


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Which checkpoint to load and in which precision."""

    path: str = ""  # HF folder, .gguf file, or package://pkg/file.gguf (a file shipped in a package)
    format: str = "auto"  # "auto" (by extension) | "hf" | "gguf"
    dtype: str = "float32"  # compute dtype: "float32" | "bfloat16"
    param_dtype: str = "float32"  # storage dtype of full-precision parameters
    moe_impl: str = "ragged"  # "ragged" (sorted grouped matmul) | "dense" (all experts, einsum)
    shrink: ShrinkSection = ShrinkSection()  # random shrunken copy instead of the weights

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("config.model.path is empty; set it to a HF folder or a .gguf file")
        local = resolve_path(self.path)
        if not os.path.exists(local):
            raise ConfigError(f"config.model.path={self.path!r} does not exist; point it at a HF "
                              "model folder (config.json + *.safetensors) or a .gguf file")
        _choice("model.format", self.format, ("auto", "hf", "gguf"))
        _choice("model.dtype", self.dtype, ("float32", "bfloat16"))
        _choice("model.param_dtype", self.param_dtype, ("float32", "bfloat16"))
        _choice("model.moe_impl", self.moe_impl, ("ragged", "dense"))

    @property
    def resolved_format(self) -> str:
        if self.format != "auto":
            return self.format
        return "gguf" if self.path.endswith(".gguf") else "hf"


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """Device mesh sizes; their product must equal the number of devices."""

    data: int = 1  # data-parallel replicas
    fsdp: int = 1  # parameter/optimizer sharding (ZeRO-3)
    tensor: int = 1  # tensor parallelism over heads / mlp / vocab
    expert: int = 1  # expert parallelism for MoE layers

    def validate(self) -> None:
        for name in ("data", "fsdp", "tensor", "expert"):
            if getattr(self, name) < 1:
                raise ConfigError(f"config.mesh.{name}={getattr(self, name)} must be >= 1")

    def check_devices(self, n_devices: int) -> None:
        product = self.data * self.fsdp * self.tensor * self.expert
        if product != n_devices:
            raise ConfigError(
                f"config.mesh data*fsdp*tensor*expert = {self.data}*{self.fsdp}*{self.tensor}*"
                f"{self.expert} = {product}, but {n_devices} devices are visible; choose sizes "
                f"whose product is {n_devices}")


@dataclasses.dataclass(frozen=True)
class DistributedSection:
    """Multi-host runs (``jax.distributed``; ``rlx.run.hosts`` says which process does what); off for
    a single process. Every process reads ``data.prompts_per_step / data_shards`` prompts per
    step from each of its data shards."""

    enabled: bool = False  # call jax.distributed.initialize before anything else
    coordinator_address: str = ""  # "host:port"; empty: auto-detect (TPU, SLURM)
    num_processes: int = 0  # 0: auto-detect
    process_id: int = 0  # ignored when auto-detecting
    rollouts: str = "primary"  # "primary": process 0 samples all prompts | "per_host": each its own
    data_shards: int = 0  # 0: one per process; fixed (a multiple of it): same batches on any count

    def validate(self) -> None:
        if self.num_processes < 0:
            raise ConfigError("config.distributed.num_processes must be >= 0 (0 = auto-detect)")
        if self.enabled and self.num_processes and not (0 <= self.process_id < self.num_processes):
            raise ConfigError(f"config.distributed.process_id={self.process_id} must be in "
                              f"[0, {self.num_processes})")
        _choice("distributed.rollouts", self.rollouts, ("primary", "per_host"))
        if self.data_shards < 0:
            raise ConfigError("config.distributed.data_shards must be >= 0 (0 = one per process)")
        if self.enabled and self.num_processes and self.data_shards % self.num_processes:
            raise ConfigError(f"config.distributed.data_shards={self.data_shards} must be a "
                              f"multiple of num_processes={self.num_processes}")


@dataclasses.dataclass(frozen=True)
class DataSection:
    """Prompts for training and the held-out set for evaluation."""

    source: str = "arith:basic"  # a registered source (mmath:math500, arith:add2, jsonl:PATH, ...)
    prompts_per_step: int = 8  # prompts per RL step (each sampled rollout.group_size times)
    max_prompt_tokens: int = 512  # longer prompts are skipped and counted
    system_prompt: str = ""  # system message put first ("" = the chat template's default)
    template: str = "{prompt}"  # applied to the user message; must contain {prompt}
    eval_size: int = 64  # held-out problems (from the eval split, disjoint from training)

    def validate(self) -> None:
        if self.prompts_per_step < 1 or self.eval_size < 0 or self.max_prompt_tokens < 1:
            raise ConfigError("config.data.prompts_per_step and max_prompt_tokens must be >= 1, "
                              "eval_size >= 0")
        if "{prompt}" not in self.template:
            raise ConfigError(f"config.data.template={self.template!r} must contain {{prompt}}")


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
    sglang: SGLangSection = SGLangSection()  # servers, used when engine == "sglang"

    def validate(self) -> None:
        _choice("rollout.engine", self.engine, ("jax", "sglang"))
        _choice("rollout.weight_layout", self.weight_layout, ("auto", "out_in", "in_out"))
        self.sglang.validate(self.engine)
        if self.group_size < 1 or self.max_new_tokens < 1:
            raise ConfigError("config.rollout.group_size and max_new_tokens must be >= 1")
        if self.temperature < 0 or self.eval_temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError("config.rollout temperatures must be >= 0 and top_p in (0, 1]")


@dataclasses.dataclass(frozen=True)
class TrainSection:
    """The RL loop."""

    mode: str = "lora"  # "lora" (frozen base + adapter, mode B) | "full" (all params, mode A)
    steps: int = 100  # RL steps (generate -> score -> update)
    advantage: str = "grpo"  # grpo | dr_grpo | rloo | reinforce_pp
    micro_batches: int = 1  # gradient accumulation inside one compiled update
    logprob_chunk: int = 512  # tokens per chunk of the chunked log-softmax
    # padded train-row lengths per doubling (rlx.learner.batching.train_buckets): a batch pads its
    # longest row by at most 1/n, and the train step compiles at most n shapes per doubling
    length_buckets: int = 8
    remat: str = "none"  # "none": keep every activation; "layer": keep layer inputs, recompute;
    # "projections": keep every linear layer's output, recompute attention, norms, activations
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal
    reward: str = "math"  # a registered reward (math, code, ...)
    math_extractors: tuple[str, ...] = ("boxed", "hash", "answer_is")  # math answer extraction order
    eval_every: int = 10  # steps between evaluations (0 = only at the start and the end)
    checkpoint_every: int = 0  # steps between checkpoints (0 = only at exit)
    keep_checkpoints: int = 2  # checkpoints kept on disk
    max_staleness: int = 0  # 0: synchronous on-policy; 1: one-step-off async (generate t+1 during update t)
    max_skipped_steps: int = 3  # stop after this many updates in a row skipped for NaN/Inf
    sample_every: int = 10  # steps between logged sample completions

    def validate(self) -> None:
        if self.mode not in ("lora", "full"):
            raise ConfigError(f"config.train.mode={self.mode!r} is not one of ['lora', 'full']")
        if self.steps < 0 or self.micro_batches < 1 or self.logprob_chunk < 1:
            raise ConfigError("config.train.steps must be >= 0, micro_batches and logprob_chunk >= 1")
        if self.length_buckets < 1:
            raise ConfigError(f"config.train.length_buckets={self.length_buckets} must be >= 1 "
                              "(padded row lengths per doubling; 8: at most 12.5% padding)")
        if self.remat not in REMAT:
            raise ConfigError(f"config.train.remat={self.remat!r} is not one of {list(REMAT)}")
        if self.advantage not in ("grpo", "dr_grpo", "rloo", "reinforce_pp"):
            raise ConfigError(f"config.train.advantage={self.advantage!r} is not one of "
                              "['grpo', 'dr_grpo', 'rloo', 'reinforce_pp']")
        if self.max_staleness not in (0, 1):
            raise ConfigError(f"config.train.max_staleness={self.max_staleness} is not one of [0, 1] "
                              "(0: synchronous, 1: one-step-off asynchronous rollouts)")
        if self.max_skipped_steps < 1:
            raise ConfigError(f"config.train.max_skipped_steps={self.max_skipped_steps} must be >= 1")
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1:
            raise ConfigError("config.train.checkpoint_every must be >= 0 (0: only at exit) and "
                              "keep_checkpoints >= 1")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The whole run. Sections mirror the keys of ``get_config()``."""

    model: ModelSection = ModelSection()
    quant: QuantConfig = QuantConfig()  # frozen base representation + serving format (mode B)
    lora: LoraConfig = LoraConfig()  # adapter shape (used when train.mode == "lora")
    mesh: MeshSection = MeshSection()
    data: DataSection = DataSection()
    rollout: RolloutSection = RolloutSection()
    train: TrainSection = TrainSection()
    loss: LossConfig = LossConfig()  # policy loss, KL, entropy, truncated importance sampling
    optim: OptimizerConfig = OptimizerConfig()  # AdamW + schedule + clipping
    distributed: DistributedSection = DistributedSection()
    seed: int = 0  # seeds parameter init, data order and sampling
    output_dir: str = "runs/default"  # tensorboard logs, metrics, checkpoints, exports
    resume: str = ""  # "" fresh | "latest" (or "true") newest complete checkpoint | a step number

    @property
    def resume_step(self) -> int | str | None:
        """None (fresh), "latest", or the checkpoint step to resume from."""
        value = str(self.resume).strip().lower()
        if value in ("", "false", "no", "0", "none"):
            return None
        if value in ("latest", "true", "yes", "auto"):
            return "latest"
        if value.isdigit():
            return int(value)
        raise ConfigError(f"config.resume={self.resume!r} is not one of ['' (fresh), 'latest', "
                          "'true', or a checkpoint step number]")

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if hasattr(section, "validate"):
                section.validate()
        self.resume_step  # noqa: B018 (validates)
        if self.train.mode == "full" and self.quant.format != "none":
            raise ConfigError(f"config.train.mode='full' trains every parameter, but config.quant."
                              f"format={self.quant.format!r} freezes a quantized base; use "
                              "train.mode='lora' or quant.format='none'")
        if self.model.resolved_format == "gguf" and self.train.mode == "full" and \
                self.quant.format == "gguf":
            raise ConfigError("a GGUF base kept as blocks is frozen: use train.mode='lora'")
        if self.train.mode == "full" and self.loss.kl_coef > 0:
            raise ConfigError(f"config.loss.kl_coef={self.loss.kl_coef} in train.mode='full' needs a "
                              "reference copy of the weights, which rlx does not keep; use "
                              "train.mode='lora' (the reference is the base with the adapter off) "
                              "or loss.kl_coef=0")


def resolve_path(path: str) -> str:
    """Turn ``package://pkg/rel/path`` into a filesystem path; other paths are returned as is."""
    if not path.startswith("package://"):
        return os.path.expanduser(path)
    pkg, _, rel = path[len("package://"):].partition("/")
    try:
        return str(importlib.resources.files(pkg).joinpath(rel))
    except ModuleNotFoundError:
        raise ConfigError(f"config path {path!r}: Python package {pkg!r} is not installed; "
                          f"pip install it (e.g. `pip install -e .[demo]`)") from None


def parse_config(cd: ml_collections.ConfigDict | dict, cls: type = RunConfig) -> Any:
    """Convert and validate; raises ``ConfigError`` naming the offending field."""
    cfg = _convert(cls, cd, "")
    cfg.validate()
    return cfg


def _convert(cls: type, data: Any, prefix: str) -> Any:
    if isinstance(data, ml_collections.ConfigDict):
        data = data.to_dict()
    if not isinstance(data, dict):
        raise ConfigError(f"config{prefix} must be a section (dict), got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key config{prefix}.{unknown[0]}; known keys of config{prefix or ''}: "
                          f"{sorted(fields)}")
    kwargs = {name: _value(hints[name], data[name], f"{prefix}.{name}") for name in data}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:  # a section's own __post_init__ check
        raise ConfigError(_field_message(cls, str(e), prefix, fields)) from None


def _field_message(cls: type, msg: str, prefix: str, fields) -> str:
    """A section's own error as ``config.section.field...``: messages start with the field name,
    bare or after the class name (``LossConfig.tis_cap must be > 0``)."""
    msg = msg.removeprefix(f"{cls.__name__}.")
    head = msg.replace("=", " ").split(" ", 1)[0]
    return f"config{prefix}.{msg}" if head in fields else f"config{prefix}: {msg}"


def _value(tp: Any, value: Any, field: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return _convert(tp, value, field)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return None if value is None else _value(args[0], value, field)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config{field}={value!r} must be a list")
        (inner, *_) = typing.get_args(tp) or (Any,)
        return tuple(_value(inner, v, field) for v in value)
    return _scalar(tp, value, field)


def _scalar(tp: Any, value: Any, field: str) -> Any:
    if tp is Any:
        return value
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise ConfigError(f"config{field}={value!r} has type {type(value).__name__}, "
                          f"expected {tp.__name__}")
    return value


def to_dict(cfg: Any) -> dict:
    """Plain nested dict of a config (for logging and checkpoint metadata)."""
    return dataclasses.asdict(cfg)
