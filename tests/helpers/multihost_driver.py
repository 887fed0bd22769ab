"""A few learner steps of a tiny model on a mesh over every process's devices.

Run as ``python -m tests.helpers.multihost_driver --out result.npz --num-processes P --process-id I
--coordinator HOST:PORT --local-devices D`` once per process (P = 1 runs alone on D devices).
Every process builds only its own rows of each batch; then the built-in engine samples from the
trained arrays on the same mesh, in every process alike. Process 0 writes the losses, the final
trainable params and the engine's tokens and log-probs to ``--out``. ``tests/run/test_multihost.py`` compares 2 x 4 against 1 x 8.
"""

from __future__ import annotations

import argparse

import numpy as np

from tests.helpers.multiprocess import add_process_args, start_devices

MESH = dict(data=2, fsdp=2, tensor=2, expert=1)
ROWS, STEPS = 16, 3


def _parse(argv=None) -> argparse.Namespace:
    p = add_process_args(argparse.ArgumentParser(description=__doc__))
    p.add_argument("--mode", choices=("full", "lora"), default="full")
    return p.parse_args(argv)


def _batches(vocab: int, rows_multiple: int):
    """The same global host batches on every process (each keeps only its rows later)."""
    from rlx.learner.batching import pad_rollouts
    from tests.helpers.steps import random_rollouts

    out = []
    for step in range(STEPS):
        rollouts = random_rollouts(ROWS, vocab, seed=10 + step)
        adv = np.random.RandomState(step).normal(size=ROWS).astype(np.float32)
        out.append(pad_rollouts(rollouts, adv, rows_multiple=rows_multiple))
    return out


def run(args: argparse.Namespace) -> dict[str, np.ndarray] | None:
    """Train STEPS steps; on process 0 return losses and flattened params, else None."""
    import jax
    from flax import nnx

    from rlx.learner.state import OptimizerConfig, create_train_state, make_optimizer
    from rlx.learner.step import StepConfig, make_train_step
    from rlx.mesh import MeshShape, make_mesh
    from rlx.run import multihost
    from tests.helpers.steps import TINY, add_qlora, tiny_model

    mesh = make_mesh(MeshShape(**MESH), jax.devices())
    model, trainable = tiny_model(0), nnx.Param
    if args.mode == "lora":
        model, trainable = add_qlora(model), nnx.LoRAParam
    opt_cfg = OptimizerConfig(learning_rate=1e-2, schedule="constant")
    graphdef, state = create_train_state(model, make_optimizer(opt_cfg), mesh, trainable=trainable)
    step = make_train_step(graphdef, state, mesh, StepConfig(micro_batches=2), opt_cfg)
    losses = []
    for batch in _batches(TINY.vocab_size, rows_multiple=8):
        local = multihost.take_local_rows(batch, mesh)  # a real pipeline reads only these rows
        state, metrics = step(state, multihost.global_batch(local, mesh, batch.shape[0]))
        losses.append(np.asarray(metrics.loss.addressable_data(0)))
    params = multihost.to_host(state.params)
    sampled = _sample(nnx.merge(graphdef, state.params, state.frozen), mesh, args.mode)
    if not multihost.is_primary():
        return None
    leaves = jax.tree_util.tree_leaves_with_path(params)
    out = {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}
    out.update(sampled)
    out["losses"] = np.array(losses)
    out["process_count"] = np.array(jax.process_count())
    out["device_count"] = np.array(jax.device_count())
    return out


def _sample(model, mesh, mode: str) -> dict[str, np.ndarray]:
    """The built-in engine on the learner's arrays over the whole mesh (every process runs it
    alike): sampled tokens and their log-probs, and teacher-forced log-probs of a sequence."""
    from flax import nnx

    from rlx.rollout.jax.config import JaxSection
    from rlx.rollout.jax.engine import JaxEngine
    from rlx.types import Prompt, SamplingParams

    # lockstep on one process too: a mesh across processes runs lockstep
    engine = JaxEngine(model, mesh=mesh, settings=JaxSection(batching="lockstep"),
                       shared=nnx.filterlib.Not(nnx.LoRAParam) if mode == "lora" else
                       nnx.filterlib.Nothing())
    prompts = [Prompt(f"p{i}", tuple((3 * i + j) % 16 for j in range(2 + i % 3))) for i in range(6)]
    rollouts = engine.generate(prompts, SamplingParams(max_new_tokens=5, temperature=1.0, n=2,
                                                       seed=7))
    scored = engine.score([([1, 2, 3, 4, 5, 6], 2)])[0]
    engine.close()
    return {"sampled_tokens": np.array([r.completion_ids for r in rollouts]),
            "sampled_logps": np.array([r.sampler_logp for r in rollouts]),
            "scored_logps": np.asarray(scored)}


def main(argv=None) -> None:
    args = _parse(argv)
    start_devices(args, distributed=True)
    result = run(args)
    if result is not None:
        np.savez(args.out, **result)


if __name__ == "__main__":
    main()
