"""Run configuration: an ``ml_collections.ConfigDict`` turned into frozen, validated dataclasses.

Configs are Python files with ``get_config()`` (see ``configs/``; ``configs/X.py:VARIANT`` calls
``get_config("VARIANT")``); command-line overrides use ``--config.a.b=v``, applied by
ml_collections' ``config_flags`` (``rlx.commandline.config_from_argv``, the one reading of a
command line that ``rlx.launch``, ``rlx.eval`` and ``rlx.plan`` share). ``parse_config`` walks
the dataclass schema below, refuses unknown keys and wrong types with the dotted field name, then
each section validates its values once. Every error is a ``ConfigError`` whose message is a single
line naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from typing import Any

import ml_collections

from rlx.errors import ConfigError, one_of
from rlx.io.trackers import LogSection
from rlx.learner.advantages import ESTIMATORS, TOKEN_ESTIMATORS
from rlx.learner.critic import CriticSection
from rlx.learner.losses import LossConfig
from rlx.learner.preference import ALGORITHMS
from rlx.learner.state import MODES, OptimizerConfig
from rlx.learner.step import FORWARDS, StepConfig
from rlx.mesh import MeshShape
from rlx.models.classifier import RewardModelSection
from rlx.models.loading import ModelSection, resolve_path
from rlx.quant.config import LoraConfig, QuantConfig
from rlx.rewards.judge import JudgeConfig
from rlx.rollout.config import RolloutSection


ROLLOUTS = ("auto", "global", "primary", "per_host")


@dataclasses.dataclass(frozen=True)
class DistributedSection:
    """Multi-host runs (``jax.distributed``; ``rlx.run.hosts`` says which process does what); off for
    a single process. Every process reads ``data.prompts_per_step / data_shards`` prompts per
    step from each of its data shards."""

    enabled: bool = False  # call jax.distributed.initialize before anything else
    coordinator_address: str = ""  # "host:port"; empty: auto-detect (TPU, SLURM)
    num_processes: int = 0  # 0: auto-detect
    process_id: int = 0  # ignored when auto-detecting
    # "global": every process runs the built-in engine as one program over the whole mesh, on
    # the learner's arrays | "primary": process 0 samples all prompts | "per_host": each its own
    # (both from a host copy of the model) | "auto": "global" with the built-in engine,
    # "primary" with servers (SGLang: process 0 drives them)
    rollouts: str = "auto"

    def resolved_rollouts(self, engine: str) -> str:
        """``rollouts`` with "auto" decided for ``rollout.engine``."""
        if self.rollouts != "auto":
            return self.rollouts
        return "global" if engine == "jax" else "primary"
    data_shards: int = 0  # 0: one per process; fixed (a multiple of it): same batches on any count
    # seconds a process may go silent before the others count it lost and stop (rlx.run.multihost)
    heartbeat_timeout_s: int = 300

    def validate(self) -> None:
        if self.num_processes < 0:
            raise ConfigError("config.distributed.num_processes must be >= 0 (0 = auto-detect)")
        if self.enabled and self.num_processes and not (0 <= self.process_id < self.num_processes):
            raise ConfigError(f"config.distributed.process_id={self.process_id} must be in "
                              f"[0, {self.num_processes})")
        one_of("config.distributed.rollouts", self.rollouts, ROLLOUTS)
        if self.data_shards < 0:
            raise ConfigError("config.distributed.data_shards must be >= 0 (0 = one per process)")
        if self.heartbeat_timeout_s < 2:
            raise ConfigError(f"config.distributed.heartbeat_timeout_s={self.heartbeat_timeout_s} "
                              "must be >= 2 seconds")
        if self.enabled and self.num_processes and self.data_shards % self.num_processes:
            raise ConfigError(f"config.distributed.data_shards={self.data_shards} must be a "
                              f"multiple of num_processes={self.num_processes}")


FIELD_SOURCES = ("hf", "jsonl", "parquet")  # source prefixes that read config.data.*_field


@dataclasses.dataclass(frozen=True)
class DataSection:
    """Prompts for training and the held-out set for evaluation."""

    # a registered source (mmath:math500, arith:add2, jsonl:PATH, hf:NAME[:CONFIG][@SPLIT], ...)
    source: str = "arith:basic"
    # record fields of hf:, jsonl: and parquet: sources ("" = "prompt" / "answer"); an hf:
    # source's other text and number fields reach the reward as extra fields
    prompt_field: str = ""  # the field holding the question text
    answer_field: str = ""  # the field holding the gold answer
    prompts_per_step: int = 8  # prompts per RL step (each sampled rollout.group_size times)
    max_prompt_tokens: int = 512  # longer prompts are skipped and counted
    system_prompt: str = ""  # system message put first ("" = the chat template's default)
    template: str = "{prompt}"  # applied to the user message; must contain {prompt}
    eval_size: int = 64  # held-out problems (from the eval split, disjoint from training)
    # named eval sets, "NAME=SOURCE" or "SOURCE" (spelled like source), e.g. ("mmath:math500",
    # "aime24=mmath:aime24"): pass@1, mean@k, pass@k each per train.eval_every (rlx.data.eval_sets)
    eval_sources: tuple[str, ...] = ()
    eval_samples: int = 1  # samples per problem of the eval sets: the k of mean@k and pass@k

    def validate(self) -> None:
        if self.prompts_per_step < 1 or self.eval_size < 0 or self.max_prompt_tokens < 1:
            raise ConfigError("config.data.prompts_per_step and max_prompt_tokens must be >= 1, "
                              "eval_size >= 0")
        if self.eval_samples < 1:
            raise ConfigError(f"config.data.eval_samples={self.eval_samples} must be >= 1")
        if "{prompt}" not in self.template:
            raise ConfigError(f"config.data.template={self.template!r} must contain {{prompt}}")
        prefix = self.source.partition(":")[0]
        if (self.prompt_field or self.answer_field) and prefix not in FIELD_SOURCES:
            raise ConfigError(f"config.data.prompt_field / answer_field name record fields of "
                              f"{', '.join(p + ':' for p in FIELD_SOURCES)} sources, not of "
                              f"{self.source!r}: leave them empty")


@dataclasses.dataclass(frozen=True)
class TrainSection:
    """The RL loop."""

    mode: str = "lora"  # "lora": frozen base + adapter | "full": every parameter (rlx.learner.state.MODES)
    # rlx.learner.preference.ALGORITHMS: "rl" (sample, score, advantages, policy loss) | "dpo"
    # (preference pairs from data.source, loss.dpo_*; the reference is the adapter switched off,
    # or in mode "full" a frozen copy of the initial parameters, sharded as the policy's)
    algorithm: str = "rl"
    steps: int = 100  # RL steps (generate -> score -> update)
    # an estimator of rlx.learner.advantages.ESTIMATORS (grpo, dr_grpo, rloo, reinforce_pp) or
    # TOKEN_ESTIMATORS ("gae": PPO with the learned critic of config.critic)
    advantage: str = "grpo"
    micro_batches: int = 1  # gradient accumulation inside one compiled update
    # > 0: micro-batches by tokens instead of by micro_batches: each holds this many tokens per
    # data-parallel shard (a packed row this long; padded rows as many as fit), their number
    # following the batch's tokens; a rollout longer than the budget makes the step's rows its
    # bucketed length, its row's micro-batch that long (rlx.learner.batching.batch_layout). 0: off
    tokens_per_micro_batch: int = 0
    # several rollouts per row (segment ids 1, 2, ..., positions restarting at 0 per rollout,
    # attention masked by segment: the loss and its gradients are those of padded rows) in rows
    # of the longest rollout's bucketed length, or of tokens_per_micro_batch; False: one rollout
    # per row, padded. DPO pads always (its chosen and rejected replies pair up by row)
    pack: bool = True
    epochs: int = 1  # passes over each rollout batch (PPO epochs)
    minibatches: int = 1  # optimizer updates per pass, each over its share of the batch's rows
    logprob_chunk: int = 512  # tokens per chunk of the chunked log-softmax
    # padded train-row lengths per doubling (rlx.learner.batching.train_buckets): a batch pads its
    # longest row by at most 1/n, and the train step compiles at most n shapes per doubling
    length_buckets: int = 8
    remat: str = "none"  # a key of rlx.learner.step.FORWARDS: "none" keeps every activation;
    # "layer" keeps layer inputs and recomputes; "projections" keeps every linear layer's output and
    # recomputes attention, norms and activations
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal
    # a registered reward (math, code, tool_call, judge: config.judge, ...) or "reward_model"
    # (config.reward_model)
    reward: str = "math"
    math_extractors: tuple[str, ...] = ("boxed", "hash", "answer_is")  # math answer extraction order
    eval_every: int = 10  # steps between evaluations (0 = only at the start and the end)
    checkpoint_every: int = 0  # steps between checkpoints (0 = only at exit)
    keep_checkpoints: int = 2  # checkpoints kept on disk
    # batches of rollouts in flight: 0 synchronous on-policy; k >= 1 the batch of step t + k is
    # generated with the weights of step t while the learner works (1: one-step-off)
    max_staleness: int = 0
    max_skipped_steps: int = 3  # stop after this many updates in a row skipped for NaN/Inf
    sample_every: int = 10  # steps between logged sample completions
    # MoE routing replay: the built-in engine records each token's experts in every MoE layer and
    # the learner's forward passes use them (gates from the learner's router over those experts)
    router_replay: bool = False

    def validate(self) -> None:
        one_of("config.train.mode", self.mode, MODES)
        one_of("config.train.algorithm", self.algorithm, ALGORITHMS)
        one_of("config.train.remat", self.remat, FORWARDS)
        one_of("config.train.advantage", self.advantage, (*ESTIMATORS, *TOKEN_ESTIMATORS))
        if self.max_staleness < 0:
            raise ConfigError(f"config.train.max_staleness={self.max_staleness} must be >= 0 (0: "
                              "synchronous; k: up to k batches of rollouts in flight)")
        if self.steps < 0 or self.micro_batches < 1 or self.logprob_chunk < 1:
            raise ConfigError("config.train.steps must be >= 0, micro_batches and logprob_chunk >= 1")
        if self.tokens_per_micro_batch < 0:
            raise ConfigError(f"config.train.tokens_per_micro_batch={self.tokens_per_micro_batch} "
                              "must be >= 0 (tokens per micro-batch and data-parallel shard, e.g. "
                              "8192; 0: train.micro_batches fixed micro-batches)")
        if self.epochs < 1 or self.minibatches < 1:
            raise ConfigError(f"config.train.epochs={self.epochs} and minibatches="
                              f"{self.minibatches} must be >= 1 (1 and 1: one update per batch)")
        if self.length_buckets < 1:
            raise ConfigError(f"config.train.length_buckets={self.length_buckets} must be >= 1 "
                              "(padded row lengths per doubling; 8: at most 12.5% padding)")
        if self.max_skipped_steps < 1:
            raise ConfigError(f"config.train.max_skipped_steps={self.max_skipped_steps} must be >= 1")
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1:
            raise ConfigError("config.train.checkpoint_every must be >= 0 (0: only at exit) and "
                              "keep_checkpoints >= 1")


ENV_KINDS = ("single", "tools", "verifiers")


def check_verifiers(reference: str, args: str) -> None:
    """``env.verifiers`` names a function and ``env.verifiers_args`` is a JSON object."""
    module, _, function = reference.partition(":")
    if not module or not function:
        raise ConfigError(f"config.env.verifiers={reference!r} must name the function that "
                          "returns the environment: 'package.module:function'")
    try:
        parsed = json.loads(args)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ConfigError(f"config.env.verifiers_args={args!r} must be a JSON object of the "
                          'function\'s keyword arguments, e.g. \'{"num_tasks": 8}\'')


@dataclasses.dataclass(frozen=True)
class EnvSection:
    """The rollout's shape: one completion per sample, or multi-turn tool-use episodes
    (``rlx.envs``: the policy calls tools, their outputs come back as tool turns, the final answer
    is graded with ``train.reward``)."""

    kind: str = "single"  # "single": one completion per sample | "tools": tool-use episodes
    max_turns: int = 4  # assistant turns per episode, the final answer included ("tools")
    max_episode_tokens: int = 1024  # model + tool tokens after the prompt, per episode ("tools")
    # tools offered: registered names (rlx.envs.registry.TOOLS: calculator, python) or a user
    # function "package.module:function" (its signature is the tool's schema)
    tools: tuple[str, ...] = ("calculator",)
    format_coef: float = 0.0  # added to an episode's reward when it called a tool and ended with
    # an answer, every call having parsed and run (0: outcome reward only)
    demo: bool = False  # open each episode with a worked call of each tool that has one
    # text the first assistant turn opens with, written into the prompt and not sampled (e.g.
    # "<tool_call>\n": the model completes a call rather than choosing to make one); "" none
    assistant_prefix: str = ""
    # the model's tool-call syntax, for episodes and train.reward="tool_call": "auto" the one its
    # chat template shows (hermes when none) | hermes | llama3_json | deepseek_v3 | harmony
    # (rlx.rewards.tool_formats; checked when the run is built)
    tool_format: str = "auto"
    # kind "verifiers": a verifiers 0.4 environment (rlx.envs.verifiers_env) from the function
    # "package.module:function" called with verifiers_args (a JSON object); its tasks replace
    # data.source, its tools and scoring the env.tools and train.reward
    verifiers: str = ""
    verifiers_args: str = "{}"

    def validate(self) -> None:
        one_of("config.env.kind", self.kind, ENV_KINDS)
        if self.kind == "verifiers":
            check_verifiers(self.verifiers, self.verifiers_args)
        if self.max_turns < 1 or self.max_episode_tokens < 1:
            raise ConfigError(f"config.env.max_turns={self.max_turns} and max_episode_tokens="
                              f"{self.max_episode_tokens} must be >= 1")
        if self.kind == "tools" and not self.tools:
            raise ConfigError("config.env.tools is empty: name at least one tool (e.g. "
                              "('calculator',)) or use env.kind='single'")
        if self.format_coef < 0:
            raise ConfigError(f"config.env.format_coef={self.format_coef} must be >= 0")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The whole run. Sections mirror the keys of ``get_config()``."""

    model: ModelSection = ModelSection()
    quant: QuantConfig = QuantConfig()  # frozen base representation + serving format (mode lora)
    lora: LoraConfig = LoraConfig()  # adapter shape (used when train.mode == "lora")
    mesh: MeshShape = MeshShape()  # device mesh sizes (rlx.mesh)
    data: DataSection = DataSection()
    rollout: RolloutSection = RolloutSection()
    env: EnvSection = EnvSection()  # single-turn completions or tool-use episodes (rlx.envs)
    train: TrainSection = TrainSection()
    judge: JudgeConfig = JudgeConfig()  # train.reward="judge": the LLM judge (rlx.rewards.judge)
    loss: LossConfig = LossConfig()  # policy loss, KL, entropy, truncated importance sampling
    critic: CriticSection = CriticSection()  # PPO's learned critic (train.advantage="gae")
    reward_model: RewardModelSection = RewardModelSection()  # train.reward="reward_model"
    optim: OptimizerConfig = OptimizerConfig()  # AdamW + schedule + clipping
    distributed: DistributedSection = DistributedSection()
    log: LogSection = LogSection()  # trackers: tensorboard, wandb, mlflow (rlx.io.trackers)
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

    @property
    def engine_copies_trainables(self) -> bool:
        """Whether the built-in engine keeps its own copy of the trainable variables: an
        asynchronous run (``train.max_staleness >= 1``) samples while the learner updates (and
        donates) them; a synchronous one samples from the learner's arrays after each sync."""
        return self.train.max_staleness > 0

    @property
    def step_config(self) -> StepConfig:
        """The learner steps' settings of this run (loss, micro-batches or their token budget,
        log-prob chunks)."""
        return StepConfig(loss=self.loss, micro_batches=self.train.micro_batches,
                          tokens_per_micro_batch=self.train.tokens_per_micro_batch,
                          logprob_chunk=self.train.logprob_chunk, compute_entropy=True)

    def check_warm_start(self) -> None:
        """``lora.init_from`` warm-starts a LoRA adapter: it needs ``train.mode="lora"``. (The
        PEFT folder itself is read before the build: ``rlx.run.checks.with_warm_start``.)"""
        if self.lora.init_from and self.train.mode != "lora":
            raise ConfigError(f"config.lora.init_from={self.lora.init_from!r} warm-starts a LoRA "
                              f"adapter, which needs train.mode='lora' (got {self.train.mode!r})")

    def validate(self) -> None:
        self.check_warm_start()
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if hasattr(section, "validate"):
                section.validate()
        self.resume_step  # noqa: B018 (validates)
        if self.train.mode == "full" and not self.quant.spec.float_base:
            raise ConfigError(f"config.train.mode='full' trains every parameter, but config.quant."
                              f"format={self.quant.format!r} freezes a quantized base; use "
                              "train.mode='lora' or quant.format='none'")
        self._check_critic()
        self.reward_model.check_used(self.train.reward, self.env.kind, self.distributed.enabled)
        if self.rollout.partial and not self.train.max_staleness:
            raise ConfigError("config.rollout.partial=True continues generations across weight "
                              "syncs, which needs batches in flight: set train.max_staleness >= 1")
        self._check_env()
        self._check_global_rollouts()
        if self.train.router_replay and self.rollout.engine != "jax":
            raise ConfigError(f"config.train.router_replay=True needs the routed experts of "
                              f"every sampled token, which only the built-in engine records "
                              f"(rollout.engine='jax'); rollout.engine={self.rollout.engine!r}: "
                              "SGLang can return them (--enable-return-routed-experts) but rlx's "
                              "SGLang client does not read them yet")
        if self.train.router_replay and (self.rollout.partial or self.env.kind != "single"):
            raise ConfigError("config.train.router_replay=True takes the routes of whole "
                              "single-turn completions; rollout.partial (segments) and "
                              "env.kind='tools' (episodes) do not carry them yet: turn those off")
        if self.train.algorithm == "dpo" and self.train.tokens_per_micro_batch:
            raise ConfigError(f"config.train.tokens_per_micro_batch="
                              f"{self.train.tokens_per_micro_batch}: DPO's micro-batches hold "
                              "whole pairs (a chosen and a rejected row each), counted by "
                              "train.micro_batches; set tokens_per_micro_batch=0")
        if self.train.algorithm == "dpo" and self.critic.enabled:
            raise ConfigError("config.train.algorithm='dpo' trains no critic; set "
                              "critic.enabled=False")
        try:
            self.step_config  # noqa: B018 (the learner step's own checks of these settings)
        except ValueError as e:
            raise ConfigError(f"config.{e}") from None


    def _check_env(self) -> None:
        if self.env.kind == "single":
            return
        clash = [f for f, on in (("rollout.partial", self.rollout.partial),
                                 ("train.algorithm='dpo'", self.train.algorithm == "dpo")) if on]
        if clash:
            raise ConfigError(f"config.env.kind={self.env.kind!r} runs whole episodes, which "
                              f"{clash[0]} does not support; turn it off or use env.kind='single'")

    def _check_global_rollouts(self) -> None:
        """``distributed.rollouts="global"`` runs the built-in engine (every process runs every
        step alike; episodes' env calls are split over the processes, ``rlx.envs.episode``).
        SGLang is driven by process 0 (``"primary"``)."""
        engine, rollouts = self.rollout.engine, self.distributed.rollouts
        if engine == "sglang" and rollouts == "per_host":
            raise ConfigError("config.distributed.rollouts='per_host' with rollout.engine="
                              "'sglang': process 0 sends every request to the servers and syncs "
                              "them; use distributed.rollouts='primary' (or 'auto')")
        if engine != "jax" and rollouts == "global":
            raise ConfigError(f"config.distributed.rollouts='global' runs the built-in engine "
                              f"(rollout.engine='jax'), not {engine!r}: use "
                              "distributed.rollouts='primary' (or 'auto')")

    def _check_critic(self) -> None:
        gae, critic = self.train.advantage in TOKEN_ESTIMATORS, self.critic
        if gae and not critic.enabled:
            raise ConfigError(f"config.train.advantage={self.train.advantage!r} needs a learned "
                              "critic: set config.critic.enabled=True (or choose an outcome "
                              f"estimator: {sorted(ESTIMATORS)})")
        if critic.enabled and not gae:
            raise ConfigError(f"config.critic.enabled=True trains a critic that only "
                              f"train.advantage in {list(TOKEN_ESTIMATORS)} reads; the run's is "
                              f"{self.train.advantage!r}")
        if critic.path and self.train.mode == "lora":
            raise ConfigError(f"config.critic.path={critic.path!r}: in train.mode='lora' the critic "
                              "is a second adapter on the policy's frozen base; leave "
                              "critic.path empty (a separate critic model is for mode 'full')")
        if critic.path and not os.path.exists(resolve_path(critic.path)):
            raise ConfigError(f"config.critic.path={critic.path!r} does not exist; point it at a "
                              "HF model folder or a .gguf file with the policy's vocabulary")


def parse_config(cd: ml_collections.ConfigDict | dict, cls: type = RunConfig) -> Any:
    """Convert and validate; raises ``ConfigError`` naming the offending field."""
    cfg = read_config(cd, cls)
    cfg.validate()
    return cfg


def read_config(cd: ml_collections.ConfigDict | dict, cls: type = RunConfig) -> Any:
    """Convert only: known keys, types and each section's own checks of its values, without
    ``validate`` (which also looks the run up on this machine: the checkpoint, SGLang's python,
    the trackers). The memory planner reads a run it need not be able to start here."""
    return _convert(cls, cd, "")


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
    except (ValueError, TypeError) as e:  # a section's own check (ConfigError is a ValueError)
        if str(e).startswith("config"):  # already names its dotted field
            raise
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


def schema_fields(cls: type = RunConfig, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """Every field of the run config by dotted name (``train.steps``, ``model.shrink.enabled``):
    (its type, its default). Sections are walked, not listed."""
    hints, out = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        name, tp = f"{prefix}{f.name}", hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(schema_fields(tp, f"{name}."))
        else:
            default = (f.default_factory() if f.default is dataclasses.MISSING  # type: ignore[misc]
                       else f.default)
            out[name] = (tp, default)
    return out


def to_dict(cfg: Any) -> dict:
    """Plain nested dict of a config (for logging and checkpoint metadata)."""
    return dataclasses.asdict(cfg)
