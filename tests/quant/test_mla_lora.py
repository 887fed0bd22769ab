"""Mode "lora" on DeepSeek-V3 / Kimi-K2 (multi-head latent attention) and GLM-4.5 MoE.

- PEFT parity (<= 1e-4, f32): HF peft's LoRA, with the target names rlx exports, on the
  transformers model of the dequantized int4 / fp8-128x128 base gives rlx's logits; adapters on
  every MLA projection (q_a, q_b or a plain q, kv_a, kv_b, o), the dense MLP, the shared experts
  and every routed expert.
- Which weights each target adapts (``target_counts``), and a target an architecture lacks (``k`` on
  MLA) refused naming the targets that exist.
- An experts-only int4 base (``quant.modules='experts'``, Kimi-K2-Thinking's release): only the
  routed experts are quantized; its compressed-tensors export names the float modules as
  Kimi's does and reloads bit-identical.
- int4 and fp8-block bases round-trip bit-identical; the sigmoid router and its correction bias
  are written f32 in a bf16 export (routing reads f32 in rlx, transformers and SGLang).
- The merged export loads in transformers (<= 1e-4); the reference is the adapter off, exactly.
"""

import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.errors import ConfigError
from rlx.io.export import export_base, export_merged, export_peft
from rlx.models import from_hf
from rlx.models.config import from_hf_config
from rlx.models.presets import preset_config
from rlx.models.safetensors_io import SafetensorsFolder
from rlx.quant import (LoraConfig, QuantConfig, QuantWeight, apply_lora, load_quantized,
                       quantize_model)
from rlx.quant.config import GQA_TARGETS, MLA_TARGETS, TARGET_MODULES
from rlx.quant.lora import lora_targets, target_counts
from rlx.rollout.sglang.policy import lora_server_args
from rlx.run.checks import check_lora_targets, group_inputs
from tests.helpers.hf_zoo import make_hf_model
from tests.helpers.quant import ids, quantized_lora_model, token_logprobs

TARGETS = {"deepseek_v3": MLA_TARGETS, "kimi_k2": MLA_TARGETS, "glm4_moe": GQA_TARGETS,
           "deepseek_v2_lite": ("q", "kv_a", "kv_b", "o", "gate", "up", "down")}  # no q_lora_rank
BASES = {"int4": QuantConfig(format="int4", group_size=8),  # group 8 divides every zoo width
         "fp8-block128": QuantConfig(format="fp8", fp8_granularity="block128")}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zoo"))


def _lora(family: str) -> LoraConfig:
    return LoraConfig(rank=3, alpha=5.0, targets=TARGETS[family])


@pytest.mark.parametrize("family,base", [pytest.param("deepseek_v3", "int4", marks=pytest.mark.slow),
                                         ("deepseek_v2_lite", "int4"),
                                         ("kimi_k2", "int4"), ("glm4_moe", "int4"),
                                         ("deepseek_v3", "fp8-block128"), ("glm4_moe", "fp8-block128")])
def test_peft_parity(zoo, tmp_path, family, base):
    """rlx logits == HF peft logits on the exported dequantized base + adapter (<= 1e-4)."""
    import peft
    import torch
    import transformers

    lora = _lora(family)
    model = quantized_lora_model(zoo, family, BASES[base], lora)
    hf_base = export_base(model, BASES[base], str(tmp_path / "base"), "v1")  # serving "hf": floats
    adapter = export_peft(model, lora, str(tmp_path / "adapter"), "v1")
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        written = json.load(f)
    attention = {TARGET_MODULES[t] for t in lora.targets} - {"gate_proj", "up_proj", "down_proj"}
    assert set(written["target_modules"]) == attention  # MLP names go by weight (PEFT_REMAPS_MLP_NAMES)
    x = ids()
    ours = np.asarray(model(jnp.asarray(x)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32)
    with torch.no_grad():
        ref = peft.PeftModel.from_pretrained(hf, adapter).eval()(torch.tensor(x)).logits.numpy()
    assert np.abs(ours - np.asarray(model(jnp.asarray(x), adapter=False))).max() > 0.1
    assert np.abs(ours - ref).max() <= 1e-4


def test_targets_adapt_every_mla_projection_and_expert(zoo):
    """deepseek_v3 zoo: 2 layers (the first dense), one shared expert, 8 routed experts."""
    arch = from_hf(make_hf_model("deepseek_v3", zoo)).config
    counts = target_counts(arch, LoraConfig(targets=(*MLA_TARGETS, "k", "q")))
    assert counts == {"q_a": 2, "q_b": 2, "kv_a": 2, "kv_b": 2, "o": 2, "k": 0, "q": 0,
                      "gate": 3, "up": 3, "down": 3}  # dense MLP + shared expert + expert stack
    assert target_counts(arch, LoraConfig(targets=("gate",), experts=False)) == {"gate": 2}
    lite = from_hf(make_hf_model("deepseek_v2_lite", zoo)).config
    assert target_counts(lite, LoraConfig(targets=("q", "q_a"))) == {"q": 2, "q_a": 0}
    model = quantized_lora_model(zoo, "deepseek_v3", lora=_lora("deepseek_v3"), randomize=False)
    adapted = {p for p, _ in lora_targets(model)}
    assert {p for p in adapted if p.startswith("layers/1/")} == {
        *(f"layers/1/self_attn/{m}/lora" for m in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                                                    "kv_b_proj", "o_proj")),
        *(f"layers/1/mlp/shared_expert/{m}/lora" for m in ("gate_proj", "up_proj", "down_proj")),
        *(f"layers/1/mlp/experts/{t}_lora" for t in ("gate", "up", "down"))}
    assert "layers/0/mlp/gate_proj/lora" in adapted  # the dense first layer


def test_a_target_the_architecture_lacks_is_refused(zoo):
    arch = from_hf(make_hf_model("deepseek_v3", zoo)).config
    cfg = types.SimpleNamespace(lora=LoraConfig(targets=GQA_TARGETS))
    with pytest.raises(ConfigError, match=r"\['q', 'k', 'v'\] adapt no module of DeepseekV3ForCausalLM "
                                          r"\(multi-head latent attention\); target only "
                                          r"\['o', 'q_a', 'q_b', 'kv_a', 'kv_b', 'gate', 'up', 'down'\]"):
        check_lora_targets(cfg, arch)
    check_lora_targets(types.SimpleNamespace(lora=LoraConfig(targets=MLA_TARGETS)), arch)
    glm = from_hf(make_hf_model("glm4_moe", zoo)).config
    with pytest.raises(ConfigError, match=r"\['kv_b'\] adapt no module of Glm4MoeForCausalLM"):
        check_lora_targets(types.SimpleNamespace(lora=LoraConfig(targets=("q", "kv_b"))), glm)


def test_group_inputs_of_the_real_architectures():
    """The widths a grouped int4 base must divide: all linears, or the routed experts only."""
    kimi = from_hf_config(preset_config("moonshotai/Kimi-K2-Instruct"))
    assert group_inputs(kimi, "experts") == {"hidden_size": 7168, "moe intermediate_size": 2048}
    assert group_inputs(kimi) == {"hidden_size": 7168, "moe intermediate_size": 2048,
                                  "intermediate_size": 18432, "shared expert intermediate_size": 2048,
                                  "q_lora_rank": 1536, "kv_lora_rank": 512,
                                  "num_heads * v_head_dim": 8192}
    glm = from_hf_config(preset_config("zai-org/GLM-4.5-Air"))
    assert group_inputs(glm)["num_heads * head_dim"] == 96 * 128


def test_experts_only_int4_base(zoo, tmp_path):
    """Only ``mlp/experts/*`` is quantized; the compressed-tensors export ignores the rest as
    Kimi-K2-Thinking's config does and reloads bit-identical with modules='experts'."""
    q = QuantConfig(format="int4", group_size=8, modules="experts", serving="compressed-tensors")
    model = quantize_model(from_hf(make_hf_model("deepseek_v3", zoo)), q)
    quantized = {"/".join(map(str, p[:-1])) for p, _ in nnx.to_flat_state(nnx.state(model, QuantWeight))}
    assert quantized == {f"layers/1/mlp/experts/{m}" for m in ("gate_proj", "up_proj", "down_proj")}
    out = export_base(model, q, str(tmp_path / "base"), "v1")
    with open(os.path.join(out, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["ignore"] == ["lm_head", "re:.*self_attn.*", "re:.*shared_expert.*",
                            r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 8
    names = set(SafetensorsFolder(out))
    assert "model.layers.1.mlp.experts.0.gate_proj.weight_packed" in names
    assert "model.layers.1.self_attn.q_a_proj.weight" in names
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in names
    loaded, q2 = load_quantized(out)
    assert q2.modules == "experts" and q2.format == "int4"
    before = dict(nnx.to_flat_state(nnx.state(model)))
    after = dict(nnx.to_flat_state(nnx.state(loaded.model)))
    assert before.keys() == after.keys()
    for path, var in before.items():
        assert np.array_equal(np.asarray(after[path][...]).view(np.uint8),
                              np.asarray(var[...]).view(np.uint8)), path
    x = jnp.asarray(ids())
    assert np.array_equal(np.asarray(model(x)), np.asarray(loaded.model(x)))


@pytest.mark.parametrize("name,q", [
    ("int4-ct", QuantConfig(format="int4", group_size=8, serving="compressed-tensors")),
    ("fp8-block128", QuantConfig(format="fp8", fp8_granularity="block128", serving="fp8"))])
def test_round_trip_bit_identical_with_an_f32_router(zoo, tmp_path, name, q):
    """A bf16 export of a quantized DeepSeek-V3 base: quantized leaves bit-identical after
    reloading, router and correction bias f32, other float leaves bf16."""
    model = quantize_model(from_hf(make_hf_model("deepseek_v3", zoo)), q)
    out = export_base(model, q, str(tmp_path / "base"), "v1", dtype=jnp.bfloat16)
    folder = SafetensorsFolder(out)
    assert folder.dtype_name("model.layers.1.mlp.gate.weight") == "F32"
    assert folder.dtype_name("model.layers.1.mlp.gate.e_score_correction_bias") == "F32"
    assert folder.dtype_name("model.layers.1.self_attn.kv_a_layernorm.weight") == "BF16"
    loaded, _ = load_quantized(out)
    before = nnx.to_flat_state(nnx.state(model, QuantWeight))
    after = dict(nnx.to_flat_state(nnx.state(loaded.model, QuantWeight)))
    assert len(before) == len(after) > 0
    for path, var in before:
        assert np.array_equal(np.asarray(after[path][...]).view(np.uint8),
                              np.asarray(var[...]).view(np.uint8)), path


def test_a_quantized_checkpoint_is_not_read_as_floats(zoo, tmp_path):
    """DeepSeek-V3's FP8 layout: float loading refuses it (its e4m3 weights without their
    scales would be a wrong model); rlx.quant.load_quantized keeps it as it is."""
    from rlx.models.hf import CheckpointError

    q = QuantConfig(format="fp8", fp8_granularity="block128", serving="fp8")
    out = export_base(quantize_model(from_hf(make_hf_model("deepseek_v3", zoo)), q),
                      q, str(tmp_path / "fp8"), "v1")
    with pytest.raises(CheckpointError, match=r"quant_method='fp8'.*rlx.quant.load_quantized"):
        from_hf(out)
    assert load_quantized(out)[1].fp8_granularity == "block128"


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_k2", "glm4_moe"])
def test_merged_export_loads_in_transformers(zoo, tmp_path, family):
    import torch
    import transformers

    model = quantized_lora_model(zoo, family, lora=_lora(family))
    out = export_merged(model, str(tmp_path / "merged"), "v1")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = ids()
    with torch.no_grad():
        ref = hf(torch.tensor(x)).logits.numpy()
    assert np.abs(np.asarray(model(jnp.asarray(x))) - ref).max() <= 1e-4


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_reference_is_adapter_off_exactly(zoo, family):
    forward = jax.jit(lambda m, x, adapter: token_logprobs(m(x, adapter=adapter), x), static_argnums=2)
    x = jnp.asarray(ids())
    base = quantize_model(from_hf(make_hf_model(family, zoo)), BASES["int4"])
    with_lora = quantized_lora_model(zoo, family, lora=_lora(family))
    ref = np.asarray(forward(with_lora, x, False))
    assert np.array_equal(ref, np.asarray(forward(base, x, False)))
    assert np.abs(np.asarray(forward(with_lora, x, True)) - ref).max() > 1e-2


def test_sglang_lora_flags_name_the_mla_modules(zoo):
    arch = from_hf(make_hf_model("deepseek_v3", zoo)).config
    assert lora_server_args(LoraConfig(rank=4, targets=MLA_TARGETS), arch) == (
        "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_a_proj", "q_b_proj",
        "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_apply_lora_skips_a_missing_projection(zoo):
    """``apply_lora`` itself adapts what exists (the config check refuses the rest)."""
    model = from_hf(make_hf_model("deepseek_v3", zoo))
    apply_lora(model, LoraConfig(targets=("k", "kv_b")), nnx.Rngs(0))
    assert {p for p, _ in lora_targets(model)} == {f"layers/{i}/self_attn/kv_b_proj/lora"
                                                   for i in range(2)}
