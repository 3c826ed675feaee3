"""`artcloud serve` started wrongly: one readable line on stderr, exit status 2, nothing half-done."""

from __future__ import annotations

import ast
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import Server
from helpers import one_line_error

from artcloud.tls import client_ssl_context, make_launch_secrets


def serve(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "artcloud", "serve", *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )


def test_port_in_use(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        one_line_error(serve("--path", str(tmp_path / "d"), "--port", str(port)), "already in use", "--port")


def test_path_not_writable(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    one_line_error(serve("--path", str(blocker / "data"), "--port", "0"), "not writable", str(blocker))


def test_half_a_certificate_pair(tmp_path):
    one_line_error(serve("--path", str(tmp_path), "--port", "0", "--tls-cert", "/nonexistent.pem"), "--tls-key")


def test_short_token_is_refused(tmp_path):
    one_line_error(serve("--path", str(tmp_path), "--port", "0", env={"ARTCLOUD_TOKEN": "short"}), "16 characters")


def test_help_teaches():
    out = subprocess.run([sys.executable, "-m", "artcloud", "serve", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for word in ("--path", "--port", "Bearer", "HTTPS"):
        assert word in out.stdout


def test_launcher_supplied_certificate_and_token(tmp_path):
    """The launcher's way: cert, key and token in the environment; the server makes no CA of its own."""
    secrets = make_launch_secrets()
    env = {"ARTCLOUD_TLS_CERT": secrets.server_cert, "ARTCLOUD_TLS_KEY": secrets.server_key, "ARTCLOUD_TOKEN": secrets.token}
    server = Server(tmp_path / "data", env=env)
    server.path.mkdir(parents=True)
    (server.path / ".tls").mkdir(mode=0o700)  # private: the server refuses to write its key into a folder open to others
    (server.path / ".tls" / "ca.pem").write_text(secrets.ca_cert)  # what the client trusts (the server never sees the CA key)
    try:
        server.start()
        headers = {"Authorization": f"Bearer {secrets.token}"}
        with httpx.Client(base_url=server.url, verify=client_ssl_context(secrets.ca_cert), headers=headers) as c:
            assert c.get("/v1/models").status_code == 200
        assert not (server.path / ".tls" / "token").exists()
        log = server.log.read_text()
        assert secrets.token not in log and "PRIVATE KEY" not in log
        assert oct((server.path / ".tls" / "server.key").stat().st_mode & 0o777) == "0o600"
    finally:
        server.stop()


def test_behind_an_https_proxy_the_token_still_guards_every_route(tmp_path):
    """Modal's tunnel ends TLS at its edge: plain HTTP to the proxy, and still no route without the token."""
    import re
    import time

    token = "t" * 32
    env = {**os.environ, "ARTCLOUD_TOKEN": token}
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "artcloud", "serve", "--path", str(tmp_path / "data"), "--port", "0",
                                 "--behind-https-proxy"], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while not (found := re.findall(r"serving plain HTTP on (http://\S+)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        with httpx.Client(base_url=found[0], timeout=30) as c:
            assert c.get("/health").json()["status"] == "ok"
            assert c.get("/v1/models").status_code == 401
            assert c.get("/v1/models", headers={"Authorization": f"Bearer {token}"}).status_code == 200
        assert token not in log.read_text()
    finally:
        proc.terminate()
        proc.wait(30)


def test_behind_an_https_proxy_needs_the_launchers_token(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "ARTCLOUD_TOKEN"}
    result = subprocess.run([sys.executable, "-m", "artcloud", "serve", "--path", str(tmp_path), "--behind-https-proxy"],
                            capture_output=True, text=True, timeout=60, env=env)
    one_line_error(result, "--behind-https-proxy needs the launcher's bearer token")
    secrets = make_launch_secrets()
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text(secrets.server_cert)
    key.write_text(secrets.server_key)
    one_line_error(serve("--path", str(tmp_path), "--behind-https-proxy", "--tls-cert", str(cert), "--tls-key", str(key),
                         env={"ARTCLOUD_TOKEN": "t" * 32}), "drop --tls-cert")


# --- the CLI's modules: no import cycle, each importable alone, all light -------------------------------------

ARTCLOUD = Path(__file__).resolve().parents[1] / "artcloud"
COMMANDS = {"serve", "replica", "trainer-node", "pull", "launch", "status", "logs", "down", "run", "stage-model"}


def _cli_modules() -> dict[str, Path]:
    """Every module of the command line: artcloud/cli.py, cli_*.py or the artcloud/cli/ package."""
    found = {f"artcloud.{p.stem}": p for p in ARTCLOUD.glob("cli*.py")}
    for p in (ARTCLOUD / "cli").glob("*.py"):
        found["artcloud.cli" if p.stem == "__init__" else f"artcloud.cli.{p.stem}"] = p
    return found


def _imports_at_load(path: Path, modules: set[str]) -> set[str]:
    """The CLI modules `path` imports when it is loaded (module level, not inside functions)."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out & modules


def test_cli_modules_import_each_other_in_no_cycle():
    modules = _cli_modules()
    graph = {name: _imports_at_load(path, set(modules)) - {name} for name, path in modules.items()}
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import cycle: {' -> '.join(path + (name,))}"
        if name not in done:
            for dep in graph[name]:
                visit(dep, path + (name,))
            done.add(name)

    for name in graph:
        visit(name, ())
    commands = {n for n in modules if n.startswith("artcloud.cli.") and not n.rsplit(".", 1)[1].startswith("_")}
    assert commands, "artcloud/cli/ holds one module per command group"
    for name in commands:  # a command module imports the app, never another command module
        assert graph[name] <= {"artcloud.cli._app"}, (name, graph[name])


@pytest.mark.parametrize("module", ["artcloud.cli._app", "artcloud.cli.run", "artcloud.cli.cloud", "artcloud.cli.serve",
                                    "artcloud.cli.stage_model"])
def test_each_cli_module_imports_alone_registers_every_command_and_stays_light(module):
    code = (f"import sys, importlib, typer.main; importlib.import_module({module!r}); from artcloud.cli import app; "
            "print(sorted(typer.main.get_command(app).commands)); "
            "print([m for m in ('sky', 'modal', 'boto3', 'torch', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    commands, heavy = out.stdout.splitlines()
    assert set(ast.literal_eval(commands)) == COMMANDS and ast.literal_eval(heavy) == []


# --- a laptop install without an extra: one line that says what to install ------------------------------------

ROOT = ARTCLOUD.parent


def artcloud_cli(tmp_path, *args: str, block: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """The CLI in a subprocess, from the repo root (where `sky/`, the templates folder, is importable as a
    namespace package), with the modules in `block` made unimportable."""
    code = f"import sys; sys.modules.update(dict.fromkeys({list(block)!r})); from artcloud.cli import main; main()"
    env = {**os.environ, "ARTCLOUD_HOME": str(tmp_path / "state"), "HOME": str(tmp_path / "home"),
           "PYTHONPATH": str(ROOT), "SKYPILOT_DISABLE_USAGE_COLLECTION": "1", "SKYPILOT_DISABLE_LOCAL_API_SERVER": "1",
           "COLUMNS": "200"}
    env.pop("ARTCLOUD_SKY_API", None)
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def _sky_record(tmp_path, name: str = "gpu-box") -> None:
    from artcloud.backends.state import SandboxRecord, StateDir

    StateDir(tmp_path / "state").save(SandboxRecord(name=name, provider="sky", state="up", gpu="L4"))


@pytest.mark.parametrize("args", [
    ["launch", "--gpu", "L4", "--dry-run"],
    ["launch", "--gpu", "L4", "--name", "gpu-box"],
    ["run", "examples/ci/train.py", "--backend", "sky", "--s3", "s3://bucket/runs"],
    ["run", "examples/ci/train.py", "--backend", "sky", "--s3", "s3://bucket/runs", "--detach"],
    ["logs", "gpu-box"],
    ["down", "gpu-box"],
])
def test_without_skypilot_a_sky_command_says_what_to_install(tmp_path, args):
    from artcloud.backends.deps import installed

    assert not installed("sky"), "this test runs where SkyPilot is not installed (the server's venv)"
    _sky_record(tmp_path)
    summary = tmp_path / "run.json"
    if args[0] == "run":
        args = [*args, "--summary", str(summary)]
    one_line_error(artcloud_cli(tmp_path, *args), "pip install 'artcloud[sky]'")
    assert not summary.exists()  # refused before anything started


def test_without_skypilot_status_lists_the_sandbox_and_says_what_to_install(tmp_path):
    _sky_record(tmp_path)
    result = artcloud_cli(tmp_path, "status")
    one_line_error(result, "pip install 'artcloud[sky]'")
    assert "gpu-box" in result.stdout and "not installed here" in result.stdout
    as_json = artcloud_cli(tmp_path, "status", "--json")
    one_line_error(as_json, "pip install 'artcloud[sky]'")
    assert '"name": "gpu-box"' in as_json.stdout


def test_without_boto3_pull_says_what_to_install(tmp_path):
    one_line_error(artcloud_cli(tmp_path, "pull", "mail/agent-1", "--s3", "s3://bucket/runs", block=("boto3",)),
                   "pip install 'artcloud[s3]'")


def test_a_cloud_for_the_modal_backend_says_what_artcloud_does_not_pass(tmp_path):
    """Modal's Sandbox.create takes cloud= ("Cloud provider for the sandbox", modal sandbox/_sandbox.py:194, 240):
    the refusal says that artcloud's modal backend does not pass one, not that Modal has no choice."""
    summary = tmp_path / "run.json"
    line = one_line_error(artcloud_cli(tmp_path, "run", "examples/ci/train.py", "--backend", "modal", "--s3",
                                       "s3://bucket/runs", "--cloud", "aws", "--summary", str(summary)),
                          "cloud='aws' is for the sky backend", "modal backend does not pass a cloud to Modal",
                          "--backend sky")
    assert "picks its own" not in line and not summary.exists()
