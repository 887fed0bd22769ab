"""Rollouts ahead of the learner: up to ``train.max_staleness`` batches in flight.

One worker thread owns the engine while the run trains: it runs, in the order they were queued,
the generations of the batches in flight and the weight syncs after each update, so the engine
samples every batch with the newest weights it has and the order of events (and so every token)
is the same on every run. A step takes the oldest batch, queues new ones until ``k`` are in
flight, trains, and queues the sync of its new weights. The next update (which donates the learner
state the sync reads) waits for that sync.

* ``k = 0``: each batch is generated when its step takes it (synchronous on-policy).
* ``k >= 1``: batch t + k starts generating at step t with the weights of step t; a batch is
  consumed k versions after the weights that sampled it (one-step-off for k = 1).
* ``rollout.partial``: a batch's budget is split into ``k + 1`` segments; each step advances every
  batch in flight by one segment, the step that takes a batch finishes it. A completion that spans
  a weight sync continues with the new weights: the engine is given the prompt and the tokens so
  far as a new prompt (its KV entries are recomputed with the new weights), and every token is
  tagged with the version that sampled it (``Rollout.token_versions``); its ``sampler_logp`` are
  those of that version, which is what truncated importance sampling divides by. Later tokens of a
  completion are fresher than its first (the staleness of the last segment is 0).

A checkpoint records the batches in flight (``snapshot``: once the queued work has run, each
batch's finished rollouts or its completions so far) and a resumed run puts them back
(``resume``), so it trains on the rollouts the uninterrupted run trains on.

Every generation call is checked (``check_rollouts``): exactly ``n`` samples of every prompt, all
made with the version the engine serves at that moment.

``config.env.kind = "tools"``: a batch's generation is ``n`` whole tool-use episodes per prompt
(``rlx.envs.runner.EnvRunner``, given the batch's examples); an episode's turns are all sampled by
the one weight version the engine serves while the batch is generated (a weight sync waits behind
it), so one-step-off and deeper queues work unchanged. In a multi-host ``primary`` run process 0
runs every process's examples.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rlx.data.pipeline import PromptBatch
from rlx.data.sources import Example
from rlx.envs.runner import EnvRunner
from rlx.rollout.errors import RolloutError
from rlx.run.hosts import Hosts
from rlx.run.progress import decode_rollout, encode_rollout
from rlx.types import Prompt, Rollout, RolloutEngine, SamplingParams


@dataclasses.dataclass(frozen=True)
class GenerationCost:
    """What generating one batch took: wall seconds, and the engine's counts over it
    (``JaxEngine.counters``: "moe_dropped_pairs", the (token, expert) pairs its MoE dispatch
    capacity dropped; "preempted", sequences its paged cache preempted; logged as
    ``rollout/<name>``; an engine that counts nothing has none)."""

    seconds: float
    counts: dict[str, int] = dataclasses.field(default_factory=dict)


def _counters(engine: RolloutEngine) -> dict[str, int]:
    counters = getattr(engine, "counters", None)
    return {} if counters is None else counters()


@dataclasses.dataclass
class _Completion:
    """A completion being sampled, segment by segment."""

    prompt: Prompt
    index: int  # sample index within its prompt's group
    ids: list[int] = dataclasses.field(default_factory=list)
    logp: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    stopped: bool = False
    has_logprobs: bool = True

    def rollout(self, budget: int) -> Rollout:
        versions = np.asarray(self.versions, np.int64)
        return Rollout(
            prompt_uid=self.prompt.uid, prompt_ids=np.asarray(self.prompt.token_ids, np.int32),
            completion_ids=np.asarray(self.ids, np.int32),
            sampler_logp=np.asarray(self.logp, np.float32),
            finish_reason="stop" if self.stopped else "length",
            weight_version=int(versions.min()) if len(versions) else 0, sample_index=self.index,
            has_logprobs=self.has_logprobs, token_versions=versions)


class _Generation:
    """One batch's generation: whole (one call), or in segments (``rollout.partial``)."""

    def __init__(self, prompts: Sequence[Prompt], sampling: SamplingParams, segments: int,
                 episodes: Callable[[RolloutEngine, SamplingParams], list[Rollout]] | None = None):
        self.prompts, self.sampling, self.episodes = tuple(prompts), sampling, episodes
        self.segment = max(1, math.ceil(sampling.max_new_tokens / segments))
        self.partial = segments > 1
        self.done: list[Rollout] | None = [] if not prompts else None
        self.parts = [_Completion(p, j) for p in self.prompts for j in range(sampling.n)]
        self.seconds = 0.0
        self.counts: dict[str, int] = {}  # the engine's counters over this batch (``_count``)
        self.error: BaseException | None = None  # the first failure, raised again by later calls

    def advance(self, engine: RolloutEngine) -> None:
        """Generate one more segment (everything, without segments) with the engine's weights.
        A failure is final: it is raised again by every later call (never retried silently)."""
        if self.error is not None:
            raise self.error
        if self.done is not None:
            return
        t, before = time.perf_counter(), _counters(engine)
        try:
            if not self.partial:
                version = engine.weight_version
                rollouts = (engine.generate(self.prompts, self.sampling) if self.episodes is None
                            else self.episodes(engine, self.sampling))
                check_rollouts(self.prompts, self.sampling.n, rollouts, version)
                self.done = rollouts
            else:
                self._segment(engine)
        except BaseException as e:
            self.error = e
            raise
        finally:
            self.seconds += time.perf_counter() - t
            self._count(before, _counters(engine))

    def _count(self, before: dict[str, int], after: dict[str, int]) -> None:
        """Add what the engine's counters counted between two readings."""
        for name in before.keys() & after.keys():
            self.counts[name] = self.counts.get(name, 0) + after[name] - before[name]

    def _segment(self, engine: RolloutEngine) -> None:
        budget = self.sampling.max_new_tokens
        live = [c for c in self.parts if not c.stopped and len(c.ids) < budget]
        # one request per completion; its uid names the completion and its length so far, so each
        # segment draws fresh random numbers (an engine seeds a request by its uid)
        prompts = [Prompt(f"{c.prompt.uid}\x00{c.index}\x00{len(c.ids)}",
                          tuple(c.prompt.token_ids) + tuple(c.ids)) for c in live]
        sampling = dataclasses.replace(self.sampling, n=1, max_new_tokens=min(
            self.segment, budget - min(len(c.ids) for c in live)))
        version = engine.weight_version
        outs = engine.generate(prompts, sampling)
        check_rollouts(prompts, 1, outs, version)
        for c, r in zip(live, outs):
            take = min(len(r.completion_ids), budget - len(c.ids))
            c.ids += r.completion_ids[:take].tolist()
            c.logp += r.sampler_logp[:take].tolist()
            c.versions += [version] * take
            c.has_logprobs = c.has_logprobs and r.has_logprobs
            c.stopped = r.finish_reason == "stop" and take == len(r.completion_ids)
        if all(c.stopped or len(c.ids) >= budget for c in self.parts):
            self.done = [c.rollout(budget) for c in self.parts]

    def finish(self, engine: RolloutEngine) -> tuple[list[Rollout], GenerationCost]:
        while self.done is None:
            self.advance(engine)
        return self.done, GenerationCost(self.seconds, self.counts)

    def progress(self) -> dict[str, Any]:
        """What a checkpoint records (JSON, exact): the finished rollouts, or each completion's
        tokens so far (``rlx.run.progress``)."""
        if self.done is not None:
            return {"done": [encode_rollout(r) for r in self.done]}
        return {"parts": [{"uid": c.prompt.uid, "index": c.index, "ids": c.ids, "logp": c.logp,
                           "versions": c.versions, "stopped": c.stopped,
                           "has_logprobs": c.has_logprobs} for c in self.parts]}

    def resume(self, progress: dict[str, Any]) -> None:
        """Continue from a checkpoint's ``progress`` of this batch (``"pooled"``: every process's,
        of which this generation takes its own prompts', in prompt order)."""
        order = {p.uid: i for i, p in enumerate(self.prompts)}
        done = [decode_rollout(r) for r in progress.get("done") or ()]
        if progress.get("pooled"):
            done = sorted((r for r in done if r.prompt_uid in order),
                          key=lambda r: (order[r.prompt_uid], r.sample_index))
        if len(done) == len(self.parts):
            self.done = done
            return
        parts = {(c["uid"], c["index"]): c for c in progress.get("parts") or ()}
        for c in self.parts:
            saved = parts[(c.prompt.uid, c.index)]
            c.ids, c.logp, c.versions = list(saved["ids"]), list(saved["logp"]), list(saved["versions"])
            c.stopped, c.has_logprobs = saved["stopped"], saved["has_logprobs"]


@dataclasses.dataclass
class _InFlight:
    batch: PromptBatch
    data_position: Any  # the data iterator's state before this batch was taken
    generation: _Generation
    step: int  # the step that trains on it


@dataclasses.dataclass
class RolloutQueue:
    """The batches in flight and the engine's worker (see the module docstring)."""

    source: Callable[[], RolloutEngine | None]  # the run's engine when a job is queued
    hosts: Hosts
    depth: int  # train.max_staleness
    partial: bool  # rollout.partial
    env: EnvRunner | None = None  # env.kind "tools": episodes instead of single completions
    _flight: collections.deque = dataclasses.field(default_factory=collections.deque)
    _pool: concurrent.futures.ThreadPoolExecutor | None = None
    _jobs: list = dataclasses.field(default_factory=list)  # queued, not yet waited for
    _synced: concurrent.futures.Future | None = None  # the last weight sync queued

    @property
    def engine(self) -> RolloutEngine | None:
        """The run's engine now (a run may be handed another one between steps)."""
        return self.source()

    def _submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        """``fn(*args)`` on the engine's worker thread; with "global" rollouts (the engine's
        calls are collectives, made in the same order on every process) at once, here."""
        if self.hosts.spmd:
            job: concurrent.futures.Future = concurrent.futures.Future()
            try:
                job.set_result(fn(*args))
            except Exception as e:  # noqa: BLE001 - raised where the job's result is taken
                job.set_exception(e)
            return job
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, "rlx-rollout")
        job = self._pool.submit(fn, *args)
        self._jobs.append(job)
        return job

    def start(self, batch: PromptBatch, position: Any, sampling: SamplingParams, step: int) -> None:
        """Queue the generation of ``batch`` (for step ``step``) behind everything queued."""
        flight = self._in_flight(batch, position, sampling, step)
        self._submit(flight.generation.advance, self.engine)

    def resume(self, batch: PromptBatch, position: Any, sampling: SamplingParams, step: int,
               progress: dict[str, Any]) -> None:
        """Put ``batch`` back in flight where a checkpoint's ``snapshot`` left it; nothing is
        queued (the snapshot was taken once the queued work had run)."""
        self._in_flight(batch, position, sampling, step).generation.resume(progress)

    def _in_flight(self, batch: PromptBatch, position: Any, sampling: SamplingParams,
                   step: int) -> _InFlight:
        prompts = self.hosts.to_generate(batch.prompts)
        segments = self.depth + 1 if self.partial else 1
        episodes = None
        if self.env is not None:
            env, examples = self.env, self._examples(batch)
            episodes = lambda engine, sampling: env.generate(engine, examples, sampling)  # noqa: E731
        flight = _InFlight(batch, position, _Generation(prompts, sampling, segments, episodes), step)
        self._flight.append(flight)
        return flight

    def _examples(self, batch: PromptBatch) -> tuple[Example, ...]:
        """The examples whose episodes this process runs (as ``Hosts.to_generate`` for prompts)."""
        hosts = self.hosts
        if not hosts.multi or hosts.rollouts == "per_host":
            return tuple(batch.examples)
        everyone = hosts.all_examples(batch.examples)
        return everyone if hosts.spmd or hosts.index == 0 else ()

    def advance(self) -> None:
        """``rollout.partial``: one more segment of every batch in flight, with the weights the
        engine will have when the worker gets to it."""
        for flight in self._flight:
            if self.partial:
                self._submit(flight.generation.advance, self.engine)

    def take(self) -> tuple[PromptBatch, list[Rollout], GenerationCost]:
        """The oldest batch, finished with the engine's newest weights (waits for it)."""
        flight = self._flight.popleft()
        rollouts, cost = self._submit(flight.generation.finish, self.engine).result()
        self._jobs = [j for j in self._jobs if not j.done()]
        rollouts, seconds, counts = self.hosts.share(rollouts, cost.seconds, cost.counts)
        return flight.batch, rollouts, GenerationCost(seconds, counts)

    def sync(self, weights: Any, version: int) -> None:
        """Queue the engine's update to ``weights`` as ``version``."""
        if self.engine is not None:
            self._synced = self._submit(self.engine.update_weights, weights, version)

    def wait_synced(self) -> None:
        """Until the last weight sync queued has run: before an update donates what it reads."""
        if self._synced is not None:
            self._synced.result()

    def wait(self) -> None:
        """Until every queued job has run (the first that failed raises here)."""
        jobs, self._jobs = self._jobs, []
        for job in jobs:
            job.result()

    @property
    def in_flight(self) -> int:
        return len(self._flight)

    def oldest_position(self) -> Any | None:
        """The data position before the oldest batch in flight (what a checkpoint records)."""
        return self._flight[0].data_position if self._flight else None

    def snapshot(self) -> list[dict[str, Any]]:
        """The batches in flight once the queued work has run (a checkpoint's record): per batch,
        the step that trains on it and its generation's ``progress``; from a failed generation on,
        none (a resumed run generates those again)."""
        concurrent.futures.wait(self._jobs)  # errors stay for take() / wait() to raise
        out = []
        for flight in self._flight:
            if flight.generation.error is not None:
                break
            out.append({"step": flight.step, "progress": flight.generation.progress()})
        return out

    def close(self) -> None:
        """Let the queued jobs finish (their errors are dropped), stop the worker."""
        if self._pool is not None:
            concurrent.futures.wait(self._jobs)
            self._pool.shutdown(wait=True)
            self._pool = None
        self._jobs, self._synced = [], None
        self._flight.clear()


def check_rollouts(prompts: Sequence[Prompt], n: int, rollouts: Sequence[Rollout],
                   version: int) -> None:
    """Raise ``RolloutError`` unless ``rollouts`` are exactly ``n`` samples of every prompt (each
    ``(uid, sample_index)`` once) made with policy ``version``: a dropped, doubled, foreign or
    stale rollout is never trained on."""
    want = collections.Counter((p.uid, j) for p in prompts for j in range(n))
    got = collections.Counter((r.prompt_uid, r.sample_index) for r in rollouts)
    problems = []
    if got != want:
        missing, extra = sorted(want - got), sorted(got - want)
        problems += [f"{len(missing)} missing (first {missing[:3]})"] if missing else []
        problems += [f"{len(extra)} unexpected or doubled (first {extra[:3]})"] if extra else []
    stale = sorted({r.weight_version for r in rollouts} - {version})
    if stale:
        problems.append(f"made with weight_version {stale}, not the policy's {version}")
    if problems:
        raise RolloutError(f"the rollout engine returned {len(rollouts)} rollouts for "
                           f"{len(prompts)} prompts x {n} samples: {'; '.join(problems)}; "
                           "refusing to train on them (an engine bug or a server fault)")


__all__ = ["RolloutQueue", "check_rollouts"]
