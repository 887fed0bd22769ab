"""rlx.platform.policy: one policy per platform, chosen once from the mesh's devices or, while
tracing, from the innermost ``compiling_for`` / ``active`` block."""

import ast
import dataclasses
import os

import jax

from rlx.learner.step import FORWARDS, compiler_options
from rlx.mesh import MeshShape, make_mesh
from rlx.platform import (CPU, GPU, TPU, PlatformPolicy, active, compiling_for, current, policy_for,
                          policy_of)
from tests.helpers import ROOT


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


def test_the_train_step_takes_the_options_of_its_meshs_policy():
    mesh = make_mesh(MeshShape(data=8))
    assert compiler_options(mesh, FORWARDS["layer"]) == CPU.compiler_options(recompute=True)
    assert compiler_options(mesh, FORWARDS["projections"]) == CPU.compiler_options(recompute=True)
    assert compiler_options(mesh, FORWARDS["none"]) is None


# Platform names as JAX spells them; a comparison against one (or a collection holding one) is
# a platform test, as is asking JAX for its backend or comparing a device's ``.platform``.
PLATFORM_NAMES = {"cpu", "gpu", "tpu", "cuda", "rocm"}


def _names_a_platform(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.lower() in PLATFORM_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_platform(e) for e in node.elts)
    return False


def _device_platform(node: ast.AST) -> bool:
    """``x.platform`` (a device's), not ``sys.platform`` (the operating system's)."""
    return (isinstance(node, ast.Attribute) and node.attr == "platform"
            and not (isinstance(node.value, ast.Name) and node.value.id == "sys"))


def platform_tests(source: str) -> list[tuple[int, str]]:
    """(line, what) for every platform test in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_names_a_platform(o) or _device_platform(o) for o in operands):
                found.append((node.lineno, "compares a platform"))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and _names_a_platform(node):
            found.append((node.lineno, "lists platform names"))
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name == "default_backend":
                found.append((node.lineno, "asks JAX for its backend"))
    return sorted(found)


def test_the_checker_sees_each_kind_of_platform_test():
    source = ('a = jax.default_backend() == "cpu"\n'
              'b = d.platform != x\n'
              'c = p not in ("gpu", "tpu")\n'
              'BACKENDS = ["cuda", "rocm"]\n'
              'ok = sys.platform == "linux" or {"cpu": 1}["cpu"] or p.decode_layout == "out_in"\n')
    assert [line for line, _ in platform_tests(source)] == [1, 1, 2, 3, 3, 4]


def test_no_platform_tests_outside_the_platform_package():
    """Models, quant, rollout, learner, ... read ``PlatformPolicy`` fields; only rlx/platform/
    (the policy, its CPU package) names platforms. The benchmarks may."""
    bad = []
    rlx = os.path.join(ROOT, "rlx")
    for folder, _, files in os.walk(rlx):
        rel = os.path.relpath(folder, rlx).split(os.sep)[0]
        if rel in ("platform", "bench"):
            continue
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                bad += [f"{os.path.relpath(path, ROOT)}:{line}: {what}"
                        for line, what in platform_tests(open(path).read())]
    assert not bad, "platform tests outside rlx/platform/ (read the policy instead):\n" + (
        "\n".join(bad))
