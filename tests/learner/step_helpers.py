"""Small helpers for the learner-step tests: a tiny decoder, a stand-in for mode B (int8 frozen
base + LoRA adapters), a jitted sampler without KV cache, and synthetic rollouts."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlx.models import ModelConfig, Transformer
from rlx.models.layers import Linear
from rlx.types import Rollout

TINY = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=16, hidden_size=32, intermediate_size=64,
    num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
)


def tiny_model(seed: int = 0, cfg: ModelConfig = TINY) -> Transformer:
    return Transformer(cfg, rngs=nnx.Rngs(seed))


class FrozenWeight(nnx.Variable):
    """A non-Param variable: frozen base weights (here int8 and their scales)."""


class QLoRALinear(nnx.Module):
    """y = x @ (int8 kernel * scale) + bias + (alpha / r) x @ A @ B; only A and B train."""

    def __init__(self, base: Linear, rank: int, alpha: float, rngs: nnx.Rngs):
        w = base.kernel[...]  # [in, out]
        axes = base.kernel.get_metadata()["logical_axes"]
        scale = jnp.maximum(jnp.max(jnp.abs(w), axis=0), 1e-8) / 127.0  # [out]
        self.qkernel = FrozenWeight(jnp.round(w / scale).astype(jnp.int8), logical_axes=axes)
        self.scale = FrozenWeight(scale, logical_axes=axes[1:])
        self.bias = base.bias
        d_in, d_out = w.shape
        a = jax.random.normal(rngs.params(), (d_in, rank)) / np.sqrt(d_in)
        self.lora_a = nnx.LoRAParam(a, logical_axes=(axes[0], "lora_rank"))
        self.lora_b = nnx.LoRAParam(jnp.zeros((rank, d_out)), logical_axes=("lora_rank", axes[1]))
        self.lora_scale = alpha / rank
        self.dtype = base.dtype

    def __call__(self, x, adapter: bool = True):
        w = self.qkernel[...].astype(jnp.float32) * self.scale[...]  # [in, out]
        y = jnp.einsum("...d,df->...f", x.astype(self.dtype), w.astype(self.dtype))
        if self.bias is not None:
            y = y + self.bias[...]
        if not adapter:
            return y
        delta = jnp.einsum("...d,dr,rf->...f", x, self.lora_a[...], self.lora_b[...])
        return y + self.lora_scale * delta


def add_qlora(model: Transformer, rank: int = 4, alpha: float = 8.0, seed: int = 1) -> Transformer:
    """Mode B stand-in: every attention / MLP projection and the lm-head become QLoRALinear."""
    rngs = nnx.Rngs(seed)
    for layer in model.layers:
        for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                              (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                setattr(parent, name, QLoRALinear(getattr(parent, name), rank, alpha, rngs))
    if model.lm_head is not None:
        model.lm_head = QLoRALinear(model.lm_head, rank, alpha, rngs)
    return model


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
