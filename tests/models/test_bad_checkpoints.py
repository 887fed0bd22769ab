"""Broken HF checkpoints give errors that name the tensor / field and the fix."""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from rlx.models import CheckpointError, ModelConfigError, from_hf
from tests.helpers.hf_zoo import make_hf_model


@pytest.fixture()
def folder(tmp_path_factory, tmp_path):
    src = make_hf_model("qwen2", str(tmp_path_factory.mktemp("zoo")))
    dst = str(tmp_path / "model")
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(folder, fn):
    file = os.path.join(folder, "model.safetensors")
    tensors = load_file(file)
    fn(tensors)
    save_file(tensors, file)


def test_missing_tensor_is_named(folder):
    _edit_tensors(folder, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.bias'"):
        from_hf(folder)


def test_shape_mismatch_is_named(folder):
    def shrink(t):
        t["model.layers.0.mlp.up_proj.weight"] = np.zeros((40, 32), np.float32)
    _edit_tensors(folder, shrink)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' has shape \(40, 32\).*\(48, 32\)"):
        from_hf(folder)


def test_unsupported_architecture_is_named(folder):
    cfg_file = os.path.join(folder, "config.json")
    cfg = json.load(open(cfg_file))
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    json.dump(cfg, open(cfg_file, "w"))
    with pytest.raises(ModelConfigError, match="GPTNeoXForCausalLM.*supports.*LlamaForCausalLM"):
        from_hf(folder)


def test_missing_config_field_is_named(folder):
    cfg_file = os.path.join(folder, "config.json")
    cfg = json.load(open(cfg_file))
    del cfg["hidden_size"]
    json.dump(cfg, open(cfg_file, "w"))
    with pytest.raises(ModelConfigError, match="missing required field 'hidden_size'"):
        from_hf(folder)


def test_truncated_safetensors_is_refused(folder):
    file = os.path.join(folder, "model.safetensors")
    size = os.path.getsize(file)
    with open(file, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        from_hf(folder)


def test_no_weights_in_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises((CheckpointError, ModelConfigError)):
        from_hf(str(tmp_path))


BAD_OPTIONS = [  # (family, config.json edit, what the error names: the field and the supported values)
    ("deepseek_v3", {"scoring_func": "softmax"}, r"scoring_func='softmax'.*\['sigmoid'\]"),
    ("deepseek_v3", {"topk_method": "group_limited_greedy"},
     r"topk_method='group_limited_greedy'.*\['noaux_tc'\]"),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
     r"rope_type='longrope'.*\['default', 'linear', 'llama3', 'yarn'\]"),
    ("glm4_moe", {"hidden_act": "gelu"}, r"hidden_act='gelu'.*\['silu', 'swish'\]"),
    ("glm4_moe", {"n_group": 3}, r"n_group=3 must divide n_routed_experts=8"),
    ("qwen2", {"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0\.5.*Glm4MoeForCausalLM"),
    # Llama / Qwen3 attention_bias also biases o_proj (transformers), which rlx's GQA has not
    ("llama", {"attention_bias": True}, r"attention_bias=True.*LlamaForCausalLM.*\[False\]"),
    ("gpt_oss", {"layer_types": ["sliding_attention", "chunked_attention"] * 2},
     r"layer_types\[...\]='chunked_attention'.*GptOssForCausalLM.*"
     r"\['sliding_attention', 'full_attention'\]"),
    ("gpt_oss", {"layer_types": ["sliding_attention", "full_attention"]},
     r"layer_types has 2 entries; num_hidden_layers=4"),
    ("gpt_oss", {"sliding_window": None}, r"sliding layers \[0, 2\] need a positive sliding_window"),
    ("gpt_oss", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     r"rope_type='dynamic'.*\['default', 'linear', 'llama3', 'yarn'\]"),
]


@pytest.mark.parametrize("family, edit, message", BAD_OPTIONS)
def test_unsupported_option_is_refused_before_the_weights(tmp_path_factory, tmp_path, family, edit,
                                                          message):
    """The weights file is garbage: an error naming the config field shows that the config was
    checked before a single weight was read."""
    dst = str(tmp_path / "model")
    shutil.copytree(make_hf_model(family, str(tmp_path_factory.mktemp("zoo"))), dst)
    cfg_file = os.path.join(dst, "config.json")
    cfg = json.load(open(cfg_file)) | edit
    json.dump(cfg, open(cfg_file, "w"))
    with open(os.path.join(dst, "model.safetensors"), "wb") as f:
        f.write(b"not a safetensors file")
    with pytest.raises(ModelConfigError, match=message):
        from_hf(dst)
