"""Errors the server returns: JSON `{"error": {"code", "message", "field"}}` with a stable `code`.

4xx means the request was at fault (and `field` names the part, e.g. `groups[0].trajectories[1].reward`);
a 5xx is a bug in artcloud.
"""

from __future__ import annotations

from typing import Any

from starlette.exceptions import HTTPException

from artcloud.wire import ErrorBody


class ApiError(HTTPException):
    """An HTTPException, so that FastAPI passes it through untouched even from inside its body reader
    (the body size limit raises it there); the app's handler renders `body()`."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None):
        super().__init__(status, message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message, "type": _TYPES.get(self.status, "error")}
        if self.field is not None:
            error["field"] = self.field
            error["param"] = self.field  # where OpenAI clients look for it
        return {"error": error}


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 409: "conflict_error",
          413: "invalid_request_error", 429: "rate_limit_error", 422: "invalid_request_error", 503: "unavailable_error"}


def field_path(loc: tuple[Any, ...] | list[Any]) -> str:
    """('body', 'groups', 0, 'trajectories', 1, 'reward') -> 'groups[0].trajectories[1].reward'."""
    out = ""
    for part in loc:
        if part in ("body", "query", "path", "header") and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part in ("choice", "message") and out.endswith("]"):
            continue  # the discriminated-union tag pydantic adds: not a field the user wrote
        else:
            out += ("." if out else "") + str(part)
    return out


# OpenAPI: what each error status of a route means.
_ERRORS = {
    400: "the request is invalid: `field` names the part at fault",
    401: "no bearer token, or the wrong one",
    404: "no such model, step, job or route",
    408: "the request body took too long to arrive",
    409: "conflicts with the server's state (a model registered differently, a server shutting down, a limit)",
    413: "the request body is over artcloud serve --max-body-mb",
    429: "too much waiting: training jobs for this model (artcloud serve --max-queued-jobs), or samples for its "
         "engine (--max-queued-samples)",
    503: "the server is still loading its models (GET /health says ready), or its sampler process restarts",
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for these error statuses, all shaped as ErrorBody."""
    return {code: {"model": ErrorBody, "description": _ERRORS[code]} for code in codes}
