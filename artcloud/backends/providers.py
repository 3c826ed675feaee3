"""What `artcloud status / logs / down` ask of a provider about a sandbox this machine launched.

Each provider answers three questions about a registry record (backends/state.py): is it alive (its
status, or None when gone), tear it down (False if nothing was left), and its output. SkyPilot's answers
go through the one SkyPilot seam (sky_api.py); Modal's through the modal client. Both import lazily.
"""

from __future__ import annotations

from typing import Iterator, Protocol

from artcloud.backends.state import SandboxRecord
from artcloud.errors import InvalidArgument


class Sandboxes(Protocol):
    def status(self, record: SandboxRecord) -> str | None: ...

    def down(self, record: SandboxRecord) -> bool: ...

    def logs(self, record: SandboxRecord, *, follow: bool = False, tail: int = 0) -> Iterator[str]: ...


class SkySandboxes:
    def __init__(self) -> None:
        from artcloud.backends.sky_api import sky_api

        self.api = sky_api()

    def status(self, record: SandboxRecord) -> str | None:
        info = self.api.status(record.name, refresh=True)  # the registry marks it down on None: not from a cache
        return None if info is None else info.status

    def down(self, record: SandboxRecord) -> bool:
        return self.api.down(record.name)

    def logs(self, record: SandboxRecord, *, follow: bool = False, tail: int = 0) -> Iterator[str]:
        return self.api.logs(record.name, follow=follow, tail=tail)


def sandboxes(provider: str) -> Sandboxes:
    if provider == "sky":
        return SkySandboxes()
    if provider == "modal":
        from artcloud.backends.modal import ModalSandboxes

        return ModalSandboxes()
    raise InvalidArgument(f"unknown provider {provider!r} in the state registry")
