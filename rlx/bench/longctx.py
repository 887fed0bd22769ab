"""Memory and time vs sequence length: one train step and one prefill per length.

For each length (``--lengths``, tokens per row, one row), a fresh process builds a random model
(``--model tiny``: ``configs/tiny.py``'s 2-layer, 64-wide shrunken SmolLM2, its context raised to
the longest length; ``--model smollm2``: SmolLM2-135M's full architecture) in float32 and times
the real GRPO train step (``rlx.learner.step.make_train_step``, every parameter trained with
AdamW, ``--remat``) and a prefill of the whole sequence into a KV cache of as many slots
(``Transformer.decode``, as the built-in engine's prefill), each the median of ``--repeats`` runs
after a compiling one. Columns: seconds and tokens/s of each, XLA's temporary bytes of the
compiled train step, and the process's peak resident memory (everything: weights, compile,
both programs). Attention runs as the platform's policy chooses (``rlx.kernels.attention``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

SMOLLM2 = dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576,
               intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
               tie_word_embeddings=True, max_position_embeddings=8192)
TINY = dict(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
            head_dim=16)  # configs/tiny.py's model.shrink


def _config(model: str, length: int):
    import dataclasses

    from rlx.models.config import from_hf_config
    from rlx.models.loading import ShrinkSection, shrunk

    cfg = from_hf_config(SMOLLM2)
    if model == "tiny":
        cfg = shrunk(cfg, ShrinkSection(enabled=True, **TINY))
    return dataclasses.replace(cfg, max_position_embeddings=max(length, cfg.max_position_embeddings))


def _median_seconds(fn, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn())  # compiles
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _train(model, length: int, args) -> dict:
    import jax
    import numpy as np

    from rlx.learner.batching import shard_batch
    from rlx.learner.state import OptimizerConfig, create_train_state, make_optimizer
    from rlx.learner.step import FORWARDS, StepConfig, make_train_step
    from rlx.mesh import MeshShape, make_mesh
    from rlx.types import TrainBatch

    mesh = make_mesh(MeshShape(), jax.devices()[:1])
    optim = OptimizerConfig(learning_rate=1e-5)
    graphdef, state = create_train_state(model, make_optimizer(optim), mesh)
    step = make_train_step(graphdef, state, mesh, StepConfig(), optim,
                           apply_fn=FORWARDS[args.remat])
    ids = np.random.RandomState(0).randint(0, model.config.vocab_size, (1, length)).astype(np.int32)
    ones = np.ones((1, length), np.int32)
    batch = shard_batch(TrainBatch(
        input_ids=ids, positions=np.arange(length, dtype=np.int32)[None], segment_ids=ones,
        loss_mask=ones.astype(np.float32), advantages=np.ones((1, length), np.float32),
        sampler_logp=np.zeros((1, length), np.float32)), mesh)
    temp = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
    held = [state]  # the step donates its state: each run takes the last one's

    def run():
        held[0], metrics = step(held[0], batch)
        return metrics

    seconds = _median_seconds(run, args.repeats)
    return {"train_s": seconds, "train_temp_mb": temp / 2**20}


def _prefill(model, length: int, args) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from rlx.models.kv_cache import KVCache
    from rlx.models.stack import layer_counts

    graphdef, state = nnx.split(model)
    ids = jnp.asarray(jax.random.randint(jax.random.key(1), (1, length), 0, 1000))
    positions = jnp.arange(length)[None]

    @jax.jit
    def prefill(state, ids):
        m = nnx.merge(graphdef, state)
        cache = KVCache.zeros(m.config, 1, length, jnp.float32, layer_counts(m))
        return m.decode(ids, positions, jnp.ones_like(ids), cache)[0]

    return {"prefill_s": _median_seconds(lambda: prefill(state, ids), args.repeats)}


def one(args, length: int) -> dict:
    """This process's measurement of one length."""
    import resource

    from flax import nnx

    from rlx.models.decoder import Transformer
    from rlx.models.stack import scan_default, stack_layers

    model = Transformer(_config(args.model, length), rngs=nnx.Rngs(0))
    model = stack_layers(model) if scan_default(model.config.num_layers) else model
    out = {"length": length, **_train(model, length, args), **_prefill(model, length, args)}
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m rlx.bench longctx",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    p.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768")
    p.add_argument("--remat", default="layer", help="config.train.remat")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)  # a child's length
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one(args, args.one)))
        return 0
    print(f"{'tokens':>7} {'train s':>8} {'train tok/s':>11} {'prefill s':>9} "
          f"{'prefill tok/s':>13} {'XLA temp MB':>11} {'peak RSS MB':>11}")
    for n in (int(x) for x in args.lengths.split(",")):
        child = [sys.executable, "-m", "rlx.bench", "longctx", "--one", str(n)] + argv
        done = subprocess.run(child, capture_output=True, text=True)
        if done.returncode:
            print(f"{n:>7} failed: {done.stderr.strip().splitlines()[-1:]}", flush=True)
            return 1
        r = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{n:>7} {r['train_s']:>8.2f} {n / r['train_s']:>11.0f} {r['prefill_s']:>9.2f} "
              f"{n / r['prefill_s']:>13.0f} {r['train_temp_mb']:>11.0f} "
              f"{r['peak_rss_mb']:>11.0f}", flush=True)
    return 0
