"""One error hierarchy: everything artcloud raises derives from `ArtcloudError`, as httpx's errors derive
from `HTTPError`, so `except artcloud.ArtcloudError` catches all of it and nothing else.

Each error has a stable `code` (a short snake_case string: match on it, not on the message) and, where the
fault lies in one argument or field, `field`. Errors about bad arguments also derive from the builtin that
plain Python would raise (`ValueError`, `TypeError`), so code written against either keeps working.
"""

from __future__ import annotations


class ArtcloudError(Exception):
    """An error answered by the server (`code`, `message`, `field`, `status`) or met on the way to it."""

    code: str = "error"

    def __init__(self, message: str, *, code: str | None = None, field: str | None = None, status: int | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code
        self.field = field
        self.status = status


class InvalidArgument(ArtcloudError, ValueError):
    """An argument artcloud cannot use; the message says what to pass instead."""

    code = "invalid_argument"


class WrongType(ArtcloudError, TypeError):
    """An argument of the wrong type; the message names the type expected."""

    code = "wrong_type"


class NotSupported(ArtcloudError, NotImplementedError):
    """Something artcloud does not do (an OpenPipe ART name it has no counterpart for, say); the message
    says what to write instead."""

    code = "not_supported"


class NotInArtcloud(ArtcloudError, AttributeError):
    """An OpenPipe ART name artcloud does not have (`art.dev`, `art.ServerlessBackend`...): still an
    AttributeError, as for any missing name, but one that says what to write instead."""

    code = "not_in_artcloud"


class WrongState(ArtcloudError, RuntimeError):
    """A call made at the wrong moment (a model not registered yet, a group whose rollouts have not run,
    a job that already ended); the message names what to call first."""

    code = "wrong_state"


class TimedOut(ArtcloudError, TimeoutError):
    """Something artcloud waited for (a server starting, a push) did not happen in time."""

    code = "timeout"


class MissingDependency(ArtcloudError):
    """An optional package is not installed here; the message names the pip extra that brings it."""

    code = "missing_dependency"


class APIError(ArtcloudError):
    """The server answered with an error status: `status`, and the `code`, `field` and message it gave. The
    statuses a caller handles apart have a class each below (as openai's and httpx's clients do); any other is
    this class, with `status` telling."""

    code = "api_error"


class BadRequest(APIError, ValueError):
    """400, 413 or 422: the server cannot use the request (its `field` says which part, its message why)."""

    code = "bad_request"


class Unauthorized(APIError, PermissionError):
    """401 or 403: the token is not this server's (a new launch has a new one)."""

    code = "unauthorized"


class NotFound(APIError, LookupError):
    """404: no such model, job, step or route on this server."""

    code = "not_found"


class Conflict(APIError):
    """409: the request clashes with the server's state (a model taken, the server shutting down, ...)."""

    code = "conflict"


class ModelLocked(Conflict):
    """409 model_locked: another client holds the model (its S3 claim); the message says whose and until when."""

    code = "model_locked"


class RateLimited(APIError):
    """429: too many jobs at once; retry later."""

    code = "rate_limited"


class Unavailable(APIError):
    """503: the server is not ready yet, or is shutting down."""

    code = "unavailable"


def api_error(status: int, message: str, *, code: str | None = None, field: str | None = None) -> APIError:
    """The error for an answer of `status` (its class by status, and by code where one has a class)."""
    if status == 409 and code == ModelLocked.code:
        cls: type[APIError] = ModelLocked
    else:
        cls = {400: BadRequest, 413: BadRequest, 422: BadRequest, 401: Unauthorized, 403: Unauthorized, 404: NotFound,
               409: Conflict, 429: RateLimited, 503: Unavailable}.get(status, APIError)
    return cls(message, code=code, field=field, status=status)


def first_line(text: object, limit: int = 200) -> str:
    """The first non-blank line of `text` (an exception's message, say), at most `limit` characters: a reason
    that fits in one line of a status, a log or another error's message."""
    line = str(text).strip().splitlines()[0] if str(text).strip() else ""
    return line if len(line) <= limit else line[:limit - 3] + "..."


def check_s3_url(s3: str | None, *, what: str = "s3") -> str | None:
    """`s3` as given when it is None or looks like s3://BUCKET/PREFIX; InvalidArgument (field `what`) otherwise."""
    if s3 is not None and not (s3.startswith("s3://") and len(s3) > 5):
        raise InvalidArgument(f"{what} must look like s3://BUCKET/PREFIX, not {s3!r}", field=what)
    return s3
