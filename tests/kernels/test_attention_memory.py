"""Memory linear in sequence length, by XLA's own memory analysis of the compiled programs.

SmolLM2-135M's architecture (30 layers, 9 query / 3 KV heads of 64; the fast test keeps 2 of its
layers, the slow one all 30) in float32, nothing allocated (abstract inputs): the train step (LoRA, one row per step), a prefill of the whole
sequence into a cache of as many slots, and one decode step over a full cache, at 4k, 8k, 16k and
32k tokens. Dense attention's scores grew 4x per doubling; the bound is 2.2x.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from rlx.models.hparams import ModelConfig, RopeConfig
from rlx.models.kv_cache import KVCache
from rlx.models.stack import layer_counts
from rlx.plan.memory import compiled_bytes
from rlx.plan.spec import PlanSpec, abstract_model

SMOLLM2 = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
    rope=RopeConfig(theta=100000.0), tie_word_embeddings=True, max_position_embeddings=32768)
LENGTHS = (4096, 8192, 16384, 32768)
BOUND = 2.2  # most growth of temporary bytes per doubling of the length


def _spec(length: int, layers: int) -> PlanSpec:
    model = dataclasses.replace(SMOLLM2, num_layers=layers)
    return PlanSpec(model, mode="lora", dtype="float32", param_dtype="float32", rows=1,
                    seq_len=length, logprob_chunk=1024)


def _decode_temp(new: int, slots: int, layers: int) -> int:
    """Temporary bytes of ``new`` tokens per row over a cache of ``slots`` (float32, one row)."""
    model = abstract_model(_spec(slots, layers))
    graphdef, state = nnx.split(model)
    stacks = layer_counts(model)
    cache = jax.eval_shape(lambda: KVCache.zeros(model.config, 1, slots, jnp.float32, stacks))
    ids = jax.ShapeDtypeStruct((1, new), jnp.int32)

    def step(state, ids, cache):
        positions = cache.index + jnp.broadcast_to(jnp.arange(new), ids.shape)
        return nnx.merge(graphdef, state).decode(ids, positions, jnp.ones_like(ids), cache)

    compiled = jax.jit(step, donate_argnums=2).lower(state, ids, cache).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def _growth(temps: list[int]) -> list[float]:
    return [b / a for a, b in zip(temps, temps[1:])]


@pytest.mark.parametrize("layers", [2, pytest.param(30, marks=pytest.mark.slow)])
def test_train_prefill_and_decode_memory_grow_linearly(layers):
    train = [compiled_bytes(_spec(n, layers))["temp"] for n in LENGTHS]
    prefill = [_decode_temp(n, n, layers) for n in LENGTHS]
    decode = [_decode_temp(1, n, layers) for n in LENGTHS]
    for name, temps in (("train", train), ("prefill", prefill), ("decode", decode)):
        print(name, [round(x / 2**20) for x in temps], "MiB")
        assert max(_growth(temps)) <= BOUND, (name, temps, _growth(temps))
