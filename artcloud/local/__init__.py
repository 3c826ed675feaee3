"""OpenPipe ART's `art.local`: `from artcloud.local import LocalBackend` (ART's `from art.local import LocalBackend`).
The backend itself is artcloud.backends.local."""

from artcloud.backends.local import LocalBackend

__all__ = ["LocalBackend"]
