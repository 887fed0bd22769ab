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
  the reason printed when its environment is missing;
- ``llama.cpp``: llama-cpp-python in its own environment (``rlx.bench.peer_envs``) on SmolLM2's
  GGUF Q4_1 file, the file ``rlx-q4_1`` loads (``rlx.bench.llama_cpp_peer``: its high-level API at
  batch 1, its batched decoding API above), skipped with the reason printed when its environment
  is missing or the model has no GGUF file (``tiny``).

``--batch`` takes one or more batch sizes (``1,16``): each is its own table, with every side built
again for it (the SGLang server is launched once per model).

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

from rlx.bench.harness import (OMP_DEFAULT_ENV, BenchError, Results, Side, call_once, interleave,
                               markdown_table, write_json)
from rlx.bench.peer_envs import LLAMA_CPP
from rlx.bench.rollout_sides import CASES
from rlx.bench.sglang_setup import SGLangSetup, group_rss_mb, sglang_server
from rlx.bench.workloads import MODELS, Workload, gguf_path, prompt_ids, smollm2_config

SIDES = ("rlx-f32", "rlx-f32-nolp", "rlx-int8", "rlx-q4_1", "hf", "sglang", "llama.cpp")
GOALS = {"smollm2": 2.0, "tiny": 3.0}  # rlx f32 tokens/s over HF generate's
HF, SGLANG, LLAMA = "HF generate f32", "SGLang f32", "llama.cpp Q4_1"
NOLP = "rlx f32, no log-probs"
PEERS = {"hf": HF, "sglang": SGLANG, "llama": LLAMA}  # ratio key -> the peer's label


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How the sides are run: rounds, modes, setup."""

    repeats: int = 3
    warmup: int = 1
    modes: tuple[str, ...] = ("greedy", "sampled")
    parallel_setup: bool = False


@dataclasses.dataclass(frozen=True)
class LlamaSetup:
    """Where the llama.cpp side runs: its interpreter ("": ``peer_envs.LLAMA_CPP``'s) and threads
    (0: every core)."""

    python: str = ""
    threads: int = 0


@dataclasses.dataclass(frozen=True)
class Plan:
    """One model's run at one batch size: which sides, with what."""

    workload: Workload
    sides: tuple[str, ...]
    lora_rank: int
    torch_threads: int
    sglang: SGLangSetup
    llama: LlamaSetup = LlamaSetup()


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
                            OMP_DEFAULT_ENV))
        elif name == "sglang" and url:
            out.append(Side(SGLANG, "rlx.bench.rollout_sides:sglang_rollout",
                            dict(url=url, prompts=prompts, new=w.new,
                                 load_folder=folder if plan.sglang.url else "",
                                 server_pgid=server_pgid)))
        elif name == "llama.cpp" and llama_reason(plan) is None:
            out.append(Side(LLAMA, "rlx.bench.llama_cpp_peer:llama_cpp_rollout",
                            dict(gguf=gguf_path(), prompts=prompts, new=w.new,
                                 threads=plan.llama.threads),
                            OMP_DEFAULT_ENV, python=LLAMA_CPP.interpreter(plan.llama.python)))
    return out


def llama_reason(plan: Plan) -> str | None:
    """Why the llama.cpp side cannot run in ``plan``, or None."""
    if plan.workload.model != "smollm2":
        return f"llama.cpp runs GGUF files; {plan.workload.model} has none"
    return LLAMA_CPP.unavailable(plan.llama.python)


def skipped_sides(plan: Plan) -> dict[str, str]:
    """Peer label -> why that requested peer is skipped."""
    reasons = {SGLANG: plan.sglang.unavailable() if "sglang" in plan.sides else None,
               LLAMA: llama_reason(plan) if "llama.cpp" in plan.sides else None}
    return {label: reason for label, reason in reasons.items() if reason}


@dataclasses.dataclass
class _Server:
    """The SGLang server of one model's run (all None when there is none)."""

    url: str | None = None
    handle: object | None = None
    start_s: float | None = None

    @property
    def pgid(self) -> int:  # a launched server leads its process group
        return self.handle.proc.pid if self.handle is not None else 0


def run_model(plans: list[Plan], root: str, opts: RunOptions) -> list[dict]:
    """Run every side of each plan (one model, one plan per batch size); one JSON record per plan
    (rows included). The export and the SGLang server serve every plan."""
    w = plans[0].workload
    logs = os.path.join(root, "logs")
    os.makedirs(logs, exist_ok=True)
    hf_config = smollm2_config() if w.model == "tiny" else None  # read once, not per worker
    folder = os.path.join(root, f"{w.model}-hf")
    if {"hf", "sglang"} & set(plans[0].sides):
        call_once(Side(f"export {w.model}", "rlx.bench.workloads:export_hf",
                       dict(model=w.model, folder=folder, hf_config=hf_config)), logs)
    skipped = skipped_sides(plans[0])
    for label, reason in skipped.items():
        print(f"{label} side skipped: {reason}", file=sys.stderr)
    with contextlib.ExitStack() as stack:
        server = _Server()
        if "sglang" in plans[0].sides and SGLANG not in skipped:
            t = time.perf_counter()
            server.url, server.handle = stack.enter_context(
                sglang_server(plans[0].sglang, folder, root))
            server.start_s = None if server.handle is None else time.perf_counter() - t
        return [_run_plan(p, folder, logs, hf_config, server, opts) | {"skipped": skipped}
                for p in plans]


def _run_plan(plan: Plan, folder: str, logs: str, hf_config: dict | None, server: _Server,
              opts: RunOptions) -> dict:
    w = plan.workload
    load_before = os.getloadavg()
    sides = build_sides(plan, prompt_ids(w), folder, server.url, hf_config, server.pgid)
    results = interleave(sides, opts.repeats, opts.warmup, logs, cases=opts.modes,
                         parallel_setup=opts.parallel_setup)
    server_rss = group_rss_mb(server.handle)
    rows = table_rows(results, [s.label for s in sides], opts.modes, server_rss, server.start_s)
    return {"workload": dataclasses.asdict(w), "sides": [s.label for s in sides], "rows": rows,
            "sglang_server_rss_mb": server_rss, "sglang_server_start_s": server.start_s,
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
    ratios = {f"vs_{key}": _ratio(rate, label, peer) for key, peer in PEERS.items()}
    ratios |= {f"cpu_vs_{key}": _ratio(per_cpu, label, peer) for key, peer in PEERS.items()}
    return {"side": label, "mode": mode, "tokens_per_s": rate[label],
            "tokens_per_cpu_s": per_cpu.get(label), **ratios,
            "seconds": results.median(label, "seconds", mode),
            "setup_s": server_start_s if sglang and server_start_s else results.setup[label]["setup_s"],
            "first_run_s": first[0]["seconds"] if first else None,
            "rss_mb": server_rss if sglang and server_rss else results.median(label, "peak_rss_mb", mode)}


def markdown(rows: list[dict]) -> str:
    def ratio(v):
        return "-" if v is None else f"{v:.2f}x"

    def opt(v):
        return "-" if v is None else v

    header = ["side", "mode", "tokens/s", "vs HF", "vs SGLang", "vs llama.cpp", "tokens/CPU-s",
              "vs HF", "vs SGLang", "vs llama.cpp", "setup s", "1st run s", "peak RSS MB"]
    return markdown_table(header, [
        [r["side"], r["mode"], r["tokens_per_s"], *(ratio(r[f"vs_{k}"]) for k in PEERS),
         opt(r["tokens_per_cpu_s"]), *(ratio(r[f"cpu_vs_{k}"]) for k in PEERS),
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
    return out + llama_lines(rows)


def llama_lines(rows: list[dict]) -> list[str]:
    """Every rlx side against llama.cpp on the same GGUF file (no goal is set for it)."""
    out = []
    for r in rows:
        if r["side"].startswith("rlx") and r["vs_llama"] is not None:
            cpu = "" if r["cpu_vs_llama"] is None else f" (per CPU-second: {r['cpu_vs_llama']:.2f}x)"
            out.append(f"{r['side']} vs {LLAMA}, {r['mode']}: {r['vs_llama']:.2f}x{cpu}")
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlx.bench rollout", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--batch", default="16", help="prompts per call; comma-separated sizes (1,16) "
                   "run one table each")
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
    p.add_argument("--lengths", default="uniform", choices=("uniform", "longtail"),
                   help="uniform: every request exactly --new tokens, rlx beside its peers; "
                   "longtail: the built-in engine on a long-tailed mix (rlx.bench.longtail; "
                   "--batch defaults to 64, --new to 256)")
    p.add_argument("--json", default="", help="write every figure to this file")
    p.add_argument("--workdir", default="", help="exports and logs go here (default: a temp folder)")
    p.add_argument("--sglang-python", default="", help="SGLang interpreter (default $RLX_SGLANG_PYTHON or .ci's venv)")
    p.add_argument("--sglang-harness", default="", help="module with cpu_server_env/cpu_server_args "
                   "(CPU-only machines: tests.helpers.sglang_harness)")
    p.add_argument("--sglang-url", default="", help="attach to this running server (it loads the export)")
    p.add_argument("--sglang-args", default="", help="extra sglang.launch_server flags")
    p.add_argument("--llama-python", default="", help="llama.cpp interpreter (default "
                   f"${LLAMA_CPP.variable} or {LLAMA_CPP.default_python})")
    p.add_argument("--llama-threads", type=int, default=0, help="llama.cpp threads (0: every core)")
    return p


def _batches(value: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise SystemExit(f"--batch: {value!r} is not a comma-separated list of sizes") from None
    if not sizes or min(sizes) < 1:
        raise SystemExit(f"--batch: {value!r}: sizes must be >= 1")
    return sizes


def _split(value: str, allowed: tuple[str, ...], flag: str) -> tuple[str, ...]:
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise SystemExit(f"{flag}: {bad or value!r} not in {allowed}")
    return items


def main(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    if a.lengths == "longtail":
        return _longtail(a, argv)
    models, batches = _split(a.model, MODELS, "--model"), _batches(a.batch)
    sides, modes = _split(a.sides, SIDES, "--sides"), _split(a.modes, CASES, "--modes")
    sglang = SGLangSetup(a.sglang_python, a.sglang_harness, a.sglang_url, a.sglang_args)
    llama = LlamaSetup(a.llama_python, a.llama_threads)
    opts = RunOptions(a.repeats, a.warmup, modes, a.parallel_setup)
    payload: dict = {"benchmark": "rollout", "runs": []}
    with tempfile.TemporaryDirectory(prefix="rlx-bench-rollout-") as tmp:
        root = a.workdir or tmp
        for model in models:
            plans = [Plan(Workload(model, b, a.prompt, a.new, a.seed), sides, a.lora_rank,
                          a.torch_threads, sglang, llama) for b in batches]
            try:
                records = run_model(plans, os.path.join(root, model), opts)
            except BenchError as e:
                print(f"rollout benchmark failed on {model}: {e}", file=sys.stderr)
                return 1
            payload["runs"] += records
            for plan, record in zip(plans, records):
                _print(plan.workload, record)
    write_json(a.json or None, payload)
    return 0


def _longtail(a: argparse.Namespace, argv: list[str]) -> int:
    from rlx.bench.longtail import LongTail, markdown, measure, sglang_rows

    given = lambda flag: any(x == flag or x.startswith(flag + "=") for x in argv)  # noqa: E731
    w = LongTail(batch=_batches(a.batch)[0] if given("--batch") else 64,
                 new=a.new if given("--new") else 256, lora_rank=a.lora_rank, seed=a.seed)
    sides = _split(a.sides, SIDES, "--sides")
    rows = measure(w, a.repeats, a.warmup) if any(s.startswith("rlx") for s in sides) else []
    sglang = SGLangSetup(a.sglang_python, a.sglang_harness, a.sglang_url, a.sglang_args)
    if "sglang" in sides:
        why = sglang.unavailable()
        if why:
            print(f"SGLang side skipped: {why}", file=sys.stderr)
        else:
            with tempfile.TemporaryDirectory(prefix="rlx-bench-longtail-") as tmp:
                rows += sglang_rows(w, sglang, a.workdir or tmp, a.repeats, a.warmup)
    print(f"\n### rollout, long-tailed lengths: SmolLM2 Q4_1 + LoRA {w.lora_rank}, {w.batch} "
          f"requests up to {w.new} tokens, T={w.temperature}\n")
    print(markdown(rows, w))
    write_json(a.json or None, {"benchmark": "rollout-longtail", "workload":
                                dataclasses.asdict(w), "rows": rows})
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
