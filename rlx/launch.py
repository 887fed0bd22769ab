"""``python -m rlx.launch --config configs/X.py[:VARIANT] [--config.a.b=v ...] [--dry_run]``:
the CLI.

Reads the config file (``:VARIANT``: ``get_config("VARIANT")``) and its overrides as every command
of rlx does (``rlx.commandline.config_from_argv``), validates it once (errors: one line naming the
field, exit status 2), then builds the run (``rlx.build``) and trains it; SIGTERM / Ctrl-C end it
after the current step with a checkpoint (exit status 128 + signal number; while the run is still
being built they stop it at once, cleaning up what was started), and ``--config.resume=latest``
continues it. Exit
status 3: too many non-finite updates in a row; 4: the rollout engine failed (no SGLang server
left, or one that could not start); 5: a checkpoint or the metrics could not be written (e.g.
the disk is full);
6: another process of a multi-host run was lost (``rlx.run.multihost.Watchdog``); each keeps the
checkpoints written and says where to resume.
``--dry_run`` only loads, shards and summarises the model. Everything else is done by the
library; this file stays short.
"""

from __future__ import annotations

import logging as std_logging
import signal
import sys

from absl import app, flags, logging

_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Load, shard and summarise the model; do not train.")


def _one_line_orbax_errors(record) -> bool:
    """Orbax logs a failed background write with its traceback (some in the message itself)
    before rlx raises it again as a ``CheckpointWriteError`` naming the cause, and asyncio each
    of its write tasks that failed too ("exception was never retrieved"): keep the first line of
    each, drop the tracebacks."""
    if record.levelno >= logging.converter.STANDARD_ERROR and (
            "orbax" in record.pathname or record.name == "asyncio"):
        lines = record.getMessage().splitlines()
        record.msg, record.args = (lines[0] if lines else ""), ()
        record.exc_info, record.exc_text = None, None
    return True


def _output_failed(run, error: OSError) -> str:
    """The line for metrics that could not be written: a checkpoint write that failed meanwhile
    (the same full disk) is reported instead, naming its step; else the last complete one."""
    from rlx.io.checkpoint import CheckpointError

    ckpt = run.checkpointer
    if ckpt is None:
        return f"{error}; no checkpoints are written"
    try:
        ckpt.wait()
    except CheckpointError as e:
        return str(e)
    steps = ckpt.steps()
    last = (f"the last complete checkpoint is step {steps[-1]} in {ckpt.directory}" if steps
            else f"no complete checkpoint is in {ckpt.directory}")
    return f"{error}. {last}. Free space, then resume with --config.resume=latest"


def quiet_logs() -> None:
    """Warnings and errors only; library errors rlx reports itself keep one line each."""
    logging.set_verbosity(logging.WARNING)
    logging.get_absl_logger().addFilter(_one_line_orbax_errors)
    std_logging.getLogger("asyncio").addFilter(_one_line_orbax_errors)


def main(argv) -> None:
    """``argv``: (the config with its overrides, the positional arguments), from
    ``rlx.commandline.absl_flags_parser``."""
    config, _ = argv
    quiet_logs()
    from rlx.config import parse_config
    from rlx.errors import ConfigError
    from rlx.io.checkpoint import CheckpointError
    from rlx.rollout.errors import RolloutError
    from rlx.run.lifecycle import Interrupted, StartupSignals

    try:
        cfg = parse_config(config)
        if _DRY_RUN.value:
            from rlx.run.summary import build_and_summarize

            print(build_and_summarize(cfg))
            return
        from rlx.run.build import build

        with StartupSignals():  # servers started so far are stopped on the way out
            run = build(cfg)
    except Interrupted as e:
        print(f"rlx: {e}; nothing was trained", file=sys.stderr)
        sys.exit(128 + e.signum)
    except ConfigError as e:
        print(f"rlx: config error: {e}", file=sys.stderr)
        sys.exit(2)
    except (ValueError, FileNotFoundError, CheckpointError) as e:  # each names its own fix
        print(f"rlx: error: {e}", file=sys.stderr)
        sys.exit(2)
    except RolloutError as e:  # a server that did not start
        print(f"rlx: error: {e}", file=sys.stderr)
        sys.exit(4)
    train(run)


def train(run) -> None:
    """Train a built run to its end, then close it; each way it can fail is one line on stderr
    and its exit status (see the module docstring)."""
    from rlx.io.checkpoint import CheckpointError
    from rlx.io.metrics import MetricsWriteError
    from rlx.rollout.errors import RolloutError
    from rlx.run.loop import NonFiniteError

    try:
        run.train()
        print(run.summary())
    except NonFiniteError as e:  # the last good checkpoint is kept; the message says what next
        print(f"rlx: error: {e}", file=sys.stderr)
        sys.exit(3)
    except RolloutError as e:  # likewise (checkpointed at the last completed step)
        print(f"rlx: error: {e}", file=sys.stderr)
        sys.exit(4)
    except CheckpointError as e:  # a write failed (the disk is full); earlier ones are intact
        print(f"rlx: error: {e}", file=sys.stderr)
        sys.exit(5)
    except MetricsWriteError as e:  # likewise
        print(f"rlx: error: {_output_failed(run, e)}", file=sys.stderr)
        sys.exit(5)
    finally:
        run.close()
    if run.stopped_by is not None:
        print(f"rlx: stopped by {signal.Signals(run.stopped_by).name} after step {run.step_count}; "
              f"resume with --config.resume=latest", file=sys.stderr)
        sys.exit(128 + run.stopped_by)


def run() -> None:
    from rlx.commandline import absl_flags_parser, end_output

    sys.exit(end_output(lambda: app.run(main, flags_parser=absl_flags_parser("rlx"))))


if __name__ == "__main__":
    run()
