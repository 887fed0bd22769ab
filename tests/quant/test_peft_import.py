"""PEFT warm start (``config.lora.init_from``, ``rlx.quant.peft_import``) against peft itself.

peft writes a randomly initialised LoRA (``init_lora_weights=False``: B is not zero, so a wrong
layout, scale or target shows) for a tiny random HF model; rlx loads the base with that adapter
through the run's own path (``rlx.run.build.load_policy``, the config's rank / alpha / targets
taken from ``adapter_config.json`` by ``rlx.run.checks.with_warm_start``), and its logits must equal peft's on the same base within
1e-4, plain LoRA and rsLoRA. An adapter of another base (other widths, more layers), a module rlx
does not adapt and a DoRA adapter are refused with one line naming them, before any weight is read.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlx.config import parse_config
from rlx.errors import ConfigError
from rlx.mesh import make_mesh
from rlx.run.build import load_policy
from rlx.run.checks import with_warm_start
from tests.helpers.hf_zoo import hf_config, make_hf_model
from tests.helpers.quant import ids

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zoo"))


def write_peft(base: str, out: str, *, seed: int = 0, **lora) -> str:
    """A random peft LoRA (B != 0) on the HF model at ``base``, saved to ``out``."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0, **lora)
    peft.get_peft_model(model, config).save_pretrained(out)
    return out


def peft_logits(base: str, adapter: str, tokens: np.ndarray) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def run_config(base: str, adapter: str, **lora):
    """The run's config as the build takes it: parsed, then the PEFT folder's adapter read."""
    parsed = parse_config({"model": {"path": base}, "quant": {"format": "none"},
                           "mesh": {"data": 8}, "lora": {"init_from": adapter, **lora}})
    return with_warm_start(parsed)


@pytest.mark.parametrize("rslora", [False, True], ids=["lora", "rslora"])
def test_logits_equal_peft_on_the_same_base(zoo, tmp_path, rslora):
    base = make_hf_model("llama", zoo)
    adapter = write_peft(base, str(tmp_path / "adapter"), r=4, lora_alpha=12, use_rslora=rslora,
                         target_modules=ALL if not rslora else ["q_proj", "v_proj", "down_proj"])
    cfg = run_config(base, adapter, rank=16, alpha=1.0)  # the folder's values win
    assert cfg.lora.rank == 4
    assert cfg.lora.alpha == pytest.approx(12 * 2.0 if rslora else 12)  # scale 12 / sqrt(4)
    assert cfg.lora.targets == (("q", "v", "down") if rslora else ("q", "k", "v", "o", "gate", "up",
                                                                   "down"))
    model, _ = load_policy(cfg, make_mesh(cfg.mesh))
    tokens = ids(batch=2, length=9) % 97
    ours = np.asarray(model(tokens))
    theirs = peft_logits(base, adapter, tokens)
    plain = np.asarray(load_policy(parse_config({"model": {"path": base}, "quant": {"format": "none"},
                                                 "mesh": {"data": 8}}), make_mesh(cfg.mesh))[0](tokens))
    assert np.abs(plain - theirs).max() > 1e-2  # the adapter changes the logits
    assert np.abs(ours - theirs).max() <= 1e-4


def test_an_adapter_that_does_not_fit_the_base_is_refused_naming_it(zoo, tmp_path):
    base = make_hf_model("llama", zoo)
    wide = make_hf_model("llama_wide", zoo)  # hidden 64 instead of 32
    other = write_peft(wide, str(tmp_path / "wide"), r=4, lora_alpha=8, target_modules=ALL)
    with pytest.raises(ConfigError) as e:
        load_policy(run_config(base, other), make_mesh(run_config(base, other).mesh))
    msg = str(e.value)
    assert msg.startswith(f"config.lora.init_from={other!r} does not fit this base") and "\n" not in msg
    assert "model.layers.0.mlp.down_proj lora_A (4, 128)" in msg and "(4, 48)" in msg

    deep_cfg = hf_config("llama")
    deep_cfg.num_hidden_layers = 3  # an adapter of a 3-layer model of the same widths
    deep = str(tmp_path / "deep_base")
    transformers.AutoModelForCausalLM.from_config(deep_cfg).save_pretrained(deep)
    deeper = write_peft(deep, str(tmp_path / "deep"), r=4, lora_alpha=8, target_modules=["q_proj"])
    with pytest.raises(ConfigError, match=r"modules the base lacks: \['model.layers.2.self_attn.q_proj'\]"):
        load_policy(run_config(base, deeper), make_mesh(run_config(base, deeper).mesh))


def test_adapters_rlx_cannot_hold_are_refused_naming_them(zoo, tmp_path):
    base = make_hf_model("llama", zoo)
    head = write_peft(base, str(tmp_path / "head"), r=4, lora_alpha=8,
                      target_modules=["q_proj", "lm_head"])
    with pytest.raises(ConfigError, match=r"adapts \['lm_head'\], which rlx's LoRA does not target"):
        run_config(base, head)
    dora = write_peft(base, str(tmp_path / "dora"), r=4, lora_alpha=8, target_modules=["q_proj"],
                      use_dora=True)
    with pytest.raises(ConfigError, match=r"cannot hold use_dora=True"):
        run_config(base, dora)
    with pytest.raises(ConfigError, match="is not a PEFT adapter folder"):
        run_config(base, str(tmp_path))
    unread = parse_config({"model": {"path": base}, "lora": {"init_from": str(tmp_path / "none")}})
    assert unread.lora.rank == 8  # parsing reads no adapter folder: the build's checks do
    with pytest.raises(ConfigError, match="is not a PEFT adapter folder"):
        with_warm_start(unread)
    with pytest.raises(ConfigError, match="needs train.mode='lora'"):
        parse_config({"model": {"path": base}, "quant": {"format": "none"}, "loss": {"kl_coef": 0.0},
                      "train": {"mode": "full"}, "lora": {"init_from": head}})


def test_gpt_oss_attention_adapter_equals_peft(zoo, tmp_path):
    """gpt-oss (biased projections, sinks, sliding layers) with a peft LoRA on q/k/v/o: peft
    names those modules as rlx does (its experts are fused parameters, not modules)."""
    base = make_hf_model("gpt_oss", zoo)
    adapter = write_peft(base, str(tmp_path / "adapter"), r=4, lora_alpha=8,
                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    cfg = run_config(base, adapter)
    assert cfg.lora.targets == ("q", "k", "v", "o")
    model, _ = load_policy(cfg, make_mesh(cfg.mesh))
    tokens = ids(batch=2, length=12) % 97  # longer than the 6-token window
    theirs = peft_logits(base, adapter, tokens)
    plain = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        plain = plain(torch.tensor(tokens)).logits.numpy()
    assert np.abs(plain - theirs).max() > 1e-2  # the adapter changes the logits
    assert np.abs(np.asarray(model(tokens)) - theirs).max() <= 1e-4
