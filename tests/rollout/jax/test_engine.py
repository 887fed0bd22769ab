"""The built-in JAX engine: learner log-prob parity, greedy = HF, sampling statistics, stops,
padding, bucketed compilation, weight updates and a sharded mesh.

Tolerances: sampler log-probs vs the learner's ``make_logprob_step`` <= 1e-5 in f32 (both modes;
bf16 figures are printed). Chi-square tests reject at p < 1e-3 (scipy.stats.chisquare; bins with
an expected count under 5 are merged into one).
"""

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.learner.batching import pad_rollouts
from rlx.mesh import MeshShape, make_mesh, sampling_rules
from rlx.models import from_hf
from rlx.platform.policy import CPU, active
from rlx.quant import GGUFTensor, LoraConfig, QuantConfig, apply_lora, quantize_model
from rlx.quant.quantize import linears
from rlx.rollout.jax.config import JaxSection
from rlx.rollout.jax.engine import Buckets, JaxEngine
from rlx.rollout.jax.sampling import segment_ends
from rlx.types import SamplingParams
from tests.helpers.hf_zoo import make_hf_model
from tests.helpers.parity import TOL, max_diff, parity, sample_prompts, step_logprobs
from tests.helpers.quant import quantized_lora_model, randomize_lora_b


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zoo"))


# gpt_oss: caches of up to 23 slots over a 6-token window (in CI under forced blockwise, below)
@pytest.mark.parametrize("family", ["llama", "qwen3_moe",
                                    pytest.param("gpt_oss", marks=pytest.mark.slow)])
def test_sampler_logprobs_equal_learner_mode_a(zoo, family):
    sampled, scored, preflight = parity(from_hf(make_hf_model(family, zoo)))
    print(f"full mode {family} f32: sampler {sampled:.2e}, score {scored:.2e}")
    assert sampled <= TOL and scored <= TOL and preflight <= TOL


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "gpt_oss"])
def test_sampler_logprobs_equal_learner_with_blockwise_attention(zoo, family):
    """Every attention call over more than one token blockwise in 16-token blocks
    (rlx.kernels.attention): the engine's prefill and scoring over its cache and the learner's
    forward pass (decode steps attend their one query densely either way)."""
    policy = dataclasses.replace(CPU, dense_attention_slots=0, attention_block=16)
    with active(policy):
        sampled, scored, preflight = parity(from_hf(make_hf_model(family, zoo)))
    assert sampled <= TOL and scored <= TOL and preflight <= TOL


@pytest.mark.parametrize("family,fmt", [  # gpt_oss: LoRA on attention and every expert
    ("llama", "int4"), ("qwen3_moe", "int8"), pytest.param("gpt_oss", "int8", marks=pytest.mark.slow)])
def test_sampler_logprobs_equal_learner_mode_b(zoo, family, fmt):
    model = quantized_lora_model(zoo, family, QuantConfig(format=fmt, group_size=8))
    sampled, scored, _ = parity(model)
    print(f"LoRA mode {family} {fmt} + LoRA f32: sampler {sampled:.2e}, score {scored:.2e}")
    assert sampled <= TOL and scored <= TOL


def _gguf_blocks(w: np.ndarray, qtype: str, kernel: bool) -> GGUFTensor:
    """``w`` (an rlx kernel ``[in, out]``, or an embedding ``[vocab, d]``) as GGUF blocks."""
    rows = np.ascontiguousarray(w.T if kernel else w)  # blocks run along the contraction axis
    blocks = gguf.quants.quantize(rows, gguf.GGMLQuantizationType[qtype])
    return GGUFTensor(qtype, rows.shape, jnp.asarray(blocks), None, kernel=kernel)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_sampler_logprobs_equal_learner_on_gguf_blocks(zoo, qtype):
    """Mode B on a base of GGUF blocks (the tied embedding and every projection whose input size
    is a multiple of 32): the engine's few-row products read the blocks (``rows_product``), the
    learner's dequantize them; log-probs agree within 1e-5."""
    model = from_hf(make_hf_model("llama_tied", zoo))
    for lin in linears(model):
        if lin.kernel.shape[0] % 32 == 0:
            lin.kernel = _gguf_blocks(np.asarray(lin.kernel[...]), qtype, kernel=True)
    model.embed = _gguf_blocks(np.asarray(model.embed[...]), qtype, kernel=False)
    apply_lora(model, LoraConfig(rank=3, alpha=5.0), nnx.Rngs(0))
    randomize_lora_b(model)
    sampled, scored, _ = parity(model)
    print(f"LoRA mode {qtype} blocks + LoRA f32: sampler {sampled:.2e}, score {scored:.2e}")
    assert sampled <= TOL and scored <= TOL


def test_a_cache_grown_per_segment_samples_what_the_learner_scores(zoo):
    """100 new tokens decode in the 128-token bucket's four segments (the KV cache grows from
    prompt + 32 to prompt + 128 slots); sampled rows keep learner parity and greedy rows equal
    HF ``generate`` across every segment boundary."""
    assert segment_ends(128) == (32, 64, 96, 128) and segment_ends(16) == (16,)
    path = make_hf_model("llama", zoo)
    model = from_hf(path)
    sampled, scored, _ = parity(model, SamplingParams(max_new_tokens=100, n=2, seed=4))
    print(f"four-segment decode, llama f32: sampler {sampled:.2e}, score {scored:.2e}")
    assert sampled <= TOL and scored <= TOL
    prompts = sample_prompts((5, 9), seed=2)
    refs = [_hf_greedy(path, list(p.token_ids), 100) for p in prompts]
    greedy = JaxEngine(model).generate(
        prompts, SamplingParams(max_new_tokens=100, temperature=0.0, stop_token_ids=refs[0][1]))
    for p, r, (ref, _) in zip(prompts, greedy, refs):
        assert r.completion_ids.tolist() == ref, p.uid
    assert max(len(r.completion_ids) for r in greedy) > 32  # past the first segment


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_bf16_logprob_figures(zoo, mode):
    """Reported, loosely bounded: bf16 compute rounds differently in a [B, T] and a 1-token pass."""
    model = from_hf(make_hf_model("llama", zoo), jnp.bfloat16)
    if mode == "lora":
        quantize_model(model, QuantConfig(format="int4", group_size=8))
        apply_lora(model, LoraConfig(rank=3, alpha=5.0, param_dtype="bfloat16"), nnx.Rngs(0))
        randomize_lora_b(model)
    sampled, scored, _ = parity(model)
    print(f"mode {mode} llama bf16: sampler max |diff| {sampled:.3e}, score {scored:.3e}")
    assert sampled < 0.1 and scored < 0.1


def _hf_greedy(path, prompt, n):
    """HF ``generate``'s greedy completion, cut after its first EOS, and the EOS ids."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt):]
    eos_id = hf.generation_config.eos_token_id
    eos = () if eos_id is None else tuple(np.atleast_1d(eos_id).tolist())
    out = out.tolist()
    ends = [i for i, t in enumerate(out) if t in eos]
    return (out[:ends[0] + 1] if ends else out), eos


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # qwen3: the head is tied to the embedding
def test_out_in_weights_sample_what_the_learner_layout_samples(zoo, family):
    model = from_hf(make_hf_model(family, zoo))
    engines = {layout: JaxEngine(model, weight_layout=layout) for layout in ("in_out", "out_in")}
    gate = model.layers[0].mlp.gate_proj  # [hidden, intermediate]: not square
    held = engines["out_in"]._state["layers"][0]["mlp"]["gate_proj"]["kernel"][...]
    assert held.shape != gate.kernel[...].shape
    np.testing.assert_array_equal(held, gate.kernel[...].T)
    assert gate.kernel_layout == "in_out"  # the learner's model is left as it was
    sampling = SamplingParams(max_new_tokens=10, n=2, seed=6)
    rows, cols = (engines[layout].generate(sample_prompts(), sampling)
                  for layout in ("in_out", "out_in"))
    for a, b in zip(rows, cols):
        assert a.completion_ids.tolist() == b.completion_ids.tolist()
        assert np.abs(a.sampler_logp - b.sampler_logp).max() <= TOL
    assert max_diff(step_logprobs(model, cols), [r.sampler_logp for r in cols]) <= TOL
    with pytest.raises(ValueError, match="weight layout 'rows' is not one of"):
        JaxEngine(model, weight_layout="rows")


def test_the_engine_copies_each_learner_weight_once(zoo):
    """The engine owns its weights (the learner may donate its buffers), and a kernel it has just
    transposed into a new buffer is not copied a second time."""
    from rlx.rollout.jax.decode_layout import transpose_update

    model = from_hf(make_hf_model("llama", zoo))
    engine = JaxEngine(model, weight_layout="out_in")
    learner = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    update = dict(nnx.to_flat_state(transpose_update(nnx.state(model, nnx.Param), engine._transposed)))
    placed = engine._place(nnx.from_flat_state(list(update.items())), None,
                           fresh=engine._transposed)
    assert engine._transposed and set(update) - engine._transposed
    for path, var in nnx.to_flat_state(placed):
        held = var[...]
        if path in engine._transposed:
            assert held is update[path][...], path
        else:
            assert held.unsafe_buffer_pointer() != learner[path][...].unsafe_buffer_pointer(), path
        np.testing.assert_array_equal(held, update[path][...])


@pytest.mark.parametrize("fmt", ["none", "int4"])
def test_shared_variables_are_the_callers_arrays(zoo, fmt):
    """LoRA mode's frozen base is read in place (``shared``): the engine holds the caller's very
    arrays, float kernels in the learner's layout even where the engine's own copy would be
    transposed; only the adapters are copied, and an adapter update replaces only them."""
    q = QuantConfig(format=fmt, group_size=8)
    model = quantized_lora_model(zoo, "llama", q, LoraConfig(rank=3, alpha=5.0))
    engine = JaxEngine(model, weight_layout="out_in", shared=nnx.Not(nnx.LoRAParam))
    frozen = dict(nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.LoRAParam))))
    adapters = dict(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)))
    held = dict(nnx.to_flat_state(engine._state))
    assert set(held) == set(frozen) | set(adapters) and not engine._transposed
    assert all(held[p][...] is v[...] for p, v in frozen.items())
    for path, var in adapters.items():
        assert held[path][...].unsafe_buffer_pointer() != var[...].unsafe_buffer_pointer()
        np.testing.assert_array_equal(held[path][...], var[...])
    sampling = SamplingParams(max_new_tokens=8, n=2, seed=4)
    rollouts = engine.generate(sample_prompts(), sampling)
    compiled = engine.compilations()
    assert max_diff(step_logprobs(model, rollouts), [r.sampler_logp for r in rollouts]) <= TOL
    randomize_lora_b(model, seed=7)
    engine.update_weights(nnx.state(model, nnx.LoRAParam), version=1)
    after = dict(nnx.to_flat_state(engine._state))
    assert all(after[p][...] is v[...] for p, v in frozen.items())
    tuned = engine.generate(sample_prompts(), sampling)
    assert engine.compilations() == compiled  # an update of the same shapes compiles nothing
    assert max_diff(step_logprobs(model, tuned), [r.sampler_logp for r in tuned]) <= TOL


def test_every_weight_layout_of_the_config_is_an_engine_layout():
    from rlx.errors import ConfigError
    from rlx.rollout.config import RolloutSection
    from rlx.rollout.jax.decode_layout import LAYOUTS

    for layout in LAYOUTS:
        RolloutSection(weight_layout=layout).validate()
    with pytest.raises(ConfigError, match="rollout.weight_layout"):
        RolloutSection(weight_layout="rows").validate()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_greedy_equals_transformers(zoo, family):
    path = make_hf_model(family, zoo)
    prompts = sample_prompts((5, 2, 9), seed=1)
    engine = JaxEngine(from_hf(path))
    refs = [_hf_greedy(path, list(p.token_ids), 12) for p in prompts]
    sampling = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=refs[0][1])
    for p, r, (ref, _) in zip(prompts, engine.generate(prompts, sampling), refs):
        assert r.completion_ids.tolist() == ref, p.uid
        assert r.finish_reason == ("stop" if len(ref) < 12 else "length")


def _first_token_probs(model, prompt, temperature=1.0):
    logits = model(jnp.asarray([prompt]))[0, -1].astype(jnp.float32) / temperature
    return np.asarray(jax.nn.softmax(logits), np.float64)


def _chi2_pvalue(samples, probs) -> float:
    from scipy import stats

    counts = np.bincount(samples, minlength=len(probs)).astype(np.float64)
    expected = probs / probs.sum() * len(samples)
    small = expected < 5
    counts = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    return float(stats.chisquare(counts[keep], expected[keep]).pvalue)


def _nucleus(probs, top_p):
    order = np.argsort(-probs)
    before = np.cumsum(probs[order]) - probs[order]
    return order[before < top_p]


@pytest.mark.parametrize("case", ["t1", "t0.7", "top_k", "top_p", "top_k_top_p"])
def test_sampling_matches_model_distribution(zoo, case):
    """First-token samples vs the (tempered, truncated) softmax; support restricted exactly."""
    model = from_hf(make_hf_model("llama", zoo))
    engine = JaxEngine(model, buckets=Buckets(max_rows=2048))
    prompt = sample_prompts((4,), seed=5)[0]
    temperature = 0.7 if case == "t0.7" else 1.0
    top_k = 5 if "top_k" in case else None
    top_p = 0.6 if "top_p" in case else None
    sampling = SamplingParams(max_new_tokens=1, n=4000, temperature=temperature, top_k=top_k,
                              top_p=top_p, seed=11)
    samples = np.array([r.completion_ids[0] for r in engine.generate([prompt], sampling)])
    probs = _first_token_probs(model, list(prompt.token_ids), temperature)
    allowed = np.arange(len(probs))
    if top_k:
        allowed = np.argsort(-probs)[:top_k]
    if top_p:
        restricted = np.zeros_like(probs)
        restricted[allowed] = probs[allowed]
        allowed = _nucleus(restricted / restricted.sum(), top_p)
    target = np.zeros_like(probs)
    target[allowed] = probs[allowed]
    assert set(samples.tolist()) <= set(allowed.tolist())
    if top_k or top_p:
        assert len(allowed) < len(probs) / 4  # the cut matters
    assert _chi2_pvalue(samples, target) > 1e-3


class _DigitTokenizer:
    """Token i decodes to "<i>": stop strings can end inside a token or span two."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"<{int(i)}>" for i in ids)


def test_stop_token_ids_and_stop_strings(zoo):
    model = from_hf(make_hf_model("llama", zoo))
    engine = JaxEngine(model, tokenizer=_DigitTokenizer())
    prompts = sample_prompts((4, 7), seed=2)
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    free = engine.generate(prompts, greedy)
    ids = free[0].completion_ids.tolist()
    k = next(i for i in range(2, 16) if ids[i] not in ids[:i])  # first occurrence of a new token
    stopped = engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0.0,
                                                      stop_token_ids=(ids[k],)))
    assert stopped[0].completion_ids.tolist() == ids[:k + 1] and stopped[0].finish_reason == "stop"
    np.testing.assert_allclose(stopped[0].sampler_logp, free[0].sampler_logp[:k + 1], atol=TOL)
    other = free[1].completion_ids.tolist()
    if ids[k] not in other:  # the other row is not affected by row 0's stop
        assert stopped[1].completion_ids.tolist() == other and stopped[1].finish_reason == "length"
    # a stop string ending inside token k + 1 (it spans tokens k and k + 1)
    stop = f"{ids[k]}><{str(ids[k + 1])[:1]}"
    first = next(j for j in range(1, 17) if stop in _DigitTokenizer().decode(ids[:j]))
    cut = engine.generate(prompts[:1], SamplingParams(max_new_tokens=16, temperature=0.0,
                                                      stop_strings=(stop,)))[0]
    assert cut.completion_ids.tolist() == ids[:first] and cut.finish_reason == "stop"
    assert len(cut.sampler_logp) == first


def test_padded_prompts_equal_prompts_alone(zoo):
    """Greedy and seeded sampling: batching/padding (prompt buckets 16 and 32) changes nothing."""
    engine = JaxEngine(from_hf(make_hf_model("qwen2", zoo)))
    prompts = sample_prompts((2, 9, 20), seed=3)
    for sampling in (SamplingParams(max_new_tokens=10, temperature=0.0),
                     SamplingParams(max_new_tokens=10, n=2, top_k=20, seed=7)):
        together = engine.generate(prompts, sampling)
        alone = [r for p in prompts for r in engine.generate([p], sampling)]
        for a, b in zip(together, alone):
            assert a.completion_ids.tolist() == b.completion_ids.tolist()
            assert np.abs(a.sampler_logp - b.sampler_logp).max() <= TOL


def test_one_compilation_per_bucket_and_weight_updates(zoo):
    """Lockstep batching: one program per (prompt rows, rows, prompt length, new tokens) bucket
    and sampling mode."""
    model = from_hf(make_hf_model("llama", zoo))
    engine = JaxEngine(model, weight_version=3, settings=JaxSection(batching="lockstep"))
    s = SamplingParams(max_new_tokens=8, n=1, seed=0)
    engine.generate(sample_prompts((3, 5, 7)), s)  # rows 4, prompt 16, new 16
    engine.generate(sample_prompts((9, 2, 4, 12), seed=1), s)  # same bucket
    engine.generate(sample_prompts((5, 6, 7, 8), seed=2), SamplingParams(max_new_tokens=12, seed=1))
    assert engine.compilations() == 1
    engine.generate(sample_prompts((2,)), SamplingParams(max_new_tokens=12, n=3, seed=1))  # rows 4
    assert engine.compilations() == 2  # 4 rows from 1 prefilled prompt row: another program
    engine.generate(sample_prompts((20, 3)), s)  # rows 2, prompt bucket 32
    assert engine.compilations() == 3
    before = engine.generate(sample_prompts((3,)), s)[0]  # rows 1
    assert engine.compilations() == 4
    params = nnx.state(model, nnx.Param)
    new = jax.tree.map(lambda x: x * 1.1, params)  # same shapes and dtypes
    engine.update_weights(new, version=4)
    after = engine.generate(sample_prompts((3,)), s)[0]
    assert engine.compilations() == 4  # new weights, same program
    assert after.weight_version == 4 and before.weight_version == 3
    assert np.abs(after.sampler_logp - before.sampler_logp).max() > 1e-3
    nnx.update(model, new)
    assert max_diff(step_logprobs(model, [after]), [after.sampler_logp]) <= TOL


def test_mode_b_adapter_update_without_recompilation(zoo):
    model = quantized_lora_model(zoo, "llama", QuantConfig(format="int8", group_size=8),
                                 LoraConfig(rank=3, alpha=5.0), randomize=False)
    engine = JaxEngine(model)
    s = SamplingParams(max_new_tokens=8, temperature=0.0)
    base = engine.generate(sample_prompts(), s)
    compiled = engine.compilations()
    randomize_lora_b(model, scale=0.5)
    engine.update_weights(nnx.state(model, nnx.LoRAParam), version=1)
    tuned = engine.generate(sample_prompts(), s)
    assert engine.compilations() == compiled
    assert any(a.completion_ids.tolist() != b.completion_ids.tolist() for a, b in zip(base, tuned))
    assert max_diff(step_logprobs(model, tuned), [r.sampler_logp for r in tuned]) <= TOL


@pytest.mark.parametrize("family,shape,full", [
    ("llama", MeshShape(data=2, fsdp=2, tensor=2), False),
    ("qwen3_moe", MeshShape(data=2, tensor=2, expert=2), False),
    # an asynchronous full-mode run's copy: the fsdp devices split heads as tensor ones do
    ("llama", MeshShape(data=2, fsdp=2, tensor=2), True)], ids=["llama", "qwen3_moe", "llama-full"])
def test_sharded_mesh_gives_the_same_tokens(zoo, family, shape, full):
    path = make_hf_model(family, zoo)
    sampling = SamplingParams(max_new_tokens=10, n=2, top_p=0.9, seed=5)
    single = JaxEngine(from_hf(path)).generate(sample_prompts(), sampling)
    mesh = make_mesh(shape)
    rules = sampling_rules("full" if full else "lora", full)
    engine = JaxEngine(from_hf(path, mesh=mesh), mesh=mesh, rules=rules)
    sharded = engine.generate(sample_prompts(), sampling)
    kernel = engine._state["layers"][0]["self_attn"]["q_proj"]["kernel"][...]
    heads = 0 if engine.weight_layout == "out_in" else 1  # the engine's copy: [heads, embed] on CPU
    split = 4 if full else 2  # over tensor (and fsdp)
    assert kernel.addressable_shards[0].data.shape[heads] == kernel.shape[heads] // split
    assert engine.batching_stats().drawn > 0  # served continuously, a page pool per data shard
    pool = engine._paged._scheduler.pools.keys[0]
    assert pool.addressable_shards[0].data.shape[-4] == pool.shape[-4] // engine._data_parallel()
    for a, b in zip(single, sharded):
        assert a.completion_ids.tolist() == b.completion_ids.tolist()
        assert np.abs(a.sampler_logp - b.sampler_logp).max() <= TOL
    seqs = [(np.concatenate([r.prompt_ids, r.completion_ids]), len(r.prompt_ids)) for r in sharded]
    assert max_diff(engine.score(seqs), [r.sampler_logp for r in sharded]) <= TOL


def test_data_shards_preempt_in_their_own_pools(zoo):
    """4 data shards x tensor 2, each shard's pool too small for both of its slots' sequences:
    samples are preempted and recomputed in their shard, and every request's tokens are those
    of one device with room to spare."""
    path = make_hf_model("llama", zoo)
    prompts = sample_prompts((3, 11, 6, 17, 9, 4), seed=2)
    sampling = SamplingParams(max_new_tokens=20, n=2, seed=5)
    single = JaxEngine(from_hf(path)).generate(prompts, sampling)
    mesh = make_mesh(MeshShape(data=2, fsdp=2, tensor=2))
    tight = JaxSection(slots=8, page_size=4, kv_pages=13)  # 12 pages of 4 tokens per shard
    engine = JaxEngine(from_hf(path, mesh=mesh), mesh=mesh, settings=tight)
    sharded = engine.generate(prompts, sampling)
    assert engine.batching_stats().preempted > 0
    assert all(d.pool.free == d.pool.pages - 1 for d in engine._paged._scheduler.shards)
    for a, b in zip(single, sharded):
        assert a.completion_ids.tolist() == b.completion_ids.tolist()
        assert np.abs(a.sampler_logp - b.sampler_logp).max() <= TOL


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_samples_of_a_prompt_share_its_prefill(zoo, temperature, monkeypatch):
    """``n`` samples of each prompt prefill each prompt once (fewer prompt rows than rows) and
    give what one prompt row per request gives: the same tokens, log-probs within 1e-5."""
    from rlx.rollout.jax import batching
    from rlx.rollout.jax import engine as jax_engine

    model = from_hf(make_hf_model("llama", zoo))
    prompts = sample_prompts((3, 9, 5))
    reqs = [(p, j) for p in prompts for j in range(4)]
    pow2 = lambda n: 1 << (n - 1).bit_length()  # noqa: E731
    distinct, prompt_rows, of_row = batching.shared_prompts(reqs, 16, pow2)
    assert [p.uid for p in distinct] == ["p0", "p1", "p2"] and prompt_rows == 4
    assert of_row.tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [-1] * 4
    assert batching.shared_prompts([reqs[0], reqs[4]], 2, pow2)[2].tolist() == [0, 1]  # distinct
    sampling = SamplingParams(max_new_tokens=10, n=4, seed=5, temperature=temperature)
    shared = JaxEngine(model).generate(prompts, sampling)
    real = batching.shared_prompts
    monkeypatch.setattr(jax_engine, "shared_prompts",
                        lambda reqs, rows, bucket: real(reqs, rows, lambda n: rows))
    alone = JaxEngine(model).generate(prompts, sampling)  # a prompt row per request
    for a, b in zip(shared, alone):
        assert a.sample_index == b.sample_index
        assert a.completion_ids.tolist() == b.completion_ids.tolist()
        assert np.abs(a.sampler_logp - b.sampler_logp).max() <= TOL
    assert max_diff(step_logprobs(model, shared), [r.sampler_logp for r in shared]) <= TOL


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_without_logprobs_the_same_tokens_and_nan_logprobs(zoo, temperature):
    """``SamplingParams(logprobs=False)`` samples the same tokens (same seed) and returns NaN
    log-probs marked as skipped, which a training batch refuses with the fix named (NaN log-probs
    of a diverged policy still batch: the numerics guard handles those)."""
    model = from_hf(make_hf_model("llama", zoo))
    engine = JaxEngine(model)
    sampling = SamplingParams(max_new_tokens=10, n=2, seed=7, temperature=temperature)
    with_lp = engine.generate(sample_prompts(), sampling)
    without = engine.generate(sample_prompts(), dataclasses.replace(sampling, logprobs=False))
    for a, b in zip(with_lp, without):
        assert a.completion_ids.tolist() == b.completion_ids.tolist()
        assert np.isfinite(a.sampler_logp).all() and np.isnan(b.sampler_logp).all()
        assert a.has_logprobs and not b.has_logprobs
    with pytest.raises(ValueError, match=r"logprobs=False"):
        pad_rollouts(without, np.zeros(len(without)))
