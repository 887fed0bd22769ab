"""rlx.platform.compiled and rlx.learner.compiled: freed heap pages go back to the OS; steps compiled once per
argument signature; an update donates its state but not the frozen base."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.learner.compiled import UpdatePerShape
from rlx.platform.compiled import CompiledPerShape, release_free_heap


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim")
def test_freed_small_blocks_return_to_the_os():
    """300 MB in 20 KB blocks (below glibc's mmap threshold, so they live in the heap), freed with
    a few survivors scattered among them: glibc keeps the pages until they are trimmed."""
    blocks = [bytes(bytearray(20_000)) for _ in range(15_000)]
    survivors = blocks[::1000]  # noqa: F841  pins the heap's top, so no automatic trim
    before = _rss_mb()
    del blocks
    held = _rss_mb()
    assert before - held < 150, "glibc already returned the pages; the test proves nothing"
    assert release_free_heap()
    assert held - _rss_mb() > 200


def test_compiled_per_shape_compiles_once_per_signature_and_donates():
    jitted = jax.jit(lambda s, x: (s + x.sum(), x * 2), donate_argnums=(0,))
    step = CompiledPerShape(jitted)
    state = jnp.zeros(())
    for n in (3, 3, 5, 3):
        out_state, y = step(state, np.arange(n, dtype=np.float32))
        assert state.is_deleted()  # donated, as the jit declares
        np.testing.assert_array_equal(y, 2 * np.arange(n))
        state = out_state
    assert float(state) == 3 + 3 + 10 + 3 and step.compilations() == 2
    step.precompile(jnp.zeros(()), np.zeros((7,), np.float32))
    assert step.compilations() == 3
    step(jnp.zeros(()), np.zeros((7,), np.int32))  # another dtype: another program
    assert step.compilations() == 4
    assert "add" in step.lower(jnp.zeros(()), np.zeros((7,), np.float32)).as_text()


def test_an_update_donates_the_state_but_not_its_frozen_part():
    """The frozen part goes in undonated and comes back as the very same arrays (not a copy);
    everything else is donated. A plain jit deletes a donated pass-through and copies an
    undonated one, so neither keeps the caller's frozen arrays alive and single."""
    from flax import struct

    @struct.dataclass
    class State:
        params: jax.Array
        frozen: dict

    def step(state, x):
        return state.replace(params=state.params + x * state.frozen["w"]), x.sum()

    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = State(params=one, frozen={"w": one})  # shaped like the state, as the steps pass
    update = UpdatePerShape(step, in_shardings=(shardings, one), out_shardings=(shardings, one))
    state = State(params=jnp.zeros((3,)), frozen={"w": jnp.arange(3.0)})
    w = state.frozen["w"]
    for _ in range(2):
        new, total = update(state, jnp.ones((3,)))
        assert state.params.is_deleted() and not w.is_deleted()
        assert new.frozen["w"] is w and float(total) == 3
        state = new
    np.testing.assert_array_equal(state.params, 2 * np.arange(3.0))
    assert update.compilations() == 1 and "multiply" in update.lower(state, jnp.ones((3,))).as_text()

    plain = jax.jit(step, donate_argnums=(0,))
    state = State(params=jnp.zeros((3,)), frozen={"w": jnp.arange(3.0)})
    new, _ = plain(state, jnp.ones((3,)))
    assert state.frozen["w"].is_deleted()  # why UpdatePerShape keeps the frozen part apart
