"""A test fixture, not a model: an OpenAI-compatible ``POST /v1/chat/completions`` on
127.0.0.1 that plays a τ² user simulator, well or badly, for tests/test_tau2_user.py.

Each request takes the next behaviour of ``script`` (then ``default``):

- ``say:TEXT``: a chat completion whose message is TEXT; ``call:NAME``: one tool call to
  NAME with no arguments (``anon_call:NAME``: the same without an id, as some servers send);
- ``status:N``: HTTP N with an OpenAI-style error body;
- ``hang``: reads the request, then answers nothing, until the client goes away;
- ``trickle``: sends the headers of a 200 and then one byte of body every 0.1 s, forever;
- ``drop``: closes the connection without answering;
- ``not_json``: a 200 whose body is an HTML page; ``malformed``: a 200 whose JSON is no
  chat completion; ``bad_arguments``: a tool call whose arguments are not JSON;
  ``empty``: a message with no text and no tool calls; ``huge``: a 200 of 3 MB of text.

Every request's JSON body is kept in ``requests`` (its Authorization header in
``authorizations``); for ``hang`` and ``trickle`` the server
records how long after the request the client closed the connection (``closed_after_s``),
so a test can see that the request was abandoned and not left open.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

GIVE_UP_S = 20.0
"""A hanging behaviour ends by itself after this long, whatever the client does."""


def completion(message: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 0,
        "model": "fake-user",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


class UserServer:
    def __init__(self, script: list[str] | None = None, default: str = "say:Hello.") -> None:
        self.script = list(script or [])
        self.default = default
        self.requests: list[dict[str, Any]] = []
        self.authorizations: list[str | None] = []
        self.closed_after_s: list[float] = []
        self._lock = threading.Lock()

    def next_behaviour(self, body: dict[str, Any]) -> str:
        with self._lock:
            self.requests.append(body)
            return self.script.pop(0) if self.script else self.default


def _wait_for_close(connection: socket.socket, started: float, server: UserServer) -> None:
    """Until the client closes the connection (or ``GIVE_UP_S``): record when it did."""
    while time.monotonic() - started < GIVE_UP_S:
        readable, _, _ = select.select([connection], [], [], 0.05)
        if readable and not connection.recv(1024, socket.MSG_PEEK):
            server.closed_after_s.append(time.monotonic() - started)
            return


@contextmanager
def serving(server: UserServer) -> Iterator[str]:
    """Serve ``server`` on a free loopback port; yields the base URL (``.../v1``)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            started = time.monotonic()
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            server.authorizations.append(self.headers.get("Authorization"))
            behaviour = server.next_behaviour(body)
            kind, _, argument = behaviour.partition(":")
            if kind == "hang":
                _wait_for_close(self.connection, started, server)
                self.close_connection = True
            elif kind == "drop":
                self.close_connection = True
            elif kind == "trickle":
                self._trickle(started)
            elif kind == "status":
                self._send(int(argument), {"error": {"message": f"fake {argument}"}})
            elif kind == "malformed":
                self._send(200, {"object": "list", "data": []})
            elif kind == "not_json":
                self._send(200, b"<html><body>502 Bad Gateway</body></html>")
            elif kind == "huge":
                self._send(200, completion({"role": "assistant", "content": "x" * 3_000_000}))
            else:
                self._send(200, completion(_message(kind, argument)))

        def _send(self, status: int, payload: Any) -> None:
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _trickle(self, started: float) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "100000000")
            self.end_headers()
            try:
                while time.monotonic() - started < GIVE_UP_S:
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.1)
            except OSError:  # the client closed the connection
                server.closed_after_s.append(time.monotonic() - started)
            self.close_connection = True

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    finally:
        httpd.shutdown()
        httpd.server_close()


def _message(kind: str, argument: str) -> dict[str, Any]:
    if kind == "say":
        return {"role": "assistant", "content": argument}
    if kind in ("call", "anon_call"):
        function = {"name": argument, "arguments": "{}"}
        call = _call(function) if kind == "call" else {"type": "function", "function": function}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "bad_arguments":
        function = {"name": "check_status_bar", "arguments": "{not json"}
        return {"role": "assistant", "content": None, "tool_calls": [_call(function)]}
    if kind == "empty":
        return {"role": "assistant", "content": ""}
    raise ValueError(f"unknown behaviour {kind!r}")


def _call(function: dict[str, str]) -> dict[str, Any]:
    return {"id": "call_user_1", "type": "function", "function": function}
