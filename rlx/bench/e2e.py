"""``python -m rlx.bench e2e``: samples/s of whole RL steps, rlx vs TRL ``GRPOTrainer``.

One step = generate ``--prompts`` x ``--group`` completions, score them, one optimizer update.
Both sides run GRPO on the same model (an f32 HF folder, ``rlx.bench.rl_models``), the same
prompts in the same order (rlx's ``arith:add2`` pipeline with the quickstart's instruction, fed to
TRL as the rendered chat text), the same reward (rlx's math reward, called by TRL as a plain Python
reward function), LoRA rank 16 / alpha 32 on every linear, DAPO loss (clip 0.2 / 0.28, token mean,
no KL), AdamW lr 5e-4 constant, gradient-norm clip 1, ``--micro-batches`` accumulation steps, and
one compute dtype (``--dtype``: float32, or bfloat16 = TRL's default autocast and rlx's bf16 base
and compute).

* ``rlx-f32`` / ``rlx-bf16`` / ``rlx-int8`` / ``rlx-gguf``: ``rlx.build(config)`` and ``Run.step()``,
  the code path of ``python -m rlx.launch`` (built-in JAX engine, LoRA mode LoRA on an f32, bf16,
  int8 or GGUF Q4_1 base; ``rlx-gguf`` is SmolLM2's own GGUF file, the quickstart's base). The
  phase split comes from the step's own timers.
* ``trl``: ``GRPOTrainer.train()`` held at every step boundary (``rlx.bench.trl_peer``), TRL's
  defaults otherwise (transformers ``generate``, gradient checkpointing).
* ``tunix``: Tunix 0.1.7's ``GRPOLearner.train()`` with its own sampler, held the same way, LoRA
  by qwix, in its own environment (``rlx.bench.tunix_peer``, ``rlx.bench.peer_envs``; skipped
  with the reason printed where that environment is missing). Its "generate s" is its whole
  generate-and-score stage, its "update s" the rest of the step (update and weight sync). Tunix
  computes in its weights' dtype (``--dtype bfloat16``: bf16 weights and compute).

With ``--fixed-length`` (default) every completion is exactly ``--new`` tokens (rlx: its training
rollouts' ``SamplingParams(ignore_eos=True)``, ``rlx.build``'s ``sampling_overrides``; TRL
``min_new_tokens``), so both sides do the same work; otherwise completions stop at EOS and their
lengths differ by chance. TRL steps take minutes on a CPU, so
the defaults are 2 measured steps after 1 warm-up step (which also compiles rlx).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile

from rlx.bench.harness import (OMP_DEFAULT_ENV, Side, add_run_args, interleave, markdown_table,
                               write_json)
from rlx.bench.peer_envs import TUNIX
from rlx.bench.rl_models import MODELS, ModelSource, resolve_model, smollm2_gguf, work_dir
from rlx.platform.compiled import release_free_heap

SIDES = ("rlx-f32", "rlx-bf16", "rlx-int8", "rlx-gguf", "trl", "tunix")
PEER = "trl"
PEERS = ("trl", "tunix")  # a "speed vs" column each
PHASES = ("generate", "score", "logprob", "update", "sync")


@dataclasses.dataclass(frozen=True)
class E2ESpec:
    """One RL step's shape and hyper-parameters, shared by every side (JSON-able)."""

    prompts: int = 8  # prompts per step
    group: int = 8  # completions per prompt
    new: int = 128  # completion tokens (cap, or exact with fixed_length)
    micro_batches: int = 4  # gradient-accumulation steps of the update
    fixed_length: bool = True  # every completion exactly `new` tokens
    steps: int = 3  # steps each side will be asked for (warm-up + measured)
    temperature: float = 0.7
    learning_rate: float = 5e-4
    lora_rank: int = 16
    lora_alpha: float = 32.0
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    source: str = "arith:add2"
    template: str = "{prompt} Give only the final answer."
    max_prompt_tokens: int = 128
    extractors: tuple[str, ...] = ("boxed", "last_number")
    dtype: str = "float32"  # compute dtype of every side: "float32" | "bfloat16"
    seed: int = 0

    def __post_init__(self):
        if min(self.prompts, self.new, self.micro_batches, self.steps) < 1 or self.group < 2:
            raise ValueError("prompts, new, micro_batches and steps must be >= 1 and group >= 2")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--dtype {self.dtype!r}: use float32 or bfloat16")
        if (self.prompts * self.group) % self.micro_batches:
            raise ValueError(f"--prompts x --group = {self.prompts * self.group} completions do "
                             f"not split into {self.micro_batches} micro-batches")

    @property
    def samples(self) -> int:
        return self.prompts * self.group


def rlx_config(s: E2ESpec, model_path: str, base: str, output_dir: str) -> dict:
    """The run config of the rlx side: the quickstart's recipe at the benchmark's shape."""
    quant = {"f32": ("none", "hf"), "bf16": ("none", "hf"), "int8": ("int8", "hf"),
             "gguf": ("gguf", "gguf")}[base]
    stored = {"f32": "float32", "bf16": "bfloat16"}.get(base, s.dtype)  # float leaves of the base
    return {
        "seed": s.seed, "output_dir": output_dir,
        "model": {"path": model_path, "dtype": s.dtype, "param_dtype": stored},
        "quant": {"format": quant[0], "serving": quant[1]}, "lora": {"rank": s.lora_rank, "alpha": s.lora_alpha},
        "data": {"source": s.source, "prompts_per_step": s.prompts, "template": s.template,
                 "max_prompt_tokens": s.max_prompt_tokens, "eval_size": 0},
        "rollout": {"group_size": s.group, "max_new_tokens": s.new,
                    "temperature": s.temperature},
        "train": {"mode": "lora", "steps": s.steps, "advantage": "grpo",
                  "math_extractors": s.extractors, "micro_batches": s.micro_batches,
                  "logprob_chunk": 1024, "eval_every": 0, "sample_every": 0,
                  "checkpoint_every": 0, "max_staleness": 0},
        "loss": {"policy_loss": "dapo", "clip_eps_low": s.clip_eps_low,
                 "clip_eps_high": s.clip_eps_high, "kl_coef": 0.0},
        "optim": {"learning_rate": s.learning_rate, "schedule": "constant", "max_grad_norm": 1.0},
    }


def rlx_side(spec: dict, model: dict, base: str = "f32"):
    """Worker factory: an rlx ``Run``; one repetition = ``run.step()``."""
    import rlx

    s, src = e2e_spec(spec), ModelSource(**model)
    path = smollm2_gguf() if base == "gguf" else src.path
    if base == "gguf" and src.name != "smollm2":
        raise ValueError("rlx-gguf needs --model smollm2 (the tiny model has no GGUF file)")
    fixed = {"ignore_eos": True, "stop_token_ids": ()} if s.fixed_length else {}
    run = rlx.build(rlx_config(s, path, base, tempfile.mkdtemp(prefix="rlx_bench_e2e_")),
                    progress=False, sampling_overrides=fixed)

    def step() -> dict:
        r = run.step()
        release_free_heap()
        out = {"samples": float(s.samples), "seconds": r["time/step"],
               "completion_tokens": r["response_length/mean"] * s.samples,
               "reward_mean": r["reward/mean"]}
        out.update({f"{p}_s": r.get(f"time/{p}", 0.0) for p in PHASES})
        return out

    return step


def e2e_spec(spec: dict) -> E2ESpec:
    return E2ESpec(**{**spec, "extractors": tuple(spec.get("extractors", ()))})


def e2e_prompts(s, model_path: str) -> list[dict]:
    """The prompts rlx's pipeline yields for steps 0 .. steps-1 (same seed, format and order),
    as rendered chat text with their gold answers."""
    from rlx.data.chat import PromptFormat
    from rlx.data.pipeline import make_prompt_pipeline
    from rlx.data.sources import get_source
    from rlx.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_path)
    it = make_prompt_pipeline(get_source(s.source, "train"), tok, batch_size=s.prompts, seed=s.seed,
                              max_prompt_tokens=s.max_prompt_tokens,
                              prompt_format=PromptFormat(template=s.template))
    rows = []
    for _ in range(s.steps):
        batch = next(it)
        rows += [{"prompt": tok.decode(list(p.token_ids)), "answer": e.answer}
                 for p, e in zip(batch.prompts, batch.examples)]
    return rows


# ------------------------------------------------------------------------------ CLI
def build_sides(names, spec: E2ESpec, src: ModelSource, tunix_python: str = "") -> list[Side]:
    out = []
    for name in names:
        kw = {"spec": dataclasses.asdict(spec), "model": src.to_kwargs()}
        if name in ("rlx-f32", "rlx-bf16", "rlx-int8", "rlx-gguf"):
            out.append(Side(name, "rlx.bench.e2e:rlx_side", {**kw, "base": name[4:]}))
        elif name == PEER:
            out.append(Side(name, "rlx.bench.trl_peer:e2e_side", kw, OMP_DEFAULT_ENV))
        elif name == "tunix":
            out.append(Side(name, "rlx.bench.tunix_peer:e2e_side",
                            {**kw, "prompts": e2e_prompts(spec, src.path)},
                            python=TUNIX.interpreter(tunix_python)))
        else:
            raise ValueError(f"--sides: unknown side {name!r}; choose from {SIDES}")
    return out


HEADER = ["side", "samples/step", "step s", "samples/s", "speed vs trl", "speed vs tunix",
          "completion tokens", "generate s", "score s", "update s", "peak RSS GB",
          "samples/CPU-s", "per CPU-s vs trl", "per CPU-s vs tunix"]


def summarize(results, labels) -> list[list]:
    """Table rows (``HEADER``); the per-CPU-second figures count every thread of the side's worker
    (a loaded machine changes them less than the wall-clock rates)."""
    peers = {p: results.rate(p, "samples") for p in PEERS if p in labels}
    per_cpu = {p: results.rate(p, "samples", "cpu_s") for p in labels}
    rows = []
    for label in labels:
        rate, first = results.rate(label, "samples"), results.runs[label][0]
        phases = [results.median(label, f"{p}_s") if f"{p}_s" in first else "-"
                  for p in ("generate", "score", "update")]
        speed = [f"{rate / peers[p]:.2f}x" if p in peers else "-" for p in PEERS]
        cpu = [f"{per_cpu[label] / per_cpu[p]:.2f}x" if p in peers else "-" for p in PEERS]
        rows.append([label, int(results.median(label, "samples")), results.median(label, "seconds"),
                     rate, *speed, int(results.median(label, "completion_tokens")), *phases,
                     results.median(label, "peak_rss_mb") / 1024.0, per_cpu[label], *cpu])
    return rows


def available(names: list[str], tunix_python: str) -> tuple[list[str], dict[str, str]]:
    """The sides that can run here, and why each other one cannot (printed)."""
    reason = TUNIX.unavailable(tunix_python) if "tunix" in names else None
    if reason:
        print(f"tunix side skipped: {reason}", file=sys.stderr)
        return [n for n in names if n != "tunix"], {"tunix": reason}
    return list(names), {}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m rlx.bench e2e", description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=MODELS, default="smollm2")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--fixed-length", action=argparse.BooleanOptionalAction, default=True,
                   help="every completion exactly --new tokens (default) or stop at EOS")
    add_run_args(p, repeats=2, sides_help=f"comma-separated subset of {SIDES} (default: "
                 "rlx-f32,trl; rlx-bf16,trl with --dtype bfloat16)")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    spec = E2ESpec(prompts=a.prompts, group=a.group, new=a.new, micro_batches=a.micro_batches,
                   fixed_length=a.fixed_length, steps=a.warmup + a.repeats, dtype=a.dtype)
    default = f"rlx-{'bf16' if a.dtype == 'bfloat16' else 'f32'},trl"
    names, skipped = available([n.strip() for n in (a.sides or default).split(",") if n.strip()],
                               a.tunix_python)
    with work_dir(a.work_dir, "rlx_bench_e2e_") as work:
        if a.log_dir:
            os.makedirs(a.log_dir, exist_ok=True)
        src = resolve_model(a.model, work)
        results = interleave(build_sides(names, spec, src, a.tunix_python), a.repeats, a.warmup,
                             log_dir=a.log_dir or work, parallel_setup=a.parallel_setup)
    rows = summarize(results, names)
    length = "exactly" if spec.fixed_length else "up to"
    print(f"## e2e: GRPO steps, {a.model}, {spec.dtype}, {spec.prompts} prompts x {spec.group} samples x "
          f"{length} {spec.new} tokens, LoRA r{spec.lora_rank}, median of {a.repeats}\n")
    print(markdown_table(HEADER, rows))
    for name, reason in skipped.items():
        print(f"\n{name}: skipped ({reason})")
    write_json(a.json, {"benchmark": "e2e", "model": a.model, "spec": dataclasses.asdict(spec),
                        "header": HEADER, "rows": rows, "skipped": skipped, **results.to_json()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
