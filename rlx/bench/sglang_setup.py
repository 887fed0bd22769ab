"""The SGLang server a benchmark compares against: launched from rlx's export, or attached by URL.

SGLang runs from its own interpreter (``--sglang-python``; default ``$RLX_SGLANG_PYTHON`` or the venv
``.ci/sglang_env.sh`` creates). Without it the SGLang sides are skipped with the reason printed.
A machine that needs extra launch settings names a *harness* module (``--sglang-harness``) with
``cpu_server_env(root) -> ((name, value), ...)`` and ``cpu_server_args(lora_rank) -> (flags, ...)``;
on a CPU-only machine that is the test suite's ``tests.helpers.sglang_harness`` (its two CPU
workarounds stay out of rlx). ``--sglang-url`` attaches to a running server instead.

The server is a separate process group, so its memory is not any worker's ``ru_maxrss``:
``group_rss_mb`` sums the resident memory of every process in its group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import shlex
from collections.abc import Iterator

DEFAULT_PYTHON = "~/.cache/rlx/sglang-0.5.23/bin/python"


@dataclasses.dataclass(frozen=True)
class SGLangSetup:
    """Where the SGLang side's server comes from."""

    python: str = ""  # interpreter of the SGLang environment ("" = $RLX_SGLANG_PYTHON or default)
    harness: str = ""  # module with cpu_server_env / cpu_server_args ("" = none)
    url: str = ""  # attach to this running server instead of launching one
    args: str = ""  # extra launch flags, one shell-quoted string
    startup_timeout_s: float = 600.0

    @property
    def interpreter(self) -> str:
        return os.path.expanduser(self.python or os.environ.get("RLX_SGLANG_PYTHON", DEFAULT_PYTHON))

    def unavailable(self) -> str | None:
        """Why no SGLang side can run here, or None."""
        if self.url:
            return None
        if not os.path.exists(self.interpreter):
            return (f"no SGLang interpreter at {self.interpreter}: create it with "
                    "`bash .ci/sglang_env.sh`, or pass --sglang-python / --sglang-url")
        return None


def _launch_settings(setup: SGLangSetup, root: str, lora_rank: int):
    env: tuple = ()
    # an idle server must not spin a core while the other sides of a benchmark run
    args: tuple[str, ...] = ("--skip-tokenizer-init", "--sleep-on-idle")
    if setup.harness:
        harness = importlib.import_module(setup.harness)
        env = tuple(harness.cpu_server_env(os.path.join(root, "harness")))
        args += tuple(harness.cpu_server_args(lora_rank))
    elif lora_rank:
        args += ("--enable-lora", "--max-lora-rank", str(lora_rank), "--lora-target-modules",
                 "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return env, args + tuple(shlex.split(setup.args))


@contextlib.contextmanager
def sglang_server(setup: SGLangSetup, model_path: str, root: str,
                  lora_rank: int = 0) -> Iterator[tuple[str, object | None]]:
    """``(url, server)`` of an SGLang server serving ``model_path`` (``server`` None if attached)."""
    if setup.url:
        yield setup.url.rstrip("/"), None
        return
    from rlx.rollout.sglang.server import SGLangServer, ServerSpec

    env, args = _launch_settings(setup, root, lora_rank)
    spec = ServerSpec(python=setup.interpreter, model_path=model_path, extra_args=args, env=env,
                      startup_timeout_s=setup.startup_timeout_s,
                      log_path=os.path.join(root, "sglang-server.log"))
    with SGLangServer(spec) as server:
        yield server.url, server


def _group_stats(pgid: int) -> list[list[str]]:
    """``/proc/PID/stat`` fields (after the command name) of every process in group ``pgid``."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:  # field 5 of stat: process group id
                out.append(fields)
        except (OSError, IndexError, ValueError):
            continue
    return out


def group_rss_mb(server) -> float | None:
    """Resident memory (MB) of every process in the server's process group, or None."""
    if server is None or server.proc is None:
        return None
    pages = sum(int(f[21]) for f in _group_stats(server.proc.pid))  # field 24: rss pages
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of group ``pgid``."""
    ticks = sum(int(f[11]) + int(f[12]) for f in _group_stats(pgid))  # fields 14, 15
    return ticks / os.sysconf("SC_CLK_TCK")
