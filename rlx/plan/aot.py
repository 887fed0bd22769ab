"""XLA:TPU's own memory figures beside the plan: ``python -m rlx.plan --config
configs/X.py[:VARIANT] [--config.FIELD=VALUE ...] --aot TOPOLOGY [--mesh ...] [--mode full|lora]
[--layers N] [--steps train,sample]``.

Compiles, on any host (libtpu from PyPI, no TPU attached), rlx's real train step
(``rlx.learner.step.make_train_step``, via ``rlx.plan.memory.compiled_bytes``) and the built-in
engine's generate programs as the config batches (``config.rollout.jax.batching``): continuous,
the decode burst and prefill chunk over each data shard's page pools
(``rlx.plan.aot_sample.paged_lowered``); lockstep, the generate step
(``rlx.rollout.jax.sampling.generate_batch``: prefill and the decode loops over the KV cache),
each jitted with the engine's shardings, for a TPU topology
(``jax.experimental.topologies``; e.g. ``tpu7x:2x2x2``), on abstract inputs: the model is built
with ``nnx.eval_shape`` (quantized base leaves as ``QTensor`` shapes, LoRA adapters, optax
state), so a 1T-parameter model costs no host memory. Prints XLA's ``memory_analysis()`` per
device beside the planner's figures for the same spec. XLA:TPU refuses, at compile time, a
program whose buffers exceed a device's HBM; that refusal (with the bytes it needed) is the
verdict "does not fit".

Devices: a TPU7x (Ironwood) chip has two TensorCores, each its own JAX device with half of the
chip's 192 GiB HBM (``DEVICE_HBM_GIB``); XLA:TPU itself allows 94.74 GiB of a core's 96 GiB.
A config whose mesh has fewer devices than the topology is scaled to it (``scale_to``): the
expert axis first (where the experts divide), else FSDP; micro-batches keep the rows each
device sees per piece.

The train step's transient memory on TPU has its own calibration (``TPU_COEFFS``, fitted to
XLA:TPU's own figures by ``calibrate``), and so has the generate step's
(``rlx.plan.aot_sample.SAMPLE_TPU_COEFFS``, fitted by ``calibrate_sample``);
``rlx.plan.memory.COEFFS`` and ``step_bytes``' sampling figures stay the XLA:CPU ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
from typing import Any

from rlx.errors import ConfigError
from rlx.learner.state import MODES
from rlx.mesh import batch_shards, make_mesh
from rlx.plan.aot_sample import (SAMPLE_CALIBRATION, SAMPLE_WHOLE_MODEL_POINTS, fit_sample_coeffs,
                                 generate_lowered, local_expert_bytes, paged_lowered,
                                 sample_temp)
from rlx.plan.memory import (STEP_NOT_ACTIVATIONS, compiled_bytes, state_bytes,
                             step_features)
from rlx.plan.planner import (CONFIG_HELP, GB, Plan, command_line, format_plan, parse_mesh, plan,
                              spec_from_config)
from rlx.plan.spec import PlanSpec
from rlx.platform.policy import compiling_for

GIB = 2 ** 30
# HBM per chip (GiB) by TPU generation, from Google Cloud's TPU pages (TPU7x: "HBM capacity per
# chip 192 GiB", two TensorCores per chip; v5p 95; v6e 32; v5e 16; v4 32). A device is a chip,
# or a TensorCore where the topology lists several per chip (TPU7x: 2).
CHIP_HBM_GIB = {"tpu7x": 192, "v5p": 95, "v6e": 32, "v5e": 16, "v5litepod": 16, "v4": 32}
# The train step's transient memory on XLA:TPU per feature of ``tpu_features`` (the XLA:CPU
# table is rlx.plan.memory.COEFFS), fitted by ``calibrate`` on the 16 one-device programs of
# ``calibration_specs`` (one TPU7x TensorCore) and the three whole-model train programs of
# ``WHOLE_MODEL_POINTS``. Residuals of the transient bytes: Kimi-K2 mode B -1.5%, mode A on 16
# nodes -3.7%, Qwen3-235B-A22B +1.4%; the one-device programs -78% to +109% (their 14-274 MB
# are mostly what the features do not count: tile padding, fixed buffers).
TPU_COEFFS = {"resid": 0.0, "qkv": 0.0, "scores": 0.656, "mlp": 0.0, "moe_d": 11.094,
              "moe_f": 0.0, "router": 0.0, "logits": 0.0, "grads": 2.566, "embed": 0.0,
              "lora": 7.493, "ckpt": 1.035, "experts": 2.54,
              # context parallelism's gathered keys and values: not fitted (no compiled point
              # has context > 1); the CPU model's coefficient
              "gathered": 2.0,
              # XLA:CPU's FSDP and vocabulary-tile terms (rlx.plan.memory.COEFFS): not fitted
              # here, the TPU points' other terms absorb them
              "fsdp_gather": 0.0, "vocab_grads": 0.0, "head_tile": 0.0}
# The whole-model train programs ``calibrate`` fits besides ``calibration_specs``: the arguments
# of ``python -m rlx.plan`` and XLA:TPU's transient GB per device (the program total less its
# arguments), rlx/plan/README.md's rows
WHOLE_MODEL_POINTS: tuple[tuple[str, float], ...] = (
    ("--config configs/kimi_k2.py --aot tpu7x:2x2x2", 18.265),  # capacity 1.25, the config's
    ("--config configs/kimi_k2.py --aot tpu7x:4x4x8 --mode full --mesh fsdp=16,expert=16 "
     "--rows 1024 --micro-batches 4", 32.718),
    ("--config configs/qwen3_235b_a22b_plan.py --aot tpu7x:2x2x2 --capacity-factor 1.25", 6.975),
)
WHOLE_MODEL_WEIGHT = 10.0  # each whole-model point's weight against one calibration_specs point
# Whole-model train programs held out of the fit: the :long recipes under context parallelism
# (context 4 x expert 4) at 32,768 and 8,192 tokens, XLA:TPU's transient GB per device
HELD_OUT_POINTS: tuple[tuple[str, float], ...] = (
    ("--config configs/kimi_k2.py:long --aot tpu7x:2x2x2", 47.100),
    ("--config configs/deepseek_v3_fp8.py:long --aot tpu7x:2x2x2", 44.717),
    ("--config configs/kimi_k2.py:long --config.rollout.max_new_tokens=6144 --aot tpu7x:2x2x2",
     36.809),
    ("--config configs/deepseek_v3_fp8.py:long --config.rollout.max_new_tokens=6144 "
     "--aot tpu7x:2x2x2", 31.801),
)


@dataclasses.dataclass(frozen=True)
class Topology:
    """A TPU topology's devices, how many of them share a chip, and each one's HBM."""

    name: str
    devices: tuple
    per_chip: int  # devices (TensorCores) per chip

    @property
    def chips(self) -> int:
        return len(self.devices) // self.per_chip

    @property
    def device_hbm_gib(self) -> float:
        gen = self.name.split(":")[0].lower()
        if gen not in CHIP_HBM_GIB:
            raise ValueError(f"no HBM size known for TPU generation {gen!r} "
                             f"(rlx.plan.aot.CHIP_HBM_GIB has {sorted(CHIP_HBM_GIB)})")
        return CHIP_HBM_GIB[gen] / self.per_chip


def topology(name: str) -> Topology:
    """The devices of TPU topology ``name`` (``tpu7x:2x2x2``), compiled for without a TPU."""
    from jax.experimental import topologies

    # libtpu guards a host's TPU chips with a lock file, one process at a time; describing a
    # topology to compile for touches no chip, so several such processes may run at once
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        desc = topologies.get_topology_desc(topology_name=name, platform="tpu")
    except Exception as e:  # noqa: BLE001 - missing plugin or unknown name: say which
        raise ValueError(f"cannot describe TPU topology {name!r} ({type(e).__name__}: {e}); "
                         "compiling for TPU needs the libtpu package (pip install -e .[tpu-aot]); "
                         "names look like tpu7x:2x2x2, v5p:2x2x1, v6e:2x4") from e
    chips = {tuple(d.coords) for d in desc.devices}
    return Topology(name, tuple(desc.devices), len(desc.devices) // len(chips))


def scale_to(spec: PlanSpec, devices: int) -> PlanSpec:
    """``spec`` on ``devices`` devices: the mesh grown along ``expert`` (where the experts still
    divide) or ``fsdp``, micro-batches lowered so each device's rows per piece stay the same."""
    m = spec.mesh
    if m.num_devices == devices:
        return spec
    if devices % m.num_devices:
        raise ValueError(f"the mesh {m} ({m.num_devices} devices) does not divide the "
                         f"topology's {devices} devices; pass --mesh")
    k = devices // m.num_devices
    moe = spec.model.moe
    if m.expert > 1 and moe is not None and moe.num_experts % (m.expert * k) == 0:
        mesh = dataclasses.replace(m, expert=m.expert * k)
    else:
        mesh = dataclasses.replace(m, fsdp=m.fsdp * k)
    per_device = max(1, spec.micro_rows // batch_shards(m))
    micro = max(1, spec.rows // (per_device * batch_shards(mesh)))
    while spec.rows % micro:
        micro -= 1
    return spec.replace(mesh=mesh, micro_batches=micro)


def with_layers(spec: PlanSpec, layers: int) -> PlanSpec:
    """``spec`` with its first ``layers`` decoder layers (the same kinds, in order), scanned or
    unrolled as the whole model is (unrolled, XLA lays out a layer's products differently)."""
    c = spec.model
    if not 1 <= layers <= c.num_layers:
        raise ValueError(f"--layers {layers} must be in [1, {c.num_layers}]")
    moe = c.moe
    if moe is not None:
        moe = dataclasses.replace(moe, sparse_layers=tuple(
            i for i in range(layers) if c.is_sparse_layer(i)))
    return spec.replace(model=dataclasses.replace(c, num_layers=layers, moe=moe),
                        scan_layers="on" if spec.scanned else "off")


@dataclasses.dataclass(frozen=True)
class XlaMemory:
    """One compiled program's ``memory_analysis()`` per device (bytes), or XLA:TPU's refusal."""

    argument: int = 0
    output: int = 0
    alias: int = 0
    temp: int = 0
    seconds: float = 0.0  # compile time
    refused: str = ""  # XLA's out-of-memory message when the program does not fit
    # the bytes that message names: "the total memory required for HLO temporaries (X)", yet X
    # is the program total, arguments included (Kimi-K2 train: 32.5 GiB of temporaries in XLA's
    # buffer assignment + 63.5 GiB of arguments = the 96.0 GiB its refusal named)
    needed: int = 0

    @property
    def total(self) -> int:
        return self.needed if self.refused else (self.argument + self.output - self.alias
                                                 + self.temp)


_OOM = re.compile(r"required for HLO temporaries \(([\d.]+)([GMK])\)")


def measure(compile_fn) -> XlaMemory:
    """Run ``compile_fn()`` (-> a ``memory_analysis()``, or ``compiled_bytes``' dict) for TPU
    (``rlx.platform.compiling_for``: TPU's policy) and time it; XLA:TPU's refusal to exceed HBM becomes a record."""
    start = time.perf_counter()
    try:
        with compiling_for("tpu"):
            stats = compile_fn()
    except Exception as e:  # noqa: BLE001 - only XLA:TPU's compile-time HBM refusal is kept
        text = str(e)
        found = _OOM.search(text)
        if "CompileTimeHbmOom" not in text or found is None:
            raise
        unit = {"G": 2 ** 30, "M": 2 ** 20, "K": 2 ** 10}[found.group(2)]
        return XlaMemory(seconds=time.perf_counter() - start, needed=int(
            float(found.group(1)) * unit), refused=text.splitlines()[0][:300])
    if not isinstance(stats, dict):
        stats = {"argument": stats.argument_size_in_bytes, "output": stats.output_size_in_bytes,
                 "alias": stats.alias_size_in_bytes, "temp": stats.temp_size_in_bytes}
    return XlaMemory(stats["argument"], stats["output"], stats["alias"], stats["temp"],
                     time.perf_counter() - start)


def compile_train(spec: PlanSpec, topo: Topology) -> XlaMemory:
    """XLA:TPU's memory analysis of the real train step of ``spec`` on ``topo``."""
    return measure(lambda: compiled_bytes(spec, topo.devices))


def compile_sample(spec: PlanSpec, topo: Topology) -> XlaMemory:
    """XLA:TPU's memory analysis of the built-in engine's generate step of ``spec`` on ``topo``."""
    return measure(lambda: generate_lowered(spec, make_mesh(spec.mesh, list(topo.devices)))
                   .compile().memory_analysis())


def compile_paged(spec: PlanSpec, topo: Topology) -> dict[str, XlaMemory]:
    """XLA:TPU's memory analysis of the continuous engine's decode burst and prefill chunk
    (``rlx.plan.aot_sample.paged_lowered``) of ``spec`` on ``topo``."""
    mesh = make_mesh(spec.mesh, list(topo.devices))
    with compiling_for("tpu"):  # traced with TPU's policy, as measure compiles
        lowered = paged_lowered(spec, mesh)
    return {name: measure(lambda low=low: low.compile().memory_analysis())
            for name, low in lowered.items()}


def format_paged(p: Plan, topo: Topology, paged: dict[str, XlaMemory]) -> str:
    """The continuous engine's programs beside the plan: arguments (the weights and each data
    shard's page pools, donated and returned) and temporaries, per device."""
    b = p.bytes
    state = b["frozen"] + b["trainable"] + b["kv_cache"]
    lines = [f"  {'continuous engine':22s}{'planner':>10s}{'XLA:TPU':>10s}"]
    for name, xla in paged.items():
        lines.append(f"  paged {name} (compiled in {xla.seconds:.0f} s)")
        if xla.refused:
            lines.append(f"    refused: {xla.refused}")
        lines.append(_row("arguments (+ pages)", state, None if xla.refused else xla.argument))
        lines.append(_row("temporaries", None, None if xla.refused else xla.temp))
        lines.append(_row("outputs - aliased", None, None if xla.refused else
                          xla.output - xla.alias))
        lines.append(_row("program total", None, xla.total,
                          "needed, > HBM" if xla.refused else
                          f"of {topo.device_hbm_gib * GIB / GB:.1f} GB HBM"))
    return "\n".join(lines)


def gathered_rows(spec: PlanSpec) -> int:
    """How many devices' rows each device's activations hold on TPU: with routed experts split
    over the ``expert`` axis and the einsum path (``moe_impl="dense"``), XLA's sharding
    propagation gives every device the whole micro-batch (the expert-sharded weights meet
    tokens split over that same axis); otherwise 1 (token dispatch keeps each device's own
    tokens; its exchange buffers are ``rlx.plan.memory.moe_slots``)."""
    moe = spec.model.moe is not None and spec.moe_impl == "dense" and spec.mesh.expert > 1
    return spec.batch_shards if moe else 1


def tpu_features(spec: PlanSpec, trainable: int) -> dict[str, float]:
    """``rlx.plan.memory.step_features`` as XLA:TPU lays the step out (the activation features
    times ``gathered_rows``), and ``experts``: ``local_expert_bytes``."""
    g = gathered_rows(spec)
    f = {k: v if k in ("grads", "logits") else g * v
         for k, v in step_features(spec, trainable).items()}
    return {**f, "experts": float(local_expert_bytes(spec))}


def tpu_plan(spec: PlanSpec, topo: Topology) -> Plan:
    """The planner's figures for ``spec`` on ``topo``: exact state, the train step's transient
    memory from ``TPU_COEFFS`` (activations of ``gathered_rows``), the generate step's
    temporaries from ``rlx.plan.aot_sample.SAMPLE_TPU_COEFFS`` (``kv_cache`` exact, the rest
    ``decode_temp``), each device's HBM."""
    p = plan(spec, topo.device_hbm_gib * GIB / GB)
    part = {k: TPU_COEFFS[k] * v for k, v in tpu_features(spec, p.bytes["trainable"]).items()}
    acts = sum(v for k, v in part.items() if k not in STEP_NOT_ACTIVATIONS)
    decode = max(0, sample_temp(spec) - p.bytes["kv_cache"])
    return dataclasses.replace(p, bytes={**p.bytes, "grads": int(part["grads"]),
                                         "activations": int(acts), "fsdp_gather": 0,
                                         "logprob_chunks": int(part["logits"]),
                                         "decode_temp": decode})


def _row(name: str, planned: float | None, xla: XlaMemory | int | None, note: str = "") -> str:
    cell = lambda x: f"{x / GB:10.3f}" if x is not None else f"{'-':>10s}"  # noqa: E731
    return f"  {name:22s}{cell(planned)}{cell(xla)}  {note}"


def format_aot(p: Plan, topo: Topology, train: XlaMemory | None, sample: XlaMemory | None) -> str:
    """The plan's categories beside XLA:TPU's per-device figures for both programs."""
    b = p.bytes
    lines = [f"XLA:TPU    {topo.name}: {len(topo.devices)} devices = {topo.chips} chips x "
             f"{topo.per_chip}, {topo.device_hbm_gib:g} GiB HBM per device "
             f"({topo.device_hbm_gib * topo.per_chip:g} GiB per chip)",
             f"  {'per device (GB)':22s}{'planner':>10s}{'XLA:TPU':>10s}"]
    for name, xla in (("train step", train), ("sample step (lockstep)", sample)):
        if xla is None:
            continue
        lines.append(f"  {name} (compiled in {xla.seconds:.0f} s)")
        if xla.refused:
            lines.append(f"    refused: {xla.refused}")
        state = b["frozen"] + b["trainable"] + (b["optimizer"] + b["batch"] if name[0] == "t"
                                                  else 0)
        temp = (b["grads"] + b["activations"] + b["logprob_chunks"] if name[0] == "t"
                else b["kv_cache"] + b["decode_temp"])
        lines.append(_row("arguments (state)", state, None if xla.refused else xla.argument))
        lines.append(_row("temporaries", temp, None if xla.refused else xla.temp))
        lines.append(_row("outputs - aliased", None, None if xla.refused else
                          xla.output - xla.alias))
        lines.append(_row("program total", state + temp, xla.total,
                          "needed, > HBM" if xla.refused else ""))
    return "\n".join(lines)


def _args(argv) -> tuple[Any, argparse.Namespace]:
    """The config (``rlx.plan.planner.command_line``: as ``rlx.launch`` reads it, overrides
    included) and the options."""
    p = argparse.ArgumentParser(prog="python -m rlx.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", metavar="configs/X.py[:VARIANT]", help=CONFIG_HELP)
    p.add_argument("--aot", required=True, help="TPU topology, e.g. tpu7x:2x2x2 (8 chips)")
    p.add_argument("--mesh", default="", help="the mesh over the topology's devices, e.g. "
                   "expert=16 (default: the config's, scaled to the topology)")
    p.add_argument("--mode", choices=tuple(MODES), default=None, help="override the mode")
    p.add_argument("--layers", type=int, default=0, help="compile only the first N decoder "
                   "layers (0: all)")
    p.add_argument("--rows", type=int, default=0, help="sequences per update (0: the config's)")
    p.add_argument("--micro-batches", type=int, default=0, help="0: the config's, scaled")
    p.add_argument("--capacity-factor", type=float, default=None, help="override "
                   "model.moe_capacity_factor (0: dropless)")
    p.add_argument("--rollout-rows", type=int, default=0, help="sequences the engine decodes "
                   "at once (0: the config's)")
    p.add_argument("--rollout-len", type=int, default=0, help="the engine's prompt + "
                   "completion slots per sequence (0: the config's)")
    p.add_argument("--steps", default="train,sample", help="programs to compile: train, "
                   "sample (the engine's generate programs as config.rollout.jax.batching "
                   "batches: continuous, the decode burst and prefill chunk over page pools; "
                   "lockstep, the generate step)")
    return command_line(argv, p)


def spec_for(cfg: Any, args: argparse.Namespace, topo: Topology) -> PlanSpec:
    """The spec ``main`` compiles: the config's (``--mode``, ``--capacity-factor``), on
    ``--mesh`` or the config's mesh scaled to ``topo``, its first ``--layers`` layers, ``--rows``,
    ``--micro-batches``, ``--rollout-rows`` and ``--rollout-len``."""
    spec = spec_from_config(cfg)
    if args.mode:
        spec = spec.replace(mode=args.mode)
    if args.capacity_factor is not None:
        spec = spec.replace(moe_capacity_factor=args.capacity_factor)
    spec = (spec.replace(mesh=parse_mesh(args.mesh)) if args.mesh
            else scale_to(spec, len(topo.devices)))
    if args.layers:
        spec = with_layers(spec, args.layers)
    if args.rows or args.micro_batches:
        spec = spec.replace(rows=args.rows or spec.rows,
                            micro_batches=args.micro_batches or spec.micro_batches)
    length = args.rollout_len or spec.rollout_len
    return spec.replace(rollout_rows=args.rollout_rows or spec.rollout_rows, rollout_len=length,
                        rollout_prompt=spec.rollout_prompt if spec.rollout_prompt < length else 0)


def main(argv=None) -> int:
    """Plan, compile for the topology, print both; exit 0 when every program fits."""
    try:
        cfg, args = _args(argv)
    except ConfigError as e:
        print(f"rlx.plan: config error: {e}", file=sys.stderr)
        return 2
    try:
        topo = topology(args.aot)
        spec = spec_for(cfg, args, topo)
    except (ValueError, TypeError) as e:
        print(f"rlx.plan: {e}", file=sys.stderr)
        return 2
    steps = set(args.steps.split(","))
    if steps - {"train", "sample", "none"}:
        print(f"rlx.plan: --steps {args.steps}: each of train, sample (or none)", file=sys.stderr)
        return 2
    train = compile_train(spec, topo) if "train" in steps else None
    sampled = "sample" in steps
    sample = compile_sample(spec, topo) if sampled and not spec.continuous else None
    paged = compile_paged(spec, topo) if sampled and spec.continuous else {}
    p = tpu_plan(spec, topo)
    print(format_plan(p, None, topo.chips * topo.per_chip))
    print(format_aot(p, topo, train, sample))
    if paged:
        print(format_paged(p, topo, paged))
    return 0 if all(x is None or not x.refused
                    for x in (train, sample, *paged.values())) else 1


def calibration_specs() -> list[PlanSpec]:
    """The one-device programs ``TPU_COEFFS`` is fitted on (with ``WHOLE_MODEL_POINTS``): bf16
    compute, dense and MoE (grouped experts, ``moe_impl="ragged"``), both modes, remat none and
    per layer; shapes other than the tests'."""
    from rlx.models import ModelConfig, MoEConfig
    from rlx.quant import LoraConfig, QuantConfig
    out = []
    for i, (width, layers, seq, rows) in enumerate(
            [(256, 2, 256, 4), (384, 3, 512, 4), (256, 3, 512, 8), (512, 2, 256, 8)]):
        dense = ModelConfig(architecture="LlamaForCausalLM", vocab_size=4096 * (1 + i % 2),
                            hidden_size=width, intermediate_size=3 * width, num_layers=layers,
                            num_heads=width // 64, num_kv_heads=2, head_dim=64)
        moe = dataclasses.replace(dense, architecture="Qwen3MoeForCausalLM", moe=MoEConfig(
            8 * (1 + i % 2), 2, width, True, sparse_layers=tuple(range(1, layers))))
        for model in (dense, moe):
            for mode, remat in (("full", "none"), ("lora", "layer")) if i % 2 else (
                    ("lora", "none"), ("full", "layer")):
                out.append(PlanSpec(model=model, mode=mode, remat=remat, rows=rows,
                                    seq_len=seq, logprob_chunk=seq, moe_impl="ragged",
                                    quant=QuantConfig("int8" if i % 2 else "int4",
                                                      group_size=64),
                                    lora=LoraConfig(rank=8)))
    return out


def calibration_points(topology_name: str = "tpu7x:2x2x1") -> list[tuple[PlanSpec, int]]:
    """(spec, XLA:TPU's transient bytes: everything but the arguments) of each of
    ``calibration_specs``, compiled for one device of the topology."""
    topo = topology(topology_name)
    one = Topology(topo.name, topo.devices[:1], 1)
    out = []
    for spec in calibration_specs():
        xla = compile_train(spec, one)
        out.append((spec, xla.total - xla.argument))
    return out


def whole_model_points() -> list[tuple[PlanSpec, int]]:
    """(spec, XLA:TPU's transient bytes) of the whole-model train programs of
    ``WHOLE_MODEL_POINTS``; a refused program's transient is its named total less the state."""
    return [(spec_from_argv(argv)[0], int(gb * GB)) for argv, gb in WHOLE_MODEL_POINTS]


def spec_from_argv(argv: str) -> tuple[PlanSpec, Topology]:
    """The spec and topology that ``python -m rlx.plan ARGV`` (``--config ... --aot ...``)
    compiles."""
    cfg, args = _args(argv.split())
    topo = topology(args.aot)
    return spec_for(cfg, args, topo), topo


def fit_coeffs(points: list[tuple[PlanSpec, int, float]]) -> dict[str, float]:
    """``TPU_COEFFS`` fitted to (spec, XLA:TPU's transient bytes, weight) points: non-negative
    least squares on the weighted relative error of the planned transient bytes."""
    import numpy as np
    from scipy.optimize import nnls
    keys, rows = sorted(TPU_COEFFS), []
    for spec, target, weight in points:
        f = tpu_features(spec, state_bytes(spec)["trainable"])
        rows.append([weight * f[k] / target for k in keys])
    coeffs, _ = nnls(np.asarray(rows), np.asarray([w for *_, w in points]))
    return dict(zip(keys, (round(float(c), 3) for c in coeffs)))


def planned_transient(spec: PlanSpec, coeffs: dict[str, float]) -> float:
    """The train step's planned transient bytes of ``spec`` under ``coeffs``."""
    f = tpu_features(spec, state_bytes(spec)["trainable"])
    return sum(coeffs[k] * v for k, v in f.items())


def calibrate(topology_name: str = "tpu7x:2x2x1",
              whole_weight: float = WHOLE_MODEL_WEIGHT) -> dict[str, float]:
    """Fit ``TPU_COEFFS`` on ``calibration_points`` (compiled now) and ``whole_model_points``
    (weighted ``whole_weight``); prints each point's residual."""
    points = [(s, t, 1.0) for s, t in calibration_points(topology_name)]
    points += [(s, t, whole_weight) for s, t in whole_model_points()]
    coeffs = fit_coeffs(points)
    for spec, target, _ in points:
        print(f"{spec.model.architecture:22s} {spec.model.num_layers:3d} layers {spec.mode:4s} "
              f"{spec.mesh.num_devices:4d} devices: XLA:TPU {target / GB:9.3f} GB, plan "
              f"{planned_transient(spec, coeffs) / target - 1:+.1%}", flush=True)
    return coeffs


def calibrate_sample(whole_weight: float = WHOLE_MODEL_WEIGHT) -> dict[str, float]:
    """Fit ``rlx.plan.aot_sample.SAMPLE_TPU_COEFFS`` to XLA:TPU's generate-step temporaries:
    the ``SAMPLE_CALIBRATION`` programs (compiled now) and ``SAMPLE_WHOLE_MODEL_POINTS``
    (weighted ``whole_weight``); prints each point's residual."""
    points = []
    for argv in SAMPLE_CALIBRATION:
        spec, topo = spec_from_argv(argv)
        points.append((argv, spec, compile_sample(spec, topo).temp, 1.0))
    points += [(argv, spec_from_argv(argv)[0], int(gb * GB), whole_weight)
               for argv, gb in SAMPLE_WHOLE_MODEL_POINTS]
    coeffs = fit_sample_coeffs([(s, t, w) for _, s, t, w in points])
    for argv, spec, target, _ in points:
        print(f"{argv}: XLA:TPU {target / GB:8.3f} GB, plan "
              f"{sample_temp(spec, coeffs) / target - 1:+.1%}", flush=True)
    return coeffs
