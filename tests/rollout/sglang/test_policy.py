"""``rollout.engine = "sglang"``: config errors, and full mode (full weights) on a real CPU server.

LoRA mode (base + hot-loaded adapters) on a real server is covered by ``tests/test_configs.py``
(the SGLang recipes); here the full-weight path: launched at build from rlx's export, sent in
memory after every update (``weight_sync="memory"``, the default), a second policy attached to the same server
(``urls``) pushing its own weights first (``sync_base``), and no process left after ``close()``.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time

import jax
import pytest
from flax import nnx

from rlx.config import parse_config
from rlx.errors import ConfigError
from rlx.models import from_hf_config
from rlx.models.presets import PRESETS
from rlx.rollout.sglang.policy import check_servable, lora_server_args, server_args
from rlx.run.engines import serving
from tests.helpers.runs import config_dict
from tests.helpers.sglang_harness import (SGLANG_PYTHON, cpu_server_args, cpu_server_env,
                                          sglang_available)


def _tiny(tmp_path, **overrides) -> dict:
    """configs/tiny.py (random 2-layer SmolLM2 shape) on 8 devices with dotted overrides."""
    return config_dict("tiny", tmp_path / "run", **{"mesh": {"data": 8}, **overrides})


@pytest.mark.parametrize("sglang,needle", [
    ({}, "needs running servers or an interpreter"),
    ({"python": "/no/such/python"}, "config.rollout.sglang.python='/no/such/python' does not exist"),
    ({"urls": ["http://h:1"], "env": ["NOEQUALS"]}, "env entry 'NOEQUALS' must be 'NAME=value'"),
    ({"urls": ["http://h:1"], "num_servers": 0}, "num_servers and tp_size must be >= 1"),
])
def test_sglang_config_errors_name_the_field(tmp_path, sglang, needle):
    with pytest.raises(ConfigError) as e:
        parse_config(_tiny(tmp_path, **{"rollout.engine": "sglang", "rollout.sglang": sglang}))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_unknown_engine_and_attach_only_configs(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout.engine='vllm' is not one of \['jax', 'sglang'\]"):
        parse_config(_tiny(tmp_path, **{"rollout.engine": "vllm"}))
    cfg = parse_config(_tiny(tmp_path, **{"rollout.engine": "sglang",
                                          "rollout.sglang.urls": ["http://h:1"]}))
    assert cfg.rollout.sglang.urls == ("http://h:1",) and cfg.rollout.sglang.sync_base


def test_what_sglang_cannot_serve_is_refused_before_anything_starts(tmp_path):
    dense = from_hf_config(PRESETS["Qwen/Qwen2.5-1.5B-Instruct"])
    moe = from_hf_config(PRESETS["Qwen/Qwen3-30B-A3B"])
    attach = {"rollout.engine": "sglang", "rollout.sglang.urls": ["http://h:1"]}
    ok = parse_config(_tiny(tmp_path, **attach))
    check_servable(serving(ok), dense)
    check_servable(serving(ok), dense, process_count=2)  # LoRA: process 0 ships the adapters
    full = {**attach, "train.mode": "full", "quant.format": "none", "loss.kl_coef": 0.0}
    check_servable(serving(parse_config(_tiny(tmp_path, **full))), dense, process_count=2)
    on_disk = parse_config(_tiny(tmp_path, **full, **{"rollout.sglang.weight_sync": "disk"}))
    check_servable(serving(on_disk), dense)
    with pytest.raises(ConfigError, match="weight_sync='disk' with 2 JAX processes"):
        check_servable(serving(on_disk), dense, process_count=2)
    with pytest.raises(ConfigError, match="use distributed.rollouts='primary'"):
        parse_config(_tiny(tmp_path, **attach, **{"distributed.rollouts": "per_host"}))
    gguf = parse_config(_tiny(tmp_path, **attach, **{"quant.format": "gguf", "quant.serving": "gguf"}))
    with pytest.raises(ConfigError, match="no model.shrink .* use quant.serving='hf'"):
        check_servable(serving(gguf), dense)
    int4 = parse_config(_tiny(tmp_path, **attach, **{
        "quant.format": "int4", "quant.group_size": 32, "quant.serving": "compressed-tensors"}))
    check_servable(serving(int4), dense)  # dense LoRA runs over SGLang's quantized matmuls
    with pytest.raises(ConfigError, match="LoRA on MoE experts only over a float or fp8 base"):
        check_servable(serving(int4), moe)
    check_servable(serving(parse_config(_tiny(tmp_path, **attach, **{
        "quant.format": "int4", "quant.group_size": 32, "quant.serving": "compressed-tensors",
        "lora.experts": False}))), moe)


def test_lora_server_flags(tmp_path):
    cfg = parse_config(_tiny(tmp_path, **{"lora.rank": 8, "lora.targets": ["q", "v", "gate", "up"]}))
    dense = from_hf_config(PRESETS["Qwen/Qwen3-8B"])
    moe = from_hf_config(PRESETS["Qwen/Qwen3-30B-A3B"])
    assert lora_server_args(cfg.lora, dense) == ("--enable-lora", "--max-lora-rank", "8",
                                            "--lora-target-modules", "q_proj", "v_proj",
                                            "gate_proj", "up_proj")
    assert lora_server_args(cfg.lora, moe)[2] == "16"  # experts' gate+up export as one rank-2r adapter
    gate_only = dataclasses.replace(cfg.lora, targets=("q", "gate"))  # a rank-r gate_up adapter
    no_experts = dataclasses.replace(cfg.lora, experts=False)  # no expert adapter exported
    assert [lora_server_args(lo, moe)[2] for lo in (gate_only, no_experts)] == ["8", "8"]


def test_launch_flags_place_servers_on_their_gpus(tmp_path):
    dense = from_hf_config(PRESETS["Qwen/Qwen3-8B"])
    sglang = {"urls": ["http://h:1"], "num_servers": 2, "tp_size": 2, "extra_args": ["--x", "1"]}
    cfg = parse_config(_tiny(tmp_path, **{"rollout.engine": "sglang", "rollout.sglang": sglang}))
    args = server_args(serving(cfg), dense, 1)
    assert args[:6] == ("--skip-tokenizer-init", "--sleep-on-idle", "--tp-size", "2",
                        "--base-gpu-id", "2")
    assert args[6:9] == ("--enable-lora", "--max-lora-rank", "4") and args[-2:] == ("--x", "1")
    full = parse_config(_tiny(tmp_path, **{"rollout.engine": "sglang", "rollout.sglang.urls": ["u"],
                                           "train.mode": "full", "quant.format": "none",
                                           "loss.kl_coef": 0.0}))
    # full weights come in memory: the server starts from config.json with dummy weights
    assert server_args(serving(full), dense, 0) == ("--skip-tokenizer-init", "--sleep-on-idle",
                                                    "--load-format", "dummy")


# --- full mode on a real server ----------------------------------------------------------------------

def _perturbed(model, seed: int):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(params))))
    params = jax.tree.map(lambda x: x * (1 + 0.3 * jax.random.normal(next(keys), x.shape, x.dtype)),
                          params)
    return nnx.merge(graphdef, params, rest)


def _probe(engine, prompts, sampling):
    outs = engine.generate(prompts, sampling)
    return outs, [(list(r.prompt_ids) + list(r.completion_ids), len(r.prompt_ids)) for r in outs]


def _process_group_gone(pid: int, timeout_s: float = 60.0) -> bool:
    """Whether every process of the server's group has exited (killed children take a moment)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.5)
    return False


@pytest.mark.slow  # CI: a minute; servers launched by rlx run in tests/reliability/test_engine_faults.py
@pytest.mark.sglang
@pytest.mark.skipif(not sglang_available(), reason=f"no SGLang at {SGLANG_PYTHON}")
def test_full_weights_launched_synced_attached_and_stopped(tmp_path):
    from rlx.rollout.preflight import PreflightError, run_preflight
    from rlx.rollout.sglang.policy import SGLangPolicy
    from rlx.run.build import build

    env = [f"{k}={v}" for k, v in cpu_server_env(str(tmp_path / "harness"))]
    cfg = _tiny(tmp_path, **{
        "train.mode": "full", "quant.format": "none", "quant.serving": "hf", "loss.kl_coef": 0.0,
        "train.checkpoint_every": 0, "data.eval_size": 0, "rollout.group_size": 4,
        "rollout.max_new_tokens": 6, "rollout.engine": "sglang",
        "rollout.sglang": {"python": SGLANG_PYTHON, "env": env, "extra_args": list(cpu_server_args())}})
    run = build(parse_config(cfg), progress=False)
    attached = None
    try:
        (server,) = run.engine.servers
        record = run.step()  # full weights sent in memory as version 1 (queued after the step)
        run.queue.wait_synced()
        assert run.engine.weight_version == 1 and record["learner/mismatch_abs_max"] < 5e-3
        prompts = next(run.data).prompts
        sampling = run._sampling()
        check = dict(engine_name="sglang", base_format="f32", threshold=5e-3)

        new = _perturbed(run.compiled.model(), seed=1)
        run.engine.update_weights(new, 2)
        outs, probe = _probe(run.engine, prompts, sampling)
        assert {r.weight_version for r in outs} == {2}
        run_preflight(new, run.engine.score, probe, **check)
        with pytest.raises(PreflightError):
            run_preflight(run.compiled.model(), run.engine.score, probe, **check)

        # attach a second policy to the running server: its own weights replace the served ones
        other = _perturbed(run.compiled.model(), seed=2)
        attach_cfg = copy.deepcopy(cfg)
        attach_cfg["output_dir"] = str(tmp_path / "attached")
        attach_cfg["rollout"]["sglang"] = {"urls": [server.url]}
        attached = SGLangPolicy(serving(parse_config(attach_cfg)), other)
        assert attached.servers == [] and attached.weight_version == 0
        outs, probe = _probe(attached, prompts, sampling)
        assert {r.weight_version for r in outs} == {0}
        run_preflight(other, attached.score, probe, **check)
        attached.close()  # the client only: the server belongs to `run`
        assert server.alive()
    finally:
        if attached is not None:
            attached.close()
        run.close()
    assert not server.alive() and _process_group_gone(server.proc.pid)
    assert not run.engine.health()
