"""Sequence classifiers (transformers' ``*ForSequenceClassification``, e.g. a reward model): the
causal LM's body without ``lm_head``, plus the ``score`` head (``score.weight`` ``[num_labels,
hidden]``, no bias) applied to the final-norm hidden state of each sequence's last token.

Which token: transformers takes the rightmost token whose id is not ``pad_token_id`` (so left and
right padding both work; without a pad id it takes the last position, and refuses batches of more
than one). rlx right-pads and knows each row's length: it takes the rightmost of the row's real
tokens whose id is not ``pad_token_id`` (the last real token when config.json has no pad id),
which is transformers' choice on the same ids; a row of pad tokens only is scored at position 0,
as there. Positions count real tokens only (``rlx.models.decoder.resolve_positions``).

The model is frozen: its variables are ``nnx.Param`` leaves placed on the mesh by the logical-axis
rules like the policy's (the head's ``embed`` dimension as the body's), read by one jitted
function per padded shape and never handed to an optimizer. ``classify`` pads token lists into
batches of ``rows`` and a power-of-two length (at least 16), so a run compiles a few shapes only.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from rlx.errors import ConfigError
from rlx.mesh import TRAIN_RULES, LogicalRules, batch_sharding, batch_shards, named_sharding, round_up
from rlx.models.config import ModelConfig, from_hf_config
from rlx.models.decoder import Precision, Transformer
from rlx.models.families import BY_ARCHITECTURE
from rlx.models.hf import check_float_checkpoint, load_model
from rlx.models.loading import check_path
from rlx.models.safetensors_io import CheckpointError, SafetensorsFolder

SUFFIX = "ForSequenceClassification"
SCORE = "score.weight"  # [num_labels, hidden]
DTYPES = ("float32", "bfloat16")
MIN_LENGTH = 16  # shortest padded length a batch compiles for


@dataclasses.dataclass(frozen=True)
class RewardModelSection:
    """``config.reward_model``: the sequence classifier ``train.reward="reward_model"`` scores
    with (its own tokenizer and chat template format prompt and completion)."""

    path: str = ""  # HF folder of a *ForSequenceClassification checkpoint with its tokenizer
    label: int = 0  # the logit that is the reward (0 for the usual one-label reward model)
    batch_size: int = 8  # sequences per forward pass
    max_length: int = 2048  # longer prompt + completion keeps its last max_length tokens
    dtype: str = "float32"  # compute and storage dtype: float32 | bfloat16
    scale: float = 1.0  # reward = scale * logit + offset
    offset: float = 0.0

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"config.reward_model.dtype={self.dtype!r} is not one of {list(DTYPES)}")
        if self.batch_size < 1 or self.max_length < 1 or self.label < 0:
            raise ConfigError(f"config.reward_model.batch_size={self.batch_size} and max_length="
                              f"{self.max_length} must be >= 1, label={self.label} >= 0")

    def check_used(self, reward: str, env_kind: str, distributed: bool) -> None:
        """``train.reward="reward_model"`` needs ``path``, a folder that exists, and scores
        single-turn completions of a one-process run (episodes and processes scoring their own
        rollouts on a shared mesh are not wired yet)."""
        if reward != "reward_model":
            return
        if not self.path:
            raise ConfigError("config.train.reward='reward_model' needs config.reward_model.path: "
                              f"the HF folder of a *{SUFFIX} checkpoint")
        check_path("config.reward_model.path", self.path)
        if env_kind != "single" or distributed:
            raise ConfigError(f"config.train.reward='reward_model' scores single-turn completions "
                              f"in one process; got env.kind={env_kind!r}, distributed.enabled="
                              f"{distributed}: use env.kind='single' without distributed")


@dataclasses.dataclass(frozen=True)
class ClassifierConfig:
    """What a classifier's ``config.json`` says: its body, its labels and its pad id."""

    body: ModelConfig  # the causal LM without lm_head (tie_word_embeddings: no head to read)
    num_labels: int
    pad_token_id: int | None


def read_classifier_config(path: str) -> ClassifierConfig:
    """The ``ClassifierConfig`` of a HF folder; anything but a ``*ForSequenceClassification`` of
    a family rlx reads (dense or MoE text models) is refused, naming what it found."""
    file = os.path.join(path, "config.json")
    if not os.path.exists(file):
        raise CheckpointError(f"{path}: no config.json; pass the HF folder of a "
                              f"*{SUFFIX} checkpoint (config.json + *.safetensors)")
    with open(file) as f:
        hf = json.load(f)
    archs = hf.get("architectures") or []
    causal = [a.removesuffix(SUFFIX) + "ForCausalLM" for a in archs if a.endswith(SUFFIX)]
    causal = [a for a in causal if a in BY_ARCHITECTURE and BY_ARCHITECTURE[a].multimodal is None]
    if not causal:
        known = sorted(a.removesuffix("ForCausalLM") + SUFFIX for a, s in BY_ARCHITECTURE.items()
                       if a.endswith("ForCausalLM") and s.multimodal is None)
        raise CheckpointError(f"{path}: config.json architectures={archs!r} is not a sequence "
                              f"classifier rlx reads; a reward model is one of {known}")
    pad = hf.get("pad_token_id")
    body = from_hf_config({**hf, "architectures": causal[:1], "tie_word_embeddings": True})
    labels = hf.get("num_labels") or len(hf.get("id2label") or {}) or 2  # transformers' default: 2
    return ClassifierConfig(body, int(labels), None if pad is None else int(pad))


class SequenceClassifier(nnx.Module):
    """A classifier's body and ``score`` head (``[hidden, num_labels]``, f32 accumulation)."""

    def __init__(self, body: Transformer, score: nnx.Param, pad_token_id: int | None):
        self.body, self.score, self.pad_token_id = body, score, pad_token_id

    def __call__(self, input_ids: Int[Array, "b t"], lengths: Int[Array, " b"]
                 ) -> Float[Array, "b l"]:
        """Logits of each row's scored token (see the module docstring)."""
        t = input_ids.shape[1]
        real = jnp.arange(t)[None, :] < lengths[:, None]  # [B, T]
        hidden = self.body.hidden_states(input_ids, attention_mask=real.astype(jnp.int32))
        scored = real if self.pad_token_id is None else real & (input_ids != self.pad_token_id)
        last = jnp.argmax(jnp.arange(t)[None, :] * scored, axis=1)  # [B]
        h = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]  # [B, D]
        return jnp.einsum("bd,dl->bl", h, self.score[...].astype(h.dtype),
                          preferred_element_type=jnp.float32)


def load_classifier(path: str, mesh: Mesh | None = None, dtype: str = "float32",
                    rules: LogicalRules = TRAIN_RULES) -> SequenceClassifier:
    """The classifier of a HF folder, its variables placed on ``mesh`` by ``rules`` (one device
    without a mesh); refused: another architecture, a quantized checkpoint, no ``score.weight``
    or one whose shape disagrees with config.json."""
    info = read_classifier_config(path)
    check_float_checkpoint(path)
    tensors = SafetensorsFolder(path)
    want = (info.num_labels, info.body.hidden_size)
    if SCORE not in tensors:
        raise CheckpointError(f"{path}: no {SCORE!r} tensor; a *{SUFFIX} checkpoint holds its "
                              f"head there ({list(want)}: num_labels x hidden_size)")
    if tuple(tensors.shape(SCORE)) != want:
        raise CheckpointError(f"{path}: {SCORE!r} has shape {list(tensors.shape(SCORE))}, but "
                              f"config.json implies {list(want)} (num_labels x hidden_size)")
    body = load_model(info.body, tensors, precision=Precision.named(dtype, dtype), mesh=mesh,
                      rules=rules)
    axes = ("embed", None)
    kernel = np.asarray(tensors[SCORE], np.float32).T.astype(jnp.dtype(dtype))  # [D, L]
    sharding = (jax.sharding.SingleDeviceSharding(jax.local_devices()[0]) if mesh is None
                else named_sharding(mesh, axes, rules, kernel.shape))
    score = nnx.Param(jax.device_put(kernel, sharding), logical_axes=axes)
    return SequenceClassifier(body, score, info.pad_token_id)


class Scorer:
    """``classify``'s compiled forward: ``(ids [R, T], lengths [R]) -> logits [R, L]`` on the
    classifier's mesh, rows split over the batch axes (one program per padded shape)."""

    def __init__(self, model: SequenceClassifier, mesh: Mesh | None = None,
                 rules: LogicalRules = TRAIN_RULES):
        self.graphdef, self.state = nnx.split(model)
        self.pad_id = model.pad_token_id or 0
        self.row_multiple = 1 if mesh is None else batch_shards(mesh, rules)
        states = jax.tree.map(lambda a: a.sharding, self.state)
        rows = None if mesh is None else (batch_sharding(mesh, 2, rules), batch_sharding(mesh, 1, rules))
        shardings = {} if mesh is None else dict(in_shardings=(states, *rows), out_shardings=rows[0])
        self._fn = jax.jit(self._logits, **shardings)

    def _logits(self, state, ids, lengths):
        return nnx.merge(self.graphdef, state)(ids, lengths)

    def __call__(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        return np.asarray(jax.device_get(self._fn(self.state, ids, lengths)))


def classify(scorer: Scorer, tokens: Sequence[Sequence[int]], batch_size: int,
             max_length: int) -> np.ndarray:
    """Logits ``[N, num_labels]`` of each token list (its last ``max_length`` tokens), in
    batches of ``batch_size`` rows (rounded up to the mesh's batch shards), right-padded with the
    pad id to a power-of-two length."""
    if not tokens:
        raise ValueError("classify needs at least one token list")
    kept = [list(t)[-max_length:] for t in tokens]
    rows = round_up(batch_size, scorer.row_multiple)
    out = []
    for start in range(0, len(kept), rows):
        chunk = kept[start:start + rows]
        longest = max(max(len(t) for t in chunk), 1)
        t = min(max(MIN_LENGTH, 1 << (longest - 1).bit_length()), max_length)
        ids = np.full((rows, t), scorer.pad_id, np.int32)
        lengths = np.zeros((rows,), np.int32)
        for i, row in enumerate(chunk):
            ids[i, :len(row)], lengths[i] = row, len(row)
        out.append(scorer(ids, lengths)[:len(chunk)])
    return np.concatenate(out)


__all__ = ["RewardModelSection", "ClassifierConfig", "SequenceClassifier", "Scorer", "classify",
           "load_classifier", "read_classifier_config"]
