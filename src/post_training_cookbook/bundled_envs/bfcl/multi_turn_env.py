"""``BFCLMultiTurnEnv``: one BFCL multi-turn entry, played as BFCL's own runner plays it.

One episode is one entry. The env opens with the first user turn and the entry's function
docs as tools; every assistant reply with calls runs them on ``bfcl-eval``'s backends (a
fresh set per episode, loaded with the entry's ``initial_config``) and answers each with a
tool message holding its result; a reply with no decodable call ends the user's turn (as in
BFCL's inference loop; a reply the codec cannot parse reaches the env as text and does the
same: ``unparsed_replies = "as_text"``), the turn is checked, and the next user turn follows.
After the last, BFCL's ``multi_turn_checker`` gives the entry's verdict.

- ``miss_func``: the docs BFCL holds back are added at the turn that adds them, in the user
  message BFCL's prompting handlers write (the docs, then "I have updated some more
  functions you can choose from. What about now?"), as tool specs in JSON. The tools of the
  prompt stay those of the first turn: the token prompt is only ever extended.
- ``max_steps_per_turn`` (default 20, BFCL's ``MAXIMUM_STEP_LIMIT``): as in BFCL's loop, the
  reply with calls past it still runs, then the entry is force-quit. Force-quit before the
  last user turn, the entry fails (BFCL's ``force_terminated``); in the last, BFCL's checker
  still judges it.
- Scores, each as BFCL reaches it: the entry verdict (``entry_verdict``) is
  ``multi_turn_checker``'s; ``prefix_turns`` counts the turns before the entry's first failing
  turn, as the checker finds it (run on each prefix of turns as the turns end). Ours, a
  training signal only: ``turn_verdicts``, each turn checked on its own on the live state, a
  turn whose ground truth has no call failing when the model calls (BFCL's checker executes
  such calls and judges them only through later turns' state).
- ``reward="entry"`` (default): the last step's reward is 1.0 when BFCL's checker accepts
  the entry, else 0.0; earlier steps give 0. ``reward="prefix"``: the reply that ends user
  turn k gets ``1/T`` when the checker's passing prefix reaches turn k (T: the entry's turns),
  so an episode's rewards sum to its prefix turn accuracy. ``reward="turns"``: ``1/T`` when
  turn k passes our per-turn check; they sum to the per-turn accuracy (ours).
  ``reward="calls"``: as ``"turns"``, but a failed turn still earns its ``credit``'s share
  (``backends.check_turn``: each ground-truth result the model's calls produced, and a right
  state). Train the per-turn rewards with ``turn_rewards="per_step"``.

Every step's metrics (read from the step that ends the episode): ``bfcl_mt_turns`` (T),
``bfcl_mt_prefix_turns`` and ``bfcl_mt_prefix_turn_accuracy`` (BFCL's), ``bfcl_mt_turns_valid``
and ``bfcl_mt_turn_accuracy`` (ours: valid / T, a turn never reached counting as failed),
``bfcl_mt_turn_credit`` (the turns' credits / T), ``bfcl_mt_entry_valid``, ``bfcl_mt_calls``,
``bfcl_mt_refused_calls`` (calls naming no method of the backends, which run nothing),
``bfcl_mt_text_replies`` (replies that ended a turn) and ``bfcl_mt_forced_quit``.
"""

from __future__ import annotations

from typing import Literal

from post_training_cookbook.bundled_envs.bfcl.backends import (
    Backends,
    DecodedCall,
    TurnVerdict,
    check_prefix,
    check_turn,
    checked_source,
    decode_calls,
)
from post_training_cookbook.bundled_envs.bfcl.multi_turn_data import MultiTurnEntry, to_tool_specs
from post_training_cookbook.envs.base import RecordingEnv, StepResult, Task
from post_training_cookbook.types import Message, ToolSpec

MultiTurnReward = Literal["entry", "prefix", "turns", "calls"]
REWARDS = ("entry", "prefix", "turns", "calls")
FORCED = "multi_turn:force_terminated"


class BFCLMultiTurnEnv(RecordingEnv):
    """A BFCL multi-turn entry as an env; build one per episode (``BFCLMultiTurnEnv()``)."""

    unparsed_replies = "as_text"

    def __init__(self, reward: MultiTurnReward = "entry", max_steps_per_turn: int = 20) -> None:
        if reward not in REWARDS:
            raise ValueError(f"reward must be one of {', '.join(REWARDS)}; got {reward!r}")
        if isinstance(max_steps_per_turn, bool) or not isinstance(max_steps_per_turn, int):
            raise TypeError(f"max_steps_per_turn must be an int, got {max_steps_per_turn!r}")
        if max_steps_per_turn < 1:
            raise ValueError(f"max_steps_per_turn must be >= 1, got {max_steps_per_turn}")
        self.reward = reward
        self.max_steps_per_turn = max_steps_per_turn
        self.entry: MultiTurnEntry | None = None
        self.turn_verdicts: list[TurnVerdict] = []
        """Each finished user turn's checks (ours), in order."""
        self.prefix_turns = 0
        """Turns before the entry's first failing turn, as BFCL's checker finds it."""
        self._prefix_failure: TurnVerdict | None = None
        self.entry_verdict: TurnVerdict | None = None
        """BFCL's verdict on the entry, once the episode has ended."""
        self._model: Backends | None = None
        self._truth: Backends | None = None
        self._tools: list[ToolSpec] = []
        self._messages: list[Message] = []
        self._recorded: list[list[list[str]]] = []  # per turn, the calls of each reply
        self._steps = 0  # replies with calls in this turn
        self._calls = self._refused = self._text_replies = 0

    async def reset(self, task: Task) -> list[Message]:
        await self.close()
        entry = self.entry = MultiTurnEntry.from_task(task)
        self._model, self._truth = Backends(entry, "model"), Backends(entry, "truth")
        self._tools = to_tool_specs(entry.functions)
        self.turn_verdicts, self.entry_verdict = [], None
        self.prefix_turns, self._prefix_failure, self._text_replies = 0, None, 0
        self._recorded, self._steps, self._calls, self._refused = [[]], 0, 0, 0
        self._messages = entry.opening(0)
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        entry, model = self.entry, self._model
        if entry is None or model is None:
            raise RuntimeError("BFCLMultiTurnEnv.step before reset")
        if self.entry_verdict is not None:
            raise RuntimeError("BFCLMultiTurnEnv.step after the episode ended")
        self._messages.append(message)
        calls = decode_calls(message)
        if calls:
            self._run(message, calls, model)
            if self._steps <= self.max_steps_per_turn:
                return StepResult(False, False, list(self._messages), metrics=self._metrics())
            # BFCL's loop force-quits the entry; its checker judges it only in the last turn
            self.turn_verdicts.append(TurnVerdict(False, FORCED))
            self.entry_verdict, reward = TurnVerdict(False, FORCED), 0.0
            if len(self.turn_verdicts) == len(entry.turns):
                prefix_before = self.prefix_turns
                self.entry_verdict = self._extend_prefix(entry)
                shares = {
                    "entry": float(self.entry_verdict.valid),
                    "prefix": float(self.prefix_turns > prefix_before) / len(entry.turns),
                }
                reward = shares.get(self.reward, 0.0)
            return StepResult(False, True, list(self._messages), reward, self._metrics())
        self._text_replies += 1
        verdict = self._finish_turn(entry)
        prefix_before = self.prefix_turns
        self._extend_prefix(entry)
        turn_share = {
            "entry": 0.0,
            "prefix": float(self.prefix_turns > prefix_before),
            "turns": float(verdict.valid),
            "calls": verdict.graded,
        }
        reward = turn_share[self.reward] / len(entry.turns)
        turn = len(self.turn_verdicts)
        if turn < len(entry.turns):
            self._recorded.append([])
            self._messages += entry.opening(turn)
            return StepResult(False, False, list(self._messages), reward, self._metrics())
        self.entry_verdict = self._prefix_failure or TurnVerdict(True)
        if self.reward == "entry":
            reward = float(self.entry_verdict.valid)
        return StepResult(True, False, list(self._messages), reward, self._metrics())

    async def close(self) -> None:
        for backends in (self._model, self._truth):
            if backends is not None:
                backends.close()
        self._model = self._truth = None

    def _run(self, message: Message, calls: list[DecodedCall], model: Backends) -> None:
        """Run a reply's calls and answer each with a tool message."""
        self._steps += 1
        self._calls += len(calls)
        self._refused += sum(model.refusal(call) is not None for call in calls)
        self._recorded[-1].append([checked_source(model, call) for call in calls])
        results = model.run(calls)
        for tool_call, call, result in zip(message["tool_calls"], calls, results, strict=True):
            answer = Message(role="tool", content=result, name=call.name)
            if isinstance(tool_call.get("id"), str):
                answer["tool_call_id"] = tool_call["id"]
            self._messages.append(answer)

    def _finish_turn(self, entry: MultiTurnEntry) -> TurnVerdict:
        assert self._model is not None and self._truth is not None
        turn = len(self.turn_verdicts)
        verdict = check_turn(
            self._model, self._truth, turn, entry.ground_truth[turn], bool(self._recorded[-1])
        )
        self.turn_verdicts.append(verdict)
        self._steps = 0
        return verdict

    def _extend_prefix(self, entry: MultiTurnEntry) -> TurnVerdict:
        """BFCL's checker on the turns played so far, once each turn ends, while every
        earlier prefix passed: ``prefix_turns`` grows by one when it passes. The checker's
        verdict on the last prefix it ran (with every turn played, the entry's)."""
        if self._prefix_failure is None:
            verdict = check_prefix(entry, self._recorded)
            if verdict.valid:
                self.prefix_turns = len(self._recorded)
            else:
                self._prefix_failure = verdict
        return self._prefix_failure or TurnVerdict(True)

    def _metrics(self) -> dict[str, float]:
        assert self.entry is not None
        turns = len(self.entry.turns)
        valid = sum(verdict.valid for verdict in self.turn_verdicts)
        entry_valid = self.entry_verdict is not None and self.entry_verdict.valid
        forced = bool(self.turn_verdicts) and self.turn_verdicts[-1].error_type == FORCED
        return {
            "bfcl_mt_turns": float(turns),
            "bfcl_mt_prefix_turns": float(self.prefix_turns),
            "bfcl_mt_prefix_turn_accuracy": self.prefix_turns / turns,
            "bfcl_mt_turns_valid": float(valid),
            "bfcl_mt_turn_accuracy": valid / turns,
            "bfcl_mt_turn_credit": sum(verdict.graded for verdict in self.turn_verdicts) / turns,
            "bfcl_mt_entry_valid": float(entry_valid),
            "bfcl_mt_calls": float(self._calls),
            "bfcl_mt_refused_calls": float(self._refused),
            "bfcl_mt_text_replies": float(self._text_replies),
            "bfcl_mt_forced_quit": float(forced),
        }
