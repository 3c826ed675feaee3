"""The machine image behind the SkyPilot stand-in (tests/sky_standin.py): what a fresh cloud VM gives a task.

A real node, as SkyPilot 0.14.1 leaves it before the task's setup runs (sky/skylet/constants.py):

- the image's own `python3` (Ubuntu 22.04: 3.10; newer images: 3.12), WITHOUT the python3-venv package, so
  `python3 -m venv` fails (ensurepip is missing); no bare `python`;
- uv at ~/.local/bin/uv (SKY_UV_INSTALL_DIR, constants.py:147; SKY_UV_INSTALL_CMD, :156: the latest uv from
  astral.sh), not on PATH;
- ~/sky-user-env, a `uv venv --system-site-packages` of that python3 (SKY_USER_ENV_CREATION_COMMANDS, :370-376),
  which every setup/run shell activates (skylet/log_lib.py:357-397 make_task_bash_script); no conda.

What differs is only the network, at the node's uv (tests/sky_uv.py wraps the real uv binary):
- `uv pip install` RESOLVES FOR REAL, against PyPI's metadata with the node venv's own Python, the task's
  constraints (the lock) and its requirements: a version mismatch fails here exactly as on a node. Only the bytes
  do not come from PyPI: the packages are this machine's venv for that Python (.venv for 3.11, the venv running
  the tests, ARTCLOUD_STANDIN_PYTHON's), linked into the node's venv, minus artcloud, which is installed from the
  task's wheel (`--no-deps --no-index`);
- uv's CPython downloads (python-build-standalone, fetched on first use: uv's default UV_PYTHON_DOWNLOADS=automatic)
  are the same Pythons of this machine, offered as uv's managed installations (UV_PYTHON_INSTALL_DIR).
SkyPilot seeds ~/sky-user-env with pip (`--seed`), which needs the network; here it is made without.

Choose the image's Python with ARTCLOUD_STANDIN_PYTHON=PATH: a venv's python (its packages are the "download"
for that Python) or a bare interpreter (then only the other venvs' Pythons can be installed into).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ENV_PYTHON = "ARTCLOUD_STANDIN_PYTHON"
# Seconds each `uv pip install` of a node waits first, as a real one downloading the server's environment.
ENV_INSTALL_DELAY = "ARTCLOUD_STANDIN_INSTALL_DELAY_S"
REPO_ROOT = Path(__file__).resolve().parent.parent
# A VM's PATH: no pyenv, no venv of this machine. The image's bin folder goes first.
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# SkyPilot's job script, up to the user's commands (sky/skylet/log_lib.py make_task_bash_script, 0.14.1).
SHELL_PREAMBLE = """\
[ -f ~/.bashrc ] && source ~/.bashrc
if [ -z "${CONDA_PREFIX:-}" ] && [ -f ~/sky-user-env/bin/activate ]; then source ~/sky-user-env/bin/activate; fi
export PYTHONUNBUFFERED=1
cd ~/sky_workdir
"""
# Debian/Ubuntu without python3-venv: the venv module is there (libpython3.X-stdlib), ensurepip is not. `python3
# -m venv DIR` makes DIR without pip, then fails with this message; `--without-pip` works. (venv runs ensurepip
# in a child with PYTHONPATH removed, so blocking ensurepip alone would not reach it: the venv module is wrapped.)
_DEBIAN_VENV_MESSAGE = """The virtual environment was not created successfully because ensurepip is not
available.  On Debian/Ubuntu systems, you need to install the python3-venv
package using the following command.

    apt install python{version}-venv

You may need to use sudo with that command.  After installing the python3-venv
package, recreate your virtual environment.
"""
_VENV_INIT = """import os as _os, sysconfig as _sysconfig
_real = _os.path.join(_sysconfig.get_paths()["stdlib"], "venv", "__init__.py")
with open(_real) as _f:
    exec(compile(_f.read(), _real, "exec"))
"""
_VENV_MAIN = """import sys
from venv import main
if "--without-pip" in sys.argv[1:]:
    sys.exit(main())
main(sys.argv[1:] + ["--without-pip"])
sys.stdout.write(MESSAGE + "\\nFailing command: " + sys.executable + "\\n")
sys.exit(1)
"""
_BLOCKED_ENSUREPIP = '''raise ModuleNotFoundError("No module named 'ensurepip'", name="ensurepip")
'''


# sudo as SkyPilot's images give it, without a password (sky/templates/aws-ray.yml.j2:119). Powering off goes to the
# stand-in's cloud (tests/sky_standin.py poweroff), which ends that node only: never to this machine.
_SUDO = """#!/bin/sh
while [ "${{1#-}}" != "$1" ]; do shift; done  # sudo's own options (-n)
case "${{1##*/}}" in
  shutdown|poweroff) shift; PYTHONPATH={repo} exec {python} -m tests.sky_standin poweroff "$@" ;;
  halt|reboot|init|systemctl|telinit) echo "sudo: $1 is not modelled by the stand-in" >&2; exit 1 ;;
esac
exec "$@"
"""


@dataclass(frozen=True)
class Image:
    """A built image: `bin/python3` (the chosen interpreter) and `blocked/` (no ensurepip, as without python3-venv)."""

    root: Path  # ROOT/images/pyX.Y
    version: str  # "3.10"

    @property
    def python3(self) -> Path:
        return self.root / "bin" / "python3"

    def environment(self) -> dict[str, str]:
        """What the image puts in every process's environment. uv finds its "downloaded" CPythons in the managed
        folder; it may not download more (there is no network)."""
        cloud = self.root.parent.parent
        return {"PATH": f"{self.root / 'bin'}:{SYSTEM_PATH}", "PYTHONPATH": str(self.root / "blocked"),
                "UV_PYTHON_DOWNLOADS": "never", "UV_OFFLINE": "1", "UV_PYTHON_INSTALL_DIR": str(cloud / MANAGED)}


MANAGED = "uv-python"  # ROOT/uv-python: uv's managed CPythons, one folder each, as `uv python install` lays them out
PACKAGES = "packages"  # ROOT/packages/pyX.Y: the "PyPI downloads" for Python X.Y (see the module docstring)


def uv_binary() -> str:
    """uv, as SkyPilot installs it on every node (here: the `uv` package of the test venv)."""
    try:
        import uv

        return uv.find_uv_bin()
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv") or str(REPO_ROOT / ".venv" / "bin" / "uv")
        if not os.access(found, os.X_OK):
            raise RuntimeError("the SkyPilot stand-in needs uv (pip install uv): SkyPilot puts it on every node")
        return found


def _describe(python: str) -> dict:
    code = ("import json, os, platform, sys, sysconfig; p = sysconfig.get_paths(); "
            "print(json.dumps({'base': os.path.realpath(getattr(sys, '_base_executable', sys.executable)), "
            "'version': '%d.%d' % sys.version_info[:2], 'full': platform.python_version(), "
            "'venv': sys.prefix != sys.base_prefix, 'sites': [p['purelib'], p['platlib']]}))")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True, cwd="/",
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    return json.loads(out.stdout)


def _is_artcloud(name: str) -> bool:
    low = name.lower()
    return (low == "artcloud" or low.startswith(("artcloud-", "artcloud.", "__editable__.artcloud", "__editable___artcloud")))


def _once(folder: Path, make) -> None:
    """Build `folder` once: made under a temporary name, then renamed (another process may win the race)."""
    if (folder / ".built").exists():
        return
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    make(tmp)
    (tmp / ".built").write_text("")
    try:
        tmp.rename(folder)
    except OSError:  # built meanwhile by another process
        shutil.rmtree(tmp, ignore_errors=True)


def host_pythons(image_python: str | None = None) -> list[str]:
    """The venvs of this machine whose packages the node's uv "downloads": the image's own Python (if it is a
    venv's) and .venv's 3.11, which every `make test` has."""
    found = [image_python or os.environ.get(ENV_PYTHON) or sys.executable, str(REPO_ROOT / ".venv" / "bin" / "python")]
    return [p for p in dict.fromkeys(found) if os.access(p, os.X_OK)]


def _packages(root: Path, info: dict) -> Path:
    """ROOT/packages/pyX.Y for a venv: `site/` (links to its packages, artcloud left out) and `paths` (what a node
    venv's .pth adds: that folder, and the folders its own .pth files add, e.g. shared CUDA libraries)."""
    folder = root / PACKAGES / f"py{info['version']}"

    def make(tmp: Path) -> None:
        sites = list(dict.fromkeys(os.path.realpath(s) for s in info["sites"] if os.path.isdir(s)))
        paths = [str(folder / "site")]
        (tmp / "site").mkdir()
        for site in sites:
            for entry in os.listdir(site):
                if _is_artcloud(entry) or entry.endswith(".pth") or entry == "__pycache__" or (tmp / "site" / entry).exists():
                    continue
                os.symlink(os.path.join(site, entry), tmp / "site" / entry)
            for pth in sorted(Path(site).glob("*.pth")):  # folder lines (not `import ...`, not this checkout)
                if _is_artcloud(pth.name):
                    continue
                for line in pth.read_text().splitlines():
                    line = line.strip()
                    if line and not line.startswith(("#", "import")) and os.path.isdir(line) \
                            and os.path.realpath(line) != str(REPO_ROOT):
                        paths.append(line)
        (tmp / "paths").write_text("\n".join(paths) + "\n")

    _once(folder, make)
    return folder


def _managed(root: Path, info: dict) -> None:
    """uv's managed installation of `info`'s CPython (what `uv python install X.Y` would download): a folder named
    as uv names them (cpython-X.Y.Z-linux-x86_64-gnu) whose bin/ links to this machine's interpreter. uv does not
    take a symlinked folder there, so only the executables are links."""
    folder = root / MANAGED / f"cpython-{info['full']}-linux-x86_64-gnu"

    def make(tmp: Path) -> None:
        (tmp / "bin").mkdir()
        for name in (f"python{info['version']}", "python3", "python"):
            os.symlink(info["base"], tmp / "bin" / name)

    _once(folder, make)


def build(root: Path, python: str | None = None) -> Image:
    """The image for `python` (default ARTCLOUD_STANDIN_PYTHON, else this one), built once under root/images/pyX.Y,
    with the packages of each host venv (root/packages) and their Pythons as uv's managed installs."""
    python = python or os.environ.get(ENV_PYTHON) or sys.executable
    info = _describe(python)
    for other in host_pythons(python):
        described = info if other == python else _describe(other)
        if described["venv"]:
            _packages(root, described)
        if described["version"] != info["version"]:
            _managed(root, described)
    image = root / "images" / f"py{info['version']}"

    def make(tmp: Path) -> None:
        (tmp / "bin").mkdir()
        for name in ("python3", f"python{info['version']}"):  # no bare `python`, as on Ubuntu
            os.symlink(info["base"], tmp / "bin" / name)
        (tmp / "bin" / "sudo").write_text(_SUDO.format(python=shlex.quote(sys.executable),
                                                       repo=shlex.quote(str(REPO_ROOT))))
        (tmp / "bin" / "sudo").chmod(0o755)
        (tmp / "blocked" / "ensurepip").mkdir(parents=True)
        (tmp / "blocked" / "ensurepip" / "__init__.py").write_text(_BLOCKED_ENSUREPIP)
        (tmp / "blocked" / "venv").mkdir()
        (tmp / "blocked" / "venv" / "__init__.py").write_text(_VENV_INIT)
        message = _DEBIAN_VENV_MESSAGE.format(version=info["version"])
        (tmp / "blocked" / "venv" / "__main__.py").write_text(f"MESSAGE = {message!r}\n" + _VENV_MAIN)

    _once(image, make)
    return Image(image, info["version"])


def provision(image: Image, home: Path) -> None:
    """A node's HOME as SkyPilot leaves it: uv in ~/.local/bin (this machine's uv, behind tests/sky_uv.py: see the
    module docstring) and the ~/sky-user-env venv."""
    bin_dir = home / ".local" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    cloud = image.root.parent.parent
    if not (bin_dir / "uv").exists():
        # The host's uv cache (tests/conftest.py fixes it before HOME moves): PyPI's answers are kept between nodes.
        cache = os.environ.get("UV_CACHE_DIR") or os.path.join(os.path.expanduser("~/.cache"), "uv")
        delay = float(os.environ.get(ENV_INSTALL_DELAY) or 0)
        (bin_dir / "uv").write_text(
            f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -I {shlex.quote(str(REPO_ROOT / 'tests' / 'sky_uv.py'))} "
            f"{shlex.quote(uv_binary())} {shlex.quote(str(cloud / PACKAGES))} {shlex.quote(cache)} {delay:g} \"$@\"\n")
        (bin_dir / "uv").chmod(0o755)
    user_env = home / "sky-user-env"
    if not (user_env / "bin" / "python").exists():
        env = {**image.environment(), "HOME": str(home), "UV_LINK_MODE": "copy", "UV_SYSTEM_PYTHON": "false"}
        env.pop("PYTHONPATH")  # SkyPilot's uv commands unset it
        subprocess.run([str(bin_dir / "uv"), "venv", "--quiet", "--relocatable", "--system-site-packages",
                        "--python", str(image.python3), str(user_env)],
                       check=True, env=env, cwd=home, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
