"""``python -m rlx.bench sync``: from "update done" to "the rollout engine serves the new policy".

Five ways a new policy reaches the engine, on the same model (f32 weights; see
``rlx.bench.sync_sides`` for what is timed and how the new policy is verified):

- ``rlx-adapter``: the built-in engine takes the new LoRA adapter in memory (LoRA mode);
- ``rlx-full``: the built-in engine takes every weight in memory (full mode);
- ``sglang-adapter``: PEFT export + SGLang ``/load_lora_adapter`` (LoRA mode on SGLang);
- ``sglang-full``: safetensors export + SGLang ``/update_weights_from_disk`` (full mode on SGLang,
  ``rollout.sglang.weight_sync="disk"``);
- ``sglang-memory``: the same weights in buckets through shared memory + SGLang
  ``/update_weights_from_tensor`` (full mode's default, ``weight_sync="memory"``).

The adapter is LoRA rank ``--lora-rank`` (default 16, the quickstart's) on all seven projections
(q, k, v, o, gate, up, down). Bytes moved: the adapter against the full weights; the goal is
<= 2% (README.md, "Weight sync"). That share depends on the rank, the targets and the model's
shape, so a second table gives it for ranks 8/16/32 on attention only and on every projection,
for this model and the larger recipes' models (computed from shapes). Both SGLang sides share one
LoRA-enabled server (``rlx.bench.sglang_setup``); without SGLang they are skipped with the reason
printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from rlx.bench.harness import BenchError, Results, Side, call_once, interleave, markdown_table, write_json
from rlx.bench.sglang_setup import SGLangSetup, group_rss_mb, sglang_server
from rlx.bench.workloads import MODELS, Workload, prompt_ids, smollm2_config

SIDES = ("rlx-adapter", "rlx-full", "sglang-adapter", "sglang-full", "sglang-memory")
LABELS = {"rlx-adapter": "rlx built-in, adapter in memory", "rlx-full": "rlx built-in, full weights in memory",
          "sglang-adapter": "SGLang adapter hot-load", "sglang-full": "SGLang full weights from disk",
          "sglang-memory": "SGLang full weights in memory"}
GOAL = 0.02  # adapter bytes / full-update bytes
ATTENTION, ALL = ("q", "k", "v", "o"), ("q", "k", "v", "o", "gate", "up", "down")
SHAPE_MODELS = ("Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen3-8B")


def build_sides(names, model: str, rank: int, probe: list[int], url: str | None, root: str,
                hf_config: dict | None = None) -> list[Side]:
    out = []
    for name in names:
        kw: dict = dict(model=model, probe=probe, hf_config=hf_config if model == "tiny" else None)
        if name.startswith("rlx-"):
            target = "rlx.bench.sync_sides:rlx_sync"
            kw.update(kind=name.split("-")[1], lora_rank=rank)
        elif url is None:
            continue
        elif name == "sglang-memory":
            target = "rlx.bench.sync_sides:sglang_memory_sync"
            kw.update(url=url)
        elif name == "sglang-adapter":
            target = "rlx.bench.sync_sides:sglang_adapter_sync"
            kw.update(url=url, lora_rank=rank, workdir=os.path.join(root, "adapters"))
        else:
            target = "rlx.bench.sync_sides:sglang_full_sync"
            kw.update(url=url, workdir=os.path.join(root, "full"))
        out.append(Side(LABELS[name], target, kw))
    return out


def table_rows(results: Results, labels: list[str]) -> list[dict]:
    full = {"rlx": LABELS["rlx-full"], "SGLang": LABELS["sglang-full"]}
    rows = []
    for label in labels:
        rec = {"side": label, "seconds": results.median(label, "seconds"),
               "bytes": results.median(label, "bytes"), "setup_s": results.setup[label]["setup_s"]}
        for phase in ("handover_s", "export_s", "load_s", "first_request_s"):
            have = results.select(label)
            rec[phase] = results.median(label, phase) if have and phase in have[0] else None
        ref = full[label.split(" ")[0]]
        rec["share_of_full"] = rec["bytes"] / results.median(ref, "bytes") if ref in results.runs else None
        rows.append(rec)
    return rows


def markdown(rows: list[dict]) -> str:
    def opt(v, fmt="{:.3g}"):
        return "-" if v is None else fmt.format(v)

    header = ["side", "sync s (median)", "export s", "load / hand-over s", "first request s",
              "bytes moved", "vs full update"]
    return markdown_table(header, [
        [r["side"], r["seconds"], opt(r["export_s"]), opt(r["load_s"] if r["load_s"] is not None else r["handover_s"]),
         opt(r["first_request_s"]), f"{r['bytes'] / 1e6:,.2f} MB",
         opt(r["share_of_full"], "{:.2%}")] for r in rows])


def _lora_params(cfg, rank: int, targets) -> int:
    d, q, kv, f = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    dims = {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "gate": (d, f), "up": (d, f), "down": (f, d)}
    return cfg.num_layers * sum(rank * (dims[t][0] + dims[t][1]) for t in targets)


def _param_count(cfg) -> int:
    """Parameters of a dense decoder (what a full update moves), from its shape."""
    d, q, kv, f = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    layer = d * (q + 2 * kv) + q * d + 3 * d * f + 2 * d
    bias = (q + 2 * kv) if cfg.qkv_bias else 0
    embed = cfg.vocab_size * d * (1 if cfg.tie_word_embeddings else 2)
    return cfg.num_layers * (layer + bias) + embed + d


def share_table(configs: dict) -> str:
    """Adapter / full-weight size for ranks 8, 16, 32 on attention or all projections (same dtype)."""
    header = ["model", "params"] + [f"r{r} {n}" for r in (8, 16, 32) for n in ("attn", "all")]
    rows = []
    for name, cfg in configs.items():
        total = _param_count(cfg)
        rows.append([name, f"{total / 1e6:,.0f}M"] + [
            f"{_lora_params(cfg, r, t) / total:.2%}" for r in (8, 16, 32) for t in (ATTENTION, ALL)])
    return markdown_table(header, rows)


def shape_configs(smollm2: dict) -> dict:
    """Model configs of the share table: SmolLM2-135M and the larger recipes' models."""
    from rlx.models.config import from_hf_config
    from rlx.models.presets import PRESETS

    out = {"SmolLM2-135M": from_hf_config(smollm2)}
    out.update({n: from_hf_config(PRESETS[n]) for n in SHAPE_MODELS if n in PRESETS})
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlx.bench sync", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", choices=MODELS)
    p.add_argument("--lora-rank", type=int, default=16, help="adapter rank (all seven projections)")
    p.add_argument("--probe", type=int, default=64, help="prompt tokens of the probe request")
    p.add_argument("--repeats", type=int, default=3, help="measured updates per side (medians)")
    p.add_argument("--warmup", type=int, default=1, help="updates run first and not measured")
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {','.join(SIDES)}")
    p.add_argument("--parallel-setup", action="store_true",
                   help="build the sides at the same time (faster start; setup times then overlap)")
    p.add_argument("--json", default="", help="write every figure to this file")
    p.add_argument("--workdir", default="", help="exports and logs go here (default: a temp folder)")
    p.add_argument("--sglang-python", default="", help="SGLang interpreter (default $RLX_SGLANG_PYTHON or .ci's venv)")
    p.add_argument("--sglang-harness", default="", help="module with cpu_server_env/cpu_server_args "
                   "(CPU-only machines: tests.helpers.sglang_harness)")
    p.add_argument("--sglang-url", default="", help="attach to this running server (LoRA enabled, "
                   "max rank >= --lora-rank); it loads the bench's export first")
    p.add_argument("--sglang-args", default="", help="extra sglang.launch_server flags")
    return p


def run_sync(a, sides: tuple[str, ...], root: str, hf_config: dict) -> dict:
    logs = os.path.join(root, "logs")
    os.makedirs(logs, exist_ok=True)
    probe = prompt_ids(Workload(a.model, 1, a.probe, 1))[0]
    setup = SGLangSetup(a.sglang_python, a.sglang_harness, a.sglang_url, a.sglang_args)
    wanted = any(s.startswith("sglang") for s in sides)
    reason = setup.unavailable() if wanted else None
    skipped = {LABELS[s]: reason for s in sides if s.startswith("sglang") and reason}
    if reason:
        print(f"SGLang sides skipped: {reason}", file=sys.stderr)
    run = dict(repeats=a.repeats, warmup=a.warmup, log_dir=logs, parallel_setup=a.parallel_setup)
    if not wanted or reason:
        results = interleave(build_sides(sides, a.model, a.lora_rank, probe, None, root, hf_config), **run)
        return {"results": results, "skipped": skipped, "server_rss_mb": None}
    folder = os.path.join(root, f"{a.model}-hf")
    call_once(Side(f"export {a.model}", "rlx.bench.workloads:export_hf",
                   dict(model=a.model, folder=folder,
                        hf_config=hf_config if a.model == "tiny" else None)), logs)
    with sglang_server(setup, folder, root, lora_rank=a.lora_rank) as (url, server):
        if setup.url:  # an attached server first serves this bench's weights
            from rlx.bench.sync_sides import post

            post(url, "/update_weights_from_disk", {"model_path": folder})
        results = interleave(build_sides(sides, a.model, a.lora_rank, probe, url, root, hf_config), **run)
        rss = group_rss_mb(server)
    return {"results": results, "skipped": skipped, "server_rss_mb": rss}


def main(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    sides = tuple(s.strip() for s in a.sides.split(",") if s.strip())
    bad = [s for s in sides if s not in SIDES]
    if bad or not sides:
        raise SystemExit(f"--sides: {bad or a.sides!r} not in {SIDES}")
    hf_config = smollm2_config()  # the share table's first model; builds the tiny one
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="rlx-bench-sync-") as tmp:
        root = a.workdir or tmp
        try:
            out = run_sync(a, sides, root, hf_config)
        except BenchError as e:
            print(f"sync benchmark failed: {e}", file=sys.stderr)
            return 1
    results: Results = out["results"]
    rows = table_rows(results, list(results.runs))
    load = ", ".join(f"{x:.1f} -> {y:.1f}" for x, y in zip(load_before, os.getloadavg()))
    print(f"\n### sync: {a.model}, LoRA r{a.lora_rank} on q,k,v,o,gate,up,down, f32 "
          f"(load average 1/5/15 min: {load})\n")
    print(markdown(rows))
    for label, reason in out["skipped"].items():
        print(f"\n{label}: skipped ({reason})")
    for line in verdicts(rows):
        print(f"- {line}")
    configs = shape_configs(hf_config)
    print("\nAdapter bytes / full-weight bytes by rank and targets (from shapes):\n")
    print(share_table(configs))
    write_json(a.json or None, {"benchmark": "sync", "model": a.model, "lora_rank": a.lora_rank,
                                "rows": rows, "skipped": out["skipped"],
                                "sglang_server_rss_mb": out["server_rss_mb"],
                                "results": results.to_json()})
    return 0


def verdicts(rows: list[dict]) -> list[str]:
    out = []
    by = {r["side"]: r for r in rows}
    memory, disk = by.get(LABELS["sglang-memory"]), by.get(LABELS["sglang-full"])
    if memory and disk:
        out.append(f"SGLang full weights: in memory {memory['seconds']:.3g} s, from disk "
                   f"{disk['seconds']:.3g} s: {disk['seconds'] / memory['seconds']:.2f}x faster "
                   "in memory")
    for r in rows:
        if "adapter" in r["side"] and r["share_of_full"] is not None:
            met = "met" if r["share_of_full"] <= GOAL else "MISSED"
            out.append(f"{r['side']}: {r['share_of_full']:.2%} of a full update's bytes "
                       f"(goal <= {GOAL:.0%}): {met}")
    return out
