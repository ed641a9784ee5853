"""The hit path's ceiling: a bare aiohttp handler answering POST /stage with a stored JSON
body looked up by adapter_id, no sidecar code at all.

Usage: python -m benchmarks.bare_server PORT RESPONSES.json  (RESPONSES maps id -> body)
"""

from __future__ import annotations

import json
import sys
from typing import Any

from aiohttp import web


def build_app(responses: dict[str, Any]) -> web.Application:
    async def stage(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response(responses[body["adapter_id"]])

    app = web.Application()
    app.router.add_post("/stage", stage)
    return app


def main() -> None:
    port, responses_path = int(sys.argv[1]), sys.argv[2]
    with open(responses_path, encoding="utf-8") as f:
        responses = json.load(f)
    web.run_app(build_app(responses), host="127.0.0.1", port=port, access_log=None,
                print=None)


if __name__ == "__main__":
    main()
