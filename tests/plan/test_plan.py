"""The memory planner: analytic model vs XLA's compiled memory analysis, config files, the 1T plan."""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import pytest

from rlx.mesh import MeshShape
from rlx.models import ModelConfig, MoEConfig
from rlx.plan import load_config_file, nodes_needed, plan, spec_from_config
from rlx.plan.memory import compiled_bytes
from rlx.plan.spec import PlanSpec
from rlx.quant import LoraConfig, QuantConfig
from tests.helpers import ROOT, SMOLLM2_FILE, smollm2_dir

# Shapes differ from the sweep the coefficients were calibrated on (one device, other sizes).
DENSE = ModelConfig(architecture="LlamaForCausalLM", vocab_size=2048, hidden_size=192,
                    intermediate_size=512, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=32)
MOE = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=1536, hidden_size=160,
                  intermediate_size=384, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=40,
                  qk_norm=True, moe=MoEConfig(12, 3, 96, True, sparse_layers=(1, 2)))
SMALL = dict(dtype="float32", param_dtype="float32", remat="none", rows=8, seq_len=160,
             logprob_chunk=320)
CASES = {
    "dense-full": PlanSpec(model=DENSE, mode="full", **SMALL),
    "moe-full": PlanSpec(model=MOE, mode="full", moe_impl="dense", **SMALL),
    "dense-lora": PlanSpec(model=DENSE, mode="lora", quant=QuantConfig("int8"), lora=LoraConfig(rank=8),
                        **SMALL),
    "moe-lora": PlanSpec(model=MOE, mode="lora", moe_impl="dense", quant=QuantConfig("int4", group_size=32),
                      lora=LoraConfig(rank=4), **SMALL),
}
MESHES = [MeshShape(data=2, fsdp=2, tensor=2), MeshShape(fsdp=2, expert=4)]


def _state(p) -> int:
    return sum(p.bytes[k] for k in ("frozen", "trainable", "optimizer", "batch"))


@pytest.mark.parametrize("name", list(CASES))
def test_analytic_matches_compiled(name):
    """Whole train step on one device: analytic peak within 10% of XLA's memory analysis."""
    spec = CASES[name]
    p = plan(spec, hbm_gb=1.0)
    xla = compiled_bytes(spec, jax.devices())
    step = p.train_peak - p.bytes["engine"]  # the engine's own weights are no part of the step
    assert abs(step - xla["total"]) <= 0.10 * xla["total"], (name, step, xla)
    # the state is exact: XLA's arguments are the state and the batch (+ a few scalars)
    assert abs(_state(p) - xla["argument"]) <= 64, (_state(p), xla)


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("name", ["moe-lora"])
def test_sharded_state_is_exact(name, mesh):
    """Per-device state bytes from logical axes equal XLA's per-device argument sizes."""
    spec = CASES[name].replace(mesh=mesh)
    xla = compiled_bytes(spec, jax.devices())
    assert abs(_state(plan(spec, 1.0)) - xla["argument"]) <= 64, xla


@pytest.mark.parametrize("name,mesh", [("dense-lora", MeshShape(context=4)),
                                       ("dense-full", MeshShape(context=2, tensor=2))],
                         ids=["lora-context4", "full-context2-tensor2"])
def test_context_parallel_step_matches_compiled(name, mesh):
    """Context parallelism: what a longer sequence adds to the step (640 -> 1,280 tokens per
    row: activations and log-prob chunks split over the context devices, each layer's keys and
    values gathered whole, ``gathered``) within 10% of what it adds to XLA's memory analysis of
    the compiled step on the mesh; the state (sharded over ``context`` like FSDP) exact."""
    growth = []
    for seq_len in (640, 1280):
        spec = CASES[name].replace(mesh=mesh, seq_len=seq_len, rows=4, logprob_chunk=640)
        p, xla = plan(spec, 1.0), compiled_bytes(spec, jax.devices())
        assert abs(_state(p) - xla["argument"]) <= 64, (_state(p), xla)
        growth.append((p.train_peak - p.bytes["engine"], xla["total"]))
    planned, compiled = growth[1][0] - growth[0][0], growth[1][1] - growth[0][1]
    assert abs(planned - compiled) <= 0.10 * compiled, (planned, compiled)


KIMI = os.path.join(ROOT, "configs", "kimi_k2.py")
GLM = os.path.join(ROOT, "configs", "glm45_air.py")


def test_kimi_k2_lora_fits_one_node_synchronous_or_one_step_off():
    """configs/kimi_k2.py, a run config planned as the run it describes: Kimi-K2's architecture
    (1.026T parameters, multi-head latent attention), int4 experts + LoRA on 8 x 141 GB. The
    learner keeps the attention, dense and shared-expert weights and the adapters' ``embed``
    dimensions split over the expert devices (``rlx.mesh.TRAIN_RULES``). The run is synchronous:
    the built-in engine samples from the learner's own arrays, base and adapters, and it fits one
    node; one-step-off, the engine's copy of the adapters (whole along ``embed``: the sampling
    rules) still fits it. Full mode needs 14 nodes synchronous; one-step-off, its engine's copy of
    every parameter is split over the fsdp devices as the learner's is (``fsdp_as_tensor``: a
    node more halves it), and 16 nodes fit it."""
    spec = spec_from_config(load_config_file(KIMI))
    assert 1.0e12 < spec.model.num_params() < 1.1e12 and spec.mesh.num_devices == 8
    assert spec.model.mla is not None and not spec.engine_copies_trainables
    assert (spec.rows, spec.seq_len, spec.micro_batches) == (64, 2048, 8)
    budget = load_config_file(KIMI)
    budget.train.tokens_per_micro_batch = 4096  # two 2048-token rollouts per row, one per device
    packed = spec_from_config(budget)
    assert (packed.rows, packed.seq_len, packed.micro_batches) == (32, 4096, 4)
    one_step_off = load_config_file(KIMI)
    one_step_off.train.max_staleness = 1  # the run's RunConfig.engine_copies_trainables
    assert spec_from_config(one_step_off) == spec.replace(engine_copies_trainables=True)
    b = plan(spec, hbm_gb=141)
    assert b.bytes["frozen"] > 0.5 * b.peak  # the int4 experts, held once
    assert b.bytes["engine"] == 0 and b.fits and nodes_needed(spec, 141) == 1
    off = plan(spec.replace(engine_copies_trainables=True), hbm_gb=141)
    assert off.bytes["engine"] > b.bytes["trainable"]  # the sampling layout: LoRA A whole
    assert off.train_peak - off.bytes["engine"] == b.train_peak < off.train_peak <= 141e9 * 0.92
    assert nodes_needed(spec.replace(engine_copies_trainables=True), 141) == 1
    # a weight sync places the new copy before the old one goes: twice the engine's beside the
    # learner's state; a synchronous run's engine reads the new arrays in place
    assert off.sync_peak - b.sync_peak == 2 * off.bytes["engine"] and b.bytes["engine_sync"] == 0
    a = plan(spec.replace(mode="full", engine_copies_trainables=True), hbm_gb=141)
    assert not a.fits and a.bytes["frozen"] == 60 * 384 * 4  # the f32 correction biases
    assert a.bytes["optimizer"] == 2 * a.bytes["trainable"] < 2 * a.bytes["engine"]
    two = plan(spec.replace(mode="full", engine_copies_trainables=True,
                            mesh=dataclasses.replace(spec.mesh, fsdp=2)), 141)
    assert 0.5 * a.bytes["engine"] <= two.bytes["engine"] < 0.51 * a.bytes["engine"]
    assert nodes_needed(spec.replace(mode="full", engine_copies_trainables=True), 141) == 16
    assert nodes_needed(spec.replace(mode="full"), 141) == 14


def test_cli_prints_categories_and_verdict(capsys):
    from rlx.plan import main

    assert main(["--config", GLM]) == 0  # 80 GB devices unless --hbm-gb
    out = capsys.readouterr().out
    for key in ("frozen", "trainable", "optimizer", "grads", "activations", "logprob_chunks",
                "kv_cache", "verdict    fits"):
        assert key in out
    assert main(["--config", KIMI, "--hbm-gb", "141", "--mode", "full"]) == 1
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "mesh fsdp=14, 112 devices = 14 nodes of 8" in out
    assert "engine" in out and "load peak" in out and "sync peak" in out


def test_cli_overrides_the_config_as_launch_does(capsys):
    """``--config.FIELD=VALUE`` is read as ``python -m rlx.launch`` reads it
    (``rlx.commandline.config_from_argv``): a longer completion is a longer row in the plan and more
    activations; an override of a field the file does not set, or of the wrong type, is launch's
    one-line error with exit status 2."""
    from rlx.plan import main

    assert main(["--config", GLM]) == 0
    short = capsys.readouterr().out
    assert main(["--config", GLM, "--config.data.max_prompt_tokens=1024",
                 "--config.rollout.max_new_tokens", "7168", "--hbm-gb", "400"]) == 0
    long = capsys.readouterr().out
    assert "rows=64x2048," in short and "rows=64x8192," in long  # 512 + 1536, 1024 + 7168

    def acts(out: str) -> float:
        return float(next(l for l in out.splitlines() if "activations" in l).split()[-1])

    assert acts(long) > 3 * acts(short)
    for override, needle in (("--config.data.nope=1", "unknown key config.data.nope "),
                             ("--config.data.max_prompt_tokens=2k",
                              "flag --config.data.max_prompt_tokens=2k: invalid literal")):
        assert main(["--config", GLM, override]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"rlx.plan: config error: {needle}") and "\n" not in err, err


def test_a_gguf_model_is_planned_as_its_file_blocks(capsys):
    """configs/quickstart.py keeps SmolLM2-135M's Q4_1 GGUF blocks as its base (a
    ``package://`` path): the planner reads the architecture and each tensor's type from the
    file's header, and its frozen bytes are exactly those of the model ``load_gguf_quantized``
    loads from the file (every block, the float norms)."""
    from flax import nnx

    from rlx.plan import main
    from rlx.plan.memory import state_bytes
    from rlx.quant import load_gguf_quantized

    quickstart = os.path.join(ROOT, "configs", "quickstart.py")
    loaded = load_gguf_quantized(os.path.join(smollm2_dir(), SMOLLM2_FILE)).model
    spec = spec_from_config(load_config_file(quickstart))
    assert state_bytes(spec)["frozen"] == sum(x.nbytes for x in jax.tree.leaves(nnx.state(loaded)))
    assert main(["--config", quickstart]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model      LlamaForCausalLM, 0.13B params; mode lora, base gguf"), out


@pytest.mark.parametrize("name", ["dense-lora", "dense-full"])
def test_the_critic_is_counted_as_a_run_holds_it(name):
    """PPO's critic (``critic=True``): per-device bytes of its variables (a second adapter, or a
    copy of the model in full mode, plus the f32 value head) and their AdamW moments equal those
    of the ``CriticState`` a run builds, sharded like the policy on an 8-device mesh."""
    from flax import nnx

    from rlx.learner.critic import init_critic, value_head
    from rlx.learner.state import OptimizerConfig, TrainState, make_optimizer, state_shardings
    from rlx.mesh import make_mesh
    from rlx.plan.spec import abstract_model, trainable_filter

    mesh_shape = MeshShape(data=2, fsdp=2, tensor=2)
    spec = CASES[name].replace(mesh=mesh_shape, critic=True)
    p = plan(spec, hbm_gb=1.0)
    without = plan(spec.replace(critic=False), hbm_gb=1.0)
    assert without.bytes["critic"] == without.bytes["critic_optimizer"] == 0
    assert p.train_peak - without.train_peak == p.bytes["critic"] + p.bytes["critic_optimizer"]

    mesh = make_mesh(mesh_shape, jax.devices()[:8])
    _, params, frozen = nnx.split(abstract_model(spec), trainable_filter(spec), ...)
    optimizer = make_optimizer(OptimizerConfig())
    critic = jax.eval_shape(lambda body: init_critic(
        body, value_head(spec.model.hidden_size), optimizer), params)
    zero = jax.ShapeDtypeStruct((), jax.numpy.int32)
    state = TrainState(step=zero, skipped=zero, params=params, frozen=frozen,
                       opt_state=jax.eval_shape(optimizer.init, params),
                       rng=jax.eval_shape(lambda: jax.random.key(0)), critic=critic)
    shardings = state_shardings(state, optimizer, mesh).critic

    def per_device(tree, tree_shardings) -> int:
        leaves = jax.tree.leaves(tree)
        placed = jax.tree.leaves(tree_shardings, is_leaf=lambda x: hasattr(x, "shard_shape"))
        return sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
                   for x, s in zip(leaves, placed, strict=True))

    assert p.bytes["critic"] == per_device(critic.params, shardings.params)
    assert abs(p.bytes["critic_optimizer"] - per_device(critic.opt_state, shardings.opt_state)) <= 64
