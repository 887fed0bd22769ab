"""``rlx.build(config) -> Run`` (defined here): everything a run needs, from a validated config.

Mesh, model (``train.mode="full"``: every parameter trains; ``"lora"``: the base frozen in its
quantized representation with LoRA adapters), train state, compiled steps, rollout engine, data,
reward, logger. The returned ``Run`` (``rlx.run.loop``) drives the loop; the CLI and notebooks
both start here. The config is validated once (``rlx.config.parse_config``), then checked against
the devices and the model's architecture (``rlx.run.checks``) before any weight is read.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import grain
import jax
import ml_collections
import optax
from flax import nnx
from jax.sharding import Mesh

from rlx.config import RunConfig, parse_config, to_dict
from rlx.data.chat import PromptFormat
from rlx.data.eval import distinct_examples
from rlx.data.overlap import count_overlap
from rlx.data.pipeline import make_prompt_pipeline
from rlx.data.sources import Example, FieldMap, ListSource, Source, get_source
from rlx.envs.episode import EpisodeShare
from rlx.envs.runner import EnvRunner, episode_tool_format, make_runner
from rlx.envs.verifiers_env import make_verifiers_runner, verifiers_source
from rlx.errors import ConfigError
from rlx.io.metrics import METRICS_FILE, LoggerConfig, MetricsLogger, read_metrics
from rlx.learner.critic import (init_critic, make_critic_step, make_value_step, read_value_head,
                                value_head)
from rlx.learner.preference import make_dpo_step
from rlx.learner.state import (MODES, TrainState, create_train_state, make_optimizer,
                               state_shardings, with_reference)
from rlx.learner.step import (FORWARDS, Compiled, make_logprob_step, make_train_step,
                              model_forward, reference_forward)
from rlx.mesh import make_mesh
from rlx.models import load_from_section
from rlx.models.decoder import Transformer
from rlx.models.loading import ShrinkSection, resolve_path
from rlx.models.stack import stack_layers
from rlx.models.tokenizer import Tokenizer
from rlx.platform import policy_of
from rlx.quant import apply_lora, load_base
from rlx.quant.peft_import import (abstract_lora_model, check_peft_adapter, load_peft_adapter,
                                   read_peft_adapter)
from rlx.rewards import RewardFn, get_reward
from rlx.rewards.tool_formats import FORMATS, detect_format
from rlx.run.checks import check_before_build, read_architecture, with_warm_start
from rlx.run.engines import make_engine
from rlx.run.heldout import named_eval_sets
from rlx.run.hosts import Hosts
from rlx.run.learn import needs_old_logprobs
from rlx.run.lifecycle import checkpoint_dir, open_checkpointer, restore
from rlx.run.loop import Run
from rlx.run.multihost import initialize_from
from rlx.run.reward_model import NAME as REWARD_MODEL, RewardModelReward
from rlx.types import RolloutEngine

log = logging.getLogger(__name__)


def build(config: RunConfig | ml_collections.ConfigDict | dict, *, progress: bool = True,
          sampling_overrides: dict[str, Any] | None = None) -> Run:
    """Validate ``config`` (if needed) and assemble a ready-to-step ``Run``; ``sampling_overrides``:
    ``SamplingParams`` fields of its training rollouts beside the config's (``Run``)."""
    cfg = with_warm_start(config if isinstance(config, RunConfig) else parse_config(config))
    initialize_from(cfg.distributed, checkpoint_dir(cfg))  # its watchdog names the last one
    hosts = Hosts.from_config(cfg)  # which processes sample, which data shards each reads
    check_before_build(cfg, jax.device_count())  # before any weight is read or compiled
    mesh = make_mesh(cfg.mesh)
    model, tokenizer = load_policy(cfg, mesh)
    if tokenizer is None:
        raise ValueError(f"config.model.path={cfg.model.path!r} carries no tokenizer; RL needs one")
    compiled = compile_steps(cfg, model, mesh)
    engine = hosts.engine(lambda c, m: make_engine(cfg, c, tokenizer, m), compiled, mesh)
    try:  # from here on a failure must not leave the engine's servers running
        return _run(cfg, mesh, compiled, engine, tokenizer, progress, hosts,
                    dict(sampling_overrides or {}))
    except BaseException:
        if engine is not None:  # None on a process that does not sample
            engine.close()
        raise


def _run(cfg: RunConfig, mesh: Mesh, compiled: Compiled, engine: RolloutEngine | None,
         tokenizer: Tokenizer, progress: bool, hosts: Hosts, sampling_overrides: dict) -> Run:
    """Data, evaluation set, checkpoints (restored when resuming), logger and reward."""
    train = run_source(cfg, "train")  # read once: the prompts and both contamination counts
    data = prompt_data(cfg, tokenizer, hosts, train)
    checkpointer = open_checkpointer(cfg, compiled.state)
    try:
        start, compiled.state, in_flight = restore(cfg, checkpointer, compiled.state, data, hosts)
    except BaseException:
        checkpointer.close()
        raise
    if start:
        hosts.sync_weights(engine, compiled, start)
    earlier = [r for r in _logged(cfg.output_dir) if r["step"] <= start] if start else []
    reward = make_reward(cfg, tokenizer, mesh)
    return Run(cfg=cfg, mesh=mesh, compiled=compiled, engine=engine, tokenizer=tokenizer,
               data=data, eval_set=checked_eval_examples(cfg, train),
               prompt_format=prompt_format(cfg), eval_sets=named_eval_sets(cfg, train),
               reward=reward, logger=make_logger(cfg, start, progress),
               step_count=start, checkpointer=checkpointer, metrics=earlier, hosts=hosts,
               resumed_in_flight=in_flight, sampling_overrides=sampling_overrides,
               env=make_env_runner(cfg, reward, tokenizer, hosts.episode_share()))


def prompt_format(cfg: RunConfig) -> PromptFormat:
    """How a data record becomes the user turn (``config.data.template`` / ``system_prompt``)."""
    return PromptFormat(system_prompt=cfg.data.system_prompt or None, template=cfg.data.template)


def prompt_data(cfg: RunConfig, tokenizer: Tokenizer, hosts: Hosts,
                source: Source | None = None) -> grain.DatasetIterator:
    """This process's training prompts: ``data.prompts_per_step`` per step over its data shards
    (of ``source``, the run's training source, read here when not given)."""
    source = run_source(cfg, "train") if source is None else source
    return hosts.prompt_data(lambda index, count, size: make_prompt_pipeline(
        source, tokenizer, batch_size=size, seed=cfg.seed,
        shard_index=index, shard_count=count, max_prompt_tokens=cfg.data.max_prompt_tokens,
        prompt_format=prompt_format(cfg)), cfg.data.prompts_per_step)


def eval_examples(cfg: RunConfig) -> list[Example]:
    """``data.eval_size`` distinct held-out problems (none when it is 0)."""
    if not cfg.data.eval_size:
        return []
    return distinct_examples(run_source(cfg, "eval"),
                             cfg.data.eval_size)


def checked_eval_examples(cfg: RunConfig, train: Source) -> list[Example]:
    """``eval_examples``, after logging how many problems of ``train`` (the training source)
    share a normalised prompt with one of them (in-memory sources; a generated one is not read
    through)."""
    held = eval_examples(cfg)
    if held and isinstance(train, ListSource):
        overlap = count_overlap(train, held)
        (log.warning if overlap.count else log.info)(
            "contamination: %s", overlap.describe(cfg.data.source, "the evaluation set"))
    return held


def run_source(cfg: RunConfig, split: str) -> Source:
    """The run's ``split`` of ``data.source``, or with ``env.kind="verifiers"`` of the
    environment's tasks (``rlx.envs.verifiers_env``)."""
    if cfg.env.kind != "verifiers":
        return get_source(cfg.data.source, split, **source_options(cfg))
    try:
        return verifiers_source(cfg.env.verifiers, split, cfg.env.verifiers_args)
    except ValueError as e:
        raise ConfigError(f"config.{e}" if str(e).startswith("env.") else str(e)) from None


def source_options(cfg: RunConfig) -> dict[str, FieldMap]:
    """``data.prompt_field`` / ``answer_field`` as the source's ``FieldMap`` (none when unset)."""
    if not (cfg.data.prompt_field or cfg.data.answer_field):
        return {}
    return {"fields": FieldMap(prompt_field=cfg.data.prompt_field or "prompt",
                               answer_field=cfg.data.answer_field or "answer")}


def tool_format(cfg: RunConfig, tokenizer: Tokenizer | None) -> str:
    """``env.tool_format``: the format it names, or for "auto" the one the tokenizer's chat
    template shows (``rlx.rewards.tool_formats.detect_format``; hermes without a template)."""
    name = cfg.env.tool_format
    if name == "auto":
        return detect_format(None if tokenizer is None else tokenizer.chat_template)
    if name not in FORMATS:
        raise ConfigError(f"config.env.tool_format={name!r} is not 'auto' (the chat template's "
                          f"format) or one of {list(FORMATS)}")
    return name


def make_reward(cfg: RunConfig, tokenizer: Tokenizer | None = None,
                mesh: Mesh | None = None) -> RewardFn:
    """The reward ``train.reward`` names (the math reward with ``train.math_extractors``, the
    call reward reading ``env.tool_format``'s syntax, the judge with ``config.judge``, the reward
    model on ``mesh``)."""
    fmt = tool_format(cfg, tokenizer)  # checked whichever reward reads it
    if cfg.train.reward == REWARD_MODEL:
        return RewardModelReward(cfg.reward_model, mesh)
    kw: dict[str, Any] = {"math": {"extractors": cfg.train.math_extractors},
                          "tool_call": {"tool_format": fmt},
                          "judge": {"config": cfg.judge}}.get(cfg.train.reward, {})
    return get_reward(cfg.train.reward, **kw)


def make_env_runner(cfg: RunConfig, reward: RewardFn, tokenizer: Tokenizer,
                    share: EpisodeShare | None = None) -> EnvRunner | None:
    """``env.kind="tools"``: the tool-use episodes' runner (``rlx.envs.runner``) offering
    ``env.tools``, grading final answers with the run's reward; ``"verifiers"``: the verifiers
    environment's episodes (``rlx.envs.verifiers_env``); None for single turns. ``share``:
    several processes drive every episode (``"global"`` rollouts)."""
    if cfg.env.kind == "single":
        return None
    runner = _env_runner(cfg, reward, tokenizer)
    runner.share = share
    return runner


def _env_runner(cfg: RunConfig, reward: RewardFn, tokenizer: Tokenizer) -> EnvRunner:
    try:
        fmt = episode_tool_format(tokenizer, tool_format(cfg, tokenizer))
    except ValueError as e:
        raise ConfigError(f"config.env.tool_format={cfg.env.tool_format!r}: {e}") from None
    if cfg.env.kind == "verifiers":
        return make_verifiers_runner(
            cfg.env.verifiers, cfg.env.verifiers_args, tokenizer,
            dataclasses.replace(prompt_format(cfg), tool_format=fmt), max_turns=cfg.env.max_turns,
            max_episode_tokens=cfg.env.max_episode_tokens, format_coef=cfg.env.format_coef,
            assistant_prefix=cfg.env.assistant_prefix)
    try:
        return make_runner(cfg.env.tools, reward, tokenizer,
                           dataclasses.replace(prompt_format(cfg), tool_format=fmt),
                           max_turns=cfg.env.max_turns, max_episode_tokens=cfg.env.max_episode_tokens,
                           format_coef=cfg.env.format_coef, demo=cfg.env.demo,
                           assistant_prefix=cfg.env.assistant_prefix)
    except ValueError as e:
        raise ConfigError(f"config.env.tools: {e}") from None


def make_logger(cfg: RunConfig, start: int, progress: bool = True) -> MetricsLogger:
    """Tensorboard, ``metrics.jsonl`` and the trackers of ``config.log``, told the whole config; a
    run resumed at step ``start`` > 0 continues the trackers' runs."""
    return MetricsLogger(LoggerConfig(logdir=cfg.output_dir, total_steps=cfg.train.steps,
                                      text_every=max(cfg.train.sample_every, 1), progress=progress,
                                      trackers=cfg.log.trackers, project=cfg.log.project,
                                      run_name=cfg.log.run_name, run_config=to_dict(cfg)),
                         start_step=start)


def _logged(output_dir: str) -> list[dict]:
    """The metrics an interrupted run logged (a resumed run continues its record)."""
    path = os.path.join(output_dir, METRICS_FILE)
    return read_metrics(path) if os.path.exists(path) else []


def load_policy(cfg: RunConfig, mesh: Mesh) -> tuple[Transformer, Tokenizer | None]:
    """Mode "lora": the base in its serving representation + adapters (``lora.init_from``: those
    of a PEFT folder, its rank, alpha and targets in ``cfg`` (``rlx.run.checks.with_warm_start``),
    checked against the base's shapes before any weight is read); "full": the
    float model. The base streams in (``rlx.quant.load_base``): a shipped quantized checkpoint as
    stored, a float one quantized tensor by tensor, never whole in float."""
    warm = cfg.lora.init_from if cfg.train.mode == "lora" else ""
    if warm:
        check_peft_adapter(read_peft_adapter(warm), abstract_lora_model(
            read_architecture(cfg)[0], cfg.model.precision, cfg.lora))
    loaded, _ = load_base(cfg.model, cfg.quant, mesh, seed=cfg.seed)
    model = loaded.model
    if cfg.train.mode == "lora":
        apply_lora(model, cfg.lora, nnx.Rngs(cfg.seed), mesh=mesh)
    if warm:
        load_peft_adapter(model, warm)
    policy, recompute = policy_of(mesh), cfg.train.remat != "none"
    if cfg.model.scans(model.config, policy, recompute):  # after quantization and adapters
        stack_layers(model, consume=True)  # rlx.models.stack; files on disk stay per layer
    return model, loaded.tokenizer


def compile_steps(cfg: RunConfig, model: Transformer, mesh: Mesh) -> Compiled:
    """Train state over the mesh, the train step, (with a KL term or DPO) the reference log-prob
    step: LoRA mode the adapter switched off, so the reference costs no second copy of the weights;
    full mode a frozen copy of the initial parameters (``TrainState.ref``, sharded as the policy's);
    and (several updates per batch) the policy's log-prob step for the old log-probs."""
    optimizer = make_optimizer(cfg.optim)
    graphdef, state = create_train_state(model, optimizer, mesh, trainable=MODES[cfg.train.mode],
                                         seed=cfg.seed, capacity_factor=cfg.model.capacity_factor)
    if cfg.train.mode == "full" and (cfg.loss.kl_coef > 0 or cfg.train.algorithm == "dpo"):
        state = with_reference(state, optimizer, mesh)  # frozen copy of the initial params
    critic_graphdef = None
    if cfg.critic.enabled:
        critic_graphdef, state = attach_critic(cfg, graphdef, state, optimizer, mesh,
                                               model.config.hidden_size)
    step_cfg = cfg.step_config
    if cfg.train.algorithm == "dpo":
        train_step = make_dpo_step(graphdef, state, mesh, step_cfg, cfg.optim,
                                   beta=cfg.loss.dpo_beta,
                                   label_smoothing=cfg.loss.dpo_label_smoothing,
                                   apply_fn=FORWARDS[cfg.train.remat])
    else:
        train_step = make_train_step(graphdef, state, mesh, step_cfg, cfg.optim,
                                     apply_fn=FORWARDS[cfg.train.remat])
    ref_step = old_step = None
    if cfg.loss.kl_coef > 0 or cfg.train.algorithm == "dpo":
        ref_step = make_logprob_step(graphdef, state.params, state.frozen, mesh, step_cfg,
                                     apply_fn=reference_forward if state.ref is None
                                     else model_forward)
    if needs_old_logprobs(cfg):
        old_step = make_logprob_step(graphdef, state.params, state.frozen, mesh, step_cfg)
    compiled = Compiled(graphdef=graphdef, state=state, train_step=train_step, ref_step=ref_step,
                        old_step=old_step, max_positions=model.config.position_limit)
    if critic_graphdef is None:
        return compiled
    return dataclasses.replace(
        compiled, critic_graphdef=critic_graphdef,
        value_step=make_value_step(critic_graphdef, state, mesh, optimizer),
        critic_step=make_critic_step(critic_graphdef, state, mesh, optimizer,
                                     value_clip=cfg.critic.value_clip,
                                     micro_batches=cfg.train.micro_batches,
                                     tokens_per_micro_batch=cfg.train.tokens_per_micro_batch,
                                     apply_fn=FORWARDS[cfg.train.remat]))


def attach_critic(cfg: RunConfig, graphdef: nnx.GraphDef, state: TrainState,
                  optimizer: optax.GradientTransformation, mesh: Mesh, hidden_size: int
                  ) -> tuple[nnx.GraphDef, TrainState]:
    """PPO's critic on the mesh (``rlx.learner.critic``): LoRA mode a second adapter on the
    policy's base, full mode a copy of the policy or the model ``critic.path`` names (starting
    from the value head it carries, if any); its graph and the state holding it."""
    critic_optimizer = make_optimizer(dataclasses.replace(
        cfg.optim, learning_rate=cfg.critic.learning_rate))
    if cfg.critic.path:
        section = dataclasses.replace(cfg.model, path=cfg.critic.path, format="auto",
                                      shrink=ShrinkSection())
        loaded = load_from_section(section, mesh, seed=cfg.seed)
        critic_graphdef, body, frozen = nnx.split(loaded.model, nnx.Param, ...)
        head = value_head(loaded.model.config.hidden_size,
                          *read_value_head(resolve_path(cfg.critic.path)))
    else:
        critic_graphdef, body, frozen = graphdef, state.params, None
        head = value_head(hidden_size)
    critic = init_critic(body, head, critic_optimizer, frozen)
    state = state.replace(critic=critic)
    return critic_graphdef, jax.device_put(state, state_shardings(state, optimizer, mesh))


__all__ = ["attach_critic", "build", "compile_steps", "eval_examples", "load_policy", "make_env_runner",
           "make_logger", "make_reward",
           "prompt_data", "prompt_format"]
