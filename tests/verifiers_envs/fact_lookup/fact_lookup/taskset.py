"""fact_lookup: the post-training-cookbook tool-use game's questions as a verifiers taskset.

A question about a fictional world ("What is the weight of kalo?"), answered by looking the
fact up with a shared MCP toolset (``list_fact_keys``, ``lookup``, ``calculator``; servers/facts.py) and
replying with only the number. The world, its questions and the train/val split are the
game's (servers/world.json, written from ``post_training_cookbook.envs.tool_use_game``; the
two splits share no entity), and so are the system prompt and the tools' names and
descriptions: the cookbook's bundled 4.5M-parameter model was fine-tuned on this format, so
it can play this env, which it cannot do for glossary (docs/verifiers.md). ``levels``: 1 (one
lookup), 2 (a lookup and arithmetic), 3 (two lookups and arithmetic).
"""

import re
from decimal import ROUND_HALF_UP, Decimal

import verifiers.v1 as vf
from fact_lookup.servers.facts import WORLD, FactTools

SYSTEM_PROMPT = (
    "Answer questions about a fictional world. Look facts up with the tools and use the "
    "calculator for arithmetic. Then reply with only the final number, rounded to two "
    "decimals if it is not whole."
)
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")


class FactLookupData(vf.TaskData):
    answer: str
    """The number the question asks for."""
    level: int


class FactLookupTask(vf.Task[FactLookupData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        # The game's rule: the reply is only a number, equal to the answer to two decimals.
        return float(numbers_equal(trace.last_reply or "", self.data.answer))


def numbers_equal(reply: str, target: str) -> bool:
    left, right = reply.strip(), target.strip()
    if len(left) > 64 or not _NUMBER.fullmatch(left) or not _NUMBER.fullmatch(right):
        return False
    cents = Decimal("0.01")
    return Decimal(left).quantize(cents, ROUND_HALF_UP) == Decimal(right).quantize(
        cents, ROUND_HALF_UP
    )


class FactLookupConfig(vf.TasksetConfig):
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()
    split: str = "val"
    """``train`` or ``val`` (the game's splits: no entity in common)."""
    levels: list[int] = [1]
    limit: int | None = None
    """Only the first ``limit`` questions of the split (in the game's order)."""


class FactLookupTaskset(vf.Taskset[FactLookupTask, FactLookupConfig]):
    @classmethod
    def toolsets(cls, config: FactLookupConfig) -> list[vf.Toolset]:
        return [FactTools(config.tools)]  # one server for every rollout: the world is fixed

    def load(self) -> list[FactLookupTask]:
        rows = [r for r in WORLD["tasks"][self.config.split] if r["level"] in self.config.levels]
        return [
            FactLookupTask(
                FactLookupData(
                    idx=i,
                    prompt=row["prompt"],
                    system_prompt=SYSTEM_PROMPT,
                    answer=row["answer"],
                    level=row["level"],
                ),
                self.config.task,
            )
            for i, row in enumerate(rows[: self.config.limit])
        ]
