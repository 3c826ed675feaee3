"""The server's dependencies, resolved once per artcloud version and shipped in the wheel (`make lock`).

A sandbox installs `artcloud[EXTRAS]` with the lock of those extras as constraints (`uv pip install -c LOCK`):
every sandbox of one artcloud version gets the same torch, vLLM and transformers, whatever PyPI released
since, and the resolver has nothing left to choose. An image's dependency layer (Modal, launchers/Dockerfile)
is the lock alone, so it stays cached until the lock changes, not at every code change.

One lock per extra a server is installed with, both made by `uv pip compile --universal` (markers for every
platform): gpu (Python 3.11+: vLLM 0.32 needs it) and server (the CPU engine, Python 3.10+). The lock of
extras "a,b" is `locks/a,b.txt` (names sorted): the setup of sky/artcloud-server.yaml finds it by that rule
without importing artcloud, whose dependencies are not installed yet at that point.
"""

from __future__ import annotations

import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from artcloud._version import __version__
from artcloud.errors import ArtcloudError, InvalidArgument

HERE = Path(__file__).resolve().parent
HEADER = "# artcloud {version} lock for extras: {name}"  # the first line of every lock (`make lock` writes it)
# The Pythons each lock serves: from the version `make lock` resolves it for (vLLM 0.32 needs 3.11) to the newest
# one whose wheels it has (gpu: vLLM 0.32's flashinfer pins cuda-python 12.6.2.post1, which has no cp313 wheel:
# found by the stand-in node's real resolution). A sandbox's setup makes its venv from the image's python3 when
# it is one of these, else from a CPython that uv installs (sky/artcloud-server.yaml, ARTCLOUD_PYTHON): Ubuntu
# 22.04, the default GPU image on GCP, has 3.10; 24.10 and later, 3.13.
PYTHONS = {"gpu": ">=3.11,<3.13", "server": ">=3.10,<3.14"}
_EXTRA = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
# what `uv pip compile` writes: NAME==VERSION, optionally ` ; MARKER`; comments and `    # via` lines between
_PIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.+!_-]+(?: ; \S.*)?")


class NoLock(ArtcloudError):
    """This artcloud ships no lock for the extras asked for, or the lock is damaged."""

    code = "no_lock"


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    marker: str  # "" when the pin holds everywhere


def lock_name(extras: str | Iterable[str]) -> str:
    """The lock's name for extras given as 'gpu', 'gpu,s3' or ['gpu']: normalized names, sorted, comma-joined."""
    parts = extras.split(",") if isinstance(extras, str) else list(extras)
    if not all(isinstance(p, str) for p in parts):
        raise InvalidArgument(f"extras {extras!r}: give extra names as strings, e.g. 'gpu' or ['gpu']", field="extras")
    names = sorted({re.sub(r"[-_.]+", "-", p.strip().lower()) for p in parts})
    if not names or not all(_EXTRA.fullmatch(n) for n in names):
        raise InvalidArgument(f"extras {extras!r} is not a list of extra names: write them separated by commas, "
                              f"e.g. 'gpu' (locks: {', '.join(available()) or 'none'})", field="extras")
    return ",".join(names)


def available(folder: Path = HERE) -> list[str]:
    """The extras this artcloud ships locks for."""
    return sorted(p.stem for p in folder.glob("*.txt"))


def python_request(extras: str | Iterable[str]) -> str:
    """The Python versions the lock of `extras` serves, as uv takes them (e.g. '>=3.11,<3.13'). Extras without a
    lock of their own get the strictest range (gpu's): their install resolves anew (ARTCLOUD_LOCK=0), vLLM and all."""
    return PYTHONS.get(lock_name(extras), PYTHONS["gpu"])


def python_near(extras: str | Iterable[str], version: tuple[int, int]) -> str:
    """The Python the lock of `extras` serves that is nearest `version` (e.g. the laptop's): an image's Python
    (Modal's debian_slim takes any), 'X.Y'."""
    bounds = dict(re.findall(r"(>=|<)(\d+\.\d+)", python_request(extras)))
    low = tuple(int(p) for p in bounds[">="].split("."))
    below = tuple(int(p) for p in bounds["<"].split("."))
    return "%d.%d" % max(low, min(tuple(version[:2]), (below[0], below[1] - 1)))


def lock_path(extras: str | Iterable[str]) -> Path:
    """The lock file of `extras` in this package; NoLock, naming the locks there are, if it ships none."""
    name = lock_name(extras)
    path = HERE / f"{name}.txt"
    if not path.is_file():
        raise NoLock(f"artcloud {__version__} ships no lock for the extras {name!r}: it has locks for "
                     f"{', '.join(available()) or 'no extras'}; install with one of those (gpu includes server and "
                     "s3), or add the extras to the Makefile's `lock` target and run `make lock`",
                     code="no_lock", field="extras")
    return path


def lock_from_wheel(wheel: Path, extras: str | Iterable[str]) -> str:
    """The text of the lock of `extras` inside a wheel of artcloud (what the sandbox will install from)."""
    name = lock_name(extras)
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        entry = f"artcloud/locks/{name}.txt"
        if entry not in names:
            shipped = sorted(n[len("artcloud/locks/"):-4] for n in names
                             if n.startswith("artcloud/locks/") and n.endswith(".txt"))
            raise NoLock(f"{wheel.name} ships no lock for the extras {name!r} (it has: {', '.join(shipped) or 'none'}"
                         "): build the wheel from an artcloud with one (`make lock`), or use extras it has a lock for",
                         code="no_lock", field="extras")
        return zf.read(entry).decode()


def read_lock(text: str, *, where: str = "the lock") -> tuple[str, str, list[Pin]]:
    """(artcloud version, extras, pins) of a lock's text; NoLock with the first bad line if it is damaged."""
    lines = text.splitlines()
    head = re.fullmatch(HEADER.format(version=r"(\S+)", name=r"(\S+)"), lines[0]) if lines else None
    if head is None:
        raise NoLock(f"{where} does not start with {HEADER.format(version='VERSION', name='EXTRAS')!r}: it is damaged "
                     "or not an artcloud lock; regenerate it with `make lock`", code="lock_damaged")
    pins = []
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not _PIN.fullmatch(line):
            raise NoLock(f"{where} is damaged at line {number} ({line[:80]!r}, not NAME==VERSION): regenerate it "
                         "with `make lock`", code="lock_damaged")
        pin, _, marker = line.partition(" ; ")
        name, _, version = pin.partition("==")
        pins.append(Pin(re.sub(r"[-_.]+", "-", name.lower()), version, marker.strip()))
    if not pins:
        raise NoLock(f"{where} pins nothing: regenerate it with `make lock`", code="lock_damaged")
    return head.group(1), head.group(2), pins


def check_covers(text: str, requirements: Iterable[str], *, python: str, where: str = "the lock") -> None:
    """NoLock unless the lock pins each requirement once (for Linux x86_64, CPython `python`) at a version
    the requirement allows: a lock older than a change to pyproject.toml's extras fails here, not on a GPU."""
    from packaging.markers import Marker
    from packaging.requirements import Requirement

    env = linux_environment(python)
    chosen: dict[str, str] = {}
    for pin in read_lock(text, where=where)[2]:
        if not pin.marker or Marker(pin.marker).evaluate(env):
            if pin.name in chosen:
                raise NoLock(f"{where} pins {pin.name} twice for Python {python} on Linux: regenerate it with "
                             "`make lock`", code="lock_damaged")
            chosen[pin.name] = pin.version
    for line in requirements:
        req = Requirement(line)
        name = re.sub(r"[-_.]+", "-", req.name.lower())
        if name not in chosen:
            raise NoLock(f"{where} is stale: it pins no {req.name} for Python {python} on Linux, which artcloud asks "
                         f"for ({line}): run `make lock` (a lock for Python {python}?)", code="lock_stale")
        if not req.specifier.contains(chosen[name], prereleases=True):
            raise NoLock(f"{where} is stale: it pins {name}=={chosen[name]}, and artcloud asks for {line}: run "
                         "`make lock` (or, if pyproject.toml already says what the lock pins, reinstall artcloud: "
                         "pip install -e . refreshes an editable install's metadata)", code="lock_stale")


def linux_environment(python: str) -> dict[str, str]:
    """The marker environment of a sandbox: Linux, x86_64, CPython `python` ('3.11')."""
    from packaging.markers import default_environment

    return {**default_environment(), "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "os_name": "posix", "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
            "python_version": python, "python_full_version": f"{python}.0", "implementation_version": f"{python}.0"}
