"""Small helpers for the learner-step tests: a tiny decoder, LoRA mode (int8 frozen base + LoRA
adapters from rlx.quant), a jitted sampler without KV cache, and synthetic rollouts."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlx.models import ModelConfig, Transformer
from rlx.quant import LoraConfig, QuantConfig, apply_lora, quantize_model
from rlx.types import Rollout

TINY = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=16, hidden_size=32, intermediate_size=64,
    num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
)


def tiny_model(seed: int = 0, cfg: ModelConfig = TINY, head_scale: float = 1.0) -> Transformer:
    """A random tiny decoder. ``head_scale`` multiplies the 0.02-scale lm-head: after the final
    RMSNorm such a head caps every logit gap near 0.6, which a frozen head (LoRA mode) could never turn
    into a confident policy, unlike a pretrained model's head; learning tests use an O(1) head."""
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    if model.lm_head is not None and head_scale != 1.0:
        model.lm_head.kernel.value = model.lm_head.kernel[...] * head_scale
    return model


def add_qlora(model: Transformer, rank: int = 4, alpha: float = 8.0, seed: int = 1) -> Transformer:
    """LoRA mode: an int8 frozen base (rlx.quant) with LoRA adapters on every projection."""
    quantize_model(model, QuantConfig(format="int8"))
    return apply_lora(model, LoraConfig(rank=rank, alpha=alpha), nnx.Rngs(seed))


@functools.partial(jax.jit, static_argnames=("graphdef", "length"))
def sample(params, frozen, prompts, key, *, graphdef, length: int):
    """Ancestral sampling at temperature 1 (full recompute per token; tiny models only).

    Returns completions [N, length] and their log-probs under the sampling model.
    """
    model = nnx.merge(graphdef, params, frozen)
    n, p = prompts.shape
    ids = jnp.concatenate([prompts, jnp.zeros((n, length), prompts.dtype)], axis=1)  # [N, P + C]

    def body(i, carry):
        ids, logps, key = carry
        key, sub = jax.random.split(key)
        logits = model(ids)  # [N, P + C, V]; causal, so the zeros ahead are ignored
        last = jax.lax.dynamic_index_in_dim(logits, p + i - 1, axis=1, keepdims=False)  # [N, V]
        tok = jax.random.categorical(sub, last.astype(jnp.float32))  # [N]
        logp = jnp.take_along_axis(jax.nn.log_softmax(last.astype(jnp.float32)), tok[:, None], 1)
        ids = jax.lax.dynamic_update_index_in_dim(ids, tok.astype(ids.dtype), p + i, axis=1)
        logps = jax.lax.dynamic_update_index_in_dim(logps, logp[:, 0], i, axis=1)
        return ids, logps, key

    init = (ids, jnp.zeros((n, length), jnp.float32), key)
    ids, logps, _ = jax.lax.fori_loop(0, length, body, init)
    return ids[:, p:], logps


def random_rollouts(n: int, vocab: int, seed: int = 0, max_prompt: int = 5,
                    max_completion: int = 6) -> list[Rollout]:
    """Rollouts of varied lengths with made-up sampler log-probs, 2 per uid."""
    rs = np.random.RandomState(seed)
    out = []
    for i in range(n):
        p, c = rs.randint(1, max_prompt + 1), rs.randint(1, max_completion + 1)
        out.append(Rollout(
            prompt_uid=i // 2, prompt_ids=rs.randint(0, vocab, p), completion_ids=rs.randint(0, vocab, c),
            sampler_logp=-rs.uniform(1.5, 4.0, c).astype(np.float32), weight_version=3,
        ))
    return out


def layer_logits_and_grads(model, kind, ids, mask, remat: bool):
    """Logits of ``ids`` through ``model``'s layers (``run_layers``; remat: each layer
    checkpointed) and the gradient of ``mean(sin(logits))`` over the unmasked positions (a mean,
    so gradients are O(1e-2): f32 tolerances are absolute) w.r.t. the ``kind`` variables."""
    graphdef, params, rest = nnx.split(model, kind, ...)

    def loss(params):
        m = nnx.merge(graphdef, params, rest)
        positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
        x = m.run_layers(m.embed_tokens(ids), positions, mask, m.rope_angles(positions),
                         remat=remat)
        logits = m.logits(m.norm(x))
        return jnp.mean(jnp.sin(logits) * mask[..., None]), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return np.asarray(logits), grads
