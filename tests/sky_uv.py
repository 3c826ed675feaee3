"""The uv of a SkyPilot stand-in node (tests/sky_image.py): the real uv, with PyPI's downloads taken from this machine.

    python -I tests/sky_uv.py REAL_UV PACKAGES UV_CACHE DELAY_S ARGS...     (~/.local/bin/uv on the node calls it)

Every command but `uv pip install` goes to the real uv as it is. `uv pip install ARGS` does what a node's does, in
two steps, so that what can fail on a node fails here:

1. resolve for real: `uv pip install --dry-run ARGS` with the network allowed (PyPI's metadata; cached in UV_CACHE),
   for the target venv's own Python, with the task's constraints (-c LOCK) and requirements. A lock that needs a
   newer Python, a pin PyPI does not have, a damaged lock: uv's own error, and the setup fails (FAILED_SETUP);
2. "download": the target venv gets a .pth to the packages of this machine's venv for its Python (PACKAGES/pyX.Y,
   sky_image._packages), and the real uv installs what ARGS name with `--no-deps --no-index` (artcloud's wheel;
   its dependencies are there already). No venv of this machine for that Python: the download fails, with a line.

DELAY_S: seconds each install waits first, as a real node downloading gigabytes (ARTCLOUD_STANDIN_INSTALL_DELAY_S).
Standard library only (it runs with -I, beside any Python).
"""

import os
import subprocess
import sys
import time

PTH = "_sky_standin_packages.pth"


def target_python(args):
    """The venv's python `uv pip install` targets: --python PATH (the task's setup always names it)."""
    for i, arg in enumerate(args):
        if arg == "--python" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--python="):
            return arg.split("=", 1)[1]
    return None


def venv_info(python):
    code = "import sys, sysconfig; print('%d.%d' % sys.version_info[:2]); print(sysconfig.get_paths()['purelib'])"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    version, purelib = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, check=True,
                                      env=env).stdout.split("\n")[:2]
    return version, purelib


def main(argv):
    real_uv, packages, cache, delay, args = argv[0], argv[1], argv[2], float(argv[3]), argv[4:]
    if args[:2] != ["pip", "install"]:
        os.execv(real_uv, [real_uv, *args])
    if delay:
        time.sleep(delay)
    python = target_python(args)
    if python is None:
        print("sky_uv: `uv pip install` without --python: the stand-in installs into a named venv only", file=sys.stderr)
        return 2
    # 1. The resolution a node does, against PyPI (UV_OFFLINE is the image's: this is the network's part).
    online = {k: v for k, v in os.environ.items() if k != "UV_OFFLINE"}
    online["UV_CACHE_DIR"] = cache
    rest = [a for a in args[2:] if a != "--no-index"]
    resolved = subprocess.run([real_uv, "pip", "install", "--dry-run", *rest], env=online)
    if resolved.returncode != 0:
        return resolved.returncode
    # 2. The download: this machine's packages for the venv's Python (unless --no-deps: then only what ARGS name
    #    comes, a local wheel), then the named wheels themselves.
    if "--no-deps" not in rest:
        version, purelib = venv_info(python)
        paths = os.path.join(packages, f"py{version}", "paths")
        if not os.path.exists(paths):
            print(f"sky_uv: no venv of this machine has Python {version}'s packages (the stand-in's PyPI): give the "
                  f"image a Python that one has (ARTCLOUD_STANDIN_PYTHON)", file=sys.stderr)
            return 1
        with open(paths) as src, open(os.path.join(purelib, PTH), "w") as dst:
            dst.write(src.read())
    os.execv(real_uv, [real_uv, "pip", "install", "--no-deps", "--no-index", *(a for a in rest if a != "--no-deps")])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
