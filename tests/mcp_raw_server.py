"""A test fixture, not a server to copy: a hand-written JSON-RPC MCP server over stdio that
misbehaves in one way, chosen by its first argument, where the SDK's server would not let
it:

- ``errors``: tools ``echo`` (answers its ``text``) and ``busy``, whose every call is answered
  with JSON-RPC error -32000 ``Connection closed`` (the code and words the SDK uses for a
  lost connection; here the connection is fine);
- ``duplicate``: lists ``echo`` twice;
- ``bad_names``: lists a tool named ``two words`` and one of 5,000 characters;
- ``garbage``: writes 200 lines that are not JSON before each answer;
- ``no_init``: ignores SIGTERM and never answers ``initialize``.

    python tests/mcp_raw_server.py MODE
"""

from __future__ import annotations

import json
import signal
import sys
from typing import Any

MODE = sys.argv[1]


def tool(name: str) -> dict[str, Any]:
    schema = {"type": "object", "properties": {"text": {"type": "string"}}}
    return {"name": name, "description": f"the {name} tool", "inputSchema": schema}


TOOLS = {
    "errors": [tool("echo"), tool("busy")],
    "duplicate": [tool("echo"), tool("echo")],
    "bad_names": [tool("echo"), tool("two words"), tool("x" * 5_000)],
    "garbage": [tool("echo")],
}


def send(message: dict[str, Any]) -> None:
    if MODE == "garbage":
        sys.stdout.write("this is not JSON-RPC {\n" * 200)
    sys.stdout.write(json.dumps({"jsonrpc": "2.0", **message}) + "\n")
    sys.stdout.flush()


def answer(request: dict[str, Any]) -> dict[str, Any] | None:
    method, params = request.get("method"), request.get("params") or {}
    if method == "initialize":
        if MODE == "no_init":
            return None
        return {
            "result": {
                "protocolVersion": params.get("protocolVersion", "2025-06-18"),
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "raw", "version": "0"},
            }
        }
    if method == "tools/list":
        return {"result": {"tools": TOOLS[MODE]}}
    if method == "tools/call":
        if params.get("name") == "busy":
            return {"error": {"code": -32000, "message": "Connection closed"}}
        text = str((params.get("arguments") or {}).get("text", ""))
        return {"result": {"content": [{"type": "text", "text": text}], "isError": False}}
    if method == "ping":
        return {"result": {}}
    return {"error": {"code": -32601, "message": f"no method {method}"}}


def main() -> None:
    if MODE == "no_init":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for line in sys.stdin:
        request = json.loads(line)
        if "id" not in request:
            continue  # a notification
        reply = answer(request)
        if reply is not None:
            send({"id": request["id"], **reply})
    if MODE == "no_init":  # stdin closed: stay, as a server stuck in its start would
        signal.pause()


if __name__ == "__main__":
    main()
