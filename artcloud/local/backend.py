"""OpenPipe ART's `art.local.backend`, for scripts that import LocalBackend from there."""

from artcloud.backends.local import LocalBackend

__all__ = ["LocalBackend"]
