"""The layers of docs/architecture.md are the package's: every module sits in one, and no
import points from a lower layer to a higher one. And the path from the loop to an env is
as short as the doc says."""

from __future__ import annotations

import ast
import asyncio
import re
from pathlib import Path
from typing import Any

from test_grpo_common import Closes, ModeEnv, mode_tasks, quick_config

from post_training_cookbook.envs import Task
from post_training_cookbook.grpo.train import train_multi_turn
from post_training_cookbook.types import Message

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "post_training_cookbook"
DOC = ROOT / "docs" / "architecture.md"


def layer_table() -> list[tuple[str, list[str]]]:
    """(layer, its modules) from the doc's table, top layer first."""
    text = DOC.read_text()
    table = text[text.index("<!-- layers") : text.index("<!-- /layers -->")]
    rows = []
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("layer", "---"):
            continue
        rows.append((cells[0], re.findall(r"`([^`]+)`", cells[1])))
    return rows


def unit_of(module: str) -> str:
    """The table's name for a module: ``envs/`` for anything in envs, ``files.py`` at the top."""
    parts = module.split(".")[1:]
    if not parts:
        return "__init__.py"
    return parts[0] + ("/" if (PACKAGE / parts[0]).is_dir() else ".py")


def package_imports() -> list[tuple[str, str, int]]:
    """(importing module, imported module, line) for every import of the package by itself,
    lazy and ``TYPE_CHECKING`` ones included."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                raise AssertionError(f"{module}: use absolute imports (line {node.lineno})")
            names = (
                [node.module]
                if isinstance(node, ast.ImportFrom) and node.module
                else [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            for name in names:
                if name.startswith("post_training_cookbook"):
                    found.append((module, name, node.lineno))
    return found


def test_every_module_is_in_one_layer_of_the_doc() -> None:
    placed = [unit for _, units in layer_table() for unit in units]
    assert len(placed) == len(set(placed)), "a module is in two layers of the table"
    on_disk = {
        path.name + ("/" if path.is_dir() else "")
        for path in PACKAGE.iterdir()
        if (path.is_dir() and (path / "__init__.py").exists()) or path.suffix == ".py"
    }
    assert set(placed) == on_disk, (
        f"not in the table: {sorted(on_disk - set(placed))}; "
        f"in the table but not on disk: {sorted(set(placed) - on_disk)}"
    )


def test_no_import_points_up_a_layer() -> None:
    height = {
        unit: len(layers) - index
        for layers in [layer_table()]
        for index, (_, units) in enumerate(layers)
        for unit in units
    }
    upward = [
        f"{module}:{line} imports {name}"
        for module, name, line in package_imports()
        if height[unit_of(name)] > height[unit_of(module)]
    ]
    assert not upward, "imports from a lower layer into a higher one:\n" + "\n".join(upward)


def test_the_checker_parses_imports_it_must_refuse() -> None:
    """The check is not vacuous: the parser sees lazy imports inside functions."""
    found = package_imports()
    assert any(module == "post_training_cookbook.service.factory" for module, _, _ in found)
    lazy = [m for m, name, _ in found if name == "post_training_cookbook.service.local"]
    assert "post_training_cookbook.service.factory" in lazy  # imported inside open_service
    height = {unit: i for i, (_, units) in enumerate(reversed(layer_table())) for unit in units}
    assert height["envs/"] < height["rollout/"] < height["trainer/"] < height["service/"]
    assert height["service/"] < height["grpo/"] < height["cli/"]


def top_level_definitions(name: str) -> list[str]:
    """``module:line`` for every top-level assignment or class of ``name`` in the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            elif isinstance(node, ast.ClassDef):
                names = [node.name]
            else:
                names = []
            if name in names:
                found.append(f"{module}:{node.lineno}")
    return found


def test_env_factory_is_defined_once_in_the_env_contract() -> None:
    """Every module names the one ``EnvFactory`` of ``envs/base.py``, importing it."""
    found = top_level_definitions("EnvFactory")
    assert [where.split(":")[0] for where in found] == ["post_training_cookbook.envs.base"], found


# ---------------------------------------------------------------- the path to env.reset


def awaiting_frames(coroutine: Any) -> list[str]:
    """The names of the coroutines a task is awaiting through, outermost first, down to the
    first thing that is not one of ours (a future, a gather)."""
    names = []
    while coroutine is not None:
        code = getattr(coroutine, "cr_code", None) or getattr(coroutine, "gi_code", None)
        if code is not None:
            names.append(code.co_qualname)
            coroutine = getattr(coroutine, "cr_await", None) or getattr(
                coroutine, "gi_yieldfrom", None
            )
        elif type(coroutine).__name__ == "Stretches":
            names.append("Stretches")
            coroutine = coroutine._coroutine
        else:
            break
    return names


class ChainRecorder(ModeEnv):
    """Records, from inside ``reset``, the coroutines every task awaits through."""

    chains: list[list[str]] = []

    async def reset(self, task: Task) -> list[Message]:
        if not ChainRecorder.chains:
            ChainRecorder.chains = [awaiting_frames(t.get_coro()) for t in asyncio.all_tasks()]
        return await super().reset(task)


def test_frames_from_run_lockstep_to_env_reset_are_the_nine_the_doc_lists(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    ChainRecorder.chains = []
    closes = Closes()
    config = quick_config(tiny_llama_dir, tmp_path, episodes_per_task=2, max_turns=1)
    train_multi_turn(config, mode_tasks(["answer"]), lambda task: ChainRecorder("answer", closes))
    chains = ChainRecorder.chains
    loop_chain = next(chain for chain in chains if "run_lockstep" in chain)
    episode_chain = next(chain for chain in chains if "run_episode" in chain)
    env_chain = next(chain for chain in chains if chain and chain[0] == "Stretches")
    from_loop = loop_chain[loop_chain.index("run_lockstep") :]
    to_call = episode_chain[: episode_chain.index("call_env") + 1]
    assert from_loop == ["run_lockstep", "collect_groups", "play_groups"]
    assert to_call == ["run_episode", "TokenDriver.play", "reset_env", "call_env"]
    assert env_chain == ["Stretches", "ChainRecorder.reset"]
    frames = from_loop + to_call + env_chain
    assert len(frames) == 9
    doc = DOC.read_text()
    listed = "`run_lockstep`, `collect_groups`,\n`play_groups`, `run_episode`, `TokenDriver.play`"
    assert listed in doc and "`reset_env`, `call_env`, `Stretches`,\n`env.reset`" in doc
