"""Who may call the API, and the request id every response carries: an ASGI middleware, not a FastAPI one (those
buffer a streamed response and miss a client's disconnect).

- With an API key (serve --api-key), the /v1 routes answer 401 to a request without `Authorization: Bearer KEY`, as
  vLLM's --api-key does; /health, /metrics and the rest stay open (a load balancer's probe has no key), and so do
  CORS preflights (a browser sends them without credentials).
- Every response carries `x-request-id`: the client's own where it sent one, else a new one, as OpenAI's API does
  (its SDK exposes it as `request_id`).
"""

from __future__ import annotations

import hmac
import uuid
from collections.abc import Callable

REQUEST_ID = b"x-request-id"


class Access:
    def __init__(self, app, api_key: str | None, unauthorized: Callable[[], object]) -> None:
        """unauthorized: the response (an ASGI app) a request without the key gets."""
        self.app, self.unauthorized = app, unauthorized
        self.key = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])  # lower-cased names (ASGI)
        request_id = headers.get(REQUEST_ID) or uuid.uuid4().hex.encode()

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REQUEST_ID, request_id)]}
            await send(message)

        guarded = self.key is not None and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS"
        # compare_digest: the time a wrong key takes to refuse does not tell how much of it was right
        if guarded and not hmac.compare_digest(headers.get(b"authorization", b""), self.key):
            await self.unauthorized()(scope, receive, send_with_id)
            return
        await self.app(scope, receive, send_with_id)
