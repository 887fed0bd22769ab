"""OFT adapters (``lora.kind="oft"``): PEFT parity on the same base, adapter-off reference,
frozen quantized base under training, the Cayley forms against their definitions."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rlx.errors import ConfigError
from rlx.io.export import export_base, export_peft
from rlx.models import from_hf
from rlx.models.families import MLA_TARGETS
from rlx.quant import LoraConfig, QuantConfig, QuantWeight, apply_lora, quantize_model
from rlx.quant.config import OftConfig
from rlx.quant.oft import cayley
from tests.helpers.hf_zoo import make_hf_model
from tests.helpers.quant import INT4, OFT8, ids, oft_model, token_logprobs

INT8 = QuantConfig(format="int8")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zoo"))


def _peft_logits(base: str, adapter: str, x, merge: bool = False) -> np.ndarray:
    """PEFT's logits of ``adapter`` on ``base``; ``merge``: PEFT's own ``merge_and_unload``
    first (PEFT's OFT forward reads a 4-D input as a conv's image, and transformers feeds
    DeepSeek-V3's ``kv_b_proj`` the latent as ``[b, 1, t, c]``)."""
    import peft
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        model = peft.PeftModel.from_pretrained(hf, adapter).eval()
        model = model.merge_and_unload() if merge else model
        return model(torch.tensor(x)).logits.numpy()


@pytest.mark.parametrize("family,lora", [
    ("llama", OFT8),  # q, k, v, o and the dense MLP; PEFT's default Neumann form (5 terms)
    ("llama", LoraConfig(kind="oft", oft=OftConfig(block_size=16, cayley_neumann=False))),
    ("qwen3", LoraConfig(kind="oft", oft=OftConfig(block_size=8, neumann_terms=7))),
    ("qwen2_moe", LoraConfig(kind="oft", oft=OftConfig(block_size=8), experts=False)),  # shared
    # every MLA projection (PEFT reads this family's MLP names as its experts: no PEFT name)
    ("deepseek_v3", LoraConfig(kind="oft", oft=OftConfig(block_size=8),
                               targets=("q_a", "q_b", "kv_a", "kv_b", "o")))])
def test_peft_parity(zoo, tmp_path, family, lora):
    """rlx logits (OFT rotating the activations before the int4 product) == PEFT's OFT logits
    (rotation of the input of a float linear) on the dequantized base, <= 1e-5 (f32)."""
    model = oft_model(zoo, family, lora)
    base = export_base(model, INT4, str(tmp_path / "base"), "v1")  # serving "hf": dequantized
    adapter = export_peft(model, lora, str(tmp_path / "adapter"), "v1")
    x = ids()
    ours = np.asarray(model(jnp.asarray(x)))
    base_only = np.asarray(model(jnp.asarray(x), adapter=False))
    assert np.abs(ours - base_only).max() > 0.1  # the adapter matters, so parity tests it
    ref = _peft_logits(base, adapter, x, merge=family == "deepseek_v3")
    print(f"OFT {family} b{lora.oft.block_size}: PEFT {np.abs(ours - ref).max():.2e}, "
          f"adapter moves {np.abs(ours - base_only).max():.2f}")
    assert np.abs(ours - ref).max() <= 1e-5


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "kimi_k2"])
def test_reference_is_adapter_off_exactly(zoo, family):
    """Log-probs with adapter=False equal the un-adapted base's exactly (one jitted function)."""
    forward = jax.jit(lambda m, x, adapter: token_logprobs(m(x, adapter=adapter), x), static_argnums=2)
    x = jnp.asarray(ids())
    targets = MLA_TARGETS if family == "kimi_k2" else OFT8.targets
    lora = LoraConfig(kind="oft", oft=OftConfig(block_size=8), targets=targets)
    base = quantize_model(from_hf(make_hf_model(family, zoo)), INT4)
    adapted = oft_model(zoo, family, lora)
    ref = np.asarray(forward(adapted, x, False))
    assert np.array_equal(ref, np.asarray(forward(base, x, False)))
    assert np.abs(np.asarray(forward(adapted, x, True)) - ref).max() > 1e-2


def test_cayley_forms():
    """Exact Cayley: R orthogonal and (I - Q)(I + Q)^-1 in float64; Neumann (PEFT's series,
    5 terms): I + 2Q + 2Q^2 + 2Q^3 + Q^4; a zero vector is the identity."""
    b = 4
    vec = np.random.RandomState(0).normal(0, 0.2, (3, b * (b - 1) // 2))
    q = np.zeros((3, b, b))
    q[:, *np.triu_indices(b, 1)] = vec
    q = q - q.transpose(0, 2, 1)
    eye = np.eye(b)
    exact = np.asarray(cayley(jnp.asarray(vec, jnp.float32), b, OftConfig(b, cayley_neumann=False)))
    want = (eye - q) @ np.linalg.inv(eye + q)
    assert np.abs(exact - want).max() <= 1e-6
    assert np.abs(exact @ exact.transpose(0, 2, 1) - eye).max() <= 1e-6
    series = np.asarray(cayley(jnp.asarray(vec, jnp.float32), b, OftConfig(b)))
    q2 = q @ q
    assert np.abs(series - (eye + 2 * q + 2 * q2 + 2 * q2 @ q + q2 @ q2)).max() <= 1e-6
    assert np.array_equal(np.asarray(cayley(jnp.zeros((2, 6)), b, OftConfig(b))),
                          np.broadcast_to(eye, (2, b, b)))


def test_a_block_size_that_does_not_divide_is_refused(zoo):
    model = from_hf(make_hf_model("llama", zoo))
    with pytest.raises(ValueError, match="block_size=5 does not divide"):
        apply_lora(model, LoraConfig(kind="oft", oft=OftConfig(block_size=5)), nnx.Rngs(0))
    with pytest.raises(ConfigError, match="kind=.dora. is not one of"):
        LoraConfig(kind="dora")


# in CI the compiled RL step of tests/learner/test_oft_step.py covers this on an int4 base
@pytest.mark.slow
@pytest.mark.parametrize("q", [INT4, INT8])
def test_one_training_step_moves_only_oft(zoo, q):
    """On an int4 / int8 base (experts included) the frozen leaves stay quantized and bit-identical
    after an AdamW step, every OFT rotation (a fresh one: zero, the identity) moves."""
    model = oft_model(zoo, "qwen2_moe", q=q, randomize=False)
    base_before = jax.tree.map(np.array, nnx.state(model, nnx.Not(nnx.LoRAParam)))
    oft_before = jax.tree.map(np.array, nnx.state(model, nnx.LoRAParam))
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.LoRAParam)
    x = jnp.asarray(ids(4, 12))

    @nnx.jit
    def step(m, o):
        loss_fn = lambda m: -token_logprobs(m(x), x).mean()  # noqa: E731
        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(m)
        o.update(m, grads)
        return loss

    step(model, opt)
    after = dict(nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.LoRAParam))))
    quantized = [p for p, v in nnx.to_flat_state(base_before) if isinstance(v, QuantWeight)]
    assert any("experts" in p for p in quantized) and any("self_attn" in p for p in quantized)
    for path, var in nnx.to_flat_state(base_before):
        assert type(after[path]) is type(var)
        assert np.array_equal(np.asarray(after[path][...]).view(np.uint8),
                              np.asarray(var[...]).view(np.uint8)), path
    oft_after = dict(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)))
    # layer 0: 4 attention + 3 shared-expert + 3 expert stacks; layer 1 (dense MLP): 4 + 3
    assert len(oft_after) == 17
    for path, var in nnx.to_flat_state(oft_before):
        assert not np.array_equal(np.asarray(oft_after[path][...]), np.asarray(var[...])), path
