"""Native few-row products over packed weights on XLA:CPU, through XLA's FFI.

XLA:CPU emits no kernel that multiplies packed weights: it decodes them into float tiles before
its product. ``kernels.cc`` (shipped beside this module) multiplies a decode step's few f32
rows by GGUF Q8_0 / Q4_0 / Q4_1 planar rows (``rlx.quant.formats.gguf.blocks``), by int8
channel-scale ``QTensor`` values (a kernel, or an int8 embedding's stored ``[d, vocab]`` as the
tied head) and by E2M1 ``QTensor`` kernels (FP4: MXFP4, NVFP4, one scale byte per block of
inputs) directly, decoding each block into registers with AVX2 / FMA / F16C (AVX-512 where the
CPU has it) and splitting the output columns over XLA's intra-op threads.

Numerical contract: activations stay f32 and every sum is an f32 sum; the weights enter as the
values ``dequantize`` gives (for one row of x, a GGUF block's scale multiplies the block's partial
sum instead: ``d (q . x) + m sum(x)``), so the products differ from ``x @ dequantize(W)`` by f32
summation rounding only (``tests/platform/test_cpu_kernels.py`` checks the worst-case bound).
Activations are not quantized to int8 blocks as llama.cpp does: that changes log-probs far beyond
the 1e-5 engine-vs-learner parity rlx keeps.

The library is built at first use with the system C++ compiler (``$CXX``, else ``c++`` / ``g++``
/ ``clang++``) into ``~/.cache/rlx/kernels/<key>/`` (``$RLX_CACHE`` replaces ``~/.cache/rlx``),
``key`` hashing the source, the compiler's version, the flags and the CPU's flags, since it is
compiled with ``-march=native``; concurrent processes serialize on a lock file and publish the
library with an atomic rename. Where there is no compiler, the CPU lacks AVX2 / FMA / F16C or the
build fails, ``available()`` warns once naming the reason and returns False, and the callers keep
XLA's products (never different numerics silently). ``RLX_CPU_KERNELS=0`` turns the kernels off
(XLA's products), e.g. to compare the two.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

SOURCE = Path(__file__).with_name("kernels.cc")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
GGUF_TARGETS = {"Q8_0": "rlx_gguf_q8_0", "Q4_0": "rlx_gguf_q4_0", "Q4_1": "rlx_gguf_q4_1"}
INT8_CHANNEL = "rlx_int8_channel"
FP4 = "rlx_fp4"
NEEDED_CPU_FLAGS = ("avx2", "fma", "f16c")


def _cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    return set(line.partition(":")[2].split())


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cache_dir() -> Path:
    return Path(os.environ.get("RLX_CACHE", Path.home() / ".cache" / "rlx")) / "kernels"


def build(cxx: str, cache: Path) -> Path:
    """The library compiled from ``SOURCE`` by ``cxx`` under ``cache/<key>/``, built once per key
    (source, compiler version, flags, CPU flags); raises RuntimeError with the compiler's
    message if it fails."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    include = ("-isystem", jax.ffi.include_dir())
    key = hashlib.sha256("\0".join([SOURCE.read_text(), version, *FLAGS, *include,
                                    " ".join(sorted(_cpu_flags()))]).encode()).hexdigest()[:16]
    folder = Path(cache) / key
    lib = folder / "librlx_cpu_kernels.so"
    if lib.exists():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
        if not lib.exists():
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
            os.close(fd)
            out = subprocess.run([cxx, *FLAGS, *include, str(SOURCE), "-o", tmp],
                                 capture_output=True, text=True)
            if out.returncode:
                os.unlink(tmp)
                raise RuntimeError(f"{cxx} failed: {out.stderr.strip()[-2000:]}")
            os.replace(tmp, lib)
    return lib


def _load() -> None:
    """Build (once per key), load and register the kernels with XLA:CPU."""
    lib = ctypes.cdll.LoadLibrary(str(build(_compiler(), _cache_dir())))
    for name in (*GGUF_TARGETS.values(), INT8_CHANNEL, FP4):
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")


@functools.cache
def unavailable_reason() -> str | None:
    """Why the kernels cannot run here (None: they are built, loaded and registered; the first
    call builds them)."""
    if os.environ.get("RLX_CPU_KERNELS", "1") == "0":
        return "RLX_CPU_KERNELS=0"
    missing = [f for f in NEEDED_CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    if _compiler() is None:
        return "no C++ compiler found (set $CXX or install g++ / clang++)"
    try:
        _load()
    except (OSError, RuntimeError, AttributeError) as e:
        return f"building {SOURCE.name} failed: {e}"
    return None


@functools.cache
def available() -> bool:
    """Whether the kernels run here; warns once naming the reason where they cannot."""
    reason = unavailable_reason()
    if reason and reason != "RLX_CPU_KERNELS=0":
        warnings.warn(f"rlx CPU kernels off ({reason}); decode products keep XLA's packed-read "
                      "path", RuntimeWarning, stacklevel=2)
    return reason is None


def with_reference_gradient(fast: Callable, reference: Callable, x: Array, *weights) -> Array:
    """``fast(x, *weights)``, a native product JAX cannot differentiate, whose vector-Jacobian
    product with respect to ``x`` is ``reference``'s (the same linear map computed by XLA): a
    learner's gradient through a few-row product on CPU. ``weights`` are frozen (zero
    cotangents); ``fast`` and ``reference`` close over no traced value."""

    @jax.custom_vjp
    def run(x, *weights):
        return fast(x, *weights)

    def forward(x, *weights):
        return fast(x, *weights), (x, weights)

    def backward(saved, dy):
        x, weights = saved
        dx, = jax.vjp(lambda v: reference(v, *weights), x)[1](dy)
        return (dx, *(jnp.zeros_like(w) if jnp.issubdtype(w.dtype, jnp.inexact)
                      else np.zeros(w.shape, jax.dtypes.float0) for w in weights))

    run.defvjp(forward, backward)
    return run(x, *weights)


def gguf_product(planar: Array, qtype: str, x: Array) -> Array:
    """``x @ W.T`` (f32 ``[R, K]`` -> ``[R, N]``) for planar GGUF rows ``[N, nb * bytes]``."""
    out = jax.ShapeDtypeStruct((x.shape[0], planar.shape[0]), jnp.float32)
    call = jax.ffi.ffi_call(GGUF_TARGETS[qtype], out, vmap_method="sequential")
    return call(x.astype(jnp.float32), planar)


def int8_channel_product(values: Array, scale: Array, x: Array) -> Array:
    """``(x @ values) * scale`` (f32 ``[R, K]`` -> ``[R, N]``) for int8 ``values [K, N]`` and
    one scale per output column (``[1, N]`` or ``[N]``)."""
    out = jax.ShapeDtypeStruct((x.shape[0], values.shape[1]), jnp.float32)
    s = scale.reshape(-1).astype(jnp.float32)
    call = jax.ffi.ffi_call(INT8_CHANNEL, out, vmap_method="sequential")
    return call(x.astype(jnp.float32), values, s)


def fp4_product(values: Array, scale_bytes: Array, table: Array, x: Array) -> Array:
    """``x @ W`` (f32 ``[R, K]`` -> ``[R, N]``) for E2M1 codes ``values [K/2, N]`` (row ``2i``
    in the low nibble), scale bytes ``[K/B, N]`` (uint8: E8M0 exponents, e4m3 bits) and
    ``table [256]``: the f32 scale each byte stands for, as the dequantization applies it
    (``W[k, n] = e2m1(code) * table[scale_bytes[k // B, n]]``)."""
    out = jax.ShapeDtypeStruct((x.shape[0], values.shape[1]), jnp.float32)
    call = jax.ffi.ffi_call(FP4, out, vmap_method="sequential")
    return call(x.astype(jnp.float32), values, scale_bytes, table.reshape(-1).astype(jnp.float32))
