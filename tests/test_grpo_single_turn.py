"""``train_single_turn``: GRPO on one reply per task, scored by a reward function."""

from test_grpo_common import ScriptedPolicy, quick_config, read_jsonl, step_metrics

from post_training_cookbook.envs import Task
from post_training_cookbook.grpo.train import train_single_turn


def test_single_turn_training_scores_one_reply_per_task_with_the_reward_function(
    tiny_llama_dir, tiny_llama_tokenizer, tmp_path, monkeypatch
):
    ScriptedPolicy(tiny_llama_tokenizer).install(monkeypatch)
    # the scripted policy answers by the prompt's mode: "1" (right) or "0" (wrong)
    tasks = [Task("Say one. mode=answer", "1"), Task("Say one. mode=wrong", "1")]
    seen = []

    def reward(reply: str, target: str) -> float:
        seen.append((reply, target))
        return 1.0 if reply.strip() == target else 0.0

    config = quick_config(tiny_llama_dir, tmp_path, batch_size=2, num_steps=2, max_turns=4)
    run = train_single_turn(config, tasks, reward, system_prompt="Reply with a number.")
    metrics = step_metrics(run.path)
    assert sorted(metrics) == [0, 1]
    assert all(line["rollout/turns_per_episode"] == 1.0 for line in metrics.values())
    dump = read_jsonl(run.path / "rollouts" / "train_step_000000.jsonl")
    assert dump[0]["messages"][0] == {"role": "system", "content": "Reply with a number."}
    assert {record["num_turns"] for record in dump} == {1}
    assert sorted(set(seen)) == [("0", "1"), ("1", "1")]
    assert {record["reward"] for record in dump} == {0.0, 1.0}
