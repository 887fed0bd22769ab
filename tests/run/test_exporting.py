"""``python -m rlx.export`` (``rlx.run.exporting``) from a real two-step checkpoint.

The run: a tiny 1-layer llama GGUF file (``write_tiny_gguf``: Q8_0, F16 and F32 tensors) as the
frozen base (``quant.format="gguf"``, served dequantized: ``quant.serving="hf"``) with a LoRA
adapter, trained two steps on a reward that grades the parity of a completion's length (so a
random model gets a mix of right and wrong, and the adapter moves). Oracles: transformers loads
the ``hf`` folder and gives the logits of rlx's model restored from the checkpoint within 1e-4
(f32); PEFT puts the ``peft`` adapter on the ``quantized`` export's base (the GGUF blocks
dequantized) with the same logits within 1e-4, where the bare base is far off; the GGUF LoRA
file holds the restored adapter's factors under the base file's tensor names. The float writer
never held more than one shard (its own accounting in ``rlx_export.json``); bad inputs give one
line on stderr and exit status 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlx.config import parse_config
from rlx.errors import ConfigError
from rlx.mesh import make_mesh
from rlx.models.loading import ModelSection, ShrinkSection
from rlx.models.safetensors_io import SafetensorsFolder, save_sharded
from rlx.rewards import RewardResult, register
from rlx.run.build import build, load_policy
from rlx.run.evaluation import restore_policy
from rlx.run.exporting import KINDS, ExportRequest, check_applies, export_run, find_checkpoint
from tests.helpers import ROOT
from tests.helpers.bad_files import write_tiny_gguf
from tests.helpers.runs import config_dict

REWARD = "export_test_even_length"
TOL = 1e-4  # f32 logits, transformers against rlx
IDS = np.array([[5, 70, 71, 258, 33, 101, 2, 9], [40, 41, 42, 43, 44, 45, 46, 47]])


def _even_length():
    return lambda completion, sample: RewardResult(float(len(completion) % 2 == 0), "parity")


try:
    register(REWARD, _even_length)
except ValueError:  # registered by an earlier import in this process
    pass


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(the run's output folder, its config dict, its adapter after the last step)."""
    root = tmp_path_factory.mktemp("export")
    base = str(root / "tiny.gguf")
    write_tiny_gguf(base)
    cfg = config_dict("tiny", root / "run", **{
        "mesh.data": 8, "data.eval_size": 2, "rollout.max_new_tokens": 6, "train.steps": 2,
        "train.checkpoint_every": 1, "train.sample_every": 0, "train.reward": REWARD,
        "optim.learning_rate": 0.05, "model.path": base, "model.shrink.enabled": False,
        "quant.format": "gguf", "quant.serving": "hf", "data.template": "{prompt}",
        "data.max_prompt_tokens": 40})
    run = build(cfg)
    try:
        run.train()
        adapter = jax.device_get(nnx.state(run.compiled.model(), nnx.LoRAParam))
    finally:
        run.close()
    return str(root / "run"), cfg, adapter


def _restored(cfg: dict, run_dir: str, step: str = ""):
    parsed = parse_config(cfg)
    mesh = make_mesh(parsed.mesh)
    policy, _ = restore_policy(parsed, load_policy(parsed, mesh)[0], mesh,
                               os.path.join(run_dir, "checkpoints", step) if step else run_dir)
    return policy.model()


def _hf_logits(folder: str, adapter: str | None = None) -> np.ndarray:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model.eval()(torch.tensor(IDS)).logits.numpy()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlx.export", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_hf_from_the_command_line_loads_in_transformers(trained, tmp_path):
    run_dir, cfg, adapter = trained
    model = _restored(cfg, run_dir)
    restored = jax.device_get(nnx.state(model, nnx.LoRAParam))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored),
                                                    jax.tree.leaves(adapter)))
    out = tmp_path / "hf"
    proc = _cli("--run", run_dir, "--to", "hf", "--max-shard-size", "4KiB", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines() == [f"exported step 2 as hf (float32) to {out}"]
    assert "export: 100%" in proc.stderr and "weight" in proc.stderr  # the progress bar
    record = json.load(open(out / "rlx_export.json"))
    largest = max(SafetensorsFolder(str(out)).nbytes(n) for n in SafetensorsFolder(str(out)))
    assert record["version"] == "2" and record["dtype"] == "float32" and record["shards"] > 2
    # the writer held one shard at most: 4 KiB, or one tensor alone when that is larger
    assert record["peak_held_bytes"] <= max(4096, largest) < record["bytes"]
    ours = np.asarray(model(jnp.asarray(IDS)))
    assert np.abs(_hf_logits(str(out)) - ours).max() <= TOL


def test_peft_on_the_quantized_base_matches_the_restored_model(trained, tmp_path):
    run_dir, cfg, _ = trained
    quantized = export_run(ExportRequest(run_dir, "quantized", str(tmp_path / "q")))
    peft = export_run(ExportRequest(run_dir, "peft", str(tmp_path / "peft")))
    assert (quantized.step, quantized.dtype, peft.dtype) == (2, "float32", None)
    assert sorted(os.listdir(quantized.path)) == ["adapter", "base", "rlx_export.json"]
    ours = np.asarray(_restored(cfg, run_dir)(jnp.asarray(IDS)))
    base = os.path.join(quantized.path, "base")
    assert np.abs(_hf_logits(base, peft.path) - ours).max() <= TOL
    assert np.abs(_hf_logits(base) - ours).max() > 100 * TOL  # the adapter matters
    mine, theirs = (SafetensorsFolder(os.path.join(p, "adapter_model.safetensors"))
                    for p in (peft.path, os.path.join(quantized.path, "adapter")))
    assert sorted(mine) == sorted(theirs) and all(np.array_equal(mine[k], theirs[k]) for k in mine)


def test_a_step_and_a_dtype_are_chosen(trained, tmp_path):
    run_dir, cfg, _ = trained
    half = export_run(ExportRequest(run_dir, "merged", str(tmp_path / "bf16"), step=1,
                                    dtype="bfloat16"))
    full = export_run(ExportRequest(run_dir, "merged", str(tmp_path / "f32"), step=1))
    last = export_run(ExportRequest(run_dir, "merged", str(tmp_path / "last")))
    assert (half.step, half.dtype, full.dtype, last.step) == (1, "bfloat16", "float32", 2)
    assert json.load(open(os.path.join(half.path, "config.json")))["torch_dtype"] == "bfloat16"
    a, b, c = (SafetensorsFolder(p) for p in (half.path, full.path, last.path))
    assert {a.dtype_name(n) for n in a} == {"BF16"} and {b.dtype_name(n) for n in b} == {"F32"}
    for name in b:  # the same weights, rounded
        assert np.array_equal(np.asarray(a[name]), b[name].astype(a[name].dtype)), name
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not np.array_equal(b[q], c[q])  # step 1's adapter is not step 2's
    step1 = _restored(cfg, run_dir, "1")
    assert np.abs(_hf_logits(full.path) - np.asarray(step1(jnp.asarray(IDS)))).max() <= TOL


def test_the_gguf_lora_file_holds_the_restored_adapter(trained, tmp_path):
    run_dir, cfg, adapter = trained
    done = export_run(ExportRequest(run_dir, "gguf-lora", str(tmp_path / "gg")))
    reader = gguf.GGUFReader(os.path.join(done.path, "adapter.gguf"))
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    assert len(tensors) == 2 * 7  # one layer, seven adapted linears
    model = _restored(cfg, run_dir)
    for module, stored in (("self_attn.v_proj", "attn_v"), ("mlp.down_proj", "ffn_down")):
        lo = getattr(getattr(model.layers[0], module.split(".")[0]), module.split(".")[1]).lora
        np.testing.assert_array_equal(tensors[f"blk.0.{stored}.weight.lora_a"],
                                      np.asarray(lo.lora_a[...]).T)
        np.testing.assert_array_equal(tensors[f"blk.0.{stored}.weight.lora_b"],
                                      np.asarray(lo.lora_b[...]).T)
        assert np.abs(np.asarray(lo.lora_b[...])).max() > 1e-3  # trained, not the zero init


def test_bad_inputs_are_one_line_and_exit_2(trained, tmp_path):
    run_dir, _, _ = trained
    cases = {
        ("--run", str(tmp_path / "nope"), "--to", "hf", str(tmp_path / "o")): "no such folder",
        ("--run", run_dir, "--step", "7", "--to", "hf", str(tmp_path / "o")):
            "--step 7: no checkpoint of that step",
        ("--run", run_dir, "--to", "onnx", str(tmp_path / "o")): "argument --to: invalid choice",
    }
    for args, says in cases.items():
        proc = _cli(*args)
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("rlx.export: error:") and says in lines[0], \
            (args, proc.stderr[-2000:])
    assert not (tmp_path / "o").exists()


def test_the_run_folder_its_checkpoints_or_one_step(trained):
    run_dir, _, _ = trained
    checkpoints = os.path.join(run_dir, "checkpoints")
    assert find_checkpoint(run_dir, None) == (checkpoints, 2)
    assert find_checkpoint(run_dir + "/./", 1) == (checkpoints, 1)
    assert find_checkpoint(checkpoints, None) == (checkpoints, 2)
    assert find_checkpoint(os.path.join(checkpoints, "1"), None) == (checkpoints, 1)
    with pytest.raises(ConfigError, match="is step 1's folder, and --step 2 asks for another"):
        find_checkpoint(os.path.join(checkpoints, "1"), 2)
    with pytest.raises(ConfigError, match="no checkpoint in"):
        find_checkpoint(os.path.dirname(run_dir), None)


def test_an_export_the_run_cannot_give_is_refused():
    tiny = parse_config(config_dict("tiny", "unused"))
    full = parse_config(config_dict("tiny", "unused", **{"train.mode": "full",
                                                         "quant.format": "none",
                                                         "loss.kl_coef": 0.0}))
    for to in ("peft", "quantized", "gguf-lora"):
        with pytest.raises(ConfigError, match=f"--to {to} exports a LoRA adapter.*use --to hf"):
            check_applies(full, to)
    check_applies(full, "hf")
    with pytest.raises(ConfigError, match="random shrunken copy"):
        check_applies(tiny, "gguf-lora")
    with pytest.raises(ConfigError, match="is no export"):
        ExportRequest("run", "onnx", "out")


def test_help_lists_every_export_and_exits_0():
    proc = _cli("--help")
    assert proc.returncode == 0 and not proc.stderr
    lines = proc.stdout.splitlines()
    for kind in KINDS:
        assert sum(line.split()[:1] == [kind] for line in lines) == 1, kind


def test_the_source_dtype_is_the_checkpoints_own(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    json.dump({"model_type": "llama", "torch_dtype": "bfloat16"}, open(folder / "config.json", "w"))
    assert ModelSection(path=str(folder)).source_dtype() == "bfloat16"
    json.dump({"model_type": "llama"}, open(folder / "config.json", "w"))  # no dtype: the tensors'
    save_sharded({"a": np.zeros(3, np.float16), "b": np.zeros(2, np.float16),
                  "c": np.zeros(2, np.float32), "i": np.zeros(9, np.int8)}, str(folder))
    assert ModelSection(path=str(folder)).source_dtype() == "float16"
    assert ModelSection(path="x.gguf").source_dtype() == "float32"
    assert ModelSection(path="x.gguf", param_dtype="bfloat16",
                        shrink=ShrinkSection(enabled=True)).source_dtype() == "bfloat16"
