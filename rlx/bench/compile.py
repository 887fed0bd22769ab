"""Compile time of the train step: few vs many layers of the same width, scanned and unrolled.

For each layer count and each way of running the layers (``unrolled``: a Python loop, one copy
of the layer per layer in the program; ``scanned``: ``rlx.models.stack``, one ``lax.scan`` body
per stack), the real GRPO train step (``rlx.learner.step.make_train_step``, every parameter
trained with AdamW, per-layer remat as ``config.train.remat`` sets it) is traced and lowered
(``lower``) and then compiled by XLA (``compile``); the columns are the seconds of each and
the HLO size of the lowered program (``--run N``: also the median seconds of N steps). One
measurement per cell, each in a fresh trace (no cache holds a program across cells: the models
differ in depth or in form).

The architecture is a preset's (``--preset``, default Qwen2.5-1.5B's) shrunk to ``--hidden``
wide (``rlx.models.loading.shrunk``) with a ``--vocab`` vocabulary; a preset with MoE layers
after dense ones (DeepSeek-V3, Kimi-K2) gives two stacks when scanned. The batch is ``--batch``
rows of ``--seq`` tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import time


def _model(args, layers: int, scanned: bool):
    from flax import nnx

    from rlx.models.config import from_hf_config
    from rlx.models.decoder import Transformer
    from rlx.models.loading import ShrinkSection, shrunk
    from rlx.models.presets import preset_config
    from rlx.models.stack import stack_layers

    section = ShrinkSection(enabled=True, num_layers=layers, hidden_size=args.hidden,
                            intermediate_size=2 * args.hidden, num_heads=args.heads,
                            num_kv_heads=max(1, args.heads // 2),
                            head_dim=args.hidden // args.heads,
                            num_experts=8, moe_intermediate_size=args.hidden // 2)
    cfg = shrunk(from_hf_config(preset_config(args.preset)), section)
    cfg = dataclasses.replace(cfg, vocab_size=args.vocab)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    return stack_layers(model) if scanned else model


def _batch(args, vocab: int):
    import numpy as np

    from rlx.types import TrainBatch

    b, t = args.batch, args.seq
    ids = np.random.RandomState(0).randint(0, vocab, (b, t)).astype(np.int32)
    ones = np.ones((b, t), np.int32)
    zeros = np.zeros((b, t), np.float32)
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    return TrainBatch(input_ids=ids, positions=positions,
                      segment_ids=ones, loss_mask=ones.astype(np.float32), advantages=zeros + 1.0,
                      sampler_logp=zeros)


def measure(args, layers: int, scanned: bool) -> dict:
    """Seconds to lower and to compile the train step, and the lowered program's size."""
    import jax

    from rlx.learner.state import OptimizerConfig, create_train_state, make_optimizer
    from rlx.learner.step import FORWARDS, StepConfig, make_train_step
    from rlx.mesh import MeshShape, make_mesh

    mesh = make_mesh(MeshShape(), jax.devices()[:1])
    model = _model(args, layers, scanned)
    optim = OptimizerConfig(learning_rate=1e-5)
    graphdef, state = create_train_state(model, make_optimizer(optim), mesh)
    step = make_train_step(graphdef, state, mesh, StepConfig(), optim,
                           apply_fn=FORWARDS[args.remat])
    batch = _batch(args, model.config.vocab_size)
    start = time.perf_counter()
    lowered = step.lower(state, batch)
    lowered_s = time.perf_counter() - start
    hlo_chars = len(lowered.as_text())
    start = time.perf_counter()
    lowered.compile()
    out = {"lower_s": lowered_s, "compile_s": time.perf_counter() - start, "hlo_chars": hlo_chars}
    return out | ({"step_s": _step_seconds(step, state, batch, mesh, args.run)} if args.run else {})


def _step_seconds(step, state, batch, mesh, runs: int) -> float:
    """Median seconds of ``runs`` train steps after a first (compiling) one."""
    import statistics

    import jax

    from rlx.learner.batching import shard_batch

    batch = shard_batch(batch, mesh)
    state, _ = step(state, batch)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        state, _ = step(state, batch)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m rlx.bench compile",
                                description=__doc__.split("\n")[0])
    p.add_argument("--layers", default="4,32", help="comma-separated layer counts")
    p.add_argument("--preset", default="Qwen/Qwen2.5-1.5B-Instruct", help="rlx.models.presets name")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary (the preset's is replaced)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--remat", default="layer", help="config.train.remat")
    p.add_argument("--run", type=int, default=0, help="also time this many steps (median)")
    args = p.parse_args(argv)
    counts = [int(n) for n in args.layers.split(",")]
    rows = {}
    print(f"{'layers':>6} {'form':>9} {'lower s':>8} {'compile s':>9} {'total s':>8} "
          f"{'HLO chars':>10}"
          + (f" {'step s':>7}" if args.run else ""))
    for scanned in (False, True):
        for n in counts:
            r = rows[(n, scanned)] = measure(args, n, scanned)
            form = "scanned" if scanned else "unrolled"
            step = f" {r['step_s']:>7.2f}" if "step_s" in r else ""
            print(f"{n:>6} {form:>9} {r['lower_s']:>8.2f} {r['compile_s']:>9.2f} "
                  f"{r['lower_s'] + r['compile_s']:>8.2f} {r['hlo_chars']:>10}{step}", flush=True)
    lo, hi = min(counts), max(counts)
    for scanned in (False, True):
        a, b = rows[(lo, scanned)], rows[(hi, scanned)]
        ratio = (b["lower_s"] + b["compile_s"]) / (a["lower_s"] + a["compile_s"])
        print(f"{'scanned' if scanned else 'unrolled'}: {hi} layers / {lo} layers = {ratio:.2f}x")
    return 0
