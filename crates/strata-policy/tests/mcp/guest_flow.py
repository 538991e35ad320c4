"""What an agent in the guest does (the e2e MCP test): the `mcp` SDK,
through the proxy the agent's environment names (HTTP_PROXY), to the
gateway's two Slack stand-ins. Prints one JSON object.

    python guest_flow.py
"""
import asyncio
import json

from mcp import ClientSession
from mcp.client.streamable_http import streamablehttp_client
from mcp.shared.exceptions import McpError


async def call(s, tool, args, progress=None):
    try:
        r = await s.call_tool(tool, args, progress_callback=progress)
        return {"isError": r.isError, "text": [c.text for c in r.content if getattr(c, "text", None)]}
    except McpError as e:
        return {"error": {"code": e.error.code, "message": e.error.message, "data": e.error.data}}


async def main():
    out = {}
    url = "http://mcp.strata.internal/{}/mcp"
    # The HTTP server, under the connector's write block.
    async with streamablehttp_client(url.format("slack")) as (r, w, _):
        async with ClientSession(r, w) as s:
            await s.initialize()
            out["http_tools"] = [t.name for t in (await s.list_tools()).tools]
            out["http_search"] = await call(s, "search", {"query": "guest"})
            out["http_post"] = await call(s, "post_message", {"channel": "general", "text": "blocked"})
    # The stdio server, with an approve rule on post_message.
    async with streamablehttp_client(url.format("slack-stdio")) as (r, w, _):
        async with ClientSession(r, w) as s:
            await s.initialize()
            out["stdio_tools"] = [t.name for t in (await s.list_tools()).tools]
            out["stdio_search"] = await call(s, "search", {"query": "guest"})
            progress = []

            async def on_progress(p, total, message):
                progress.append(message)

            out["stdio_post"] = await call(s, "post_message", {"channel": "general", "text": "approved-1"}, on_progress)
            out["stdio_progress"] = progress
    print(json.dumps(out), flush=True)


asyncio.run(main())
