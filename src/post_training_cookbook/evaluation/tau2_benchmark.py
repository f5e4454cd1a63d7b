"""τ²-bench as ``evaluate(..., benchmark="tau2:...")``: a domain split's tasks, ``Tau2Env``,
and τ²'s report, pass^k per domain.

Spelling: ``tau2:DOMAIN[,DOMAIN...][@SPLIT]``, the domains among ``airline``, ``retail``,
``telecom`` (each with τ²'s user simulator) and ``telecom_solo`` (telecom in τ²'s solo mode:
the ticket, no user); ``SPLIT`` one of τ²'s splits of every domain named (``base``, the
published benchmark, by default; ``train``, ``test``; telecom also ``small``, ``full``).
``"tau2"`` alone is τ²-bench as published: airline, retail and telecom, ``base``.

A domain with a user needs the simulated user's model: ``evaluate(...,
user_simulator=UserSimulatorSettings(model=..., base_url=...))`` (or any ``UserFactory``);
without it, or with one for ``telecom_solo`` alone, the call is refused before any model
loads.

The report is τ²'s (``tau2.metrics.agent_metrics``, called, not copied): an episode succeeds
when τ²'s reward is 1 (``is_successful``: within 1e-6); a task of n trials
(``episodes_per_task``) with c successes scores pass^k = C(c, k) / C(n, k) for every k from
1 to n (``pass_hat_k``), and a domain's pass^k is the mean over its tasks. Its standard error
is over tasks: the sample standard deviation of the tasks' pass^k values over
sqrt(number of tasks) (0 with one task). An episode τ² did not score (its prompt did not fit
``max_model_length``, a reply the codec could not parse, an env error under
``env_errors="truncate"``, ``max_turns`` reached) is a failure.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from post_training_cookbook.envs.base import Env, Task
from post_training_cookbook.evaluation.scores import BenchmarkScore, CategoryScore
from post_training_cookbook.rollout import Episode, Group

if TYPE_CHECKING:
    from post_training_cookbook.bundled_envs.tau2.user import Tau2User

TAU2 = "tau2"
SOLO = "telecom_solo"
TAU2_DOMAINS = ("airline", "retail", "telecom", SOLO)
PUBLISHED = ("airline", "retail", "telecom")
"""``"tau2"`` alone: τ²-bench's three domains, each with its user simulator."""
DEFAULT_SPLIT = "base"

TAU2_LIMITS = {"max_turns": 200, "max_model_length": 32768, "max_tokens_per_turn": 1024}
"""The episode limits a τ² score uses unless told otherwise: τ² bounds an episode by its
messages (the env's ``max_steps``, 200: ``max_turns`` never binds first), not by tokens, and
its prompts are some 5,000 to 10,000 tokens before the first user turn (docs/tau2.md)."""


def check_tau2_spec(spec: str, domains: Sequence[str], split: str) -> tuple[tuple[str, ...], str]:
    """The domains and split of ``spec`` (``"tau2:airline,retail@test"``), checked against
    τ²'s own splits; ``ValueError`` naming what is wrong."""
    from post_training_cookbook.bundled_envs.tau2.data import task_splits

    unknown = [domain for domain in domains if domain not in TAU2_DOMAINS]
    if unknown:
        raise ValueError(
            f"unknown τ² domain {unknown[0]!r} (from {spec!r}): choose from "
            f"{', '.join(TAU2_DOMAINS)} (telecom_solo: telecom without a user)"
        )
    chosen = tuple(dict.fromkeys(domains)) or PUBLISHED
    split = split or DEFAULT_SPLIT
    for domain in chosen:
        splits = task_splits(_tau2_domain(domain))
        if split not in splits:
            raise ValueError(
                f"τ²'s {_tau2_domain(domain)} domain has no split {split!r} (from {spec!r}): "
                f"its splits are {', '.join(splits)}"
            )
    return chosen, split


def tau2_inputs(
    domains: Sequence[str], split: str, spec: str, limit: int | None, user: Tau2User | None
) -> tuple[list[Task], Callable[[Task], Env]]:
    """The tasks (the first ``limit`` of each domain's split) and the env factory of a τ²
    spec (``spec``: as written, for errors); ``ValueError`` when the user simulator is
    missing or has no domain to play."""
    from post_training_cookbook.bundled_envs.tau2 import Tau2Env, tau2_tasks

    with_user = [domain for domain in domains if domain != SOLO]
    if with_user and user is None:
        raise ValueError(
            f"benchmark {spec!r}: {', '.join(with_user)} need(s) τ²'s user simulator: pass "
            "user_simulator=UserSimulatorSettings(model=..., base_url=...) (CLI: --user-model, "
            "--user-base-url), or score tau2:telecom_solo, which has no user"
        )
    if not with_user and user is not None:
        raise ValueError(f"benchmark {spec!r} has no user: drop user_simulator")
    tasks = [
        task
        for domain in domains
        for task in tau2_tasks(_tau2_domain(domain), split, solo=domain == SOLO, limit=limit)
    ]

    def env_factory(task: Task) -> Env:
        return Tau2Env(solo=True) if _domain_of(task) == SOLO else Tau2Env(user=user)

    return tasks, env_factory


def score_tau2(
    domains: Sequence[str], spec: str, groups: Sequence[Group], limit: int | None
) -> BenchmarkScore:
    """τ²'s pass^k per domain (``spec``: the spec scored, as written), with standard errors
    over tasks (the module's docstring)."""
    from post_training_cookbook.bundled_envs.tau2.package import tau2

    successes: dict[str, list[list[bool]]] = {domain: [] for domain in domains}
    for group in groups:
        successes[_domain_of(group.task)].append([tau2_success(e) for e in group.episodes])
    pass_hat = {domain: tasks_pass_hat_k(trials) for domain, trials in successes.items()}
    means = {d: {k: _mean(values) for k, values in ks.items()} for d, ks in pass_hat.items()}
    errors = {
        d: {k: standard_error(values) for k, values in ks.items()} for d, ks in pass_hat.items()
    }
    accuracy = {domain: means[domain].get(1, 0.0) for domain in domains}
    return BenchmarkScore(
        benchmark=spec,
        version=tau2().version,
        limit=limit,
        per_category={
            domain: CategoryScore(sum(map(sum, trials)), sum(map(len, trials)))
            for domain, trials in successes.items()
        },
        accuracy=accuracy,
        overall=_mean(list(accuracy.values())),
        standard_error={domain: errors[domain].get(1, 0.0) for domain in domains},
        pass_hat_k=means,
        pass_hat_k_standard_error=errors,
    )


def tau2_success(episode: Episode) -> bool:
    """τ²'s success: its reward of the episode is 1 (an episode τ² did not score fails)."""
    from post_training_cookbook.bundled_envs.tau2.package import tau2

    reward = episode.metrics.get("tau2_reward")
    return reward is not None and bool(tau2().metrics.is_successful(reward))


def tasks_pass_hat_k(trials_per_task: Sequence[Sequence[bool]]) -> dict[int, list[float]]:
    """Each task's pass^k (τ²'s ``pass_hat_k``) for k = 1 .. the fewest trials of a task (τ²'s
    rule when tasks have unequal trials); ``trials_per_task``: the successes of each task's
    trials."""
    from post_training_cookbook.bundled_envs.tau2.package import tau2

    if not trials_per_task:
        return {}
    most_k = min(len(trials) for trials in trials_per_task)
    return {
        k: [tau2().metrics.pass_hat_k(len(t), sum(t), k) for t in trials_per_task]
        for k in range(1, most_k + 1)
    }


def standard_error(values: Sequence[float]) -> float:
    """The mean's standard error: sample standard deviation / sqrt(n); 0 below two values."""
    if len(values) < 2:
        return 0.0
    return statistics.stdev(values) / math.sqrt(len(values))


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def _tau2_domain(domain: str) -> str:
    """τ²'s name of a spec's domain (``telecom_solo`` is telecom)."""
    return "telecom" if domain == SOLO else domain


def _domain_of(task: Task) -> str:
    """The spec's domain a τ² task was drawn from (``telecom_solo`` for a solo task)."""
    from post_training_cookbook.bundled_envs.tau2.data import METADATA_KEY

    data = task.metadata[METADATA_KEY]
    return SOLO if data["solo"] else str(data["domain"])
