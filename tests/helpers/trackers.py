"""Reading back what a run logged: tensorboard event files and wandb's offline run files."""

from __future__ import annotations

import glob
import json
import os
import struct

TRACKER_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off"}


def tensorboard_scalars(logdir: str) -> dict[tuple[str, int], float]:
    """(tag, step) -> value of every scalar in the tensorboard files of ``logdir`` (TFRecord
    framing: u64 length, u32 crc, payload, u32 crc); a later event of the same tag and step wins."""
    from tensorboardX.proto import event_pb2

    out = {}
    files = glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
    for path in sorted(files, key=os.path.getmtime):
        data, pos = open(path, "rb").read(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            for v in event.summary.value:
                if v.WhichOneof("value") == "simple_value":
                    out[(v.tag, event.step)] = v.simple_value
    return out


def wandb_records(run_file: str) -> list:
    """The protobuf records of a wandb ``run-<id>.wandb`` file: a 7-byte header (``:W&B``, magic,
    version), then LevelDB-log blocks of 32 KiB whose chunks (u32 crc, u16 length, u8 type:
    1 full, 2 first, 3 middle, 4 last) carry one ``wandb_internal_pb2.Record`` each."""
    from wandb.proto import wandb_internal_pb2

    data = open(run_file, "rb").read()
    assert data[:4] == b":W&B", run_file
    records, pos, block, buf = [], 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        n, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if n == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + n]
        pos += 7 + n
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            records.append(record)
    return records


def wandb_flush() -> None:
    """Wait until wandb has written everything (``run.finish()`` may return while its service
    still writes the run file; ``wandb.teardown`` waits for the service to end)."""
    import wandb

    wandb.teardown()


def wandb_offline_runs(logdir: str) -> dict[str, list[str]]:
    """run id -> its offline run folders under ``<logdir>/wandb`` (oldest first; the id is the
    name of the folder's ``run-<id>.wandb``: a folder started in the same second as another gets
    a ``-1`` suffix)."""
    out: dict[str, list[str]] = {}
    for folder in sorted(glob.glob(os.path.join(logdir, "wandb", "offline-run-*"))):
        (run_file,) = glob.glob(os.path.join(folder, "run-*.wandb"))
        run_id = os.path.basename(run_file).removeprefix("run-").removesuffix(".wandb")
        out.setdefault(run_id, []).append(folder)
    return out


def wandb_history(folder: str) -> tuple[dict[tuple[str, int], float], dict[int, dict], dict]:
    """((key, step) -> scalar, step -> the other logged values, the run's config) of one
    offline run folder."""
    (run_file,) = glob.glob(os.path.join(folder, "run-*.wandb"))
    scalars, other, config = {}, {}, {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind in ("run", "config"):  # the config comes with the run or in records after it
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({u.key: json.loads(u.value_json) for u in updates
                           if u.key != "_wandb"})  # wandb's own telemetry
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item}
            step = int(items.pop("_step"))
            media = {k.rsplit("/", 1)[0] for k in items if k.endswith("/_type")}  # tables
            for key, value in items.items():
                if key.startswith("_"):
                    continue
                if key.rsplit("/", 1)[0] in media:
                    other.setdefault(step, {})[key] = value
                    continue
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    scalars[(key, step)] = float(value)
                else:
                    other.setdefault(step, {})[key] = value
    return scalars, other, config
