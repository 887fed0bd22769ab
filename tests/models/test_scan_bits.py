"""A 1-byte float (fp8) base scanned on XLA:CPU is stored as its bits and read one layer at a time.

XLA:CPU copies or widens a whole fp8 stack that a loop takes, even when the program bitcasts it
to integers first; an argument that already is ``uint8`` it slices in place. So on one CPU device
``stack_layers`` stores fp8 stacks as ``uint8`` (``rlx.models.stack.stored_bits`` names the
float type) and ``scan`` bitcasts each layer back inside the loop. Checked here against the
unrolled model and against XLA's own memory analysis: the same logits and LoRA gradients
(<= 1e-6, f32), the unrolled view (file writers, base fingerprint) gives the original fp8 arrays
bit for bit, and the scanned forward's temporaries stay below one stack's bytes.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlx.io.fingerprint import base_reference
from rlx.models import Transformer, from_hf_config
from rlx.models.families import SUPPORTED_ARCHITECTURES
from rlx.models.stack import stack_layers, stored_bits, unrolled
from rlx.quant import LoraConfig, QuantConfig, apply_lora, quantize_model
from tests.helpers.hf_zoo import hf_config
from tests.helpers.steps import layer_logits_and_grads

ARCHITECTURE = {kind: arch for arch, kind in SUPPORTED_ARCHITECTURES.items()}


def _fp8_model(layers: int = 3, **sizes) -> Transformer:
    hf = hf_config("deepseek_v3")
    cfg = from_hf_config(hf.to_dict() | {"architectures": [ARCHITECTURE[hf.model_type]]} | sizes)
    cfg = dataclasses.replace(cfg, num_layers=layers, moe=dataclasses.replace(
        cfg.moe, sparse_layers=tuple(range(min(cfg.moe.sparse_layers), layers))))
    model = quantize_model(Transformer(cfg, rngs=nnx.Rngs(0)),
                           QuantConfig(format="fp8", fp8_granularity="block128"))
    apply_lora(model, LoraConfig(rank=4, alpha=8.0), nnx.Rngs(1))
    for _, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):  # B != 0: the adapter acts
        v.set_value(0.1 * jax.random.normal(jax.random.key(v.shape[-1]), v.shape, v.dtype))
    return model


def _fp8_leaves(state) -> dict:
    return {p: np.asarray(v[...]).view(np.uint8) for p, v in nnx.to_flat_state(state)
            if getattr(v[...], "dtype", None) == jnp.float8_e4m3fn}


def _batch():
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 97, (2, 9)))
    return ids, jnp.ones((2, 9), jnp.int32)


def test_fp8_stacks_are_bits_and_compute_as_unrolled():
    model = _fp8_model()
    before = _fp8_leaves(nnx.state(model))
    reference = base_reference(nnx.state(model, nnx.Not(nnx.LoRAParam)))
    stacked = stack_layers(nnx.merge(*nnx.split(model)))
    flat = nnx.to_flat_state(nnx.state(stacked))
    bits = [(p, v) for p, v in flat if stored_bits(v) is not None]
    assert bits and all(v[...].dtype == jnp.uint8 and stored_bits(v) == jnp.float8_e4m3fn
                        for _, v in bits)
    assert not any(getattr(v[...], "dtype", None) == jnp.float8_e4m3fn for _, v in flat)

    ref_logits, ref_grads = layer_logits_and_grads(model, nnx.LoRAParam, *_batch(), True)
    logits, grads = layer_logits_and_grads(stacked, nnx.LoRAParam, *_batch(), True)
    np.testing.assert_allclose(logits, ref_logits, atol=1e-6, rtol=0)
    holder = nnx.merge(*nnx.split(stacked))
    nnx.update(holder, grads)
    got = {p: np.asarray(v[...]) for p, v in
           nnx.to_flat_state(nnx.state(unrolled(holder), nnx.LoRAParam))}
    ref = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(ref_grads)}
    assert got.keys() == ref.keys() and ref
    for p in ref:
        np.testing.assert_allclose(got[p], ref[p], atol=1e-6, rtol=0, err_msg=str(p))

    after = _fp8_leaves(nnx.state(unrolled(stacked)))  # the file writers' view
    assert after.keys() == before.keys()
    assert all(np.array_equal(after[p], before[p]) for p in before)
    assert base_reference(nnx.state(stacked, nnx.Not(nnx.LoRAParam))) == reference


def _forward_temp_bytes(model) -> int:
    """XLA's temporaries of the scanned layers' forward over ``_batch``."""
    graphdef, state = nnx.split(model)

    def forward(state, ids, mask):
        m = nnx.merge(graphdef, state)
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
        return m.run_layers(m.embed_tokens(ids), positions, mask, m.rope_angles(positions))

    return jax.jit(forward).lower(state, *_batch()).compile().memory_analysis().temp_size_in_bytes


def test_a_scanned_fp8_forward_reads_its_stack_in_place():
    """XLA's memory analysis of the scanned forward: temporaries below half the bytes of the
    largest fp8 stack; the same stacks held as fp8 (a copy or a widening of each stack ahead of
    the loop) exceed that stack's bytes."""
    stacked = stack_layers(_fp8_model(layers=16, hidden_size=256, moe_intermediate_size=256))
    flat = nnx.to_flat_state(nnx.state(stacked))
    largest = max(v[...].nbytes for _, v in flat if stored_bits(v) is not None)
    assert _forward_temp_bytes(stacked) < largest / 2
    for _, v in flat:  # the stacks as fp8 arrays again: what the program copies or widens
        if stored_bits(v) is not None:
            v.set_value(jax.lax.bitcast_convert_type(v[...], stored_bits(v)))
    assert _forward_temp_bytes(stacked) > largest
