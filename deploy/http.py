"""What every route of the app shares: the error body, and reading a request body with a cap.

Kept apart from ``app.py`` because each HTTP API surface (ours, OpenAI's) raises the same
:class:`HTTPError` and reads bodies the same way, and none of them should import the deployment.
"""

from fastapi import Request
from fastapi.responses import JSONResponse

from deploy.schemas import ErrorResponse

MAX_ERRORS = 16  # a body with thousands of bad keys gets a bounded answer, not one line per key
MAX_MESSAGE_CHARS = 512
_TYPES = {404: "not_found_error", 503: "service_unavailable", 500: "server_error"}


class HTTPError(Exception):
    """An answer other than 200: ``errors`` are (field, message) pairs, message starting with the
    field; the first one is the headline."""

    def __init__(self, status: int, errors: list[tuple[str, str]], headers: dict | None = None):
        super().__init__(errors[0][1] if errors else str(status))
        self.status, self.errors, self.headers = status, errors, headers or {}

    def body(self) -> dict:
        errs = [(f[:MAX_MESSAGE_CHARS], m[:MAX_MESSAGE_CHARS]) for f, m in self.errors[:MAX_ERRORS]]
        field, detail = errs[0] if errs else ("body", f"body: HTTP {self.status}")
        kind = _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return ErrorResponse(
            error={"message": detail, "type": kind, "param": field, "code": self.status},
            detail=detail, field=field,
            errors=[{"field": f, "message": m} for f, m in errs]).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_responses(*statuses: int) -> dict:
    """OpenAPI ``responses`` for a route's error statuses."""
    return {s: {"model": ErrorResponse} for s in statuses or (400, 413, 422, 503)}


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past ``limit`` bytes (by Content-Length when sent, else while
    reading) and with 400 when empty."""
    too_big = HTTPError(413, [("body", f"body: larger than the limit of {limit} bytes (max_body_bytes)")])
    cl = request.headers.get("content-length")
    if cl is not None:
        try:
            if int(cl) > limit:
                raise too_big
        except ValueError:
            raise HTTPError(400, [("content-length", f"content-length: not an integer: {cl[:32]!r}")]) from None
    buf, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        buf.append(chunk)
    body = b"".join(buf)
    if not body.strip():
        raise HTTPError(400, [("body", "body: empty; send a JSON object")])
    return body
