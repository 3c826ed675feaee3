"""A laptop install with artcloud[sky,s3] and no modal: a Modal command ends in one line that says
`pip install 'artcloud[modal]'`, exit 2, and no traceback. (.venv-laptop has modal for the contract tests:
the CLI runs here with `modal` made unimportable, as an install without it has none.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import one_line_error

from artcloud.backends.state import SandboxRecord, StateDir

REPO = Path(__file__).resolve().parents[2]
WITHOUT_MODAL = "import sys; sys.modules['modal'] = None; from artcloud.cli import main; main()"


def cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ARTCLOUD_HOME": str(tmp_path / "state"), "HOME": str(tmp_path / "home"),
           "PYTHONPATH": str(REPO), "SKYPILOT_DISABLE_USAGE_COLLECTION": "1", "SKYPILOT_DISABLE_LOCAL_API_SERVER": "1",
           "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-c", WITHOUT_MODAL, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def modal_record(tmp_path):
    StateDir(tmp_path / "state").save(SandboxRecord(name="modal-box", provider="modal", state="up", gpu="H100",
                                                    extra={"sandbox_id": "sb-123"}))


@pytest.mark.parametrize("args", [
    ["launch", "--provider", "modal", "--gpu", "H100"],
    ["launch", "--provider", "modal", "--gpu", "H100", "--dry-run"],
    ["run", "examples/ci/train.py", "--backend", "modal", "--s3", "s3://bucket/runs"],
    ["run", "examples/ci/train.py", "--backend", "modal", "--s3", "s3://bucket/runs", "--detach"],
    ["logs", "modal-box"],
    ["down", "modal-box"],
    ["status"],
])
def test_without_modal_a_modal_command_says_what_to_install(tmp_path, modal_record, args):
    summary = tmp_path / "run.json"
    if args[0] == "run":
        args = [*args, "--summary", str(summary)]
    result = cli(tmp_path, *args)
    one_line_error(result, "pip install 'artcloud[modal]'")
    assert not summary.exists()  # refused before anything started
    if args == ["status"]:
        assert "modal-box" in result.stdout  # still listed, its status unknown
