"""The RL loop: a short ``step()`` of named calls.

prompts -> generate -> score -> advantages -> batch -> reference log-probs -> update -> weight
sync -> metrics, then (in ``train``) evaluation and checkpoints. Each step takes ``train.epochs``
x ``train.minibatches`` optimizer updates over its batch (default one; rows packed; each update
accumulates gradients over ``train.micro_batches`` or token-budget micro-batches inside the
compiled step; ``rlx.run.learn``) and hands the new weights to the engine (version = step).

* Synchronous on-policy (``train.max_staleness = 0``): each step samples with the current weights.
* Asynchronous (``train.max_staleness = k >= 1``, ``rlx.run.rollouts``): up to k batches of
  rollouts are in flight; the engine generates step t + k's batch with the weights of step t on a
  worker thread while the learner scores and updates (one-step-off for k = 1); weight syncs are
  queued behind the generations, so the engine always samples with the newest weights it has.
  ``rollout.partial`` continues a completion that spans a weight sync with the new weights, each
  token tagged with its version. Rollouts carry their ``weight_version`` (and per-token versions);
  the loss's truncated importance sampling (sampler vs. learner log-probs, per token) corrects the
  lag together with the numerical sampler/learner mismatch, which is measured every step
  (``mismatch/*``, ``rollout/staleness`` per batch and ``rollout/token_staleness`` per token).

Rollouts are checked before anything uses them (``check_rollouts``): exactly ``group_size``
samples of every prompt, each ``(uid, sample index)`` once, all of the policy version the engine
served when it made them; otherwise a ``RolloutError``. An engine failure ends ``train`` with a
checkpoint of the last completed step and an error saying where to resume.

Checkpoints (``rlx.run.lifecycle``): every ``train.checkpoint_every`` steps, and at the end of
``train`` or when SIGTERM / Ctrl-C stop it after the current step. A resumed synchronous run is
bit-identical to an uninterrupted one (same batches, same sampling seeds, same rng stream); so is
an asynchronous one: its checkpoints hold the rollouts in flight (``RolloutQueue.snapshot``).

Multi-host (``config.distributed``): every process runs this loop; ``Run.hosts`` (``rlx.run.hosts``)
exchanges prompts, rollouts and rewards so that every process trains on the same global batch,
each feeding its own rows; with one process each of its calls is the identity.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from rlx.config import RunConfig
from rlx.data.chat import PromptFormat
from rlx.data.sources import Example, user_example
from rlx.data.eval_sets import EvalSet, summary_lines
from rlx.envs.runner import EnvRunner, make_runner, transcript
from rlx.io.checkpoint import Checkpointer
from rlx.io.export import export_critic, export_merged, export_peft
from rlx.io.metrics import MetricsLogger, TextSample
from rlx.learner.step import Compiled
from rlx.models.tokenizer import Tokenizer
from rlx.rewards.base import RewardFn, RewardResult, reads_chat, score_batch, take_metrics
from rlx.rollout.errors import RolloutError
from rlx.run.heldout import Evaluator
from rlx.run.hosts import Hosts
from rlx.run.learn import StepLearner
from rlx.run.lifecycle import StopSignals
from rlx.run.preference import learn_preferences
from rlx.run.rollouts import GenerationCost, RolloutQueue
from rlx.types import Prompt, Rollout, RolloutEngine, SamplingParams

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Too many updates in a row were skipped for a non-finite loss or gradient norm."""


class _Timer:
    def __init__(self):
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t = time.perf_counter()
        yield
        self.times[f"time/{name}"] = time.perf_counter() - t


@dataclasses.dataclass
class Run:
    """A built run: ``step()``, ``train(n)``, ``evaluate()``, ``generate(texts)``, ``close()``."""

    cfg: RunConfig
    mesh: Mesh
    compiled: Compiled
    engine: RolloutEngine | None  # None on a process of a multi-host run that does not sample
    tokenizer: Tokenizer
    data: grain.DatasetIterator  # yields PromptBatch (rlx.data.pipeline)
    eval_set: Sequence[Example]  # the held-out split (data.eval_size; rlx.run.heldout)
    prompt_format: PromptFormat
    reward: RewardFn
    logger: MetricsLogger
    step_count: int = 0
    metrics: list[dict[str, float]] = dataclasses.field(default_factory=list)  # per step / eval
    probe: list[tuple[list[int], int]] | None = None  # the parity preflight's fixed sequences
    checkpointer: Checkpointer | None = None  # None: no checkpoints
    stopped_by: int | None = None  # the signal that stopped `train`, if one did
    _queue: RolloutQueue | None = None  # batches in flight, the engine's worker (rlx.run.rollouts)
    _horizon: int | None = None  # the last step `train` will take (no prefetch beyond it)
    _skipped_in_row: int = 0  # updates skipped for NaN/Inf since the last good one
    hosts: Hosts = dataclasses.field(default_factory=Hosts)  # this process's part (rlx.run.hosts)
    # (step, progress) of the batches a restored checkpoint had in flight, until put back
    resumed_in_flight: list = dataclasses.field(default_factory=list)
    env: EnvRunner | None = None  # env.kind "tools": tool-use episodes (rlx.envs.runner)
    _env_metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # this step's env/*
    # SamplingParams fields of the training rollouts set by the caller beside the config, e.g.
    # {"ignore_eos": True, "stop_token_ids": ()}: every completion max_new_tokens long
    sampling_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    eval_sets: Sequence[EvalSet] = ()  # data.eval_sources (rlx.data.eval_sets)

    # --- one RL step ----------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        if self.cfg.train.algorithm == "dpo":
            return self._preference_step()
        timer = _Timer()
        with timer("step"):
            with timer("wait_rollouts"):
                batch, rollouts, cost = self._rollouts()
            timer.times["time/generate"] = cost.seconds
            with timer("score"):
                rewards, texts, reasons = self._score(rollouts, batch)
            uids = np.array([r.prompt_uid for r in rollouts])
            keep = self._keep(rewards, uids)
            with timer("logprob"):  # and values, advantages
                prepared = self.learner.prepare(rollouts, rewards, uids, keep)
            with timer("update"):  # dispatch is asynchronous: the updates block until done
                self.queue.wait_synced()  # the engine has copied the weights the update donates
                learned = self.learner.update(prepared, self.step_count)
            with timer("sync"):
                self.step_count += 1
                self.hosts.sync(self.queue, self.engine, self.compiled, self.step_count)
        record = {**learned, **self._record(rollouts, rewards, keep, timer.times, cost)}
        self._log(record, rollouts, texts, rewards, reasons)
        self._check_numerics(record)
        return record

    def _preference_step(self) -> dict[str, float]:
        """DPO (``rlx.run.preference``): this step's pairs -> one update -> weight sync."""
        timer = _Timer()
        with timer("step"):
            batch = next(self.data)
            with timer("update"):
                self.queue.wait_synced()
                record = learn_preferences(self.cfg, self.mesh, self.compiled, self.hosts,
                                           self.tokenizer, self.prompt_format, batch.examples)
            with timer("sync"):
                self.step_count += 1
                self.hosts.sync(self.queue, self.engine, self.compiled, self.step_count)
        record = {**record, **timer.times, "learner/skipped": record["dpo/skipped"]}
        self.metrics.append({"step": self.step_count, **record})
        self.logger.log(self.step_count, record)
        self._check_numerics(record)
        return record

    def _check_numerics(self, record: dict[str, float]) -> None:
        """Count updates the learner skipped for a non-finite loss / gradient norm; stop after
        ``train.max_skipped_steps`` in a row (no checkpoint is written meanwhile)."""
        if not record.get("learner/skipped"):
            self._skipped_in_row = 0
            return
        self._skipped_in_row += 1
        limit = self.cfg.train.max_skipped_steps
        log.warning("step %d: non-finite loss or gradient norm, update skipped (%d in a row, "
                    "stopping at %d)", self.step_count, self._skipped_in_row, limit)
        if self._skipped_in_row >= limit:
            last = self.checkpointer.steps()[-1] if self.checkpointer and \
                self.checkpointer.steps() else None
            raise NonFiniteError(
                f"{self._skipped_in_row} updates in a row (up to step {self.step_count}) had a "
                f"non-finite loss or gradient norm and were skipped; the last good checkpoint is "
                f"step {last} in {self.checkpointer.directory if self.checkpointer else '-'}. "
                "Lower optim.learning_rate or check the rewards and data, then resume with "
                "--config.resume=latest")

    @property
    def queue(self) -> RolloutQueue:
        """Rollouts in flight and the engine's worker (``rlx.run.rollouts``)."""
        if self._queue is None:
            self._queue = RolloutQueue(lambda: self.engine, self.hosts, self.cfg.train.max_staleness,
                                       self.cfg.rollout.partial, env=self.env)
        return self._queue

    def _rollouts(self):
        """This step's batch and rollouts: the oldest in flight (finished now with the newest
        weights when partial), or generated now; then the batches in flight move one segment
        (partial) and new ones start until ``train.max_staleness`` are in flight. (A failed
        generation stays in flight: a checkpoint then records the data position before it.)"""
        q = self.queue
        if not q.in_flight and self.resumed_in_flight:
            self._resume_in_flight()
        if not q.in_flight:
            self._start(self.step_count)
        batch, rollouts, cost = q.take()
        q.advance()
        while q.in_flight < self.cfg.train.max_staleness:
            step = self.step_count + q.in_flight + 1  # the step that will train on it
            if self._horizon is not None and step >= self._horizon:
                break
            self._start(step)
        return batch, rollouts, cost

    def _start(self, step: int) -> None:
        position = self.data.get_state()
        self.queue.start(next(self.data), position, self._sampling(step=step), step)

    def _resume_in_flight(self) -> None:
        """The batches a checkpoint had in flight, back in flight as they stood (their batches are
        read again from the restored data position)."""
        for step, progress in self.resumed_in_flight:
            position = self.data.get_state()
            self.queue.resume(next(self.data), position, self._sampling(step=step), step, progress)
        self.resumed_in_flight = []

    def _sampling(self, evaluation: bool = False, step: int | None = None) -> SamplingParams:
        r = self.cfg.rollout
        step = self.step_count if step is None else step
        params = SamplingParams(
            max_new_tokens=r.max_new_tokens, n=1 if evaluation else r.group_size,
            temperature=r.eval_temperature if evaluation else r.temperature,
            **r.cuts(), seed=self.cfg.seed + step,
            logprobs=not evaluation,  # evaluation and samples to look at need none
            stop_token_ids=(self.tokenizer.eos_id,))
        return params if evaluation else dataclasses.replace(params, **self.sampling_overrides)

    def _score(self, rollouts: Sequence[Rollout], batch) -> tuple[np.ndarray, list[str], list[str]]:
        if self.env is not None:  # the episodes were graded by their envs
            # env/* over every episode of the batch, whichever process ran it
            rewards, texts, reasons, self._env_metrics = self.env.scores(
                rollouts, pool=self.hosts.every_episode)
            return rewards, texts, reasons
        examples = {e.uid: e for e in batch.examples}
        own = [i for i, r in enumerate(rollouts) if r.prompt_uid in examples]  # this process's
        texts = [self.tokenizer.decode(rollouts[i].completion_ids.tolist(), skip_special_tokens=True)
                 for i in own]
        samples = [examples[rollouts[i].prompt_uid].reward_sample(reads_chat(self.reward)) for i in own]
        results = score_batch(self.reward, texts, samples)
        return self.hosts.gather_scores(len(rollouts), own, [res.score for res in results], texts,
                                        [res.reason for res in results])

    def _keep(self, rewards: np.ndarray, uids: np.ndarray) -> np.ndarray:
        """Indices trained on: all, or (dynamic sampling) groups whose rewards differ."""
        if not self.cfg.train.dynamic_sampling:
            return np.arange(len(rewards))
        mixed = {u for u in set(uids.tolist()) if np.ptp(rewards[uids == u]) > 0}
        keep = np.array([i for i, u in enumerate(uids.tolist()) if u in mixed], np.int64)
        return keep if len(keep) else np.arange(len(rewards))

    @property
    def learner(self) -> StepLearner:
        """The learner's side of a step (``rlx.run.learn``) on the current compiled steps."""
        return StepLearner(self.cfg, self.mesh, self.compiled, self.hosts)

    # --- metrics --------------------------------------------------------------------------
    def _record(self, rollouts, rewards, keep, times, cost: GenerationCost) -> dict[str, float]:
        lengths = np.array([len(r.completion_ids) for r in rollouts], np.float64)
        tokens = float(sum(len(r.completion_ids) for r in rollouts))
        record = {}
        record.update({
            "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
            "reward/min": float(rewards.min()), "reward/max": float(rewards.max()),
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response_length/clipped_frac": float(np.mean(
                [r.finish_reason == "length" for r in rollouts])),
            "batch/kept_frac": len(keep) / len(rollouts),
            **staleness(rollouts, self.step_count - 1),
            "throughput/gen_tokens_per_s": tokens / max(times["time/generate"], 1e-9),
            **self._env_metrics, **take_metrics(self.reward), **times,  # reward/judge_*
        })
        for name, n in cost.counts.items():  # moe_dropped_pairs (learner/...: the update's), preempted
            record[f"rollout/{name}"] = float(n)
        return record

    def _log(self, record, rollouts, texts, rewards, reasons) -> None:
        self.metrics.append({"step": self.step_count, **record})
        self.logger.log(self.step_count, record)
        if self.cfg.train.sample_every and self.step_count % self.cfg.train.sample_every == 0:
            rows = list(zip(rollouts, texts, rewards, reasons))[:4]
            samples = [TextSample(prompt=self.tokenizer.decode(list(r.prompt_ids)), completion=t,
                                  reward=float(s), reason=why) for r, t, s, why in rows]
            self.logger.log_text(self.step_count, samples)

    # --- loops, evaluation, inspection --------------------------------------------------------
    def train(self, steps: int | None = None) -> list[dict[str, float]]:
        """Run ``steps`` (default: the rest of ``train.steps``), evaluating every ``eval_every``
        and checkpointing every ``checkpoint_every`` steps and at the end. SIGTERM / Ctrl-C stop
        the loop after the current step (``stopped_by``), with a final checkpoint."""
        total = self.cfg.train.steps if steps is None else self.step_count + steps
        every, check = self.cfg.train.eval_every, self.cfg.rollout.preflight_every
        self._horizon, self.stopped_by = total, None
        evaluating = bool(self.eval_set or self.eval_sets)
        with StopSignals() as signals:
            try:
                if self.step_count == 0 and evaluating and self.step_count < total:
                    if self.eval_set:  # the parity probe's prompts
                        self.preflight()
                    self.evaluate()
                while self.step_count < total and self.hosts.first_signal(signals.received) is None:
                    self.step()
                    if check and self.eval_set and self.step_count % check == 0:
                        self.preflight()
                    if evaluating and (self.step_count == total
                                          or (every and self.step_count % every == 0)):
                        self.evaluate()
                    self.save()
            except RolloutError as e:
                self._engine_failed(e, signals.received)
            self.save(force=True)
            self.stopped_by = self.hosts.first_signal(signals.received)
        return self.metrics

    def _engine_failed(self, error: RolloutError, signal_received: int | None) -> None:
        """The engine failed mid-step. Nothing of that step was trained on (an engine fails
        while generating, or syncing weights after the update), so the state is the last
        completed step's: checkpoint it, then raise with where to resume from. After a stop
        signal (which may have stopped the servers too, e.g. sent to the whole job) the run
        ends as stopped by it instead."""
        self.save(force=True)
        if signal_received is not None:
            log.warning("rollout engine failed after a stop signal (the step in flight is "
                        "dropped): %s", error)
            return
        raise RolloutError(f"{error}\nThe run stopped at step {self.step_count}; "
                           f"{self._last_checkpoint()}") from error

    def _last_checkpoint(self) -> str:
        if self.checkpointer is None:
            return "no checkpoints are written (train.checkpoint_every and no checkpointer)"
        self.checkpointer.wait()
        steps = self.checkpointer.steps()
        if not steps:
            return f"no checkpoint was written in {self.checkpointer.directory}"
        return (f"the last checkpoint is step {steps[-1]} in {self.checkpointer.directory}: "
                "resume with --config.resume=latest")

    def save(self, force: bool = False) -> bool:
        """Checkpoint the current step if due (or ``force``); True when a save started. The run's
        position goes with it (``Hosts.position``): the data position before the oldest batch in
        flight and those batches' rollouts (``RolloutQueue.snapshot``), so that a resumed
        one-step-off run trains on the same rollouts as an uninterrupted one."""
        ckpt = self.checkpointer
        if ckpt is None or self._skipped_in_row:  # only states after a good update
            return False
        if not (force or ckpt.should_save(self.step_count)):
            return False
        oldest = None if self._queue is None else self._queue.oldest_position()
        in_flight = [] if self._queue is None else self._queue.snapshot()
        position = self.hosts.position(self.data.get_state() if oldest is None else oldest,
                                       in_flight + [{"step": s, "progress": p}
                                                    for s, p in self.resumed_in_flight])
        return ckpt.save(self.step_count, self.compiled.state, force=force, position=position)

    def preflight(self):
        """Learner vs engine log-probs on a fixed probe (greedy replies to 4 held-out prompts);
        raises ``PreflightError`` above ``rollout.preflight_threshold``, else logs the figures."""
        self.queue.wait()  # the engine serves the learner's weights, and is idle
        report = self.hosts.with_engine(self._preflight, self.hosts.preflight_model(self.compiled))
        self.logger.log(self.step_count, report.scalars())
        self.metrics.append({"step": self.step_count, **report.scalars()})
        return report

    def _preflight(self, model):
        from rlx.data.chat import encode_prompt
        from rlx.rollout.preflight import run_preflight

        if self.probe is None:
            prompts = [Prompt(e.uid, tuple(encode_prompt(self.tokenizer, e, self.prompt_format)))
                       for e in self.eval_set[:4]]
            outs = self.engine.generate(prompts, self._sampling(evaluation=True))
            self.probe = [(list(r.prompt_ids) + list(r.completion_ids), len(r.prompt_ids))
                          for r in outs if len(r.completion_ids)]
        return run_preflight(model, self.engine.score, self.probe,
                             engine_name=self.engine.name,
                             base_format=self.cfg.quant.format,
                             threshold=self.cfg.rollout.preflight_threshold)

    def evaluate(self) -> dict[str, float]:
        """The held-out split's accuracy and each eval set's figures (``rlx.run.heldout``)."""
        self.queue.wait()
        record = self.hosts.with_engine(self._evaluate)
        self.metrics.append({"step": self.step_count, **record})
        self.logger.log(self.step_count, record)
        return record

    def _evaluate(self) -> dict[str, float]:
        t, sampling = time.perf_counter(), self._sampling(evaluation=True)
        on = Evaluator(self.engine, self.reward, self.tokenizer, self.prompt_format, self.env)
        rows = self.cfg.data.prompts_per_step * self.cfg.rollout.group_size
        return {**on.split(self.eval_set, sampling, rows),
                **on.sets(self.eval_sets, sampling, self.cfg.data.eval_samples),
                "time/eval": time.perf_counter() - t}

    def generate(self, texts: Sequence[str], tools: Sequence[str] | None = None,
                 **sampling: Any) -> list[str]:
        """Chat-templated completions of user messages (for looking at samples). With ``tools``
        (names as in ``env.tools``) each message opens a tool-use episode (``env.max_turns``,
        ``env.max_episode_tokens``; final answers not graded) and its transcript is returned."""
        base = dataclasses.replace(self._sampling(evaluation=True), **sampling)
        if tools is not None:
            return self._episodes(texts, tools, base)
        prompts = [Prompt(f"gen-{i}", tuple(self.tokenizer.encode_chat(
            [{"role": "user", "content": t}], add_generation_prompt=True))) for i, t in enumerate(texts)]
        self.queue.wait()
        outs = self.hosts.with_engine(lambda: self.engine.generate(prompts, base))
        return [self.tokenizer.decode(r.completion_ids.tolist(), skip_special_tokens=True) for r in outs]

    def _episodes(self, texts: Sequence[str], tools: Sequence[str],
                  sampling: SamplingParams) -> list[str]:
        env = self.cfg.env
        fmt = PromptFormat(tool_format=None if env.tool_format == "auto" else env.tool_format)
        runner = make_runner(tools, lambda text, sample: RewardResult(0.0, "not graded"),
                             self.tokenizer, fmt, max_turns=env.max_turns,
                             max_episode_tokens=env.max_episode_tokens, demo=env.demo,
                             assistant_prefix=env.assistant_prefix)
        runner.share = self.hosts.episode_share()  # "global": each process its envs' calls
        examples = [user_example(f"gen-{i}", "generate", t) for i, t in enumerate(texts)]
        self.queue.wait()
        episodes = self.hosts.with_engine(lambda: runner.episodes(self.engine, examples,
                                                                      sampling))
        return [transcript(e) for e in episodes]

    def summary(self) -> str:
        """The reward curve and held-out accuracy at start and now (a step evaluated twice: its last)."""
        evals = list({r["step"]: r["eval/accuracy"] for r in self.metrics if "eval/accuracy" in r}.items())
        rewards = [r["reward/mean"] for r in self.metrics if "reward/mean" in r]
        lines = [f"steps {self.step_count}; mean reward per step: "
                 + " ".join(f"{x:.2f}" for x in rewards)]
        calls = {r["step"]: r["eval/tool_call_rate"] for r in self.metrics
                 if "eval/tool_call_rate" in r}
        lines += [f"held-out greedy accuracy at step {s}: {100 * a:.1f}%" + (
            f" (tool-call rate {100 * calls[s]:.1f}%)" if s in calls else "") for s, a in evals]
        for key, name in (("env/tool_call_rate", "tool-call rate"), ("env/outcome", "correct")):
            if any(key in r for r in self.metrics):
                lines.append(f"{name} per step: " + " ".join(
                    f"{r[key]:.2f}" for r in self.metrics if key in r))
        if len(evals) >= 2:
            lines.append(f"change: {100 * (evals[-1][1] - evals[0][1]):+.1f} points")
        return "\n".join(lines + summary_lines(self.metrics))

    def export(self, path: str) -> dict[str, str]:
        """The trained policy and PPO's critic, each in its own folder (``rlx.io.export``),
        published atomically with the step as version: ``<path>/policy`` (LoRA mode the adapter
        as a PEFT folder on ``model.path``, full mode a HF folder) and, with a critic,
        ``<path>/critic`` (``export_critic``: its adapter and value head apart from the policy's).
        Every process takes part; process 0 writes. Returns the folders by name."""
        policy, critic = self.hosts.learner_model(self.compiled), self.hosts.critic(self.compiled)
        return self.hosts.on_primary(self._export, path, policy, critic)

    def _export(self, path: str, policy: nnx.Module, critic) -> dict[str, str]:
        cfg, version = self.cfg, str(self.step_count)
        lora = cfg.lora if cfg.train.mode == "lora" else None
        out = {"policy": os.path.join(path, "policy")}
        if lora is not None:
            export_peft(policy, lora, out["policy"], version, base_model_name_or_path=cfg.model.path)
        else:
            export_merged(policy, out["policy"], version)
        if critic is not None:
            out["critic"] = export_critic(*critic, os.path.join(path, "critic"), version, lora=lora,
                                          base_model_name_or_path=cfg.model.path)
        return out

    def close(self) -> None:
        """Finish pending work (checkpoint writes, a prefetched generation), stop the engine's
        servers and the reward workers, close the logs."""
        if self._queue is not None:
            self._queue.close()
        if self.checkpointer is not None:
            self.checkpointer.close()
        self.logger.close()
        if self.engine is not None:  # a process that does not sample holds none
            self.engine.close()
        close = getattr(self.reward, "close", None)
        if close is not None:
            close()


def staleness(rollouts: Sequence[Rollout], version: int) -> dict[str, float]:
    """How many versions behind ``version`` (the policy the step trained) the rollouts were
    sampled: per completion by its oldest token (``rollout/staleness``, mean and max over the
    batch) and per token (``rollout/token_staleness``)."""
    per_seq = np.array([version - r.weight_version for r in rollouts], np.float64)
    per_token = np.concatenate([version - (np.full(len(r.completion_ids), r.weight_version)
                                           if r.token_versions is None else r.token_versions)
                                for r in rollouts] + [np.zeros(0)]).astype(np.float64)
    return {"rollout/staleness": float(per_seq.mean()), "rollout/staleness_max": float(per_seq.max()),
            "rollout/token_staleness": float(per_token.mean()) if per_token.size else 0.0,
            "rollout/token_staleness_max": float(per_token.max(initial=0.0))}


__all__ = ["NonFiniteError", "Run", "staleness"]
