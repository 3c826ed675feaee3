"""Shared fixtures: a real `artcloud serve` process over HTTPS on loopback, with artcloud/tiny-random."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.server_process import ServerProcess

# Never reach a hub or a cloud from a test.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# uv's cache where this machine keeps it, fixed before a test moves HOME: the SkyPilot stand-in's nodes resolve
# their installs against PyPI (tests/sky_uv.py), and its answers are worth keeping between nodes.
os.environ.setdefault("UV_CACHE_DIR",
                      os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "uv"))

# What the processes a test starts leave in their temp folder (a run's data folder, vLLM's IPC sockets) goes in
# one folder per test process, removed when it ends, not loose in /tmp. This process keeps its own (pytest's
# tmp_path lives there, kept for a look after a failure).
tempfile.gettempdir()  # cached before TMPDIR changes
_CHILD_TMP = tempfile.mkdtemp(prefix="artcloud-tests-")
os.environ["TMPDIR"] = _CHILD_TMP
atexit.register(shutil.rmtree, _CHILD_TMP, ignore_errors=True)

TINY = "artcloud/tiny-random"
_REPO = Path(__file__).resolve().parents[1]


def _cuda() -> bool:
    try:
        import torch
    except ImportError:  # .venv-laptop has no torch
        return False
    return torch.cuda.is_available()


# The CUDA-only engine paths (sleep and wake, offloading, 4-bit, dedicated mode) are collected where torch
# sees CUDA: bench/gpu_check.sh on a lent GPU. (A second conftest.py in tests/conformance would shadow this
# module for the tests that `from conftest import ...`.)
collect_ignore = [] if _cuda() else ["conformance/test_cuda.py"]
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


# The files that take longest, longest first (241 s down to 30 s each in a 3-worker run on 2 cores, 2026-12-06;
# test_vllm_server.py, unmeasured there, where earlier runs had it).
# make test runs with `--dist loadfile --no-loadscope-reorder`: xdist then hands whole files to its workers
# in collection order, so a long file left to the end would keep one worker busy while the other idles (the
# two workers' shares came within 21 s of each other, against about a minute with xdist's own order). Order
# only: a file missing here runs after these, in its usual place.
LONGEST_FIRST = (
    "tests/test_sharded.py", "tests/test_sky_spot.py", "tests/test_sky_node_loss.py", "tests/test_fuzz.py",
    "tests/conformance/test_engines.py", "tests/test_vllm_server.py", "tests/test_sky.py", "tests/test_run.py", "tests/test_run_cloud.py",
    "tests/test_sft.py", "tests/test_server_faults.py", "tests/test_sdk.py", "tests/test_modal.py",
    "tests/test_s3_server.py", "tests/test_art_examples.py", "tests/test_s3.py", "tests/test_sky_nodes.py",
    "tests/test_replicas.py", "tests/test_sky_standin.py", "tests/test_final_push.py", "tests/test_cli.py",
    "tests/test_lease.py", "tests/test_history.py", "tests/test_limits.py", "tests/test_fork.py",
    "tests/test_weights.py", "tests/test_resume.py", "tests/test_client_faults.py", "tests/test_sky_edges.py",
    "tests/test_model_state.py", "tests/test_startup.py", "tests/test_smollm2.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(rank)))  # stable: files stay whole


class Server(ServerProcess):
    """`artcloud serve` as a child process, with test-friendly timeouts."""

    def client(self, token: str | None = None, **kw) -> httpx.Client:
        return super().client(token, **{"timeout": 120, **kw})


@pytest.fixture
def start_server(tmp_path):
    servers: list[Server] = []

    def start(path: Path | None = None, *args: str, **kw) -> Server:
        server = Server(path or tmp_path / f"srv{len(servers)}", *args, **kw)
        servers.append(server)  # before start(): a server that fails to come up is still stopped
        return server.start()

    yield start
    for s in servers:
        s.stop()


@contextmanager
def serving_agent(folder: Path, *args: str, project: str = "tests") -> Iterator[Server]:
    """A server (with `args`) that has `agent` registered on artcloud/tiny-random, stopped on exit."""
    server = Server(folder, *args)
    try:
        server.start()
        with server.client() as c:
            r = c.post("/artcloud/models", json={"name": "agent", "project": project, "base_model": TINY})
            assert r.status_code == 200, r.text
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """One server per test module, with `agent` registered on artcloud/tiny-random."""
    with serving_agent(tmp_path_factory.mktemp("tiny") / "data") as server:
        yield server


@pytest.fixture(scope="module")
def one_torch_thread():
    """The tiny model's matrices are small: with other processes on the machine, intra-op threads only
    wait for each other (10x slower). One thread for the module, then back as it was."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_engine_with_adapter(slot: str, scale: float):
    """A CPUEngine on tiny-random with a LoRA adapter whose A and B are random (so it changes the
    function and every LoRA parameter gets a gradient)."""
    import torch

    from artcloud.server.engines.cpu import CPUEngine
    from artcloud.types import LoraConfig

    engine = CPUEngine(TINY)
    engine.create_adapter(slot, LoraConfig(rank=4, alpha=8.0))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in engine.trainer._params(slot):
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return engine


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    """One real S3 server (SeaweedFS) for the whole session."""
    from tests.seaweed import SeaweedS3

    server = SeaweedS3(tmp_path_factory.mktemp("seaweed")).start()
    yield server
    server.stop()


@pytest.fixture
def sky_env(tmp_path, monkeypatch):
    """A temporary HOME, state registry and stand-in cloud; no AWS settings from the real machine."""
    home = tmp_path / "home"
    home.mkdir()
    env = {
        "HOME": str(home),
        "ARTCLOUD_HOME": str(tmp_path / "artcloud-state"),
        "ARTCLOUD_SKY_API": "tests.sky_standin:LocalSky",
        "ARTCLOUD_STANDIN_ROOT": str(tmp_path / "cloud"),
        "ARTCLOUD_STANDIN_MINUTE_S": "0.5",
        "ARTCLOUD_STANDIN_CLOUDS": "local",
        "SKYPILOT_DISABLE_USAGE_COLLECTION": "1",
        "PYTHONPATH": os.pathsep.join([str(_REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),  # CLI runs
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                "ARTCLOUD_S3_ACCESS_KEY_ID", "ARTCLOUD_S3_SECRET_ACCESS_KEY", "ARTCLOUD_S3_ENDPOINT_URL"):
        monkeypatch.delenv(key, raising=False)
    root = tmp_path / "cloud"
    yield root
    # Whatever a test did, nothing it launched may outlive it; what a test left up it asserts on itself.
    from tests.sky_standin import down_all, leftover_processes

    down_all(root)
    assert leftover_processes(root) == {}


@pytest.fixture
def judge():
    """make(*script) -> a scripted OpenAI-compatible judge on loopback (tests/test_ruler.py Judge), closed after."""
    from test_ruler import Judge

    servers: list[Judge] = []

    def make(*script):
        servers.append(Judge(list(script)))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


# ARTCLOUD_TEST_CPU_LOG=FILE: one line per test, "CPU seconds <TAB> wall seconds <TAB> test id", appended by each
# worker. CPU is this process's and its reaped children's (a server a test stopped and waited for counts; a
# process left to someone else does not): what `make test` spends where, for whoever shortens it next.
if os.environ.get("ARTCLOUD_TEST_CPU_LOG"):
    import time as _time

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        def cpu() -> float:
            t = os.times()
            return t.user + t.system + t.children_user + t.children_system

        cpu0, wall0 = cpu(), _time.monotonic()
        yield
        with open(os.environ["ARTCLOUD_TEST_CPU_LOG"], "a") as f:
            f.write(f"{cpu() - cpu0:.2f}\t{_time.monotonic() - wall0:.2f}\t{item.nodeid}\n")
