"""A provider's face on one sandbox of the registry (backends/state.py): is it alive, its output, tear it down.

The same object answers SkyBackend or ModalBackend (their `provisioner`: teardown and the output an error message
quotes) and `artcloud status / logs / down` (`provisioner(record.provider)`), so a sandbox is asked about one way
whoever asks. Launching is the backend's (sandbox.py): it alone holds the spec, the credentials and the progress.
Blocking calls (async code runs them in a thread); each provider's SDK is imported lazily.
"""

from __future__ import annotations

from typing import Iterator, Protocol

from artcloud.backends.state import SandboxRecord
from artcloud.errors import InvalidArgument


class Provisioner(Protocol):
    def status(self, record: SandboxRecord) -> str | None:
        """The provider's status of it (RUNNING, UP, STOPPED, ...), or None when it is gone."""

    def destroy(self, record: SandboxRecord) -> bool:
        """Tear it down; False when nothing of it was left."""

    def logs(self, record: SandboxRecord, *, follow: bool = False, tail: int = 0) -> Iterator[str]:
        """Its output, line by line (the last `tail` lines; 0: all), following new lines if asked."""


def provisioner(provider: str) -> Provisioner:
    if provider == "sky":
        from artcloud.backends.sky import SkyProvisioner

        return SkyProvisioner()
    if provider == "modal":
        from artcloud.backends.modal import ModalProvisioner

        return ModalProvisioner()
    raise InvalidArgument(f"unknown provider {provider!r} in the state registry")
