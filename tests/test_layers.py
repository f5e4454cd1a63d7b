"""The layers of docs/architecture.md are the package's: every module sits in one, a row is one
folder, no import points from a lower layer to a higher one or crosses folders inside a row,
no circle of imports runs through two folders, and none runs between the modules of one
folder. Imports inside functions and under ``TYPE_CHECKING`` count as imports throughout, so
a circle cannot be hidden by importing one side late. And the paths from the loop to an env
and to the loss are as short as the doc says."""

from __future__ import annotations

import ast
import asyncio
import re
import shutil
import sys
import threading
from pathlib import Path
from types import CodeType, FrameType
from typing import Any, NamedTuple

import pytest
from test_grpo_common import Closes, ModeEnv, mode_envs, mode_tasks, quick_config
from torch import Tensor

from post_training_cookbook import sync
from post_training_cookbook.envs import Task
from post_training_cookbook.grpo.train import train_multi_turn
from post_training_cookbook.trainer import objective
from post_training_cookbook.trainer.types import LossConfig
from post_training_cookbook.types import Message

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "post_training_cookbook"
DOC = ROOT / "docs" / "architecture.md"

# Imports the checks below refuse that are still in the package, each to be cut (and then
# struck from here: the checks fail on a listed import that is gone, as on a new one).
# (Old paths of what moved up the layers are served from the top, ``moved_paths.py``, so a
# deprecation shim adds none.)
KNOWN_UPWARD: set[str] = set()
KNOWN_CIRCLES: set[str] = set()


class Import(NamedTuple):
    importer: str  # dotted module names, ``post_training_cookbook.…``
    imported: str
    line: int


def layer_table(doc: Path = DOC) -> list[tuple[str, list[str]]]:
    """(layer, its modules) from the doc's table, top layer first."""
    text = doc.read_text()
    table = text[text.index("<!-- layers") : text.index("<!-- /layers -->")]
    rows = []
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("layer", "---"):
            continue
        rows.append((cells[0], re.findall(r"`([^`]+)`", cells[1])))
    return rows


def unit_of(module: str, package: Path = PACKAGE) -> str:
    """The table's name for a module: ``envs/`` for anything in envs, ``files.py`` at the top."""
    parts = module.split(".")[1:]
    if not parts:
        return "__init__.py"
    return parts[0] + ("/" if (package / parts[0]).is_dir() else ".py")


def folder_of(unit: str) -> str:
    """The folder a table unit lives in: ``envs/`` itself, ``""`` for the package's own modules."""
    return unit if unit.endswith("/") else ""


def module_names(package: Path) -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its ``__init__``'s)."""
    names = {}
    for path in package.rglob("*.py"):
        module = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        names[module.removesuffix(".__init__")] = path
    return names


def package_imports(package: Path = PACKAGE) -> list[Import]:
    """Every import of the package by itself, lazy and ``TYPE_CHECKING`` ones included, and
    every string that names one of its modules (what ``importlib.import_module``, the
    deprecation shims and lazy ``__getattr__`` tables import by name). ``from a import b``
    imports the module ``a.b`` where there is one, else ``a``; the parent packages an import
    runs on the way are not counted (every import would then run through the top
    ``__init__``)."""
    modules = module_names(package)
    root = package.name
    found = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                raise AssertionError(f"{module}: use absolute imports (line {node.lineno})")
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [
                    f"{node.module}.{alias.name}"
                    if f"{node.module}.{alias.name}" in modules
                    else node.module
                    for alias in node.names
                ]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value] if node.value in modules and node.value != root else []
            else:
                names = []
            found += [
                Import(module, name, node.lineno)
                for name in dict.fromkeys(names)
                if name == root or name.startswith(root + ".")
            ]
    return found


def short(module: str) -> str:
    return module.split(".", 1)[1] if "." in module else module


def upward_imports(
    table: list[tuple[str, list[str]]], imports: list[Import], package: Path = PACKAGE
) -> set[str]:
    """``importer -> imported`` for each import from a lower layer into a higher one."""
    height = {unit: -index for index, (_, units) in enumerate(table) for unit in units}
    return {
        f"{short(found.importer)} -> {short(found.imported)}"
        for found in imports
        if height[unit_of(found.imported, package)] > height[unit_of(found.importer, package)]
    }


def imports_across_folders_in_a_row(
    table: list[tuple[str, list[str]]], imports: list[Import], package: Path = PACKAGE
) -> set[str]:
    """``importer -> imported`` for each import between two folders the table puts on one row."""
    row = {unit: index for index, (_, units) in enumerate(table) for unit in units}
    found = set()
    for each in imports:
        importer, imported = unit_of(each.importer, package), unit_of(each.imported, package)
        if row[importer] == row[imported] and folder_of(importer) != folder_of(imported):
            found.add(f"{short(each.importer)} -> {short(each.imported)}")
    return found


def circles(imports: list[Import], package: Path = PACKAGE) -> set[str]:
    """The circles of imports between table units (a folder, or one of the package's own
    modules), each named by its units: ``distill/, grpo/`` when ``grpo/`` imports ``distill/``
    and ``distill/`` imports ``grpo/``, even when no module is on the circle twice."""
    graph: dict[str, set[str]] = {}
    for each in imports:
        importer, imported = unit_of(each.importer, package), unit_of(each.imported, package)
        graph.setdefault(importer, set()).add(imported)
        graph.setdefault(imported, set())
    return circles_of(graph)


def circles_inside_folders(imports: list[Import], package: Path = PACKAGE) -> set[str]:
    """The circles of imports between the modules of one folder (its subfolders included),
    each named by its modules: ``distill.endpoint, distill.teacher`` when each imports the
    other, though one of the two imports sits inside a function. A package's ``__init__`` is
    a module of its folder like the others."""
    graph: dict[str, set[str]] = {}
    for each in imports:
        unit = unit_of(each.importer, package)
        inside = unit == unit_of(each.imported, package) and unit == folder_of(unit)
        if inside and each.importer != each.imported:
            graph.setdefault(short(each.importer), set()).add(short(each.imported))
            graph.setdefault(short(each.imported), set())
    return circles_of(graph)


def circles_of(graph: dict[str, set[str]]) -> set[str]:
    """Each circle of a graph (a strongly connected component of two nodes or more), named by
    its nodes in order."""
    members: dict[int, list[str]] = {}
    for node, number in strongly_connected(graph).items():
        members.setdefault(number, []).append(node)
    return {", ".join(sorted(nodes)) for nodes in members.values() if len(nodes) > 1}


def strongly_connected(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each node's strongly connected component, numbered (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    component: dict[str, int] = {}
    stack: list[str] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = lowlink[start] = len(index)
        stack.append(start)
        while work:
            node, successors = work[-1]
            successor = next(successors, None)
            if successor is None:
                work.pop()
                if work:
                    lowlink[work[-1][0]] = min(lowlink[work[-1][0]], lowlink[node])
                if lowlink[node] == index[node]:
                    number = len(set(component.values()))
                    while True:
                        member = stack.pop()
                        component[member] = number
                        if member == node:
                            break
            elif successor not in index:
                index[successor] = lowlink[successor] = len(index)
                stack.append(successor)
                work.append((successor, iter(sorted(graph[successor]))))
            elif successor in stack:
                lowlink[node] = min(lowlink[node], index[successor])
    return component


def placed_units(package: Path) -> set[str]:
    return {
        path.name + ("/" if path.is_dir() else "")
        for path in package.iterdir()
        if (path.is_dir() and (path / "__init__.py").exists()) or path.suffix == ".py"
    }


def layer_violations(package: Path = PACKAGE, doc: Path = DOC) -> dict[str, set[str]]:
    """What the checks below find in a package and its doc, by check."""
    table, imports = layer_table(doc), package_imports(package)
    return {
        "upward": upward_imports(table, imports, package),
        "across folders in a row": imports_across_folders_in_a_row(table, imports, package),
        "on a circle": circles(imports, package),
        "on a circle inside a folder": circles_inside_folders(imports, package),
    }


def test_every_module_is_in_one_layer_of_the_doc() -> None:
    placed = [unit for _, units in layer_table() for unit in units]
    assert len(placed) == len(set(placed)), "a module is in two layers of the table"
    on_disk = placed_units(PACKAGE)
    assert set(placed) == on_disk, (
        f"not in the table: {sorted(on_disk - set(placed))}; "
        f"in the table but not on disk: {sorted(set(placed) - on_disk)}"
    )


def test_each_row_of_the_table_is_one_folder() -> None:
    shared = {
        layer: sorted({folder_of(unit) or "(the package's own modules)" for unit in units})
        for layer, units in layer_table()
    }
    assert all(len(folders) == 1 for folders in shared.values()), shared


def assert_only_known(found: set[str], known: set[str], what: str) -> None:
    assert not found - known, f"{what}:\n" + "\n".join(sorted(found - known))
    assert not known - found, f"gone, strike from the known list: {sorted(known - found)}"


def test_no_import_points_up_a_layer() -> None:
    found = upward_imports(layer_table(), package_imports())
    assert_only_known(found, KNOWN_UPWARD, "imports from a lower layer into a higher one")


def test_no_import_crosses_folders_inside_a_row() -> None:
    found = imports_across_folders_in_a_row(layer_table(), package_imports())
    assert not found, "imports between folders of one row:\n" + "\n".join(sorted(found))


def test_no_circle_of_imports_runs_through_two_folders() -> None:
    assert_only_known(circles(package_imports()), KNOWN_CIRCLES, "circling through")


def test_no_circle_of_imports_runs_between_the_modules_of_one_folder() -> None:
    """Where two modules of a folder need each other, what both need moves to a module both
    import: an import inside a function or under ``TYPE_CHECKING`` is an import here, so it
    cannot hide the circle (what stays inside a function or under ``TYPE_CHECKING`` does so
    for another reason: an optional or heavy dependency, a name for annotations only)."""
    found = circles_inside_folders(package_imports())
    assert not found, "circling inside a folder:\n" + "\n".join(sorted(found))


def test_the_loops_stand_on_runs_not_on_each_other() -> None:
    """SFT and GRPO are siblings: what a run is (its folder, its config's rules) is ``runs/``."""
    across = [
        f"{short(each.importer)} -> {short(each.imported)}"
        for each in package_imports()
        if {unit_of(each.importer), unit_of(each.imported)} == {"sft/", "grpo/"}
    ]
    assert not across, across


def test_the_checker_parses_imports_it_must_refuse() -> None:
    """The check is not vacuous: the parser sees lazy imports inside functions and modules
    imported by name."""
    found = package_imports()
    assert any(each.importer == "post_training_cookbook.service.factory" for each in found)
    lazy = [
        each.importer for each in found if each.imported == "post_training_cookbook.service.local"
    ]
    assert "post_training_cookbook.service.factory" in lazy  # imported inside open_service
    by_name = {(each.importer, each.imported) for each in found}
    shim = ("post_training_cookbook.service.trainer", "post_training_cookbook.trainer.trainer")
    assert shim in by_name  # moved_module(__name__, "post_training_cookbook.trainer.trainer")
    height = {unit: i for i, (_, units) in enumerate(reversed(layer_table())) for unit in units}
    assert height["envs/"] < height["rollout/"] < height["trainer/"] < height["service/"]
    # The env contract is below what is built on it: tool backends and the bundled envs.
    assert height["envs/"] < height["tool_backends/"] and height["envs/"] < height["bundled_envs/"]
    moved = ("post_training_cookbook.moved_paths", "post_training_cookbook.tool_backends.sandbox")
    assert moved in by_name  # the table of old paths names the new homes, from the top
    assert height["service/"] < height["grpo/"] < height["cli/"]
    # evaluation reads a GRPO run's folder and settings without importing grpo/: kept below it,
    # an import of grpo/ from evaluation/ is an upward one.
    assert height["runs/"] < height["evaluation/"] < height["grpo/"]


def planted_copy(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the package and its doc to plant imports in."""
    package = tmp_path / "src" / "post_training_cookbook"
    shutil.copytree(PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(DOC, tmp_path / "architecture.md")
    return package, tmp_path / "architecture.md"


def plant(module: Path, line: str) -> None:
    module.write_text(module.read_text() + f"\n\ndef _planted() -> None:\n    {line}\n")


def test_the_checks_refuse_a_planted_upward_import(tmp_path: Path) -> None:
    package, doc = planted_copy(tmp_path)
    before = layer_violations(package, doc)
    plant(package / "rollout" / "types.py", "from post_training_cookbook.serve import policy")
    after = layer_violations(package, doc)
    assert after["upward"] - before["upward"] == {"rollout.types -> serve.policy"}


def test_the_checks_refuse_a_planted_import_across_folders_of_one_row(tmp_path: Path) -> None:
    package, doc = planted_copy(tmp_path)
    assert not layer_violations(package, doc)["across folders in a row"]
    rows = doc.read_text().splitlines(keepends=True)
    merged = [
        row.replace("| `rollout/` |", "| `rollout/`, `engine/` |")
        for row in rows
        if not row.startswith("| engine | `engine/` |")
    ]
    doc.write_text("".join(merged))
    found = layer_violations(package, doc)["across folders in a row"]
    assert "rollout.play -> engine.types" in found, found


def test_the_checks_refuse_a_planted_circle(tmp_path: Path) -> None:
    """A circle through two folders, its return leg imported lazily and by name."""
    package, doc = planted_copy(tmp_path)
    before = layer_violations(package, doc)["on a circle"]
    assert not any("types.py" in circle for circle in before)
    plant(package / "types.py", 'importlib.import_module("post_training_cookbook.envs.base")')
    after = layer_violations(package, doc)["on a circle"]
    assert any("envs/" in circle and "types.py" in circle for circle in after - before), after


def test_the_checks_refuse_a_circle_inside_a_folder_closed_lazily(tmp_path: Path) -> None:
    """``envs.tools`` imports ``envs.base``; a return leg inside a function closes a circle."""
    package, doc = planted_copy(tmp_path)
    assert not layer_violations(package, doc)["on a circle inside a folder"]
    plant(package / "envs" / "base.py", "from post_training_cookbook.envs.tools import as_tool")
    found = layer_violations(package, doc)["on a circle inside a folder"]
    assert any("envs.base" in circle and "envs.tools" in circle for circle in found), found


def test_the_checks_refuse_a_circle_inside_a_folder_closed_under_type_checking(
    tmp_path: Path,
) -> None:
    package, doc = planted_copy(tmp_path)
    base = package / "envs" / "base.py"
    base.write_text(
        base.read_text()
        + "\n\nif typing.TYPE_CHECKING:\n"
        + "    from post_training_cookbook.envs.tool_env import ToolEnv\n"
    )
    found = layer_violations(package, doc)["on a circle inside a folder"]
    assert any("envs.base" in circle and "envs.tool_env" in circle for circle in found), found


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


# ---------------------------------------------------------------- the path to the loss


def place_of(code: CodeType) -> str:
    """``name (folder/)`` of a function of the package (``name (.)`` at its top); ``""`` for
    anyone else's (Python's threads and event loop)."""
    package = Path(sync.__file__).parent  # the package imported, wherever it is
    path = Path(code.co_filename)
    if not path.is_relative_to(package):
        return ""
    parts = path.relative_to(package).parts
    return f"{code.co_qualname} ({parts[0] + '/' if len(parts) > 1 else '.'})"


def stack_places(frame: FrameType | None) -> list[str]:
    """The package's functions on a thread's stack, outermost first."""
    places = []
    while frame is not None:
        places.append(place_of(frame.f_code))
        frame = frame.f_back
    return [place for place in reversed(places) if place]


def awaiting_places(coroutine: Any) -> list[str]:
    """``awaiting_frames``, each with its folder."""
    places = []
    while coroutine is not None and getattr(coroutine, "cr_code", None) is not None:
        places.append(place_of(coroutine.cr_code))
        coroutine = coroutine.cr_await
    return places


def test_the_path_from_train_multi_turn_to_the_loss_is_the_ten_frames_the_doc_lists(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recorded from inside ``policy_loss``, in a real run: the trainer thread's stack, the
    main thread's, and the coroutines the loop's task awaits through."""
    chains: dict[str, list[str]] = {}

    def recording_terms(
        logprobs: Tensor, log_ratio: Tensor, advantages: Tensor, mask: Tensor, c: LossConfig
    ) -> tuple[Tensor, dict[str, float]]:
        if not chains:
            main = sys._current_frames()[threading.main_thread().ident or 0]
            tasks = asyncio.all_tasks(sync.process_loop())
            task = next(t for t in tasks if "_train" in awaiting_frames(t.get_coro()))
            below_the_loop = stack_places(main)  # (and whatever the loop runs just now)
            chains.update(
                main=below_the_loop[: below_the_loop.index("_on_process_loop (.)") + 1],
                trainer=stack_places(sys._getframe(1)),
                loop=awaiting_places(task.get_coro()),
            )
        return objective.ppo_clip(logprobs, log_ratio, advantages, mask, c)

    variant = objective.Variant(recording_terms, objective.sequence_mean)
    monkeypatch.setitem(objective.VARIANTS, "grpo", variant)
    config = quick_config(tiny_llama_dir, tmp_path, episodes_per_task=2, max_turns=1)
    train_multi_turn(config, mode_tasks(["answer", "env"]), mode_envs(Closes()))  # rewards vary
    assert chains, "the run trained no batch"
    assert chains["main"] == [
        "train_multi_turn (grpo/)",  # a sync entry point: the loop is a coroutine
        "run_sync (.)",
        "_on_process_loop (.)",
    ]
    assert chains["loop"] == [
        "_train (grpo/)",  # opens the run (service, run folder, W&B), picks the loop
        "run_lockstep (grpo/)",
        "train (grpo/)",  # phase 3, which the async loop shares
        "LocalModelService.forward_backward (service/)",  # in this process, or on Ray
        "LocalModelService._on_trainer (service/)",  # awaits the trainer thread
    ]
    assert chains["trainer"] == [  # on the trainer thread, so the event loop goes on
        "Trainer.forward_backward (trainer/)",  # log π_θ of each micro-batch, backward
        "policy_loss (trainer/)",  # the loss: ratio, terms, aggregation (trainer/objective.py)
    ]
    frames = chains["main"] + chains["loop"] + chains["trainer"]
    assert len(frames) == 10
    assert {frame.split()[-1] for frame in frames} == {"(grpo/)", "(.)", "(service/)", "(trainer/)"}
    listed = "`train_multi_turn`, `run_sync`, `_on_process_loop`, `_train`, `run_lockstep`,\n"
    listed += "`train`, `LocalModelService.forward_backward`, `_on_trainer`,\n"
    listed += "`Trainer.forward_backward`, `policy_loss`"
    assert listed in DOC.read_text()
