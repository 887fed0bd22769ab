"""Rollout engine faults on real SGLang servers, during a real run (reliability, engine line).

One run of configs/tiny.py (a random 2-layer model, LoRA) with ``rollout.engine = "sglang"`` and
two CPU servers launched by rlx; faults are injected with the operating system and the servers'
own API, never by replacing a component:

- a server hangs (SIGSTOP of its process group): its requests time out
  (``rollout.sglang.request_timeout_s``) and go to the other server; once resumed it is taken back
  with the current weights;
- a server's weights are replaced by someone else (``/update_weights_from_disk`` with other
  weights and another ``weight_version``; ``/update_weight_version``): detected from the answers'
  version before any is used, the server re-synced, the step unaffected; with no weights rlx could
  reload, a clear error;
- a server dies (SIGKILL of its process group): the other serves; the last one hanging or dying
  stops the run with a ``RolloutError`` naming the server, what happened and what to do, and a
  loadable checkpoint of the last completed step;
- the engine hands the coordinator a dropped, doubled or stale rollout: refused before the learner.

After every step the batch the learner received is checked: exactly the requested prompt uids x
sample indices, once each, all of the current weight version. The counts of faults injected and
survived are printed at the end of the module (``pytest -s``).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import shutil
import signal

import numpy as np
import pytest
import requests

from rlx.config import parse_config
from rlx.io.metrics import METRICS_FILE, read_metrics
from rlx.rollout.errors import RolloutError
from rlx.types import Prompt, SamplingParams
from tests.helpers.runs import config_dict
from tests.helpers.sglang_harness import (SGLANG_PYTHON, cpu_server_args, cpu_server_env,
                                          sglang_available)

pytestmark = [pytest.mark.sglang,
              pytest.mark.skipif(not sglang_available(), reason=f"no SGLang at {SGLANG_PYTHON}")]

TIMEOUT_S = 5.0  # request_timeout_s: a tiny model answers in well under a second
INJECTED: collections.Counter = collections.Counter()
SURVIVED: collections.Counter = collections.Counter()


def _config(out: str) -> dict:
    env = [f"{k}={v}" for k, v in cpu_server_env(os.path.join(out, "harness"))]
    env.append("SGLANG_CPU_OMP_THREADS_BIND=0|1")  # CPU "device" i of server i: one core each
    return config_dict("tiny", os.path.join(out, "run"), **{
        "mesh": {"data": 8}, "data.eval_size": 0, "train.steps": 1000, "train.checkpoint_every": 1,
        "train.sample_every": 0, "rollout.engine": "sglang", "rollout.sglang": dict(
            python=SGLANG_PYTHON, num_servers=2, env=env, request_timeout_s=TIMEOUT_S,
            extra_args=list(cpu_server_args()) + ["--lora-backend", "torch_native"])})


class Recorder:
    """The run's engine, recording what its ``generate`` hands to the coordinator."""

    def __init__(self, engine):
        self.engine = engine
        self.calls: list[tuple] = []  # (prompts, n, rollouts)

    def generate(self, prompts, sampling):
        out = self.engine.generate(prompts, sampling)
        self.calls.append((list(prompts), sampling.n, out))
        return out

    def __getattr__(self, name):
        return getattr(self.engine, name)


@dataclasses.dataclass
class Harness:
    run: object
    policy: object  # the SGLangPolicy
    recorder: Recorder
    learner_rows: list  # per update: the weight_version of each learner batch row (-1: padding)

    @property
    def servers(self):
        return self.policy.servers

    @property
    def state(self):
        return self.policy.engine.servers  # the engine's ServerSet


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    from rlx.run.build import build

    out = str(tmp_path_factory.mktemp("engine_faults"))
    run = build(parse_config(_config(out)), progress=False)
    policy, rows = run.engine, []
    run.engine = recorder = Recorder(policy)
    update = run.compiled.train_step

    def tapped(state, batch):  # what the learner receives
        rows.append(np.asarray(batch.weight_version).max(axis=1).tolist())
        return update(state, batch)

    run.compiled.train_step = tapped
    try:
        yield Harness(run, policy, recorder, rows)
    finally:
        for server in policy.servers:  # a failed test may have left one stopped
            if server.alive():
                os.killpg(server.proc.pid, signal.SIGCONT)
        run.close()
        print(f"\nengine faults injected: {dict(INJECTED)}; survived (run went on with every "
              f"rollout accounted for): {dict(SURVIVED)}; failed loudly as designed: "
              f"{dict(INJECTED - SURVIVED)}")


def _step(h: Harness) -> None:
    """One step; the learner's batch must be exactly the requested rollouts of this version."""
    version, updates = h.run.step_count, len(h.learner_rows)
    h.run.step()
    h.run.queue.wait()  # the weight sync queued after the update has reached the servers
    prompts, n, rollouts = h.recorder.calls[-1]
    keys = sorted((r.prompt_uid, r.sample_index) for r in rollouts)
    assert keys == sorted((p.uid, j) for p in prompts for j in range(n))  # none lost or doubled
    assert {r.weight_version for r in rollouts} == {version}
    assert len(h.learner_rows) == updates + 1
    assert sorted(v for v in h.learner_rows[-1] if v >= 0) == [version] * len(rollouts)


def _signal(server, sig) -> None:
    os.killpg(server.proc.pid, sig)


def _generate_requests(server) -> int:
    with open(server.log_path, errors="replace") as f:
        return f.read().count("POST /generate")


# --- the coordinator never trains on a wrong batch --------------------------------------------

class Faulty(Recorder):
    """Hands the coordinator a damaged batch (what a buggy engine could do)."""

    def __init__(self, engine, damage):
        super().__init__(engine)
        self.damage = damage

    def generate(self, prompts, sampling):
        return self.damage(self.engine.generate(prompts, sampling))


@pytest.mark.parametrize("damage,needle", [
    (lambda rs: rs[:-1], "1 missing"),
    (lambda rs: rs + rs[:1], "1 unexpected or doubled"),
    (lambda rs: [dataclasses.replace(rs[0], sample_index=99)] + rs[1:], "1 missing"),
    (lambda rs: [dataclasses.replace(rs[0], weight_version=7)] + rs[1:], "weight_version [7]"),
], ids=["dropped", "doubled", "foreign", "stale"])
def test_the_learner_never_gets_a_dropped_doubled_or_stale_rollout(harness, damage, needle):
    h = harness
    step, updates = h.run.step_count, len(h.learner_rows)
    h.run.engine = Faulty(h.recorder, damage)
    INJECTED["engine returned a wrong batch"] += 1
    try:
        with pytest.raises(RolloutError, match="refusing to train on them") as e:
            h.run.step()
    finally:
        h.run.engine = h.recorder
    assert needle in str(e.value)
    assert h.run.step_count == step and len(h.learner_rows) == updates  # nothing trained


# --- a hung server ------------------------------------------------------------------------------

def test_a_hung_server_times_out_its_requests_go_to_the_other_and_it_comes_back(harness):
    h = harness
    a, b = h.servers
    retries = h.state.retries
    _signal(a, signal.SIGSTOP)
    INJECTED["server hung (SIGSTOP)"] += 1
    try:
        _step(h)
    finally:
        _signal(a, signal.SIGCONT)
    SURVIVED["server hung (SIGSTOP)"] += 1
    assert h.state.retries > retries, "no request was sent to the hung server"
    assert not h.state.healthy[a.url] and h.state.healthy[b.url]
    assert "request_timeout_s" in h.state.faults[a.url] and "is stopped" in h.state.faults[a.url]
    served = _generate_requests(a)
    _step(h)  # resumed: re-synced (it missed a weight update while out) and serving again
    assert h.state.healthy[a.url], h.state.faults
    assert _generate_requests(a) > served


# --- someone else's weights ---------------------------------------------------------------------

def _foreign_weights(run, out: str) -> str:
    """The served base with every weight scaled by 1.1: someone else's model."""
    from safetensors.numpy import load_file, save_file

    base = os.path.join(run.cfg.output_dir, "serving", "base")
    shutil.copytree(base, out, ignore=shutil.ignore_patterns("*.safetensors"))
    for path in glob.glob(os.path.join(base, "*.safetensors")):
        tensors = {k: (v * 1.1).astype(v.dtype) for k, v in load_file(path).items()}
        save_file(tensors, os.path.join(out, os.path.basename(path)), metadata={"format": "pt"})
    return out


def _sequences(h: Harness):
    _, _, rollouts = h.recorder.calls[-1]
    return [(list(r.prompt_ids) + list(r.completion_ids), len(r.prompt_ids)) for r in rollouts
            if len(r.completion_ids)]


def test_foreign_weights_are_detected_and_replaced_before_any_rollout_is_used(harness, tmp_path):
    from rlx.rollout.preflight import PreflightError, run_preflight
    from rlx.rollout.sglang.engine import SGLangEngine

    h = harness
    a, _ = h.servers
    foreign = _foreign_weights(h.run, str(tmp_path / "foreign"))
    r = requests.post(f"{a.url}/update_weights_from_disk",
                      json={"model_path": foreign, "weight_version": "999"}, timeout=120)
    assert r.status_code == 200 and r.json()["success"], r.text
    INJECTED["server weights replaced by another process"] += 1
    check = dict(engine_name="sglang", base_format="hf", threshold=5e-3)
    probe = _sequences(h)
    spy = SGLangEngine([a.url])  # takes whatever the server serves
    spy.adapter = h.policy.engine.adapter
    with pytest.raises(PreflightError):  # the fault is real: A serves other log-probs now
        run_preflight(h.run.compiled.model(), spy.score, probe, **check)
    spy.close()
    resyncs = h.state.resyncs
    _step(h)  # A's answers (version 999) were discarded, A re-synced, the batch is exact
    SURVIVED["server weights replaced by another process"] += 1
    assert h.state.resyncs > resyncs and h.state.healthy[a.url]
    spy = SGLangEngine([a.url], weight_version=h.run.step_count)
    spy.adapter = h.policy.engine.adapter
    run_preflight(h.run.compiled.model(), spy.score, _sequences(h), **check)  # rlx's weights again

    # a client that loaded no weights itself cannot restore them: a clear error, no rollout
    requests.post(f"{a.url}/update_weight_version", json={"new_version": "intruder"}, timeout=30)
    INJECTED["weight_version changed by another process"] += 1
    with pytest.raises(RolloutError) as e:
        spy.generate([Prompt("x", (1, 2, 3))], SamplingParams(max_new_tokens=2))
    spy.close()
    message = str(e.value)
    assert a.url in message and "'intruder'" in message and "no weights it could load" in message
    assert "What to do" in message
    _step(h)  # the run's own engine restores A again
    SURVIVED["weight_version changed by another process"] += 1


# --- dead servers -------------------------------------------------------------------------------

def _checkpoint_intact(h: Harness) -> None:
    steps = h.run.checkpointer.steps()
    assert steps and steps[-1] == h.run.step_count, (steps, h.run.step_count)
    restored = h.run.checkpointer.restore(steps[-1], h.run.compiled.state)
    assert restored.step == steps[-1]
    logged = read_metrics(os.path.join(h.run.cfg.output_dir, METRICS_FILE))
    assert max(r["step"] for r in logged) == h.run.step_count


def test_dead_servers_are_dropped_then_the_last_one_stops_the_run_loudly(harness):
    h = harness
    a, b = h.servers
    _signal(a, signal.SIGKILL)
    a.proc.wait(timeout=60)
    INJECTED["server killed (SIGKILL)"] += 1
    _step(h)  # between steps: its requests fail and go to B
    SURVIVED["server killed (SIGKILL)"] += 1
    assert not h.state.healthy[a.url] and "exited with code -9" in h.state.faults[a.url]

    _signal(b, signal.SIGSTOP)  # the last server hangs: the run stops, checkpointed
    INJECTED["last server hung (SIGSTOP)"] += 1
    try:
        with pytest.raises(RolloutError) as e:
            h.run.train(1)
    finally:
        _signal(b, signal.SIGCONT)
    message = str(e.value)
    for needle in (b.url, "request_timeout_s", "is stopped", a.url, "exited with code -9",
                   "What to do", "resume with --config.resume=latest"):
        assert needle in message, (needle, message)
    _checkpoint_intact(h)

    _step(h)  # B resumed: taken back, the run goes on
    SURVIVED["last server hung (SIGSTOP)"] += 1  # once it resumed
    _signal(b, signal.SIGKILL)
    b.proc.wait(timeout=60)
    INJECTED["last server killed (SIGKILL)"] += 1
    with pytest.raises(RolloutError) as e:
        h.run.train(1)
    message = str(e.value)
    assert b.url in message and "exited with code -9" in message and "What to do" in message
    _checkpoint_intact(h)
