"""HTTP-level guards of `spd serve`, before a body is parsed: the request id, the API key and the
body size limit.

- `X-Request-Id`: a client's id (1-128 visible ASCII characters) is used and echoed; otherwise the
  server makes one. It names the request in the log and comes back on every answer.
- `--api-key` (or SPD_API_KEY): /v1 endpoints require `Authorization: Bearer KEY` (401 otherwise,
  in OpenAI's shape); /health and /metrics stay open for probes and scrapers.
- `--max-request-bytes`: a body over the limit is answered 413 before it is parsed: at once from its
  Content-Length, or as soon as a chunked body passes the limit. The rest of a body with an honest
  Content-Length (up to DISCARD_LIMIT) is read and dropped, so the client reads the 413 rather than
  a reset connection.
"""
from __future__ import annotations

import hmac
import json
import re
import uuid

from fastapi import Request

from spd_engine.server.openai_api import ApiError

DEFAULT_MAX_REQUEST_BYTES = 2 << 20
DISCARD_LIMIT = 64 << 20
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


def too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"the request body has {size}{'+' if size > limit else ''} bytes; this server takes at most "
                         f"{limit} (--max-request-bytes)", code="request_too_large")


async def _discard(request: Request, limit: int) -> None:
    seen = 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > limit:
            return


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or ApiError 413 once it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        if int(declared) <= DISCARD_LIMIT:
            await _discard(request, DISCARD_LIMIT)
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
