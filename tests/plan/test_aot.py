"""Ahead-of-time compilation for a TPU topology on this CPU host (``rlx.plan.aot``): rlx's train
step and the built-in engine's generate step of a tiny MoE model (int4 experts + LoRA, bf16)
compile for 4 TPU7x chips, and XLA:TPU's memory analysis agrees with the planner's figures.

Needs the libtpu package (the ``tpu-aot`` extra); skipped without it. The programs trace the TPU
choices of rlx (``rlx.platform.compiling_for``: bf16 KV cache, grouped quantized products for a
decode step's few rows), which the CPU tests never reach.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlx.learner.step import compiler_options, model_forward
from rlx.mesh import MeshShape
from rlx.models import ModelConfig, MoEConfig
from rlx.models.kv_cache import cache_dtype
from rlx.plan.aot import (HELD_OUT_POINTS, WHOLE_MODEL_POINTS, compile_paged, compile_sample,
                          compile_train, measure, spec_from_argv, topology, tpu_plan)
from rlx.plan.aot_sample import (SAMPLE_WHOLE_MODEL_POINTS, generate_shapes, paged_shapes,
                                 sample_temp)
from rlx.plan.spec import PlanSpec
from rlx.platform import CPU, TPU, compiling_for, current
from rlx.quant import LoraConfig, QuantConfig
from rlx.quant.tensors import quantize_array
from tests.helpers import ROOT

# widths multiples of 128: XLA:TPU pads arrays to (8, 128) tiles, which the planner does not count
MOE = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=2048, hidden_size=256,
                  intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                  qk_norm=True, moe=MoEConfig(8, 2, 128, True, sparse_layers=(1,)))
SPEC = PlanSpec(model=MOE, mode="lora", moe_impl="dense", rows=8, seq_len=256, logprob_chunk=256,
                quant=QuantConfig("int4", group_size=64), lora=LoraConfig(rank=8),
                mesh=MeshShape(data=2, expert=4), rollout_rows=8, rollout_len=128)


@pytest.fixture(scope="module")
def topo():
    pytest.importorskip("libtpu", reason="compiling for TPU needs the libtpu package "
                                         "(pip install -e .[tpu-aot])")
    return topology("tpu7x:2x2x1")


def test_traced_code_reads_the_target_platforms_policy():
    """Inside ``compiling_for("tpu")`` a bf16 decode caches bf16 (XLA:CPU's branch: f32) and a
    bf16 decode step's few rows multiply int4 groups inside the product (XLA:CPU: dequantize
    first)."""
    q = quantize_array(jnp.ones((128, 64)), "int4", group_size=32)
    x = jnp.ones((4, 128))
    assert cache_dtype(jnp.bfloat16, CPU) == jnp.float32
    assert q.product(x, jnp.bfloat16, jnp.float32) is None
    with compiling_for("tpu"):
        assert current() is TPU and cache_dtype(jnp.bfloat16) == jnp.bfloat16
        assert q.product(x, jnp.bfloat16, jnp.float32) is not None
    assert current() is CPU


def test_topology_counts_tensorcores(topo):
    """tpu7x:2x2x1 is 4 Ironwood chips of two TensorCores each, 96 GiB HBM per TensorCore."""
    assert (len(topo.devices), topo.chips, topo.per_chip, topo.device_hbm_gib) == (8, 4, 2, 96)


def test_aot_reads_config_overrides_and_variants(topo, capsys):
    """``--aot`` takes the config as ``python -m rlx.launch`` does: ``configs/X.py:VARIANT`` and
    ``--config.FIELD=VALUE`` (the spec only: nothing compiles)."""
    from rlx.plan.aot import main

    kimi = os.path.join(ROOT, "configs", "kimi_k2.py")
    spec, _ = spec_from_argv(f"--config {kimi} --aot tpu7x:2x2x2")
    long, _ = spec_from_argv(f"--config {kimi}:long --config.rollout.max_new_tokens=6144 "
                             "--aot tpu7x:2x2x2")
    assert (spec.seq_len, spec.rollout_len) == (2048, 2048)
    assert (long.seq_len, long.rollout_len) == (8192, 8192)  # the long variant's 2048-token prompts
    # the long variant splits each sequence over 4 context devices, experts over 2 (x2 on 16)
    assert long.mesh.context == 4 and long.mesh.num_devices == spec.mesh.num_devices
    assert (spec.rollout_prompt, long.rollout_prompt) == (512, 2048)  # max_prompt_tokens
    assert long == spec.replace(seq_len=8192, rollout_len=8192, rollout_prompt=2048,
                                mesh=long.mesh, micro_batches=long.micro_batches)
    assert main(["--config", kimi, "--config.rollout.max_new_tokens=lots", "--aot",
                 "tpu7x:2x2x2"]) == 2
    assert capsys.readouterr().err.startswith(
        "rlx.plan: config error: flag --config.rollout.max_new_tokens=lots: invalid literal")
    # --steps sample compiles the engine's programs as the config batches them
    lockstep, _ = spec_from_argv(f"--config {kimi} --config.rollout.jax.batching=lockstep "
                                 "--aot tpu7x:2x2x2")
    assert spec.continuous and not lockstep.continuous
    assert lockstep == spec.replace(batching="lockstep")
    assert main(["--config", kimi, "--aot", "tpu7x:2x2x2", "--steps", "train,paged"]) == 2
    assert "--steps train,paged: each of train, sample" in capsys.readouterr().err


def test_train_and_generate_compile_and_match_the_plan(topo):
    """Both programs compile for TPU; XLA:TPU's arguments are the planned state within 10%
    (small arrays pad to (8, 128) tiles, which the plan does not count), and the generate step
    holds at least its bf16 KV cache."""
    p = tpu_plan(SPEC, topo)
    train = compile_train(SPEC, topo)
    state = sum(p.bytes[k] for k in ("frozen", "trainable", "optimizer", "batch"))
    assert not train.refused and abs(train.argument - state) <= 0.10 * train.argument
    sample = compile_sample(SPEC, topo)
    assert not sample.refused
    assert abs(sample.argument - (p.bytes["frozen"] + p.bytes["trainable"])) <= (
        0.10 * sample.argument)
    rows, prompt, new = generate_shapes(SPEC)
    cache = MOE.num_layers * rows * (prompt + new) * 2 * 2 * 64 * 2 // 8  # bf16 keys, values
    assert sample.temp >= cache, (sample, cache)


def test_the_continuous_engines_programs_compile_with_a_pool_per_data_shard(topo):
    """The decode burst and prefill chunk of the continuous engine compile for TPU on the
    8-shard mesh. The pools they donate and return (XLA's aliased bytes) are one data shard's
    per device (9 pages: its slot's 128 tokens and the padding page), at most 2x with XLA:TPU's
    tile padding (measured 2.0x), not the 8 shards' together (8x); the burst's other arguments
    are the planned weights within 10% (tiles; the prefill computes no logits, and XLA drops
    the unread output head from its arguments)."""
    p = tpu_plan(SPEC, topo)
    shapes = paged_shapes(SPEC)
    assert (shapes["shards"], shapes["pages"]) == (8, 9)
    pools = MOE.num_layers * 2 * shapes["pages"] * 16 * 2 * 64 * 2  # keys + values, bf16
    state = p.bytes["frozen"] + p.bytes["trainable"]
    for name, xla in compile_paged(SPEC, topo).items():
        assert not xla.refused, name
        assert pools <= xla.alias <= 2 * pools, (name, xla.alias, pools)
        assert xla.argument - xla.alias <= 1.10 * state, (name, xla, state)
        if name == "burst":
            assert abs(xla.argument - xla.alias - state) <= 0.10 * state, (xla, state)


def test_a_program_over_hbm_is_refused_with_its_size(topo):
    """XLA:TPU refuses at compile time what does not fit a device; the record keeps the bytes."""
    mesh = Mesh(np.asarray(topo.devices[:1]), ("x",))
    x = jax.ShapeDtypeStruct((60 * 2 ** 30 // 4,), jnp.float32,
                             sharding=NamedSharding(mesh, PartitionSpec()))
    out = measure(lambda: jax.jit(lambda a: a * 2).lower(x).compile().memory_analysis())
    assert out.refused and 119 * 2 ** 30 <= out.needed <= 121 * 2 ** 30  # argument + output


def test_a_bf16_all_reduce_compiles_with_the_train_steps_options(topo):
    """A 2 MB bf16 sum over 8 devices (a full-parameter step's gradients, in miniature) compiles
    for TPU7x with the train step's XLA options (``rlx.learner.step.compiler_options``: libtpu
    offloads such all-reduces to the SparseCores and then fails to compile them)."""
    mesh = Mesh(np.asarray(topo.devices), ("data",))
    x = jax.ShapeDtypeStruct((8, 2 ** 20), jnp.bfloat16,
                             sharding=NamedSharding(mesh, PartitionSpec("data")))
    fn = jax.jit(lambda a: a.sum(0), out_shardings=NamedSharding(mesh, PartitionSpec()),
                 compiler_options=compiler_options(mesh, model_forward))
    assert fn.lower(x).compile().memory_analysis().output_size_in_bytes == 2 * 2 ** 20


def test_the_tpu_plan_is_within_10_percent_of_each_whole_model_program(topo):
    """The train step of each whole-model program ``TPU_COEFFS`` was fitted on
    (``WHOLE_MODEL_POINTS``: XLA:TPU's transient bytes, rlx/plan/README.md) and of those held
    out (``HELD_OUT_POINTS``: the :long recipes under context parallelism): the TPU plan's
    program total (exact state + ``TPU_COEFFS`` transient) is within 10% of XLA:TPU's (the
    same state + its transient)."""
    assert len(WHOLE_MODEL_POINTS) >= 3 and len(HELD_OUT_POINTS) >= 2
    for argv, transient_gb in WHOLE_MODEL_POINTS + HELD_OUT_POINTS:
        spec, on = spec_from_argv(argv)
        p = tpu_plan(spec, on)
        state = sum(p.bytes[k] for k in ("frozen", "trainable", "optimizer", "batch"))
        planned = state + p.bytes["grads"] + p.bytes["activations"] + p.bytes["logprob_chunks"]
        xla = state + transient_gb * 1e9
        assert abs(planned - xla) <= 0.10 * xla, (argv, planned / 1e9, xla / 1e9)


# a small MoE whose generate step holds about 1 GB per device: 128 rows of 256 + 1024 slots over 8
# devices, tokens dispatched dropless to 16 int4 experts split 8 ways (width 2048, one layer).
# Not one of the programs SAMPLE_TPU_COEFFS was fitted on (SAMPLE_CALIBRATION,
# SAMPLE_WHOLE_MODEL_POINTS).
WIDE = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=8192, hidden_size=2048,
                   intermediate_size=4096, num_layers=1, num_heads=16, num_kv_heads=2,
                   head_dim=128, qk_norm=True,
                   moe=MoEConfig(16, 4, 1024, True, sparse_layers=(0,)))
SAMPLE_SPEC = PlanSpec(model=WIDE, mode="lora", moe_impl="ragged",
                       quant=QuantConfig("int4", group_size=64), lora=LoraConfig(rank=8),
                       mesh=MeshShape(expert=8), rollout_rows=128, rollout_len=1024)


def test_the_sample_step_plan_agrees_with_xla_tpu(topo):
    """The TPU plan of the generate step (exact state + ``SAMPLE_TPU_COEFFS`` times
    ``sample_features``, printed as the plan's ``kv_cache + decode_temp``) of a model it was not
    fitted on is within 25% of XLA:TPU's compiled program, temporaries and total (measured:
    -17.0% and -16.7%; this program's peak is the exchange buffers alone, which the linear
    fit, whose points also hold the dequantized experts at their peak, weighs low). The old plan
    (KV cache + one step's logits) was 97% under."""
    xla = compile_sample(SAMPLE_SPEC, topo)
    p = tpu_plan(SAMPLE_SPEC, topo)
    temp = p.bytes["kv_cache"] + p.bytes["decode_temp"]
    assert temp == sample_temp(SAMPLE_SPEC)
    assert abs(temp - xla.temp) <= 0.25 * xla.temp, (temp / 1e9, xla.temp / 1e9)
    total = p.bytes["frozen"] + p.bytes["trainable"] + temp
    assert abs(total - xla.total) <= 0.25 * xla.total, (total / 1e9, xla.total / 1e9)


def test_the_sample_plan_is_within_10_percent_of_each_whole_model_generate_program(topo):
    """Each whole-model generate program of ``SAMPLE_WHOLE_MODEL_POINTS`` (XLA:TPU's
    temporaries, rlx/plan/README.md): the TPU plan's sample-step total (exact state + planned
    temporaries) is within 10% of XLA:TPU's (the same state + its temporaries)."""
    for argv, temp_gb in SAMPLE_WHOLE_MODEL_POINTS:
        spec, on = spec_from_argv(argv)
        p = tpu_plan(spec, on)
        state = p.bytes["frozen"] + p.bytes["trainable"]
        planned = state + p.bytes["kv_cache"] + p.bytes["decode_temp"]
        xla = state + temp_gb * 1e9
        assert abs(planned - xla) <= 0.10 * xla, (argv, planned / 1e9, xla / 1e9)


def test_the_generate_fit_finds_both_phases():
    """``fit_sample_coeffs`` on targets made by known coefficients (``sample_temp``: the larger
    of the prefill and the last decode segment) gives them back: the 2,048-token programs'
    prefill binds, the 32,768-token ones' whole cache."""
    from rlx.plan.aot_sample import SAMPLE_TPU_COEFFS, fit_sample_coeffs

    kimi = os.path.join(ROOT, "configs", "kimi_k2.py")
    deepseek = os.path.join(ROOT, "configs", "deepseek_v3_fp8.py")
    argv = [f"--config {kimi} --aot tpu7x:2x2x2 --capacity-factor 0",
            f"--config {deepseek} --aot tpu7x:2x2x2",
            f"--config {kimi}:long --aot tpu7x:2x2x2",
            f"--config {deepseek}:long --aot tpu7x:2x2x2",
            f"--config {kimi}:long --config.rollout.max_new_tokens=6144 --aot tpu7x:2x2x2"]
    specs = [spec_from_argv(a)[0] for a in argv]
    planted = dict(SAMPLE_TPU_COEFFS, kv_full=1.3)
    points = [(s, sample_temp(s, planted), 1.0) for s in specs]
    fitted = fit_sample_coeffs(points)
    assert fitted["kv_full"] == pytest.approx(1.3, rel=0.01)
    for s, target, _ in points:
        assert sample_temp(s, fitted) == pytest.approx(target, rel=0.01)
