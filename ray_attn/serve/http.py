"""What every route of the app shares: the error body, and reading a request body with a cap and a
deadline.

Kept apart from ``app.py`` because each HTTP API surface (ours, OpenAI's) raises the same
:class:`HTTPError` and reads bodies the same way, and none of them should import the deployment.
FastAPI's and Starlette's own errors (404, 405, 422, 500) are answered in the same body through
:func:`install_error_handlers`.
"""

import asyncio
import json
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ray_attn.serve.loop import QueueFull
from ray_attn.serve.schemas import ErrorResponse, field_name

MAX_ERRORS = 16  # a body with thousands of bad keys gets a bounded answer, not one line per key
MAX_MESSAGE_CHARS = 512
MAX_FIELD_CHARS = 128
# The `errors` list as JSON, at most: whatever the client sent (10,000 unknown keys, key names of
# control characters that JSON writes as \uXXXX), the whole error body stays under 8 KB.
MAX_ERRORS_BYTES = 4096
DEFAULT_BODY_TIMEOUT_S = 30.0  # ServeAppConfig.body_timeout_s's default, for a caller that names none
_TYPES = {404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable", 500: "server_error"}


def _clip(text: str, max_chars: int) -> str:
    """``text`` cut to ``max_chars`` characters whose JSON takes at most ``max_chars`` bytes."""
    text = text[:max_chars]
    while len(json.dumps(text, ensure_ascii=False).encode()) > max_chars + 2:
        text = text[:len(text) * 3 // 4]
    return text


class HTTPError(Exception):
    """An answer other than 200: ``errors`` are (field, message) pairs, message starting with the
    field; the first one is the headline."""

    def __init__(self, status: int, errors: list[tuple[str, str]], headers: dict | None = None):
        super().__init__(errors[0][1] if errors else str(status))
        self.status, self.errors, self.headers = status, errors, headers or {}

    def body(self) -> dict:
        errs, size = [], 0
        for f, m in self.errors[:MAX_ERRORS]:
            f, m = _clip(f, MAX_FIELD_CHARS), _clip(m, MAX_MESSAGE_CHARS)
            size += len(json.dumps([f, m], ensure_ascii=False).encode()) + 24  # + the two keys
            if errs and size > MAX_ERRORS_BYTES:
                break
            errs.append((f, m))
        field, detail = errs[0] if errs else ("body", f"body: HTTP {self.status}")
        kind = _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return ErrorResponse(
            error={"message": detail, "type": kind, "param": field, "code": self.status},
            detail=detail, field=field,
            errors=[{"field": f, "message": m} for f, m in errs]).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def not_taken(e: Exception, retry: dict) -> HTTPError:
    """503 + Retry-After for a request the engine loop refused at submit (``QueueFull``: the replica
    is full; otherwise ``LoopDead``: its engine is gone).  Both are the server's state, not the
    request's: the client may retry, here later or on another replica."""
    if isinstance(e, QueueFull):
        return HTTPError(503, [("queue", f"queue: replica is at capacity ({e}); retry later")], retry)
    return HTTPError(503, [("replica", f"replica: unavailable ({e}); retry later")], retry)


def request_failed(error, retry: dict) -> HTTPError:
    """503 + Retry-After for a request the engine accepted and then failed (a rank or the engine
    died under it): a server-side failure the client may retry."""
    return HTTPError(503, [("replica", f"replica: request failed: {error}")], retry)


def error_responses(*statuses: int) -> dict:
    """OpenAPI ``responses`` for a route's error statuses."""
    return {s: {"model": ErrorResponse} for s in statuses or (400, 408, 413, 422, 429, 503)}


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The body, refused with 413 past ``limit`` bytes (by Content-Length when sent, else while
    reading), with 400 when empty, and with 408 when it has not all arrived ``timeout_s`` seconds
    after reading began.  ``timeout_s`` defaults to the ``body_timeout_s`` that the admission
    middleware (``ray_attn/serve/admission.py``) puts in the request's state: a client that sends its
    headers and then stalls must not hold its connection slot for as long as it likes."""
    if timeout_s is None:
        timeout_s = getattr(request.state, "body_timeout_s", DEFAULT_BODY_TIMEOUT_S)
    too_big = HTTPError(413, [("body", f"body: larger than the limit of {limit} bytes (max_body_bytes)")])
    cl = request.headers.get("content-length")
    if cl is not None:
        try:
            if int(cl) > limit:
                raise too_big
        except ValueError:
            raise HTTPError(400, [("content-length", f"content-length: not an integer: {cl[:32]!r}")]) from None
    buf, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_big
                buf.append(chunk)
    except TimeoutError:
        # Connection: close -- the rest of the body may still come, and it must not be read as
        # the next request on this connection.
        raise HTTPError(408, [("body", f"body: not received in full within {timeout_s:g}s "
                                       f"(body_timeout_s); {size} bytes arrived")],
                        {"Connection": "close"}) from None
    except ClientDisconnect:
        raise HTTPError(400, [("body", "body: the client disconnected before sending all of it")]) from None
    body = b"".join(buf)
    if not body.strip():
        raise HTTPError(400, [("body", "body: empty; send a JSON object")])
    return body


# ------------------------------------------------------------------- FastAPI's and Starlette's own
def _starlette_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    path = request.url.path
    if exc.status_code == 404:
        errors = [("path", f"path: {path} does not exist (see /docs for the routes)")]
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        errors = [("method", f"method: {request.method} is not allowed on {path} (allowed: {allowed})")]
    else:
        reason = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        errors = [("request", f"request: {reason}")]
    return HTTPError(exc.status_code, errors, dict(exc.headers or {})).response()


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = []
    for e in exc.errors()[:MAX_ERRORS]:
        field = field_name(tuple(e.get("loc", ())))
        errors.append((field, f"{field}: {e.get('msg', 'invalid')}"))
    return HTTPError(422, errors).response()


def server_error(exc: Exception) -> HTTPError:
    # No exception text: it may hold internals (a header, a path).  The traceback goes to the log.
    return HTTPError(500, [("server", f"server: internal error ({type(exc).__name__}); "
                                      f"see the replica's log")])


def _server_error(request: Request, exc: Exception) -> JSONResponse:
    # Starlette logs the traceback after this answer.
    return server_error(exc).response()


def install_error_handlers(app: FastAPI) -> None:
    """Answer FastAPI's and Starlette's own errors (unknown path, wrong method, a FastAPI-validated
    parameter, an unhandled exception) in the same error body as every other route."""
    app.add_exception_handler(StarletteHTTPException, _starlette_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _server_error)
