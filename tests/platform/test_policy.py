"""rlx.platform.policy: one policy per platform, chosen once from the mesh's devices or, while
tracing, from the innermost ``compiling_for`` / ``active`` block."""

import dataclasses

import jax

from rlx.mesh import MeshShape, make_mesh
from rlx.platform import (CPU, GPU, TPU, PlatformPolicy, active, compiling_for, current, policy_for,
                          policy_of)


def test_the_cpu_mesh_gets_the_cpu_policy():
    mesh = make_mesh(MeshShape(data=2, fsdp=4))
    assert policy_of(mesh) is CPU
    assert current() is CPU  # the tests run on XLA:CPU (tests/conftest.py)


def test_compiling_for_a_platform_sets_the_policy_inside_the_block_only():
    with compiling_for("tpu") as inside:
        assert inside is TPU and current() is TPU
        with compiling_for("gpu"):
            assert current() is GPU
        assert current() is TPU
    assert current() is policy_for(jax.default_backend()) is CPU


def test_active_takes_any_policy():
    variant = dataclasses.replace(CPU, grouped_products=True)
    with active(variant):
        assert current() == variant and current() is not CPU
    assert current() is CPU


def test_gpu_names_share_one_policy_and_an_unknown_platform_gets_the_plain_one():
    assert policy_for("gpu") is policy_for("cuda") is policy_for("rocm") is GPU
    assert policy_for("metal") == PlatformPolicy()


def test_the_cpu_choices():
    # the KV cache widened, the engine's out_in layout, few-row products, bits for fp8 stacks,
    # the host's tensor layout; grouped scales stay outside the product
    assert CPU.wide_kv_cache and CPU.decode_layout == "out_in" and CPU.few_row_products
    assert CPU.byte_floats_as_bits and CPU.host_layout and CPU.experts_one_at_a_time
    assert not CPU.grouped_products
    assert CPU.unroll_train_from_params == 50_000_000 and CPU.unroll_decode_bytes == 1 << 30
    for accelerator in (GPU, TPU):
        assert accelerator.grouped_products and accelerator.decode_layout == "in_out"
        assert not (accelerator.wide_kv_cache or accelerator.few_row_products
                    or accelerator.byte_floats_as_bits or accelerator.host_layout)
        assert accelerator.unroll_train_from_params is accelerator.unroll_decode_bytes is None


def test_train_step_compiler_options():
    # XLA:CPU: the memory-optimised scheduler only where the step recomputes activations
    scheduler = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
    assert CPU.compiler_options(recompute=True) == scheduler
    assert CPU.compiler_options(recompute=False) is None
    assert GPU.compiler_options(recompute=True) is None
    tpu = {"xla_tpu_enable_sparse_core_collective_offload_all_reduce": False}
    assert TPU.compiler_options(recompute=False) == TPU.compiler_options(recompute=True) == tpu
