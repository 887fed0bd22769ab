"""DeepSeek-V4 (``DeepseekV4ForCausalLM``, ``rlx.models.families.deepseek_v4``) against
transformers 5.25's class, f32, on a tiny random model whose sizes make every feature bind: a
sliding window (4) shorter than the rows (13), compressed sparse (rate 2: 6 entries, the indexer
keeps 2) and heavily compressed (rate 4) layers with a YaRN ``compress`` rope, shared-KV
attention with a partial rotary (8 of 16), learned sinks, a grouped output projection (2 groups),
3 hyper-connection streams (5 Sinkhorn iterations), two hash-routed and two routed MoE layers
(``sqrtsoftplus``, a shared expert, routed scaling) and a ``swiglu_limit`` that clips. Every
weight, bias, sink and table is random (transformers initialises many of them to zero).

Tolerances: max |logit difference| <= 1e-4 relative to the largest oracle logit (padded rows
compared on their real tokens), 1e-5 for the rlx -> ``to_hf`` -> transformers round trip.
"""

import dataclasses
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from rlx.models.families import deepseek_v4 as v4
from rlx.models.deepseek_v4.hash_moe import HashTable
from rlx.models.hparams import ModelConfigError
from rlx.models.moe import CorrectionBias
from rlx.models.deepseek_v4.model import DeepseekV4
from rlx.quant import LoraConfig, apply_lora
from tests.helpers.deepseek_v4 import TOL, T, hf_logits, ids_of, logits, make_v4

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_v4(str(tmp_path_factory.mktemp("v4")))


def test_logits_match_transformers(tiny):
    ids = ids_of()
    ref = hf_logits(tiny, ids)
    scale = np.abs(ref).max()
    assert scale > 0.5, "oracle logits too small to make the test meaningful"
    out = logits(v4.load(tiny), ids)
    assert np.abs(out - ref).max() <= TOL * scale


def _unbound(model, feature: str):
    """``model`` with ``feature`` switched off (so its binding shows in the logits)."""
    for layer in model.layers:
        a = layer.self_attn
        if feature == "topk" and a.indexer is not None:
            a.indexer.topk = 10 ** 6
        if feature == "limit":
            layer.mlp.experts.limit = layer.mlp.shared_expert.limit = 1e9
        if feature == "window":
            a.a = dataclasses.replace(a.a, window=10 ** 6)
    return model


@pytest.mark.slow
def test_each_feature_binds(tiny):
    """Switched off, the indexer's top-k, the SwiGLU limit and the window each move the logits
    far beyond the tolerance: the parity test exercises them."""
    ids = ids_of()
    out = logits(v4.load(tiny), ids)
    for feature in ("topk", "limit", "window"):
        other = logits(_unbound(v4.load(tiny), feature), ids)
        assert np.abs(out - other).max() > 100 * TOL * np.abs(out).max(), feature


def test_padded_rows_equal_unpadded(tiny):
    """Right-padded rows of several lengths give each real token its unpadded logits."""
    model = v4.load(tiny)
    ids = ids_of(b=2)
    lengths = [T, 7]
    mask = np.zeros_like(ids)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    padded = logits(model, np.where(mask, ids, 0), mask)
    for i, n in enumerate(lengths):
        alone = logits(model, ids[i:i + 1, :n])[0]
        assert np.abs(padded[i, :n] - alone).max() <= 1e-5 * np.abs(alone).max()


def _with_config(src: str, dst, **changes) -> str:
    """A folder holding ``src``'s config.json with ``changes`` and no weights."""
    with open(f"{src}/config.json") as f:
        cfg = json.load(f) | changes
    dst.mkdir(exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.mark.parametrize("field, value, supported", [
    ("hidden_act", "gelu", "['silu']"),
    ("scoring_func", "softmax", "['sqrtsoftplus', 'sigmoid']"),
    ("num_key_value_heads", 2, "[1]"),
    ("n_shared_experts", 2, "[1]"),
    ("layer_types", ["sliding_attention", "full_attention", "sliding_attention",
                     "sliding_attention"], "'compressed_sparse_attention'"),
    ("mlp_layer_types", ["dense", "moe", "moe", "moe"], "['hash_moe', 'moe']"),
    ("rope_parameters", {"rope_type": "llama3", "factor": 8.0}, "['default', 'yarn']"),
])
def test_unsupported_options_are_refused_before_any_weight(tiny, tmp_path, field, value, supported):
    """The folder has no weights: the error comes from config.json alone, naming the field and
    the values rlx implements."""
    path = _with_config(tiny, tmp_path / "bad", **{field: value})
    with pytest.raises(ModelConfigError) as err:
        v4.load(path)
    assert field in str(err.value) and supported in str(err.value)


def test_legacy_compress_ratios_refused_outside_the_class_values(tiny, tmp_path):
    hf = json.load(open(f"{tiny}/config.json"))
    del hf["layer_types"]
    with pytest.raises(ModelConfigError, match=r"compress_ratios\[\.\.\.\]=16 .*\[0, 4, 128\]"):
        v4.from_hf_config(hf | {"compress_ratios": [0, 4, 16, 4]})
    legacy = v4.from_hf_config(hf | {"compress_ratios": [0, 4, 128, 4]})
    assert legacy.layer_types[1:3] == ("compressed_sparse_attention", "heavily_compressed_attention")


def _copy_with(src: str, dst, extra: dict) -> str:
    """``src``'s checkpoint with the tensors ``extra`` added."""
    tensors = load_file(f"{src}/model.safetensors")
    dst.mkdir(exist_ok=True)
    save_file(tensors | extra, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(open(f"{src}/config.json").read())
    return str(dst)


def test_mtp_tensors_are_skipped_with_a_note_and_others_refused(tiny, tmp_path, caplog):
    """A multi-token-prediction layer's tensors are skipped (logged, logits unchanged); a tensor
    rlx would not read is refused rather than ignored."""
    mtp = {"mtp.0.attn.wq_a.weight": np.ones((12, 32), np.float32),
           "mtp.0.enorm.weight": np.ones((32,), np.float32)}
    path = _copy_with(tiny, tmp_path / "mtp", mtp)
    with caplog.at_level(logging.INFO):
        model = v4.load(path)
    assert "multi-token-prediction" in caplog.text
    ids = ids_of()
    assert np.array_equal(logits(model, ids), logits(v4.load(tiny), ids))
    stray = _copy_with(tiny, tmp_path / "stray", {"model.layers.0.attn.wq_c.weight": mtp[
        "mtp.0.attn.wq_a.weight"]})
    with pytest.raises(ModelConfigError, match="wq_c"):
        v4.load(stray)


def test_to_hf_round_trip(tiny, tmp_path):
    """rlx -> ``to_hf`` -> transformers and -> rlx give rlx's logits within 1e-5."""
    model = v4.load(tiny)
    ids = ids_of()
    ours = logits(model, ids)
    out = str(tmp_path / "out")
    v4.to_hf(model, out)
    scale = np.abs(ours).max()
    assert np.abs(hf_logits(out, ids) - ours).max() <= 1e-5 * scale
    assert np.abs(logits(v4.load(out), ids) - ours).max() <= 1e-5 * scale


def _paths(state) -> list[str]:
    return ["/".join(map(str, p)) for p, _ in nnx.to_flat_state(state)]


@nnx.jit
def _lora_grads(model, ids):
    def loss(m):
        return -jnp.take_along_axis(jax.nn.log_softmax(m(ids)), ids[..., None], -1).mean()
    return nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)


@pytest.mark.slow
def test_mode_b_adapts_attention_and_experts_with_indexer_and_compressors_frozen(tiny):
    """LoRA (``rlx.quant.apply_lora``) on the query projections, the routed experts and the
    shared expert: fresh adapters leave the logits unchanged, their gradients flow, and nothing
    of the compressors, the indexer, the correction biases or the hash tables is trainable in
    either mode (mode A trains the compressors, not the indexer)."""
    model = v4.load(tiny)
    ids = ids_of()
    base = logits(model, ids)
    apply_lora(model, LoraConfig(rank=2, targets=("q_a", "q_b", "gate", "up", "down")),
               nnx.Rngs(1))
    assert np.abs(logits(model, ids) - base).max() <= 1e-6 * np.abs(base).max()
    lora = _paths(nnx.state(model, nnx.LoRAParam))
    for i in range(4):
        for part in ("self_attn/q_a_proj", "self_attn/q_b_proj", "mlp/experts/gate_lora",
                     "mlp/experts/down_lora", "mlp/shared_expert/up_proj"):
            assert any(p.startswith(f"layers/{i}/{part}") for p in lora), (i, part)
    assert not any("compressor" in p or "indexer" in p for p in lora)

    grads = _lora_grads(model, jnp.asarray(ids))
    leaves = [np.asarray(g) for _, g in nnx.to_flat_state(grads)]
    assert all(np.isfinite(g).all() for g in leaves) and any(np.abs(g).max() > 0 for g in leaves)
    full = _paths(nnx.state(model, nnx.Param))  # mode A's trainable set
    assert any(p.endswith("compressor/wkv") for p in full)
    assert not any("indexer" in p or p.endswith(("mlp/bias", "tid2eid")) for p in full)


@nnx.jit
def _step(model, ids, positions, segments, caches):
    return model.step(ids, positions, segments, caches)


def test_cached_decode_equals_the_full_forward(tiny):
    """Left-padded prefills (5 and 3 tokens), then one-token steps over a 16-position cache:
    past the window (4), through several compression windows (rates 2 and 4) and the indexer's
    choice; every real position's logits equal the full forward pass's over the unpadded row
    within 1e-5 (relative)."""
    model = v4.load(tiny)
    ids = ids_of()
    full = logits(model, ids)
    b, t = ids.shape
    lens = np.array([5, 3])
    prompt = np.zeros((b, 5), ids.dtype)
    pos, seg = np.zeros((b, 5), np.int32), np.zeros((b, 5), np.int32)
    for i, n in enumerate(lens):
        prompt[i, 5 - n:], pos[i, 5 - n:], seg[i, 5 - n:] = ids[i, :n], np.arange(n), 1
    caches = model.empty_cache(b, 16)
    out, caches = _step(model, jnp.asarray(prompt), jnp.asarray(pos), jnp.asarray(seg), caches)
    got = [[np.asarray(out)[i, 5 - n:]] for i, n in enumerate(lens)]
    for k in range(t - lens.min()):
        p = np.minimum(lens + k, t - 1)[:, None]
        out, caches = _step(model, jnp.asarray(np.take_along_axis(ids, p, 1)), jnp.asarray(p),
                            jnp.ones_like(jnp.asarray(p)), caches)
        for i in range(b):
            if lens[i] + k < t:
                got[i].append(np.asarray(out)[i])
    for i in range(b):
        row = np.concatenate(got[i], axis=0)
        assert row.shape == full[i].shape
        assert np.abs(row - full[i]).max() <= 1e-5 * np.abs(full).max()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(v4.PRESETS))
def test_presets_have_transformers_parameter_count(name):
    """Each published preset reads as rlx's model with exactly transformers' parameter count
    (built on the meta device; buffers such as ``tid2eid`` and the correction biases are not
    parameters in either), and the layer schedule transformers derives."""
    hf = v4.PRESETS[name]
    cfg = v4.from_hf_config(hf)
    theirs = transformers.DeepseekV4Config(**{k: v for k, v in hf.items()
                                              if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        expected = sum(p.numel() for p in transformers.DeepseekV4ForCausalLM(theirs).parameters())
    abstract = nnx.eval_shape(lambda: DeepseekV4(cfg, rngs=nnx.Rngs(0)))
    buffer = lambda v: isinstance(v, HashTable) or type(v) is CorrectionBias  # noqa: E731
    ours = sum(int(np.prod(v.shape)) for _, v in nnx.to_flat_state(nnx.state(abstract))
               if not buffer(v))
    assert ours == expected
    assert list(cfg.layer_types) == theirs.layer_types
    assert list(cfg.mlp_layer_types) == theirs.mlp_layer_types
