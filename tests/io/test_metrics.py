"""Metrics logging: tensorboard scalars and text read back from the event file, JSONL, console."""

from __future__ import annotations

import dataclasses
import glob
import io
import json
import os
import struct
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct as flax_struct

from rlx.io.metrics import LoggerConfig, MetricsLogger, TextSample, read_metrics, to_scalars
from rlx.types import StepMetrics


class RewardStats(NamedTuple):
    mean: float
    std: float


@flax_struct.dataclass
class Timing:
    generate: jax.Array
    update: jax.Array


@dataclasses.dataclass
class Eval:
    pass_at_1: float
    pass_at_8: float | None = None  # None fields are left out


def _events(logdir: str):
    """Every Event record of the tensorboard files (TFRecord framing: u64 length, u32 crc,
    payload, u32 crc)."""
    from tensorboardX.proto import event_pb2

    out = []
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        data, pos = open(path, "rb").read(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            out.append(event_pb2.Event.FromString(data[pos + 12:pos + 12 + n]))
            pos += 12 + n + 4
    return out


def _scalars(logdir: str) -> dict[tuple[str, int], float]:
    return {(v.tag, e.step): v.simple_value for e in _events(logdir) for v in e.summary.value
            if v.WhichOneof("value") == "simple_value"}


def _texts(logdir: str) -> dict[tuple[str, int], str]:
    return {(v.tag, e.step): v.tensor.string_val[0].decode() for e in _events(logdir)
            for v in e.summary.value if v.metadata.plugin_data.plugin_name == "text"}


def _step_metrics(i: int) -> StepMetrics:
    return StepMetrics(*[jnp.float32(i + k / 10) for k in range(len(StepMetrics._fields))])


def _record(i: int):
    return {"reward": {"math": RewardStats(mean=0.25 * i, std=np.float32(0.5))},
            "train": _step_metrics(i),
            "time": Timing(generate=jnp.asarray(1.5 * i), update=jnp.asarray(0.5)),
            "eval": Eval(pass_at_1=0.1 * i)}


def _config(tmp_path, **kw) -> LoggerConfig:
    return LoggerConfig(str(tmp_path / "run"), **{
        "total_steps": 3, "reward_key": "reward/math/mean",
        "console_keys": ("reward/math/mean", "loss"), **kw})


def test_scalars_reach_tensorboard_jsonl_console_and_progress_bar(tmp_path, monkeypatch):
    fetches = []
    real_get = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda x: fetches.append(1) or real_get(x))
    stream = io.StringIO()
    with MetricsLogger(_config(tmp_path), process_index=0, stream=stream) as logger:
        for step in (1, 2, 3):
            logged = logger.log(step, _record(step))
    assert len(fetches) == 3  # one device_get per step
    names = {"reward/math/mean", "reward/math/std", "time/generate", "time/update",
             "eval/pass_at_1"} | {f"train/{f}" for f in StepMetrics._fields}
    assert set(logged) == names  # eval/pass_at_8 (None) left out

    board = _scalars(str(tmp_path / "run"))
    assert {tag for tag, _ in board} == names
    for step in (1, 2, 3):
        assert board[("reward/math/mean", step)] == 0.25 * step
        assert board[("time/generate", step)] == 1.5 * step
        grad_norm = step + StepMetrics._fields.index("grad_norm") / 10  # see _step_metrics
        assert board[("train/grad_norm", step)] == pytest.approx(grad_norm, abs=1e-6)

    records = read_metrics(str(tmp_path / "run"))
    lines = open(tmp_path / "run" / "metrics.jsonl").read().splitlines()
    assert len(lines) == 3 and [r["step"] for r in records] == [1, 2, 3]
    assert records[1]["reward/math/mean"] == 0.5 and records[1]["reward/math/std"] == 0.5
    lr = StepMetrics._fields.index("lr") / 10
    assert records[2]["train/lr"] == float(np.float32(3 + lr))  # the float32 value, exactly
    assert records[0]["eval/pass_at_1"] == pytest.approx(0.1) and records[0]["wall_time"] > 1.7e9
    out = stream.getvalue()
    assert "step 2/3 | reward/math/mean 0.5 | train/loss 2" in out
    assert "3/3" in out and "reward=0.75" in out  # the bar, with the last reward


def test_text_samples_every_k_steps(tmp_path):
    samples = [TextSample("What is 2+3?", "It is \\boxed{5}.\nDone | ok", 1.0),
               TextSample("What is 7*6?", "", None)]
    with MetricsLogger(_config(tmp_path, text_every=2, progress=False), process_index=0,
                       stream=io.StringIO()) as logger:
        written = [s for s in range(1, 6) if logger.log_text(s, samples)]
        assert logger.log_text(5, samples[:1], force=True)
    assert written == [2, 4]
    texts = _texts(str(tmp_path / "run"))
    # tensorboardX stores text under "<tag>/text_summary"
    texts = {(tag.split("/")[0], step): text for (tag, step), text in texts.items()}
    assert set(texts) == {("samples", 2), ("samples", 4), ("samples", 5)}
    assert "It is \\boxed{5}." in texts[("samples", 2)] and "reward 1" in texts[("samples", 2)]
    lines = [json.loads(x) for x in open(tmp_path / "run" / "samples.jsonl")]
    assert [x["step"] for x in lines] == [2, 2, 4, 4, 5]
    assert lines[0]["completion"] == samples[0].completion and lines[1]["reward"] is None


def test_other_processes_write_nothing(tmp_path):
    logger = MetricsLogger(_config(tmp_path), process_index=1)
    assert not logger.active
    assert logger.log(1, _record(1)) == {}
    assert not logger.log_text(10, [TextSample("p", "c")])
    logger.log_config({"seed": 1})
    logger.flush()
    logger.close()
    assert not os.path.exists(tmp_path / "run")


def test_resumed_run_overrides_steps_and_a_cut_last_line_is_ignored(tmp_path):
    cfg = _config(tmp_path, progress=False, console_every=0)
    with MetricsLogger(cfg, process_index=0) as first:
        for step in range(1, 5):
            first.log(step, {"loss": float(step)})
    with MetricsLogger(cfg, process_index=0, start_step=2) as resumed:  # checkpoint of step 2
        for step in range(3, 6):
            resumed.log(step, {"loss": 10.0 * step})
    from tensorboardX.proto.event_pb2 import SessionLog

    restarts = [e.step for e in _events(str(tmp_path / "run")) if e.WhichOneof("what") ==
                "session_log" and e.session_log.status == SessionLog.START]
    assert restarts == [3]  # tensorboard drops the first run's events of steps >= 3
    assert len(glob.glob(str(tmp_path / "run" / "events.out.tfevents.*"))) == 2
    assert _scalars(str(tmp_path / "run"))[("loss", 1)] == 1.0
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # killed mid-write
    records = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert [(r["step"], r["loss"]) for r in records] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0),
                                                        (5, 50.0)]


def test_config_and_bad_metrics(tmp_path):
    with MetricsLogger(_config(tmp_path, progress=False), process_index=0,
                       stream=io.StringIO()) as logger:
        logger.log_config({"seed": 3, "model": {"path": "m.gguf"}})
        with pytest.raises(ValueError, match="metric 'reward/per_sample' must be a numeric scalar"):
            logger.log(1, {"reward": {"per_sample": jnp.zeros(4)}})
        with pytest.raises(ValueError, match="reserved"):
            logger.log(1, {"step": 1.0})
    assert json.load(open(tmp_path / "run" / "config.json"))["model"]["path"] == "m.gguf"
    with pytest.raises(TypeError, match="record or a mapping"):
        to_scalars(3.0)
    assert to_scalars({"ok": True, "n": np.int64(3)}) == {"ok": 1.0, "n": 3.0}


def test_low_precision_scalars_become_floats():
    """bf16 / fp8 metrics (a full-mode step in bfloat16) are numbers too."""
    out = to_scalars({"grad_norm": jnp.asarray(1.5, jnp.bfloat16),
                      "x": jnp.asarray(0.5, jnp.float8_e4m3fn), "n": jnp.asarray(3, jnp.int32)})
    assert out == {"grad_norm": 1.5, "x": 0.5, "n": 3.0}
    with pytest.raises(ValueError, match="metric 'v' must be a numeric scalar"):
        to_scalars({"v": jnp.ones(2)})
