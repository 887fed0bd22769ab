"""``PlanSpec``: what the memory planner needs to know about a run, and how to build it abstractly.

A spec names the architecture (``ModelConfig``), the training mode (A: every parameter trains with
AdamW; B: a frozen, possibly quantized base with LoRA adapters), the batch the learner sees, the
mesh, the rematerialisation choice, the built-in engine's rollout shape (its KV cache) and whether
PPO's critic lives beside the policy.

``abstract_model`` builds the model with ``nnx.eval_shape``: the same constructors, quantizer and
adapter code as a real run, but only shapes and dtypes, so a 1T-parameter spec costs no memory.
``rlx.learner.step.remat_forward`` is the learner ``apply_fn`` with one ``jax.checkpoint`` per decoder layer.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from rlx.errors import one_of
from rlx.rollout.jax.config import BATCHING
from rlx.learner.state import MODES
from rlx.learner.step import FORWARDS
from rlx.mesh import LogicalRules, MeshShape, batch_shards, sampling_rules
from rlx.models import ModelConfig, Precision, Transformer
from rlx.models.decoder import DTYPES
from rlx.models.loading import SCAN_MODES
from rlx.models.moe import MOE_IMPLS
from rlx.models.stack import scan_default, stack_layers
from rlx.models.hf import param_map
from rlx.quant import LoraConfig, QuantConfig, apply_lora, quantize_model
from rlx.quant.formats.gguf.blocks import BLOCK_BYTES, KEPT, GGUFTensor
from rlx.quant.loading import set_node


@dataclasses.dataclass(frozen=True)
class PlanSpec:
    """A run as the planner sees it (all sizes global unless named per device)."""

    model: ModelConfig
    mode: str = "lora"  # rlx.learner.state.MODES: "full" (AdamW on every parameter) or "lora"
    quant: QuantConfig = QuantConfig()  # mode "lora": the base representation ("none": float)
    lora: LoraConfig = LoraConfig()  # mode "lora": the adapters (AdamW on them)
    dtype: str = "bfloat16"  # compute dtype
    param_dtype: str = "bfloat16"  # storage dtype of float parameters (and of AdamW moments)
    rows: int = 8  # sequences per optimizer step (global)
    seq_len: int = 1024  # tokens per sequence (padded / packed row length)
    micro_batches: int = 1  # gradient-accumulation steps per optimizer step
    logprob_chunk: int = 1024  # tokens per chunk of the chunked log-softmax
    remat: str = "layer"  # a key of rlx.learner.step.FORWARDS (as config.train.remat)
    moe_impl: str = "ragged"  # one of rlx.models.moe.MOE_IMPLS
    # token dispatch over the expert axis: 0 dropless, else the capacity factor
    # (config.model.moe_capacity_factor, rlx.models.moe_dispatch)
    moe_capacity_factor: float = 0.0
    scan_layers: str = "auto"  # config.model.scan_layers: "auto" | "on" | "off"
    mesh: MeshShape = MeshShape()
    rollout_rows: int = 64  # built-in engine: sequences decoded at once (global)
    rollout_len: int = 2048  # built-in engine: prompt + completion slots per sequence
    # built-in engine: prompt tokens of those (a run config's data.max_prompt_tokens); 0: a
    # quarter of rollout_len
    rollout_prompt: int = 0
    kv_dtype: str = "bfloat16"  # built-in engine: KV cache dtype
    # built-in engine's batching (config.rollout.jax): "continuous" over page pools (a data
    # shard's pool: kv_pages pages of page_size tokens, 0: sized for its share of the
    # rollout_rows, a group of rollout_group samples together), or "lockstep"
    batching: str = "continuous"
    page_size: int = 16
    kv_pages: int = 0
    rollout_group: int = 1
    # whether the built-in engine holds its own copy of the trainable variables (a run's
    # RunConfig.engine_copies_trainables: an asynchronous one); False: it samples from the
    # learner's own arrays
    engine_copies_trainables: bool = False
    # the built-in engine's weight layout (config.rollout.weight_layout as resolved for the
    # platform that samples, rlx.rollout.jax.decode_layout): "out_in" holds every trainable
    # float Linear kernel transposed, a copy of its own even in a synchronous run
    decode_layout: str = "in_out"
    # PPO's learned critic (config.critic.enabled): a copy of the trainable variables (lora: a
    # second adapter on the same base; full: a copy of the policy, an upper bound for a smaller
    # critic.path model) plus the f32 value head, each with AdamW moments
    critic: bool = False
    # full mode's frozen reference policy (config.loss.kl_coef > 0 or train.algorithm="dpo" in
    # train.mode="full"): a copy of the trainable variables, sharded as they are (lora: none, the
    # reference is the base with the adapter off)
    reference: bool = False
    # train.reward="reward_model": the frozen classifier's body (no lm_head) and score labels,
    # resident in reward_model_dtype for the whole run (rlx.models.classifier); None: no model
    reward_model: ModelConfig | None = None
    reward_model_labels: int = 1
    reward_model_dtype: str = "float32"
    # quant.format="gguf": the file's tensor types ((HF name, GGUF type), from its header); the
    # block-quantized ones are planned as the blocks rlx.quant.load_gguf_quantized keeps
    gguf_types: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        one_of("plan.mode", self.mode, MODES)
        one_of("plan.decode_layout", self.decode_layout, ("in_out", "out_in"))
        one_of("plan.remat", self.remat, FORWARDS)
        one_of("plan.batching", self.batching, BATCHING)
        for name in ("dtype", "param_dtype", "kv_dtype", "reward_model_dtype"):
            one_of(f"plan.{name}", getattr(self, name), DTYPES)
        one_of("plan.moe_impl", self.moe_impl, MOE_IMPLS)
        one_of("plan.scan_layers", self.scan_layers, SCAN_MODES)
        if self.moe_capacity_factor < 0:
            raise ValueError(f"plan.moe_capacity_factor={self.moe_capacity_factor} must be >= 0 "
                             "(0: dropless)")
        for name in ("rows", "seq_len", "micro_batches", "logprob_chunk", "rollout_rows",
                     "rollout_len", "page_size", "rollout_group"):
            if getattr(self, name) < 1:
                raise ValueError(f"plan.{name}={getattr(self, name)} must be >= 1")
        if self.kv_pages < 0:
            raise ValueError(f"plan.kv_pages={self.kv_pages} must be >= 0 (0: automatic)")
        if not 0 <= self.rollout_prompt < self.rollout_len:
            raise ValueError(f"plan.rollout_prompt={self.rollout_prompt} must be in [0, "
                             f"plan.rollout_len={self.rollout_len}) (0: a quarter of it)")
        if self.rows % self.micro_batches:
            raise ValueError(f"plan.rows={self.rows} must be a multiple of plan.micro_batches="
                             f"{self.micro_batches}")

    @property
    def batch_shards(self) -> int:
        """Devices the batch rows are split over (``rlx.mesh.batch_shards`` under TRAIN_RULES)."""
        return batch_shards(self.mesh)

    @property
    def continuous(self) -> bool:
        """Whether the built-in engine batches continuously over page pools."""
        return self.batching == "continuous"

    @property
    def page_shards(self) -> int:
        """The continuous engine's data shards, each with its page pool: the batch shards and
        the context devices (``rlx.mesh.context_as_rows``)."""
        return self.batch_shards * self.mesh.context

    @property
    def micro_rows(self) -> int:
        return self.rows // self.micro_batches

    @property
    def precision(self) -> Precision:
        return Precision.named(self.dtype, self.param_dtype, self.moe_impl)

    @property
    def scanned(self) -> bool:
        """Whether the layers run scanned (``rlx.models.stack``), as a run would decide."""
        return self.scan_layers == "on" or (self.scan_layers == "auto"
                                            and scan_default(self.model.num_layers))

    @property
    def engine_rules(self) -> LogicalRules:
        """The built-in engine's sharding rules in this run (``rlx.mesh.sampling_rules``)."""
        return sampling_rules(self.mode, self.engine_copies_trainables)

    def replace(self, **kw) -> "PlanSpec":
        return dataclasses.replace(self, **kw)


def _build(spec: PlanSpec) -> Transformer:
    model = Transformer(spec.model, spec.precision, rngs=nnx.Rngs(0))
    if spec.mode == "lora":
        gguf = spec.quant.spec.keeps_file_blocks
        model = _gguf_blocks(model, spec) if gguf else quantize_model(model, spec.quant)
        model = apply_lora(model, spec.lora, nnx.Rngs(1))
    return stack_layers(model) if spec.scanned else model


def _gguf_blocks(model: Transformer, spec: PlanSpec) -> Transformer:
    """The float ``model`` with each tensor the GGUF file keeps as blocks (``spec.gguf_types``)
    replaced by a ``GGUFTensor`` of its type and shape, stored as ``load_gguf_quantized`` stores
    it (zeros: the model is built abstractly)."""
    types = dict(spec.gguf_types)
    flat = {"/".join(map(str, k)): v for k, v in nnx.to_flat_state(nnx.state(model))}
    for path, src in param_map(spec.model).items():
        qtype = types.get(src.hf_names[0])
        if src.layout not in ("T", "copy", "stack_T") or qtype not in BLOCK_BYTES:
            continue
        var = flat[path]
        shape, ax = var.shape, var.get_metadata().get("logical_axes")
        hf = shape if src.layout == "copy" else (*shape[:-2], shape[-1], shape[-2])  # [..., N, K]
        blocks = jnp.zeros((*hf[:-1], hf[-1] // KEPT[qtype][0] * BLOCK_BYTES[qtype]), jnp.uint8)
        if ax is not None:  # the stored rows follow the matrix's N axis, the bytes are whole
            ax = (ax[0], ax[-1], None) if src.layout == "stack_T" else (
                ax[-1] if src.layout == "T" else ax[0], None)
        set_node(model, path, GGUFTensor(qtype, hf, blocks, ax, kernel=src.layout != "copy"))
    return model


def abstract_model(spec: PlanSpec) -> Transformer:
    """The model of ``spec`` with ``jax.ShapeDtypeStruct`` leaves (no weights allocated)."""
    return nnx.eval_shape(lambda: _build(spec))


def trainable_filter(spec: PlanSpec):
    return MODES[spec.mode]


