"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

Every failure the server reports goes through `APIError`, so no body ever carries a traceback, a
file path or a pydantic dump. Knows nothing of the engine.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}


class APIError(Exception):
    """A request failed; `status_code` and `message` go to the client verbatim."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        error_type = _ERROR_TYPES.get(self.status_code, "invalid_request_error")
        return {"error": {"message": self.message, "type": error_type, "param": self.param,
                          "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def from_http_status(status_code: int) -> APIError:
    """For Starlette's own errors (unknown route, wrong method): the status phrase, no detail."""
    try:
        phrase = HTTPStatus(status_code).phrase
    except ValueError:
        return APIError(status_code, "error")
    return APIError(status_code, phrase, code=phrase.lower().replace(" ", "_"))


def from_validation_error(error: ValidationError) -> APIError:
    """The first pydantic error as one line; `param` is the top-level field it concerns."""
    first = error.errors(include_url=False, include_input=False)[0]
    loc = [str(part) for part in first["loc"]]
    message = first["msg"].removeprefix("Value error, ")
    if loc:
        message = f"{'.'.join(loc)}: {message}"
    return bad_request(message, param=loc[0] if loc else None)


def add_exception_handlers(app: FastAPI) -> None:
    """Every error `app` answers becomes an OpenAI-style body: ours, Starlette's (unknown route,
    wrong method), FastAPI's parameter validation, and anything unexpected (a 500 without
    detail; the traceback goes to the log)."""

    async def on_api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    async def on_http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return from_http_status(error.status_code).response(error.headers)

    async def on_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query")]
        return bad_request(f"{'.'.join(loc)}: {first.get('msg', 'invalid request')}",
                           loc[0] if loc else None).response()

    async def on_unexpected_error(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error serving %s", request.url.path)
        return APIError(500, "internal server error", code="internal_error").response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_unexpected_error)
