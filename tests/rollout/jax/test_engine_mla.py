"""The built-in engine on multi-head latent attention models: a tiny DeepSeek-V3 (low-rank
queries, interleaved rope), a DeepSeek-V2-Lite shape with plain queries and interleaved rope, and
a Kimi-K2-like one (one expert group, YaRN), the same language model read from Kimi-K2.5's
vision-language checkpoint (text only), all decoding over the latent KV cache with
``kv_b_proj`` absorbed into the decode steps.

Tolerances: sampler log-probs, the engine's scores and the preflight's learner log-probs vs the
learner's ``make_logprob_step`` <= 1e-5 (f32, the same tokens); greedy tokens equal transformers'
``generate`` exactly. The same bound holds with LoRA adapters on every MLA projection (the
``kv_b_proj`` one folded into the absorbed blocks), int8 / int4 ``kv_b_proj`` kernels and a W8A8
activation quantizer on them, before and after an adapter update. The cache holds ``kv_lora_rank + qk_rope_head_dim`` numbers per token and
layer (the engine's decode loop carries nothing else per slot).
"""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from rlx.mesh import MeshShape, make_mesh
from rlx.models import from_hf
from rlx.quant import LoRA, LoraConfig, quantize_array
from rlx.rollout.jax.engine import JaxEngine
from rlx.rollout.jax.sampler import Knobs, SamplerSpec
from rlx.rollout.jax.sampling import GenerateStatic, generate_batch
from rlx.rollout.jax.stops import Stops
from rlx.rollout.preflight import learner_logprobs
from rlx.types import SamplingParams
from tests.helpers.hf_zoo import hf_config, load_hf_model, make_hf_model
from tests.helpers.parity import max_diff, sample_prompts, step_logprobs

TOL = 1e-5
INTERLEAVED_PLAIN_Q = "deepseek_v2_lite_interleaved"  # q_lora_rank=None with interleaved rope
FAMILIES = ("deepseek_v3", INTERLEAVED_PLAIN_Q, "kimi_k2", "kimi_k25")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zoo"))


def _model_path(zoo: str, family: str) -> str:
    """The zoo's model, or the DeepSeek-V2-Lite shape with DeepSeek's interleaved rope (biases
    perturbed, as the zoo does, so a missing one shows)."""
    if family != INTERLEAVED_PLAIN_Q:
        return make_hf_model(family, zoo)
    path = os.path.join(zoo, family)
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        config = hf_config("deepseek_v2_lite")
        config.rope_interleave = True
        model = transformers.AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    p.add_(0.3 * torch.randn_like(p))
        model.save_pretrained(path)
    return path


def _hf_greedy(path: str, prompts, n: int) -> tuple[list[list[int]], tuple[int, ...]]:
    """transformers' greedy ``generate`` of each prompt alone, cut after its first EOS, and the
    EOS ids."""
    hf = load_hf_model(path)
    eos_id = hf.generation_config.eos_token_id
    eos = () if eos_id is None else tuple(np.atleast_1d(eos_id).tolist())
    outs = []
    for p in prompts:
        with torch.no_grad():
            ids = torch.tensor([list(p.token_ids)])
            out = hf.generate(ids, max_new_tokens=n, do_sample=False)[0, ids.shape[1]:].tolist()
        ends = [i for i, t in enumerate(out) if t in eos]
        outs.append(out[:ends[0] + 1] if ends else out)
    return outs, eos


# CI time: the plain-query shape is slow here (it runs in CI in test_mla_lora and test_deepseek_glm)
ENGINE_CASES = [pytest.param(f, marks=pytest.mark.slow) if f == INTERLEAVED_PLAIN_Q else f
                for f in FAMILIES]


@pytest.mark.parametrize("family", ENGINE_CASES)
def test_latent_cache_sampler_matches_learner_and_greedy_matches_transformers(zoo, family):
    """Three prompts, two samples each: each prompt is prefilled once and its latent cache rows
    copied to its samples (``KVCache.take_rows``); then greedy rows against HF ``generate``."""
    path = _model_path(zoo, family)
    model = from_hf(path, text_only=True)  # Kimi-K2.5: its language model (text families: no-op)
    engine = JaxEngine(model)
    sampling = SamplingParams(max_new_tokens=12, n=2, seed=3)
    rollouts = engine.generate(sample_prompts(), sampling)
    assert all(len(r.completion_ids) == sampling.max_new_tokens for r in rollouts)
    learner = step_logprobs(model, rollouts)
    seqs = [(np.concatenate([r.prompt_ids, r.completion_ids]), len(r.prompt_ids)) for r in rollouts]
    sampled = max_diff(learner, [r.sampler_logp for r in rollouts])
    scored = max_diff(learner, engine.score(seqs))
    preflight = max_diff(learner, learner_logprobs(model, seqs))
    print(f"latent cache {family} f32: sampler {sampled:.2e}, score {scored:.2e}, "
          f"preflight {preflight:.2e}")
    assert sampled <= TOL and scored <= TOL and preflight <= TOL

    prompts = sample_prompts((5, 2, 9), seed=1)
    refs, eos = _hf_greedy(path, prompts, 12)
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0.0,
                                                     stop_token_ids=eos))
    for p, r, ref in zip(prompts, greedy, refs):
        assert r.completion_ids.tolist() == ref, p.uid


def _loop_buffers(engine: JaxEngine, rows: int, prompt: int, new_tokens: int):
    """Shapes of the float buffers of rank >= 3 that the engine's decode loops carry."""
    static = GenerateStatic(engine._graphdef, SamplerSpec(), new_tokens, engine.adapter)
    row = jnp.zeros((rows,), jnp.int32)
    args = (jnp.zeros((rows, prompt), jnp.int32), row + prompt, row, row.astype(jnp.uint32), row,
            jnp.int32(0), Knobs.of(1.0, None, None), jnp.int32(new_tokens),
            Stops(jnp.full((4,), -1, jnp.int32)))
    jaxpr = jax.make_jaxpr(functools.partial(generate_batch, static=static))(engine._state, *args)
    loops = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "while"]
    assert loops
    return [[v.aval.shape for v in e.outvars
             if v.aval.ndim >= 3 and jnp.issubdtype(v.aval.dtype, jnp.floating)] for e in loops]


def test_the_cache_holds_the_latent_and_the_rope_key_only(zoo):
    """Per token and MLA layer ``kv_lora_rank + qk_rope_head_dim`` numbers (16 + 8 here, 512 +
    64 = 576 at DeepSeek-V3's shape): the decode loops' carry holds, per layer, the shared rotary
    keys ``[b, r, s]`` and the latents ``[b, s, c]`` and no per-head buffer."""
    model = from_hf(make_hf_model("deepseek_v3", zoo))
    m, layers = model.config.mla, model.config.num_layers
    rows, prompt, new = 2, 16, 64  # two segments of 32 steps: the cache grows between them
    for loop, end in zip(_loop_buffers(JaxEngine(model), rows, prompt, new), (32, 64)):
        slots = prompt + end
        assert sorted(loop) == sorted([(rows, m.qk_rope_head_dim, slots),
                                       (rows, slots, m.kv_lora_rank)] * layers), loop
        per_token = sum(int(np.prod(s)) for s in loop) // (rows * slots * layers)
        assert per_token == m.kv_lora_rank + m.qk_rope_head_dim == 24


def test_without_logprobs_the_same_tokens(zoo):
    engine = JaxEngine(from_hf(make_hf_model("deepseek_v3", zoo)))
    sampling = SamplingParams(max_new_tokens=8, n=2, seed=7)
    with_lp = engine.generate(sample_prompts(), sampling)
    without = engine.generate(sample_prompts(), dataclasses.replace(sampling, logprobs=False))
    for a, b in zip(with_lp, without):
        assert a.completion_ids.tolist() == b.completion_ids.tolist()
        assert np.isfinite(a.sampler_logp).all() and np.isnan(b.sampler_logp).all()


def test_sharded_mesh_gives_the_same_tokens(zoo):
    """8 devices (data 2, fsdp 2, tensor 2): the latent pages are split over the batch only
    (a pool per data shard), the heads of the absorbed queries over tensor."""
    path = make_hf_model("deepseek_v3", zoo)
    sampling = SamplingParams(max_new_tokens=8, n=2, top_p=0.9, seed=5)
    single = JaxEngine(from_hf(path)).generate(sample_prompts(), sampling)
    mesh = make_mesh(MeshShape(data=2, fsdp=2, tensor=2))
    engine = JaxEngine(from_hf(path, mesh=mesh), mesh=mesh)
    sharded = engine.generate(sample_prompts(), sampling)
    assert engine.batching_stats().drawn > 0  # continuous: a latent page pool per data shard
    for a, b in zip(single, sharded):
        assert a.completion_ids.tolist() == b.completion_ids.tolist()
        assert np.abs(a.sampler_logp - b.sampler_logp).max() <= TOL


def _adapt(lin, seed: int, scale: float = 0.3) -> None:
    """A rank-3 LoRA adapter with a random (non-zero) B on ``lin`` (attached directly, as
    ``rlx.quant.apply_lora`` does for its targets)."""
    d_in, d_out = lin.kernel.shape
    lin.lora = LoRA(d_in, d_out, LoraConfig(rank=3, alpha=5.0), lin.axes, dtype=lin.dtype,
                    rngs=nnx.Rngs(seed))
    b = lin.lora.lora_b
    b.set_value(scale * jax.random.normal(jax.random.key(seed), b.shape, b.dtype))


def _engine_vs_learner(engine: JaxEngine, model, prompts, sampling) -> float:
    rollouts = engine.generate(prompts, sampling)
    return max_diff(step_logprobs(model, rollouts), [r.sampler_logp for r in rollouts])


@pytest.mark.parametrize("act_quant", ["none", "int8_token"])
def test_adapters_and_quantized_kv_b_match_the_learner(zoo, act_quant):
    """LoRA on q_a, q_b, kv_a, kv_b and o of both layers; ``kv_b_proj`` int8 in layer 0 and int4
    in layer 1 (the engine's other kernels are float ``[out, in]`` copies). "int8_token": both
    ``kv_b_proj`` quantize their input per token (W8A8), and layer 1's has no adapter: layer 0's
    decode steps expand (its adapter sees the unquantized latent), layer 1's absorb with the
    cached latents quantized per slot. Then new adapter values through ``update_weights``: no
    recompilation, and still the learner's log-probs."""
    model = from_hf(make_hf_model("deepseek_v3", zoo))
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        for j, lin in enumerate(attn.linears()):
            if not (act_quant != "none" and i == 1 and lin is attn.kv_b_proj):
                _adapt(lin, 10 * i + j)
        kv_b = attn.kv_b_proj
        kv_b.kernel = quantize_array(kv_b.kernel[...], ("int8", "int4")[i], group_size=8,
                                     axes=kv_b.axes)
        kv_b.act_quant = act_quant
    parts = [len(layer.self_attn._absorbed_parts(jnp.float32, True)) for layer in model.layers]
    assert parts == ([1, 1] if act_quant == "none" else [2, 1])  # W8A8 + adapter: two terms
    engine = JaxEngine(model)
    sampling = SamplingParams(max_new_tokens=10, n=2, seed=11)
    first = _engine_vs_learner(engine, model, sample_prompts(), sampling)
    compiled = engine.compilations()
    for i, layer in enumerate(model.layers):  # a learner step's worth of change
        for j, lin in enumerate(layer.self_attn.linears()):
            if lin.lora is not None:
                b = lin.lora.lora_b
                b.set_value(b[...] + 0.2 * jax.random.normal(jax.random.key(100 + 10 * i + j),
                                                             b.shape, b.dtype))
    engine.update_weights(nnx.state(model, nnx.LoRAParam), 1)
    second = _engine_vs_learner(engine, model, sample_prompts(), sampling)
    print(f"latent cache, LoRA + int8/int4 kv_b, act_quant {act_quant}: engine vs learner "
          f"{first:.2e}, after an adapter update {second:.2e}")
    assert engine.compilations() == compiled
    assert first <= TOL and second <= TOL
