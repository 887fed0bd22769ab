"""The benchmark harness's worker environments: what each kind of side runs under."""

import os
import sys

import pytest

from rlx.bench.harness import OMP_DEFAULT_ENV, Side, Worker, interleave, stolen_cpu_s
from tests.helpers import ROOT


def env_side(names):
    """A side that reports the values its worker sees of ``names`` (None: unset)."""
    return lambda: {"env": {n: os.environ.get(n) for n in names}}


def _env_of(side_env: dict) -> dict:
    worker = Worker(Side("env", "tests.bench.test_harness:env_side",
                         {"names": ["OMP_WAIT_POLICY", "TOKENIZERS_PARALLELISM"]}, side_env))
    try:
        return worker.run()["env"]
    finally:
        worker.close()


def test_torch_sides_get_openmp_defaults_and_rlx_sides_sleeping_threads(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the caller's own setting does not leak in
    assert _env_of({}) == {"OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}
    assert _env_of(OMP_DEFAULT_ENV) == {"OMP_WAIT_POLICY": None, "TOKENIZERS_PARALLELISM": "false"}


def test_a_side_of_another_interpreter_imports_rlx_from_this_checkout(tmp_path):
    # a peer's environment is a venv without rlx installed: one with no site packages shows it
    import venv

    venv.create(tmp_path / "bare", with_pip=False, system_site_packages=False)
    python = str(tmp_path / "bare" / "bin" / "python")
    worker = Worker(Side("bare", "tests.bench.probe_sides:interpreter_side", python=python))
    try:
        seen = worker.run()
    finally:
        worker.close()
    assert seen["python"] == python
    assert seen["rlx"] == os.path.join(ROOT, "rlx", "__init__.py")
    assert seen["path"].split(os.pathsep)[0] == ROOT


def test_every_torch_peer_runs_under_the_torch_environment():
    from rlx.bench import e2e, learner, products, rollout
    from rlx.bench.rl_models import ModelSource
    from rlx.bench.sglang_setup import SGLangSetup
    from rlx.bench.workloads import Workload

    src = ModelSource(name="tiny", path="unused")
    plan = rollout.Plan(Workload(), ("rlx-f32", "rlx-int8", "hf", "sglang"), 16, 0, SGLangSetup())
    sides = [*learner.build_sides(["rlx-f32", "peft", "peft-nogc"], learner.LearnerSpec(), src),
             *e2e.build_sides(["rlx-f32", "trl"], e2e.E2ESpec(), src),
             *products.build_sides(["xla", "torch"], products.model_shapes("tiny"), 4, 1),
             *rollout.build_sides(plan, [[1, 2]], "unused", "http://127.0.0.1:1")]
    torch = {s.label for s in sides if s.env == OMP_DEFAULT_ENV}
    assert torch == {"peft", "peft-nogc", "trl", "torch", rollout.HF}
    assert all(s.env == {} for s in sides if s.label not in torch)
    assert all(s.python == "" for s in sides)  # all of them run in rlx's own interpreter


def test_the_peers_of_other_environments_run_their_interpreters():
    from rlx.bench import learner, rollout
    from rlx.bench.peer_envs import LLAMA_CPP, TUNIX
    from rlx.bench.rl_models import ModelSource
    from rlx.bench.sglang_setup import SGLangSetup
    from rlx.bench.workloads import Workload

    plan = rollout.Plan(Workload("smollm2"), ("rlx-q4_1", "llama.cpp"), 0, 0, SGLangSetup(),
                        rollout.LlamaSetup(python=sys.executable))
    [rlx_side, llama] = rollout.build_sides(plan, [[1, 2]], "unused", None)
    [tunix] = learner.build_sides(["tunix"], learner.LearnerSpec(), ModelSource("tiny", "unused"),
                                  tunix_python="/elsewhere/python")
    assert rlx_side.python == "" and llama.python == sys.executable
    assert rlx_side.env == {} and llama.env == OMP_DEFAULT_ENV  # llama.cpp's OpenMP pool spins
    assert llama.kwargs["gguf"].endswith(".gguf") and tunix.python == "/elsewhere/python"
    assert rollout.LlamaSetup().python == "" and LLAMA_CPP.interpreter() and TUNIX.interpreter()


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the kernel reports no steal time")
def test_every_measured_run_records_the_cpu_time_the_hypervisor_took():
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    total = sum(ticks) / os.sysconf("SC_CLK_TCK")  # all CPU time since boot, steal included
    assert 0.0 <= stolen_cpu_s() <= total
    side = Side("env", "tests.bench.test_harness:env_side", {"names": ["OMP_WAIT_POLICY"]})
    results = interleave([side], repeats=2, warmup=1, progress=False)
    shares = [r["stolen_share"] for r in results.runs["env"] + results.warmup["env"]]
    assert len(shares) == 3 and all(0.0 <= x <= 1.0 for x in shares)
    assert results.stolen() == max(shares[:2]) and results.to_json()["max_stolen_share"] == results.stolen()
