"""``python -m rlx.launch`` end to end in a subprocess: summary on success, one-line errors."""

import os
import subprocess
import sys

import pytest

from tests.helpers.hf_zoo import make_hf_model
from tests.helpers import ROOT

CONFIG = os.path.join(ROOT, "configs", "quickstart.py")
HF_BASE = ("--config.quant.format=none", "--config.quant.serving=hf")  # the quickstart keeps GGUF blocks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model("qwen3_moe", str(tmp_path_factory.mktemp("zoo")))


def _launch(*overrides: str, devices: int = 8) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "rlx.launch", f"--config={CONFIG}", "--dry_run",
                           *overrides],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def test_launch_loads_shards_and_summarises(model_dir):
    r = _launch(f"--config.model.path={model_dir}", *HF_BASE, "--config.mesh.data=2",
                "--config.mesh.tensor=2", "--config.mesh.expert=2")
    assert r.returncode == 0, r.stderr
    assert "Qwen3MoeForCausalLM" in r.stdout
    assert "experts 8 top-2" in r.stdout
    assert "'data': 2, 'fsdp': 1, 'context': 1, 'tensor': 2, 'expert': 2" in r.stdout


@pytest.mark.parametrize("override,needle", [
    ("--config.mesh.fsdp=3", "config.mesh data*fsdp*context*tensor*expert = 8*3*1*1*1 = 24, but 8 devices"),
    ("--config.model.dtype=float64", "config.model.dtype='float64' is not one of"),
    ("--config.model.path=/no/such/model", "config.model.path='/no/such/model' does not exist"),
])
def test_bad_config_exits_nonzero_with_one_line(model_dir, override, needle):
    args = [f"--config.model.path={model_dir}", *HF_BASE, "--config.mesh.data=8", override]
    r = _launch(*args)
    assert r.returncode == 2
    lines = [l for l in r.stderr.strip().splitlines() if l.startswith("rlx:")]
    assert len(lines) == 1 and needle in lines[0], r.stderr


@pytest.mark.parametrize("override,needle", [
    ("--config.model.nope=1", "unknown key config.model.nope (--config.model.nope): no such "
                              "field; the closest is config.model."),
    ("--config.train.lr=-1", "unknown key config.train.lr (--config.train.lr): no such field; "
                             "the closest is config.optim.learning_rate"),
    ("--config.optim.learning_rate=-1", "config.optim: OptimizerConfig learning_rate"),
    # a field quickstart.py does not list: read, then refused by the run's checks
    ("--config.rollout.partial=True", "config.rollout.partial=True continues generations"),
    ("--config.data.max_prompt_tokens=1.5", "flag --config.data.max_prompt_tokens=1.5: invalid "
                                            "literal for int()"),
])
def test_a_bad_override_is_refused_in_one_line(model_dir, override, needle):
    """Read by ``rlx.commandline.config_from_argv``, as ``python -m rlx.plan`` reads it."""
    r = _launch(f"--config.model.path={model_dir}", override)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and \
        r.stderr.startswith(f"rlx: config error: {needle}"), r.stderr


@pytest.mark.parametrize("command", ["rlx.launch", "rlx.eval", "rlx.plan"])
def test_help_exits_0_also_when_the_reader_stops_early(command):
    """``--help`` prints the command's options, exit status 0; a reader that closes the output
    before it is written (``--help | head``) leaves no BrokenPipeError traceback."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    argv = [sys.executable, "-m", command, "--help"]
    r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "--config" in r.stdout and ("--aot TOPOLOGY" in r.stdout or command != "rlx.plan")
    closed = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    closed.stdout.close()
    err = closed.stderr.read().decode()
    assert closed.wait(timeout=120) == 0 and err == "", err
