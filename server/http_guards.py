"""HTTP-level guards of `spd serve`, before a body is parsed: the request id, the API key, the
Host header, the content type and the body size limit; and the client's address, which bounds its
share of the tokenizer (server/tokenizing.py).

- `X-Request-Id`: a client's id (1-128 visible ASCII characters) is used and echoed; otherwise the
  server makes one. It names the request in the log and comes back on every answer.
- `--api-key` (or `--api-key-file`, or SPD_API_KEY): /v1 endpoints require `Authorization: Bearer
  KEY` (401 otherwise, in OpenAI's shape); /health and /metrics stay open for probes and scrapers.
- Without a key, the `Host` header must name the server by an IP address, `localhost` or a name
  of `--allowed-host` (400 otherwise): a web page whose own name an attacker points at 127.0.0.1
  (DNS rebinding) sends its name as Host, so a browser cannot reach a server without a key.
- A JSON body must say so (`Content-Type: application/json` or `...+json`; 415 otherwise): a
  browser sends text/plain or form bodies to another site without asking it first, JSON not.
- `--max-request-bytes`: a body over the limit is answered 413 before it is parsed: at once, with
  `Connection: close`, from its Content-Length, or as soon as a chunked body passes the limit. The
  connection then reads and drops what the client still sends for a moment before it closes
  (server/connections.py), so the client reads the 413 rather than a reset connection.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import re
import uuid

from fastapi import Request

from spd_engine.server.limits import DEFAULT_MAX_REQUEST_BYTES  # noqa: F401 - the limit's home for app.py
from spd_engine.server.openai_api import ApiError
from spd_engine.server.tokenizing import CLIENT

CLOSE = {"Connection": "close"}
REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")


def request_id(request: Request) -> str:
    given = request.headers.get("x-request-id", "")
    return given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


def check_api_key(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY' with this server's "
                            "--api-key", code="invalid_api_key")


def host_allowed(host_header: str, allowed: frozenset[str]) -> bool:
    """Whether a Host header names this server without a DNS name an attacker could point here:
    an IP address, `localhost`, or one of `allowed` (names given to --allowed-host)."""
    host = host_header.strip().lower()
    if host.startswith("["):  # [v6]:port
        name = host[1:host.find("]")] if "]" in host else ""
    else:
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    if not name:
        return False
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return name in ("localhost", "localhost.") or name in allowed


def check_host(request: Request, api_key: str | None, allowed: frozenset[str]) -> None:
    """ApiError 400 when no key is set and the Host header is not one that names this server."""
    if api_key is None and not host_allowed(request.headers.get("host", ""), allowed):
        raise ApiError(400, "the Host header does not name this server: without --api-key it must be an IP "
                            "address, localhost or a name given to --allowed-host", code="host_not_allowed")


def check_json_type(request: Request) -> None:
    """ApiError 415 unless the body says it is JSON."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise ApiError(415, f"the request body must be JSON with 'Content-Type: application/json', got "
                            f"{media or 'no content type'!r}", code="unsupported_media_type")


def too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"the request body has {size}{'+' if size > limit else ''} bytes; this server takes at most "
                         f"{limit} (--max-request-bytes)", code="request_too_large", headers=CLOSE)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or ApiError 413 (with Connection: close: the rest is not read) once it is known to
    exceed `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared), limit)
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(size, limit)
        parts.append(chunk)
    return b"".join(parts)


def parse_json(raw: bytes):
    """The JSON document of a body; ApiError 400 for anything else (not UTF-8, not JSON, nested
    beyond the parser's recursion limit)."""
    try:
        return json.loads(raw)
    except ValueError as err:  # not JSON, or not UTF-8
        raise ApiError(400, f"the request body is not valid JSON: {err}") from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON for this server: nested too deeply") from None


class ClientAddress:
    """ASGI middleware: the client's address in tokenizing.CLIENT while its request is handled (the
    handler runs in the task that sets it, so the value is the request's own)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            CLIENT.set((scope.get("client") or ("",))[0])
        await self.app(scope, receive, send)
