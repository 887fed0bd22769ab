"""``PlanSpec``: what the memory planner needs to know about a run, and how to build it abstractly.

A spec names the architecture (``ModelConfig``), the training mode (A: every parameter trains with
AdamW; B: a frozen, possibly quantized base with LoRA adapters), the batch the learner sees, the
mesh, the rematerialisation choice and the built-in engine's rollout shape (its KV cache).

``abstract_model`` builds the model with ``nnx.eval_shape``: the same constructors, quantizer and
adapter code as a real run, but only shapes and dtypes, so a 1T-parameter spec costs no memory.
``rlx.learner.step.remat_forward`` is the learner ``apply_fn`` with one ``jax.checkpoint`` per decoder layer.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from rlx.mesh import MeshShape
from rlx.models import ModelConfig, Precision, Transformer
from rlx.quant import LoraConfig, QuantConfig, apply_lora, quantize_model

MODES = ("A", "B")
REMAT = ("none", "layer")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class PlanSpec:
    """A run as the planner sees it (all sizes global unless named per device)."""

    model: ModelConfig
    mode: str = "B"  # "A": full-parameter AdamW; "B": frozen base + LoRA (AdamW on adapters)
    quant: QuantConfig = QuantConfig()  # mode B base representation ("none": float base)
    lora: LoraConfig = LoraConfig()  # mode B adapters
    dtype: str = "bfloat16"  # compute dtype
    param_dtype: str = "bfloat16"  # storage dtype of float parameters (and of AdamW moments)
    rows: int = 8  # sequences per optimizer step (global)
    seq_len: int = 1024  # tokens per sequence (padded / packed row length)
    micro_batches: int = 1  # gradient-accumulation steps per optimizer step
    logprob_chunk: int = 1024  # tokens per chunk of the chunked log-softmax
    remat: str = "layer"  # "none": keep every activation; "layer": keep layer inputs, recompute
    moe_impl: str = "ragged"  # "ragged" | "dense" (see rlx.models.moe)
    mesh: MeshShape = MeshShape()
    rollout_rows: int = 64  # built-in engine: sequences decoded at once (global)
    rollout_len: int = 2048  # built-in engine: prompt + completion slots per sequence
    kv_dtype: str = "bfloat16"  # built-in engine: KV cache dtype

    def __post_init__(self):
        _one_of("mode", self.mode, MODES)
        _one_of("remat", self.remat, REMAT)
        _one_of("dtype", self.dtype, tuple(_DTYPES))
        _one_of("param_dtype", self.param_dtype, tuple(_DTYPES))
        _one_of("kv_dtype", self.kv_dtype, tuple(_DTYPES))
        _one_of("moe_impl", self.moe_impl, ("ragged", "dense"))
        for name in ("rows", "seq_len", "micro_batches", "logprob_chunk", "rollout_rows",
                     "rollout_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"plan.{name}={getattr(self, name)} must be >= 1")
        if self.rows % self.micro_batches:
            raise ValueError(f"plan.rows={self.rows} must be a multiple of plan.micro_batches="
                             f"{self.micro_batches}")

    @property
    def batch_shards(self) -> int:
        """Devices the batch rows are split over (TRAIN_RULES: data x fsdp x expert)."""
        m = self.mesh
        return m.data * m.fsdp * m.expert

    @property
    def micro_rows(self) -> int:
        return self.rows // self.micro_batches

    @property
    def precision(self) -> Precision:
        return Precision(dtype=_DTYPES[self.dtype], param_dtype=_DTYPES[self.param_dtype],
                         moe_impl=self.moe_impl)

    def replace(self, **kw) -> "PlanSpec":
        return dataclasses.replace(self, **kw)


def _one_of(name, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"plan.{name}={value!r} is not one of {list(allowed)}")


def _build(spec: PlanSpec) -> Transformer:
    model = Transformer(spec.model, spec.precision, rngs=nnx.Rngs(0))
    if spec.mode == "B":
        model = quantize_model(model, spec.quant)
        model = apply_lora(model, spec.lora, nnx.Rngs(1))
    return model


def abstract_model(spec: PlanSpec) -> Transformer:
    """The model of ``spec`` with ``jax.ShapeDtypeStruct`` leaves (no weights allocated)."""
    return nnx.eval_shape(lambda: _build(spec))


def trainable_filter(spec: PlanSpec):
    return nnx.LoRAParam if spec.mode == "B" else nnx.Param


