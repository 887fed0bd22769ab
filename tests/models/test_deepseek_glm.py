"""DeepSeek-V3 / Kimi-K2 / GLM-4.5 specifics beyond the logits parity of test_hf_parity.

- Cached decode equals the full forward pass (<= 1e-5, the same f32 math in another order): GQA
  with partial rotary, and MLA over its latent cache, whose decode steps absorb ``kv_b_proj``
  into the query and output products, also with a LoRA adapter on ``kv_b_proj`` (folded into the
  absorbed blocks) and a quantized ``kv_b_proj`` (dequantized for the fold); the absorbed and the
  expanded attention agree on the same cache (<= 1e-5), in the engine's ``[out, in]`` layout too.
- YaRN frequencies and temperatures equal transformers' own functions (<= 1e-6 relative: both
  evaluate the same f32 formula; the temperatures are Python floats, <= 1e-12).
- The router's correction bias is a frozen buffer in both training modes.
- ``num_params`` equals transformers' count at full scale (meta tensors, exact integers), and the
  config dicts round-trip exactly.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale

from rlx.learner.state import MODES
from rlx.models import Transformer, from_hf, from_hf_config, hf_state_dict, to_hf_config
from rlx.models.families import SUPPORTED_ARCHITECTURES
from rlx.models.kv_cache import KVCache
from rlx.models.layers import rope_inv_freq
from rlx.models.loading import ShrinkSection, shrunk
from rlx.models.moe import CorrectionBias
from rlx.quant import LoRA, LoraConfig, quantize_array
from rlx.rollout.jax.decode_layout import to_out_in
from tests.helpers.hf_zoo import FAMILIES, hf_config, make_hf_model

ARCHITECTURE = {kind: arch for arch, kind in SUPPORTED_ARCHITECTURES.items()}  # by model_type


def _rlx_config(hf: transformers.PretrainedConfig):
    """``from_hf_config`` of what ``save_pretrained`` would write for ``hf``."""
    return from_hf_config(hf.to_dict() | {"architectures": [ARCHITECTURE[hf.model_type]]})


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zoo"))


def _decode_vs_forward(model, adapter: bool = True) -> float:
    """Max |logit difference| between the full forward pass and a cached decode of left-padded
    prompts of 11 and 8 tokens: the first 7 slots prefilled together, then 4 one-token steps."""
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 97, (2, 11)))
    mask = jnp.asarray(np.array([[1] * 11, [0] * 3 + [1] * 8]))
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    full = jax.jit(lambda m, x, a: m(x, attention_mask=a, adapter=adapter))(model, ids, mask)
    step = jax.jit(lambda m, x, p, s, c: (lambda h, c: (m.logits(h, adapter), c))(
        *m.decode(x, p, s, c, adapter)))
    cache = KVCache.zeros(model.config, 2, 11, jnp.float32)
    logits, cache = step(model, ids[:, :7], positions[:, :7], mask[:, :7], cache)
    outs = [logits]
    for t in range(7, 11):
        logits, cache = step(model, ids[:, t:t + 1], positions[:, t:t + 1], mask[:, t:t + 1], cache)
        outs.append(logits)
    decoded = np.concatenate([np.asarray(o) for o in outs], axis=1)
    real = np.asarray(mask).astype(bool)
    return float(np.abs(decoded[real] - np.asarray(full)[real]).max())


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2_lite", "glm4_moe"])
def test_decode_equals_forward(zoo, family):
    assert _decode_vs_forward(from_hf(make_hf_model(family, zoo))) <= 1e-5


def _kv_b_adapters(model, scale: float = 0.3) -> None:
    """A rank-3 LoRA adapter with a random (non-zero) B on every layer's ``kv_b_proj``."""
    for i, layer in enumerate(model.layers):
        lin = layer.self_attn.kv_b_proj
        d_in, d_out = lin.kernel.shape
        lin.lora = LoRA(d_in, d_out, LoraConfig(rank=3, alpha=5.0), lin.axes, dtype=lin.dtype,
                        rngs=nnx.Rngs(i))
        b = lin.lora.lora_b
        b.set_value(scale * jax.random.normal(jax.random.key(i), b.shape, b.dtype))


def _absorbed_vs_expanded(attn, adapter: bool) -> tuple[float, np.ndarray]:
    """(max |absorbed - expanded|, expanded) of one layer's attention of 3 queries over a random
    9-slot latent cache whose last 2 slots are empty."""
    m, h = attn.mla, attn.num_heads
    keys = jax.random.split(jax.random.key(7), 4)
    q_nope = jax.random.normal(keys[0], (2, 3, h, m.qk_nope_head_dim))
    q_rope = jax.random.normal(keys[1], (2, 3, h, m.qk_rope_head_dim))
    rope_keys = jax.random.normal(keys[2], (2, m.qk_rope_head_dim, 9))
    latents = jax.random.normal(keys[3], (2, 9, m.kv_lora_rank))
    q_pos = jnp.broadcast_to(jnp.arange(9, 12), (2, 3))
    kv_seg = jnp.broadcast_to((jnp.arange(9) < 7).astype(jnp.int32), (2, 9))
    seen = (jnp.ones((2, 3), jnp.int32), kv_seg, q_pos, jnp.broadcast_to(jnp.arange(9), (2, 9)))
    ref = attn.expanded(q_nope, q_rope, rope_keys, latents, seen, adapter)
    out = attn.absorbed(q_nope, q_rope, rope_keys, latents, seen, adapter)
    return float(jnp.abs(out - ref).max()), np.asarray(ref)


def test_absorbed_decode_folds_a_kv_b_adapter_and_a_quantized_kernel(zoo):
    """LoRA on ``kv_b_proj`` (rlx.quant.LoRA attached directly: ``apply_lora`` names GQA's
    projections) and an int8 ``kv_b_proj`` in the first layer: decode steps (absorbed) equal the
    forward pass (expanded); absorbed == expanded on each layer, adapter on and off, in the
    learner's and in the engine's ``[out, in]`` layout, and under a W8A8 activation quantizer
    (with an adapter too: the base term on the quantized latents, the adapter's on the plain)."""
    model = from_hf(make_hf_model("deepseek_v3", zoo))
    _kv_b_adapters(model)
    lin = model.layers[0].self_attn.kv_b_proj
    lin.kernel = quantize_array(lin.kernel[...], "int8", axes=lin.axes)
    assert _decode_vs_forward(model) <= 1e-5
    for layout in ("in_out", "out_in"):
        if layout == "out_in":
            to_out_in(model)  # float kernels [out, in]; the int8 one keeps its layout
            assert model.layers[1].self_attn.kv_b_proj.kernel_layout == "out_in"
        for i, layer in enumerate(model.layers):
            (on, with_lora), (off, base) = (_absorbed_vs_expanded(layer.self_attn, a)
                                            for a in (True, False))
            assert on <= 1e-5 and off <= 1e-5, (layout, i, on, off)
            assert np.abs(with_lora - base).max() > 1e-2  # the adapter changes the attention
    attn = model.layers[1].self_attn
    attn.kv_b_proj.act_quant = "int8_token"  # the absorbed path quantizes the latents per token
    for adapter in (True, False):  # with the adapter: base and delta absorbed apart
        assert len(attn._absorbed_parts(jnp.float32, adapter)) == (2 if adapter else 1)
        assert _absorbed_vs_expanded(attn, adapter)[0] <= 1e-5


YARN_CASES = {  # (model type, rope dict as checkpoints write it); the width is the class's own
    "deepseek_v3": ("deepseek_v3", dict(factor=40.0, beta_fast=32, beta_slow=1, mscale=1.0,
                                        mscale_all_dim=1.0, rope_theta=10000.0)),
    "kimi_k2_beta_1_1": ("deepseek_v3", dict(factor=32.0, beta_fast=1.0, beta_slow=1.0, mscale=1.0,
                                             mscale_all_dim=1.0, rope_theta=50000.0)),
    "deepseek_v2_mscale": ("deepseek_v3", dict(factor=40.0, mscale=0.707, mscale_all_dim=0.707,
                                               rope_theta=10000.0)),
    "qwen3_long": ("qwen3", dict(factor=4.0, rope_theta=1e6, original_max_position_embeddings=32768)),
    "untruncated_explicit": ("qwen3", dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                           attention_factor=1.3, rope_theta=150000.0)),
    "glm_partial": ("glm4_moe", dict(factor=4.0, rope_theta=1e6, partial_rotary_factor=0.5,
                                     original_max_position_embeddings=32768)),
}


def _hf_rope_config(model_type: str, rope: dict):
    sizes = dict(hidden_size=1024, num_attention_heads=8, max_position_embeddings=131072)
    if model_type == "deepseek_v3":
        sizes.update(qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    else:
        sizes.update(head_dim=128)
    rope = {"rope_type": "yarn", "original_max_position_embeddings": 4096, **rope}
    return transformers.AutoConfig.for_model(model_type, **sizes, rope_parameters=rope)


@pytest.mark.parametrize("case", YARN_CASES)
def test_yarn_matches_transformers(case):
    model_type, rope = YARN_CASES[case]
    hf = _hf_rope_config(model_type, rope)
    inv_ref, scale_ref = ROPE_INIT_FUNCTIONS["yarn"](hf)
    ours = _rlx_config(hf)
    inv = rope_inv_freq(ours.rope, ours.rotary_dim)
    assert inv.shape == tuple(inv_ref.shape)
    np.testing.assert_allclose(inv, inv_ref.numpy(), rtol=1e-6, atol=0)
    assert abs(ours.rope.cos_sin_scale() - scale_ref) <= 1e-12
    if ours.mla is not None:  # only MLA folds mscale_all_dim into its softmax scale
        assert abs(ours.rope.softmax_mscale() - yarn_apply_mscale(hf.rope_parameters, 1.0)) <= 1e-12


def test_correction_bias_is_a_frozen_buffer_in_both_modes(zoo):
    path = make_hf_model("deepseek_v3", zoo)
    model = from_hf(path)
    bias = model.layers[1].mlp.correction_bias
    assert isinstance(bias, CorrectionBias) and not isinstance(bias, nnx.Param)
    for mode, trainable in MODES.items():
        _, params, frozen = nnx.split(model, trainable, ...)
        trained = {"/".join(map(str, k)) for k, _ in nnx.to_flat_state(params)}
        kept = {"/".join(map(str, k)) for k, _ in nnx.to_flat_state(frozen)}
        assert "layers/1/mlp/correction_bias" not in trained, mode
        assert "layers/1/mlp/correction_bias" in kept, mode
    # saved with the weights, in f32, equal to the checkpoint's
    tensors = hf_state_dict(model, dtype=np.float16)
    saved = tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert saved.dtype == np.float32
    np.testing.assert_array_equal(saved, hf.model.layers[1].mlp.gate.e_score_correction_bias.numpy())


@pytest.mark.parametrize("family", FAMILIES)
def test_config_round_trips(family):
    cfg = _rlx_config(hf_config(family))
    assert from_hf_config(to_hf_config(cfg)) == cfg


FULL_SCALE = {  # architecture fields of the public releases' config.json (shapes only)
    "DeepSeek-V3": {
        "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
        "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
        "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3},
    "Kimi-K2": {
        "model_type": "deepseek_v3", "vocab_size": 163840, "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1,
        "n_routed_experts": 384, "routed_scaling_factor": 2.827, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
        "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1},
    "GLM-4.5": {
        "model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 5120,
        "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 92,
        "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
        "n_shared_experts": 1, "n_routed_experts": 160, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "use_qk_norm": True, "attention_bias": True,
        "partial_rotary_factor": 0.5},
}


@pytest.mark.parametrize("name", FULL_SCALE)
def test_num_params_at_full_scale_matches_transformers(name):
    """DeepSeek-V3 671.0B, Kimi-K2 1.03T, GLM-4.5 352.8B (without their MTP layers)."""
    fields = dict(FULL_SCALE[name])
    hf = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(hf).num_parameters()
    assert _rlx_config(hf).num_params() == reference


@pytest.mark.parametrize("name", FULL_SCALE)
def test_shrunken_copy_builds_and_runs(name):
    fields = dict(FULL_SCALE[name])
    hf = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    big = _rlx_config(hf)
    small = shrunk(big, ShrinkSection(num_layers=big.first_k_dense_replace + 1))  # one sparse layer
    assert (small.mla is None) == (big.mla is None)
    assert small.first_k_dense_replace == big.first_k_dense_replace
    assert from_hf_config(to_hf_config(small)) == small
    small = dataclasses.replace(small, vocab_size=97)
    model = Transformer(small, rngs=nnx.Rngs(0))
    logits = jax.jit(lambda m, x: m(x))(model, jnp.ones((1, 5), jnp.int32))
    assert logits.shape == (1, 5, 97) and bool(jnp.isfinite(logits).all())
