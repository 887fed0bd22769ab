"""Stopping a run with a signal leaves a final checkpoint and no process behind (reliability,
signals line).

``python -m rlx.launch`` runs in its own session, as a terminal or a job manager starts it, on a
shrunken configs/tiny.py with the code reward on HumanEval (every completion runs in a sandboxed
process). From its start the test records every process below it from the process table
(/proc: SGLang servers and the processes they spawn, sandbox runs, grading workers), and sends
the signal while the first step's completions run in the sandbox. Then:

- SIGTERM to the launch process (SGLang servers launched by rlx): exit status 128 + 15, a final
  checkpoint committed and loadable at the last logged step, afterwards none of the recorded
  processes alive and nothing listening on the servers' ports;
- Ctrl-C as a terminal sends it, SIGINT to the whole foreground process group (built-in engine):
  exit status 128 + 2, the same checks;
- SIGTERM while a server is still starting: rlx stops at once, stopping the server's whole
  process group, including a child the server was still spawning (exit status 128 + 15);
- SIGKILL of the process that launched a server (nothing can clean up then): the server dies
  with it (``PR_SET_PDEATHSIG``);
  (these two with a stand-in ``sglang.launch_server`` module, started by rlx's own launch code);
- the math grading workers (same process group as rlx) ignore a Ctrl-C and SIGTERM, so the step
  in flight is graded right, and stop with the reward.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import orbax.checkpoint as ocp
import pytest

from rlx.io.metrics import read_metrics
from tests.helpers import ROOT, procs
from tests.helpers.sglang_harness import SGLANG_PYTHON, cpu_server_args, cpu_server_env, sglang_available

TINY = os.path.join(ROOT, "configs", "tiny.py")


def _write_config(tmp_path, engine: str) -> str:
    """A config file: tiny, HumanEval + code reward, and (SGLang) the CPU server harness."""
    lines = [
        "import importlib.util",
        "import ml_collections",
        "",
        "def get_config():",
        f"    spec = importlib.util.spec_from_file_location('tiny', {TINY!r})",
        "    module = importlib.util.module_from_spec(spec)",
        "    spec.loader.exec_module(module)",
        "    c = module.get_config()",
        f"    c.output_dir = {str(tmp_path / 'run')!r}",
        "    c.mesh.data = 8",
        "    c.data.source, c.data.template, c.data.max_prompt_tokens = 'humaneval', '{prompt}', 200",
        "    c.data.eval_size = 0",
        "    c.train.reward, c.train.steps, c.train.checkpoint_every = 'code', 1000, 0",
        "    c.train.sample_every = 0",
        f"    c.rollout.engine = {engine!r}",
    ]
    if engine == "sglang":
        env = tuple(f"{k}={v}" for k, v in cpu_server_env(str(tmp_path / "harness")))
        args = tuple(cpu_server_args()) + ("--lora-backend", "torch_native")
        lines.append(f"    c.rollout.sglang = ml_collections.ConfigDict(dict(python={SGLANG_PYTHON!r}, "
                     f"num_servers=1, env={env!r}, extra_args={args!r}))")
    path = tmp_path / "config.py"
    path.write_text("\n".join(lines + ["    return c", ""]))
    return str(path)


def _launch(config: str, log) -> subprocess.Popen:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    return subprocess.Popen([sys.executable, "-m", "rlx.launch", f"--config={config}"], cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)


def _steps_logged(out: str) -> int:
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    return max((r["step"] for r in read_metrics(path) if "reward/mean" in r), default=0)


def _watch(proc: subprocess.Popen, seen: dict, until, timeout_s: float) -> None:
    """Record ``proc``'s descendants every 50 ms until ``until()`` holds (or it exits)."""
    deadline = time.monotonic() + timeout_s
    while not until():
        for key, cmd in procs.descendants(proc.pid).items():
            if cmd or key not in seen:  # an exiting process shows an empty command line
                seen[key] = cmd
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s"
        if proc.poll() is not None:
            return
        time.sleep(0.05)


def _committed_and_loadable(out: str) -> int:
    folder = os.path.join(out, "checkpoints")
    steps = sorted(int(n) for n in os.listdir(folder) if n.isdigit())
    with ocp.CheckpointManager(folder) as mgr:
        restored = mgr.restore(steps[-1], args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    assert int(restored["state"]["step"]) == steps[-1]
    return steps[-1]


def _left_behind(seen: dict, grace_s: float = 15.0) -> dict:
    """Recorded processes still alive after ``grace_s`` (a killed child takes a moment)."""
    deadline = time.monotonic() + grace_s
    while (alive := {p: c for p, c in seen.items() if procs.alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def _stop_and_check(tmp_path, engine: str, stop) -> dict:
    """Launch, let it train, ``stop(proc)``; returns the recorded descendants by kind."""
    from rlx.data.sources import DataError, get_source

    try:
        get_source("humaneval", "train")
    except DataError as e:
        pytest.skip(f"HumanEval not installed: {e}")
    out = str(tmp_path / "run")
    seen: dict = {}
    with open(tmp_path / "stderr.txt", "w+") as log:
        proc = _launch(_write_config(tmp_path, engine), log)
        try:
            # the signal arrives while the first step's completions run in the sandbox
            _watch(proc, seen, lambda: _kinds(seen)["sandbox"] > 0, timeout_s=600)
            assert proc.poll() is None, f"the run ended early:\n{_tail(log)}"
            stop(proc)
            _watch(proc, seen, lambda: proc.poll() is not None, timeout_s=300)
            code = proc.wait()
        except BaseException:
            proc.kill()
            procs.kill_all(seen)
            raise
        stderr = _tail(log)
    left = _left_behind(seen)
    procs.kill_all(left)  # (clean-up before failing)
    assert not left, f"processes left behind: {left}"
    ports = {int(m) for c in seen.values() for m in re.findall(r"--port (\d+)", c)}
    assert not ports & procs.listening_ports(), "a server port is still listened on"
    assert code != 0 and _committed_and_loadable(out) == _steps_logged(out) >= 1
    return {"code": code, "stderr": stderr, "seen": seen, "ports": ports}


def _tail(log, n: int = 4000) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-n:]


def _kinds(seen: dict) -> dict[str, int]:
    kinds = {"sglang": r"sglang", "sandbox": r"bwrap|prlimit|prog\.py|unshare",
             "grader": r"rlx\.rewards\.math import _serve"}
    return {k: sum(bool(re.search(rx, c)) for c in seen.values()) for k, rx in kinds.items()}


@pytest.mark.slow  # CI: 90 s; SIGTERM -> checkpoint in tests/run/test_resume.py, server clean-up below
@pytest.mark.sglang
@pytest.mark.skipif(not sglang_available(), reason=f"no SGLang at {SGLANG_PYTHON}")
def test_sigterm_checkpoints_and_stops_the_sglang_servers_and_sandboxes(tmp_path):
    result = _stop_and_check(tmp_path, "sglang", lambda p: p.send_signal(signal.SIGTERM))
    assert result["code"] == 128 + signal.SIGTERM, result["stderr"]
    assert "stopped by SIGTERM" in result["stderr"]
    kinds = _kinds(result["seen"])
    print(f"\nSIGTERM: processes recorded below the launch process: {kinds}; ports "
          f"{sorted(result['ports'])}; none left")
    assert kinds["sglang"] >= 3 and result["ports"], result["seen"]  # server, scheduler, ...


@pytest.mark.slow  # about a minute; the SIGTERM test above covers the same cleanup in CI
def test_ctrl_c_to_the_process_group_checkpoints_and_stops_every_child(tmp_path):
    result = _stop_and_check(tmp_path, "jax", lambda p: os.killpg(p.pid, signal.SIGINT))
    assert result["code"] == 128 + signal.SIGINT, result["stderr"]
    assert "stopped by SIGINT" in result["stderr"]
    print(f"\nCtrl-C: processes recorded below the launch process: {_kinds(result['seen'])}; "
          "none left")


_HOLDER = """
import sys, time
from rlx.rollout.sglang.server import SGLangServer, ServerSpec
spec = ServerSpec(python=sys.executable, model_path=sys.argv[1], log_path=sys.argv[2],
                  env=(("PYTHONPATH", sys.argv[1]),))
server = SGLangServer(spec)
server.spawn()  # on this main thread, as rlx does
print(server.proc.pid, flush=True)
time.sleep(600)
"""


def test_a_launched_server_dies_with_a_sigkilled_rlx(tmp_path):
    # stands in for SGLang: a `sglang.launch_server` module that serves nothing, forever; it is
    # started through rlx's real launch command (which sets the parent-death signal)
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    (tmp_path / "sglang" / "launch_server.py").write_text(
        "import pathlib, time\npathlib.Path(__file__).with_name('started').touch()\ntime.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path), str(tmp_path / "log")],
                              cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                              stdout=subprocess.PIPE, text=True)
    server = None
    try:
        pid = int(holder.stdout.readline())
        server = next(p for p in procs.descendants(holder.pid) if p[0] == pid)
        deadline = time.monotonic() + 60
        while not (tmp_path / "sglang" / "started").exists():  # past the parent-death setting
            assert time.monotonic() < deadline, "the stand-in server did not start"
            time.sleep(0.1)
        holder.send_signal(signal.SIGKILL)  # no clean-up code runs
        holder.wait(timeout=30)
        assert not _left_behind({server: "server"}, grace_s=10.0)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
        if server is not None:
            procs.kill_all([server])



def test_grading_workers_outlive_a_ctrl_c_and_stop_with_the_reward():
    """A terminal's Ctrl-C (and a job manager's SIGTERM) reaches every process of the group; the
    math grading workers ignore both, so the step in flight is graded correctly, not scored 0
    for a killed worker. ``close()`` stops them."""
    from rlx.rewards.math import MathReward

    before = set(procs.descendants(os.getpid()))  # other tests' graders may still be alive
    reward = MathReward(workers=1)
    try:
        assert reward("so \\boxed{4}", {"answer": "4"}).score == 1.0  # starts the worker
        (worker,) = [p for p, c in procs.descendants(os.getpid()).items()
                     if "_serve" in c and p not in before]
        for sig in (signal.SIGINT, signal.SIGTERM):
            os.kill(worker[0], sig)
        time.sleep(0.5)
        result = reward("so \\boxed{5}", {"answer": "5"})
        assert result.score == 1.0 and result.reason == "correct" and procs.alive(worker)
    finally:
        reward.close()
    assert not _left_behind({worker: "grader"}, grace_s=10.0)


_STAND_IN = """
import pathlib, subprocess, sys, time
# like SGLang's scheduler and detokenizer: a child that is still starting (it has not yet asked
# to die with its parent) when rlx is stopped
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
pathlib.Path(__file__).with_name("started").touch()
time.sleep(600)  # never healthy: rlx is still waiting for it to start
"""


def test_sigterm_while_a_server_starts_stops_it_and_what_it_spawned(tmp_path):
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    (tmp_path / "sglang" / "launch_server.py").write_text(_STAND_IN)
    config = tmp_path / "config.py"
    config.write_text("\n".join([
        "import importlib.util",
        "import ml_collections",
        "def get_config():",
        f"    spec = importlib.util.spec_from_file_location('tiny', {TINY!r})",
        "    module = importlib.util.module_from_spec(spec)",
        "    spec.loader.exec_module(module)",
        "    c = module.get_config()",
        f"    c.output_dir, c.mesh.data, c.data.eval_size = {str(tmp_path / 'run')!r}, 8, 0",
        "    c.rollout.engine = 'sglang'",
        f"    c.rollout.sglang = ml_collections.ConfigDict(dict(python={sys.executable!r}, "
        f"env=('PYTHONPATH={tmp_path}',)))",
        "    return c", ""]))
    seen: dict = {}
    with open(tmp_path / "stderr.txt", "w+") as log:
        proc = _launch(str(config), log)
        try:
            started = tmp_path / "sglang" / "started"
            _watch(proc, seen, lambda: started.exists() and len(seen) >= 2, timeout_s=300)
            proc.send_signal(signal.SIGTERM)
            _watch(proc, seen, lambda: proc.poll() is not None, timeout_s=120)
        except BaseException:
            proc.kill()
            procs.kill_all(seen)
            raise
        stderr = _tail(log)
    left = _left_behind(seen)
    procs.kill_all(left)
    assert not left, f"processes left behind: {left}"
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "SIGTERM received while starting; nothing was trained" in stderr
