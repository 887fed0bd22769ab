"""Scoring a policy on the held-out split of a run config's data (``python -m rlx.eval``).

The policy is the config's model with one of: nothing more (the base; in mode "lora" its fresh
adapter changes nothing), the trained parameters of a run's checkpoint (``checkpoint``: the run's
output folder, its ``checkpoints/`` folder or one step's folder; restored like a resume, so the
model, quant and lora sections must be the run's), or a PEFT adapter folder (``adapter``: as
``lora.init_from``). It samples ``n`` completions (at least ``k``) of each of ``problems`` held-out
problems (``data.eval_size`` unless given) with the config's engine, grades them with the
config's reward and reports pass@1, pass@k (the unbiased estimator, ``rlx.data.eval``) and the
mean reward: ``report.json`` and one line per problem in ``problems.jsonl`` under ``out``. The
named sets of ``data.eval_sources`` (``rlx.data.eval_sets``) are scored alike, whole, each in
``<out>/<name>/`` and under ``"sets"`` in ``<out>/report.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax
from flax import nnx

from rlx.config import RunConfig, to_dict
from rlx.data.eval import EvalReport, evaluate
from rlx.data.eval_sets import load_eval_sets
from rlx.errors import ConfigError
from rlx.mesh import make_mesh
from rlx.run.build import compile_steps, eval_examples, load_policy, make_reward, prompt_format
from rlx.run.checks import check_before_build, with_warm_start
from rlx.run.engines import make_engine
from rlx.run.lifecycle import CHECKPOINT_DIR, open_checkpointer
from rlx.types import SamplingParams

REPORT_FILE = "report.json"
PROBLEMS_FILE = "problems.jsonl"


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    """What ``python -m rlx.eval`` was asked besides the config."""

    k: int = 8  # pass@k
    n: int = 0  # samples per problem; 0: k
    temperature: float | None = None  # None: config.rollout.temperature
    problems: int = 0  # held-out problems; 0: config.data.eval_size
    batch: int = 16  # problems per engine call
    checkpoint: str = ""  # a run's output folder, its checkpoints/ folder or one step's folder
    adapter: str = ""  # a PEFT LoRA folder
    out: str = ""  # "": <config.output_dir>/eval
    progress: bool = True

    def __post_init__(self):
        if self.k < 1 or self.n < 0 or (self.n and self.n < self.k):
            raise ConfigError(f"--k={self.k} must be >= 1 and --n={self.n} 0 (= k) or >= k")
        if self.checkpoint and self.adapter:
            raise ConfigError("give --checkpoint or --adapter, not both")
        if self.problems < 0 or self.batch < 1:
            raise ConfigError("--problems must be >= 0 (0: config.data.eval_size), --batch >= 1")
        if self.temperature is not None and self.temperature < 0:
            raise ConfigError(f"--temperature={self.temperature} must be >= 0")


class _Policy:
    """The loaded model as the engines take a policy (``model()``)."""

    def __init__(self, model: nnx.Module):
        self._model = model

    def model(self) -> nnx.Module:
        return self._model


def eval_config(cfg: RunConfig, opts: EvalOptions) -> RunConfig:
    """The config evaluated: ``adapter`` as ``lora.init_from`` (its rank, alpha and targets read
    from the folder: ``rlx.run.checks.with_warm_start``), ``problems`` as the eval size."""
    if opts.adapter:
        if not os.path.isdir(opts.adapter):
            raise ConfigError(f"--adapter={opts.adapter!r} is not a folder (a PEFT LoRA folder)")
        cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, init_from=opts.adapter))
    cfg = with_warm_start(cfg)
    if opts.problems:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval_size=opts.problems))
    if not (cfg.data.eval_size or cfg.data.eval_sources):
        raise ConfigError("config.data.eval_size is 0 and data.eval_sources is empty: pass "
                          "--problems N or --config.data.eval_sources='(\"mmath:aime24\",)'")
    return cfg


def checkpoint_location(path: str) -> tuple[str, int | None]:
    """(the run's output folder, the step or None for the newest) of a ``--checkpoint`` path."""
    path = os.path.abspath(path)
    name, parent = os.path.basename(path), os.path.dirname(path)
    if os.path.isdir(os.path.join(path, CHECKPOINT_DIR)):
        return path, None
    if name == CHECKPOINT_DIR and os.path.isdir(path):
        return parent, None
    if name.isdigit() and os.path.basename(parent) == CHECKPOINT_DIR and os.path.isdir(path):
        return os.path.dirname(parent), int(name)
    raise ConfigError(f"--checkpoint={path!r} is not a run's output folder, its {CHECKPOINT_DIR}/ "
                      f"folder or one step's folder in it")


def restore_policy(cfg: RunConfig, model: nnx.Module, mesh, path: str) -> tuple[_Policy, int]:
    """The trained parameters of the checkpoint at ``path`` on ``model`` (and its step)."""
    run_dir, step = checkpoint_location(path)
    compiled = compile_steps(cfg, model, mesh)
    checkpointer = open_checkpointer(dataclasses.replace(cfg, output_dir=run_dir), compiled.state)
    try:
        steps = checkpointer.steps()
        if not steps or (step is not None and step not in steps):
            raise ConfigError(f"--checkpoint={path!r}: no checkpoint{f' of step {step}' * bool(step)} "
                              f"in {checkpointer.directory} (saved steps: {steps or 'none'})")
        restored = checkpointer.restore(steps[-1] if step is None else step, compiled.state,
                                        report_changes=False)  # the training settings do not matter
    finally:
        checkpointer.close()
    return _Policy(nnx.merge(compiled.graphdef, restored.state.params, restored.state.frozen)), \
        restored.step


def run_eval(cfg: RunConfig, opts: EvalOptions) -> dict[str, Any]:
    """Evaluate (see the module docstring); returns the report that ``report.json`` holds."""
    cfg = eval_config(cfg, opts)
    check_before_build(cfg, jax.device_count())
    mesh = make_mesh(cfg.mesh)
    model, tokenizer = load_policy(cfg, mesh)
    if tokenizer is None:
        raise ConfigError(f"config.model.path={cfg.model.path!r} carries no tokenizer")
    policy, step = (restore_policy(cfg, model, mesh, opts.checkpoint) if opts.checkpoint
                    else (_Policy(model), None))
    examples, sets = eval_examples(cfg), load_eval_sets(cfg.data.eval_sources, cfg.data.eval_size)
    n = opts.n or opts.k
    temperature = cfg.rollout.temperature if opts.temperature is None else opts.temperature
    sampling = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, n=n,
                              temperature=temperature,
                              **cfg.rollout.cuts(), seed=cfg.seed, logprobs=False, stop_token_ids=(tokenizer.eos_id,))
    engine = make_engine(cfg, policy, tokenizer, mesh)
    reward = make_reward(cfg, tokenizer)
    start, out = time.perf_counter(), opts.out or os.path.join(cfg.output_dir, "eval")
    summary = {
        "config": to_dict(cfg), "checkpoint": opts.checkpoint or None, "checkpoint_step": step,
        "adapter": opts.adapter or None, "data_source": cfg.data.source, "split": "eval",
        "problems": len(examples), "k": opts.k, "n": n, "temperature": temperature,
        "max_new_tokens": cfg.rollout.max_new_tokens, "sets": {}}
    try:
        if examples:
            report = _evaluate(engine, examples, reward, cfg, opts, sampling, tokenizer)
            summary.update(_figures(report, opts.k))
            write_report(out, summary, report, examples, opts.k)
        for s in sets:  # each in its own folder, data.eval_sources' name
            report = _evaluate(engine, s.examples, reward, cfg, opts, sampling, tokenizer)
            summary["sets"][s.name] = {"source": s.spec, "problems": len(s.examples),
                                       **_figures(report, opts.k)}
            write_report(os.path.join(out, s.name), summary["sets"][s.name], report,
                         s.examples, opts.k)
    finally:
        engine.close()
        if hasattr(reward, "close"):
            reward.close()
    summary["seconds"] = time.perf_counter() - start
    write_report(out, summary, None, (), opts.k)
    return summary


def _figures(report: EvalReport, k: int) -> dict[str, float]:
    return {"pass@1": report.pass_at[1], f"pass@{k}": report.pass_at[k],
            "mean_reward": report.mean_score}


def _evaluate(engine, examples, reward, cfg, opts, sampling, tokenizer) -> EvalReport:
    from tqdm import tqdm

    with tqdm(total=len(examples), unit="problem", disable=not opts.progress,
              dynamic_ncols=True) as bar:
        return evaluate(engine, examples, reward, k=opts.k, sampling=sampling,
                        tokenizer=tokenizer, prompt_format=prompt_format(cfg),
                        batch_size=opts.batch, keep_completions=True, on_batch=bar.update)


def write_report(out: str, summary: dict, report: EvalReport | None, examples, k: int) -> None:
    """``report.json`` (the summary) and ``problems.jsonl`` (one line per problem; none without
    a ``report``) under ``out``."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, REPORT_FILE), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, default=str)
        f.write("\n")
    if report is None:
        return
    by_uid = {e.uid: e for e in examples}
    with open(os.path.join(out, PROBLEMS_FILE), "w", encoding="utf-8") as f:
        for r in report.records:
            e = by_uid[r.uid]
            f.write(json.dumps({
                "uid": r.uid, "prompt": e.prompt, "answer": e.answer, "n": r.n,
                "correct": r.correct, "pass@1": r.pass_at[1], f"pass@{k}": r.pass_at[k],
                "mean_reward": sum(r.scores) / r.n, "scores": list(r.scores),
                "completions": list(r.completions)}) + "\n")


__all__ = ["EvalOptions", "PROBLEMS_FILE", "REPORT_FILE", "checkpoint_location", "eval_config",
           "restore_policy", "run_eval", "write_report"]
