"""An OpenAI-compatible policy server: ``/v1/chat/completions`` through the same codec and
engine as training, token-in-token-out per conversation.

    from post_training_cookbook.serve import start_server

    with start_server("post-training-cookbook/tool-use-tiny") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused")

``wire`` speaks the API's format, ``conversations`` keeps token-in-token-out across calls,
``policy`` runs one completion, ``app`` is the HTTP face (routes, token, bounds), ``server``
runs it, ``loading`` loads a model to serve. Needs the ``serve`` extra (starlette, uvicorn);
the names below load on first use, so ``wire`` imports without it. docs/openai_endpoint.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from post_training_cookbook.lazy import module_getattr

if TYPE_CHECKING:
    from post_training_cookbook.serve.app import ServerLimits
    from post_training_cookbook.serve.loading import load_served_model, start_server
    from post_training_cookbook.serve.policy import Endpoint, ServedModel
    from post_training_cookbook.serve.server import EpisodeRoute, PolicyServer, serve_forever

_LAZY = {
    "ServerLimits": "post_training_cookbook.serve.app",
    "load_served_model": "post_training_cookbook.serve.loading",
    "start_server": "post_training_cookbook.serve.loading",
    "Endpoint": "post_training_cookbook.serve.policy",
    "ServedModel": "post_training_cookbook.serve.policy",
    "EpisodeRoute": "post_training_cookbook.serve.server",
    "PolicyServer": "post_training_cookbook.serve.server",
    "serve_forever": "post_training_cookbook.serve.server",
}

__all__ = [
    "Endpoint",
    "EpisodeRoute",
    "PolicyServer",
    "ServedModel",
    "ServerLimits",
    "load_served_model",
    "serve_forever",
    "start_server",
]

__getattr__ = module_getattr(__name__, lazy=_LAZY)
