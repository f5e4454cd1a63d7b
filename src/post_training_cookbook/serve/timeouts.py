"""A header read timeout for uvicorn's HTTP/1.1 protocol.

uvicorn closes a connection idle between requests (``timeout_keep_alive``), but not one that
sends its request headers slowly (a byte every few seconds): such connections would stay
open for as long as their clients like. ``header_timed_protocol(seconds)`` is uvicorn's
``H11Protocol`` with a deadline on the headers of each request, from the connection's start
or the previous response's end; a connection past it is closed. The body has its own
timeout in the app (``ServerLimits.body_timeout_s``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderTimedH11(H11Protocol):
    header_timeout_s: float = 10.0
    _header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self._in_request():
            self._disarm()  # the headers are in: the body timeout takes over

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self._in_request():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _too_slow(self) -> None:
        self._header_deadline = None
        if not self._in_request():
            self.transport.close()


def header_timed_protocol(header_timeout_s: float) -> Any:
    """``HeaderTimedH11`` with its deadline, as uvicorn's ``Config(http=...)`` takes it."""
    return type("HeaderTimedH11", (HeaderTimedH11,), {"header_timeout_s": header_timeout_s})
