"""The `mcp` SDK as an agent would use it: list the tools, call one.

    python client.py URL TOOL ARGS_JSON

Prints one JSON line: {"tools": [...], "annotations": {...}, "result": ...,
"error": {"code", "message", "data"}, "progress": [...], "seconds": ...}.
Honours HTTP_PROXY (httpx does), which is how a guest reaches the gateway.
"""
import asyncio
import json
import sys
import time

from mcp import ClientSession
from mcp.client.streamable_http import streamablehttp_client
from mcp.shared.exceptions import McpError


async def main(url, tool, args):
    out = {"progress": []}
    async with streamablehttp_client(url) as (read, write, _):
        async with ClientSession(read, write) as s:
            await s.initialize()
            listed = await s.list_tools()
            out["tools"] = [t.name for t in listed.tools]
            out["annotations"] = {
                t.name: (t.annotations.model_dump(exclude_none=True) if t.annotations else {})
                for t in listed.tools
            }
            if tool:
                async def progress(p, total, message):
                    out["progress"].append(message)

                t0 = time.monotonic()
                try:
                    r = await s.call_tool(tool, json.loads(args), progress_callback=progress)
                    out["result"] = {
                        "isError": r.isError,
                        "text": [c.text for c in r.content if getattr(c, "text", None) is not None],
                    }
                except McpError as e:
                    out["error"] = {"code": e.error.code, "message": e.error.message, "data": e.error.data}
                out["seconds"] = time.monotonic() - t0
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "", sys.argv[3] if len(sys.argv) > 3 else "{}"))
