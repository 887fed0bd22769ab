"""Which process does what in a multi-host run (``config.distributed``), for ``rlx.run.loop.Run``.

Every process runs the same loop over one mesh spanning all processes' devices (``rlx.run.multihost``).
In each step:

1. data: a process reads its own shards of the data (``distributed.data_shards``; one per process
   by default), ``prompts_per_step / data_shards`` prompts from each, concatenated in shard order.
   The global prompt batch is every process's prompts in process order, i.e. the shards in order:
   with ``data_shards`` fixed it is the same on any process count that divides it (one process
   reading shards 0 and 1 sees the global batch of two processes reading one each).
2. rollouts (``distributed.rollouts``):

   * ``"global"``: every process's prompts are gathered to every process, and every process runs
     the built-in engine as one program over the whole mesh, on the learner's own arrays (no host
     copy of the model; only token ids, log-probs and lengths reach the hosts). The engine's
     calls are collectives, so they run on the thread that runs the train steps, in the same
     order on every process: generation does not overlap an update (``max_staleness`` keeps its
     meaning, one-step-off batches are generated before the update that trains on the older).
     Tool-use episodes run alike on every process, each process calling the environments of its
     share of them (``Hosts.episode_share``): tools run once per episode and every process
     continues from the same replies. ``"auto"``, the default, is this with the built-in engine;
   * ``"primary"`` (``"auto"`` with SGLang): every process's prompts are gathered to process 0, whose engine samples all of
     them; the rollouts are broadcast to every process;
   * ``"per_host"``: each process samples its own prompts with its own engine; the rollouts are
     all-gathered.

   Either way every process then holds the same global rollouts, prompt-major in process order;
   a GRPO group (one prompt's samples) is sampled by one engine and never split. The engines seed
   every sample by (step, prompt uid, sample index), so both modes draw the same tokens.
3. rewards: each process scores the rollouts of its own prompts (it holds their examples: answers,
   tests, environments; an episode comes graded by its environment) and the scores are all-gathered, so advantages, dynamic sampling and the
   padded batch come out identical on every process;
4. batch: each process puts only its own rows of that batch on its devices (``take_local_rows``,
   ``global_batch``) for the compiled steps;
5. weights: ``"global"``: the engine reads the learner's arrays where they lie, as on one process.
   ``"primary"`` and ``"per_host"``: an engine runs on its own process's devices (a
   process-local mesh), built from a host copy of the learner's weights; after each update the
   trainable variables are all-gathered (``to_host``) and installed, as an ``nnx.State``, where
   an engine runs.

Evaluation, the parity preflight and ``Run.generate`` run on every process with ``"global"``
(the same engine calls, the same result), else on process 0, which shares its result (or its
error) with the others. Metrics and logs are written by process 0 (``MetricsLogger``);
checkpoints by every process together (orbax), with the run's position gathered into one record
(``position``: every data shard's state, every process's rollouts in flight), so a checkpoint
resumes on another process count that divides ``data_shards`` (``restore_position``). A signal on
any process stops every process after the same step.

With one process every exchange is the identity and the engine shares the learner's mesh, model
and weight updates, exactly as a single-process run always did.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import grain
import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from rlx.config import RunConfig
from rlx.data.pipeline import PromptBatch
from rlx.errors import ConfigError
from rlx.envs.episode import EpisodeShare
from rlx.learner.batching import shard_batch
from rlx.learner.step import Compiled
from rlx.mesh import MeshShape, make_mesh
from rlx.rollout.sglang.policy import stream_weights
from rlx.run import multihost
from rlx.types import Prompt, Rollout, RolloutEngine, TrainBatch


class ShardedPrompts(grain.DatasetIterator):
    """One ``PromptBatch`` per step from several shard iterators, concatenated in shard order."""

    def __init__(self, shards: Sequence[grain.DatasetIterator]):
        super().__init__(list(shards))
        self._shards = list(shards)

    def __next__(self) -> PromptBatch:
        parts = [next(s) for s in self._shards]
        return PromptBatch(prompts=tuple(p for b in parts for p in b.prompts),
                           examples=tuple(e for b in parts for e in b.examples),
                           epoch=max(b.epoch for b in parts))

    def get_state(self) -> dict[str, Any]:
        return {"shards": [s.get_state() for s in self._shards]}

    def set_state(self, state: dict[str, Any]) -> None:
        if len(state["shards"]) != len(self._shards):
            raise ValueError(f"a data position of {len(state['shards'])} shards does not fit "
                             f"{len(self._shards)} shards")
        for shard, s in zip(self._shards, state["shards"]):
            shard.set_state(s)


def local_mesh(mesh: Mesh) -> Mesh:
    """A mesh over this process's devices: the learner's tensor and expert sizes where they fit
    in it, the rest data-parallel (an engine of one process)."""
    n = jax.local_device_count()
    tensor = math.gcd(mesh.shape["tensor"], n)
    expert = math.gcd(mesh.shape["expert"], n // tensor)
    return make_mesh(MeshShape(data=n // (tensor * expert), tensor=tensor, expert=expert),
                     jax.local_devices())


@dataclasses.dataclass(frozen=True)
class Hosts:
    """This process's part in the run (see the module docstring); the identity on one process."""

    rollouts: str = "primary"  # "global" | "primary" | "per_host" (distributed.rollouts, resolved)
    data_shards: int = 0  # 0: one per process
    streams: bool = False  # SGLang full mode in memory: every process streams the weights
    index: int = dataclasses.field(default_factory=jax.process_index)
    count: int = dataclasses.field(default_factory=jax.process_count)

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "Hosts":
        """From ``config.distributed`` (after ``jax.distributed`` is up); checks the data split."""
        streams = (cfg.rollout.engine == "sglang" and cfg.train.mode == "full"
                   and cfg.rollout.sglang.weight_sync == "memory")
        hosts = cls(cfg.distributed.resolved_rollouts(cfg.rollout.engine),
                    cfg.distributed.data_shards, streams)
        shards, per_step = hosts.shards, cfg.data.prompts_per_step
        if shards % hosts.count:
            raise ConfigError(f"config.distributed.data_shards={shards} is not a multiple of the "
                              f"{hosts.count} JAX processes")
        if per_step % shards:
            raise ConfigError(f"config.data.prompts_per_step={per_step} is not a multiple of the "
                              f"{shards} data shards (config.distributed.data_shards, default one "
                              "per process): each shard gives the same share of a step's prompts")
        return hosts

    @property
    def shards(self) -> int:
        return self.data_shards or self.count

    @property
    def multi(self) -> bool:
        return self.count > 1

    @property
    def spmd(self) -> bool:
        """Several processes running one engine program over the whole mesh (``"global"``)."""
        return self.multi and self.rollouts == "global"

    @property
    def runs_engine(self) -> bool:
        """Whether this process samples (and so holds an engine)."""
        return not self.multi or self.rollouts in ("global", "per_host") or self.index == 0

    # --- build --------------------------------------------------------------------------------
    def prompt_data(self, make: Callable[[int, int, int], grain.DatasetIterator],
                    prompts_per_step: int) -> grain.DatasetIterator:
        """This process's prompts: ``make(shard_index, shard_count, batch_size)`` per own shard."""
        per = self.shards // self.count
        own = [make(i, self.shards, prompts_per_step // self.shards)
               for i in range(self.index * per, (self.index + 1) * per)]
        return own[0] if per == 1 else ShardedPrompts(own)

    def engine(self, make: Callable[[Compiled, Mesh], RolloutEngine], compiled: Compiled,
               mesh: Mesh) -> RolloutEngine | None:
        """``make(compiled, mesh)``: one process, or ``"global"``, on the learner's own; else on
        this process's devices from a host copy of the learner's weights, and only where it
        samples (else None). A failure on any process is raised on every process (none waits
        for the others)."""
        if not self.multi:
            return make(compiled, mesh)
        engine = None
        on_device = self.spmd or self.streams  # the engine reads (or streams) the learner's arrays
        host = None if on_device else self._host_copy(compiled)  # collective: every process
        try:
            if on_device and self.runs_engine:
                engine = make(compiled, mesh)
            elif self.runs_engine:
                engine = make(host, local_mesh(mesh))
        except Exception as e:  # noqa: BLE001 - shared below, then raised
            self._agree_on_failure(e)
            raise
        try:
            self._agree_on_failure(None)
        except RuntimeError:
            if engine is not None:  # another process failed: stop this one's servers
                engine.close()
            raise
        if self.streams:
            self.push_weights(engine, compiled, 0)
        return engine

    def _host_copy(self, compiled: Compiled, everywhere: bool = False) -> Compiled:
        """``compiled`` with the policy's parameters and frozen base as host numpy (collective):
        on every process with ``"per_host"`` (or ``everywhere``), else on process 0 alone (the
        others gather each array in turn and drop it, keeping shapes only)."""
        fetch = (multihost.to_host if everywhere or self.rollouts == "per_host"
                 else multihost.to_primary)
        return dataclasses.replace(compiled, state=compiled.state.replace(
            params=fetch(compiled.state.params), frozen=fetch(compiled.state.frozen)))

    def push_weights(self, engine: RolloutEngine | None, compiled: Compiled, version: int) -> None:
        """SGLang full mode in memory (``streams``): every process reads the model's weights one
        at a time, each all-gathered, and process 0's policy sends them in buckets
        (``rlx.rollout.sglang.policy.stream_weights``). No host holds the model. An error on
        process 0 is raised on every process once all of them have read every weight."""
        error = None
        try:
            stream_weights(engine, compiled.model(), version)
        except Exception as e:  # noqa: BLE001 - shared below, then raised
            error = e
        shared = multihost.broadcast_object(None if error is None
                                            else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        if shared is not None:
            raise RuntimeError(f"process 0 of the run failed to send the weights: {shared}")

    def _agree_on_failure(self, error: BaseException | None) -> None:
        """Share this process's error; raise on a process that had none when another had one."""
        failed = [(i, e) for i, e in enumerate(multihost.allgather_objects(
            None if error is None else f"{type(error).__name__}: {error}")) if e is not None]
        if failed and error is None:
            i, message = failed[0]
            raise RuntimeError(f"process {i} of the run failed: {message}")

    # --- one step -------------------------------------------------------------------------------
    def to_generate(self, prompts: Sequence[Prompt]) -> Sequence[Prompt]:
        """The prompts this process's engine samples: its own (one process, "per_host"), every
        process's (every process in "global", process 0 in "primary"), or none."""
        if not self.multi or self.rollouts == "per_host":
            return prompts
        everyone = multihost.allgather_objects(tuple(prompts))
        return tuple(p for part in everyone for p in part) if self.spmd or self.index == 0 else ()

    def all_examples(self, examples: Sequence[Any]) -> tuple[Any, ...]:
        """Every process's examples of this step, in process order (DPO's pairs), everywhere."""
        if not self.multi:
            return tuple(examples)
        return tuple(e for part in multihost.allgather_objects(tuple(examples)) for e in part)

    def every_episode(self, items: Sequence[Any]) -> tuple[Any, ...]:
        """Per-episode items of every process, everywhere: ``all_examples``, or (``"global"``:
        every process ran every episode) this process's own."""
        return tuple(items) if self.spmd else self.all_examples(items)

    def episode_share(self) -> EpisodeShare | None:
        """``"global"``: each process runs the env calls of its share of the episodes, which
        every process drives (``rlx.envs.episode.EpisodeShare``); else None."""
        if not self.spmd:
            return None
        return EpisodeShare(self.index, self.count, multihost.allgather_objects)

    def share(self, rollouts: list[Rollout], seconds: float, counts: dict[str, int]
              ) -> tuple[list[Rollout], float, dict[str, int]]:
        """The global rollouts (process order), generation seconds (the slowest process's) and
        the engines' counts (``GenerationCost.counts``, summed over the processes that
        generated), on every process."""
        if not self.multi or self.spmd:  # "global": every process holds them all already
            return rollouts, seconds, counts
        if self.rollouts == "primary":
            return multihost.broadcast_object((list(rollouts), seconds, counts))
        parts = multihost.allgather_objects((list(rollouts), seconds, counts))
        total: dict[str, int] = {}
        for *_, part in parts:
            for name, n in part.items():
                total[name] = total.get(name, 0) + n
        return [r for part, *_ in parts for r in part], max(t for _, t, _ in parts), total

    def gather_scores(self, total: int, own: Sequence[int], scores: Sequence[float],
                      texts: Sequence[str], reasons: Sequence[str]
                      ) -> tuple[np.ndarray, list[str], list[str]]:
        """Every rollout's score, text and grading reason from each process's ``own`` (indices
        into the global rollouts) ones; raises when some rollout was scored by no process."""
        mine = (list(own), list(scores), list(texts), list(reasons))
        parts = multihost.allgather_objects(mine) if self.multi else [mine]
        out, out_texts, out_reasons = np.zeros(total, np.float64), [None] * total, [""] * total
        for index, part_scores, part_texts, part_reasons in parts:
            for i, s, t, why in zip(index, part_scores, part_texts, part_reasons):
                out[i], out_texts[i], out_reasons[i] = s, t, why
        missing = [i for i, t in enumerate(out_texts) if t is None]
        if missing:
            raise RuntimeError(f"{len(missing)} rollouts (the first: {missing[0]}) belong to no "
                               "process's prompt batch; engines must return the prompts' uids")
        return out, out_texts, out_reasons

    def device_batch(self, batch: TrainBatch, mesh: Mesh) -> TrainBatch:
        """The host batch (the same on every process) on the mesh, each process giving its rows."""
        if not self.multi:
            return shard_batch(batch, mesh)
        local = multihost.take_local_rows(batch, mesh)
        return multihost.global_batch(local, mesh, batch.shape[0])

    def to_numpy(self, x: jax.Array) -> np.ndarray:
        """A device array of the global batch as host numpy, on every process."""
        return multihost.to_host(x)

    def engine_weights(self, compiled: Compiled) -> nnx.Module | nnx.State | None:
        """What ``RolloutEngine.update_weights`` takes after an update: one process (or
        "global") the whole model, on the devices; else the trainable variables (all-gathered;
        every process takes part)."""
        if not self.multi or self.spmd:
            return compiled.model()
        return multihost.to_host(compiled.state.params)

    def sync(self, queue: Any, engine: RolloutEngine | None, compiled: Compiled,
             version: int) -> None:
        """After an update, the learner's weights to the engine as ``version``: queued behind
        what the engine runs (``RolloutQueue.sync``); streamed (``push_weights``) on this thread,
        every process together, once the engine is idle."""
        if self.multi and self.streams:
            queue.wait()
            self.push_weights(engine, compiled, version)
            return
        queue.sync(self.engine_weights(compiled), version)

    def sync_weights(self, engine: RolloutEngine | None, compiled: Compiled, version: int) -> None:
        """The learner's current weights to the engine as ``version``: one process (or "global")
        the whole model; streamed (``push_weights``); else the trainable variables
        (all-gathered), where an engine runs."""
        if self.multi and self.streams:
            self.push_weights(engine, compiled, version)
            return
        if not self.multi or self.spmd:
            engine.update_weights(compiled.model(), version)
            return
        params = multihost.to_host(compiled.state.params)
        if engine is not None:
            engine.update_weights(params, version)

    def learner_model(self, compiled: Compiled) -> nnx.Module:
        """The learner's model: one process its own; several a host copy (process 0 writes an
        export from it)."""
        if not self.multi:
            return compiled.model()
        return self._host_copy(compiled, everywhere=True).model()

    def preflight_model(self, compiled: Compiled) -> nnx.Module:
        """The learner's model the parity preflight scores with: its own arrays where every
        process runs the check ("global"), else ``learner_model``."""
        return compiled.model() if self.spmd else self.learner_model(compiled)

    def critic(self, compiled: Compiled) -> tuple[nnx.Module, Any] | None:
        """PPO's critic (body module, value head) as ``Compiled.critic``: one process its own;
        several a host copy (every process takes part)."""
        if not self.multi or compiled.state.critic is None:
            return compiled.critic()
        critic = compiled.state.critic
        host = dataclasses.replace(compiled, state=compiled.state.replace(
            frozen=multihost.to_host(compiled.state.frozen), critic=critic.replace(
                params=multihost.to_host(critic.params),
                frozen=None if critic.frozen is None else multihost.to_host(critic.frozen))))
        return host.critic()

    def with_engine(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, which calls the engine: on every process with "global" (the engine's
        calls are collectives; each gets the same result), else ``on_primary``."""
        return fn(*args) if self.spmd else self.on_primary(fn, *args)

    def on_primary(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on process 0; its result (or its error, raised) on every process."""
        if not self.multi:
            return fn(*args)
        result = error = None
        if self.index == 0:
            try:
                result = fn(*args)
            except Exception as e:  # noqa: BLE001 - shared, then raised everywhere
                error = e
        shared = error
        if error is not None and not _picklable(error):
            shared = RuntimeError(f"{type(error).__name__}: {error}")
        result, shared = multihost.broadcast_object((result, shared))
        if error is not None:
            raise error
        if shared is not None:
            raise shared
        return result

    # --- checkpoints ------------------------------------------------------------------------------
    def position(self, data_state: Any, in_flight: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The run's position for a checkpoint, readable on any process count: every data
        shard's state in shard order (``data_state`` is this process's iterator state before the
        oldest batch in flight) and each process's progress on the batches in flight
        (``RolloutQueue.snapshot``: ``{"step", "progress"}`` per batch). Collective."""
        per = self.shards // self.count
        own = ([data_state] if per == 1 else list(data_state["shards"]), list(in_flight))
        parts = multihost.allgather_objects(own) if self.multi else [own]
        return {"processes": self.count, "rollouts": self.rollouts,
                "data_shards": [s for shards, _ in parts for s in shards],
                "in_flight": [{"step": entry["step"],
                               "progress": [flights[i]["progress"] for _, flights in parts]}
                              for i, entry in enumerate(parts[0][1])]}

    def restore_position(self, data: grain.DatasetIterator, position: dict[str, Any]
                         ) -> list[tuple[int, dict[str, Any]]]:
        """Move ``data`` (this process's shards) to a checkpoint's ``position``; the batches that
        were in flight there, as (step, this process's progress). Written by another process
        count, the progress of every process is pooled (each generation takes its own prompts')."""
        shards = position["data_shards"]
        if len(shards) != self.shards:
            raise ConfigError(
                f"the checkpoint's data position has {len(shards)} data shards, this run "
                f"{self.shards}: set config.distributed.data_shards={len(shards)} to resume it "
                "(the global batches depend on the shard count)")
        per = self.shards // self.count
        own = shards[self.index * per:(self.index + 1) * per]
        data.set_state(own[0] if per == 1 else {"shards": own})
        same = position["processes"] == self.count
        return [(entry["step"], entry["progress"][self.index] if same
                 else pooled_progress(entry["progress"])) for entry in position["in_flight"]]

    def first_signal(self, received: int | None) -> int | None:
        """The stop signal any process received (the first by process), on every process."""
        if not self.multi:
            return received
        return next((s for s in multihost.allgather_objects(received) if s is not None), None)


def pooled_progress(progress: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Every process's progress on one batch as one (``"pooled"``: a generation then takes the
    entries of its own prompts, in prompt order)."""
    return {"pooled": True, "done": [r for p in progress for r in p.get("done") or ()],
            "parts": [c for p in progress for c in p.get("parts") or ()]}


def _picklable(obj: Any) -> bool:
    try:
        pickle.loads(pickle.dumps(obj))
        return True
    except Exception:  # noqa: BLE001
        return False
