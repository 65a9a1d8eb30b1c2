"""Who may call the API, and the request id every response carries: an ASGI middleware, not a FastAPI one (those
buffer a streamed response and miss a client's disconnect).

- With an API key (serve --api-key), the /v1 routes answer 401 to a request without `Authorization: Bearer KEY`, as
  vLLM's --api-key does, and so do /tokenize and /detokenize, which vLLM leaves open: they run the tokenizer (and a
  trusted request's own chat template) on whatever a client sends, which without the key stalled a keyed server and
  grew it by gigabytes. /health, /metrics and /version stay open (a load balancer's probe has no key), and so do CORS
  preflights (a browser sends them without credentials).
- A server on a loopback address answers only requests whose Host header names a loopback host (localhost,
  127.0.0.1, ::1) or one it was told to serve as (serve --allowed-host): a web page whose name an attacker's DNS
  turns into 127.0.0.1 after it loads (DNS rebinding) is of that same origin, and could otherwise read from it.
- Every response carries `x-request-id`: the client's own where it sent one, else a new one, as OpenAI's API does
  (its SDK exposes it as `request_id`).
"""

from __future__ import annotations

import hmac
import ipaddress
import uuid
from collections.abc import Callable

REQUEST_ID = b"x-request-id"
GUARDED_ROUTES = ("/tokenize", "/detokenize")  # beside every /v1 one


def is_loopback(host: str) -> bool:
    """Whether a host name or address (no port) is this machine's loopback: localhost, *.localhost, 127/8, ::1."""
    host = host.lower().strip("[]").rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """A Host header's host, less its port, in lower case and without a root's trailing dot: "[::1]:8000" -> "::1",
    "Example.com.:80" -> "example.com"."""
    if header.startswith("["):
        host = header[1:].partition("]")[0]
    else:
        host = header.rpartition(":")[0] if header.count(":") == 1 else header
    return host.lower().rstrip(".")


class Access:
    def __init__(self, app, api_key: str | None, unauthorized: Callable[[], object],
                 misdirected: Callable[[str], object], hosts: tuple[str, ...] | None = ()) -> None:
        """unauthorized: the response (an ASGI app) a request without the key gets; misdirected(host): the one a
        request for a host not served gets. hosts: the names served beside loopback ones, as Host headers or names
        ("*": any; None: any, for a server on an address other hosts reach)."""
        self.app, self.unauthorized, self.misdirected = app, unauthorized, misdirected
        self.key = api_key.strip().encode() if api_key and api_key.strip() else None  # as a header's is read
        self.hosts = None if hosts is None or "*" in hosts else {host_name(h) for h in hosts}

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

        if self.hosts is not None and b"host" in headers:  # (HTTP/1.0 may send none: not a browser's)
            host = host_name(headers[b"host"].decode("latin-1"))
            if not (is_loopback(host) or host in self.hosts):
                await self.misdirected(host)(scope, receive, send_with_id)
                return
        path = scope["path"]
        guarded = (self.key is not None and (path.startswith("/v1") or path.rstrip("/") in GUARDED_ROUTES)
                   and scope["method"] != "OPTIONS")
        # the scheme in any case (RFC 9110's auth-scheme); compare_digest: the time a wrong key takes to refuse does not
        # tell how much of it was right
        scheme, _, key = headers.get(b"authorization", b"").strip().partition(b" ")
        if guarded and not (scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self.key)):
            await self.unauthorized()(scope, receive, send_with_id)
            return
        await self.app(scope, receive, send_with_id)
