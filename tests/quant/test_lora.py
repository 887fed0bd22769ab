"""LoRA on a frozen quantized base: PEFT parity, frozen base under optax, adapter-off reference."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rlx.io.export import export_base, export_peft
from rlx.models import from_hf
from rlx.quant import LoraConfig, QuantWeight, quantize_model
from tests.helpers.hf_zoo import make_hf_model
from tests.helpers.quant import INT4, ids, quantized_lora_model, randomize_lora_b, token_logprobs


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zoo"))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen2_moe", "mixtral", "qwen3_moe",
                                    pytest.param("gpt_oss", marks=pytest.mark.slow)])
def test_peft_parity_on_dequantized_base(zoo, tmp_path, family):
    """rlx logits == HF peft logits (<= 1e-4, f32) on the exported dequantized base + adapter."""
    import peft
    import torch
    import transformers

    lora = LoraConfig(rank=3, alpha=5.0)
    model = quantized_lora_model(zoo, family, lora=lora)
    base = export_base(model, INT4, str(tmp_path / "base"), "v1")  # serving "hf": dequantized floats
    adapter = export_peft(model, lora, str(tmp_path / "adapter"), "v1")
    x = ids()
    ours = np.asarray(model(jnp.asarray(x)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        ref = peft.PeftModel.from_pretrained(hf, adapter).eval()(torch.tensor(x)).logits.numpy()
    base_only = np.asarray(model(jnp.asarray(x), adapter=False))
    assert np.abs(ours - base_only).max() > 0.1  # the adapter matters, so parity tests it
    assert np.abs(ours - ref).max() <= 1e-4


def test_frozen_base_after_20_adam_steps(zoo):
    """Only LoRA leaves get gradients and move; every base leaf (int4, scales, norms, router) is
    bit-identical after 20 optimizer steps on a toy next-token loss."""
    model = quantized_lora_model(zoo, "qwen2_moe", randomize=False)
    base_before = jax.tree.map(np.array, nnx.state(model, nnx.Not(nnx.LoRAParam)))
    lora_before = jax.tree.map(np.array, nnx.state(model, nnx.LoRAParam))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)
    x = jnp.asarray(ids(4, 12))

    def loss_fn(m):
        return -token_logprobs(m(x), x).mean()

    @nnx.jit
    def step(m, o):
        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(m)
        o.update(m, grads)
        return loss, grads

    losses = []
    for _ in range(20):
        loss, grads = step(model, opt)
        losses.append(float(loss))
    grad_paths = {p for p, _ in nnx.to_flat_state(grads)}
    lora_paths = {p for p, _ in nnx.to_flat_state(lora_before)}
    assert grad_paths == lora_paths and all(
        isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(grads))
    assert losses[-1] < losses[0]
    after = dict(nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.LoRAParam))))
    for path, var in nnx.to_flat_state(base_before):
        assert np.array_equal(np.asarray(after[path][...]).view(np.uint8),
                              np.asarray(var[...]).view(np.uint8)), path
    assert any(isinstance(v, QuantWeight) for _, v in nnx.to_flat_state(base_before))
    lora_after = dict(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)))
    for path, var in nnx.to_flat_state(lora_before):
        assert not np.array_equal(np.asarray(lora_after[path][...]), np.asarray(var[...])), path


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_reference_is_adapter_off_exactly(zoo, family):
    """Log-probs with adapter=False equal the base model's exactly (one jitted function)."""
    forward = jax.jit(lambda m, x, adapter: token_logprobs(m(x, adapter=adapter), x), static_argnums=2)
    x = jnp.asarray(ids())
    base = quantize_model(from_hf(make_hf_model(family, zoo)), INT4)
    with_lora = quantized_lora_model(zoo, family)
    ref = np.asarray(forward(with_lora, x, False))
    assert np.array_equal(ref, np.asarray(forward(base, x, False)))
    assert np.abs(np.asarray(forward(with_lora, x, True)) - ref).max() > 1e-2


def test_mode_a_is_the_plain_model(zoo):
    """Without quantization or adapters the model has only nnx.Params and adapter= changes nothing."""
    model = from_hf(make_hf_model("qwen2_moe", zoo))
    assert not jax.tree.leaves(nnx.state(model, QuantWeight))
    assert not jax.tree.leaves(nnx.state(model, nnx.LoRAParam))
    x = jnp.asarray(ids())
    assert np.array_equal(np.asarray(model(x)), np.asarray(model(x, adapter=False)))


def test_lora_dropout_only_in_train_mode(zoo):
    model = quantized_lora_model(zoo, "llama", lora=LoraConfig(rank=3, dropout=0.5))
    randomize_lora_b(model)
    x = jnp.asarray(ids())
    model.eval()
    a, b = np.asarray(model(x)), np.asarray(model(x))
    assert np.array_equal(a, b)
    model.train()
    assert not np.array_equal(np.asarray(model(x)), a)


def test_ragged_rank_product_is_ragged_dot_with_a_lane_major_gradient():
    """Per-expert LoRA A: the same value and gradients as ``jax.lax.ragged_dot`` (f32, exact:
    the same products), rows past the groups included; every product of its gradient has the
    rank dimension before the input dimension (``[e, r, d]``), never ``[e, d, r]``."""
    from rlx.quant.lora import ragged_rank_product

    m, d, r, e = 29, 40, 3, 4
    kx, ka, kc = jax.random.split(jax.random.key(0), 3)
    x, a = jax.random.normal(kx, (m, d)), jax.random.normal(ka, (e, d, r))
    ct = jax.random.normal(kc, (m, r))
    sizes = jnp.array([9, 0, 7, 10], jnp.int32)  # 26 of 29 rows in groups, one group empty
    ours = lambda x, a: jnp.sum(ragged_rank_product(x, a, sizes) * ct)  # noqa: E731
    ref = lambda x, a: jnp.sum(jax.lax.ragged_dot(x, a, sizes) * ct)  # noqa: E731
    np.testing.assert_array_equal(ragged_rank_product(x, a, sizes),
                                  jax.lax.ragged_dot(x, a, sizes))
    for g, h in zip(jax.grad(ours, (0, 1))(x, a), jax.grad(ref, (0, 1))(x, a)):
        np.testing.assert_allclose(g, h, rtol=1e-6, atol=1e-6)
    jaxpr = jax.make_jaxpr(jax.grad(ours, 1))(x, a).jaxpr
    outs = [q.outvars[0].aval.shape for q in jaxpr.eqns if q.primitive.name == "ragged_dot_general"]
    assert (e, r, d) in outs and (e, d, r) not in outs
