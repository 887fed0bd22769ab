"""Every field of the ``loss``, ``train``, ``rollout`` (``rollout.sglang`` included), ``env`` and
``data`` sections does something: set to another value, it changes what the run does, or the config is refused.

Each field has one row in ``EFFECTS``: a context (other fields it needs, e.g. ``norm_length`` acts
only with its aggregation), the new value, and the observer that sees its effect. Observers run
rlx's own code on the tiny config:

* ``loop``: the real ``Run`` loop (``rlx.run.loop``) over real data, reward, logger and
  checkpointer, with the compiled steps and the rollout engine replaced by recording stand-ins
  (the one seam: no model is compiled or sampled). The trace holds every call the loop made to the
  engine and the train step, the checkpoints on disk, the logged records and sample count, and how
  the loop ended.
* ``learner``: the lowered train step of ``rlx.run.build.compile_steps`` (its HLO text) and the
  number of trainable values.
* ``loss``: the loss and metrics of ``rlx.learner.losses.policy_loss`` under the run's step config
  (``RunConfig.step_config``) on one fixed batch.
* ``engine``: the engine constructor ``rlx.run.engines`` picks and the built-in engine's layout.
* ``sglang``: the servers ``SGLangPolicy`` would launch, whether it loads rlx's export, its client's
  settings.
* ``data``: the run's first training batch (token ids, ground truth, prompts dropped as too long)
  and its held-out problems, from ``rlx.run.build.prompt_data`` and ``eval_examples``.

A new field without a row fails ``test_every_field_has_a_row``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.config import DataSection, EnvSection, RunConfig, TrainSection, parse_config
from rlx.data.eval_sets import load_eval_sets
from rlx.errors import ConfigError
from rlx.learner.losses import LossConfig, policy_loss
from rlx.mesh import make_mesh
from rlx.rollout.config import RolloutSection
from rlx.rollout.jax.config import JaxSection
from rlx.rollout.sglang.config import SGLangSection
from rlx.rollout.preflight import PreflightError, learner_logprobs
from rlx.rollout.sglang.policy import client_options, launch_specs, loads_export, weight_sync
from rlx.run.build import (compile_steps, eval_examples, load_policy, make_env_runner, make_logger,
                           make_reward, prompt_data, prompt_format)
from rlx.run.checks import read_architecture
from rlx.rollout.registry import BACKENDS
from rlx.run.engines import make_engine, serving
from rlx.run.hosts import Hosts
from rlx.run.lifecycle import open_checkpointer
from rlx.run.loop import NonFiniteError, Run
from rlx.types import LogProbs, Rollout, SamplingParams, StepMetrics
from tests.helpers import ROOT
from tests.helpers.runs import config_dict

BASE = {"train.steps": 3, "data.eval_size": 2, "train.checkpoint_every": 1,
        "train.keep_checkpoints": 2, "train.sample_every": 1, "train.eval_every": 0}
SGLANG = {"rollout.engine": "sglang", "rollout.sglang.python": sys.executable}
FULL = {"train.mode": "full", "quant.format": "none", "loss.kl_coef": 0.0}
DPO = {"train.algorithm": "dpo", "data.source": "arith_pairs:add2"}
TOOLS = {"env.kind": "tools"}
# records with two question/answer field pairs: prompt/answer and question/solution
# tiny's add2 prompts are 53 or 54 tokens long (template, chat markup and the two numbers): 53
# drops the longer ones
MAX_PROMPT_TOKENS = 53
FIELDS_FILE = {"data.source": "jsonl:" + os.path.join(ROOT, "tests", "data", "fields.jsonl")}
# the training rollouts' sampling beside the config (Run.sampling_overrides): every completion
# max_new_tokens long
FIXED_LENGTH = {"ignore_eos": True, "stop_token_ids": ()}

# field -> (observer, new value, context); "refused": the new value must be refused
EFFECTS = {
    "loss.policy_loss": ("loss", "gspo", {}),
    "loss.clip_eps_low": ("loss", 0.05, {}),
    "loss.clip_eps_high": ("loss", 0.5, {}),
    "loss.clip_ratio_c": ("loss", 1.5, {}),
    "loss.aggregation": ("loss", "seq-mean-token-sum", {}),
    "loss.norm_length": ("loss", 3, {"loss.aggregation": "seq-mean-token-sum-norm",
                                     "loss.norm_length": 8}),
    "loss.kl_coef": ("loss", 0.5, {}),
    "loss.kl_estimator": ("loss", "k1", {}),
    "loss.kl_as": ("loop", "reward-penalty", {}),
    "loss.entropy_coef": ("loss", 0.1, {}),
    "loss.tis_mode": ("loss", "off", {}),
    "loss.tis_cap": ("loss", 1.2, {}),
    "loss.tis_seq_low": ("loss", 0.95, {"loss.tis_mode": "sequence-mask"}),
    "loss.tis_seq_high": ("loss", 1.05, {"loss.tis_mode": "sequence-mask"}),
    "loss.old_logp": ("loop", "sampler", {"train.minibatches": 2}),
    "loss.dpo_beta": ("learner", 0.5, DPO),
    "loss.dpo_label_smoothing": ("learner", 0.1, DPO),
    "train.algorithm": ("loop", "dpo", {"data.source": "arith_pairs:add2"}),
    "train.mode": ("learner", "full", {k: v for k, v in FULL.items() if k != "train.mode"}),
    "train.steps": ("loop", 2, {}),
    "train.advantage": ("loop", "rloo", {}),
    "train.micro_batches": ("learner", 2, {}),
    "train.tokens_per_micro_batch": ("loop", 256, {}),
    # tiny's rollouts (prompt-dominated) do not pack two to a row of the longest's length
    "train.pack": ("loop", False, {"train.tokens_per_micro_batch": 256}),
    "train.epochs": ("loop", 2, {}),
    "train.minibatches": ("loop", 2, {}),
    "train.logprob_chunk": ("learner", 16, {}),
    "train.length_buckets": ("loop", 1, {"sampling": FIXED_LENGTH, "rollout.max_new_tokens": 16}),
    "train.remat": ("learner", "layer", {}),
    "train.dynamic_sampling": ("loop", True, {}),
    "train.reward": ("loop", "math_format", {}),
    "train.math_extractors": ("loop", ["hash"], {}),
    "train.eval_every": ("loop", 1, {}),
    "train.checkpoint_every": ("loop", 3, {}),
    "train.keep_checkpoints": ("loop", 1, {}),
    "train.max_staleness": ("loop", 2, {}),
    "train.max_skipped_steps": ("loop", 1, {"skip": True}),
    "train.sample_every": ("loop", 2, {}),
    # its effect on a MoE run: tests/learner/test_router_replay.py (tiny here is dense: refused)
    "train.router_replay": ("refused", True, SGLANG),
    "rollout.engine": ("engine", "sglang", {"rollout.sglang.urls": ["http://h:1"]}),
    "rollout.group_size": ("loop", 2, {}),
    "rollout.max_new_tokens": ("loop", 4, {}),
    "rollout.temperature": ("loop", 0.5, {}),
    "rollout.top_p": ("loop", 0.9, {}),
    "rollout.top_k": ("loop", 20, {}),
    "rollout.min_p": ("loop", 0.05, {}),
    "rollout.eval_temperature": ("loop", 0.5, {}),
    "rollout.preflight_threshold": ("loop", 1e-4, {}),
    "rollout.preflight_every": ("loop", 1, {}),
    "rollout.weight_layout": ("engine", "in_out", {}),
    "rollout.partial": ("loop", True, {"train.max_staleness": 1}),
    "rollout.jax.batching": ("engine", "lockstep", {}),
    "rollout.jax.slots": ("engine", 4, {}),
    "rollout.jax.page_size": ("engine", 8, {}),
    "rollout.jax.kv_pages": ("engine", 64, {}),
    "rollout.jax.prefill_chunk": ("engine", 64, {}),
    "rollout.jax.prefill_rows": ("engine", 2, {}),
    "rollout.jax.burst": ("engine", 4, {}),
    "rollout.sglang.urls": ("sglang", ["http://h:1"], SGLANG),
    "rollout.sglang.python": ("sglang", os.path.join(os.path.dirname(sys.executable), ".",
                                                     os.path.basename(sys.executable)), SGLANG),
    "rollout.sglang.num_servers": ("sglang", 2, SGLANG),
    "rollout.sglang.tp_size": ("sglang", 2, SGLANG),
    "rollout.sglang.extra_args": ("sglang", ["--x", "1"], SGLANG),
    "rollout.sglang.env": ("sglang", ["A=1"], SGLANG),
    "rollout.sglang.startup_timeout_s": ("sglang", 5.0, SGLANG),
    "rollout.sglang.request_timeout_s": ("sglang", 5.0, SGLANG),
    "rollout.sglang.sync_base": ("sglang", False, {**SGLANG, "rollout.sglang.urls": ["http://h:1"]}),
    "rollout.sglang.weight_sync": ("sglang", "disk", {**SGLANG, **FULL}),
    "rollout.sglang.sync_bucket_mb": ("sglang", 64.0, {**SGLANG, **FULL}),
    "env.kind": ("env", "tools", {}),
    "env.max_turns": ("env", 1, TOOLS),
    "env.max_episode_tokens": ("env", 16, TOOLS),
    "env.tools": ("env", ["calculator", "python"], TOOLS),
    "env.format_coef": ("env", 0.5, TOOLS),
    "env.demo": ("env", True, TOOLS),
    "env.assistant_prefix": ("env", "<tool_call>\n", TOOLS),
    # tiny's SmolLM2 template shows no family syntax (auto: hermes); the policy's <tool_call>
    # blocks are no calls in Llama's JSON format
    "env.tool_format": ("env", "llama3_json", TOOLS),
    "env.verifiers": ("refused", "no_function", {"env.kind": "verifiers"}),
    "env.verifiers_args": ("refused", "[1]", {"env.kind": "verifiers",
                                              "env.verifiers": "rlx_vf_arith:load_environment"}),
    "data.source": ("data", "arith:mul", {}),
    "data.prompt_field": ("data", "question", FIELDS_FILE),
    "data.answer_field": ("data", "solution", FIELDS_FILE),
    "data.prompts_per_step": ("data", 4, {}),
    "data.max_prompt_tokens": ("data", MAX_PROMPT_TOKENS, {}),
    "data.system_prompt": ("data", "Answer briefly.", {}),
    "data.template": ("data", "Q: {prompt}", {}),
    "data.eval_size": ("data", 1, {}),
    "data.eval_sources": ("loop", ("arith:add2",), {}),  # eval/add2/... beside eval/accuracy
    "data.eval_samples": ("loop", 2, {"data.eval_sources": ("arith:add2",),
                                      "rollout.eval_temperature": 0.5}),
}
SECTIONS = {"loss": LossConfig, "train": TrainSection, "rollout": RolloutSection,
            "rollout.sglang": SGLangSection, "rollout.jax": JaxSection, "env": EnvSection,
            "data": DataSection}


def _config(tmp_path, context: dict, **change) -> RunConfig:
    overrides = {**BASE, **{k: v for k, v in context.items() if "." in k}, **change}
    return parse_config(config_dict("tiny", tmp_path, **overrides))


# --- the loop, with recording stand-ins for the compiled steps and the engine -----------------
class _Step:
    """The train step's stand-in: records each batch (its shape, loss tokens, advantages and
    old log-probs), advances the state's step."""

    def __init__(self, trace: list, skip: bool):
        self.trace, self.skip = trace, skip

    def __call__(self, state, batch):
        mask = np.asarray(batch.loss_mask)
        adv = np.round(np.asarray(batch.advantages)[mask > 0], 4)
        old = None if batch.old_logp is None else round(float(np.asarray(batch.old_logp).sum()), 3)
        self.trace.append(("train", batch.shape, int(mask.sum()), tuple(adv.tolist()), old))
        zero = jnp.zeros((), jnp.float32)
        metrics = StepMetrics(*[zero] * len(StepMetrics._fields))._replace(
            skipped=jnp.float32(self.skip))
        return state.replace(step=state.step + 1), metrics


def _reference(params, frozen, batch):
    return LogProbs(jnp.zeros(batch.shape, jnp.float32), None)


class _Engine:
    """A rollout engine whose policy answers a prompt "What is a + b?" right for the first
    ``uid % (n + 1)`` samples (so some groups are all right or all wrong) in ``\\boxed{}``; it
    scores sequences as the learner does plus 5e-4 (the parity preflight sees that gap)."""

    name, weight_version = "stand-in", 0

    def __init__(self, tokenizer, compiled, trace: list):
        self.tokenizer, self.compiled, self.trace = tokenizer, compiled, trace

    def generate(self, prompts, sampling):
        self.trace.append(("generate", len(prompts), sampling))
        out = []
        for p in prompts:
            a, b = map(int, re.findall(r"(\d+) \+ (\d+)", self.tokenizer.decode(list(p.token_ids)))[-1])
            right = sum(map(ord, p.uid)) % (sampling.n + 1)
            for j in range(sampling.n):
                text = f"\\boxed{{{a + b if j < right else a + b + 1}}}"
                ids = self.tokenizer.encode(text) + [self.tokenizer.eos_id]
                ids = (ids * sampling.max_new_tokens)[:sampling.max_new_tokens] if sampling.ignore_eos \
                    else ids[:sampling.max_new_tokens]
                logp = np.full(len(ids), -sampling.temperature, np.float32)
                out.append(Rollout(p.uid, np.asarray(p.token_ids), np.asarray(ids), logp,
                                   "length" if len(ids) == sampling.max_new_tokens else "stop",
                                   self.weight_version, j))
        return out

    def score(self, sequences):
        self.trace.append(("score", len(sequences)))
        return [lp + 5e-4 for lp in learner_logprobs(self.compiled.model(), sequences)]

    def update_weights(self, weights, version):
        self.trace.append(("update", version))
        self.weight_version = version

    def close(self):
        pass


@functools.lru_cache(maxsize=None)
def _policy(cfg: RunConfig):
    """``load_policy`` once per model-shaping setting (the stand-in steps never change it)."""
    mesh = make_mesh(cfg.mesh, jax.devices()[:cfg.mesh.num_devices])
    return mesh, *load_policy(cfg, mesh)


def _shape_of(cfg: RunConfig) -> RunConfig:
    """``cfg`` with only what ``load_policy`` reads (the model, base, adapter, mode, mesh, seed)."""
    return RunConfig(model=cfg.model, quant=cfg.quant, lora=cfg.lora, mesh=cfg.mesh, seed=cfg.seed,
                     train=TrainSection(mode=cfg.train.mode))


def _loop(cfg: RunConfig, skip: bool = False, sampling: dict | None = None) -> tuple:
    """What the real loop did over ``cfg.train.steps`` steps (see the module docstring)."""
    mesh, model, tokenizer = _policy(_shape_of(cfg))
    trace: list = []
    compiled = compile_steps(cfg, model, mesh)
    compiled = dataclasses.replace(compiled, train_step=_Step(trace, skip),
                                   ref_step=_reference if compiled.ref_step else None)
    hosts = Hosts()
    run = Run(cfg=cfg, mesh=mesh, compiled=compiled, engine=_Engine(tokenizer, compiled, trace),
              tokenizer=tokenizer, data=prompt_data(cfg, tokenizer, hosts), eval_set=eval_examples(cfg),
              prompt_format=prompt_format(cfg), reward=make_reward(cfg),
              eval_sets=load_eval_sets(cfg.data.eval_sources, cfg.data.eval_size),
              logger=make_logger(cfg, 0, progress=False),
              checkpointer=open_checkpointer(cfg, compiled.state), hosts=hosts,
              sampling_overrides=sampling or {})
    ended = "done"
    try:
        run.train()
    except (NonFiniteError, PreflightError) as e:
        ended = type(e).__name__
    finally:
        run.close()
    records = [tuple(sorted((k, round(v, 6)) for k, v in r.items() if not k.startswith(("time/", "throughput/"))))
               for r in run.metrics]
    path = os.path.join(cfg.output_dir, "samples.jsonl")
    samples = len(open(path).readlines()) if os.path.exists(path) else 0
    return ended, tuple(map(repr, trace)), tuple(run.checkpointer.steps()), tuple(records), samples


# --- the other observers --------------------------------------------------------------------
def _learner(cfg: RunConfig) -> tuple:
    mesh, model, _ = _policy(_shape_of(cfg))
    compiled = compile_steps(cfg, model, mesh)
    rows, length = 8, 16
    batch = dataclasses.replace(_loss_batch(rows, length), input_ids=jnp.zeros((rows, length), jnp.int32))
    hlo = compiled.train_step.lower(compiled.state, batch).as_text()
    trainable = sum(x.size for x in jax.tree.leaves(compiled.state.params))
    return hlo, trainable


def _loss_batch(rows: int = 4, length: int = 6):
    """Log-probs spread so that ratios and importance weights fall on both sides of every clip."""
    from rlx.types import TrainBatch

    rng = np.random.default_rng(0)
    f = lambda scale: jnp.asarray(rng.normal(-1.0, scale, (rows, length)), jnp.float32)  # noqa: E731
    mask = jnp.asarray(np.arange(length)[None, :] >= np.arange(rows)[:, None] % 3 + 1, jnp.float32)
    return TrainBatch(input_ids=jnp.zeros((rows, length), jnp.int32),
                      positions=jnp.tile(jnp.arange(length), (rows, 1)),
                      segment_ids=jnp.ones((rows, length), jnp.int32), loss_mask=mask,
                      advantages=jnp.asarray(np.resize([1.0, -1.0, 0.5, -0.5], (rows, 1)) * np.ones(length), jnp.float32),
                      sampler_logp=f(0.5), old_logp=f(0.5), ref_logp=f(0.5))


def _loss(cfg: RunConfig) -> tuple:
    b = _loss_batch()
    entropy = jnp.abs(b.old_logp)
    logp = b.old_logp + 0.4 * jnp.asarray(np.random.default_rng(1).normal(size=b.shape), jnp.float32)
    loss, metrics = policy_loss(logp, b.old_logp, b.advantages, b.loss_mask, cfg.step_config.loss,
                                ref_logp=b.ref_logp, sampler_logp=b.sampler_logp, entropy=entropy)
    return tuple(round(float(x), 6) for x in (loss, *metrics))


def _engine(cfg: RunConfig) -> tuple:
    builder = BACKENDS[cfg.rollout.engine]
    if cfg.rollout.engine != "jax":
        return (builder,)
    mesh, model, tokenizer = _policy(_shape_of(cfg))
    engine = make_engine(cfg, compile_steps(cfg, model, mesh), tokenizer, mesh)
    paged = engine._paged  # continuous batching's pool and programs (None: lockstep)
    return builder, engine.weight_layout, paged and (paged.slots, paged.section)


def _sglang(cfg: RunConfig) -> tuple:
    s = serving(cfg)
    return (tuple(launch_specs(s, read_architecture(cfg)[0], "served")), loads_export(s),
            tuple(sorted(client_options(s).items())), weight_sync(s))


def _env(cfg: RunConfig) -> tuple:
    """The episodes ``make_env_runner`` runs for two problems with a scripted policy that asks
    the calculator for the problem's sum, then answers with the tool's reply (or nothing: the
    single-turn run has no runner)."""
    from tests.helpers.envs import ScriptedEngine, call

    _, _, tokenizer = _policy(_shape_of(cfg))
    runner = make_env_runner(cfg, make_reward(cfg), tokenizer)
    if runner is None:
        return ()

    def policy(context: str) -> str:
        replies = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", context)
        if len(replies) < 2:  # the demonstration's reply is not this problem's
            a, b = re.findall(r"(\d+) \+ (\d+)", context)[-1]
            return call(f"{a}+{b}")
        return f"\\boxed{{{replies[-1]}}}"

    rollouts = runner.generate(ScriptedEngine(tokenizer, policy), eval_examples(cfg),
                               SamplingParams(max_new_tokens=64))
    return tuple((len(r.prompt_ids), r.completion_ids.tolist(), r.reward) for r in rollouts)


def _data(cfg: RunConfig) -> tuple:
    """The first training batch (token ids, ground truth, prompts dropped as too long) and the
    held-out problems (prompt, ground truth)."""
    _, _, tokenizer = _policy(_shape_of(cfg))
    batches = prompt_data(cfg, tokenizer, Hosts())
    batch = next(batches)
    train = tuple((p.token_ids, tuple(e.reward_sample().items()))
                  for p, e in zip(batch.prompts, batch.examples))
    held = tuple((e.prompt, tuple(e.reward_sample().items())) for e in eval_examples(cfg))
    return train, batches.stats.filtered_too_long, held


OBSERVERS = {"data": _data, "env": _env, "loop": _loop, "learner": _learner, "loss": _loss, "engine": _engine, "sglang": _sglang}


def test_every_field_has_a_row():
    fields = {f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)
              if f.name not in ("sglang", "jax")}
    assert set(EFFECTS) == fields


# The loop and learner observers build a run twice (6-25 s a row on 2 cores): the CI sweeps every
# other observer's rows and these three of theirs; the slow marker runs them all.
CI_LOOP_ROWS = ("train.steps", "train.mode", "train.advantage")


def _row(field: str):
    slow = EFFECTS[field][0] in ("loop", "learner") and field not in CI_LOOP_ROWS
    return pytest.param(field, marks=pytest.mark.slow) if slow else field


@pytest.mark.parametrize("field", [_row(f) for f in sorted(EFFECTS)])
def test_changing_the_field_changes_the_run_or_is_refused(field, tmp_path):
    kind, value, context = EFFECTS[field]
    if kind == "refused":
        with pytest.raises(ConfigError, match=re.escape(field.split(".")[-1])):
            _config(tmp_path / "new", context, **{field: value})
        return
    observe = OBSERVERS[kind]
    extra = {k: context[k] for k in ("skip", "sampling") if k in context}  # the loop's own
    before = observe(_config(tmp_path / "old", context), **extra)
    after = observe(_config(tmp_path / "new", context, **{field: value}), **extra)
    assert before != after, f"config.{field}={value!r} changed nothing that {kind} observes"
