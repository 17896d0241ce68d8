"""Every HTTP error in OpenAI's shape, mapped in one place, and the request body read under a size cap.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

`api_error(exc)` turns anything a handler raised into an `APIError`: our own `APIError` as is; routing errors
(404 no such path, 405 wrong method) with their status; k3serve's typed errors by `errors.http_status` (what the
client sent is 400, the rest 500). `install_error_handlers` registers it for every exception type, so a bad
request never answers FastAPI's `{"detail": ...}` and a 4xx never drops the keep-alive connection.
`read_json_body` refuses a body over the cap (413) before it is parsed, a body that is not JSON, nests too deeply
or holds text that is not Unicode (a lone surrogate) with a 400, before anything is tokenized.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3serve.errors import K3Error, http_status, user_message

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20  # a 4,096-token prompt is ~30 KB as ids, at most a few hundred KB as escaped text
MAX_JSON_DEPTH = 32  # the deepest request OpenAI's schema allows is ~6 levels (messages -> content parts)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str | None = None,
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})  # e.g. Retry-After and x-ratelimit-* on a 429
        self.type = type_ or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


def error_response(error: APIError) -> JSONResponse:
    body = {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}
    headers = dict(getattr(error, "headers", None) or {})
    if getattr(error, "allow", None):
        headers["Allow"] = error.allow
    return JSONResponse(body, status_code=error.status, headers=headers or None)


def api_error(exc: BaseException) -> APIError:
    """The one mapping from an exception raised while serving a request to the error the client gets."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, StarletteHTTPException):
        if exc.status_code == 404:
            error = APIError(404, "no such endpoint; see /openapi.json for the routes this server has",
                             code="not_found")
        elif exc.status_code == 405:
            error = APIError(405, f"this endpoint does not take that method ({exc.detail})",
                             code="method_not_allowed")
            error.allow = (exc.headers or {}).get("Allow")  # type: ignore[attr-defined]
        else:
            error = APIError(exc.status_code, str(exc.detail))
        return error
    if isinstance(exc, RequestValidationError):  # a route that lets FastAPI validate its body
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return APIError(400, f"{first.get('msg', 'invalid request')} ({param})" if param else "invalid request",
                        param=param)
    status = http_status(exc)
    if status < 500:
        return APIError(status, user_message(exc))
    if isinstance(exc, K3Error):
        return APIError(status, user_message(exc), type_="server_error")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error")


def install_error_handlers(app: FastAPI, on_error: Callable[[], None] | None = None) -> None:
    """Answer every error in OpenAI's shape. A 5xx that is not ours is logged with its traceback."""

    async def handle(_: Request, exc: Exception) -> JSONResponse:
        error = api_error(exc)
        if error.status >= 500 and not isinstance(exc, (APIError, K3Error)):
            logger.error("unhandled error while serving a request", exc_info=exc)
        if on_error is not None:
            on_error()
        return error_response(error)

    # NOTE: specific types first: a handler for Exception runs outside the app and closes the connection,
    # the others answer in place and keep it alive.
    for kind in (APIError, StarletteHTTPException, RequestValidationError, K3Error, RecursionError, UnicodeError,
                 Exception):
        app.add_exception_handler(kind, handle)


async def read_json_body(request: Request, max_bytes: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """The request's JSON object, read under `max_bytes` and checked for depth and Unicode before any use."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"the request body has {int(declared)} bytes; this server takes at most {max_bytes}",
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"the request body is over {max_bytes} bytes, the most this server takes",
                           code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_json_values(data)
    return data


def check_json_values(data: Any) -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH and strings that are not Unicode text (a lone surrogate, which
    JSON's \\uD800 escape can spell but UTF-8 cannot encode), naming where. Iterative: no recursion limit."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", param=where or None)
        if isinstance(value, str):
            _check_text(value, where)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, where)
                stack.append((item, f"{where}.{key}" if where else key, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{where}.{index}", depth + 1) for index, item in enumerate(value))


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(400, f"{where or 'the request body'}: text is not valid Unicode at character {exc.start} "
                            f"(U+{ord(text[exc.start]):04X}, a lone surrogate)", param=where or None) from None
