"""The ``post-training-cookbook`` command: every subcommand on a short real run of a tiny
model, ``--help`` everywhere, and one-line errors for bad arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_eval_common import (
    DAMAGED_MODEL_FOLDERS,
    VARIETY_TASKS,
    VarietyEnv,
    damaged_model_folder,
    tiny_model_dir,
    trained_run,
)

from post_training_cookbook.cli import main
from post_training_cookbook.cli.loading import CliError, load_env_factory, load_tasks
from post_training_cookbook.envs.tool_use_game import ToolUseGameEnv
from post_training_cookbook.models import BUNDLED_MODEL_DIR, BUNDLED_MODEL_ID, list_models
from post_training_cookbook.plots import PANEL_TITLES, plot_run

COMMANDS = ["train", "eval", "models", "plot", "view"]
TOOL_USE = "post_training_cookbook.envs.tool_use_game"


def run_cli(capsys, *arguments: str) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of ``post-training-cookbook ARGUMENTS`` in-process."""
    capsys.readouterr()  # drop what earlier setup printed
    try:
        status = main([str(argument) for argument in arguments])
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else 1
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def write_config(path: Path, runs_dir: Path, run_name: str, env: dict[str, str], **fields):
    config = {
        "model": str(tiny_model_dir()), "codec": "hermes", "wandb_project": None,
        "runs_dir": str(runs_dir), "run_name": run_name, "num_steps": 2, "batch_size": 2,
        "episodes_per_task": 4, "max_sampling_attempts": 3, "learning_rate": 1e-2,
        "validation_interval": 1, "max_turns": 2, "max_model_length": 1400,
        "max_tokens_per_turn": 16, "overlong_buffer_length": 0, **fields, "env": env,
    }  # fmt: skip
    path.write_text(yaml.safe_dump(config))
    return path


VARIETY_ENV = {
    "factory": "test_eval_common:VarietyEnv",
    "tasks": "test_eval_common:VARIETY_TASKS",
    "val_tasks": "test_eval_common:VARIETY_TASKS",
}


# --- help and errors ----------------------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_that_exits_zero(capsys, command):
    status, out, _ = run_cli(capsys, command, "--help")
    assert status == 0 and out.startswith(f"usage: post-training-cookbook {command}")


def test_no_command_prints_the_command_list_and_fails(capsys):
    status, out, _ = run_cli(capsys)
    assert status == 2 and all(command in out for command in COMMANDS)


def test_module_and_console_script_both_run_the_cli():
    script = Path(sys.executable).with_name("post-training-cookbook")
    for command in ([sys.executable, "-m", "post_training_cookbook"], [str(script)]):
        done = subprocess.run([*command, "models"], capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr
        assert "post-training-cookbook/tool-use-tiny" in done.stdout


@pytest.mark.parametrize(
    ("arguments", "reason"),
    [
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["eval", "--episodes-per-task", "0"], "expected a positive integer, got 0"),
        (["eval", "m", "--compare", "a", "b"], "not allowed with argument"),
        (["eval", "no/such-model"], "unknown model 'no/such-model'"),
        (["eval", "TINY", "--env", "no_such_module:Env"], "cannot import 'no_such_module'"),
        (["eval", "TINY", "--env", "ToolUseGameEnv"], "not an import path"),
        (["eval", "TINY", "--tasks", f"{TOOL_USE}:NOPE"], "has no attribute 'NOPE'"),
        (["eval", "TINY", "--max-model-length", "4096"], "exceeds"),
        (["train", "missing.yaml"], "No such file"),
        (["plot", "nowhere"], "has no metrics.jsonl"),
        (["view", "nowhere"], "neither a run directory"),
        (["view", "RUN", "--step", "99"], "no train rollouts for step 99"),
    ],
)
def test_bad_arguments_fail_with_a_one_line_reason(capsys, arguments, reason):
    known = {"RUN": trained_run, "TINY": tiny_model_dir}
    arguments = [str(known[a]()) if a in known else a for a in arguments]
    status, _, err = run_cli(capsys, *arguments)
    assert status != 0
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "error:" in err and reason in err


# --- train --------------------------------------------------------------------------------------


def test_train_runs_the_tool_use_game_from_a_yaml_with_an_env_section(capsys, tmp_path):
    env = {
        "factory": f"{TOOL_USE}:ToolUseGameEnv",
        "tasks": f"{TOOL_USE}:TOOL_USE_GAME_TRAIN_TASKS",
        "val_tasks": f"{TOOL_USE}:TOOL_USE_GAME_VAL_TASKS",
    }
    config = write_config(
        tmp_path / "run.yaml", tmp_path, "game", env, episodes_per_task=2, validation_interval=0
    )  # validation would play all 260 validation tasks
    status, out, err = run_cli(capsys, "train", config, "--set", "optimizer.num_steps=1")
    run = tmp_path / "game"
    assert status == 0, err
    assert f"run: {run}" in out
    assert (run / "final_model" / "config.json").is_file()
    assert yaml.safe_load((run / "config.yaml").read_text())["optimizer"]["num_steps"] == 1
    assert (run / "rollouts" / "train_step_000000.jsonl").is_file()


def test_train_runs_a_mixture_of_envs_from_a_yaml_and_logs_each_envs_metrics(capsys, tmp_path):
    env = {
        "mixture": [
            {**VARIETY_ENV, "name": "variety", "weight": 3},
            {
                "name": "calculator",
                "factory": "post_training_cookbook.bundled_envs.calculator:MathEnv",
                "tasks": "post_training_cookbook.bundled_envs.calculator:CALCULATOR_TRAIN_TASKS",
            },
        ]
    }
    config = write_config(tmp_path / "mixture.yaml", tmp_path, "mixture", env, batch_size=4)
    status, out, err = run_cli(capsys, "train", config)
    assert status == 0, err
    run = tmp_path / "mixture"
    assert f"run: {run}" in out
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    envs = {
        record["task"]["metadata"]["env"]
        for step in (0, 1)
        for record in map(json.loads, (run / "rollouts" / f"train_step_{step:06d}.jsonl").open())
    }
    assert envs == {"variety", "calculator"}
    for name in envs:
        assert any(f"rollout/{name}/reward_mean" in line for line in lines)
    assert all("val/variety/reward_mean" in line for line in lines)  # only variety validates
    assert not any("val/calculator/reward_mean" in line for line in lines)


def test_eval_with_a_mixture_config_plays_its_validation_tasks_each_on_its_own_env(tmp_path):
    from post_training_cookbook.bundled_envs.calculator import MathEnv
    from post_training_cookbook.cli.loading import eval_env, load_train_config

    calculator = "post_training_cookbook.bundled_envs.calculator"
    calc = {
        "name": "calc",
        "factory": f"{calculator}:MathEnv",
        "tasks": f"{calculator}:CALCULATOR_TRAIN_TASKS",
        "val_tasks": f"{calculator}:CALCULATOR_VAL_TASKS",
    }
    env = {"mixture": [{**VARIETY_ENV, "name": "variety"}, calc]}
    _, section = load_train_config(write_config(tmp_path / "m.yaml", tmp_path, "m", env))
    factory, tasks = eval_env(None, None, section)
    assert len(tasks) == len(VARIETY_TASKS) + 50
    assert isinstance(factory(tasks[0]), VarietyEnv) and isinstance(factory(tasks[-1]), MathEnv)
    with pytest.raises(CliError, match="needs --env as well"):
        eval_env(None, "x:y", section)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"bogus_field": 1}, "unknown GRPOConfig key 'bogus_field'"),
        ({"env": {"tasks": "x:y"}}, "needs an 'env:' section with a 'factory'"),
        ({"env": {**VARIETY_ENV, "extra": "x:y"}}, "unknown env key(s) ['extra']"),
        ({"env": {"factory": VARIETY_ENV["factory"]}}, "env.tasks is missing"),
        ({"env": {"mixture": [{"name": "a"}]}}, "env.mixture entry 1 needs factory, tasks"),
        ({"env": {"mixture": [VARIETY_ENV], "tasks": "x:y"}}, "env.mixture comes alone"),
        ({"env": {"mixture": [{**VARIETY_ENV, "name": "a", "weight": -1}]}}, "weight must be > 0"),
    ],
)
def test_train_rejects_a_bad_yaml_before_training(capsys, tmp_path, change, reason):
    config = write_config(tmp_path / "run.yaml", tmp_path, "bad", VARIETY_ENV)
    data = {**yaml.safe_load(config.read_text()), **change}
    config.write_text(yaml.safe_dump(data))
    status, _, err = run_cli(capsys, "train", config)
    assert status == 2 and reason in err and not (tmp_path / "bad").exists()


def test_train_resume_skips_a_damaged_checkpoint_and_refuses_in_one_line_when_none_reads(
    capsys, tmp_path
):
    config = write_config(tmp_path / "run.yaml", tmp_path, "run", VARIETY_ENV,
                          checkpoint_interval=1, validation_interval=0, episodes_per_task=2,
                          max_sampling_attempts=1)  # fmt: skip
    assert run_cli(capsys, "train", config)[0] == 0
    checkpoints = tmp_path / "run" / "checkpoints"
    (checkpoints / "step_000002" / "trainer_state.json").write_text('{"version": 2, "us')
    status, out, err = run_cli(capsys, "train", config, "--set", "resume=true")
    assert status == 0, err
    assert "resume: skipped step_000002: trainer_state.json: " in out
    assert "resume: from step_000001 (step 1)" in out
    for folder in checkpoints.iterdir():
        (folder / "rng.safetensors").write_bytes(b"")
    status, _, err = run_cli(capsys, "train", config, "--set", "resume=true")
    # the model loaded first (transformers' loading bars), then the error: one line
    assert status == 2 and "Traceback" not in err
    (error,) = [line for line in err.splitlines() if "error" in line]
    assert error == err.strip().splitlines()[-1]
    assert "no checkpoint reads back (step_000002: rng.safetensors: 0 bytes" in error


@pytest.mark.parametrize("case", DAMAGED_MODEL_FOLDERS)
def test_train_and_eval_refuse_a_damaged_model_folder_in_one_line_naming_the_file(
    capsys, tmp_path, case
):
    model = tmp_path / "model"
    damaged, problem = damaged_model_folder(tiny_model_dir(), model, case)
    config = write_config(tmp_path / "run.yaml", tmp_path, "run", VARIETY_ENV, model=str(model))
    for arguments in (["train", config], ["eval", model, "--num-tasks", "1", "--no-save"]):
        status, _, err = run_cli(capsys, *arguments)
        assert status == 2, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert f"error: {damaged}: {problem}" in err
    assert not (tmp_path / "run").exists()


# --- eval ---------------------------------------------------------------------------------------


def test_eval_compare_prints_a_baseline_and_the_trained_model_side_by_side(capsys, tmp_path):
    config = write_config(tmp_path / "run.yaml", tmp_path, "variety-cli", VARIETY_ENV)
    assert run_cli(capsys, "train", config)[0] == 0
    status, out, err = run_cli(
        capsys, "eval", "--config", config, "--compare", tiny_model_dir(), tmp_path / "variety-cli",
        "--episodes-per-task", "2", "--runs-dir", tmp_path / "evals",
    )  # fmt: skip
    assert status == 0, err
    header = out.splitlines()[1]
    assert "A: tiny-llama" in header and "B: variety-cli" in header and "B − A" in header
    assert "6 task(s), 2 episode(s) per task, max_turns 2" in out  # the config's settings
    rows = {line.split("  ")[0]: line.split()[-3:] for line in out.splitlines()[2:]}
    before, after, delta = (float(value) for value in rows["reward (mean)"])
    assert delta == pytest.approx(after - before, abs=2e-3)  # each printed to 3 decimals
    assert len(list((tmp_path / "evals").iterdir())) == 2


@pytest.mark.heavy
@pytest.mark.skipif(
    not (BUNDLED_MODEL_DIR / "config.json").is_file(), reason="the bundled model is not built"
)
def test_the_bundled_model_before_and_after_a_short_run_prints_side_by_side(capsys, tmp_path):
    env = {
        "factory": f"{TOOL_USE}:ToolUseGameEnv",
        "tasks": f"{TOOL_USE}:TOOL_USE_GAME_TRAIN_TASKS",
        "val_tasks": f"{TOOL_USE}:TOOL_USE_GAME_VAL_TASKS",
    }
    config = tmp_path / "run.yaml"
    fields = {
        "model": BUNDLED_MODEL_ID, "wandb_project": None, "runs_dir": str(tmp_path),
        "run_name": "bundled", "num_steps": 5, "batch_size": 4, "episodes_per_task": 8,
        "learning_rate": 1e-4, "max_turns": 6, "max_model_length": 1024,
        "max_tokens_per_turn": 64, "validation_interval": 0, "env": env,
    }  # fmt: skip
    config.write_text(yaml.safe_dump(fields))
    assert run_cli(capsys, "train", config)[0] == 0
    status, out, err = run_cli(
        capsys, "eval", "--config", config, "--compare", BUNDLED_MODEL_ID, tmp_path / "bundled",
        "--num-tasks", "40", "--episodes-per-task", "4", "--runs-dir", tmp_path / "evals",
    )  # fmt: skip
    assert status == 0, err
    print(out)  # the comparison, for the CI log
    assert "A: tool-use-tiny" in out and "B: bundled" in out and "B − A" in out
    assert "40 task(s), 4 episode(s) per task" in out


def test_eval_json_holds_the_summary_and_tasks_may_come_from_a_jsonl_file(capsys, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(
            json.dumps({"prompt": t.prompt, "metadata": t.metadata}) + "\n"
            for t in VARIETY_TASKS[:3]
        )
    )
    status, out, err = run_cli(
        capsys, "eval", trained_run(), "--step", "1", "--env", "test_eval_common:VarietyEnv",
        "--tasks", tasks, "--max-model-length", "256", "--max-tokens-per-turn", "8",
        "--episodes-per-task", "2", "--pass-k", "1", "--no-save", "--json",
    )  # fmt: skip
    assert status == 0, err
    summary = json.loads(out)
    assert summary["model_name"] == "variety-step1" and summary["num_episodes"] == 6
    assert list(summary["pass_at_k"]) == ["1"] and summary["output_dir"] is None


# --- models, plot, view -------------------------------------------------------------------------


def test_models_lists_the_catalog_with_generator_support_or_trainer_only(capsys):
    status, out, _ = run_cli(capsys, "models")
    assert status == 0
    for info in list_models():
        line = next(line for line in out.splitlines() if line.startswith(info.model_id + " "))
        assert ("trainer-only" if info.trainer_only else "generator") in line
        assert str(info.max_context) in line and info.default_dtype in line
    status, out, _ = run_cli(capsys, "models", "--json")
    assert [row["id"] for row in json.loads(out)] == [info.model_id for info in list_models()]


def test_plot_writes_a_png_with_the_named_panels(capsys, tmp_path):
    from PIL import Image

    out = tmp_path / "plots.png"
    status, stdout, err = run_cli(capsys, "plot", trained_run(), "--out", out)
    assert status == 0, err
    assert stdout.strip() == str(out)
    image = Image.open(out)
    assert image.size == (1200, 800)
    assert image.text["Panels"] == "; ".join(PANEL_TITLES)
    assert np.asarray(image.convert("L"), dtype=float).var() > 100
    figure = plot_run(trained_run())
    assert [axes.get_title() for axes in figure.axes] == list(PANEL_TITLES)
    reward_axes, validation_axes = figure.axes[:2]
    assert len(reward_axes.lines[0].get_xdata()) == 2  # steps 0 and 1
    assert len(validation_axes.lines[0].get_xdata()) == 3  # before each step, and at the end


def test_view_prints_a_steps_episodes_with_colours_by_mask(capsys):
    status, out, err = run_cli(capsys, "view", trained_run(), "--step", "0", "--color", "always")
    assert status == 0, err
    assert "variety · train step 0" in out
    assert out.count("── episode") == len(json.loads(f"[{_dump_lines(0)}]"))
    assert "\x1b[1;32m" in out and "\x1b[2m" in out


def test_view_writes_a_self_contained_html_of_the_validation_step(capsys, tmp_path):
    page = tmp_path / "val.html"
    status, out, err = run_cli(
        capsys, "view", trained_run(), "--kind", "val", "--step", "2", "--html", page
    )
    assert status == 0, err and str(page) in out
    html = page.read_text()
    assert html.count('<section class="episode') == 2
    assert "<script" not in html and "http" not in html.replace(str(trained_run()), "")


def test_view_reads_an_evaluation_folder(capsys, tmp_path):
    status, _, err = run_cli(
        capsys, "eval", trained_run(), "--env", "test_eval_common:VarietyEnv", "--tasks",
        "test_eval_common:VARIETY_TASKS", "--max-model-length", "256", "--max-tokens-per-turn",
        "8", "--runs-dir", tmp_path,
    )  # fmt: skip
    assert status == 0, err
    (folder,) = tmp_path.iterdir()
    status, out, err = run_cli(capsys, "view", folder, "--color", "never")
    assert status == 0, err and out.count("── episode") == len(VARIETY_TASKS)


# --- import paths -------------------------------------------------------------------------------


def test_an_env_class_without_arguments_is_built_without_the_task():
    factory = load_env_factory(f"{TOOL_USE}:ToolUseGameEnv")
    assert isinstance(factory(VARIETY_TASKS[0]), ToolUseGameEnv)


def test_a_factory_function_gets_the_task(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(
        "from test_eval_common import VarietyEnv\n"
        "seen = []\n"
        "def make(task):\n    seen.append(task)\n    return VarietyEnv()\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "my_envs", raising=False)
    factory = load_env_factory("my_envs:make")  # found in the working directory
    assert isinstance(factory(VARIETY_TASKS[1]), VarietyEnv)
    assert sys.modules["my_envs"].seen == [VARIETY_TASKS[1]]
    monkeypatch.syspath_prepend(os.getcwd())


def test_tasks_must_be_a_sequence_of_task():
    with pytest.raises(CliError, match="not a sequence of Task"):
        load_tasks(f"{TOOL_USE}:SYSTEM_PROMPT")
    assert load_tasks("test_eval_common:VARIETY_TASKS") == VARIETY_TASKS


def _dump_lines(step: int) -> str:
    path = trained_run() / "rollouts" / f"train_step_{step:06d}.jsonl"
    return ",".join(line for line in path.read_text().splitlines() if line.strip())


def test_the_yaml_of_docs_cli_md_loads_as_a_config_and_an_env_section(tmp_path):
    from post_training_cookbook.cli.loading import load_train_config

    text = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    blocks = [part.split("```")[0] for part in text.split("```yaml\n")[1:]]
    block, mixture_section = blocks[0], blocks[1]  # blocks[2]: sft (test_sft_demonstrations)
    path = tmp_path / "calculator.yaml"
    path.write_text(block)
    config, env = load_train_config(path, ["optimizer.num_steps=2"])
    assert config.learning_rate == 1e-4 and config.wandb_project is None
    assert config.num_steps == 2
    assert env == {
        "factory": "calculator_env:MathEnv",
        "tasks": "calculator_env:TRAIN_TASKS",
        "val_tasks": "calculator_env:VAL_TASKS",
    }
    # the mixture's env section, in place of the single env's
    path.write_text(block.split("env:\n")[0] + mixture_section)
    _, env = load_train_config(path)
    assert [(entry["name"], entry["weight"]) for entry in env["mixture"]] == [
        ("calculator", 1.0),
        ("game", 3.0),
    ]
    assert env["mixture"][1]["factory"].endswith("tool_use_game:ToolUseGameEnv")
