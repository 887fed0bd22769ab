"""``python -m rlx.launch --config configs/X.py [--config.a.b=v ...]``: the command-line entry.

Parses and validates the config once (errors: one line naming the field, exit status 2),
initialises ``jax.distributed`` when configured, builds the mesh, loads and shards the model and
prints a summary. Everything else is done by the library; this file stays short.
"""

from __future__ import annotations

import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.", lock_config=True)
flags.mark_flags_as_required(["config"])


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    from rlx.config import ConfigError, parse_config
    from rlx.summary import build_and_summarize

    try:
        cfg = parse_config(_CONFIG.value)
        print(build_and_summarize(cfg))
    except ConfigError as e:
        print(f"rlx: config error: {e}", file=sys.stderr)
        sys.exit(2)
    except (ValueError, FileNotFoundError) as e:  # checkpoint / model errors carry their own fix
        print(f"rlx: error: {e}", file=sys.stderr)
        sys.exit(2)


def run() -> None:
    app.run(main)


if __name__ == "__main__":
    run()
