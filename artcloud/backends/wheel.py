"""A wheel of the artcloud that is running right here, to install on the sandbox.

Client and server must run the same artcloud (the server refuses another version), and a user's working
copy may hold changes that no release has. So the sandbox gets *this* package: its files as they are
imported now (an editable install included) and its installed metadata, so that `wheel[gpu]` pulls the
same dependencies a `pip install artcloud[gpu]` would. Pure Python, so one `py3-none-any` wheel fits
every sandbox. Building takes a few tens of milliseconds, and the same code always gives the same bytes.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Iterable

from artcloud._version import __version__
from artcloud.errors import ArtcloudError, InvalidArgument
from artcloud.locks import linux_environment

PACKAGE = Path(__file__).resolve().parents[1]  # artcloud/
# What setuptools puts in artcloud's wheel (pyproject.toml: the packages artcloud*, and [tool.setuptools.package-data]):
# each package's modules, and these data files. Anything else in the folder (a backup, a scratch file, a hidden
# or cached one) stays out. tests/test_wheel.py holds this to pyproject.toml.
PACKAGE_DATA = ("templates/*.yaml", "locks/*.txt")


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def package_files(root: Path = PACKAGE) -> list[tuple[str, Path]]:
    """(archive name, file) for every file of the artcloud package at `root` that a wheel ships; links are followed."""
    files = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if _ships(root, rel) and path.is_file():
            files.append((f"artcloud/{rel.as_posix()}", path))
    return files


def _ships(root: Path, rel: Path) -> bool:
    if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
        return False
    if rel.suffix == ".py":  # a module of a package (setuptools finds folders with an __init__.py)
        return (root / rel.parent / "__init__.py").is_file()
    return any(rel.parent.as_posix() == folder and fnmatch.fnmatchcase(rel.name, name)
               for folder, _, name in (pattern.rpartition("/") for pattern in PACKAGE_DATA))


def build_wheel(out_dir: Path) -> Path:
    """Write artcloud-VERSION-py3-none-any.whl into `out_dir` and return its path."""
    meta, entry_points = None, ""
    # An installed dist-info (METADATA) first; a source tree's egg-info (PKG-INFO) may shadow it on sys.path.
    for dist in sorted(metadata.distributions(name="artcloud"), key=lambda d: d.read_text("METADATA") is None):
        meta = dist.read_text("METADATA") or dist.read_text("PKG-INFO")
        if meta:
            entry_points = dist.read_text("entry_points.txt") or ""
            break
    if not meta:
        raise ArtcloudError(
            "artcloud is imported from a folder that was never installed, so its dependencies are unknown: "
            "install it (pip install -e .) or launch with image=... (a prebuilt server image)",
            code="not_installed",
        )
    info = f"artcloud-{__version__}.dist-info"
    wheel_meta = "Wheel-Version: 1.0\nGenerator: artcloud\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"artcloud-{__version__}-py3-none-any.whl"
    tmp = target.with_suffix(".tmp")
    records = []
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as whl:
        entries = [(name, path.read_bytes()) for name, path in package_files()]
        entries += [
            (f"{info}/METADATA", _with_version(meta).encode()),
            (f"{info}/WHEEL", wheel_meta.encode()),
            (f"{info}/entry_points.txt", entry_points.encode()),
        ]
        for name, data in entries:
            whl.writestr(_entry(name), data)
            records.append(_record_line(name, data))
        records.append(f"{info}/RECORD,,")
        whl.writestr(_entry(f"{info}/RECORD"), "\n".join(records) + "\n")
    tmp.replace(target)
    return target


def _entry(name: str) -> zipfile.ZipInfo:
    """A fixed timestamp and mode: the same code gives the same wheel, byte for byte, so an image built
    from it (Modal) is cached instead of rebuilt at every launch."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.external_attr = 0o644 << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


def _with_version(meta: str) -> str:
    """The metadata with this package's version (an editable install's may lag a version bump). Only the
    header is touched: the long description after the first blank line may hold 'Version:' lines too."""
    header, sep, body = meta.partition("\n\n")
    lines = [f"Version: {__version__}" if line.startswith("Version:") else line for line in header.splitlines()]
    return "\n".join(lines) + "\n" + (sep[1:] + body if sep else "")


def wheel_requirements(wheel: Path, *, extras: Iterable[str], python: str) -> list[str]:
    """What `pip install 'WHEEL[EXTRAS]'` would install directly, from the wheel's METADATA Requires-Dist:
    the extras resolved (self-references like artcloud[server] included) and every marker evaluated for the
    image (Linux, x86_64, CPython `python`), so the list, and so the layer, is the same on any laptop."""
    from email.parser import Parser

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    with zipfile.ZipFile(wheel) as zf:
        name = next((n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")), None)
        if name is None:
            raise InvalidArgument(f"{wheel} has no .dist-info/METADATA: not a wheel (build one with build_wheel)")
        meta = Parser().parsestr(zf.read(name).decode())
    own = canonicalize_name(meta["Name"])
    reqs = [Requirement(line) for line in meta.get_all("Requires-Dist") or []]
    env = linux_environment(python)

    def wanted(req: Requirement, chosen: set[str]) -> bool:
        return req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in chosen)

    chosen, before = {"", *extras}, set()
    while chosen != before:  # artcloud[gpu] asks for artcloud[server], which may ask for more
        before = set(chosen)
        for req in reqs:
            if canonicalize_name(req.name) == own and wanted(req, chosen):
                chosen |= req.extras
    out = []
    for req in reqs:
        if canonicalize_name(req.name) != own and wanted(req, chosen):
            req.marker = None
            if str(req) not in out:
                out.append(str(req))
    return out
