"""Run the policy server: in a background thread (``PolicyServer``, what tests, the agent adapter
and notebooks use) or in the foreground (``serve_forever``, the ``serve`` command).

Binding: 127.0.0.1 by default. Any address that is not loopback needs a bearer token, and
the server refuses to start without one, because the endpoint samples from your weights for
anyone who can reach it. The socket is bound before the thread starts, so a port in use or a
refused address fails in the caller, at once.
"""

from __future__ import annotations

import ipaddress
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn

from post_training_cookbook.serve.app import Routes, ServerLimits, build_app
from post_training_cookbook.serve.policy import Endpoint, ServedModel
from post_training_cookbook.serve.timeouts import header_timed_protocol

START_TIMEOUT_S = 30.0


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """``ValueError`` for an address off loopback without a bearer token."""
    if token is not None and len(token) < 16:
        raise ValueError("the bearer token must be at least 16 characters")
    if not is_loopback(host) and token is None:
        raise ValueError(
            f"binding {host} exposes the model beyond this machine: give a bearer token "
            "(token=..., or --token-env VAR on the command line), or bind 127.0.0.1"
        )


@dataclass(frozen=True)
class EpisodeRoute:
    """Where one episode's agent talks to the server."""

    episode_id: str
    base_url: str
    api_key: str


class PolicyServer:
    """The OpenAI-compatible server in a daemon thread of its own (with its own event loop).

    ``model``: the model ``/v1/chat/completions`` serves; None for a server that only serves
    episodes (the agent adapter's). ``on_stop`` runs once it stopped (``start_server`` closes
    its engine there). Use as a context manager, or call ``stop``."""

    def __init__(
        self,
        model: ServedModel | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        limits: ServerLimits | None = None,
        on_stop: Callable[[], None] | None = None,
    ) -> None:
        check_bind(host, token)
        self.host = host
        self._on_stop = on_stop
        self.limits = limits or ServerLimits()
        self.routes = Routes(Endpoint(model) if model else None, token, self.limits)
        self._socket = bound_socket(host, port)
        self.port: int = self._socket.getsockname()[1]
        config = uvicorn.Config(
            build_app(self.routes),
            log_level="warning",
            access_log=False,
            http=header_timed_protocol(self.limits.header_timeout_s),
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._socket]},
            daemon=True,
            name="PolicyServer",
        )
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._socket.close()
                raise RuntimeError(f"the policy server did not start on {host}:{self.port}")
            time.sleep(0.01)

    @property
    def base_url(self) -> str:
        """The ``base_url`` for an OpenAI client."""
        return f"{self._origin()}/v1"

    def open_episode(self, endpoint: Endpoint) -> EpisodeRoute:
        """Serve ``endpoint`` under a fresh episode id, behind a fresh key."""
        episode_id, key = secrets.token_hex(8), secrets.token_urlsafe(24)
        self.routes.episodes[episode_id] = (key, endpoint)
        return EpisodeRoute(episode_id, f"{self._origin()}/episodes/{episode_id}/v1", key)

    def close_episode(self, episode_id: str) -> None:
        """Later calls of that episode get 404."""
        self.routes.episodes.pop(episode_id, None)

    def stop(self) -> None:
        """Stop serving (requests in flight get a few seconds), then run ``on_stop``."""
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()
        if self._on_stop is not None:
            on_stop, self._on_stop = self._on_stop, None
            on_stop()

    def __enter__(self) -> PolicyServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _origin(self) -> str:
        host = self.host if ":" not in self.host else f"[{self.host}]"
        if host in ("0.0.0.0", "[::]"):
            host = "127.0.0.1"  # reachable from this machine; others use the machine's address
        return f"http://{host}:{self.port}"


async def serve_forever(
    model: ServedModel,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    token: str | None = None,
    limits: ServerLimits | None = None,
    sock: socket.socket | None = None,
) -> None:
    """Serve ``model`` in this event loop until interrupted (Ctrl-C stops it cleanly);
    ``sock``: a socket already bound (``bound_socket``), so a port in use fails early."""
    check_bind(host, token)
    limits = limits or ServerLimits()
    app = build_app(Routes(Endpoint(model), token, limits))
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="info",
        http=header_timed_protocol(limits.header_timeout_s),
    )
    await uvicorn.Server(config).serve(sockets=None if sock is None else [sock])


def bound_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(128)
    sock.setblocking(False)
    return sock
