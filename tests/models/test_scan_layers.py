"""Scanned layers (``rlx.models.stack``) compute what the unrolled loop computes.

The same random weights, stacked and unstacked: f32 logits and gradients agree to 1e-6 (the same
per-layer math; only XLA's fusion across layer boundaries differs) for a dense model (llama,
qwen3), DeepSeek-V3 (MLA; a dense first layer and MoE after it: two stacks) and mode B (an int8
base with LoRA adapters, which stack too), with and without per-layer remat; the cached decode
over a stacked cache equals the unrolled decode, and so does the rollout engine's CPU decode of
a stacked model, which unstacks its layers inside the program (one cache buffer per layer); stacking then unstacking gives back every
variable exactly.
The longer variants are marked ``slow`` (``python -m pytest -m slow``).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.models import Transformer, from_hf_config
from rlx.models.families import SUPPORTED_ARCHITECTURES
from rlx.models.hparams import ModelConfig
from rlx.models.loading import ModelSection
from rlx.models.kv_cache import KVCache
from rlx.models.stack import (cache_stacks, decode_model, is_stacked, layer_counts, layer_runs, per_layer_tree,
                              stack_layers, stacked_tree, unrolled, unstack_layers)
from rlx.platform import CPU, GPU, TPU
from rlx.quant import LoraConfig, QuantConfig, apply_lora, quantize_model
from tests.helpers.hf_zoo import hf_config
from tests.helpers.steps import layer_logits_and_grads

ARCHITECTURE = {kind: arch for arch, kind in SUPPORTED_ARCHITECTURES.items()}


def _model(family: str, layers: int = 4, seed: int = 0) -> Transformer:
    hf = hf_config(family)
    cfg = from_hf_config(hf.to_dict() | {"architectures": [ARCHITECTURE[hf.model_type]]})
    if cfg.moe is not None:
        first = min(cfg.moe.sparse_layers)
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(
            cfg.moe, sparse_layers=tuple(range(first, layers))))
    return Transformer(dataclasses.replace(cfg, num_layers=layers), rngs=nnx.Rngs(seed))


def _copy(model):
    return nnx.merge(*nnx.split(model))


def _batch():
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 97, (2, 9)))
    mask = jnp.asarray(np.array([[1] * 9, [0] * 3 + [1] * 6]))
    return ids, mask


def _loss_and_grads(model, kind, remat: bool):
    return layer_logits_and_grads(model, kind, *_batch(), remat)


def _per_layer(grads, model):
    """``grads`` of a stacked model under the unrolled model's paths (``unrolled``)."""
    holder = _copy(model)
    nnx.update(holder, grads)
    state = nnx.state(unrolled(holder), grads_kind(grads))
    return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(state)}


def grads_kind(grads):
    kinds = {type(v) for _, v in nnx.to_flat_state(grads)}
    return nnx.LoRAParam if kinds == {nnx.LoRAParam} else nnx.Param


def _assert_parity(model, kind, remat=False):
    stacked = stack_layers(_copy(model))
    assert is_stacked(stacked) and not is_stacked(model)
    ref_logits, ref_grads = _loss_and_grads(model, kind, remat)
    logits, grads = _loss_and_grads(stacked, kind, remat)
    np.testing.assert_allclose(logits, ref_logits, atol=1e-6, rtol=0)
    ref = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(ref_grads)}
    got = _per_layer(grads, stacked)
    assert got.keys() == ref.keys() and ref
    for p in ref:
        np.testing.assert_allclose(got[p], ref[p], atol=1e-6, rtol=0, err_msg=str(p))
    return stacked


def test_layer_runs():
    assert layer_runs(["d", "d", "m", "m", "m"]) == ((0, 2), (2, 3))
    assert layer_runs(["d", "m", "d"]) == ((0, 1), (1, 1), (2, 1))


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_dense_logits_and_grads(family):
    stacked = _assert_parity(_model(family, layers=3), nnx.Param, remat=family == "qwen3")
    assert layer_counts(stacked) == (3,)


def test_deepseek_v3_two_stacks():
    """A dense first layer, then two MoE layers: a dense prefix stack and a MoE stack."""
    stacked = _assert_parity(_model("deepseek_v3", layers=3), nnx.Param)
    assert layer_counts(stacked) == (1, 2)


def test_gpt_oss_sliding_and_full_layers_stack_apart():
    """A layer's window is static: gpt-oss's alternating sliding and full layers make one stack
    each, with the unrolled model's logits and gradients (sinks and biases included)."""
    stacked = _assert_parity(_model("gpt_oss", layers=4), nnx.Param)
    assert layer_counts(stacked) == (1, 1, 1, 1)


def test_mode_b_int8_base_with_lora():
    model = _model("qwen3", layers=2)
    model = quantize_model(model, QuantConfig(format="int8"))
    apply_lora(model, LoraConfig(rank=4, alpha=8.0), nnx.Rngs(1))
    for _, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):  # B != 0: the adapter acts
        v.set_value(0.1 * jax.random.normal(jax.random.key(v.shape[-1]), v.shape, v.dtype))
    stacked = _assert_parity(model, nnx.LoRAParam, remat=True)
    paths = [p for p, _ in nnx.to_flat_state(nnx.state(stacked, nnx.LoRAParam))]
    assert all(p[0] == "stacks" for p in paths)


def _decode(model):
    """Logits of a 5-token prefill then 4 one-token steps of left-padded rows."""
    ids, mask = _batch()
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)

    def step(m, x, p, s, c):
        m = decode_model(m)
        h, c = m.decode(x, p, s, c)
        return m.logits(h), c

    step = jax.jit(step)
    cache = KVCache.zeros(model.config, 2, 9, jnp.float32, cache_stacks(model))
    outs = []
    for a, b in ((0, 5), (5, 6), (6, 7), (7, 8), (8, 9)):
        logits, cache = step(model, ids[:, a:b], positions[:, a:b], mask[:, a:b], cache)
        outs.append(np.asarray(logits))
    cache = cache.take_rows(jnp.asarray([1, 0, 1]))
    return np.concatenate(outs, axis=1), cache


@pytest.mark.parametrize("family", ["llama", pytest.param("deepseek_v3", marks=pytest.mark.slow)])
@pytest.mark.parametrize("one_by_one", [False, True], ids=["scanned", "layer_by_layer"])
def test_decode_over_a_stacked_cache(family, one_by_one):
    model = _model(family, layers=3)
    stacked = stack_layers(_copy(model))
    stacked.unroll_decode = one_by_one  # the engine's CPU decode: the stacks sliced per layer
    ref, ref_cache = _decode(model)
    got, cache = _decode(stacked)
    np.testing.assert_allclose(got, ref, atol=1e-6, rtol=0)
    assert cache.stacks == (None if one_by_one else layer_counts(stacked))
    per_layer = list(cache.keys) if one_by_one else [k for s in cache.keys for k in s]
    assert len(per_layer) == len(ref_cache.keys)
    for a, b in zip(per_layer, ref_cache.keys):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)


def test_decode_refuses_a_cache_of_another_layout():
    stacked = stack_layers(_model("llama", layers=3))
    ids = jnp.ones((2, 3), jnp.int32)
    cache = KVCache.zeros(stacked.config, 2, 4, jnp.float32)  # one buffer per layer
    with pytest.raises(ValueError, match="layer_counts"):
        stacked.decode(ids, jnp.zeros_like(ids), ids, cache)


def test_unstack_gives_back_every_variable():
    model = _model("deepseek_v3", layers=3)
    round_trip = unstack_layers(stack_layers(_copy(model)))
    ref = nnx.to_flat_state(nnx.state(model))
    got = dict(nnx.to_flat_state(nnx.state(round_trip)))
    assert [p for p, _ in ref] == list(got)
    for p, v in ref:
        assert got[p].get_metadata().get("logical_axes") == v.get_metadata().get("logical_axes")
        np.testing.assert_array_equal(np.asarray(got[p][...]), np.asarray(v[...]))


def test_checkpoint_trees_hold_the_unrolled_paths():
    """Params and AdamW state of a stacked model, mapped per layer (what a checkpoint writes),
    have the unrolled model's paths and values, and map back to the stacked trees exactly."""
    import optax

    model = _model("deepseek_v3", layers=3)
    stacked = stack_layers(_copy(model))
    opt = optax.adamw(1e-3)
    params, ref_params = nnx.state(stacked, nnx.Param), nnx.state(model, nnx.Param)
    tree, ref = {"params": params, "opt": opt.init(params)}, {"params": ref_params,
                                                             "opt": opt.init(ref_params)}
    flat = lambda t: {jax.tree_util.keystr(p): np.asarray(x)  # noqa: E731
                      for p, x in jax.tree_util.tree_leaves_with_path(t)}
    per_layer = per_layer_tree(tree)
    got, want = flat(per_layer), flat(ref)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert jax.tree.structure(stacked_tree(per_layer, tree)) == jax.tree.structure(tree)
    back = flat(stacked_tree(per_layer, tree))
    assert back.keys() == flat(tree).keys()
    for k, v in flat(tree).items():
        np.testing.assert_array_equal(back[k], v, err_msg=k)


def test_auto_scans_deep_models_but_not_large_ones_on_cpu():
    """``scan_layers="auto"``: SmolLM2-135M's 30 layers scan on accelerators and run unrolled on
    XLA:CPU without recomputation (a faster train step there, rlx/bench/README.md); a tiny
    30-layer model stays scanned on CPU (its compile time would dominate); 8 layers never scan;
    "on" always does."""
    smollm2 = ModelConfig("LlamaForCausalLM", vocab_size=49152, hidden_size=576,
                          intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                          head_dim=64, tie_word_embeddings=True)
    assert smollm2.num_params() == 134_515_008  # transformers' num_parameters()
    tiny = dataclasses.replace(smollm2, vocab_size=256, hidden_size=64, intermediate_size=128,
                               num_heads=4, num_kv_heads=2, head_dim=16)
    auto = ModelSection(path="m", scan_layers="auto")
    assert auto.scans(smollm2, TPU) and auto.scans(smollm2, GPU)
    assert not auto.scans(smollm2, CPU)
    assert auto.scans(smollm2, CPU, recompute=True)  # train.remat: measured there as scanned
    assert auto.scans(tiny, CPU)
    assert not auto.scans(dataclasses.replace(smollm2, num_layers=8), TPU)
    assert ModelSection(path="m", scan_layers="on").scans(smollm2, CPU)
    assert not ModelSection(path="m", scan_layers="off").scans(smollm2, TPU)
