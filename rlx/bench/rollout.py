"""``python -m rlx.bench rollout``: generation tokens/s, rlx's JAX engine beside its peers.

Same machine, same process tree, same model weights, same prompts (token ids), same batch and
lengths for every side; the sides run interleaved (A B C ... per round, greedy then sampled) and
the table gives medians over the measured rounds. Sides (``--sides``, default all):

- ``rlx-f32``: the built-in engine, f32 weights, with the sampler log-prob of every token (what
  RL trains with; SGLang is asked for them too);
- ``rlx-f32-nolp``: the same without log-probs (``SamplingParams(logprobs=False)``, as for
  evaluation): the work HF ``generate`` does, which computes none;
- ``rlx-int8`` / ``rlx-q4_1``: the same engine on a frozen int8 (per channel) / GGUF Q4_1 base with
  a LoRA adapter of ``--lora-rank`` on every projection, as LoRA mode samples (0 = no adapter);
- ``hf``: transformers ``generate``, f32, on rlx's HF export of the same weights (torch threads:
  ``--torch-threads``, default torch's own choice, i.e. every core);
- ``sglang``: a real SGLang server serving that export (``rlx.bench.sglang_setup``), skipped with
  the reason printed when its environment is missing.

Each side generates exactly ``--new`` tokens per prompt (no end-of-sequence stop) and the tokens
it actually produced are counted. Setup (load, build; for a launched SGLang server its start-up)
and the first run (compilation, caches) are reported apart from the steady-state rate, as is the
memory (a launched SGLang server: its whole process group). Beside tokens per wall-clock second
the table gives tokens per CPU-second (every thread of the side's process, or of the server's
group): on a machine shared with other jobs the wall-clock rate also measures how much of the CPU
each side manages to get, the CPU-time rate only the work it needs. The load average before and
after is printed. ``--json PATH`` writes every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import tempfile
import time

from rlx.bench.harness import (TORCH_ENV, BenchError, Results, Side, call_once, interleave,
                               markdown_table, write_json)
from rlx.bench.rollout_sides import CASES
from rlx.bench.sglang_setup import SGLangSetup, group_rss_mb, sglang_server
from rlx.bench.workloads import MODELS, Workload, prompt_ids, smollm2_config

SIDES = ("rlx-f32", "rlx-f32-nolp", "rlx-int8", "rlx-q4_1", "hf", "sglang")
GOALS = {"smollm2": 2.0, "tiny": 3.0}  # rlx f32 tokens/s over HF generate's
HF, SGLANG = "HF generate f32", "SGLang f32"
NOLP = "rlx f32, no log-probs"


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How the sides are run: rounds, modes, setup."""

    repeats: int = 3
    warmup: int = 1
    modes: tuple[str, ...] = ("greedy", "sampled")
    parallel_setup: bool = False


@dataclasses.dataclass(frozen=True)
class Plan:
    """One model's run: which sides, with what."""

    workload: Workload
    sides: tuple[str, ...]
    lora_rank: int
    torch_threads: int
    sglang: SGLangSetup


def _rlx_label(side: str, lora_rank: int) -> str:
    base = side.split("-", 1)[1]
    if base == "f32":
        return "rlx f32"
    if base == "f32-nolp":
        return NOLP
    name = {"int8": "int8", "q4_1": "Q4_1"}[base]
    return f"rlx {name} base" + (f" + LoRA r{lora_rank}" if lora_rank else "")


def build_sides(plan: Plan, prompts: list[list[int]], folder: str, url: str | None,
                hf_config: dict | None = None, server_pgid: int = 0) -> list[Side]:
    w = plan.workload
    out = []
    for name in plan.sides:
        if name.startswith("rlx-"):
            base = name.split("-")[1]
            rank = 0 if base == "f32" else plan.lora_rank
            out.append(Side(_rlx_label(name, plan.lora_rank), "rlx.bench.rollout_sides:rlx_rollout",
                            dict(model=w.model, base=base, lora_rank=rank, prompts=prompts,
                                 new=w.new, hf_config=hf_config, logprobs=name != "rlx-f32-nolp")))
        elif name == "hf":
            out.append(Side(HF, "rlx.bench.rollout_sides:hf_rollout",
                            dict(folder=folder, prompts=prompts, new=w.new, threads=plan.torch_threads),
                            TORCH_ENV))
        elif name == "sglang" and url:
            out.append(Side(SGLANG, "rlx.bench.rollout_sides:sglang_rollout",
                            dict(url=url, prompts=prompts, new=w.new,
                                 load_folder=folder if plan.sglang.url else "",
                                 server_pgid=server_pgid)))
    return out


def run_model(plan: Plan, root: str, opts: RunOptions) -> dict:
    """Run every side of ``plan`` on one model; returns the JSON record (rows included)."""
    w = plan.workload
    load_before = os.getloadavg()
    logs = os.path.join(root, "logs")
    os.makedirs(logs, exist_ok=True)
    prompts = prompt_ids(w)
    hf_config = smollm2_config() if w.model == "tiny" else None  # read once, not per worker
    folder, skipped = os.path.join(root, f"{w.model}-hf"), {}
    if {"hf", "sglang"} & set(plan.sides):
        call_once(Side(f"export {w.model}", "rlx.bench.workloads:export_hf",
                       dict(model=w.model, folder=folder, hf_config=hf_config)), logs)
    reason = plan.sglang.unavailable() if "sglang" in plan.sides else None
    if reason:
        skipped[SGLANG] = reason
        print(f"SGLang side skipped: {reason}", file=sys.stderr)
    with contextlib.ExitStack() as stack:
        url, server, start_s = None, None, None
        if "sglang" in plan.sides and not reason:
            t = time.perf_counter()
            url, server = stack.enter_context(sglang_server(plan.sglang, folder, root))
            start_s = None if server is None else time.perf_counter() - t
        pgid = server.proc.pid if server is not None else 0  # a launched server leads its group
        sides = build_sides(plan, prompts, folder, url, hf_config, pgid)
        results = interleave(sides, opts.repeats, opts.warmup, logs, cases=opts.modes,
                             parallel_setup=opts.parallel_setup)
        server_rss = group_rss_mb(server)
    rows = table_rows(results, [s.label for s in sides], opts.modes, server_rss, start_s)
    return {"workload": dataclasses.asdict(w), "sides": [s.label for s in sides], "rows": rows,
            "skipped": skipped, "sglang_server_rss_mb": server_rss, "sglang_server_start_s": start_s,
            "load_before": load_before, "load_after": os.getloadavg(), "results": results.to_json()}


def table_rows(results: Results, labels: list[str], modes, server_rss: float | None,
               server_start_s: float | None) -> list[dict]:
    """One record per side and mode; SGLang's memory and setup are its server's when launched."""
    rows = []
    for mode in modes:
        rate = {label: results.rate(label, "tokens", case=mode) for label in labels}
        per_cpu = {label: results.rate(label, "tokens", "cpu_s", case=mode) for label in labels
                   if all("cpu_s" in r for r in results.select(label, mode))}
        for label in labels:
            rows.append(_row(results, label, mode, rate, per_cpu, server_rss, server_start_s))
    return rows


def _ratio(table: dict, label: str, ref: str) -> float | None:
    return table[label] / table[ref] if label in table and ref in table else None


def _row(results: Results, label: str, mode: str, rate: dict, per_cpu: dict,
         server_rss: float | None, server_start_s: float | None) -> dict:
    first = results.select(label, mode, warmup=True)
    sglang = label == SGLANG
    return {"side": label, "mode": mode, "tokens_per_s": rate[label],
            "vs_hf": _ratio(rate, label, HF), "vs_sglang": _ratio(rate, label, SGLANG),
            "tokens_per_cpu_s": per_cpu.get(label), "cpu_vs_hf": _ratio(per_cpu, label, HF),
            "cpu_vs_sglang": _ratio(per_cpu, label, SGLANG),
            "seconds": results.median(label, "seconds", mode),
            "setup_s": server_start_s if sglang and server_start_s else results.setup[label]["setup_s"],
            "first_run_s": first[0]["seconds"] if first else None,
            "rss_mb": server_rss if sglang and server_rss else results.median(label, "peak_rss_mb", mode)}


def markdown(rows: list[dict]) -> str:
    def ratio(v):
        return "-" if v is None else f"{v:.2f}x"

    def opt(v):
        return "-" if v is None else v

    header = ["side", "mode", "tokens/s", "vs HF", "vs SGLang", "tokens/CPU-s", "vs HF", "vs SGLang",
              "setup s", "1st run s", "peak RSS MB"]
    return markdown_table(header, [
        [r["side"], r["mode"], r["tokens_per_s"], ratio(r["vs_hf"]), ratio(r["vs_sglang"]),
         opt(r["tokens_per_cpu_s"]), ratio(r["cpu_vs_hf"]), ratio(r["cpu_vs_sglang"]),
         r["setup_s"], opt(r["first_run_s"]), opt(r["rss_mb"])] for r in rows])


def verdicts(model: str, rows: list[dict]) -> list[str]:
    """One line per goal (README.md, "Rollout") that this run measured (wall-clock rates; the
    CPU-time ratio in brackets): rlx with log-probs against HF and SGLang (which is asked for
    them), and rlx without them against HF ``generate``, which computes none."""
    out = []
    peers = {"rlx f32": (("HF", "hf", GOALS[model]), ("SGLang", "sglang", 1.0)),
             NOLP: (("HF", "hf", GOALS[model]),)}
    for r in (r for r in rows if r["side"] in peers):
        for peer, key, goal in peers[r["side"]]:
            wall, cpu = r[f"vs_{key}"], r[f"cpu_vs_{key}"]
            if wall is None:
                continue
            extra = "" if cpu is None else f" (per CPU-second: {cpu:.2f}x)"
            out.append(f"{r['side']} vs {peer}, {r['mode']}: {wall:.2f}x{extra} (goal >= "
                       f"{goal:g}x): {'met' if wall >= goal else 'MISSED'}")
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlx.bench rollout", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--batch", type=int, default=16, help="prompts per call")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    p.add_argument("--new", type=int, default=128, help="new tokens per prompt (exactly)")
    p.add_argument("--modes", default=",".join(CASES), help="comma-separated subset of greedy,sampled")
    p.add_argument("--repeats", type=int, default=3, help="measured rounds (medians)")
    p.add_argument("--warmup", type=int, default=1, help="rounds run first and not measured")
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {','.join(SIDES)}")
    p.add_argument("--lora-rank", type=int, default=16, help="adapter rank on the int8/Q4_1 bases (0: none)")
    p.add_argument("--torch-threads", type=int, default=0, help="torch threads of the HF side (0: torch's default)")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts")
    p.add_argument("--parallel-setup", action="store_true",
                   help="build the sides at the same time (faster start; setup times then overlap)")
    p.add_argument("--json", default="", help="write every figure to this file")
    p.add_argument("--workdir", default="", help="exports and logs go here (default: a temp folder)")
    p.add_argument("--sglang-python", default="", help="SGLang interpreter (default $RLX_SGLANG_PYTHON or .ci's venv)")
    p.add_argument("--sglang-harness", default="", help="module with cpu_server_env/cpu_server_args "
                   "(CPU-only machines: tests.helpers.sglang_harness)")
    p.add_argument("--sglang-url", default="", help="attach to this running server (it loads the export)")
    p.add_argument("--sglang-args", default="", help="extra sglang.launch_server flags")
    return p


def _split(value: str, allowed: tuple[str, ...], flag: str) -> tuple[str, ...]:
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise SystemExit(f"{flag}: {bad or value!r} not in {allowed}")
    return items


def main(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    models = _split(a.model, MODELS, "--model")
    sides, modes = _split(a.sides, SIDES, "--sides"), _split(a.modes, CASES, "--modes")
    sglang = SGLangSetup(a.sglang_python, a.sglang_harness, a.sglang_url, a.sglang_args)
    payload: dict = {"benchmark": "rollout", "models": {}}
    with tempfile.TemporaryDirectory(prefix="rlx-bench-rollout-") as tmp:
        root = a.workdir or tmp
        for model in models:
            plan = Plan(Workload(model, a.batch, a.prompt, a.new, a.seed), sides, a.lora_rank,
                        a.torch_threads, sglang)
            try:
                record = run_model(plan, os.path.join(root, model),
                                   RunOptions(a.repeats, a.warmup, modes, a.parallel_setup))
            except BenchError as e:
                print(f"rollout benchmark failed on {model}: {e}", file=sys.stderr)
                return 1
            payload["models"][model] = record
            _print(plan.workload, record)
    write_json(a.json or None, payload)
    return 0


def _print(w: Workload, record: dict) -> None:
    load = ", ".join(f"{a:.1f} -> {b:.1f}" for a, b in zip(record["load_before"], record["load_after"]))
    print(f"\n### rollout: {w.model}, batch {w.batch}, prompt {w.prompt}, {w.new} new tokens "
          f"(load average 1/5/15 min: {load})\n")
    print(markdown(record["rows"]))
    for label, reason in record["skipped"].items():
        print(f"\n{label}: skipped ({reason})")
    for line in verdicts(w.model, record["rows"]):
        print(f"- {line}")
