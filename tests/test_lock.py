"""The locks (artcloud/locks/): shipped in both wheels, current with pyproject.toml's extras and with this
version, found by extras with a clear error when there is none; the image path (launchers/Dockerfile,
SkyBackend(image=)) installs nothing at launch.

A lock left behind by a change to pyproject.toml's extras or to the version fails here: run `make lock`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

from artcloud import locks
from artcloud._version import __version__
from artcloud.backends.sky_task import build_task
from artcloud.backends.wheel import build_wheel
from artcloud.errors import InvalidArgument
from artcloud.locks import linux_environment
from artcloud.tls import make_launch_secrets

REPO = Path(__file__).resolve().parents[1]
BASH = shutil.which("bash") or "/bin/bash"
# The Pythons each lock serves (requires-python and up; vLLM 0.32 needs 3.11; gpu has no cp313 cuda-python).
PYTHONS = {"gpu": ["3.11", "3.12"], "server": ["3.10", "3.11", "3.12", "3.13"]}


def extra_requirements(extra: str, python: str) -> list[str]:
    """What pyproject.toml asks for `artcloud[extra]` on Linux x86_64, CPython `python`: the base
    dependencies, the extra's, and those of the extras it names (artcloud[server] in gpu)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    env = linux_environment(python)
    out, todo, seen = list(project["dependencies"]), [extra], set()
    while todo:
        name = todo.pop()
        seen.add(name)
        for line in project["optional-dependencies"][name]:
            req = Requirement(line)
            if req.name == "artcloud":
                todo += sorted(req.extras - seen)
            elif req.marker is None or req.marker.evaluate(env):
                out.append(line)
    return out


def test_the_locks_of_the_server_extras_are_there():
    assert locks.available() == sorted(PYTHONS)


@pytest.mark.parametrize("extra", sorted(PYTHONS))
def test_a_lock_pins_every_requirement_of_its_extra_at_a_version_it_allows(extra):
    text = locks.lock_path(extra).read_text()
    for python in PYTHONS[extra]:
        wanted = extra_requirements(extra, python)
        assert len(wanted) > 10 and any(r.startswith("torch") for r in wanted)
        locks.check_covers(text, wanted, python=python, where=f"artcloud/locks/{extra}.txt")


@pytest.mark.parametrize("extra", sorted(PYTHONS))
def test_a_lock_carries_this_artclouds_version(extra):
    text = locks.lock_path(extra).read_text()
    assert text.splitlines()[0] == locks.HEADER.format(version=__version__, name=extra)
    version, name, pins = locks.read_lock(text)
    assert (version, name) == (__version__, extra) and len(pins) > 100


@pytest.mark.parametrize("extra", sorted(PYTHONS))
def test_a_sandbox_gets_a_python_its_lock_serves(extra):
    """ARTCLOUD_PYTHON (the node's venv: the image's python3 if it is one of these, else uv's CPython) is the
    Pythons checked here, from the one `make lock` resolves for."""
    from packaging.specifiers import SpecifierSet

    wanted = SpecifierSet(locks.python_request(extra))
    assert [v for v in ("3.9", "3.10", "3.11", "3.12", "3.13", "3.14") if wanted.contains(f"{v}.0")] == PYTHONS[extra]
    assert f"$(call LOCK_ONE,{extra},{PYTHONS[extra][0]})" in (REPO / "Makefile").read_text()


@pytest.mark.parametrize("extra,laptop,image", [("gpu", (3, 10), "3.11"), ("gpu", (3, 12), "3.12"),
                                                ("gpu", (3, 13), "3.12"), ("server", (3, 13), "3.13"),
                                                ("server", (3, 10), "3.10")])
def test_an_image_gets_the_python_its_lock_serves_nearest_the_laptops(extra, laptop, image):
    assert locks.python_near(extra, laptop) == image  # Modal's server_image: a 3.13 laptop once got a 3.13 image


def test_a_stale_lock_fails_the_check():
    text = locks.lock_path("gpu").read_text()
    with pytest.raises(locks.NoLock, match=r"stale: it pins vllm==0\.32\.0, and artcloud asks for vllm==0\.33\.0: "
                                           r"run `make lock`") as raised:
        locks.check_covers(text, ["vllm==0.33.0"], python="3.11")
    assert raised.value.code == "lock_stale"
    with pytest.raises(locks.NoLock, match="pins no wandb for Python 3.11 on Linux"):
        locks.check_covers(text, ["wandb>=0.19"], python="3.11")
    old = text.replace(f"# artcloud {__version__} ", "# artcloud 0.0.9 ", 1)
    assert locks.read_lock(old)[0] == "0.0.9"  # what test_a_lock_carries_this_artclouds_version catches


def test_the_locks_are_in_the_wheel_artcloud_builds(tmp_path):
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as zf:
        for extra in PYTHONS:
            assert zf.read(f"artcloud/locks/{extra}.txt").decode() == locks.lock_path(extra).read_text()
    assert locks.lock_from_wheel(wheel, "GPU") == locks.lock_path("gpu").read_text()


def test_the_locks_are_in_the_wheel_setuptools_builds(tmp_path):
    """The release's wheel (pyproject's package-data), built offline from a copy of the sources."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, src / name)
    for folder in ("artcloud", "sky"):
        shutil.copytree(REPO / folder, src / folder, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("artcloud-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        assert {n for n in zf.namelist() if n.startswith("artcloud/locks/")} == {
            "artcloud/locks/__init__.py", "artcloud/locks/gpu.txt", "artcloud/locks/server.txt"}
    assert locks.lock_from_wheel(wheel, "server") == locks.lock_path("server").read_text()


@pytest.mark.parametrize("extras,name", [("gpu", "gpu"), (" GPU ", "gpu"), (["server"], "server"),
                                         ("s3,gpu", "gpu,s3"), ("Gpu_Extra", "gpu-extra")])
def test_lock_names(extras, name):
    assert locks.lock_name(extras) == name


@pytest.mark.parametrize("extras", ["", "gpu;rm -rf /", "../gpu", ",", [3], "gpu]"])
def test_malformed_extras_are_refused_with_the_field_and_the_fix(extras):
    with pytest.raises(InvalidArgument, match=r"extras .* is not a list of extra names: write them separated by "
                                              r"commas, e.g. 'gpu' \(locks: gpu, server\)|give extra names as strings") as raised:
        locks.lock_path(extras)
    assert raised.value.field == "extras"


def test_an_unknown_extra_says_which_locks_there_are(tmp_path):
    with pytest.raises(locks.NoLock, match=rf"artcloud {re.escape(__version__)} ships no lock for the extras 'wandb': "
                                           "it has locks for gpu, server") as raised:
        locks.lock_path("wandb")
    assert raised.value.code == "no_lock" and raised.value.field == "extras"
    wheel = tmp_path / "artcloud-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("artcloud/locks/server.txt", "x")
    with pytest.raises(locks.NoLock, match=r"ships no lock for the extras 'gpu' \(it has: server\)"):
        locks.lock_from_wheel(wheel, "gpu")


@pytest.mark.parametrize("text,where", [
    ("", "does not start with '# artcloud VERSION lock for extras: EXTRAS'"),
    ("torch==2.13.0\n", "does not start with"),
    ("# artcloud 0.1.0 lock for extras: gpu\n# via\ntorch>=2\n", r"damaged at line 3 \('torch>=2', not NAME==VERSION\)"),
    ("# artcloud 0.1.0 lock for extras: gpu\n", "pins nothing"),
])
def test_a_damaged_lock_names_its_line(text, where):
    with pytest.raises(locks.NoLock, match=where) as raised:
        locks.read_lock(text)
    assert raised.value.code == "lock_damaged"


# ----------------------------------------------------------------------------------------- the prebuilt image


def test_an_image_task_installs_nothing_at_launch(tmp_path):
    """SkyBackend(image=...): the image has artcloud (launchers/Dockerfile), so the task's setup, run here
    as SkyPilot would, exits at once: no venv, no uv, no lock."""
    made = make_launch_secrets()
    secrets = {"ARTCLOUD_TOKEN": made.token, "ARTCLOUD_TLS_CERT": made.server_cert, "ARTCLOUD_TLS_KEY": made.server_key}
    task = build_task(secrets=secrets, image="docker:registry.example/artcloud-server:1")
    envs = task.config["envs"]
    assert envs["ARTCLOUD_INSTALL"] == "0" and envs["ARTCLOUD_WHEEL"] == "" and "workdir" not in task.config
    home = tmp_path / "home"
    home.mkdir()
    out = subprocess.run([BASH, "-c", task.config["setup"]], cwd=home, capture_output=True, text=True,
                         env={**envs, "HOME": str(home), "PATH": "/usr/bin:/bin"})
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")
    assert list(home.iterdir()) == []
    # and the same setup without the image installs (it fails here at once: no uv, no python3 -m venv target)
    envs["ARTCLOUD_INSTALL"] = "1"
    out = subprocess.run([BASH, "-c", task.config["setup"]], cwd=home, capture_output=True, text=True,
                         env={**envs, "HOME": str(home), "PATH": str(tmp_path / "nothing")})
    assert out.returncode != 0


def test_the_dockerfile_installs_the_lock_in_a_layer_before_artcloud():
    """No docker on this machine: the layer order is read from the Dockerfile."""
    steps = [line for line in (REPO / "launchers" / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
             if re.match(r"(FROM|COPY|RUN|ARG|ENV) ", line)]
    first = lambda word: next(i for i, step in enumerate(steps) if word in step)  # noqa: E731
    lock_copy, lock_install = first("COPY artcloud/locks/*.txt"), first('-r "/tmp/artcloud-locks/${ARTCLOUD_EXTRAS}.txt"')
    own_copy, own_install = first("COPY launchers/Dockerfile dist*"), first("--no-deps")
    assert lock_copy < lock_install < first("ARG ARTCLOUD_VERSION") < own_copy <= own_install
    assert first("ARG ARTCLOUD_WHEEL") > lock_install  # a changed ARG would miss the lock layer's cache
    assert "uv pip install" in steps[lock_install] and "uv pip install" in steps[own_install]
    assert "cmp " in steps[own_install]  # the installed artcloud ships the lock the layer installed
    for extra in PYTHONS:
        assert (REPO / "artcloud" / "locks" / f"{extra}.txt").is_file()
    assert os.path.basename(locks.lock_path("gpu")) == "gpu.txt"  # the Dockerfile's and the setup's naming
