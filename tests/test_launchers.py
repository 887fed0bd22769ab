"""The launchers' ``--dry-run`` prints the commands they would run; check those commands."""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest

from tests.helpers import ROOT

LAUNCH = os.path.join(ROOT, "launch")
_CLEAR = ("SLURM_JOB_NODELIST", "SLURM_SUBMIT_DIR", "TPU_NAME", "ZONE", "CONFIG", "MODEL", "GPUS",
          "TP", "MODE", "RLX_ARGS", "SGLANG_MODE", "SGLANG_MODEL", "SGLANG_URL", "SERVER_ARGS")


def _dry(script: str, **env) -> list[list[str]]:
    """Run ``script --dry-run`` with ``env``; the printed commands, each split into words."""
    full = {k: v for k, v in os.environ.items() if k not in _CLEAR}
    full.update(env)
    r = subprocess.run(["bash", os.path.join(LAUNCH, script), "--dry-run"], env=full,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = [ln[2:] for ln in r.stdout.splitlines() if ln.startswith("+ ")]
    return [shlex.split(ln.removesuffix(" &")) for ln in lines]


def _flag(cmd: list[str], name: str) -> str:
    for i, word in enumerate(cmd):
        if word == name:
            return cmd[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    raise AssertionError(f"{name} not in {cmd}")


def test_tpu_pod_runs_rlx_on_every_worker():
    cmds = _dry("tpu_pod.sh", TPU_NAME="pod-v5p", ZONE="us-east5-a", CONFIG="configs/k.py",
                SETUP_CMD="pip install -e 'rlx[tpu]'", RLX_ARGS="--config.mesh.fsdp=64")
    assert len(cmds) == 2
    for cmd in cmds:
        assert cmd[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"] and cmd[5] == "pod-v5p"
        assert "--worker=all" in cmd and "--zone=us-east5-a" in cmd
    assert _flag(cmds[0], "--command") == "pip install -e 'rlx[tpu]'"
    remote = shlex.split(_flag(cmds[1], "--command"))
    assert remote[:3] == ["cd", "rlx", "&&"]
    assert remote[3:6] == ["python3", "-m", "rlx.launch"]
    assert "--config=configs/k.py" in remote and "--config.distributed.enabled=True" in remote
    assert remote[-1] == "--config.mesh.fsdp=64"


def test_tpu_pod_requires_its_variables():
    r = subprocess.run(["bash", os.path.join(LAUNCH, "tpu_pod.sh"), "--dry-run"],
                       env={k: v for k, v in os.environ.items() if k not in _CLEAR},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "TPU_NAME ZONE CONFIG" in r.stderr


def test_sglang_pool_servers_and_router():
    cmds = _dry("sglang_pool.sh", MODEL="/ckpt/policy", GPUS="0,1,2,3,4,5", TP="2",
                ADVERTISE="node7", SERVER_ARGS="--enable-lora --max-lora-rank 16")
    servers, router = cmds[:-1], cmds[-1]
    assert len(servers) == 3
    for i, cmd in enumerate(servers):
        assert cmd[:2] == ["env", f"CUDA_VISIBLE_DEVICES={2 * i},{2 * i + 1}"]
        assert cmd[3:5] == ["-m", "sglang.launch_server"]
        assert _flag(cmd, "--model-path") == "/ckpt/policy" and _flag(cmd, "--tp-size") == "2"
        assert _flag(cmd, "--port") == str(30000 + i) and _flag(cmd, "--max-lora-rank") == "16"
        assert "--enable-lora" in cmd
    assert router[1:3] == ["-m", "sglang_router.launch_router"]
    urls = router[router.index("--worker-urls") + 1: router.index("--host")]
    assert urls == [f"http://node7:{30000 + i}" for i in range(3)]
    assert _flag(router, "--port") == "8000" and _flag(router, "--policy") == "cache_aware"


def test_sglang_pool_dp_mode():
    (cmd,) = _dry("sglang_pool.sh", MODEL="/m", MODE="dp", GPUS="0,1,2,3", TP="2")
    assert cmd[3:5] == ["-m", "sglang_router.launch_server"]
    assert _flag(cmd, "--dp-size") == "2" and _flag(cmd, "--tp-size") == "2"


@pytest.mark.parametrize("mode", ["per-node", "partition", "external", "none"])
def test_slurm_modes(mode):
    env = dict(CONFIG="configs/k.py", SGLANG_MODE=mode, SGLANG_MODEL="/ckpt", DRY_NODES="g0 g1 g2",
               SGLANG_PARTITION="infer", SGLANG_URL="http://infer-01:8000",
               RLX_ARGS="--config.mesh.fsdp=12")
    cmds = _dry("slurm_gpu.sbatch", **env)
    train = next(c for c in cmds if "rlx.launch" in c)
    assert train[:5] == ["srun", "--overlap", "--nodes=3", "--ntasks-per-node=1",
                         f"--chdir={ROOT}"]
    assert "--config=configs/k.py" in train and "--config.distributed.enabled=True" in train
    assert train[-1] == "--config.mesh.fsdp=12"
    url = [w for w in train if w.startswith("--config.rollout.sglang.urls=")]
    gpus = train[train.index("env") + 1]
    if mode == "per-node":
        pools, router = cmds[0], cmds[1]
        assert "ROUTER=0" in pools and "GPUS=0,1,2,3" in pools and pools[-1].endswith("sglang_pool.sh")
        assert _flag(router, "--nodelist") == "g0"
        assert len(router[router.index("--worker-urls") + 1: router.index("--host")]) == 12
        assert url == ["--config.rollout.sglang.urls=http://g0:8000"] and gpus == "CUDA_VISIBLE_DEVICES=4,5,6,7"
    elif mode == "partition":
        assert cmds[0][0] == "sbatch" and _flag(cmds[0], "--partition") == "infer"
        assert cmds[-1][0] == "scancel" and gpus == "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7"
    elif mode == "external":
        assert url == ["--config.rollout.sglang.urls=http://infer-01:8000"] and len(cmds) == 1
    else:
        assert url == [] and len(cmds) == 1


@pytest.mark.parametrize("method", ["fp8", "w8a8_int8", "compressed-tensors"])
def test_sglang_pool_serves_an_rlx_export_with_its_quantization(tmp_path, method):
    (tmp_path / "config.json").write_text('{"quantization_config": {"quant_method": "%s"}}' % method)
    cmds = _dry("sglang_pool.sh", MODEL=str(tmp_path), GPUS="0,1", TP="1", ROUTER="0")
    servers = [c for c in cmds if "sglang.launch_server" in c]
    assert len(servers) == 2 and all(_flag(c, "--quantization") == method for c in servers)
    plain = _dry("sglang_pool.sh", MODEL=str(tmp_path), GPUS="0", ROUTER="0",
                 SERVER_ARGS="--quantization fp8")
    assert sum(w == "--quantization" for w in plain[0]) == 1  # an explicit flag wins


def test_sglang_pool_serves_a_gguf_file_as_gguf():
    cmds = _dry("sglang_pool.sh", MODEL="/models/base.Q4_1.gguf", GPUS="0", ROUTER="0")
    assert _flag(cmds[0], "--quantization") == "gguf"
