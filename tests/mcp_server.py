"""A small MCP server for the MCP tool tests, written with the official SDK's ``MCPServer``
(FastMCP before mcp 2): the tool-use game's three tools over its world, and tools that add
(structured output), fail (``isError``), hang, or kill the server.

    python tests/mcp_server.py stdio
    python tests/mcp_server.py http PORT       (streamable HTTP on 127.0.0.1:PORT/mcp)

Each call is appended to the file ``$MCP_TEST_CALL_LOG`` names, when set, so a test can see
that the calls reached the server.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import BaseModel

from post_training_cookbook.envs.arithmetic import safe_eval
from post_training_cookbook.envs.tool_use_game.env import default_world

server = MCPServer("cookbook-test-server", log_level="WARNING")
WORLD = default_world()


def logged(name: str, **arguments: object) -> None:
    path = os.environ.get("MCP_TEST_CALL_LOG")
    if path:
        with open(path, "a") as log:
            log.write(json.dumps({"tool": name, "arguments": arguments, "pid": os.getpid()}) + "\n")


@server.tool(description="List the fact keys that start with a prefix, such as an entity's name.")
def list_fact_keys(prefix: str) -> str:
    logged("list_fact_keys", prefix=prefix)
    keys = WORLD.keys_with_prefix(prefix.strip())
    return ", ".join(keys[:10]) if keys else f"no keys start with '{prefix}'"


@server.tool(description="Look up the value of a fact by its key, such as 'kalo.weight'.")
def lookup(key: str) -> str:
    logged("lookup", key=key)
    if key.strip() not in WORLD.facts:
        raise ToolError(f"lookup: unknown key '{key}'")
    return str(WORLD.facts[key.strip()])


@server.tool(description="Evaluate an arithmetic expression with numbers, + - * / and parentheses.")
def calculator(expression: str) -> str:
    logged("calculator", expression=expression)
    return str(safe_eval(expression))


class Sum(BaseModel):
    total: int
    terms: list[int]


@server.tool(description="Add two integers.")
def add(a: int, b: int) -> Sum:
    logged("add", a=a, b=b)
    return Sum(total=a + b, terms=[a, b])


@server.tool(description="Fail with the reason given.")
def fail(reason: str) -> str:
    logged("fail", reason=reason)
    raise ToolError(f"failed on purpose: {reason}")


@server.tool(description="Never answer.")
async def hang() -> str:
    logged("hang")
    await asyncio.sleep(3600)
    return "unreachable"


@server.tool(description="End the server's process at once.")
def die() -> str:
    logged("die")
    os._exit(1)


if __name__ == "__main__":
    if sys.argv[1] == "stdio":
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
