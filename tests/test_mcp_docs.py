"""docs/mcp.md's complete example, run as the page prints it: its server, then its training
script (two steps on the bundled model) against that server."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from test_grpo_common import step_metrics

from post_training_cookbook.tool_backends import MCPStdioServer, MCPToolbox

PAGE = Path(__file__).resolve().parents[1] / "docs" / "mcp.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.DOTALL)


def test_the_pages_server_serves_its_tools(tmp_path: Path) -> None:
    server_code, _ = python_blocks()[:2]
    (tmp_path / "inventory_server.py").write_text(server_code)
    spec = MCPStdioServer(sys.executable, (str(tmp_path / "inventory_server.py"),))
    with MCPToolbox(spec) as toolbox:
        assert [s["function"]["name"] for s in toolbox.specs] == ["stock", "multiply"]
        tools = {tool.name: tool for tool in toolbox.tools()}
        assert asyncio.run(tools["stock"].execute('{"item": "plums"}')).content == "30"
        with pytest.raises(Exception, match="unknown item 'kiwis'; items: apples"):
            asyncio.run(tools["stock"].execute('{"item": "kiwis"}'))


@pytest.mark.heavy  # two GRPO steps of 8 episodes: ~30 s on a loaded 2-core machine
def test_the_pages_training_example_runs_as_printed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server_code, training_code = python_blocks()[:2]
    (tmp_path / "inventory_server.py").write_text(server_code)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    namespace: dict[str, object] = {"__name__": "docs_example"}
    exec(compile(training_code, str(PAGE), "exec"), namespace)
    run = namespace["run"]
    assert sorted(step_metrics(run.path)) == [0, 1]  # type: ignore[attr-defined]
