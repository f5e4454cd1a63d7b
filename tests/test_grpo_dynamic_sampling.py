"""Zero-variance groups and dynamic sampling in ``train_multi_turn``.

A group whose episodes all get the same reward is skipped and counted
(``rollout/zero_variance_skip_ratio``); up to ``max_sampling_attempts`` sampling rounds per
step fill the batch with informative groups (``rollout/sampling_attempts``). Tasks here are
"live" (episodes alternate right and wrong answers) or "dead" (always wrong: reward 0).
"""

from __future__ import annotations

from test_grpo_common import (
    DEAD,
    LIVE,
    Closes,
    RecordedSamples,
    ScriptedPolicy,
    mode_envs,
    mode_tasks,
    quick_config,
    step_metrics,
    train_dump,
)

from post_training_cookbook.grpo.data import TaskStream
from post_training_cookbook.grpo.train import train_multi_turn


def run(tiny_llama_dir, tiny_llama_tokenizer, tmp_path, monkeypatch, tasks, **overrides):
    ScriptedPolicy(tiny_llama_tokenizer).install(monkeypatch)
    recorded = RecordedSamples(monkeypatch)
    config = quick_config(tiny_llama_dir, tmp_path, batch_size=2, **overrides)
    return train_multi_turn(config, tasks, mode_envs(Closes())), recorded


def test_when_no_group_varies_every_attempt_is_played_and_nothing_trains(
    tiny_llama_dir, tiny_llama_tokenizer, tmp_path, monkeypatch
):
    tasks = mode_tasks(DEAD, DEAD, DEAD, DEAD, DEAD, DEAD)
    result, recorded = run(
        tiny_llama_dir, tiny_llama_tokenizer, tmp_path, monkeypatch, tasks, max_sampling_attempts=3
    )
    metrics = step_metrics(result.path)[0]
    assert metrics["rollout/sampling_attempts"] == 3.0
    assert metrics["rollout/groups"] == 6.0  # 2 in the first round, 2 more in each later one
    assert metrics["rollout/zero_variance_skip_ratio"] == 1.0
    assert metrics["train/samples"] == 0.0 and metrics["train/groups"] == 0.0
    assert metrics["policy/version"] == 0.0 and recorded.batches == []
    assert {record["group"] for record in train_dump(result.path, 0)} == set(range(6))


def test_when_every_group_varies_one_attempt_fills_the_batch(
    tiny_llama_dir, tiny_llama_tokenizer, tmp_path, monkeypatch
):
    tasks = mode_tasks(LIVE, LIVE, LIVE)
    result, recorded = run(
        tiny_llama_dir, tiny_llama_tokenizer, tmp_path, monkeypatch, tasks, max_sampling_attempts=3
    )
    metrics = step_metrics(result.path)[0]
    assert metrics["rollout/sampling_attempts"] == 1.0
    assert metrics["rollout/groups"] == 2.0
    assert metrics["rollout/zero_variance_skip_ratio"] == 0.0
    assert metrics["train/groups"] == 2.0 and metrics["policy/version"] == 1.0
    assert len(recorded.batches) == 1 and len(recorded.batches[0]) == 4


def test_dynamic_sampling_plays_new_tasks_until_the_batch_is_informative_or_attempts_run_out(
    tiny_llama_dir, tiny_llama_tokenizer, tmp_path, monkeypatch
):
    tasks = mode_tasks(LIVE, DEAD, LIVE, DEAD, LIVE, DEAD)
    live = {task.prompt for task in tasks if task.metadata["modes"] == list(LIVE)}
    num_steps, batch_size, max_attempts = 4, 2, 3
    result, recorded = run(
        tiny_llama_dir,
        tiny_llama_tokenizer,
        tmp_path,
        monkeypatch,
        tasks,
        num_steps=num_steps,
        max_sampling_attempts=max_attempts,
    )
    metrics = step_metrics(result.path)
    played = []
    attempts_seen = set()
    for step in range(num_steps):
        prompts = []
        for record in train_dump(result.path, step):
            if record["group"] == len(prompts):
                prompts.append(record["task"]["prompt"])
        played += prompts
        # The rule: a first round of batch_size tasks, then as many as are still missing.
        attempts, informative, cursor = 0, 0, 0
        while attempts < max_attempts and informative < batch_size:
            take = batch_size if attempts == 0 else batch_size - informative
            informative += sum(prompt in live for prompt in prompts[cursor : cursor + take])
            cursor += take
            attempts += 1
        assert cursor == len(prompts), (step, prompts)
        assert metrics[step]["rollout/sampling_attempts"] == attempts
        attempts_seen.add(attempts)
        skipped = sum(prompt not in live for prompt in prompts)
        assert metrics[step]["rollout/zero_variance_skip_ratio"] == skipped / len(prompts)
        assert metrics[step]["train/groups"] == min(batch_size, informative)
    assert len(attempts_seen) > 1, "the task order should exercise more than one case"
    # rounds take tasks from the seeded stream, in order, across steps
    assert played == [task.prompt for _, task in TaskStream(tasks, seed=0).take(len(played))]
    assert sum(len(batch) for batch in recorded.batches) == 2 * sum(
        metrics[step]["train/groups"] for step in range(num_steps)
    )
