#!/usr/bin/env bash
# The Python `mcp` SDK (PyPI) the MCP gateway tests use, as client and as a
# FastMCP server: a venv under /var/cache/strata/venv, made once per pinned
# version (CI pays once). Prints the venv's python.
set -euo pipefail
VERSION="${STRATA_MCP_VERSION:-1.30.0}"
VENV="${STRATA_MCP_VENV:-/var/cache/strata/venv/mcp-$VERSION}"
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('mcp') != '$VERSION')" 2>/dev/null; then
  rm -rf "$VENV"
  python3 -m venv "$VENV" >&2
  "$VENV/bin/pip" install -q "mcp==$VERSION" >&2
fi
echo "$VENV/bin/python"
