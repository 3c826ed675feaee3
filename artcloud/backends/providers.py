"""A provider's one face: everything artcloud asks of SkyPilot, Modal or this machine about a sandbox.

The same class answers `artcloud status / logs / down` (cli/cloud.py's `provisioner(record.provider)`: status,
destroy and logs of any sandbox in the registry) and the backend that launched or attached to one sandbox
(sandbox.py: it holds a provisioner made for that sandbox's name and spec, and asks it to launch, where the server
answers, whether the machine lives, and to tear it down). The lifecycle around those questions (attach or launch, the ready poll,
failures, down, replacing a lost machine) is written once, in sandbox.py; a provider writes only its answers.
Each provider's SDK is imported lazily; the registry-face calls block (async code runs them in a thread).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, NamedTuple

from artcloud.backends.state import SandboxRecord
from artcloud.errors import ArtcloudError, first_line


class Credentials(NamedTuple):
    """What a launch (or an attach) gives the client: the server's token, and the CA to trust (None: keep the
    backend's, e.g. the public CAs of Modal's edge). The URL comes later, from `endpoint`."""

    token: str
    ca: str | None = None


# claim(record, ca_cert, token): a launch calls it just before it asks the provider for anything that bills.
Claim = Callable[[SandboxRecord | None, str | None, str], None]


class Provisioner:
    """A provider's answers about sandboxes. The registry face (status, destroy, logs) takes any record; the rest
    is about the one sandbox this provisioner was made for (`name`)."""

    name = ""  # the sandbox's name (`artcloud status / logs / down` know it by it)
    error: type[ArtcloudError] = ArtcloudError  # the class its failures are raised as
    launched_by = ""  # who could not launch it, in a failed launch's message ("SkyPilot ")
    teardown_word = "torn down"
    price_per_hour: float | None = None  # dollars, where the provider's catalog says
    poll_s = (0.5, 5.0)  # the ready poll's first and longest wait

    # ------------------------------------------------------------------------------------- any sandbox of the registry

    def status(self, record: SandboxRecord) -> str | None:
        """The provider's status of it (RUNNING, UP, STOPPED, ...), or None when it is gone."""
        raise NotImplementedError

    def destroy(self, record: SandboxRecord) -> bool:
        """Tear it down; False when nothing of it was left."""
        raise NotImplementedError

    def logs(self, record: SandboxRecord, *, follow: bool = False, tail: int = 0) -> Iterator[str]:
        """Its output, line by line (the last `tail` lines; 0: all), following new lines if asked."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------- this sandbox

    def holds(self) -> bool:
        """Whether the sandbox it launched or attached to may still be there (False: it is known to have ended, so
        the backend's next start launches anew)."""
        return True

    async def existing(self, record: SandboxRecord | None) -> bool:
        """A live sandbox of this name to attach to? (Raise if the name is someone else's.)"""
        return False

    async def adopt(self, record: SandboxRecord, creds: tuple[str, str]) -> Credentials:
        """Take over an attached sandbox: its credentials as the client should use them."""
        return Credentials(token=creds[1], ca=creds[0])

    async def launch(self, job: Any, *, preload: str | None, deadline: float, claim: Claim) -> Credentials:
        """Create the machine and start the server on it (or a detached `job`, with its arguments), calling
        `claim` just before the provider is asked for anything that bills; returns once the provider has it."""
        raise NotImplementedError

    async def endpoint(self, deadline: float) -> str | None:
        """The server's https:// URL once known, else None (raise to fail fast)."""
        raise NotImplementedError

    async def alive(self, *, answered: bool) -> None:
        """Raise ServerGone when the machine or its server is known dead (`answered`: its server answered once)."""

    async def job_started(self, deadline: float) -> None:
        """A detached job was launched: return once it runs (its install done), raise if it failed before.
        Most providers start the command itself: nothing to wait for."""

    async def lost(self, cause: BaseException) -> bool:
        """Whether `cause` means the machine itself is gone (so a new one should take its place)."""
        return False

    async def node_lost(self) -> str | None:
        """Why a node of a multi-node machine is lost while its head may serve on (nothing fails at the transport
        then), or None."""
        return None

    async def going(self) -> bool:
        """Whether the server announced its end (a cloud's preemption notice): it pushes its last checkpoints,
        closes its port, then exits."""
        return False

    async def gone(self, *, ours: bool) -> bool:
        """True once nothing of the sandbox is left (`ours`: this machine launched it, so a dead one may be reaped)."""
        raise NotImplementedError

    async def teardown(self, *, exiting: bool) -> None:
        """Tear this sandbox down, idempotently (`exiting`: its server was asked to exit and is on its way)."""
        raise NotImplementedError

    async def last_lines(self, lines: int) -> list[str]:
        """What the server printed last, for an error message."""
        return []

    def failure(self, cause: BaseException, launching: bool) -> tuple[str, str]:
        """(message, code) for a failed start whose cause is not already an ArtcloudError."""
        what = f"{type(cause).__name__}: {first_line(cause)}".rstrip(": ")
        if launching:
            return f"{self.launched_by}could not launch {self.name}: {what}", "launch_failed"
        return f"the server on {self.name} did not come up: {what}", "startup_failed"

    def not_ready(self, url: str | None, startup_timeout: str) -> ArtcloudError:
        """The error when the server was not ready by the start's deadline."""
        return self.error(f"the server on {self.name} was not ready in time (startup_timeout {startup_timeout}): raise "
                          f"startup_timeout if the model is big, or see `artcloud logs {self.name}`", code="startup_timeout")

