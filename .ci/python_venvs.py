"""Build the extra venvs in which `make test-pythons` runs tests/pythons: one per Python that
requires-python admits besides .venv's own (3.11).

    python .ci/python_venvs.py cuda-libs DIR              # once: the nvidia-* wheels torch links to
    python .ci/python_venvs.py venv VERSION VENV DIR      # e.g. venv 3.10 .venv-py3.10 .venv-cuda-libs

Why it is built this way:
- The CPU build of torch on this machine's disk is cp311 only; for 3.10, 3.12 and 3.13 PyPI serves
  only the CUDA build (~530 MB a wheel), which runs on the CPU but links to ~3 GB of nvidia-* libraries.
  Those are py3-none wheels, the same for every Python, so they are installed ONCE into a shared folder
  (DIR) that each venv puts on its sys.path with a .pth file: pip then sees them as installed, and torch
  loads them from sys.path as it does from site-packages.
- triton and cuda-bindings (torch's GPU compiler and CUDA driver bindings, per-Python wheels) are
  left out: nothing on the CPU path imports them. Everything else is what pip resolves for
  `artcloud[server,s3]` + pytest, installed exactly (name==version, --no-deps), so `pip check` names
  only those two, and the build fails if it names anything else.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

TORCH = "torch==2.14.1"  # the newest torch the machine's pip constraints allow (torch<=2.14.1)
# Installed into the shared folder: every distribution of torch's resolution whose name starts so.
SHARED_PREFIXES = ("nvidia-", "cuda-toolkit", "cuda-pathfinder")
LEFT_OUT = {"triton", "cuda-bindings"}
TEST_REQUIREMENTS = ["pytest>=8", "pytest-timeout>=2.3"]
STAMP = ".installed-stamp"
REPO = Path(__file__).resolve().parent.parent


class BuildError(Exception):
    pass


def pip(python: str | Path, *args: str, capture: bool = False) -> str:
    # -qq: errors only. At -q pip warns about every project missing from this machine's local indexes.
    return run(str(python), "-m", "pip", args[0], "-qq", *args[1:], capture=capture)


def run(*cmd: str, capture: bool = False) -> str:
    out = subprocess.run(cmd, check=False, text=True, stdout=subprocess.PIPE if capture else None)
    if out.returncode != 0:
        raise BuildError(f"failed ({out.returncode}): {' '.join(cmd)}")
    return out.stdout if capture else ""


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def resolve(python: str, *requirements: str, ignore_installed: bool = False) -> list[dict]:
    """What `pip install REQUIREMENTS` would install into `python`'s environment, from pip's own
    resolver (--dry-run --report), as the report's `install` items."""
    flags = ["--ignore-installed"] if ignore_installed else []
    report = pip(python, "install", "--dry-run", "--report", "-", *flags, *requirements, capture=True)
    return json.loads(report)["install"]


def pinned(item: dict) -> list[str]:
    meta = item["metadata"]
    if canonical(meta["name"]) == "artcloud":
        return ["-e", str(REPO)]
    return [f"{meta['name']}=={meta['version']}"]


# ------------------------------------------------------------------------------------ interpreters


def find_python(version: str) -> str:
    """`pythonX.Y` on PATH, else pyenv's newest X.Y.* build. Missing is an error, not a skip: the
    matrix exists to catch what breaks on a Python nobody runs by hand (3.10 lost TLS that way)."""
    name = f"python{version}"
    candidates = [shutil.which(name)]
    root = os.environ.get("PYENV_ROOT") or _pyenv_root() or os.path.expanduser("~/.pyenv")
    candidates += sorted(glob.glob(f"{root}/versions/{version}.*/bin/{name}"), key=_patch_level, reverse=True)
    candidates += [f"/usr/bin/{name}", f"/usr/local/bin/{name}"]
    for path in filter(None, candidates):
        if not os.access(path, os.X_OK):
            continue
        # A pyenv shim is on PATH for every installed version but fails for one not selected: ask it.
        probe = subprocess.run([path, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                               capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return path
    raise BuildError(
        f"Python {version} not found (looked on PATH and under {root}/versions): install it "
        f"(pyenv install {version}), or leave it out with make test EXTRA_PYTHONS='...'"
    )


def _pyenv_root() -> str | None:
    """`pyenv root`: where pyenv keeps its Pythons, whatever HOME is (a fresh HOME has no ~/.pyenv)."""
    pyenv = shutil.which("pyenv")
    if pyenv is None:
        return None
    out = subprocess.run([pyenv, "root"], capture_output=True, text=True)
    return out.stdout.strip() or None if out.returncode == 0 else None


def _patch_level(path: str) -> tuple[int, ...]:
    release = Path(path).parent.parent.name.split(".")
    return tuple(int(p) if p.isdigit() else -1 for p in release)


# ------------------------------------------------------------------------------------ the builds


def build_cuda_libs(folder: Path) -> None:
    """The nvidia-* part of torch's resolution, once, into `folder` (one pip call: several calls
    with --target would collide on the shared `nvidia/` namespace folder)."""
    shared = [item for item in resolve(sys.executable, TORCH, ignore_installed=True)
              if canonical(item["metadata"]["name"]).startswith(SHARED_PREFIXES)]
    if not shared:
        raise BuildError(f"{TORCH} resolved to no nvidia-* libraries: the CUDA build's layout changed")
    if folder.exists():
        shutil.rmtree(folder)
    pip(sys.executable, "install", "--no-deps", "--no-compile", "--target", str(folder),
        *[spec for item in shared for spec in pinned(item)])
    (folder / STAMP).touch()


def build_venv(version: str, venv: Path, cuda_libs: Path) -> None:
    if not (cuda_libs / STAMP).exists():
        raise BuildError(f"{cuda_libs} is not built: run {sys.argv[0]} cuda-libs {cuda_libs} first")
    python = venv / "bin" / "python"
    if not python.exists():
        run(find_python(version), "-m", "venv", str(venv))
    pip(python, "install", "--upgrade", "pip")
    site = Path(run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", capture=True).strip())
    (site / "_artcloud_cuda_libs.pth").write_text(f"{cuda_libs.resolve()}\n")

    try:
        plan = resolve(str(python), "-e", f"{REPO}[server,s3]", *TEST_REQUIREMENTS, TORCH)
    except BuildError:
        raise BuildError(f"pip cannot install artcloud[server,s3] with {TORCH} on Python {version}: "
                         "see pip's error above (a dependency's floor that needs a newer Python?)") from None
    wanted = [item for item in plan if canonical(item["metadata"]["name"]) not in LEFT_OUT]
    if any(canonical(item["metadata"]["name"]).startswith(SHARED_PREFIXES) for item in wanted):
        raise BuildError(f"{cuda_libs} does not hold what {TORCH} needs: rebuild it (make clean-pythons)")
    specs = [spec for item in wanted for spec in pinned(item)]
    if specs:
        pip(python, "install", "--no-deps", "--no-compile", *specs)
    check_pip(python)
    check_torch(python)
    (venv / STAMP).touch()


def check_pip(python: Path) -> None:
    out = subprocess.run([str(python), "-m", "pip", "check"], capture_output=True, text=True).stdout
    unexpected = [line for line in out.splitlines()
                  if line.strip() and not (line.startswith("torch ") and line.split(" requires ")[-1].split(",")[0] in LEFT_OUT)
                  and "No broken requirements" not in line]
    if unexpected:
        raise BuildError("pip check found broken requirements:\n" + "\n".join(unexpected))


def check_torch(python: Path) -> None:
    """The CUDA build of torch on the CPU: import, forward, backward."""
    code = (
        "import torch; m = torch.nn.Linear(8, 2); x = torch.randn(4, 8);"
        "m(x).square().sum().backward(); assert m.weight.grad.abs().sum() > 0;"
        "print('torch', torch.__version__, 'forward/backward on the CPU: ok')"
    )
    print(run(str(python), "-W", "ignore", "-c", code, capture=True).strip())


def main(argv: list[str]) -> int:
    try:
        if argv[:1] == ["cuda-libs"] and len(argv) == 2:
            build_cuda_libs(Path(argv[1]))
        elif argv[:1] == ["venv"] and len(argv) == 4:
            build_venv(argv[1], Path(argv[2]), Path(argv[3]))
        else:
            print(__doc__.split("\n\n")[1], file=sys.stderr)
            return 2
    except BuildError as e:
        print(f"python_venvs: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
