"""The learner's lm-head (`logprob_head`): the vocabulary-blocked `LMHead` for a plain head must give
the losses, metrics and gradients of the model's own `logits` callable, for tied and untied heads,
f32 and bf16 compute, a full-parameter (trainable head) and a frozen int8 base with LoRA."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.learner.batching import pad_rollouts
from rlx.kernels.logprobs import LMHead
from rlx.learner.losses import LossConfig
from rlx.learner.step import StepConfig, compute_grads, for_mesh, logprob_head, model_forward
from rlx.mesh import MeshShape, make_mesh
from rlx.models import Transformer
from rlx.models.decoder import Precision
from rlx.quant import QuantConfig, quantize_model
from tests.helpers.steps import TINY, add_qlora, random_rollouts

V = 40  # > vocab_block below: several blocks, the last one overlapping
CASES = {  # name -> (tied, compute dtype, mode)
    "untied-f32-full": (False, jnp.float32, "full"), "tied-f32-full": (True, jnp.float32, "full"),
    "tied-f32-lora": (True, jnp.float32, "lora"), "untied-f32-lora": (False, jnp.float32, "lora"),
    "tied-bf16-full": (True, jnp.bfloat16, "full"), "untied-bf16-lora": (False, jnp.bfloat16, "lora"),
}


def _model(tied: bool, dtype, mode: str):
    cfg = dataclasses.replace(TINY, vocab_size=V, tie_word_embeddings=tied)
    model = Transformer(cfg, Precision(dtype=dtype), rngs=nnx.Rngs(3))
    head = model.embed if tied else model.lm_head.kernel  # logits of std ~1
    head.value = head[...] * 10.0
    if mode == "lora":
        return add_qlora(model), nnx.LoRAParam
    return model, nnx.Param


def _callable_forward(model, batch, adapter: bool = True):
    hidden = model.hidden_states(batch.input_ids, batch.positions, batch.segment_ids,
                                 adapter=adapter)
    return hidden, functools.partial(model.logits, adapter=adapter)


def _batch():
    rollouts = random_rollouts(8, V, seed=31, max_prompt=6, max_completion=7)
    adv = np.random.RandomState(32).normal(size=8)
    old = [r.sampler_logp + 0.2 for r in rollouts]
    return pad_rollouts(rollouts, adv, old_logp=old, rows_multiple=2)


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
@pytest.mark.parametrize("case", list(CASES))
def test_blocked_head_gives_the_losses_and_gradients_of_the_logits_callable(case, entropy_coef):
    tied, dtype, mode = CASES[case]
    model, trainable = _model(tied, dtype, mode)
    assert isinstance(logprob_head(model), LMHead)
    h = jnp.asarray(np.random.RandomState(0).normal(size=(3, TINY.hidden_size)), dtype)
    np.testing.assert_array_equal(np.asarray(logprob_head(model)(h), np.float32),
                                  np.asarray(model.logits(h), np.float32))  # same products
    graphdef, params, frozen = nnx.split(model, trainable, ...)
    cfg = StepConfig(loss=LossConfig("dapo", entropy_coef=entropy_coef), micro_batches=2,
                     logprob_chunk=9, vocab_block=16)
    batch = _batch()
    runs = [jax.jit(functools.partial(compute_grads, graphdef=graphdef, cfg=cfg, apply_fn=f))(
        params, frozen, batch) for f in (model_forward, _callable_forward)]
    (g_blk, loss_blk, m_blk, *_), (g_ref, loss_ref, m_ref, *_) = runs
    tol = 1e-5 if dtype == jnp.float32 else 2e-2  # bf16: per-tile vs whole-row rounding
    assert abs(float(loss_ref)) > 1e-3
    assert abs(float(loss_blk) - float(loss_ref)) <= tol * max(1.0, abs(float(loss_ref)))
    assert abs(float(m_blk.entropy) - float(m_ref.entropy)) <= tol * max(1.0, float(m_ref.entropy))
    head_grads = []
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_blk), jax.tree.leaves(g_ref)):
        a, b, name = np.asarray(a, np.float32), np.asarray(b, np.float32), jax.tree_util.keystr(path)
        assert np.abs(a - b).max() <= tol * max(float(np.abs(b).max()), 1e-6), name
        if "embed" in name if tied else "lm_head" in name:
            head_grads.append(float(np.abs(a).max()))
    # full mode: the head's own gradient came through the blocked backward pass
    assert (max(head_grads) > 1e-4) if mode == "full" else not head_grads


def test_heads_that_cannot_be_sliced_keep_the_logits_callable():
    model, _ = _model(False, jnp.float32, "full")
    model.lm_head.act_quant = "int8_token"  # a W8A8 server's activation quantization
    assert not isinstance(logprob_head(model), LMHead)
    model.lm_head.act_quant = "none"
    model.lm_head.kernel_layout = "out_in"  # the rollout engine's transposed copy
    assert not isinstance(logprob_head(model), LMHead)
    model.lm_head.kernel_layout = "in_out"
    assert isinstance(logprob_head(model), LMHead)
    quantize_model(model, QuantConfig(format="int8", quantize_lm_head=True))
    assert not isinstance(logprob_head(model), LMHead)  # dequantized chunk by chunk instead
    tied, _ = _model(True, jnp.float32, "full")
    quantize_model(tied, QuantConfig(format="int8", quantize_embed=True))
    assert not isinstance(logprob_head(tied), LMHead)


def test_a_vocabulary_sharded_over_tensor_takes_whole_rows():
    cfg = StepConfig(vocab_block=64)
    devices = jax.devices()
    assert for_mesh(cfg, make_mesh(MeshShape(), devices[:1])).vocab_block == 64
    tp = make_mesh(MeshShape(data=2, tensor=2), devices[:4])
    assert for_mesh(cfg, tp).vocab_block == 0
