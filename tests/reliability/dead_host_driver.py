"""Process 1 of the dead-host test's 2-process run: the run ``rlx.launch`` builds from the same
config file, which SIGKILLs itself at one point of step ``--kill-step`` (1-based):

* ``generate`` - in its engine's ``generate`` (``distributed.rollouts="per_host"``: every process
  samples its own prompts; the other process then waits for its rollouts);
* ``train`` - as the train step is called (the other process is inside its collectives);
* ``checkpoint`` - right after that step's checkpoint save started: its write is in progress.

``python -m tests.reliability.dead_host_driver --config FILE --coordinator HOST:PORT --kill-at
POINT --kill-step K``. The points are reached by composition (the run's engine, compiled steps
and checkpointer wrapped), not by patching rlx.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import signal


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _Delegate:
    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)


class KillingEngine(_Delegate):
    """Dies in the generation of step ``step`` (sampled with weight version ``step - 1``)."""

    def __init__(self, inner, step: int):
        super().__init__(inner)
        self._step = step

    def generate(self, prompts, sampling):
        if self._inner.weight_version == self._step - 1:
            _die()
        return self._inner.generate(prompts, sampling)


class KillingCheckpointer(_Delegate):
    """Dies once the save of step ``step`` started (its background write in progress)."""

    def __init__(self, inner, step: int):
        super().__init__(inner)
        self._step = step

    def save(self, step, *args, **kwargs):
        started = self._inner.save(step, *args, **kwargs)
        if step == self._step:
            _die()
        return started


def _killing_step(run, fn, step: int):
    def train_step(*args, **kwargs):
        if run.step_count == step - 1:
            _die()
        return fn(*args, **kwargs)
    return train_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", required=True)
    p.add_argument("--coordinator", required=True)
    p.add_argument("--kill-at", choices=("generate", "train", "checkpoint"), required=True)
    p.add_argument("--kill-step", type=int, required=True)
    args = p.parse_args()
    spec = importlib.util.spec_from_file_location("dead_host_config", args.config)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    config.distributed.process_id = 1
    config.distributed.coordinator_address = args.coordinator

    from rlx.run.build import build

    run = build(config, progress=False)
    if args.kill_at == "generate":
        run.engine = KillingEngine(run.engine, args.kill_step)
    elif args.kill_at == "train":
        run.compiled = dataclasses.replace(run.compiled, train_step=_killing_step(
            run, run.compiled.train_step, args.kill_step))
    else:
        run.checkpointer = KillingCheckpointer(run.checkpointer, args.kill_step)
    try:
        run.train()
    finally:
        run.close()


if __name__ == "__main__":
    main()
