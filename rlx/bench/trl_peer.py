"""The PyTorch peers of the learner and end-to-end benchmarks: PEFT LoRA + TRL's ``GRPOTrainer``.

Learner (``learner_side``): a real ``GRPOTrainer`` is built (PEFT LoRA from ``peft_config``, its
fused chunked log-prob head, gradient checkpointing and AdamW exactly as TRL sets them up), then
each repetition does by hand what ``Trainer``'s inner loop does for one optimizer step, minus the
generation that ``GRPOTrainer._prepare_inputs`` would start: per micro-batch
``trainer.compute_loss(model, inputs)`` (TRL's own GRPO/DAPO loss on prepared inputs: prompt and
completion ids and masks, advantages, old per-token log-probs, ``num_items_in_batch``) and
``accelerator.backward``; then ``accelerator.clip_grad_norm_`` and ``optimizer.step()``.

End to end (``e2e_side``): ``GRPOTrainer.train()`` itself, in a background thread that a callback
holds at every optimizer-step boundary, so each repetition is exactly one whole TRL step
(generate, score, update) and the harness can interleave it with rlx.

Precision follows the benchmark's ``dtype``: f32 (``bf16=False``) or TRL's default bf16 autocast
over the f32 weights (``bf16=True``), as rlx computes in bf16 over f32 weights. Everything else
is TRL's default unless the benchmark names it (gradient checkpointing is on by default; the
learner benchmark also runs it off as ``peft-nogc``).
"""

from __future__ import annotations

import queue
import tempfile
import threading
import time
import traceback

import numpy as np
from transformers import TrainerCallback

from rlx.bench.learner import LearnerSpec, make_rollouts
from rlx.bench.rl_models import ModelSource, llama_linears, lora_a_init
from rlx.platform.compiled import release_free_heap

_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
            "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def load_model_and_tokenizer(src: ModelSource):
    """The f32 torch model and its tokenizer from a HF folder (``rlx.bench.rl_models``)."""
    import torch
    import transformers

    if src.is_gguf:
        raise ValueError(f"{src.path}: the PyTorch peers load HF folders only (transformers' "
                         "Trainer refuses GGUF-loaded models); use rlx.bench.rl_models.resolve_model")
    model = transformers.AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32)
    return model, transformers.AutoTokenizer.from_pretrained(src.path)


def zero_reward(completions, **kwargs) -> list[float]:
    """Placeholder reward for the learner benchmark (it never generates)."""
    return [0.0] * len(completions)


def grpo_args(output_dir: str, s: LearnerSpec, per_device: int, group: int, grad_ckpt: bool,
              **extra):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir, use_cpu=True, bf16=s.dtype == "bfloat16", report_to="none", save_strategy="no",
        logging_steps=1, per_device_train_batch_size=per_device,
        gradient_accumulation_steps=s.micro_batches, steps_per_generation=s.micro_batches,
        num_generations=group, loss_type="dapo", epsilon=s.clip_eps_low,
        epsilon_high=s.clip_eps_high, beta=0.0, learning_rate=s.learning_rate,
        lr_scheduler_type="constant", max_grad_norm=s.max_grad_norm, weight_decay=0.0,
        gradient_checkpointing=grad_ckpt, seed=s.seed, **extra)


def peft_config(s: LearnerSpec):
    from peft import LoraConfig

    return LoraConfig(r=s.lora_rank, lora_alpha=s.lora_alpha, lora_dropout=0.0,
                      target_modules=list(_MODULES.values()), task_type="CAUSAL_LM")


def set_peft_lora(peft_model, s: LearnerSpec) -> None:
    """Copy the shared ``A`` init (``rlx.bench.rl_models.lora_a_init``) into every PEFT adapter."""
    import torch

    c = peft_model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    shapes = llama_linears(c.num_hidden_layers, c.hidden_size, c.num_attention_heads * head_dim,
                           c.num_key_value_heads * head_dim, c.intermediate_size)
    layers = peft_model.get_base_model().model.layers
    with torch.no_grad():
        for (layer, target), a in lora_a_init(shapes, s.lora_rank, s.seed).items():
            block = layers[layer]
            owner = block.self_attn if target in ("q", "k", "v", "o") else block.mlp
            weight = getattr(owner, _MODULES[target]).lora_A["default"].weight  # [r, in]
            weight.copy_(torch.from_numpy(np.ascontiguousarray(a.T)))


def enable_activation_checkpointing(trainer) -> None:
    """What ``Trainer.train()`` does before its first step when the config asks for gradient
    (activation) checkpointing; the learner benchmark never calls ``train()``."""
    args = trainer.args
    if not args.activation_checkpointing:
        return
    kwargs = dict(args.activation_checkpointing_kwargs or {})
    every, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
    trainer.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None,
                                                  every_n_layers=every, offload=offload)


def learner_side(spec: dict, model: dict, gradient_checkpointing: bool = True):
    """Worker factory: one update = TRL's loss, backward, clipping and AdamW over the batch."""
    import torch
    from datasets import Dataset
    from trl import GRPOTrainer

    s, src = LearnerSpec(**spec), ModelSource(**model)
    torch.manual_seed(s.seed)
    base, tokenizer = load_model_and_tokenizer(src)
    per_device = s.batch // s.micro_batches
    args = grpo_args(tempfile.mkdtemp(prefix="rlx_bench_trl_"), s, per_device, s.group,
                     gradient_checkpointing, max_completion_length=s.completion)
    trainer = GRPOTrainer(model=base, reward_funcs=zero_reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["x"] * s.batch}),
                          processing_class=tokenizer, peft_config=peft_config(s))
    set_peft_lora(trainer.model, s)
    enable_activation_checkpointing(trainer)
    trainer.current_gradient_accumulation_steps = s.micro_batches
    optimizer = trainer.create_optimizer()
    micro = _micro_batches(s, make_rollouts(s, base.config.vocab_size))

    def run() -> dict:
        model = trainer.model
        model.train()
        t = time.perf_counter()
        loss = 0.0
        for inputs in micro:
            mb_loss = trainer.compute_loss(model, inputs)
            trainer.accelerator.backward(mb_loss)
            loss += float(mb_loss.detach())
        grad_norm = trainer.accelerator.clip_grad_norm_(model.parameters(), s.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        seconds = time.perf_counter() - t
        release_free_heap()
        tokens = sum(float(i["prompt_mask"].sum() + i["completion_mask"].sum()) for i in micro)
        return {"tokens": tokens, "loss_tokens": sum(float(i["completion_mask"].sum()) for i in micro),
                "seconds": seconds, "loss": loss, "grad_norm": float(grad_norm)}

    return run


def _micro_batches(s: LearnerSpec, r) -> list[dict]:
    """TRL's prepared-input dicts, one per micro-batch (rows j, j + k, ... as in rlx)."""
    import torch

    k = s.micro_batches
    total = torch.tensor(float(r.completion_ids.size))  # completion tokens of the whole batch
    out = []
    for j in range(k):
        rows = np.arange(j, s.batch, k)
        prompt = torch.from_numpy(r.prompt_ids[rows])
        completion = torch.from_numpy(r.completion_ids[rows])
        out.append({"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt),
                    "completion_ids": completion, "completion_mask": torch.ones_like(completion),
                    "advantages": torch.from_numpy(r.advantages[rows]),
                    "old_per_token_logps": torch.from_numpy(r.old_logp[rows]),
                    "num_items_in_batch": total})
    return out


# ------------------------------------------------------------------------------ end to end
_REWARD = {}


def arith_reward(completions, answer, **kwargs) -> list[float]:
    """rlx's math reward (the quickstart's extractors) as a TRL reward function."""
    from rlx.rewards import get_reward, score_batch

    fn = _REWARD.get("math")
    if fn is None:
        fn = _REWARD["math"] = get_reward("math", extractors=_REWARD["extractors"])
    return [r.score for r in score_batch(fn, completions, [{"answer": a} for a in answer])]


def e2e_side(spec: dict, model: dict, gradient_checkpointing: bool = True):
    """Worker factory: ``GRPOTrainer.train()`` in a thread, released one step per repetition."""
    import torch
    from datasets import Dataset
    from trl import GRPOTrainer

    from rlx.bench.e2e import e2e_prompts, e2e_spec

    s, src = e2e_spec(spec), ModelSource(**model)
    torch.manual_seed(s.seed)
    _REWARD["extractors"] = s.extractors
    base, tokenizer = load_model_and_tokenizer(src)
    learner = LearnerSpec(micro_batches=s.micro_batches, learning_rate=s.learning_rate,
                          lora_rank=s.lora_rank, lora_alpha=s.lora_alpha, dtype=s.dtype,
                          clip_eps_low=s.clip_eps_low, clip_eps_high=s.clip_eps_high, seed=s.seed)
    extra = {"generation_kwargs": {"min_new_tokens": s.new}} if s.fixed_length else {}
    args = grpo_args(tempfile.mkdtemp(prefix="rlx_bench_trl_"), learner,
                     s.samples // s.micro_batches, s.group, gradient_checkpointing,
                     max_completion_length=s.new, temperature=s.temperature, max_steps=s.steps,
                     shuffle_dataset=False, **extra)
    gate = StepGate()
    trainer = GRPOTrainer(model=base, reward_funcs=arith_reward, args=args,
                          train_dataset=Dataset.from_list(e2e_prompts(s, src.path)),
                          processing_class=tokenizer, peft_config=peft_config(learner),
                          callbacks=[gate])
    gate.start(trainer.train)

    def step() -> dict:
        seconds, logs = gate.step()
        release_free_heap()  # the trainer thread is held at the step boundary
        return {"samples": float(s.samples), "seconds": seconds,
                "completion_tokens": logs.get("completions/mean_length", 0.0) * s.samples,
                "reward_mean": logs.get("reward", 0.0)}

    return step


class StepGate(TrainerCallback):
    """Holds ``Trainer.train()`` (run in a thread) after each step's log until ``step()`` asks for
    the next one; ``step()`` returns that step's wall time and logged metrics."""

    def __init__(self):
        self._go, self._done = threading.Event(), queue.Queue()
        self._thread = None

    def start(self, train) -> None:
        def target():
            try:
                train()
                self._done.put(("end", None))
            except BaseException as e:  # reported by the next step()
                traceback.print_exc()
                self._done.put(("error", f"{type(e).__name__}: {e}"))

        self._thread = threading.Thread(target=target, name="trl-train", daemon=True)
        self._thread.start()

    def step(self) -> tuple[float, dict]:
        t = time.perf_counter()
        self._go.set()
        kind, payload = self._done.get()
        if kind != "step":
            raise RuntimeError(f"TRL training stopped before the step was done: {payload}")
        return time.perf_counter() - t, payload

    def _hold(self) -> None:
        self._go.wait()
        self._go.clear()

    def on_train_begin(self, args, state, control, **kwargs):
        self._hold()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:  # a training step's log (not the final summary)
            self._done.put(("step", dict(logs)))
            self._hold()
