"""Checks of a parsed config against the devices and the model's architecture, before any work.

``with_warm_start(cfg)`` reads a PEFT folder's rank, alpha and targets (``lora.init_from``) into
the config the run is built from, refusing a folder rlx's adapters cannot hold (parsing the config
reads no adapter folder). ``check_before_build(cfg, n_devices)`` runs in ``rlx.build`` after it,
before weights are read, anything is compiled or any server is launched. It reads only the
model's architecture (``config.json`` or the GGUF header, with ``model.shrink`` applied) and
raises a one-line ``ConfigError`` naming the field, what is wrong and the values that would work:

- the mesh against the visible devices, and against the model (tensor parallelism must divide the
  attention heads, expert parallelism the experts);
- the batch: with one rollout per row (``train.pack=False``, or DPO's pairs) and a fixed number of
  micro-batches, ``data.prompts_per_step * rollout.group_size`` rows (whole GRPO groups by
  construction) must divide evenly over the data-parallel devices and ``train.micro_batches``,
  otherwise every update would pad with empty rows (packed rows and token budgets make as many
  rows as the step needs, whatever the rollout count);
- the sequence length: ``data.max_prompt_tokens`` + ``rollout.max_new_tokens`` (tool-use episodes:
  ``env.max_episode_tokens``) within the positions the model was built for
  (``ModelConfig.position_limit``: ``max_position_embeddings``, or a scaled rope's extended length);
- LoRA targets that adapt no module of this model (e.g. MLP targets on a MoE whose experts are
  excluded by ``lora.experts=False`` and that has no dense or shared MLP);
- a base format the checkpoint cannot take: a quantized HF folder (``quantization_config``) needs
  ``quant.format='shipped'``, whose layout must be one rlx reads (``rlx.quant.shipped``, refused
  naming the method); ``quant.format='gguf'`` needs a GGUF file holding
  Q4_0/Q4_1/Q8_0 linear weights (and real weights, not ``model.shrink``), int4/nf4 group sizes must
  divide every layer's input size; what SGLang cannot serve (``rlx.rollout.sglang.policy.
  check_servable``: LoRA on MoE experts only over a float or fp8 base, ...);
- the named eval sets (``data.eval_sources``: ``rlx.run.heldout.check_eval_sets``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os

import jax

from rlx.config import RunConfig
from rlx.errors import ConfigError
from rlx.learner.critic import HEAD_TENSORS, value_head_width
from rlx.mesh import batch_axes, batch_shards
from rlx.models.config import ModelConfig, from_hf_config
from rlx.models.decoder import Precision
from rlx.models.loading import resolve_path
from rlx.quant.config import LORA_TARGETS, MLP_TARGETS, QuantConfig
from rlx.quant.loading import check_shrink, resolve_quant
from rlx.quant.lora import target_counts
from rlx.quant.peft_import import abstract_lora_model, peft_lora_config
from rlx.rollout.sglang.policy import check_servable
from rlx.run.engines import serving
from rlx.run.heldout import check_eval_sets


def with_warm_start(cfg: RunConfig) -> RunConfig:
    """``cfg`` with the adapter of its PEFT folder ``lora.init_from``: that folder's rank, alpha and
    targets (``rlx.quant.peft_import.peft_lora_config``; rsLoRA as the equal ``alpha * sqrt(r)``
    over ``r``), read from ``adapter_config.json`` and the tensor names; ``cfg`` itself without
    one. The run's build, ``python -m rlx.eval`` and the dry run take the config from here."""
    if not cfg.lora.init_from:
        return cfg
    cfg.check_warm_start()
    return dataclasses.replace(cfg, lora=peft_lora_config(cfg.lora))


def check_before_build(cfg: RunConfig, n_devices: int) -> ModelConfig:
    """Every check above; returns the (shrunk) architecture the run will build."""
    cfg.mesh.check_devices(n_devices)
    check_batch(cfg)
    check_eval_sets(cfg)
    arch, gguf_types = read_architecture(cfg)
    check_mesh_fits(cfg, arch)
    note_lockstep(cfg, arch)
    if cfg.train.mode == "lora":
        check_lora_targets(cfg, arch)
    check_base_format(cfg, arch, gguf_types)
    check_moe(cfg, arch)
    if cfg.critic.path:
        check_critic(cfg, arch)
    if cfg.train.algorithm == "dpo":
        check_pairs(cfg)
    check_lengths(cfg, arch)
    return arch


def check_moe(cfg: RunConfig, arch: ModelConfig) -> None:
    """Routing replay and a dispatch capacity need MoE layers."""
    if arch.moe is not None:
        return
    for field, on in (("train.router_replay", cfg.train.router_replay),
                      ("model.moe_capacity_factor", cfg.model.moe_capacity_factor > 0)):
        if on:
            raise ConfigError(f"config.{field} acts on MoE layers, and {cfg.model.path!r} has "
                              "none; turn it off for a dense model")


def read_architecture(cfg: RunConfig, other: str | None = None
                      ) -> tuple[ModelConfig, dict[str, str]]:
    """The model's ``ModelConfig`` (shrunk when ``model.shrink`` is on) and, for a GGUF file, the
    storage type of each tensor; only headers are read. ``other``: another model's path (a
    critic's), read as it is (never shrunk)."""
    path = resolve_path(other or cfg.model.path)
    gguf = path.endswith(".gguf") if other else cfg.model.is_gguf
    types: dict[str, str] = {}
    if gguf:
        from rlx.models.gguf import read_gguf

        ckpt = read_gguf(path)
        arch, types = from_hf_config(ckpt.hf_config), dict(ckpt.tensor_types)
    else:
        from rlx.models.hf import read_hf_config

        arch = read_hf_config(path, text_only=cfg.model.text_only)
    if other is None and cfg.model.shrink.enabled:
        from rlx.models.loading import shrunk

        arch = shrunk(arch, cfg.model.shrink)
    return arch, types


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_lengths(cfg: RunConfig, arch: ModelConfig) -> None:
    """The longest sequence the config allows fits the model's positions (DPO's pairs are as long
    as the data makes them: not checked here)."""
    if cfg.train.algorithm == "dpo":
        return
    limit, prompt = arch.position_limit, cfg.data.max_prompt_tokens
    single = cfg.env.kind == "single"
    field, reply = (("rollout.max_new_tokens", cfg.rollout.max_new_tokens) if single
                    else ("env.max_episode_tokens", cfg.env.max_episode_tokens))
    if prompt + reply <= limit:
        return
    rope = arch.rope
    built = f"max_position_embeddings={arch.max_position_embeddings}" + (
        f", {rope.kind} rope factor {rope.factor:g} x original_max_position_embeddings="
        f"{rope.original_max_position_embeddings}" if rope.kind != "default" else "")
    raise ConfigError(
        f"config.data.max_prompt_tokens + config.{field} = {prompt} + {reply} = {prompt + reply} "
        f"tokens, longer than the {limit} positions {arch.architecture} was built for ({built}); "
        f"lower them to sum to at most {limit}, or use a checkpoint whose config.json extends its "
        "context (rope_scaling, e.g. YaRN)")


def check_batch(cfg: RunConfig) -> None:
    """With one rollout per row and a fixed number of micro-batches, the step's rows divide evenly
    over the data-parallel devices times the micro-batches (of each of ``train.minibatches``
    minibatches)."""
    if cfg.train.algorithm == "dpo":  # whole pairs per micro-batch and device
        return _check_pairs(cfg)
    if cfg.train.pack or cfg.train.tokens_per_micro_batch:
        return  # rows as many as the step needs (rlx.learner.batching.batch_layout)
    rows = cfg.data.prompts_per_step * cfg.rollout.group_size
    micro = cfg.train.micro_batches * cfg.train.minibatches
    dp = batch_shards(cfg.mesh)
    if rows % (dp * micro) == 0:
        return
    prompts = next(p for p in range(cfg.data.prompts_per_step, 10**9)
                   if p * cfg.rollout.group_size % (dp * micro) == 0)
    micros = [d for d in _divisors(rows) if rows % (dp * d) == 0]
    split = "train.micro_batches" + (" x train.minibatches" if cfg.train.minibatches > 1 else "")
    fix = f"set data.prompts_per_step={prompts}" + (f" or {split} to one of {micros}" if micros else "")
    raise ConfigError(
        f"config.data.prompts_per_step * config.rollout.group_size = {cfg.data.prompts_per_step} * "
        f"{cfg.rollout.group_size} = {rows} rollouts per step do not split evenly over "
        f"{' * '.join(f'mesh.{a}' for a in batch_axes())} = {dp} devices x {split} = {micro}; {fix}")


def _check_pairs(cfg: RunConfig) -> None:
    pairs, dp, micro = cfg.data.prompts_per_step, batch_shards(cfg.mesh), cfg.train.micro_batches
    if pairs % (dp * micro):
        raise ConfigError(f"config.data.prompts_per_step={pairs} preference pairs per step do not "
                          f"split evenly over {dp} data-parallel devices x train.micro_batches = "
                          f"{micro}; use a multiple of {dp * micro}")


def check_pairs(cfg: RunConfig) -> None:
    """DPO: every pair of ``data.source`` has a prompt and two non-empty, different replies
    (the pair source refuses a bad line naming it; read before any weight)."""
    from rlx.data.sources import DataError, get_source

    try:
        get_source(cfg.data.source, "all")
    except (DataError, KeyError) as e:
        raise ConfigError(f"config.data.source={cfg.data.source!r}: {e}") from None


def check_mesh_fits(cfg: RunConfig, arch: ModelConfig) -> None:
    """Tensor parallelism splits attention heads; expert parallelism splits experts; context
    parallelism cannot split a gated DeltaNet's recurrence."""
    t, e = cfg.mesh.tensor, cfg.mesh.expert
    if arch.num_heads % t:
        raise ConfigError(f"config.mesh.tensor={t} does not divide the model's {arch.num_heads} "
                          f"attention heads; use one of {_divisors(arch.num_heads)}")
    if arch.moe is not None and arch.moe.num_experts % e:
        raise ConfigError(f"config.mesh.expert={e} does not divide the model's "
                          f"{arch.moe.num_experts} experts; use one of {_divisors(arch.moe.num_experts)}")
    if arch.linear_attention is not None and cfg.mesh.context > 1:
        raise ConfigError(f"config.mesh.context={cfg.mesh.context}: {arch.architecture}'s gated "
                          "DeltaNet layers run a recurrence over each sequence's tokens in order, "
                          "which context parallelism splits; use context=1")


def note_lockstep(cfg: RunConfig, arch: ModelConfig) -> None:
    """Logs that the built-in engine runs a model with recurrent layers lockstep, when the config
    asks for continuous batching."""
    if (arch.linear_attention is not None and cfg.rollout.engine == "jax"
            and cfg.rollout.jax.batching == "continuous"):
        logging.getLogger("rlx").warning(
            "config.rollout.jax.batching='continuous': the built-in engine samples %s lockstep "
            "(its paged cache does not carry the DeltaNet layers' recurrent state yet); set "
            "rollout.jax.batching='lockstep' to silence this", arch.architecture)


def check_lora_targets(cfg: RunConfig, arch: ModelConfig) -> None:
    """Each LoRA target adapts at least one module of this model (``rlx.quant.lora.target_counts``:
    e.g. ``k`` on a multi-head latent attention model, or MLP targets on a MoE whose experts are
    excluded by ``lora.experts=False`` and that has no dense or shared MLP)."""
    counts = target_counts(arch, cfg.lora)
    dead = [t for t, n in counts.items() if n == 0]
    if not dead:
        if cfg.lora.kind == "oft":
            check_oft(cfg, arch)
        return
    every = target_counts(arch, dataclasses.replace(cfg.lora, targets=LORA_TARGETS))
    live = [t for t in LORA_TARGETS if every[t]]
    why = ""
    if any(t in MLP_TARGETS for t in dead) and arch.moe is not None and not cfg.lora.experts:
        why = ("every layer's MLP is sparse, it has no shared expert and config.lora.experts="
               "False; set lora.experts=True or ")
    attention = "multi-head latent attention" if arch.mla is not None else "attention"
    raise ConfigError(
        f"config.lora.targets={list(cfg.lora.targets)}: {dead} adapt no module of "
        f"{arch.architecture} ({attention}); {why}target only {live}")


def check_oft(cfg: RunConfig, arch: ModelConfig) -> None:
    """An OFT adapter (``lora.kind="oft"``) fits: its block size divides the input width of
    every projection it adapts (on the shapes alone), and the serving format quantizes no
    activations (a W8A8 server would quantize the input before the rotation a merged export
    folds into the weight; the learner rotates first)."""
    q = cfg.quant
    if q.activation_mode != "none":
        raise ConfigError(f"config.lora.kind='oft' with config.quant.serving={q.serving!r}, which "
                          "quantizes activations: rlx rotates them before the base and a merged "
                          "export cannot; serve a weight-only layout (e.g. quant.serving='hf')")
    try:
        abstract_lora_model(arch, Precision.named("float32", "float32"), cfg.lora)
    except ValueError as e:
        raise ConfigError(f"{e} (every adapted projection of {arch.architecture})") from None


def check_critic(cfg: RunConfig, arch: ModelConfig) -> None:
    """A separate critic (``critic.path``) reads the policy's token ids, and a value head it
    carries fits its hidden states."""
    critic, _ = read_architecture(cfg, cfg.critic.path)
    if critic.vocab_size != arch.vocab_size:
        raise ConfigError(f"config.critic.path={cfg.critic.path!r} has a vocabulary of "
                          f"{critic.vocab_size} tokens, the policy's {arch.vocab_size}: the critic "
                          "reads the policy's token ids; use a model with the same tokenizer")
    width = value_head_width(resolve_path(cfg.critic.path))
    if width is not None and width != critic.hidden_size:
        raise ConfigError(f"config.critic.path={cfg.critic.path!r} carries a value head "
                          f"({HEAD_TENSORS[0]}) of width {width}, but its hidden size is "
                          f"{critic.hidden_size}; the head and the model disagree")


def check_base_format(cfg: RunConfig, arch: ModelConfig, gguf_types: dict[str, str]) -> None:
    """The base format fits the checkpoint: a quantized HF folder needs ``quant.format="shipped"``
    (its values are not floats), a shipped layout rlx cannot honour is refused naming its method
    (``rlx.quant.shipped.layout``), a GGUF base needs a GGUF file, group sizes divide the widths,
    and SGLang can serve the result."""
    q = cfg.quant
    if not cfg.model.is_gguf and not cfg.model.shrink.enabled:
        _check_quantized_folder(cfg)
    if q.spec.from_checkpoint:
        resolved = resolve_quant(q, cfg.model)
        if cfg.rollout.engine == "sglang" and not resolved.exact:
            lay = resolved.layout
            raise ConfigError(
                f"config.quant.format='shipped': SGLang cannot be handed this checkpoint's "
                f"{lay.method} layout ({lay.bits}-bit {lay.strategy}"
                f"{'' if lay.symmetric else ', asymmetric'}) as rlx holds it; use "
                "rollout.engine='jax' (the built-in engine samples from the same arrays)")
        q = resolved.quant
    if q.spec.keeps_file_blocks:
        _check_gguf_base(cfg, q, gguf_types)
    if q.spec.grouped and not cfg.quant.spec.from_checkpoint:
        _check_group_size(q.group_size, arch, q.modules)
    if cfg.rollout.engine == "sglang":
        check_servable(serving(cfg), arch, jax.process_count())


def _check_quantized_folder(cfg: RunConfig) -> None:
    """A HF folder whose config.json carries a ``quantization_config`` holds quantized values:
    only ``quant.format="shipped"`` reads them (float loading would misread them as weights;
    rlx never dequantizes a base to re-quantize it)."""
    from rlx.quant.shipped import read_quantization_config

    qc = read_quantization_config(resolve_path(cfg.model.path))
    if qc and not cfg.quant.spec.from_checkpoint:
        raise ConfigError(
            f"config.model.path={cfg.model.path!r} holds a quantized checkpoint (quantization_config "
            f"quant_method={qc.get('quant_method')!r}); config.quant.format={cfg.quant.format!r} "
            "would read its quantized values as float weights: set config.quant.format='shipped' "
            "(train.mode='lora') to keep them as they are, or point model.path at a float copy")


def _check_gguf_base(cfg: RunConfig, q: QuantConfig, gguf_types: dict[str, str]) -> None:
    from rlx.quant.formats.gguf.blocks import BLOCK_BYTES

    if not cfg.model.is_gguf:  # (shipped resolves to a file's blocks only for a GGUF file)
        raise ConfigError(f"config.quant.format={q.format!r} keeps a GGUF file's blocks, but "
                          f"config.model.path={cfg.model.path!r} is not a .gguf file; use "
                          "quant.format='int8'/'int4'/'nf4'/'fp8' to quantize HF weights, or point "
                          "model.path at a GGUF file")
    check_shrink(cfg.quant, q, cfg.model)
    linear = {n: t for n, t in gguf_types.items() if n.endswith("_proj.weight")}
    if linear and not any(t in BLOCK_BYTES for t in linear.values()):
        found = sorted(set(linear.values()))
        raise ConfigError(
            f"config.quant.format='gguf': {os.path.basename(cfg.model.path)} stores its linear "
            f"weights as {found}, which rlx does not keep as blocks (supported: {sorted(BLOCK_BYTES)});"
            " use a Q4_0/Q4_1/Q8_0 file, or quant.format='int8'/'int4' to requantize the "
            "dequantized weights")


def group_inputs(arch: ModelConfig, modules: str = "all") -> dict[str, int]:
    """The input widths of the linears a grouped int4/nf4 base quantizes (``quant.modules``): the
    routed experts' (hidden, expert width) and, for ``"all"``, the attention's (GQA: hidden and
    ``num_heads * head_dim``; MLA: hidden, ``q_lora_rank``, ``kv_lora_rank`` and ``num_heads *
    v_head_dim``), the dense MLPs' and the shared experts'."""
    inputs = {"hidden_size": arch.hidden_size}
    if arch.moe is not None:
        inputs["moe intermediate_size"] = arch.moe.intermediate_size
    if modules == "experts":
        return inputs
    if any(not arch.is_sparse_layer(i) for i in range(arch.num_layers)):
        inputs["intermediate_size"] = arch.intermediate_size
    if arch.moe is not None and arch.moe.shared_intermediate_size:
        inputs["shared expert intermediate_size"] = arch.moe.shared_intermediate_size
    m = arch.mla
    if m is None:
        inputs["num_heads * head_dim"] = arch.num_heads * arch.head_dim
        return inputs
    if m.q_lora_rank is not None:
        inputs["q_lora_rank"] = m.q_lora_rank
    inputs["kv_lora_rank"] = m.kv_lora_rank
    inputs["num_heads * v_head_dim"] = arch.num_heads * m.v_head_dim
    return inputs


def _check_group_size(group: int, arch: ModelConfig, modules: str) -> None:
    inputs = group_inputs(arch, modules)
    bad = {k: v for k, v in inputs.items() if v % group}
    if bad:
        common = math.gcd(*inputs.values())
        ok = [g for g in (16, 32, 64, 128, 256) if common % g == 0]
        raise ConfigError(f"config.quant.group_size={group} does not divide the model's input sizes "
                          f"{bad}; use a group size dividing {common} (e.g. {ok or [common]})")
