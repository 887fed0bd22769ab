"""A single-turn verifiers taskset: four sums, scored by a rubric of two weighted rewards."""

import verifiers.v1 as vf

PROBLEMS = ((2, 3), (7, 5), (12, 30), (9, 9))


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task):
    @vf.reward
    async def correct(self, task, trace) -> float:
        """1 when the reply's last \\boxed{} holds the sum."""
        return float(vf.extract_boxed_answer(trace.last_reply) == task.answer)

    @vf.reward(weight=0.1)
    async def brevity(self, trace) -> float:
        """1 / (1 + characters of the reply)."""
        return 1.0 / (1 + len(trace.last_reply))


class SumTaskset(vf.Taskset[SumTask]):
    def load(self):
        for i, (a, b) in enumerate(PROBLEMS):
            prompt = f"What is {a} + {b}? Answer in \\boxed{{}}."
            yield SumTask(SumData(id=f"sum-{i}", prompt=prompt, answer=str(a + b)),
                          self.config.task)


__all__ = ["SumTaskset"]


def load_environment(system_prompt: str | None = None) -> vf.Env:
    """The environment, with an optional system prompt for every task."""
    taskset = vf.TasksetConfig(id="rlx_vf_arith")
    env = vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset=taskset))
    if system_prompt:
        env.taskset.system_prompt = system_prompt
    return env
