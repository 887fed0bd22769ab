"""Checkpoints: exact resume, LoRA mode without its base, refusals, atomic commit, keep-last-n,
resharding."""

from __future__ import annotations

import dataclasses
import glob
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rlx.data import ListSource, make_prompt_pipeline
from rlx.data.sources import user_example
from rlx.io.checkpoint import CheckpointConfig, CheckpointCorruptError, Checkpointer
from rlx.io.fingerprint import CheckpointMismatchError, base_reference
from rlx.learner.state import OptimizerConfig, TrainState, create_train_state, make_optimizer
from rlx.mesh import MeshShape, make_mesh
from rlx.models import ModelConfig, Transformer
from rlx.quant import LoraConfig, QuantConfig, apply_lora, quantize_model
from tests.helpers import ROOT as REPO
from tests.helpers.tokenizers import byte_tokenizer

CFG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=16, hidden_size=32,
                  intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8)
OPT = make_optimizer(OptimizerConfig(learning_rate=1e-2))


def _mesh(shape: MeshShape = MeshShape()):
    return make_mesh(shape, jax.devices()[: shape.num_devices])


def _fresh(mode: str, seed: int = 0, cfg: ModelConfig = CFG, mesh=None) -> TrainState:
    """A new state; LoRA mode: int8 base (weights from `seed`) + rank-2 LoRA (init from seed + 1)."""
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    trainable = nnx.Param
    if mode == "lora":
        quantize_model(model, QuantConfig(format="int8"))
        apply_lora(model, LoraConfig(rank=2), nnx.Rngs(seed + 1))
        trainable = nnx.LoRAParam
    return create_train_state(model, OPT, mesh or _mesh(), trainable=trainable, seed=seed)[1]


@jax.jit
def _update(state: TrainState, key) -> TrainState:
    """One optimizer update with made-up gradients; moves params, moments, count and rng."""
    shift = jax.random.uniform(key)
    grads = jax.tree.map(lambda x: jnp.cos(7.0 * x + shift), state.params)  # varied, not constant
    updates, opt_state = OPT.update(grads, state.opt_state, state.params)
    return state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                         opt_state=opt_state, rng=jax.random.split(state.rng)[0])


def _advance(state: TrainState, k: int) -> TrainState:
    for i in range(k):
        state = _update(state, jax.random.key(100 + i))
    return state


def _host(state: TrainState):
    return jax.device_get((state.step, state.skipped, state.params, state.opt_state,
                           jax.random.key_data(state.rng)))


def _assert_bit_identical(got, want) -> None:
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(got_leaves, want_leaves):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()


def _pipeline():
    source = ListSource("toy", "all", [user_example(f"toy:{i}", "toy", f"q{i}") for i in range(40)])
    return make_prompt_pipeline(source, byte_tokenizer(), batch_size=4, seed=3)


def _uids(batch) -> list[str]:
    return [p.uid for p in batch.prompts]


def _ckpt(tmp_path, **kw) -> CheckpointConfig:
    return CheckpointConfig(str(tmp_path / "ckpt"), **{"every": 1, "keep": 5, **kw})


def test_resume_is_bit_identical_and_continues_the_data(tmp_path):
    trained, it = _advance(_fresh("lora"), 3), _pipeline()
    next(it), next(it)
    want = _host(trained)
    with Checkpointer(_ckpt(tmp_path, every=2), model_config=CFG, run_config={"seed": 3}) as ck:
        assert not ck.save(3, trained, it)  # not due
        assert ck.save(4, trained, it)  # asynchronous
        next_batch = next(it)  # the iterator moves on while the write completes
        for x in jax.tree.leaves((trained.params, trained.opt_state)):
            x.delete()  # as a donating train step would: the save must not need them any more
    fresh, it2 = _fresh("lora"), _pipeline()
    assert not np.array_equal(jax.device_get(jax.tree.leaves(fresh.params)[0]),
                              jax.tree.leaves(want[2])[0])  # a different starting point
    restored = Checkpointer(_ckpt(tmp_path), model_config=CFG).restore_latest(fresh, it2)
    assert restored.step == 4 and restored.config == {"seed": 3}
    _assert_bit_identical(_host(restored.state), want)
    assert int(restored.state.step) == 3
    assert _uids(next(it2)) == _uids(next_batch)
    _assert_bit_identical(jax.device_get(restored.state.frozen), jax.device_get(fresh.frozen))
    draw = lambda s: np.asarray(jax.random.normal(jax.random.split(s.rng)[1], (4,)))  # noqa: E731
    assert np.array_equal(draw(restored.state), np.asarray(jax.random.normal(
        jax.random.split(jax.random.wrap_key_data(want[4]))[1], (4,))))
    for a, b in zip(jax.tree.leaves(restored.state.params), jax.tree.leaves(fresh.params)):
        assert a.sharding == b.sharding
    (data_file,) = glob.glob(f"{tmp_path}/ckpt/4/data/process_0-of-1.json")
    with open(data_file, "r+b") as f:
        f.truncate(20)
    with pytest.raises(CheckpointCorruptError, match="data-iterator state cannot be read"):
        Checkpointer(_ckpt(tmp_path)).restore(4, fresh, _pipeline())


def test_mode_b_checkpoint_holds_no_base_and_refuses_another_base(tmp_path):
    cfg = dataclasses.replace(CFG, vocab_size=512, hidden_size=256, intermediate_size=512,
                              num_layers=2, head_dim=64)
    state = _fresh("lora", cfg=cfg)
    base = base_reference(state.frozen, source="/models/tiny.gguf", format="int8")
    with Checkpointer(_ckpt(tmp_path), model_config=cfg, base=base) as ck:
        ck.save(1, state)
        meta = ck.read_meta(1)
    on_disk = sum(os.path.getsize(f) for f in glob.glob(f"{tmp_path}/ckpt/1/**", recursive=True)
                  if os.path.isfile(f))
    adapter = sum(x.nbytes for x in jax.tree.leaves((state.params, state.opt_state)))
    assert base.num_bytes > 2_000_000 and adapter < base.num_bytes / 10
    assert on_disk < adapter + 300_000 < base.num_bytes / 4, (on_disk, adapter, base.num_bytes)
    saved = set(meta["fingerprint"]["leaves"])
    assert not any(p.startswith("frozen") for p in saved)
    assert all("lora" in p for p in saved if p.startswith("params/"))
    assert meta["fingerprint"]["base"]["source"] == "/models/tiny.gguf"

    other = _fresh("lora", seed=7, cfg=cfg)  # same shapes, other base weights
    other_base = base_reference(other.frozen, source="/models/other.gguf", format="int8")
    ck = Checkpointer(_ckpt(tmp_path), model_config=cfg, base=other_base)
    with pytest.raises(CheckpointMismatchError, match=r"frozen base hash.*tiny\.gguf.*other\.gguf"):
        ck.restore_latest(other)
    same = Checkpointer(_ckpt(tmp_path), model_config=cfg)
    assert same.restore(1, _fresh("lora", cfg=cfg)).step == 1


def test_a_checkpoint_of_another_model_is_refused_naming_what_differs(tmp_path):
    with Checkpointer(_ckpt(tmp_path), model_config=CFG) as ck:
        ck.save(1, _fresh("full"))
    wider = dataclasses.replace(CFG, intermediate_size=48)
    with pytest.raises(CheckpointMismatchError) as err:
        Checkpointer(_ckpt(tmp_path), model_config=wider).restore_latest(_fresh("full", cfg=wider))
    msg = str(err.value)
    assert "model.intermediate_size: checkpoint 64, current 48" in msg
    assert ("params/layers/0/mlp/gate_proj/kernel: checkpoint shape (32, 64) float32, "
            "current (32, 48)") in msg
    qwen = dataclasses.replace(CFG, architecture="Qwen2ForCausalLM")  # same tree, other model
    with pytest.raises(CheckpointMismatchError,
                       match="model.architecture: checkpoint 'LlamaForCausalLM'"):
        Checkpointer(_ckpt(tmp_path), model_config=qwen).restore_latest(_fresh("full"))
    with pytest.raises(CheckpointMismatchError, match="params/layers/0/mlp/down_proj/lora/lora_a"):
        Checkpointer(_ckpt(tmp_path)).restore_latest(_fresh("lora"))  # full mode checkpoint, LoRA mode run


def _data_files(step_dir: str) -> list[str]:
    files = glob.glob(f"{step_dir}/state/**/d/*", recursive=True)
    return sorted(files, key=os.path.getsize, reverse=True)


def test_truncated_or_corrupt_checkpoints_are_refused_and_resume_falls_back(tmp_path):
    states = {s: _advance(_fresh("full"), s) for s in (1, 2, 3)}
    with Checkpointer(_ckpt(tmp_path)) as ck:
        for step, state in states.items():
            ck.save(step, state)
    root = f"{tmp_path}/ckpt"
    big = _data_files(f"{root}/3")[0]
    with open(big, "r+b") as f:
        f.truncate(os.path.getsize(big) // 2)
    ck = Checkpointer(_ckpt(tmp_path))
    with pytest.raises(CheckpointCorruptError, match="checkpoint 3 in .* is truncated or corrupt"):
        ck.restore(3, _fresh("full"))
    with open(f"{root}/2/meta/metadata", "r+b") as f:  # a half-written JSON item
        f.truncate(100)
    with pytest.raises(CheckpointCorruptError, match="checkpoint 2 .* metadata cannot be read"):
        ck.restore(2, _fresh("full"))
    restored = ck.restore_latest(_fresh("full"))
    assert restored.step == 1
    _assert_bit_identical(_host(restored.state), _host(states[1]))
    assert ck.steps() == [1] and sorted(os.listdir(root)) == ["1", "2.corrupt", "3.corrupt"]
    assert ck.save(2, states[2], force=True)  # the resumed run can write those steps again
    ck.wait()
    data = _data_files(f"{root}/1")[0]  # a flipped byte, same size: caught by the checksums
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x55]))
    with pytest.raises(CheckpointCorruptError,
                       match=r"differ from the checksums written when it was saved: \w+/"):
        ck.restore(1, _fresh("full"))
    metadata = f"{root}/2/state/_METADATA"
    with open(metadata, "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointCorruptError, match="no complete checkpoint in .*tried 2"):
        ck.restore_latest(_fresh("full"))


_CHILD = """
import os
import signal
import sys
import jax
import jax.numpy as jnp
from rlx.io.checkpoint import Checkpointer, CheckpointConfig
from rlx.learner.state import TrainState

def state(v):
    z = jnp.zeros((), jnp.int32)
    w = jax.random.normal(jax.random.key(v), ({n},))
    return TrainState(step=z + v, skipped=z, params={{"w": w}}, frozen={{}}, opt_state=(),
                      rng=jax.random.key(v))

ck = Checkpointer(CheckpointConfig(sys.argv[1], every=1))
ck.save(1, state(1))
ck.wait()
print("committed 1", flush=True)
s2 = state(2)
jax.block_until_ready(s2)
ck.save(2, s2)  # returns with the write under way in a background thread
while not any(e.startswith("2.orbax-checkpoint-tmp") for e in os.listdir(sys.argv[1])):
    pass  # until that thread has made its temporary folder (late on a loaded machine)
print("writing 2", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)  # freeze every thread mid-write, for the parent's SIGKILL
ck.wait()
print("committed 2", flush=True)
"""


def _dummy_state(v: int, n: int) -> TrainState:
    z = jax.numpy.zeros((), jax.numpy.int32)
    w = jax.random.normal(jax.random.key(v), (n,))
    return TrainState(step=z + v, skipped=z, params={"w": w}, frozen={}, opt_state=(),
                      rng=jax.random.key(v))


def test_sigkill_during_a_write_leaves_the_previous_checkpoint(tmp_path):
    n = 16 * 2**20  # 64 MB of float32: far from written when save() returns
    root = str(tmp_path / "ckpt")
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    child = subprocess.Popen([sys.executable, "-c", _CHILD.format(n=n), root], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for expected in ("committed 1", "writing 2"):
            assert child.stdout.readline().strip() == expected
        _, status = os.waitpid(child.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
        entries = os.listdir(root)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        child.kill()
    partial = [e for e in entries if e.startswith("2.orbax-checkpoint-tmp")]
    assert "2" not in entries and partial, entries  # killed mid-write of step 2
    assert sorted(os.listdir(root)) == sorted(entries)
    ck = Checkpointer(CheckpointConfig(root, every=1))
    assert ck.steps() == [1]
    restored = ck.restore_latest(_dummy_state(0, n))
    assert restored.step == 1
    _assert_bit_identical(_host(restored.state), _host(_dummy_state(1, n)))
    assert ck.save(2, _dummy_state(2, n))  # the resumed run writes step 2 again
    ck.close()
    assert sorted(os.listdir(root)) == ["1", "2"]  # the partial write was cleaned up


_LOOP_CHILD = """
import os
import signal
import sys
import jax
import jax.numpy as jnp
import numpy as np
from rlx.io.checkpoint import Checkpointer, CheckpointConfig
from rlx.learner.state import TrainState

def state(v):
    z = jnp.zeros((), jnp.int32)
    w = jax.random.normal(jax.random.key(v), ({n},))
    return TrainState(step=z + v, skipped=z, params={{"w": w}}, frozen={{}}, opt_state=(),
                      rng=jax.random.key(v))

ck = Checkpointer(CheckpointConfig(sys.argv[1], every=1, keep=3))
restored = ck.restore_latest(state(0))
start = 0 if restored is None else restored.step
if restored is not None:
    got = np.asarray(restored.state.params["w"])
    if not (got.tobytes() == np.asarray(state(start).params["w"]).tobytes()
            and int(restored.state.step) == start):
        sys.exit(3)
print("resumed", start, flush=True)
for v in range(start + 1, start + 100000):
    ck.save(v, state(v))  # waits for the previous save to commit, then writes in the background
    print("saved", v, flush=True)
"""


def test_sigkill_at_random_times_in_a_loop_of_saves(tmp_path):
    """Three runs killed at random moments (mid-write, mid-rename, mid-delete of old steps);
    each resumes from the newest committed step with exactly that step's values."""
    import random

    root, rng, last_saved = str(tmp_path / "ckpt"), random.Random(0), 0
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    for _ in range(3):
        child = subprocess.Popen([sys.executable, "-c", _LOOP_CHILD.format(n=2**20), root],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 text=True)
        try:
            first = child.stdout.readline().split()
            assert first[0] == "resumed", (first, child.wait())
            assert int(first[1]) >= last_saved - 1  # save(v) returns after v - 1 committed
            lines = [child.stdout.readline()]  # saving has started
            time.sleep(rng.uniform(0.05, 1.0))
            child.send_signal(signal.SIGKILL)
            lines += child.stdout.read().splitlines()
            saved = [int(line.split()[1]) for line in lines]
            assert child.wait(timeout=30) == -signal.SIGKILL
            last_saved = saved[-1]
        finally:
            child.kill()
    ck = Checkpointer(CheckpointConfig(root, every=1, keep=3))
    assert ck.steps() and ck.steps()[-1] >= last_saved - 1
    for step in ck.steps():  # every listed checkpoint is complete
        restored = ck.restore(step, _dummy_state(0, 2**20))
        _assert_bit_identical(_host(restored.state), _host(_dummy_state(step, 2**20)))


def test_keep_last_n_and_the_save_interval(tmp_path):
    state = _fresh("full")
    with Checkpointer(_ckpt(tmp_path, every=2, keep=2)) as ck:
        saved = [step for step in range(1, 10) if ck.save(step, state)]
        ck.wait()
        assert saved == [2, 4, 6, 8] and ck.steps() == [6, 8]
        assert sorted(os.listdir(tmp_path / "ckpt")) == ["6", "8", "deleted"]
        assert os.listdir(tmp_path / "ckpt" / "deleted") == []  # retired steps are gone
        assert ck.save(9, state, force=True)  # at exit
        assert not ck.save(9, state, force=True)  # already there: a periodic + exit save
    assert Checkpointer(_ckpt(tmp_path)).steps() == [8, 9]
    with pytest.raises(ValueError, match="keep must be >= 1"):
        CheckpointConfig("x", keep=0)


def test_restore_onto_another_mesh_reshards(tmp_path):
    fsdp = _mesh(MeshShape(fsdp=8))
    trained = _advance(_fresh("full", mesh=fsdp), 2)
    sharded = [x for x in jax.tree.leaves(trained.params) if len(x.sharding.device_set) == 8]
    assert sharded and any(not x.sharding.is_fully_replicated for x in sharded)
    with Checkpointer(_ckpt(tmp_path)) as ck:
        ck.save(2, trained)
    single = _fresh("full", seed=5)
    restored = Checkpointer(_ckpt(tmp_path)).restore_latest(single)
    _assert_bit_identical(_host(restored.state), _host(trained))
    for a, b in zip(jax.tree.leaves(restored.state.params), jax.tree.leaves(single.params)):
        assert a.sharding == b.sharding and len(a.sharding.device_set) == 1


def test_no_checkpoint_yet_is_not_an_error(tmp_path):
    assert Checkpointer(_ckpt(tmp_path)).restore_latest(_fresh("full")) is None
