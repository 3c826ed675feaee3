"""Cold start, the install: `artcloud[EXTRA]` into an empty venv, pip vs uv, with artcloud's lock vs without.

What a fresh sandbox pays before the server can start: its Python environment. Each way installs this
checkout's wheel (built here by setuptools, so its metadata is this pyproject.toml's) with its extra into a
new, empty venv, cold: pip with --no-cache-dir, uv with a cache folder of its own that starts empty. Measured:

  seconds     the install command alone (making the venv, and pip's own upgrade, are not counted)
  downloaded  bytes received from the network meanwhile (/proc/net/dev, loopback left out: the whole
              machine's count, so keep other downloads off it); the link's rate is taken from the same samples
  installed   the venv's size afterwards (file sizes, hard links counted once)

and, with uv's cache then warm, the resolution alone (`uv pip install --dry-run` into an empty venv), with the
lock as constraints vs without: the lock's own effect, apart from the download. Each venv is deleted once
measured. Both tools see PyPI alone (this machine's pip configuration, with its local wheel folders, is set
aside). From PyPI on Linux, torch is the CUDA build: `gpu` downloads several GB (that is what a GPU sandbox
installs), and vLLM 0.32 needs Python 3.11+.

    .venv/bin/python bench/cold_start_install.py                                  # gpu: pip/uv x lock/none
    .venv/bin/python bench/cold_start_install.py --extra server --tools uv        # a quicker check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out" / "cold_start_install.json"
DEFAULT_PYTHON = {"gpu": "3.11", "server": "3.10"}  # the oldest each lock serves (vLLM 0.32 needs 3.11)
ARTCLOUD = ("uv", True)  # how a sandbox installs: uv (SkyPilot's nodes have it) with the lock


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("install (bench/cold_start_install.py)")
    g.add_argument("--extra", default="gpu", help="the extra to install: gpu (several GB) or server (default gpu)")
    g.add_argument("--tools", default="pip,uv", help="comma-separated: pip, uv (default both)")
    g.add_argument("--locks", default="with,without", help="comma-separated: with, without (default both)")
    g.add_argument("--python", default=None,
                   help="the venvs' Python: a version pyenv has (3.11) or a path (default: 3.11 for gpu, 3.10 for server)")
    g.add_argument("--resolve-repeats", type=int, default=3, help="warm-cache resolutions per side (median; 0: skip)")
    g.add_argument("--uv", default=None, help="the uv binary (default: the uv package's, or uv on PATH)")


# ----------------------------------------------------------------------------------------- parts


def find_python(wanted: str) -> str:
    if os.sep in wanted:
        return wanted
    try:
        prefix = subprocess.run(["pyenv", "prefix", wanted], capture_output=True, text=True, check=True).stdout.strip()
        return str(Path(prefix) / "bin" / "python3")
    except (OSError, subprocess.CalledProcessError):
        found = shutil.which(f"python{wanted}")
        if not found:
            raise SystemExit(f"no Python {wanted}: install it (pyenv install {wanted}) or pass --python PATH")
        return found


def find_uv(flag: str | None) -> str:
    if flag:
        return flag
    try:
        import uv

        return uv.find_uv_bin()
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv") or str(ROOT / ".venv" / "bin" / "uv")
        if not os.access(found, os.X_OK):
            raise SystemExit("no uv: pip install uv, or pass --uv PATH")
        return found


def build_artcloud_wheel(out: Path) -> Path:
    """This checkout's wheel as a release is built (setuptools, package data, this pyproject's metadata),
    from a copy of the sources so that no build/ or egg-info lands in the checkout."""
    src = out / "src"
    src.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    for folder in ("artcloud", "sky"):
        shutil.copytree(ROOT / folder, src / folder, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(out / "dist"), str(src)], check=True)
    shutil.rmtree(src)
    (wheel,) = (out / "dist").glob("artcloud-*.whl")
    return wheel


def rx_bytes() -> int:
    """Bytes received on every interface but loopback, since boot."""
    total = 0
    for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
        name, _, fields = line.partition(":")
        if name.strip() != "lo":
            total += int(fields.split()[0])
    return total


class NetMeter:
    """Received bytes over a command's run, sampled every 0.25 s: the total, and the rate while receiving."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), rx_bytes()))
            self._stop.wait(0.25)

    def __enter__(self) -> NetMeter:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.monotonic(), rx_bytes()))

    @property
    def received(self) -> int:
        return self.samples[-1][1] - self.samples[0][1]

    def active_rate(self) -> float | None:
        """Bytes/s over the samples that received more than 1 MB/s (the link while it was busy)."""
        secs = got = 0.0
        for (t0, b0), (t1, b1) in zip(self.samples, self.samples[1:]):
            if t1 > t0 and (b1 - b0) / (t1 - t0) > 1e6:
                secs, got = secs + t1 - t0, got + b1 - b0
        return got / secs if secs else None


def tree_bytes(folder: Path) -> int:
    seen, total = set(), 0
    for dirpath, _, files in os.walk(folder):
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def tool_env(cache: Path) -> dict[str, str]:
    """Both tools see PyPI alone: this machine's pip configuration (extra local indexes, find-links, a global
    constraints file) would let pip skip downloads a sandbox makes; uv gets its own cache folder."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_")) or k == "PIP_CERT"}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "UV_PYTHON_DOWNLOADS": "never", "UV_CACHE_DIR": str(cache)}


def make_venv(tool: str, python: str, venv: Path, uv: str, env: dict[str, str]) -> None:
    if tool == "uv":
        subprocess.run([uv, "venv", "--quiet", "--python", python, str(venv)], check=True, env=env)
    else:  # pip as a sandbox would run it: today's release (the venv's own may be years old)
        subprocess.run([python, "-m", "venv", str(venv)], check=True, env=env)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        "--no-cache-dir", "--upgrade", "pip"], check=True, env=env)


def install_command(tool: str, venv: Path, spec: str, lock: Path | None, uv: str) -> list[str]:
    constraints = ["-c", str(lock)] if lock else []
    if tool == "uv":
        return [uv, "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"), *constraints, spec]
    return [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
            "--no-cache-dir", *constraints, spec]


def cold_install(tool: str, locked: bool, *, python: str, spec: str, lock: Path, uv: str, work: Path,
                 cache: Path) -> dict:
    """One cold install into a new venv, measured; the venv is deleted after."""
    venv = work / f"venv-{tool}-{'lock' if locked else 'nolock'}"
    env = tool_env(cache)
    make_venv(tool, python, venv, uv, env)
    cmd = install_command(tool, venv, spec, lock if locked else None, uv)
    try:
        with NetMeter() as net:
            t0 = time.perf_counter()
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            seconds = time.perf_counter() - t0
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
        return {"tool": tool, "lock": locked, "seconds": seconds, "download_bytes": net.received,
                "link_bytes_per_s": net.active_rate(), "installed_bytes": tree_bytes(venv)}
    finally:
        shutil.rmtree(venv, ignore_errors=True)


def warm_resolution(*, python: str, spec: str, lock: Path, uv: str, work: Path, cache: Path, repeats: int) -> dict:
    """`uv pip install --dry-run` into an empty venv with a warm cache, with the lock vs without, alternating."""
    venv = work / "venv-resolve"
    env = tool_env(cache)
    make_venv("uv", python, venv, uv, env)
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for i in range(repeats):
            for locked in ((True, False) if i % 2 == 0 else (False, True)):
                cmd = install_command("uv", venv, spec, lock if locked else None, uv)
                cmd.insert(3, "--dry-run")
                t0 = time.perf_counter()
                subprocess.run(cmd, env=env, check=True, capture_output=True)
                times[locked].append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(venv, ignore_errors=True)
    return {"with": statistics.median(times[True]), "without": statistics.median(times[False]), "runs": times}


# ----------------------------------------------------------------------------------------- rows


def _label(tool: str, locked: bool) -> str:
    return f"{tool} + lock" if locked else f"{tool}, no lock"


def rows_for(runs: list[dict], resolution: dict | None, extra: str, python: str) -> list[dict]:
    rows: list[dict] = []
    mine = next((r for r in runs if (r["tool"], r["lock"]) == ARTCLOUD), None)
    peers = [r for r in runs if r is not mine] or [None]
    metrics = [("seconds", "s", f"install artcloud[{extra}] cold into an empty venv"),
               ("download_bytes", "bytes", "downloaded (network bytes received)"),
               ("installed_bytes", "bytes", "installed (the venv's size)")]
    for key, unit, what in metrics:
        for i, peer in enumerate(peers):
            a = mine[key] if mine else None
            b = peer[key] if peer else None
            rows.append({"section": "install", "what": f"{what}: {_label(*ARTCLOUD)}" if mine else what,
                         "artcloud": a, "peer": _label(peer["tool"], peer["lock"]) if peer else "-", "peer_value": b,
                         "unit": unit, "ratio": b / a if a and b else None,  # how many times faster (smaller) artcloud is
                         "note": f"Python {python}" if key == "seconds" and i == 0 else "",
                         **({"key": f"install.uv_lock.{key}"} if mine and i == 0 else {})})
    rates = [r["link_bytes_per_s"] for r in runs if r["link_bytes_per_s"]]
    if rates:
        rows.append({"section": "install", "what": "this machine's link to PyPI while downloading", "artcloud": max(rates),
                     "peer": "-", "peer_value": None, "unit": "bytes/s", "ratio": None,
                     "note": "the fastest run's rate while receiving", "key": "install.link_bytes_per_s"})
    if resolution:
        rows.append({"section": "install", "what": f"resolve artcloud[{extra}], warm cache: uv -c lock",
                     "artcloud": resolution["with"], "peer": "uv, no lock", "peer_value": resolution["without"],
                     "unit": "s", "ratio": resolution["without"] / resolution["with"],
                     "note": "uv pip install --dry-run, median", "key": "install.resolve_lock.seconds"})
    return rows


def measure(args: argparse.Namespace) -> list[dict]:
    from artcloud import locks

    extra = args.extra
    lock = locks.lock_path(extra)  # this checkout's lock, the one its wheel ships
    python = find_python(args.python or DEFAULT_PYTHON.get(extra, "3.11"))
    version = subprocess.run([python, "-c", "import platform; print(platform.python_version())"], check=True,
                             capture_output=True, text=True).stdout.strip()
    uv = find_uv(args.uv)
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    with_lock = [{"with": True, "without": False}[w.strip()] for w in args.locks.split(",") if w.strip()]
    runs: list[dict] = []
    resolution = None
    with tempfile.TemporaryDirectory(prefix="artcloud-bench-install-") as tmp:
        work = Path(tmp)
        spec = f"{build_artcloud_wheel(work)}[{extra}]"
        warm_cache: Path | None = None
        for tool in tools:
            for locked in with_lock:
                cache = work / f"uv-cache-{tool}-{locked}"  # new and empty: cold
                print(f"[install] {_label(tool, locked)}: artcloud[{extra}] into an empty venv (Python {version}) ...",
                      file=sys.stderr, flush=True)
                run = cold_install(tool, locked, python=python, spec=spec, lock=lock, uv=uv, work=work, cache=cache)
                print(f"[install]   {run['seconds']:.1f} s, {run['download_bytes'] / 1e9:.2f} GB down, "
                      f"{run['installed_bytes'] / 1e9:.2f} GB installed", file=sys.stderr, flush=True)
                runs.append(run)
                if tool == "uv" and warm_cache is None:
                    warm_cache = cache  # kept for the warm resolution
                else:
                    shutil.rmtree(cache, ignore_errors=True)
        if args.resolve_repeats > 0 and "uv" in tools:
            resolution = warm_resolution(python=python, spec=spec, lock=lock, uv=uv, work=work, cache=warm_cache,
                                         repeats=args.resolve_repeats)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"extra": extra, "python": version, "runs": runs, "resolution": resolution}, indent=2))
    return rows_for(runs, resolution, extra, version)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    rows = measure(parser.parse_args())
    for row in rows:
        a, b = row["artcloud"], row["peer_value"]
        scale, unit = (1e9, "GB") if row["unit"] == "bytes" else (1e6, "MB/s") if row["unit"] == "bytes/s" else (1, row["unit"])
        fmt = lambda x: "-" if x is None else f"{x / scale:.3g} {unit}"  # noqa: E731
        ratio = f"{row['ratio']:.2f}x" if row["ratio"] else "-"
        print(f"{row['what']:<70} {fmt(a):>12}   {row['peer']:<14} {fmt(b):>12}   {ratio:>6}   {row['note']}")
