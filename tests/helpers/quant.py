"""Shared helpers of the quantization tests: tiny HF models, random non-zero adapters, log-probs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlx.models import from_hf
from rlx.quant import LoraConfig, QuantConfig, apply_lora, quantize_model
from rlx.quant.config import OftConfig
from tests.helpers.hf_zoo import make_hf_model

# group 8 divides every input size of the zoo models (32, 48, 16, 24).
INT4 = QuantConfig(format="int4", group_size=8)
# an OFT adapter whose blocks of 8 divide every adapted input width of the zoo (32, 48, 16, 24, 64)
OFT8 = LoraConfig(kind="oft", oft=OftConfig(block_size=8))


def randomize_lora_b(model: nnx.Module, seed: int = 1, scale: float = 0.3) -> None:
    """Give every ``lora_b`` random values (fresh adapters are exactly zero)."""
    key = jax.random.key(seed)
    for i, (path, var) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))):
        if path[-1] == "lora_b":
            var.set_value(scale * jax.random.normal(jax.random.fold_in(key, i), var.shape, var.dtype))


def quantized_lora_model(root: str, family: str, q: QuantConfig = INT4,
                         lora: LoraConfig = LoraConfig(rank=3, alpha=5.0), randomize: bool = True):
    model = quantize_model(from_hf(make_hf_model(family, root)), q)
    apply_lora(model, lora, nnx.Rngs(0))
    if randomize:
        randomize_lora_b(model)
    return model


def randomize_oft(model: nnx.Module, seed: int = 1, scale: float = 0.15) -> None:
    """Give every ``oft_r`` random values (a fresh adapter is exactly the identity)."""
    key = jax.random.key(seed)
    for i, (path, var) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))):
        assert path[-1] == "oft_r"
        var.set_value(scale * jax.random.normal(jax.random.fold_in(key, i), var.shape, var.dtype))


def oft_model(root: str, family: str, lora: LoraConfig = OFT8, q: QuantConfig = INT4,
              randomize: bool = True):
    """A zoo model on a ``q`` base with ``lora``'s OFT adapters (random with ``randomize``)."""
    model = quantize_model(from_hf(make_hf_model(family, root)), q)
    apply_lora(model, lora, nnx.Rngs(0))
    if randomize:
        randomize_oft(model)
    return model


def token_logprobs(logits, ids):
    """log p(ids[:, 1:]) under ``logits[:, :-1]`` (f32 log-softmax)."""
    lp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(lp, ids[:, 1:, None], axis=-1)[..., 0]


def ids(batch: int = 2, length: int = 9, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, 97, (batch, length))


def check_f32_sum_bound(y, x, w) -> None:
    """``y`` equals ``x @ w`` (``[R, K] @ [K, N]``) within the worst-case bound of a length-K
    dot product summed in f32 in any order: ``K * 2**-24 * |x| @ |w|`` of the float64 product."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    err = np.abs(np.asarray(y, np.float64) - x64 @ w64)
    assert (err <= x64.shape[-1] * 2.0 ** -24 * (np.abs(x64) @ np.abs(w64))).all(), err.max()


def jitted_product(tensor, head: bool = False):
    """``tensor.product(x, f32, f32)`` (``head``: ``tensor.head_product(x, f32)``) jitted with
    the tensor's arrays as arguments (closed-over arrays would be constants that XLA folds):
    returns (run(x), optimized HLO text of x)."""
    graph, state = nnx.split(tensor)

    def call(s, x):
        t = nnx.merge(graph, s)
        return t.head_product(x, jnp.float32) if head else t.product(x, jnp.float32, jnp.float32)

    fn = jax.jit(call)
    return lambda x: fn(state, x), lambda x: fn.lower(state, x).compile().as_text()
