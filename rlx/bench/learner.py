"""``python -m rlx.bench learner``: one GRPO update, rlx LoRA mode vs PyTorch + PEFT with TRL's loss.

Every side trains the same batch of rollouts (built here from a fixed seed: random prompt and
completion tokens, GRPO advantages of random 0/1 rewards in groups of 8, old log-probs near the
model's) with the same hyper-parameters and micro-batching, in its own worker process:

* ``rlx-f32`` / ``rlx-bf16`` / ``rlx-int8``: rlx LoRA mode, LoRA (rank 16, alpha 32, every linear of
  every block) on a frozen f32, bf16 or int8 (per-channel) base; the compiled ``train_step`` of
  ``rlx.learner.step`` (micro-batches as a ``lax.scan``, chunked log-probs, AdamW), as the
  coordinator runs it. ``rlx-f32-remat`` etc.: the same with ``config.train.remat="layer"``
  (each layer's activations recomputed in the backward pass, as TRL's gradient checkpointing);
  ``rlx-f32-proj`` etc.: ``config.train.remat="projections"`` (every linear layer's output kept,
  the rest of each layer recomputed).
* ``peft`` / ``peft-nogc``: PyTorch + PEFT LoRA of the same shape on the f32 weights, loss from
  TRL's own ``GRPOTrainer.compute_loss`` (``rlx.bench.trl_peer``), torch AdamW from the trainer;
  ``peft`` keeps TRL's default gradient checkpointing, ``peft-nogc`` turns it off.
* ``tunix``: Tunix 0.1.7's GRPO learner (its loss, its trainer's jitted step, qwix LoRA of the
  same shape, AdamW behind global-norm clipping, micro-batches accumulated by ``optax.MultiSteps``)
  in its own environment (``rlx.bench.tunix_peer``; skipped with the reason printed where that
  environment is missing). Its LoRA ``A`` is qwix's own random init (``B = 0`` everywhere, so the
  first loss is the base's); Tunix computes in its weights' dtype.

``--dtype`` is the compute dtype of every side: float32, or bfloat16 (TRL's default; torch
autocasts, rlx computes in bf16 with f32 accumulation). LoRA parameters and AdamW stay in f32.

Loss on both sides: DAPO-style clipped surrogate (eps 0.2 / 0.28), token mean over the whole
batch, no KL; AdamW lr 1e-5, betas (0.9, 0.999), eps 1e-8, no weight decay, gradient norm clipped
to 1. One repetition = one optimizer update over the batch in ``--micro-batches`` accumulation
steps of ``batch / micro-batches`` rows. Figures: tokens/s (prompt + completion tokens of the
batch per second of the update) and peak RSS of each side's process.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

from rlx.bench.harness import (OMP_DEFAULT_ENV, Side, add_run_args, interleave, markdown_table,
                               write_json)
from rlx.bench.peer_envs import TUNIX
from rlx.bench.rl_models import (MODELS, ModelSource, llama_linears, lora_a_init, resolve_model,
                                 work_dir)
from rlx.platform.compiled import release_free_heap

RLX_SIDES = ("rlx-f32", "rlx-bf16", "rlx-int8")  # each also as "<side>-remat" and "<side>-proj"
REMAT_SUFFIXES = {"": "none", "remat": "layer", "proj": "projections"}  # suffix -> train.remat
RLX_VARIANTS = {f"{n}-{x}".rstrip("-"): (n.removeprefix("rlx-"), remat)  # side -> (base, remat)
                for x, remat in REMAT_SUFFIXES.items() for n in RLX_SIDES}
SIDES = (*RLX_VARIANTS, "peft", "peft-nogc", "tunix")
PEER = "peft"


def default_sides(dtype: str) -> tuple[str, ...]:
    """The float base stored in the compute dtype, the int8 base, and both PyTorch peers."""
    return ("rlx-bf16" if dtype == "bfloat16" else "rlx-f32", "rlx-int8", "peft", "peft-nogc")


@dataclasses.dataclass(frozen=True)
class LearnerSpec:
    """What every side trains on and with; JSON-able (it travels to the workers as kwargs)."""

    batch: int = 32  # sequences per update
    prompt: int = 64  # prompt tokens per sequence
    completion: int = 128  # completion tokens per sequence (all trained)
    micro_batches: int = 4  # gradient-accumulation steps per update
    group: int = 8  # completions per prompt uid (GRPO groups)
    lora_rank: int = 16
    lora_alpha: float = 32.0
    learning_rate: float = 1e-5
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    max_grad_norm: float = 1.0
    dtype: str = "float32"  # compute dtype: "float32" | "bfloat16" (rlx casts, torch autocasts)
    logprob_chunk: int = 1024  # rlx: tokens per chunk of the chunked log-softmax
    seed: int = 0

    def __post_init__(self):
        if min(self.batch, self.prompt, self.completion, self.micro_batches) < 1:
            raise ValueError("batch, prompt, completion and micro_batches must all be >= 1")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--dtype {self.dtype!r}: use float32 or bfloat16")
        if self.batch % self.micro_batches:
            raise ValueError(f"--batch {self.batch} must be a multiple of --micro-batches "
                             f"{self.micro_batches}")

    @property
    def tokens(self) -> int:
        return self.batch * (self.prompt + self.completion)


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """The shared rollouts, host numpy: ids [B, P] and [B, C], advantages [B], old log-probs [B, C]."""

    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    advantages: np.ndarray
    old_logp: np.ndarray


def make_rollouts(spec: LearnerSpec, vocab_size: int) -> RolloutBatch:
    """Deterministic rollouts from ``spec.seed`` (the same on every side)."""
    from rlx.learner.advantages import compute_advantages

    rng = np.random.default_rng(spec.seed)
    prompts = rng.integers(0, vocab_size, (spec.batch, spec.prompt), dtype=np.int64)
    completions = rng.integers(0, vocab_size, (spec.batch, spec.completion), dtype=np.int64)
    rewards = (rng.random(spec.batch) < 0.4).astype(np.float64)
    uids = np.arange(spec.batch) // max(spec.group, 1)
    advantages = compute_advantages("grpo", rewards, uids).astype(np.float32)
    # near a random model's log-prob of a random token, so ratios straddle the clip range
    old = -np.log(vocab_size) + 0.3 * rng.standard_normal((spec.batch, spec.completion))
    return RolloutBatch(prompts, completions, advantages, old.astype(np.float32))


# ------------------------------------------------------------------------------ the rlx side
def rlx_side(spec: dict, model: dict, base: str = "f32", remat: str = "none"):
    """Worker factory: rlx LoRA mode on a ``base`` ("f32" | "bf16" | "int8") frozen base; ``remat``
    as ``config.train.remat`` ("none" | "layer" | "projections")."""
    import jax

    s, src = LearnerSpec(**spec), ModelSource(**model)
    learner = _rlx_learner(s, src, base, remat)
    rollouts = make_rollouts(s, learner.vocab_size)
    batch = _rlx_batch(s, rollouts, learner.mesh)
    learner.step.precompile(learner.state, batch)  # compiled in setup, not in run 1
    holder = {"state": learner.state}

    def run() -> dict:
        t = time.perf_counter()
        holder["state"], metrics = jax.block_until_ready(learner.step(holder["state"], batch))
        seconds = time.perf_counter() - t
        release_free_heap()  # an idle side waiting for its turn does not hold its peak
        return {"tokens": float(np.sum(np.asarray(batch.segment_ids) > 0)),
                "loss_tokens": float(metrics.tokens), "seconds": seconds,
                "loss": float(metrics.loss), "grad_norm": float(metrics.grad_norm)}

    return run


@dataclasses.dataclass
class _RlxLearner:
    mesh: object
    graphdef: object
    state: object
    step: object
    vocab_size: int


def _rlx_learner(s: LearnerSpec, src: ModelSource, base: str, remat: str = "none") -> _RlxLearner:
    from flax import nnx

    from rlx.learner.losses import LossConfig
    from rlx.learner.state import OptimizerConfig, create_train_state, make_optimizer
    from rlx.learner.step import FORWARDS, StepConfig, make_train_step
    from rlx.mesh import MeshShape, make_mesh
    from rlx.models.loading import load_gguf, load_hf
    from rlx.quant import LoraConfig, QuantConfig, apply_lora, quantize_model

    if base not in ("f32", "bf16", "int8"):
        raise ValueError(f"rlx learner base {base!r} is not benchmarked; use f32, bf16 or int8")
    mesh = make_mesh(MeshShape())
    import jax.numpy as jnp

    loader = load_gguf if src.is_gguf else load_hf
    stored = {"f32": jnp.float32, "bf16": jnp.bfloat16, "int8": jnp.dtype(s.dtype)}[base]
    model = loader(src.path, jnp.dtype(s.dtype), mesh, param_dtype=stored).model
    if base == "int8":
        quantize_model(model, QuantConfig(format="int8"), mesh=mesh)
    apply_lora(model, LoraConfig(rank=s.lora_rank, alpha=s.lora_alpha), nnx.Rngs(s.seed), mesh=mesh)
    _set_rlx_lora(model, s)
    opt = OptimizerConfig(learning_rate=s.learning_rate, schedule="constant",
                          max_grad_norm=s.max_grad_norm)
    graphdef, state = create_train_state(model, make_optimizer(opt), mesh,
                                         trainable=nnx.LoRAParam, seed=s.seed)
    loss = LossConfig(policy_loss="dapo", clip_eps_low=s.clip_eps_low, clip_eps_high=s.clip_eps_high)
    cfg = StepConfig(loss=loss, micro_batches=s.micro_batches, logprob_chunk=s.logprob_chunk)
    step = make_train_step(graphdef, state, mesh, cfg, opt, apply_fn=FORWARDS[remat])
    return _RlxLearner(mesh, graphdef, state, step, model.config.vocab_size)


def _set_rlx_lora(model, s: LearnerSpec) -> None:
    """Copy the shared ``A`` init into every adapter (B stays 0)."""
    import jax.numpy as jnp

    c = model.config
    shapes = llama_linears(c.num_layers, c.hidden_size, c.num_heads * c.head_dim,
                           c.num_kv_heads * c.head_dim, c.intermediate_size)
    names = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
             "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    for (layer, target), a in lora_a_init(shapes, s.lora_rank, s.seed).items():
        block = model.layers[layer]
        owner = block.self_attn if target in ("q", "k", "v", "o") else block.mlp
        lora = getattr(owner, names[target]).lora
        lora.lora_a.set_value(jnp.asarray(a, lora.lora_a[...].dtype))


def _rlx_batch(s: LearnerSpec, r: RolloutBatch, mesh):
    from rlx.learner.batching import pad_rollouts, shard_batch
    from rlx.types import Rollout

    rollouts = [Rollout(prompt_uid=str(i // max(s.group, 1)), prompt_ids=r.prompt_ids[i],
                        completion_ids=r.completion_ids[i], sampler_logp=r.old_logp[i])
                for i in range(s.batch)]
    host = pad_rollouts(rollouts, r.advantages, rows_multiple=s.micro_batches,
                        old_logp=list(r.old_logp))
    return shard_batch(host, mesh)


# ------------------------------------------------------------------------------ CLI
def build_sides(names, spec: LearnerSpec, src: ModelSource, tunix_python: str = "") -> list[Side]:
    out = []
    for name in names:
        kw = {"spec": dataclasses.asdict(spec), "model": src.to_kwargs()}
        if name in RLX_VARIANTS:
            base, remat = RLX_VARIANTS[name]
            out.append(Side(name, "rlx.bench.learner:rlx_side", {**kw, "base": base, "remat": remat}))
        elif name in ("peft", "peft-nogc"):
            out.append(Side(name, "rlx.bench.trl_peer:learner_side",
                            {**kw, "gradient_checkpointing": name == "peft"}, OMP_DEFAULT_ENV))
        elif name == "tunix":
            out.append(Side(name, "rlx.bench.tunix_peer:learner_side", kw,
                            python=TUNIX.interpreter(tunix_python)))
        else:
            raise ValueError(f"--sides: unknown side {name!r}; choose from {SIDES}")
    return out


def summarize(results, labels) -> list[list]:
    """Table rows (``HEADER``); tokens per CPU-second count every thread of the side's worker."""
    peer_rss = results.median(PEER, "peak_rss_mb") if PEER in labels else None
    rows = []
    for label in labels:
        rate, rss = results.rate(label, "tokens"), results.median(label, "peak_rss_mb")
        cpu = results.rate(label, "tokens", "cpu_s")
        rows.append([label, int(results.median(label, "tokens")),
                     results.median(label, "seconds"), rate, *_versus(results, labels, rate),
                     rss / 1024.0, f"{rss / peer_rss:.2f}x" if peer_rss else "-", cpu,
                     *_versus(results, labels, cpu, "cpu_s")])
    return rows


def _versus(results, labels, value: float, seconds: str = "seconds") -> list[str]:
    """``value`` over PEFT's and Tunix's rate (``tokens`` per ``seconds``), "-" for a missing peer."""
    return [f"{value / results.rate(p, 'tokens', seconds):.2f}x" if p in labels else "-"
            for p in (PEER, "tunix")]


HEADER = ["side", "tokens/update", "update s", "tokens/s", "speed vs peft", "speed vs tunix",
          "peak RSS GB", "RSS vs peft", "tokens/CPU-s", "per CPU-s vs peft", "per CPU-s vs tunix"]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m rlx.bench learner", description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=MODELS, default="smollm2")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--completion", type=int, default=128)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--logprob-chunk", type=int, default=LearnerSpec.logprob_chunk,
                   help="rlx: tokens per chunk of the chunked log-softmax")
    add_run_args(p, repeats=3, sides_help=(
        f"comma-separated subset of {SIDES} (default: {', '.join(default_sides('float32'))}; "
        "rlx-bf16 instead of rlx-f32 with --dtype bfloat16)"))
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    spec = LearnerSpec(batch=a.batch, prompt=a.prompt, completion=a.completion,
                       micro_batches=a.micro_batches, group=min(8, a.batch), dtype=a.dtype,
                       logprob_chunk=a.logprob_chunk)
    names = [n.strip() for n in (a.sides or ",".join(default_sides(a.dtype))).split(",") if n.strip()]
    skipped = {"tunix": TUNIX.unavailable(a.tunix_python)} if "tunix" in names else {}
    skipped = {k: v for k, v in skipped.items() if v}
    names = [n for n in names if n not in skipped]
    for name, reason in skipped.items():
        print(f"{name} side skipped: {reason}", file=sys.stderr)
    with work_dir(a.work_dir, "rlx_bench_learner_") as work:
        if a.log_dir:
            os.makedirs(a.log_dir, exist_ok=True)
        src = resolve_model(a.model, work)
        results = interleave(build_sides(names, spec, src, a.tunix_python), a.repeats, a.warmup,
                             log_dir=a.log_dir or work, parallel_setup=a.parallel_setup)
    print(f"## learner: one GRPO update, {a.model}, {spec.dtype}, {spec.batch} x ({spec.prompt} + "
          f"{spec.completion}) tokens, {spec.micro_batches} micro-batches, LoRA r{spec.lora_rank}, "
          f"median of {a.repeats}\n")
    print(markdown_table(HEADER, summarize(results, names)))
    for name, reason in skipped.items():
        print(f"\n{name}: skipped ({reason})")
    write_json(a.json, {"benchmark": "learner", "model": a.model, "spec": dataclasses.asdict(spec),
                        "header": HEADER, "rows": summarize(results, names), "skipped": skipped,
                        **results.to_json()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
