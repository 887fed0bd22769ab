"""``python -m rlx.export --run DIR [--step N] --to KIND [--dtype D] [--max-shard-size 2GiB] OUT``.

Restores a run's checkpoint (``--step N``, default the newest) and writes it to ``OUT`` as one of
``rlx.run.exporting.KINDS`` (``--help`` lists them, one line each), published atomically with the
step as its version; one line on stdout says what was written. A missing folder or step, an
export that does not apply to the run (an adapter of a full-mode run), a bad option: one line
on stderr, exit status 2, nothing written.
"""

from __future__ import annotations

import argparse
import re
import sys

from rlx.commandline import end_output
from rlx.errors import ConfigError

PROG = "rlx.export"
_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]i?B)?\s*$", re.IGNORECASE)
_UNITS = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


class _Parser(argparse.ArgumentParser):
    """argparse whose refusals are one line (no usage block), exit status 2."""

    def error(self, message: str):
        print(f"{PROG}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def shard_size(text: str) -> int:
    """Bytes of ``--max-shard-size``: a number of bytes, or with KB / MB / GB (powers of 1000)
    or KiB / MiB / GiB (powers of 1024)."""
    found = _SIZE.match(text)
    if found is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 2GiB, 500MB, 4096)")
    unit = (found.group(2) or "").lower()
    return int(found.group(1)) * _UNITS.get(unit, 1)


def parser() -> argparse.ArgumentParser:
    """The command line, with every ``--to`` on a line of its own in ``--help``."""
    from rlx.run.exporting import DTYPES, KINDS

    kinds = "\n".join(f"  {name:<10} {text}" for name, text in KINDS.items())
    p = _Parser(prog=f"python -m {PROG}", formatter_class=argparse.RawDescriptionHelpFormatter,
                description="Write a run's checkpoint for serving or other tools.",
                epilog=f"exports (--to):\n{kinds}")
    p.add_argument("--run", required=True, metavar="DIR",
                   help="the run's output folder (config.output_dir), its checkpoints/ folder or "
                        "one step's folder")
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="the checkpoint step to export (default: the newest)")
    p.add_argument("--to", required=True, choices=list(KINDS), metavar="KIND",
                   help="what to write: " + ", ".join(KINDS) + " (listed below)")
    p.add_argument("--dtype", default="base", choices=DTYPES,
                   help="float dtype of hf / merged / quantized (default: base, the base "
                        "checkpoint's own: bf16 stays bf16)")
    p.add_argument("--max-shard-size", type=shard_size, default="2GiB", metavar="SIZE",
                   help="largest safetensors shard (default 2GiB; one tensor may be larger)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("out", metavar="OUT", help="the folder to write (replaced atomically)")
    return p


class _Bars:
    """``rlx.run.exporting.export_run``'s ``progress``: a tqdm bar on stderr per float export
    (``close`` ends them)."""

    def __init__(self):
        self.bars = []

    def __call__(self, total: int):
        from tqdm import tqdm

        self.bars.append(tqdm(total=total, unit="weight", desc="export", dynamic_ncols=True))
        return self.bars[-1].update

    def close(self) -> None:
        for bar in self.bars:
            bar.close()


def main(argv: list[str]) -> int:
    """Parse ``argv`` and export; the exit status."""
    args = parser().parse_args(argv)
    from rlx.run.exporting import ExportRequest, export_run

    bars = _Bars()
    try:
        req = ExportRequest(run=args.run, to=args.to, out=args.out, step=args.step,
                            dtype=args.dtype, max_shard_bytes=args.max_shard_size)
        done = export_run(req, None if args.no_progress else bars)
    except (ConfigError, ValueError, FileNotFoundError) as e:  # each names its own fix
        print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    finally:
        bars.close()
    dtype = f" ({done.dtype})" if done.dtype else ""
    print(f"exported step {done.step} as {done.kind}{dtype} to {done.path}")
    return 0


if __name__ == "__main__":
    sys.exit(end_output(lambda: main(sys.argv[1:])))
