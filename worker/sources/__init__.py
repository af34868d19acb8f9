"""Tools that are not Python functions of the worker: MCP servers' tools (``mcp_*``)
and HTTP calls declared in a spec (``http_tools``)."""
