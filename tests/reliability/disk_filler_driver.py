"""The run ``rlx.launch`` builds from the same flags, whose disk another writer fills while a
checkpoint is being written: right after the save of step ``--fill_step`` started (its write in
the background), a file takes all the free space of the output folder's disk. The run is then
trained by ``rlx.launch.train`` (its one-line errors and exit statuses).

``python -m tests.reliability.disk_filler_driver --fill_step K --config=FILE [--config.a.b=v]``.
The point is reached by composition (the run's checkpointer wrapped), not by patching rlx.
"""

from __future__ import annotations

import os

from absl import app, flags

from rlx import launch  # defines --config

_FILL_STEP = flags.DEFINE_integer("fill_step", 2, "The step whose checkpoint write is cut short.")


def fill(folder: str) -> None:
    """A file in ``folder`` taking all the free space of its disk."""
    block = b"\0" * (1 << 16)
    try:
        with open(os.path.join(folder, "filler"), "wb") as f:
            while True:
                f.write(block)
                f.flush()
    except OSError:  # full (the run's own writes may have filled it first)
        pass


class FillingCheckpointer:
    """The run's checkpointer; once the save of ``step`` started, the disk is filled."""

    def __init__(self, inner, step: int, folder: str):
        self._inner, self._step, self._folder = inner, step, folder

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def save(self, step, *args, **kwargs):
        started = self._inner.save(step, *args, **kwargs)
        if step == self._step and started:
            fill(self._folder)
        return started


def main(argv: list[str]) -> None:
    del argv
    launch.quiet_logs()
    from rlx.config import parse_config
    from rlx.run.build import build

    cfg = parse_config(flags.FLAGS.config)
    run = build(cfg)
    run.checkpointer = FillingCheckpointer(run.checkpointer, _FILL_STEP.value, cfg.output_dir)
    launch.train(run)


if __name__ == "__main__":
    app.run(main)
