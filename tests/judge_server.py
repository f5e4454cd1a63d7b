"""A test fixture, not a model: an OpenAI-compatible ``POST /v1/chat/completions`` on
127.0.0.1 that answers with fixed completions, for the judge tests.

The completion depends on the answer being graded (the request's last user message):

- ``worth N``: "Score: N" after a line of reasons;
- ``SLOW``: the same, after ``slow_s`` seconds (a timeout);
- ``GARBLED``: no score at all; ``HUGE``: "Score: 42" (out of 0-10);
- ``FLAKY``: HTTP 500 the first time this exact request comes, then as above;
- ``REFUSE``: HTTP 401, as an endpoint with a wrong key answers;
- anything else: "Score: 5".

Every request is recorded (its JSON body and Authorization header) in ``requests``.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class JudgeServer:
    def __init__(self, slow_s: float = 2.0) -> None:
        self.slow_s = slow_s
        self.requests: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        """The most requests the server was answering at once."""
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def answer_counted(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return self.answer(body)
        finally:
            with self._lock:
                self.in_flight -= 1

    def answer(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        graded = body["messages"][-1]["content"].split("Answer to grade:\n")[-1]
        with self._lock:
            first_time = json.dumps(body, sort_keys=True) not in self._seen
            self._seen.add(json.dumps(body, sort_keys=True))
        if "REFUSE" in graded:
            return 401, {"error": {"message": "Incorrect API key provided", "type": "auth"}}
        if "FLAKY" in graded and first_time:
            return 500, {"error": {"message": "upstream hiccup", "type": "server_error"}}
        if "SLOW" in graded:
            time.sleep(self.slow_s)
        worth = re.search(r"worth (\d+)", graded)
        text = {"GARBLED": "I cannot decide.", "HUGE": "Reasons.\nScore: 42"}
        content = next((v for k, v in text.items() if k in graded), None)
        content = (
            content or f"The answer meets the rubric partly.\nScore: {worth[1] if worth else 5}"
        )
        return 200, {
            "id": "chatcmpl-test",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", ""),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }


@contextmanager
def serving(server: JudgeServer) -> Iterator[str]:
    """Serve ``server`` on a free loopback port; yields the base URL (``.../v1``)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            server.requests.append({"body": body, "authorization": self.headers["Authorization"]})
            status, payload = server.answer_counted(body)
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

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
