"""A tool-use verifiers taskset: (a + b) * c with Python function tools `add` and `multiply`
(a task-level toolset, one per episode, counting its calls); scored on the boxed result."""

import verifiers.v1 as vf

PROBLEMS = ((3, 4, 5), (2, 8, 3))


class ArithmeticToolset(vf.Toolset):
    def __init__(self, config):
        super().__init__(config)
        self.calls = 0

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """a + b."""
        self.calls += 1
        return a + b

    @vf.tool
    async def multiply(self, a: int, b: int) -> int:
        """a * b."""
        self.calls += 1
        return a * b


class ExprData(vf.TaskData):
    answer: str


class ExprTask(vf.Task):
    @vf.reward
    async def correct(self, task, trace) -> float:
        """1 when the reply's last \\boxed{} holds (a + b) * c."""
        return float(vf.extract_boxed_answer(trace.last_reply) == task.answer)

    @classmethod
    def toolsets(cls, config):
        return [ArithmeticToolset(vf.ToolsetConfig())]


class ExprTaskset(vf.Taskset[ExprTask]):
    def load(self):
        for i, (a, b, c) in enumerate(PROBLEMS):
            prompt = f"Compute ({a} + {b}) * {c} with the tools, then answer in \\boxed{{}}."
            yield ExprTask(ExprData(id=f"expr-{i}", prompt=prompt, answer=str((a + b) * c)),
                           self.config.task)


__all__ = ["ExprTaskset"]


def load_environment() -> vf.Env:
    return vf.SingleAgentEnv(vf.SingleAgentEnvConfig(
        taskset=vf.TasksetConfig(id="rlx_vf_tools")))
