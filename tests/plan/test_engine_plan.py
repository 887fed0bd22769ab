"""The planner's weight state equals the device buffers a run really holds: the learner's state
and the built-in engine placed as ``rlx.run.build`` places them (``create_train_state``, then the
engine sharing the frozen part), counted with ``jax.live_arrays()`` on the first device. LoRA mode
holds the base once: the engine's own weights are a copy of the adapters only; full mode's engine
copies every parameter (an engine that copies: an asynchronous run's; a synchronous run's engine
copies nothing, ``tests/run/test_one_base.py``). Also the load transient: the checkpoint's largest tensor."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from rlx.learner.state import MODES, OptimizerConfig, create_train_state, make_optimizer
from rlx.mesh import MeshShape, make_mesh, sampling_rules
from rlx.models import from_hf
from rlx.plan.memory import load_tensor_bytes, state_bytes
from rlx.plan.spec import PlanSpec
from rlx.quant import LoraConfig, QuantConfig, apply_lora, quantize_model
from rlx.rollout.jax.engine import JaxEngine
from tests.helpers.hf_zoo import make_hf_model

QUANT = QuantConfig(format="int4", group_size=8)
LORA = LoraConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zoo"))


def _shards(arrays, device=None) -> dict[int, int]:
    """Bytes of each device buffer of ``arrays`` (on ``device`` only, if given) by its address:
    a buffer that several arrays show (a sharded array and the per-device arrays it was
    assembled from; a key array and its key data) counts once."""
    def data(x):
        return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    return {s.data.unsafe_buffer_pointer(): s.data.nbytes for x in arrays
            for s in data(x).addressable_shards if device is None or s.device == device}


def _on_first_device(arrays) -> int:
    return sum(_shards(arrays, jax.devices()[0]).values())


def _buffers(arrays) -> set[int]:
    return set(_shards(arrays))


def _build(path: str, mode: str, mesh):
    """The learner's state and the engine, as a run builds them; the arrays they created; the
    model's graph."""
    before = jax.live_arrays()  # kept alive: no new array reuses one of their ids
    model = from_hf(path, mesh=mesh)
    if mode == "lora":
        model = apply_lora(quantize_model(model, QUANT), LORA, nnx.Rngs(1))
    graphdef, state = create_train_state(model, make_optimizer(OptimizerConfig()), mesh,
                                         trainable=MODES[mode])
    # the frozen arrays already on their training sharding are not copied (the int4 quantizer
    # leaves its packed values replicated over fsdp: those are resharded)
    loaded = [v[...] for _, v in nnx.to_flat_state(nnx.state(model, nnx.Not(MODES[mode])))]
    placed = [(a, b) for a, b in zip(loaded, jax.tree.leaves(state.frozen))
              if a.sharding.is_equivalent_to(b.sharding, a.ndim)]
    assert len(placed) >= len(loaded) / 2
    assert all(_buffers([a]) == _buffers([b]) for a, b in placed)
    del model, loaded, placed
    engine = JaxEngine(nnx.merge(graphdef, state.params, state.frozen), mesh=mesh,
                       shared=nnx.Not(MODES[mode]), rules=sampling_rules(mode, True))
    old = {id(x) for x in before}
    return state, engine, [x for x in jax.live_arrays() if id(x) not in old], graphdef


@pytest.mark.parametrize("mode", ["lora", "full"])
@pytest.mark.parametrize("shape", [MeshShape(), MeshShape(fsdp=2, tensor=2)], ids=["1", "2x2"])
def test_planned_weight_state_equals_the_live_buffers(zoo, mode, shape):
    path = make_hf_model("llama", zoo)
    mesh = make_mesh(shape, jax.devices()[:shape.num_devices])
    state, engine, new, graphdef = _build(path, mode, mesh)
    held = jax.tree.leaves(engine._state)
    frozen = {id(x) for x in jax.tree.leaves(state.frozen)}
    learner = {id(x) for x in jax.tree.leaves(state)}
    own = [x for x in held if id(x) not in frozen]
    # every frozen array the engine reads is the learner's; its own arrays are new buffers
    assert sum(id(x) in frozen for x in held) == len(frozen)
    assert not any(id(x) in learner for x in own)
    # nothing else was created
    assert _buffers(new) == _buffers(jax.tree.leaves(state)) | _buffers(own)
    assert len(own) == len(jax.tree.leaves(state.params))  # the trainable variables only

    # an engine that copies the trainable variables: an asynchronous run's (train.max_staleness)
    spec = PlanSpec(model=engine._config, mode=mode, quant=QUANT, lora=LORA, dtype="float32",
                    param_dtype="float32", mesh=shape, engine_copies_trainables=True)
    planned = state_bytes(spec)
    # a synchronous run's engine samples from the learner's own arrays: no copy planned, but
    # for the kernels the out_in layout (XLA:CPU's) holds transposed
    synchronous = spec.replace(engine_copies_trainables=False)
    assert state_bytes(synchronous)["engine"] == 0 < planned["engine"]
    sync = JaxEngine(nnx.merge(graphdef, state.params, state.frozen), mesh=mesh,
                     shared=nnx.Not(MODES[mode]), copy_weights=False,
                     rules=sampling_rules(mode, False))
    transposed = [v[...] for p, v in nnx.to_flat_state(sync._state) if tuple(p) in sync._transposed]
    assert (mode == "full") == bool(transposed)  # LoRA mode's kernels are the frozen base's
    assert state_bytes(synchronous.replace(decode_layout="out_in"))["engine"] == \
        _on_first_device(transposed)
    sync.close()
    measured = {k: _on_first_device(jax.tree.leaves(v)) for k, v in (
        ("frozen", state.frozen), ("trainable", state.params), ("engine", own))}
    for key, value in measured.items():
        assert planned[key] == value, key
    # AdamW's mu and nu; the optimizer's step counters (int32 scalars) are the rest
    opt = jax.tree.leaves(state.opt_state)
    counters = _on_first_device([x for x in opt if x.ndim == 0])
    assert planned["optimizer"] == _on_first_device(opt) - counters
    # the small things: the step and skipped counters and the rng key (2 x uint32)
    small = _on_first_device([state.step, state.skipped, jax.random.key_data(state.rng)])
    assert small == 16
    total = sum(planned[k] for k in ("frozen", "trainable", "optimizer", "engine"))
    assert _on_first_device(new) == total + counters + small


def test_the_load_transient_is_the_largest_checkpoint_tensor(zoo):
    """Counted whole in the checkpoint's dtype: here the f32 [vocab, hidden] embedding (97 x 32),
    larger than any projection; MoE experts count one expert's matrix each."""
    from safetensors.numpy import load_file

    path = make_hf_model("llama", zoo)
    spec = PlanSpec(model=from_hf(path).config, quant=QUANT, lora=LORA, param_dtype="float32")
    files = load_file(f"{path}/model.safetensors")
    assert load_tensor_bytes(spec) == max(t.nbytes for t in files.values()) == 97 * 32 * 4
    assert load_tensor_bytes(spec.replace(param_dtype="bfloat16")) == 97 * 32 * 2
    np.testing.assert_equal(state_bytes(spec)["load_tensor"], load_tensor_bytes(spec))
