"""One policy per platform: the choices rlx's model, engine and learner code make for the
platform their programs run on, held as a value (``PlatformPolicy``).

The fields are the choices, never the platform's name: which element type a 16-bit decode caches
its keys and values in, the built-in engine's weight layout, when layers are unrolled rather than
scanned, which few-row products multiply packed weights directly, whether 1-byte float stacks
enter a scan as bits, whether the host lays checkpoint tensors out, which attention kernel runs
and from which length, and the train step's compiler options. ``CPU`` holds XLA:CPU's
engineering (short sequences attend densely: on 2 cores the blockwise loop's recomputing backward
costs more than the scores it saves below about 512 tokens); ``TPU`` runs JAX's Pallas splash
kernels for self-attention; ``GPU`` runs the blockwise XLA attention (a Pallas GPU kernel that
takes rlx's segment masks is to come).

The policy is chosen once from the platform: ``policy_of(mesh)`` where code has the mesh (engine
construction, the train step's compile, the scan decision), ``policy_for(platform)`` from a name.
Code deep inside a traced model (a quantized product, the KV cache's dtype) reads ``current()``:
the policy of the innermost ``compiling_for(platform)`` or ``active(policy)`` block, else that of
``jax.default_backend()``. ``compiling_for`` is what an ahead-of-time compile for devices this
host lacks (TPU topologies, ``rlx.plan.aot``) wraps its tracing in, so that the program takes the
target's choices. This module is the one place that reads a platform name.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax
from jax.sharding import Mesh

Options = tuple[tuple[str, str | bool], ...]  # XLA compiler options as (name, value) pairs


@dataclasses.dataclass(frozen=True)
class PlatformPolicy:
    """What rlx chooses for one platform; the defaults are the plain XLA path."""

    # a decode in a 16-bit float compute dtype caches keys/values in f32 (rlx.models.kv_cache)
    wide_kv_cache: bool = False
    # the built-in engine's float projection weights: "out_in" or "in_out" (rollout.jax.decode_layout)
    decode_layout: str = "in_out"
    # scan_layers="auto" unrolls a model of this many parameters or more whose train step keeps
    # its activations (rlx.models.stack.scan_default); None: the layer count alone decides
    unroll_train_from_params: int | None = None
    # the built-in engine's decode unstacks scanned layers for weights up to this many bytes
    # (rlx.rollout.jax.engine.unroll_decode); None: never
    unroll_decode_bytes: int | None = None
    # a decode step's few f32 rows multiply packed weights (int8 channel, GGUF planar, FP4
    # E2M1 blocks) directly: the native kernels (rlx.platform.cpu.kernels) where they build,
    # else chunked reads
    few_row_products: bool = False
    # grouped scales (int4 groups, fp8 tiles) scale a few-row product's partial sums inside it
    grouped_products: bool = False
    # stacks of 1-byte floats enter a scan as their uint8 bits (rlx.models.stack)
    byte_floats_as_bits: bool = False
    # checkpoint tensors are laid out by the host (rlx.platform.cpu.host_layout)
    host_layout: bool = False
    # a frozen quantized expert stack is multiplied one expert's matrix at a time
    # (rlx.models.grouped.grouped_matmul) instead of by ragged_dot
    experts_one_at_a_time: bool = False
    # attention (rlx.kernels.attention.attend): calls over at most this many key slots
    # materialise their scores; longer ones run `attention_kernel` ("blockwise": XLA loops;
    # "splash": JAX's Pallas TPU kernels) in blocks of `attention_block` tokens
    dense_attention_slots: int = 0
    attention_kernel: str = "blockwise"
    attention_block: int = 512
    # a paged KV cache's attention (rlx.kernels.attention.paged) reads this many key slots'
    # pages per block
    paged_attention_block: int = 512
    # the built-in engine's decode slots (rlx.rollout.jax.paged; config.rollout.jax.slots)
    decode_slots: int = 256
    # its decode bursts' row buckets per halving of the slots (rlx.rollout.jax.continuous.
    # slot_buckets): 1 (halves) where a decode step costs about the same at any row count (an
    # accelerator reads the weights whatever the rows), 2 (also three quarters) where rows cost
    # compute (XLA:CPU); each bucket is one more program to compile
    slot_buckets_per_octave: int = 1
    # Pallas kernels run in the interpreter (any backend: tests of a kernel's numerics)
    pallas_interpret: bool = False
    # XLA options of every train step, and those added where the step recomputes activations
    train_options: Options = ()
    remat_train_options: Options = ()

    def compiler_options(self, recompute: bool) -> dict[str, str | bool] | None:
        """The train step's XLA options (None: the compiler's defaults)."""
        options = dict(self.train_options + (self.remat_train_options if recompute else ()))
        return options or None


# With XLA:CPU's default order the recomputed activations of every layer stay alive together
# inside the micro-batch loop, which undoes train.remat='layer'; the memory-optimised scheduler
# restores the saving remat is for. Without remat it lowers the peak little and slows the update,
# so those steps keep the default.
CPU_REMAT_OPTIONS: Options = (("xla_cpu_scheduler_type", "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"),)
# libtpu (0.0.52) fails to compile a bf16 all-reduce that it offloads to TPU7x's SparseCores
# (a full-parameter step's bf16 gradients: "Failed to verify lowered MLO module ...
# 'sc_tpu.vector_store' op Value element type 'f32' does not match base element type 'bf16'");
# the TensorCores reduce them instead
TPU_OPTIONS: Options = (("xla_tpu_enable_sparse_core_collective_offload_all_reduce", False),)

CPU = PlatformPolicy(
    wide_kv_cache=True, decode_layout="out_in", unroll_train_from_params=50_000_000,
    unroll_decode_bytes=1 << 30, few_row_products=True, byte_floats_as_bits=True,
    host_layout=True, experts_one_at_a_time=True, remat_train_options=CPU_REMAT_OPTIONS,
    dense_attention_slots=512, attention_block=64, paged_attention_block=32,
    decode_slots=64, slot_buckets_per_octave=2)
GPU = PlatformPolicy(grouped_products=True)
TPU = PlatformPolicy(grouped_products=True, train_options=TPU_OPTIONS, attention_kernel="splash")
POLICIES = {"cpu": CPU, "gpu": GPU, "cuda": GPU, "rocm": GPU, "tpu": TPU}


def policy_for(platform: str) -> PlatformPolicy:
    """The policy of ``platform`` (a JAX platform name); another platform gets the plain one."""
    return POLICIES.get(platform, PlatformPolicy())


def policy_of(mesh: Mesh) -> PlatformPolicy:
    """The policy of the platform ``mesh``'s devices run on."""
    return policy_for(mesh.devices.flat[0].platform)


_ACTIVE: contextvars.ContextVar[PlatformPolicy | None] = contextvars.ContextVar(
    "rlx_platform_policy", default=None)


def current() -> PlatformPolicy:
    """The policy of the code being traced: that of the innermost ``compiling_for`` / ``active``
    block, else that of ``jax.default_backend()``."""
    return _ACTIVE.get() or policy_for(jax.default_backend())


@contextlib.contextmanager
def active(policy: PlatformPolicy) -> Iterator[PlatformPolicy]:
    """Within this block ``current()`` is ``policy``."""
    token = _ACTIVE.set(policy)
    try:
        yield policy
    finally:
        _ACTIVE.reset(token)


def compiling_for(platform: str) -> contextlib.AbstractContextManager[PlatformPolicy]:
    """Within this block ``current()`` is ``platform``'s policy (e.g. ``"tpu"``)."""
    return active(policy_for(platform))


__all__ = ["PlatformPolicy", "CPU", "GPU", "TPU", "POLICIES", "TPU_OPTIONS", "policy_for",
           "policy_of", "current", "active", "compiling_for"]
