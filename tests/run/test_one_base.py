"""LoRA mode holds its frozen base once: after ``build`` the live device buffers are the learner's
state (base, adapters, AdamW moments, step counters, rng) and, in an asynchronous run, the
built-in engine's copy of the adapters, nothing else. The engine samples from the learner's very
base arrays, which no update donates (``rlx.learner.compiled.UpdatePerShape``); a synchronous run's
engine also samples from the learner's very adapters, and takes the new ones at each sync. The
engine's KV cache lives inside each generate call: nothing of it is held after build."""

from __future__ import annotations

import jax
import pytest
from flax import nnx

from rlx.run.build import build
from tests.helpers.runs import run_config


def _buffers(arrays, device=None) -> dict[int, int]:
    """Bytes by device buffer (on ``device`` only, if given); a buffer several arrays show (a
    sharded array and its per-device pieces, a key array and its key data) counts once."""
    def data(x):
        return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    return {s.data.unsafe_buffer_pointer(): s.data.nbytes for x in arrays
            for s in data(x).addressable_shards if device is None or s.device == device}


def _held(run) -> tuple[list, list]:
    """The engine's arrays it shares with the learner's frozen state, and its own."""
    frozen = {id(x) for x in jax.tree.leaves(run.compiled.state.frozen)}
    held = jax.tree.leaves(run.engine._state)
    return [x for x in held if id(x) in frozen], [x for x in held if id(x) not in frozen]


@pytest.mark.parametrize("fmt,mesh,staleness", [
    ("int8", {"mesh.data": 8}, 0),
    pytest.param("int8", {"mesh.data": 8}, 1, marks=pytest.mark.slow),
    pytest.param("int4", {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}, 0,
                 marks=pytest.mark.slow),
    # the adapters split over the expert devices (training rules), read as placed
    pytest.param("int8", {"mesh.data": 2, "mesh.expert": 4}, 0, marks=pytest.mark.slow)])
def test_the_built_run_holds_its_base_once(tmp_path, fmt, mesh, staleness):
    before = jax.live_arrays()  # kept alive: no array made by build reuses one of their ids
    run = build(run_config("tiny", tmp_path, **{"quant.format": fmt, "train.steps": 1,
                                                "train.max_staleness": staleness, **mesh}),
                progress=False)
    try:
        old = {id(x) for x in before}
        new = [x for x in jax.live_arrays() if id(x) not in old]
        state = run.compiled.state
        shared, own = _held(run)
        assert len(shared) == len(jax.tree.leaves(state.frozen))  # every base array, as it is
        own_paths = {p for p, v in nnx.to_flat_state(run.engine._state)
                     if not any(v[...] is x for x in shared)}
        assert own_paths == {p for p, _ in nnx.to_flat_state(state.params)}  # the adapters only
        adapters = set(_buffers(jax.tree.leaves(state.params)))
        # synchronous: the learner's very adapters; asynchronous: a copy of them
        assert (set(_buffers(own)) == adapters) == (staleness == 0)
        assert not set(_buffers(own)) & adapters or staleness == 0
        if staleness == 0:
            own = []
        expected = jax.tree.leaves(state) + own
        assert set(_buffers(new)) == set(_buffers(expected))
        first = jax.devices()[0]
        base = sum(_buffers(jax.tree.leaves(state.frozen), first).values())
        total = sum(_buffers(new, first).values())
        # base + adapters + AdamW (+ counters) + the engine's adapters (asynchronous) + step,
        # skipped, rng
        parts = (state.frozen, state.params, state.opt_state, own,
                 [state.step, state.skipped, state.rng])
        assert total == sum(sum(_buffers(jax.tree.leaves(p), first).values()) for p in parts)
        assert base > total / 2  # the base is the bulk, and it is there once

        run.step()  # one update: the base is not donated, the engine still reads it
        run.queue.wait()  # the weight sync queued after the update
        assert not any(x.is_deleted() for x in jax.tree.leaves(run.compiled.state.frozen))
        assert len(_held(run)[0]) == len(shared) and run.engine.weight_version == 1
        assert not any(x.is_deleted() for x in jax.tree.leaves(run.engine._state))
        assert (set(_buffers(_held(run)[1])) == set(_buffers(jax.tree.leaves(
            run.compiled.state.params)))) == (staleness == 0)  # the update's new adapters
    finally:
        run.close()
