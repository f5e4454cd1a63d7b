"""``PrefixRouter``: an episode's turns stay on the replica that holds their prefix; new
episodes go to the least loaded replica. Pure Python: runs in the default suite too."""

from __future__ import annotations

import pytest

from post_training_cookbook.service.routing import PrefixRouter, prefix_hashes

SYSTEM = list(range(100, 140))  # the prompt every task shares (system prompt, tool specs)


def task_prompt(task: int) -> list[int]:
    return [*SYSTEM, 1000 + task, 2000 + task]


def test_prefix_hashes_continue_from_a_prefix() -> None:
    tokens = [5, 6, 7, 8, 9]
    whole = prefix_hashes(tokens)
    assert prefix_hashes(tokens[2:], whole[1]) == whole[2:]
    assert len(set(whole)) == len(whole)


def test_new_episodes_go_to_the_least_loaded_replica() -> None:
    router = PrefixRouter(3)
    replicas = [router.acquire(task_prompt(task), 1).replica for task in range(3)]
    assert sorted(replicas) == [0, 1, 2]  # tasks share 40 tokens, not a remembered prefix
    assert router.in_flight == [1, 1, 1]


def test_the_episodes_of_a_group_share_a_replica() -> None:
    router = PrefixRouter(2)
    first = router.acquire(task_prompt(0), 1)
    same_group = [router.acquire(task_prompt(0), 1) for _ in range(7)]
    assert {route.replica for route in same_group} == {first.replica}
    other_group = router.acquire(task_prompt(1), 1)
    assert other_group.replica != first.replica


def test_a_later_turn_follows_its_episode_even_when_that_replica_is_busier() -> None:
    router = PrefixRouter(2)
    turn_one = router.acquire(task_prompt(0), 1)
    completion = [7, 8, 9, 10]
    router.release(turn_one, [completion])
    for task in (1, 2, 3):  # load the episode's replica with other groups' turns
        router.acquire(task_prompt(task), 4)
    busy = turn_one.replica
    router.in_flight[busy] += 20
    tool_result = [11, 12, 13]
    turn_two = router.acquire(task_prompt(0) + completion + tool_result, 1)
    assert turn_two.replica == busy


def test_a_failed_sample_releases_its_load_without_remembering_anything() -> None:
    router = PrefixRouter(2)
    route = router.acquire(task_prompt(0), 3)
    router.release(route)
    assert router.in_flight == [0, 0]


def test_excluded_replicas_get_nothing_more() -> None:
    router = PrefixRouter(2)
    route = router.acquire(task_prompt(0), 1)
    router.exclude(route.replica)
    again = router.acquire(task_prompt(0), 1)  # its prefix lives on the excluded replica
    assert again.replica != route.replica
    router.exclude(again.replica)
    with pytest.raises(RuntimeError, match="every generator replica"):
        router.acquire(task_prompt(5), 1)


def test_the_affinity_table_forgets_the_least_recently_used_prefix() -> None:
    router = PrefixRouter(2, max_entries=4)
    for task in range(6):
        router.release(router.acquire(task_prompt(task), 1))
    assert len(router._affinity) == 4
