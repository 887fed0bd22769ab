"""``python -m rlx.bench bigload`` at about 100 MB: the FP8-block DeepSeek-shaped checkpoint it
writes is what DeepSeek ships (transformers' FP8 config, every linear e4m3 with its 128x128
``weight_scale_inv``), the dry-run load keeps it as it is (``quant.format=shipped``), and the
loading process's peak RSS stays within 1.15x the bytes on disk + 1 GiB (issue's bound); with
``--step`` the folder (which carries a tokenizer) trains for one mode-B RL step."""

import json
import math
import os

import pytest

from rlx.bench.bigload import main, reuse_checkpoint
from rlx.models.safetensors_io import SafetensorsFolder


def test_bigload_writes_deepseek_fp8_blocks_and_loads_them_as_shipped(tmp_path, capsys):
    folder, out = tmp_path / "ckpt", tmp_path / "figures.json"
    assert main(["--params", "1e8", "--dir", str(folder), "--json", str(out)]) == 0
    fig = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "base       fp8 (shipped)" in printed and "raw read of the files" in printed
    disk = fig["disk_bytes"]
    with open(folder / "config.json") as f:
        config = json.load(f)
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    t = SafetensorsFolder(str(folder))
    q = "model.layers.1.mlp.experts.3.down_proj"
    assert t.dtype_name(f"{q}.weight") == "F8_E4M3"
    assert t.shape(f"{q}.weight_scale_inv") == (-(-config["hidden_size"] // 128),
                                                 -(-config["moe_intermediate_size"] // 128))
    assert t.dtype_name("lm_head.weight") == "BF16"
    assert 0.08e9 < disk < 0.3e9
    assert fig["peak_rss"] <= 1.15 * disk + 2**30, fig
    assert fig["raw_bytes"] == disk and fig["page_cache"] == "warm", fig  # every shard's bytes
    assert 0 < disk - fig["new_bytes"] < 0.01 * disk, fig  # every tensor (not the headers)
    assert os.path.exists(folder / "config.json")  # --dir: kept
    assert reuse_checkpoint(str(folder), 1e8) == disk  # --reuse takes it as written
    with pytest.raises(ValueError, match=r"config.json differs in \['num_hidden_layers'\]"):
        reuse_checkpoint(str(folder), 1e9)  # another --params: another checkpoint
    shard = next(folder.glob("*.safetensors"))
    os.truncate(shard, shard.stat().st_size - 1)
    with pytest.raises(ValueError, match="cut short"):
        reuse_checkpoint(str(folder), 1e8)


@pytest.mark.slow  # about a minute: three compilations of a 4-layer model on 2 cores
def test_bigload_step_trains_one_mode_b_step_on_the_shipped_base(tmp_path, capsys):
    out = tmp_path / "figures.json"
    assert main(["--params", "1e8", "--json", str(out), "--step", "--step-tokens", "2"]) == 0
    fig = json.loads(out.read_text())
    assert "step " in capsys.readouterr().out
    assert fig["step_skipped"] == 0 and fig["step_sequences"] == 4, fig  # 2 prompts x 2 samples
    assert 4 <= fig["step_tokens"] <= 8 and math.isfinite(fig["step_loss"]), fig
    assert fig["step_grad_norm"] > 0, fig  # the stand-in reward's advantages move the adapter
    assert fig["step_peak_rss"] < 4 * 2**30, fig
