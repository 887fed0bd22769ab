"""A multi-turn verifiers taskset: guess the secret number with the `guess` tool, which answers
"higher", "lower" or "correct"; scored on naming the secret and on the guesses it took."""

import verifiers.v1 as vf

SECRET = 6
UPPER = (8, 10, 16)


class GuessToolset(vf.Toolset):
    @vf.tool
    def guess(self, number: int) -> str:
        """Compare a guess with the secret number."""
        return "correct" if number == SECRET else ("higher" if number < SECRET else "lower")


class GuessTask(vf.Task):
    @vf.reward
    async def found(self, trace) -> float:
        """1 when the reply's last \\boxed{} holds the secret."""
        return float(vf.extract_boxed_answer(trace.last_reply) == str(SECRET))

    @vf.reward(weight=0.5)
    async def few_guesses(self, trace) -> float:
        """1 / guesses made (0 without a guess)."""
        return 1.0 / len(trace.tool_messages) if trace.tool_messages else 0.0


class GuessTaskset(vf.Taskset[GuessTask]):
    def load(self):
        for upper in UPPER:
            prompt = (f"I am thinking of a number from 1 to {upper}. Find it with the guess "
                      "tool, then answer in \\boxed{}.")
            yield GuessTask(vf.TaskData(id=f"guess-{upper}", prompt=prompt), self.config.task)

    @classmethod
    def toolsets(cls, config):
        return [GuessToolset(vf.ToolsetConfig())]


__all__ = ["GuessTaskset"]


def load_environment() -> vf.Env:
    return vf.SingleAgentEnv(vf.SingleAgentEnvConfig(
        taskset=vf.TasksetConfig(id="rlx_vf_guess")))
