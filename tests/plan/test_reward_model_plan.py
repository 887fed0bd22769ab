"""The memory planner counts a run's reward model (``train.reward="reward_model"``): its
per-device bytes on one device are the checkpoint's own tensor bytes (f32, the score head
included, no lm_head), resident in every phase, and split further over FSDP devices."""

from __future__ import annotations

import os

from safetensors.numpy import load_file

from rlx.mesh import MeshShape
from rlx.plan import plan, spec_from_config
from rlx.plan.planner import format_plan
from tests.helpers.classifiers import make_classifier
from tests.helpers.runs import config_dict


def test_the_reward_model_is_counted_with_its_checkpoint_bytes(tmp_path):
    path = make_classifier("llama", str(tmp_path), num_labels=2)
    cfg = config_dict("tiny", tmp_path / "tiny", **{"train.reward": "reward_model",
                                                    "reward_model.path": path})
    spec = spec_from_config(cfg)
    assert spec.reward_model.hidden_size == 32 and spec.reward_model_labels == 2
    counted = plan(spec, 80.0)
    stored = sum(t.nbytes for t in load_file(os.path.join(path, "model.safetensors")).values())
    assert counted.bytes["reward_model"] == stored  # f32 on one device: every stored tensor
    without = plan(spec.replace(reward_model=None), 80.0)
    assert without.bytes["reward_model"] == 0
    for peak in ("train_peak", "sample_peak", "sync_peak"):
        assert getattr(counted, peak) - getattr(without, peak) == stored, peak
    assert "reward_model" in format_plan(counted) and "reward_model" not in format_plan(without)
    split = plan(spec.replace(mesh=MeshShape(fsdp=2)), 80.0).bytes["reward_model"]
    assert split < stored  # hidden (the embed axis) halves over fsdp
