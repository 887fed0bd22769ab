"""Float exports stream: ``ShardWriter`` holds at most one shard (its own accounting), writes HF's
shard names and index, and reads back (``SafetensorsFolder``) as written; a fused, interleaved
tensor (gpt-oss ``gate_up_proj``) streams out once and whole, equal to the one transformers saved.
"""

import json
import os

import numpy as np
import pytest

from rlx.io.export import export_merged, read_version
from rlx.models import from_hf
from rlx.models.safetensors_io import SafetensorsFolder, ShardWriter, save_sharded
from tests.helpers.hf_zoo import make_hf_model


def test_the_writer_holds_one_shard_at_most(tmp_path):
    rng = np.random.default_rng(0)
    small = {n: rng.standard_normal(100).astype(np.float32) for n in "abc"}  # 400 bytes each
    big = rng.standard_normal(500).astype(np.float32)  # 2000 bytes: a shard of its own
    tail = rng.standard_normal((10, 10)).astype(np.float32)  # 400 bytes
    writer = ShardWriter(str(tmp_path), max_shard_bytes=1000)
    held = []
    for name, array in [*small.items(), ("big", big), ("tail", tail)]:
        writer.add(name, array)
        held.append(writer.held_bytes)
    names = writer.close()
    # a 400, b 800; c would make 1200 > 1000: [a, b] written, c 400; big would make 2400: [c]
    # written, big 2000 alone; tail would make 2400: [big] written, tail 400; close writes [tail]
    assert held == [400, 800, 400, 2000, 400]
    assert writer.peak_bytes == 2000 and writer.total_bytes == 3600
    assert names == [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)]
    assert sorted(os.listdir(tmp_path)) == sorted(names + ["model.safetensors.index.json"])
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    assert index["metadata"]["total_size"] == 3600
    assert index["weight_map"] == {"a": names[0], "b": names[0], "c": names[1], "big": names[2],
                                   "tail": names[3]}
    back = SafetensorsFolder(str(tmp_path))
    for name, array in [*small.items(), ("big", big), ("tail", tail)]:
        assert np.array_equal(back[name], array), name
    with pytest.raises(ValueError, match="already written"):
        writer.add("a", small["a"])


def test_a_mapping_under_the_limit_is_one_file(tmp_path):
    tensors = {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "y": np.ones(4, np.int8)}
    writer = save_sharded(tensors, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    assert writer.peak_bytes == writer.total_bytes == 24 + 4
    back = SafetensorsFolder(str(tmp_path))
    assert all(np.array_equal(back[k], v) for k, v in tensors.items())


def test_a_fused_interleaved_tensor_streams_out_whole(tmp_path):
    """gpt-oss's ``gate_up_proj`` ``[E, D, 2I]`` is two rlx weights (gate: even columns, up:
    odd); the merged export writes it once, equal to what transformers saved (no adapter: the
    same f32 values)."""
    folder = make_hf_model("gpt_oss", str(tmp_path / "zoo"))
    out = export_merged(from_hf(folder), str(tmp_path / "merged"), "5", max_shard_bytes=20_000)
    hf, ours = SafetensorsFolder(folder), SafetensorsFolder(out)
    fused = [n for n in hf if n.endswith("gate_up_proj")]
    assert fused and set(ours) == set(hf)
    for name in hf:
        assert np.array_equal(ours[name], hf[name]), name
    record = json.load(open(os.path.join(out, "rlx_export.json")))
    assert record["shards"] > 1 and record["peak_held_bytes"] <= max(
        20_000, max(hf.nbytes(n) for n in hf))
    assert read_version(out) == "5"
