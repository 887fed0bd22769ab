"""Parity preflight: do the learner and the rollout engine see the same policy?

Before training starts (and every k steps) a fixed probe batch of token sequences is scored twice:
teacher-forced log-probs from the learner's own model code, and the log-probs the rollout engine
assigns to the same tokens. Over the configured threshold on the maximum absolute difference, the
run stops with an error naming the engine, the base format and the figures; below it, the figures
are returned for tensorboard. Quantized bases in LoRA mode are compared in their served form, so a
mismatched serving format or a stale adapter is caught before any update is wasted on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from rlx.kernels.logprobs import token_logprobs
from rlx.mesh import host_values

Sequences = Sequence[tuple[Sequence[int], int]]  # (token ids, prompt length)


class PreflightError(RuntimeError):
    """Learner and rollout engine disagree on log-probs beyond the threshold."""


@dataclasses.dataclass(frozen=True)
class PreflightReport:
    engine: str
    base_format: str
    max_abs: float
    mean_abs: float
    k3_kl: float  # mean of exp(d) - d - 1 with d = engine - learner log-prob
    tokens: int
    threshold: float

    @property
    def passed(self) -> bool:
        return self.max_abs <= self.threshold

    def scalars(self) -> dict[str, float]:
        return {"preflight/max_abs": self.max_abs, "preflight/mean_abs": self.mean_abs,
                "preflight/k3_kl": self.k3_kl}


def learner_logprobs(model, sequences: Sequences, chunk_size: int = 256, **call_kw) -> list[np.ndarray]:
    """Teacher-forced log-probs of every token after the prompt, from the learner's model."""
    width = max(len(ids) for ids, _ in sequences)
    ids = np.zeros((len(sequences), width), np.int32)
    mask = np.zeros_like(ids)
    for r, (seq, _) in enumerate(sequences):
        ids[r, : len(seq)], mask[r, : len(seq)] = seq, 1
    # numpy in (placed beside the weights, also on a mesh across processes), numpy out
    logp = host_values(_score(model, ids, mask, chunk_size, tuple(sorted(call_kw.items()))))
    return [logp[r, p - 1 : len(seq) - 1] for r, (seq, p) in enumerate(sequences)]


@jax.jit(static_argnums=(3, 4))
def _score(model, ids, mask, chunk_size, call_kw):
    h = model.hidden_states(ids, attention_mask=mask, **dict(call_kw))  # [B, T, D]
    logp, _ = token_logprobs(h[:, :-1], model.logits, ids[:, 1:], chunk_size)
    return logp  # [B, T-1]: logp[t] scores ids[t+1]


def compare(learner: list[np.ndarray], engine: list[np.ndarray], *, engine_name: str,
            base_format: str, threshold: float) -> PreflightReport:
    for i, (a, b) in enumerate(zip(learner, engine)):
        if a.shape != b.shape:
            raise PreflightError(f"{engine_name} returned {b.shape[0]} log-probs for probe {i}, "
                                 f"the learner {a.shape[0]}")
    d = np.concatenate([b - a for a, b in zip(learner, engine)]).astype(np.float64)
    return PreflightReport(engine_name, base_format, float(np.abs(d).max()), float(np.abs(d).mean()),
                           float(np.mean(np.exp(d) - d - 1)), int(d.size), threshold)


def run_preflight(model, score_engine: Callable[[Sequences], list[np.ndarray]], probe: Sequences,
                  *, engine_name: str, base_format: str, threshold: float, **call_kw) -> PreflightReport:
    """Score ``probe`` with both sides; raise ``PreflightError`` over ``threshold``."""
    report = compare(learner_logprobs(model, probe, **call_kw), score_engine(probe),
                     engine_name=engine_name, base_format=base_format, threshold=threshold)
    if not report.passed:
        raise PreflightError(
            f"parity preflight failed: {engine_name} (base format {base_format}) and the learner "
            f"disagree on log-probs: max |diff| {report.max_abs:.3g} > threshold {threshold:.3g} "
            f"(mean {report.mean_abs:.3g}, k3 KL {report.k3_kl:.3g} over {report.tokens} tokens). "
            "The engine is not serving the policy being trained: check the exported weights/adapter, "
            "the quantization format the server was started with, and the weight version.")
    return report
