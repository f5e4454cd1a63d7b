"""Import paths that moved up the layers, kept for one release (until
``deprecation.REMOVAL_RELEASE``): their old homes sit below the new ones and may not name
them, so the package's entry hands this table to ``deprecation.redirect``. Paths that moved
down keep a shim at the old path instead (``service/trainer.py``)."""

from __future__ import annotations

MOVED_MODULES = {
    # Tool backends and bundled envs left the env contract (``envs/``); a package's modules
    # (``envs.sandbox.pool``, ``envs.bfcl.checker``) follow it.
    "post_training_cookbook.envs.mcp_connection": (
        "post_training_cookbook.tool_backends.mcp_connection"
    ),
    "post_training_cookbook.envs.mcp_tools": "post_training_cookbook.tool_backends.mcp_tools",
    "post_training_cookbook.envs.process_marks": (
        "post_training_cookbook.tool_backends.process_marks"
    ),
    "post_training_cookbook.envs.sandbox": "post_training_cookbook.tool_backends.sandbox",
    "post_training_cookbook.envs.calculator": "post_training_cookbook.bundled_envs.calculator",
    "post_training_cookbook.envs.bfcl": "post_training_cookbook.bundled_envs.bfcl",
}
"""Old module path → new."""

MOVED_NAMES = {
    ("post_training_cookbook.envs", "MCPHttpServer"): "post_training_cookbook.tool_backends",
    ("post_training_cookbook.envs", "MCPStdioServer"): "post_training_cookbook.tool_backends",
    ("post_training_cookbook.envs", "MCPTool"): "post_training_cookbook.tool_backends",
    ("post_training_cookbook.envs", "MCPToolbox"): "post_training_cookbook.tool_backends",
    ("post_training_cookbook.envs", "MCPToolCallError"): "post_training_cookbook.tool_backends",
    # It loads a model, so it lives above the envs.
    ("post_training_cookbook.envs", "LocalJudge"): "post_training_cookbook.evaluation.local_judge",
    (
        "post_training_cookbook.envs.judge",
        "LocalJudge",
    ): "post_training_cookbook.evaluation.local_judge",
}
"""(old module, name) → the module that has the name now."""
