"""Cold start, phase by phase (issue 18): the server's phase tracker and /health, `--preload`, the stdlib-only
"installing" responder that answers before artcloud is installed, and where the client records the time went."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import threading
from pathlib import Path

import httpx
import pytest
from conftest import TINY
from helpers import find_python, wait_for

import artcloud
from artcloud.server.startup import Startup, read_install_record
from artcloud.tls import client_ssl_context, make_launch_secrets

REPO = Path(__file__).resolve().parents[1]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------------------------------- the tracker


def test_tracker_phases_progress_and_durations():
    clock = Clock()
    s = Startup(started_at=98.0, install_s=75.5, clock=clock)
    assert s.report() == {"phase": "starting", "phase_s": 2.0, "phases": {"installing": 75.5}}
    clock.now = 101.0
    with s.loading():
        clock.now = 103.0
        s.progress(0, 4_000)  # the weights download begins inside the load
        clock.now = 104.0
        s.progress(1_000, 4_000)
        report = s.report()
        assert report["phase"] == "fetching_weights" and report["progress"] == {"done": 1000, "total": 4000, "unit": "bytes"}
        clock.now = 107.0
        s.progress(4_000, 4_000)  # the last byte: the engine loads what came
        assert s.report()["phase"] == "loading_engine" and "progress" not in s.report()
        clock.now = 110.0
    assert s.phase == "starting"  # not ready yet: back where it was
    s.rollout_done(0.5)  # before ready: not the first rollout of a served model
    clock.now = 111.0
    s.mark_ready()
    assert s.report() == {"phase": "ready", "phase_s": 0.0, "phases": {
        "installing": 75.5, "starting": 4.0, "loading_engine": 5.0, "fetching_weights": 4.0}}
    s.rollout_done(0.25)
    s.rollout_done(9.0)  # only the first counts
    clock.now = 200.0
    with s.loading():  # a later base model: loading_engine again, then back to ready; serving time is not counted
        clock.now = 230.0
        assert s.report()["phase"] == "loading_engine"
    assert s.report() == {"phase": "ready", "phase_s": 0.0, "phases": {
        "installing": 75.5, "starting": 4.0, "loading_engine": 35.0, "fetching_weights": 4.0, "first_rollout": 0.25}}


@pytest.mark.parametrize("text", ['{"started": 10, "ended": 5}', '{"started": 1}', "[1, 2]", "not json",
                                  '{"started": 0, "ended": 1e12}', '{"started": "NaN", "ended": 1}'])
def test_install_record_is_untrusted(tmp_path, text):
    path = tmp_path / "install.json"
    path.write_text(text)
    assert read_install_record(path) is None
    assert read_install_record(tmp_path / "missing.json") is None and read_install_record(None) is None
    path.write_text('{"started": 1000.5, "ended": 1090.0}')
    assert read_install_record(path) == 89.5


def test_health_says_loading_while_the_preload_loads(tmp_path):
    """The registry's restore preloads the base model: until the engine is up, /health says not ready and
    loading_engine (then fetching_weights while a download reports bytes); then ready, with the durations."""
    from artcloud.server.engines.choose import engine_factory
    from artcloud.server.registry import Registry

    real = engine_factory("cpu", workdir=tmp_path / ".engines")
    entered, fetch, load = threading.Event(), threading.Event(), threading.Event()

    def factory(base_model: str, *args):  # the real CPU engine, held at each step so the test sees each phase
        entered.set()
        assert fetch.wait(30)
        registry.startup.progress(1_500_000_000, 3_000_000_000)  # what a weights download reports, from its thread
        assert load.wait(30)
        return real(base_model, *args)

    registry = Registry(tmp_path, factory=factory, preload=TINY)

    async def main():
        restore = asyncio.create_task(registry.restore())
        await asyncio.to_thread(entered.wait, 30)
        loading = registry.health()
        fetch.set()
        fetching = await asyncio.to_thread(wait_for, "fetching_weights",
                                           lambda: (h := registry.health())["phase"] == "fetching_weights" and h, 30)
        load.set()
        await restore
        return loading, fetching, registry.health()

    loading, fetching, ready = asyncio.run(main())
    try:
        assert (loading["ready"], loading["phase"]) == (False, "loading_engine") and "progress" not in loading
        assert fetching["ready"] is False and fetching["progress"] == {"done": 1_500_000_000, "total": 3_000_000_000, "unit": "bytes"}
        assert (ready["ready"], ready["phase"], ready["status"]) == (True, "ready", "ok")
        assert set(ready["phases"]) == {"starting", "loading_engine", "fetching_weights"}
        assert list(registry.hosts) == [TINY]  # loaded before ready: the first register finds it
        assert TINY not in json.dumps(ready)  # /health is public: no model names
    finally:
        for host in registry.hosts.values():
            host.close()


# ---------------------------------------------------------------------------------------------- the installing responder


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bootstrap_answers_installing_over_tls_with_the_stdlib_alone(tmp_path, start_server):
    """bootstrap_health.py on Python 3.10 with no site-packages at all (-I -S: the standard library only)
    answers /health over HTTPS with the launch's certificate; stopped, it leaves the install's record, which
    `artcloud serve` reports as the installing phase."""
    made, port, record = make_launch_secrets(hosts=["localhost"]), _free_port(), tmp_path / "rec" / "install.json"
    env = {"PATH": os.environ["PATH"], "ARTCLOUD_TLS_CERT": made.server_cert, "ARTCLOUD_TLS_KEY": made.server_key,
           "ARTCLOUD_PORT": str(port), "ARTCLOUD_HOST": "127.0.0.1", "ARTCLOUD_VERSION": artcloud.__version__}
    proc = subprocess.Popen([find_python("3.10"), "-I", "-S", str(REPO / "artcloud" / "bootstrap_health.py"), "--record", str(record)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ctx = client_ssl_context(made.ca_cert)
        with httpx.Client(base_url=f"https://localhost:{port}", verify=ctx, timeout=5) as c:
            def health():
                try:
                    return c.get("/health")
                except httpx.TransportError:
                    return None

            first = wait_for("bootstrap /health", health, timeout=30)
            assert first.status_code == 200
            body = first.json()
            assert {k: body[k] for k in ("status", "version", "ready", "phase")} == {
                "status": "ok", "version": artcloud.__version__, "ready": False, "phase": "installing"}
            assert body["elapsed_s"] >= 0
            assert c.get("/v1/models").status_code == 404
            with pytest.raises(httpx.TransportError):  # plain HTTP is not served, and does not stop it
                httpx.get(f"http://localhost:{port}/health", timeout=5)
            assert c.get("/health").json()["phase"] == "installing"
        assert json.loads(record.read_text()).keys() == {"started"}
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    saved = json.loads(record.read_text())
    assert saved["ended"] >= saved["started"]
    assert made.server_key not in out

    server = start_server(tmp_path / "srv", env={"ARTCLOUD_INSTALL_RECORD": str(record)})
    with server.client() as c:
        reported = c.get("/health").json()
    assert reported["ready"] is True and reported["phase"] == "ready"
    assert reported["phases"]["installing"] == round(saved["ended"] - saved["started"], 3)
    # Ready without torch (~2 s of CPU at every start; it comes with the first model: train/advantages.py).
    assert "libtorch" not in Path(f"/proc/{server.proc.pid}/maps").read_text()


# ---------------------------------------------------------------------------------------------- the client


def test_register_starts_a_preloading_server_and_records_the_cold_start(tmp_path):
    """model.register on a LocalBackend not yet started starts the server with --preload: /health says ready
    once the base model is loaded, and the backend records provision, start, engine, and (read from the
    server) the first rollout; the run summary renders them."""
    from artcloud.run_summary import render_markdown

    backend = artcloud.LocalBackend(path=tmp_path / "local")

    async def main():
        try:
            model = artcloud.TrainableModel(name="cold", project="t", base_model=TINY)
            await model.register(backend)
            measured = dict(backend.cold_start_s)
            client = model.openai_client()
            await client.chat.completions.create(model=model.name, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            return measured, await backend.cold_start()
        finally:
            await backend.down()

    measured, rows = asyncio.run(main())
    log = (tmp_path / "local" / "server.log").read_text()
    assert f"preloading {TINY}" in log
    assert {"provision", "start", "engine"} <= set(measured) and "weights" not in measured
    assert [r["phase"] for r in rows] == ["provision", "start", "engine", "first rollout"]
    assert all(r["seconds"] > 0 and r["cost_usd"] is None for r in rows)  # a local server has no price
    markdown = render_markdown({"run": "r", "outcome": "succeeded", "cold_start": rows, "models": []})
    assert "### Cold start" in markdown and "| first rollout |" in markdown


def test_wait_ready_shows_phase_and_gigabytes_on_a_terminal():
    from rich.console import Console

    from artcloud.backends.sandbox import StartBar, _server_seconds, describe_phase

    # Provision is the launch's wait less what the server says it spent before answering (install included).
    assert _server_seconds({"phase": "loading_engine", "phase_s": 2.5, "phases": {"installing": 60, "starting": 1.5}}) == 64.0
    assert _server_seconds({"phase": "installing", "elapsed_s": 12.0}) == 12.0
    assert _server_seconds({"phases": {"x": "1e9", "y": True, "z": -4}, "phase_s": float("nan")}) == 0.0

    assert describe_phase({"phase": "fetching_weights", "progress": {"done": 3, "total": 2, "unit": "bytes"}}) == (
        "fetching weights", 2, 2)
    assert describe_phase({"phase": "x", "progress": {"done": True, "total": "9"}}) == ("starting the server", None, None)
    screen = io.StringIO()
    with StartBar("box", console=Console(file=screen, force_terminal=True, width=120)) as bar:
        bar.show({"phase": "fetching_weights", "progress": {"done": 3_100_000_000, "total": 16_000_000_000, "unit": "bytes"}})
        bar._progress.refresh()
    assert "fetching weights" in screen.getvalue() and "3.1/16.0 GB" in screen.getvalue()
    piped = io.StringIO()
    with StartBar("box", console=Console(file=piped)) as bar:  # not a terminal: nothing at all
        bar.show({"phase": "installing"})
    assert piped.getvalue() == ""


@pytest.mark.slow
def test_sky_launch_by_register_reports_install_preload_and_costs(sky_env, monkeypatch):
    """Through the SkyPilot stand-in, which runs the task's real setup and run: SkyBackend ships
    bootstrap_health.py, the setup serves "installing" with it while the wheel installs, and the server then
    reports how long that took; a register that launched the cluster had it preload the base model; each
    phase costs the launched machine's price for its time."""
    from artcloud.backends.sky import SkyBackend

    monkeypatch.setenv("ARTCLOUD_STANDIN_INSTALL_DELAY_S", "3")  # an install the client can watch
    backend = SkyBackend(gpu="H100:1", cluster_name="cold", idle_minutes=1)
    from rich.console import Console

    screen = io.StringIO()  # the launch's progress bar, as a terminal would show it
    backend.progress_console = Console(file=screen, force_terminal=True, width=120)

    async def main():
        try:
            model = artcloud.TrainableModel(name="cold", project="t", base_model=TINY)
            await model.register(backend)
            await model.openai_client().chat.completions.create(
                model=model.name, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            rows = await backend.cold_start()
            folder = sky_env / "clusters" / "cold"  # read before down() takes the "machine" away
            files = [(folder / name).read_text() for name in ("home/artcloud-bootstrap.log", "home/artcloud-install.json", "job.log")]
            return rows, files
        finally:
            await backend.down()

    rows, (bootstrap_log, install_record, job_log) = asyncio.run(main())
    assert "/health (installing)" in bootstrap_log
    # SkyPilot's launch call returns after the setup: the bar watched /health meanwhile and said so.
    assert "installing" in screen.getvalue()  # (the later phases may pass between two polls: not asserted)
    assert [r["phase"] for r in rows] == ["provision", "install", "start", "engine", "first rollout"]
    for r in rows:
        assert r["seconds"] >= 0 and r["cost_usd"] == round(2.49 * r["seconds"] / 3600.0, 6)
    record = json.loads(install_record)
    assert rows[1]["seconds"] == round(record["ended"] - record["started"], 3)
    assert f"preloading {TINY}" in job_log
