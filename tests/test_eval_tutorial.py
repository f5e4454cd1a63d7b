"""docs/tutorial.md runs: its env file, its Python script and its shell commands, in order.

The default test runs every block with the tiny random model in place of the bundled one and
smaller sizes; the heavy test runs the tutorial unchanged on the bundled model.
"""

from __future__ import annotations

import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest
from test_eval_common import tiny_model_dir

from post_training_cookbook.cli import main
from post_training_cookbook.models import BUNDLED_MODEL_DIR, BUNDLED_MODEL_ID

TUTORIAL = Path(__file__).resolve().parents[1] / "docs" / "tutorial.md"
SMALLER = {
    r"num_steps=\d+": "num_steps=2",
    r"batch_size=\d+": "batch_size=2",
    r"episodes_per_task=\d+": "episodes_per_task=2",
    r"validation_interval=\d+": "validation_interval=1",
    r"make_tasks\(24, seed=1\)": "make_tasks(3, seed=1)",
}


NOT_RUN = "<!-- not run by tests/test_eval_tutorial.py"
"""Marks a block that needs something a test cannot reach (a judge endpoint): its own test
runs it (tests/test_judge.py)."""


def code_blocks(language: str, *, marked: bool = False) -> list[str]:
    """The tutorial's ``language`` blocks, in order: those the tutorial test runs, or with
    ``marked`` only those marked ``NOT_RUN``."""
    found = re.findall(rf"(<!--[^\n]*-->\n)?```{language}\n(.*?)```", TUTORIAL.read_text(), re.S)
    return [block for mark, block in found if mark.startswith(NOT_RUN) == marked]


def shell_commands() -> list[list[str]]:
    lines = [line for block in code_blocks("bash") for line in block.splitlines()]
    return [shlex.split(line) for line in lines if line.strip()]


def run_tutorial(folder: Path, replacements: dict[str, str], monkeypatch) -> None:
    """The env file written to ``folder``, the script and the commands run there, in-process
    (a subprocess would spend most of its time importing torch)."""

    def adapt(text: str) -> str:
        for pattern, replacement in replacements.items():
            text = re.sub(pattern, replacement, text)
        return text

    env_file, *script = code_blocks("python")
    (folder / "calculator_env.py").write_text(adapt(env_file))
    (folder / "tutorial.py").write_text(adapt("\n".join(script)))
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, "calculator_env", raising=False)
    runpy.run_path(str(folder / "tutorial.py"), run_name="__main__")
    for command in shell_commands():
        assert command[0] == "post-training-cookbook"
        arguments = [adapt(argument) for argument in command[1:]]
        assert main(arguments) == 0, f"post-training-cookbook {shlex.join(arguments)} failed"
    monkeypatch.delitem(sys.modules, "calculator_env", raising=False)


def test_the_tutorial_has_the_env_file_the_script_and_the_commands():
    env_file, *script = code_blocks("python")
    assert "class MathEnv(ToolEnv)" in env_file and "@function_tool" in env_file
    assert "check_env(" in script[0]
    assert any("train_multi_turn(" in block for block in script)
    assert any("EnvMixture(" in block for block in script)
    (judged,) = code_blocks("python", marked=True)
    assert "JudgeReward(" in judged and "OpenAIJudge(" in judged
    assert [command[1] for command in shell_commands()] == ["plot", "view", "view", "eval", "view"]


def test_every_tutorial_block_runs_with_a_tiny_model(tmp_path, monkeypatch):
    replacements = {re.escape(BUNDLED_MODEL_ID): str(tiny_model_dir()), **SMALLER}
    run_tutorial(tmp_path, replacements, monkeypatch)
    run = tmp_path / "runs" / "calculator"
    assert (run / "final_model" / "config.json").is_file()
    assert (run / "plots.png").is_file() and (tmp_path / "calculator_val.html").is_file()
    evaluations = sorted(p.name for p in (tmp_path / "runs").glob("eval_*"))
    assert len(evaluations) == 4  # before, after, and the command's two
    mixture_lines = (tmp_path / "runs" / "mixture" / "metrics.jsonl").read_text()
    assert '"rollout/game/reward_mean"' in mixture_lines
    assert '"val/calculator/reward_mean"' in mixture_lines


@pytest.mark.heavy
@pytest.mark.skipif(
    not (BUNDLED_MODEL_DIR / "config.json").is_file(), reason="the bundled model is not built"
)
def test_the_tutorial_runs_unchanged_on_the_bundled_model(tmp_path, monkeypatch):
    run_tutorial(tmp_path, {}, monkeypatch)
