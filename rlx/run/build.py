"""``rlx.build(config) -> Run`` (defined here): everything a run needs, from a validated config.

Mesh, model (mode A: all parameters; mode B: the base frozen in its quantized representation and
LoRA adapters), train state, compiled steps, rollout engine, data, reward, logger. The returned
``Run`` (``rlx.run.loop``) drives the loop; the CLI and notebooks both start here.
"""

from __future__ import annotations

import jax
import ml_collections
from flax import nnx

from rlx.config import RunConfig, parse_config, resolve_path
from rlx.run.checks import check_before_build
from rlx.run.loop import Compiled, Run
from rlx.data.chat import PromptFormat
from rlx.data.eval import distinct_examples
from rlx.data.pipeline import make_prompt_pipeline
from rlx.data.sources import get_source
from rlx.run.hosts import Hosts
from rlx.learner.state import create_train_state, make_optimizer
from rlx.learner.step import FORWARDS, StepConfig, make_logprob_step, make_train_step, reference_forward
from rlx.run.lifecycle import open_checkpointer, restore
from rlx.mesh import MeshShape, make_mesh
from rlx.io.metrics import LoggerConfig, MetricsLogger
from rlx.models import load_from_section
from rlx.run.multihost import initialize_from
from rlx.quant import apply_lora, load_gguf_quantized, quantize_model
from rlx.rewards import get_reward


def build(config: RunConfig | ml_collections.ConfigDict | dict, *, progress: bool = True) -> Run:
    """Validate ``config`` (if needed) and assemble a ready-to-step ``Run``."""
    cfg = config if isinstance(config, RunConfig) else parse_config(config)
    initialize_from(cfg.distributed)
    hosts = Hosts.from_config(cfg)  # which processes sample, which data shards each reads
    check_before_build(cfg, jax.device_count())  # before any weight is read or compiled
    m = cfg.mesh
    mesh = make_mesh(MeshShape(m.data, m.fsdp, m.tensor, m.expert))
    model, tokenizer = load_policy(cfg, mesh)
    if tokenizer is None:
        raise ValueError(f"config.model.path={cfg.model.path!r} carries no tokenizer; RL needs one")
    compiled = compile_steps(cfg, model, mesh)
    engine = hosts.engine(lambda c, m: make_engine(cfg, c, tokenizer, m), compiled, mesh)
    try:  # from here on a failure must not leave the engine's servers running
        return _run(cfg, mesh, compiled, engine, tokenizer, progress, hosts)
    except BaseException:
        if engine is not None:  # None on a process that does not sample
            engine.close()
        raise


def _run(cfg: RunConfig, mesh, compiled: Compiled, engine, tokenizer, progress: bool,
         hosts: Hosts) -> Run:
    """Data, evaluation set, checkpoints (restored when resuming), logger and reward."""
    fmt = PromptFormat(system_prompt=cfg.data.system_prompt or None, template=cfg.data.template)
    data = hosts.prompt_data(lambda index, count, size: make_prompt_pipeline(
        get_source(cfg.data.source, "train"), tokenizer, batch_size=size, seed=cfg.seed,
        shard_index=index, shard_count=count, max_prompt_tokens=cfg.data.max_prompt_tokens,
        prompt_format=fmt), cfg.data.prompts_per_step)
    eval_set = distinct_examples(get_source(cfg.data.source, "eval"), cfg.data.eval_size) \
        if cfg.data.eval_size else []
    checkpointer = open_checkpointer(cfg, compiled.state)
    try:
        start, compiled.state = restore(cfg, checkpointer, compiled.state, data)
    except BaseException:
        checkpointer.close()
        raise
    if start:
        hosts.sync_weights(engine, compiled, start)
    earlier = [r for r in _logged(cfg.output_dir) if r["step"] <= start] if start else []
    logger = MetricsLogger(LoggerConfig(logdir=cfg.output_dir, total_steps=cfg.train.steps,
                                        text_every=max(cfg.train.sample_every, 1), progress=progress),
                           start_step=start)
    reward_kw = {"extractors": cfg.train.math_extractors} if cfg.train.reward == "math" else {}
    return Run(cfg=cfg, mesh=mesh, compiled=compiled, engine=engine, tokenizer=tokenizer,
               data=data, eval_set=eval_set, prompt_format=fmt,
               reward=get_reward(cfg.train.reward, **reward_kw), logger=logger,
               step_count=start, checkpointer=checkpointer, metrics=earlier, hosts=hosts)


def _logged(output_dir: str) -> list[dict]:
    """The metrics an interrupted run logged (a resumed run continues its record)."""
    import os

    from rlx.io.metrics import METRICS_FILE, read_metrics

    path = os.path.join(output_dir, METRICS_FILE)
    return read_metrics(path) if os.path.exists(path) else []


def load_policy(cfg: RunConfig, mesh):
    """Mode B: the base in its serving representation + adapters; mode A: the float model."""
    if cfg.quant.format == "gguf":
        loaded = load_gguf_quantized(resolve_path(cfg.model.path), mesh=mesh,
                                     moe_impl=cfg.model.moe_impl)
    else:
        loaded = load_from_section(cfg.model, mesh, seed=cfg.seed)
        quantize_model(loaded.model, cfg.quant, mesh=mesh)
    model = loaded.model
    if cfg.train.mode == "lora":
        apply_lora(model, cfg.lora, nnx.Rngs(cfg.seed), mesh=mesh)
    return model, loaded.tokenizer


def compile_steps(cfg: RunConfig, model, mesh) -> Compiled:
    trainable = nnx.LoRAParam if cfg.train.mode == "lora" else nnx.Param
    graphdef, state = create_train_state(model, make_optimizer(cfg.optim), mesh,
                                         trainable=trainable, seed=cfg.seed)
    step_cfg = StepConfig(loss=cfg.loss, micro_batches=cfg.train.micro_batches,
                          logprob_chunk=cfg.train.logprob_chunk,
                          compute_entropy=True)
    train_step = make_train_step(graphdef, state, mesh, step_cfg, cfg.optim,
                                 apply_fn=FORWARDS[cfg.train.remat])
    ref_step = None
    if cfg.loss.kl_coef > 0:
        if cfg.train.mode != "lora":
            raise ValueError("config.loss.kl_coef > 0 in mode 'full' needs a reference copy of the "
                             "weights, which rlx does not keep yet; use train.mode='lora' (the "
                             "reference is the base with the adapter off) or kl_coef=0")
        ref_step = make_logprob_step(graphdef, state.params, state.frozen, mesh, step_cfg,
                                     apply_fn=reference_forward)
    return Compiled(graphdef=graphdef, state=state, train_step=train_step, ref_step=ref_step)


def make_engine(cfg: RunConfig, compiled: Compiled, tokenizer, mesh):
    """The rollout engine ``config.rollout.engine`` names, serving the learner's current policy."""
    if cfg.rollout.engine == "sglang":
        from rlx.rollout.sglang_policy import SGLangPolicy

        return SGLangPolicy(cfg, compiled.model())  # exports, launches or attaches servers
    if cfg.rollout.engine == "jax":
        from rlx.rollout.jax_engine import JaxEngine

        return JaxEngine(compiled.model(), tokenizer=tokenizer, mesh=mesh, seed=cfg.seed,
                         weight_layout=cfg.rollout.weight_layout)
    raise ValueError(f"config.rollout.engine={cfg.rollout.engine!r} has no coordinator wiring")


__all__ = ["build", "load_policy", "compile_steps", "make_engine"]
