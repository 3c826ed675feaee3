"""The machine image behind the SkyPilot stand-in (tests/sky_standin.py): what a fresh cloud VM gives a task.

A real node, as SkyPilot 0.14 leaves it before the task's setup runs (sky/skylet/constants.py):

- the image's own `python3` (Ubuntu 22.04: 3.10; newer images: 3.12), WITHOUT the python3-venv package, so
  `python3 -m venv` fails (ensurepip is missing); no bare `python`;
- uv at ~/.local/bin/uv (SKY_UV_INSTALL_CMD), not on PATH;
- ~/sky-user-env, a `uv venv --system-site-packages` of that python3 (SKY_USER_ENV_CREATION_COMMANDS), which
  every setup/run shell activates (log_lib.make_task_bash_script); conda is no longer installed.

What differs, at the edge only: SkyPilot seeds ~/sky-user-env with pip (`--seed`), which needs the network;
here it is made without. And nothing is downloaded: the packages a server needs (torch, fastapi, ...) are the
"image's" preinstalled packages, taken from a venv of this machine built for that same Python (.venv for
3.11, .venv-py3.10 / .venv-py3.12 from `make test-pythons`) minus artcloud itself, and reach the task's
processes on PYTHONPATH; the task installs the wheel with `--no-deps --no-index`, so `import artcloud` finds
only the wheel's copy.

Choose the image's Python with ARTCLOUD_STANDIN_PYTHON=PATH, the python of such a venv (default: the one
running the tests).
"""

from __future__ import annotations

import json
import os
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


@dataclass(frozen=True)
class Image:
    """A built image: `bin/python3` (the chosen interpreter), `site/` (its preinstalled packages), `blocked/`."""

    root: Path
    version: str  # "3.10"
    extra_paths: tuple[str, ...]  # folders the host venv's .pth files add (e.g. shared CUDA libraries)

    @property
    def python3(self) -> Path:
        return self.root / "bin" / "python3"

    def environment(self) -> dict[str, str]:
        """What the image puts in every process's environment."""
        paths = [str(self.root / "blocked"), str(self.root / "site"), *self.extra_paths]
        return {"PATH": f"{self.root / 'bin'}:{SYSTEM_PATH}", "PYTHONPATH": os.pathsep.join(paths),
                "UV_PYTHON_DOWNLOADS": "never", "UV_OFFLINE": "1"}


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
    code = ("import json, os, sys, sysconfig; p = sysconfig.get_paths(); "
            "print(json.dumps({'base': os.path.realpath(getattr(sys, '_base_executable', sys.executable)), "
            "'version': '%d.%d' % sys.version_info[:2], 'sites': [p['purelib'], p['platlib']]}))")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True, cwd="/",
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    return json.loads(out.stdout)


def _is_artcloud(name: str) -> bool:
    low = name.lower()
    return (low == "artcloud" or low.startswith(("artcloud-", "artcloud.", "__editable__.artcloud", "__editable___artcloud")))


def build(root: Path, python: str | None = None) -> Image:
    """The image for `python` (a venv's interpreter; default ARTCLOUD_STANDIN_PYTHON, else this one), built
    once under root/images/pyX.Y."""
    python = python or os.environ.get(ENV_PYTHON) or sys.executable
    info = _describe(python)
    image = root / "images" / f"py{info['version']}"
    extra: list[str] = []
    sites = list(dict.fromkeys(os.path.realpath(s) for s in info["sites"] if os.path.isdir(s)))
    for site in sites:  # .pth lines that are folders (not `import ...`, not this checkout): kept on the path
        for pth in sorted(Path(site).glob("*.pth")):
            if _is_artcloud(pth.name):
                continue
            for line in pth.read_text().splitlines():
                line = line.strip()
                if line and not line.startswith(("#", "import")) and os.path.isdir(line) \
                        and os.path.realpath(line) != str(REPO_ROOT):
                    extra.append(line)
    if (image / ".built").exists():
        return Image(image, info["version"], tuple(extra))
    tmp = image.with_name(image.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "bin").mkdir(parents=True)
    for name in ("python3", f"python{info['version']}"):  # no bare `python`, as on Ubuntu
        os.symlink(info["base"], tmp / "bin" / name)
    (tmp / "blocked" / "ensurepip").mkdir(parents=True)
    (tmp / "blocked" / "ensurepip" / "__init__.py").write_text(_BLOCKED_ENSUREPIP)
    (tmp / "blocked" / "venv").mkdir()
    (tmp / "blocked" / "venv" / "__init__.py").write_text(_VENV_INIT)
    message = _DEBIAN_VENV_MESSAGE.format(version=info["version"])
    (tmp / "blocked" / "venv" / "__main__.py").write_text(f"MESSAGE = {message!r}\n" + _VENV_MAIN)
    (tmp / "site").mkdir()
    for site in sites:
        for entry in os.listdir(site):
            if _is_artcloud(entry) or entry.endswith(".pth") or entry == "__pycache__" or (tmp / "site" / entry).exists():
                continue
            os.symlink(os.path.join(site, entry), tmp / "site" / entry)
    (tmp / ".built").write_text(python + "\n")
    try:
        tmp.rename(image)
    except OSError:  # built meanwhile by another process
        shutil.rmtree(tmp, ignore_errors=True)
    return Image(image, info["version"], tuple(extra))


def provision(image: Image, home: Path) -> None:
    """A node's HOME as SkyPilot leaves it: uv in ~/.local/bin and the ~/sky-user-env venv."""
    bin_dir = home / ".local" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    if not (bin_dir / "uv").exists():
        delay = os.environ.get(ENV_INSTALL_DELAY)
        if delay:  # a real node's `uv pip install` downloads gigabytes: it takes a while
            (bin_dir / "uv").write_text(f'#!/bin/bash\n[ "$1 $2" = "pip install" ] && sleep {float(delay):g}\n'
                                        f'exec {uv_binary()} "$@"\n')
            (bin_dir / "uv").chmod(0o755)
        else:
            os.symlink(uv_binary(), bin_dir / "uv")
    user_env = home / "sky-user-env"
    if not (user_env / "bin" / "python").exists():
        env = {**image.environment(), "HOME": str(home), "UV_LINK_MODE": "copy", "UV_SYSTEM_PYTHON": "false"}
        env.pop("PYTHONPATH")  # SkyPilot's uv commands unset it
        subprocess.run([str(bin_dir / "uv"), "venv", "--quiet", "--relocatable", "--system-site-packages",
                        "--python", str(image.python3), str(user_env)],
                       check=True, env=env, cwd=home, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
