"""What this machine has launched: the local state registry (~/.artcloud, or $ARTCLOUD_HOME).

One folder per sandbox under `sandboxes/NAME/`: `sandbox.json` (provider, URL, GPU, price, when), and the
launch's CA certificate and bearer token, the token in a 0600 file. A record is written *before* the
provider is asked for a machine, so that a laptop that dies mid-launch still leaves a name that
`artcloud status` shows and `artcloud down` tears down. `artcloud down` keeps the record, marked down and
without credentials, so that downing a name twice is not an error; `artcloud status` forgets it after 30 days.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from artcloud.errors import InvalidArgument

ENV_HOME = "ARTCLOUD_HOME"
# SkyPilot's rule is [a-zA-Z]([-_.a-zA-Z0-9]*[a-zA-Z0-9])? (sky/skylet/constants.py CLUSTER_NAME_VALID_REGEX), Modal's
# for a sandbox [a-zA-Z0-9-_.]{1,64} (modal/_utils/name_utils.py): this is stricter than both, and a DNS label.
_NAME = re.compile(r"^[a-z](?:[a-z0-9-]{0,61}[a-z0-9])?$")


def state_root() -> Path:
    return Path(os.environ.get(ENV_HOME) or Path.home() / ".artcloud").expanduser()


def check_name(name: str) -> str:
    """Cluster names as every provider accepts them: lower case, digits and dashes, a letter first, no dash last.
    Checked before anything is built or launched."""
    if not _NAME.fullmatch(name):
        raise InvalidArgument(f"sandbox name {name!r} must start with a letter, end with a letter or digit and hold only "
                         "a-z, 0-9 and '-' (63 at most), e.g. 'mail-agent-1'")
    return name


@dataclass
class SandboxRecord:
    name: str
    provider: str  # "sky" or "modal"
    launched_at: float = field(default_factory=time.time)
    url: str | None = None  # https://host:port once known
    gpu: str | None = None
    cloud: str | None = None
    price_per_hour: float | None = None  # dollars, when the provider's catalog knows it
    state: str = "launching"  # launching, up, down
    ended_at: float | None = None  # when it went down
    max_duration_s: float | None = None
    idle_minutes: int | None = None
    s3: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # provider-specific (e.g. a Modal sandbox id)
    launcher: dict[str, Any] | None = None  # {"host", "pid"} of the process launching it (see launching_now)

    def age_s(self, now: float | None = None) -> float:
        end = self.ended_at or now or time.time()
        return max(0.0, end - self.launched_at)

    def cost_so_far(self, now: float | None = None) -> float | None:
        if self.price_per_hour is None:
            return None
        return self.price_per_hour * self.age_s(now) / 3600.0


def launcher() -> dict[str, Any]:
    """This process, as a record's `launcher`."""
    return {"host": socket.gethostname(), "pid": os.getpid()}


def launching_now(record: SandboxRecord) -> bool:
    """Whether a process of this machine is launching `record` right now. Until its launch is done the provider
    may not know the sandbox yet (the registry is written first): that is a launch in progress, not a sandbox that
    went away. A launcher that died mid-launch leaves a record that is not."""
    who = record.launcher
    if record.state != "launching" or not isinstance(who, dict) or who.get("host") != socket.gethostname():
        return False
    pid = who.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    return True


class StateDir:
    """The registry. Safe to share between processes: every write is a rename of a whole file from a temporary
    file of its own, and a read-modify-write (mark_down) holds the sandbox's lock file."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else state_root()

    def _dir(self, name: str) -> Path:
        return self.root / "sandboxes" / check_name(name)

    def save(self, record: SandboxRecord, *, ca_cert: str | None = None, token: str | None = None) -> None:
        folder = self._dir(record.name)
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(folder, 0o700)
        if ca_cert is not None:
            _write(folder / "ca.pem", ca_cert, 0o644)
        if token is not None:
            _write(folder / "token", token, 0o600)
        _write(folder / "sandbox.json", json.dumps(asdict(record), indent=2), 0o644)

    def load(self, name: str) -> SandboxRecord | None:
        try:
            data = json.loads((self._dir(name) / "sandbox.json").read_text())
        except (OSError, ValueError):
            return None
        known = {k: v for k, v in data.items() if k in SandboxRecord.__dataclass_fields__}
        return SandboxRecord(**known)

    def credentials(self, name: str) -> tuple[str, str] | None:
        """(CA certificate PEM, token) of a sandbox, or None if they are not here."""
        folder = self._dir(name)
        try:
            return (folder / "ca.pem").read_text(), (folder / "token").read_text().strip()
        except OSError:
            return None

    def all(self) -> list[SandboxRecord]:
        folder = self.root / "sandboxes"
        records = [self.load(p.name) for p in sorted(folder.iterdir())] if folder.is_dir() else []
        return sorted((r for r in records if r is not None), key=lambda r: r.launched_at)

    def mark_down(self, name: str) -> None:
        """Keep the record (so a second `artcloud down NAME` knows the name and succeeds) but drop its
        credentials: the sandbox is gone."""
        with self._locked(name):
            record = self.load(name)
            if record is None:
                return
            for secret in ("token", "ca.pem"):
                (self._dir(name) / secret).unlink(missing_ok=True)
            record.state, record.ended_at = "down", record.ended_at or time.time()
            self.save(record)

    @contextlib.contextmanager
    def _locked(self, name: str):
        """An exclusive lock on one sandbox's record, between processes (flock; none where there is no fcntl)."""
        folder = self._dir(name)
        if not folder.is_dir():
            yield
            return
        try:
            import fcntl
        except ImportError:  # Windows: renames stay atomic, the read-modify-write is not locked
            yield
            return
        with open(folder / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def live(self) -> list[SandboxRecord]:
        return [r for r in self.all() if r.state != "down"]

    def prune(self, older_than_s: float = 30 * 86400.0) -> None:
        """Forget sandboxes that went down more than `older_than_s` ago."""
        now = time.time()
        for record in self.all():
            if record.state == "down" and now - (record.ended_at or record.launched_at) > older_than_s:
                self.remove(record.name)

    def remove(self, name: str) -> None:
        shutil.rmtree(self._dir(name), ignore_errors=True)


def _write(path: Path, text: str, mode: int) -> None:
    """Replace `path` whole: a temporary file of this write's own (two writers never share one), then a rename."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
