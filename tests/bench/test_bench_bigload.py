"""``python -m rlx.bench bigload`` at about 100 MB: the FP8-block DeepSeek-shaped checkpoint it
writes is what DeepSeek ships (transformers' FP8 config, every linear e4m3 with its 128x128
``weight_scale_inv``), the dry-run load keeps it as it is (``quant.format=shipped``), and the
loading process's peak RSS stays within 1.15x the bytes on disk + 1 GiB (issue's bound)."""

import json
import os

from rlx.bench.bigload import main
from rlx.models.safetensors_io import SafetensorsFolder


def test_bigload_writes_deepseek_fp8_blocks_and_loads_them_as_shipped(tmp_path, capsys):
    folder, out = tmp_path / "ckpt", tmp_path / "figures.json"
    assert main(["--params", "1e8", "--dir", str(folder), "--json", str(out)]) == 0
    fig = json.loads(out.read_text())
    assert "base       fp8 (shipped)" in capsys.readouterr().out
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
    assert os.path.exists(folder / "config.json")  # --dir: kept
