"""Soak: 200 steps of the tiny config with one-step-off rollouts and periodic checkpoints.

``python -m rlx.launch`` runs as a subprocess on one CPU device while the test samples the resident
memory of its whole process tree (the run plus its reward workers) from ``/proc`` and reads the step
from ``metrics.jsonl``. Checked: the run ends normally after exactly 200 steps, every step logged
once, in order, each batch one policy version old (async), the last checkpoints committed; and the
memory is flat after warm-up: the median RSS of every 20-step window after step 40 stays within
10% of the first such window's (a leak of a few hundred KB per step, e.g. rollouts or compiled
programs kept alive, breaks it).

Marked ``slow`` (about 4-6 minutes on 2 cores): ``python -m pytest -m slow tests/reliability``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import pytest
from tests.helpers import ROOT

STEPS, WARMUP, WINDOW, TOLERANCE = 200, 40, 20, 0.10


def _tree_rss_mb(root: int) -> float:
    """Resident memory of ``root`` and all its descendants (from /proc), in MB."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/statm") as f:
                rss[int(entry)] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue  # the process ended while we looked
        children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo += children.get(pid, [])
    return total / 2**20


def _steps_logged(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip().endswith("}")]


def _run_and_sample(out: str) -> tuple[subprocess.CompletedProcess, list[tuple[int, float]]]:
    cmd = [sys.executable, "-m", "rlx.launch", f"--config={os.path.join(ROOT, 'configs', 'tiny.py')}",
           f"--config.output_dir={out}", f"--config.train.steps={STEPS}",
           "--config.train.max_staleness=1", "--config.train.checkpoint_every=25",
           "--config.train.keep_checkpoints=2", "--config.train.sample_every=50",
           "--config.train.eval_every=100", "--config.data.eval_size=4"]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
               JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    os.makedirs(out, exist_ok=True)
    log = open(os.path.join(out, "launch.log"), "w+")  # a pipe left unread would block the run
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
    metrics, samples = os.path.join(out, "metrics.jsonl"), []
    deadline = time.monotonic() + 1800
    while proc.poll() is None and time.monotonic() < deadline:
        trained = [r["step"] for r in _steps_logged(metrics) if "learner/loss" in r]
        samples.append((max(trained, default=0), _tree_rss_mb(proc.pid)))
        time.sleep(0.5)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    log.seek(0)
    output = log.read()
    log.close()
    return subprocess.CompletedProcess(cmd, proc.returncode, output, output), samples


@pytest.mark.slow
def test_200_async_steps_with_checkpoints_keep_memory_flat(tmp_path):
    out = str(tmp_path / "soak")
    res, samples = _run_and_sample(out)
    assert res.returncode == 0, res.stderr[-3000:]
    trained = [r for r in _steps_logged(os.path.join(out, "metrics.jsonl")) if "learner/loss" in r]
    assert [r["step"] for r in trained] == list(range(1, STEPS + 1))  # each step once, in order
    assert all(r["rollout/staleness"] == 1 for r in trained[1:])  # one-step-off throughout
    assert sorted(int(n) for n in os.listdir(os.path.join(out, "checkpoints")) if n.isdigit()) \
        == [175, 200]
    windows = {}
    for step, rss in samples:
        if step > WARMUP:
            windows.setdefault((step - WARMUP - 1) // WINDOW, []).append(rss)
    medians = [statistics.median(v) for _, v in sorted(windows.items())]
    print("RSS medians per 20-step window after warm-up (MB):", [round(m) for m in medians])
    assert len(medians) >= (STEPS - WARMUP) // WINDOW - 1, f"too few samples: {len(samples)}"
    assert max(medians) <= medians[0] * (1 + TOLERANCE), \
        f"RSS grew from {medians[0]:.0f} MB to {max(medians):.0f} MB after warm-up"
