"""What tools stand on outside the process, each a ``Tool`` of the env contract (``envs/``):
tools from MCP servers (``MCPToolbox`` over ``MCPStdioServer`` or ``MCPHttpServer``:
``mcp_tools``, ``mcp_connection``; docs/mcp.md) and model-written code run in a bubblewrap
sandbox (``sandbox``: the ``python`` and ``bash`` tools; docs/sandbox.md). ``process_marks``
finds and ends the processes either left behind. Importing this package imports neither the
MCP SDK nor the sandbox."""

from post_training_cookbook.tool_backends.mcp_connection import MCPHttpServer, MCPStdioServer
from post_training_cookbook.tool_backends.mcp_tools import MCPTool, MCPToolbox, MCPToolCallError

__all__ = ["MCPHttpServer", "MCPStdioServer", "MCPTool", "MCPToolCallError", "MCPToolbox"]
