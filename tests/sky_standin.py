"""A stand-in for SkyPilot at artcloud's seam (artcloud/backends/sky_api.py), for tests.

Name it in ARTCLOUD_SKY_API=tests.sky_standin:LocalSky and every SkyPilot call SkyBackend or the CLI makes
lands here. It does the real work behind the edge: `launch` runs the task's own `setup` and `run` commands
as local processes, so the real wheel is pip-installed into a fresh venv and the real `artcloud serve`
answers on loopback. Only what a cloud VM would make different is changed, at the edge:

- the "cluster" is a folder ROOT/clusters/NAME: `home/` is its $HOME (the workdir is copied to
  home/sky_workdir, like SkyPilot's sync), `cluster.json` its state, `job.log` the job's output;
- the server listens on 127.0.0.1 and a free local port (the task's port 8443 maps to it in `endpoint`);
- a task of num_nodes N runs its setup, then its run, on N nodes at once: the head in home/, each worker in
  worker{RANK}-home/ on a loopback address of its own (127.A.B.RANK+1), with SkyPilot's SKYPILOT_NODE_RANK,
  SKYPILOT_NODE_IPS (head first) and SKYPILOT_NUM_NODES; one node failing fails the step and kills the others
  (task_codegen.py:362-402, 497-520, 565-572, 629-664); all nodes' output goes to the one job log;
- the node is a machine image (tests/sky_image.py): the image's own python3 (e.g. 3.10 with
  ARTCLOUD_STANDIN_PYTHON=a 3.10 interpreter, as on Ubuntu 22.04) without the python3-venv package, uv at
  ~/.local/bin/uv and an activated ~/sky-user-env, as SkyPilot 0.14 leaves a node; the task's own setup makes
  its venv and installs the wheel there, its uv resolving for real against PyPI (tests/sky_uv.py);
- the job inherits this machine's environment (HF_HUB_OFFLINE, ...) but not what a cloud VM could not have:
  ARTCLOUD_*, AWS_*, SKYPILOT_*, MODAL_*, PYTHONPATH, this machine's PATH (pyenv, venvs); the model caches are
  shared (ARTCLOUD_CACHE, HF_HOME point at this machine's);
- a detached supervisor process (`python -m tests.sky_standin supervise ROOT NAME JOB`) is the node's skylet: it
  runs the job, setup first, then does SkyPilot's autodown.

What SkyPilot 0.14.1 does, as this stand-in does it (paths under sky/ in skypilot's wheel):
- launch: the cluster is INIT while provisioned, then UP; autostop is set before the job (PRE_EXEC,
  execution.py:646-705); the job is submitted and `launch` returns (execution.py:924 detach_setup, true for every
  cluster but a controller; backends/cloud_vm_ray_backend.py:4158-4166 "Setup detached", :4476 "Job submitted").
  The job's setup runs inside it: SETTING_UP, then RUNNING, or FAILED_SETUP when the setup fails
  (backends/task_codegen.py:535, 998, 1037); setup and run write one log (`sky logs`).
- autodown: idle once no job is active, for `idle_minutes` from the last job's end or autostop's setting
  (skylet/events.py:292-330 StopEvent); the cluster is AUTOSTOPPING while it goes (events.py:362
  set_autostopping_started; backends/backend_utils.py:2822-2848). A failed setup is a finished job: autodowned too.
- status: `sky.status` reads the API server's cache (client/sdk.py:1912 refresh=StatusRefreshMode.NONE;
  utils/common.py:70-71), refreshed by its daemon once a minute (server/daemons.py:161-174): here every
  ARTCLOUD_STANDIN_STATUS_REFRESH_S (default: one "minute"). StatusRefreshMode.AUTO (`status(refresh=True)`), and
  job_status and logs (check_cluster_available, backend_utils.py:3540-3580), refresh a spot or autostop cluster
  whose cache is older than 2 s (backend_utils.py:147, 3329-3346); endpoints read the cache
  (backend_utils.py:4479-4530). A refresh that finds the node gone drops the cluster; STOPPED; INIT 'unhealthy'
  for a broken node, whose autostop it cancels only when the head is dead (backend_utils.py:3120-3183).
- job_status, logs and endpoint answer for UP and AUTOSTOPPING clusters only (backend_utils.py:3625-3643, 4522-4524).

All state is on disk under ARTCLOUD_STANDIN_ROOT (the CLI runs in subprocesses). Every process of a
cluster carries ARTCLOUD_STANDIN_CLUSTER=ROOT/clusters/NAME in its environment: that is how `down` finds
them all, including the ones GNU `timeout` moved into a process group of their own.

Environment:
    ARTCLOUD_STANDIN_ROOT      the folder for all state (required)
    ARTCLOUD_STANDIN_MINUTE_S  seconds in an autostop "minute" (default 60; tests use e.g. 0.5)
    ARTCLOUD_STANDIN_STATUS_REFRESH_S  how old the API server's cached status may grow (default: one "minute")
    ARTCLOUD_STANDIN_HOLD_AUTOSTOP  a file: while it exists, an autostopping cluster stays AUTOSTOPPING
    ARTCLOUD_STANDIN_CLOUDS    enabled clouds, comma-separated (default "local")
    ARTCLOUD_STANDIN_CATALOG   "offline": gpu_offers() cannot read the catalog (returns None)
    ARTCLOUD_STANDIN_NO_CAPACITY  clouds whose offers are sold out: launch fails over to the next cheapest, as
                               SkyPilot's provisioner does (so the launched price differs from the catalog's best)
    ARTCLOUD_STANDIN_PYTHON    the image's python3: an interpreter of this machine (tests/sky_image.py)
    ARTCLOUD_STANDIN_NETWORK   how ports reach the laptop: "direct" (default: host:port), "ingress" (Kubernetes
                               with an ingress, as on kind: an http:// URL with a path, no TCP), "vast" (only
                               port 8080 is forwarded; any other port is announced but nothing answers there)
    ARTCLOUD_STANDIN_FAULT     RecordingSky only: launch_fails, setup_fails, no_health, job_fails, down_fails (comma-separated)
    ARTCLOUD_STANDIN_HOLD_LAUNCH  RecordingSky only: a file; while it exists, a launch that was called (and recorded)
                               waits before the cluster's record is made: SkyPilot's optimizer (execution.py:533-565)
                               and its first region tried, before which `sky status` does not know the cluster (its
                               record is first written in _retry_zones, cloud_vm_ray_backend.py:1251)

No `import sky` here: the real package validates the task in the contract tests.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

from artcloud.backends.sky_api import NO_OPEN_PORTS, ClusterInfo, GPUOffer, Launched
from tests import sky_image

ENV_ROOT = "ARTCLOUD_STANDIN_ROOT"
ENV_MINUTE = "ARTCLOUD_STANDIN_MINUTE_S"
ENV_CLOUDS = "ARTCLOUD_STANDIN_CLOUDS"
ENV_CATALOG = "ARTCLOUD_STANDIN_CATALOG"
ENV_FAULT = "ARTCLOUD_STANDIN_FAULT"
ENV_NETWORK = "ARTCLOUD_STANDIN_NETWORK"
ENV_NO_CAPACITY = "ARTCLOUD_STANDIN_NO_CAPACITY"
ENV_MARKER = "ARTCLOUD_STANDIN_CLUSTER"  # set on every process of a cluster: ROOT/clusters/NAME
ENV_NODE = "ARTCLOUD_STANDIN_NODE"  # and its node's rank
ENV_STATUS_REFRESH = "ARTCLOUD_STANDIN_STATUS_REFRESH_S"
ENV_HOLD_AUTOSTOP = "ARTCLOUD_STANDIN_HOLD_AUTOSTOP"
ENV_HOLD_LAUNCH = "ARTCLOUD_STANDIN_HOLD_LAUNCH"
CACHE_S = 2.0  # CLUSTER_STATUS_CACHE_DURATION_SECONDS (backend_utils.py:147): an AUTO refresh skips a fresher record
SERVES = ("UP", "AUTOSTOPPING")  # the statuses job_status, logs and endpoints answer for

ACTIVE_JOB = ("INIT", "PENDING", "SETTING_UP", "RUNNING")
REPO_ROOT = Path(__file__).resolve().parent.parent
DOWN_GRACE_S = 5.0


class StandinError(RuntimeError):
    """The stand-in is used wrongly (e.g. ARTCLOUD_STANDIN_ROOT is not set)."""


class StandinLaunchError(RuntimeError):
    """Launch failed (like sky.exceptions.CommandError for a failed setup); the message ends with the log's tail."""


class ResourcesUnavailableError(StandinLaunchError):
    """Like sky.exceptions.ResourcesUnavailableError: no enabled cloud offers what the task asks for."""


class ClusterDoesNotExist(ValueError):
    """Like sky.exceptions.ClusterDoesNotExist (a ValueError there too: exceptions.py:366)."""


class ClusterNotUpError(Exception):
    """Like sky.exceptions.ClusterNotUpError (exceptions.py:349): the cluster exists but is not UP/AUTOSTOPPING."""


# ----------------------------------------------------------------------------------------- catalog

_CLOUD_NAMES = {"aws": "AWS", "gcp": "GCP", "azure": "Azure", "lambda": "Lambda", "runpod": "RunPod",
                "kubernetes": "Kubernetes", "local": "Local", "vsphere": "vSphere"}

# (cloud, instance type, accelerator, count, $/h, spot $/h, region): made up, but of the right size.
CATALOG: tuple[GPUOffer, ...] = tuple(GPUOffer(*row) for row in (
    ("local", "local-h100-1", "H100", 1, 2.49, 1.25, "local"),
    ("local", "local-l4-1", "L4", 1, 0.44, 0.22, "local"),
    # the cheapest H100, on a cloud where SkyPilot cannot open a port (vsphere.py:57): artcloud must skip it
    ("vsphere", "vsphere-h100-1", "H100", 1, 1.10, 0.55, "datacenter-1"),
    ("aws", "p5.4xlarge", "H100", 1, 6.88, 2.75, "us-east-1"),
    ("aws", "p5.48xlarge", "H100", 8, 98.32, 39.33, "us-east-1"),
    ("gcp", "a3-highgpu-1g", "H100", 1, 11.06, 3.52, "us-central1"),
    ("gcp", "a3-highgpu-2g", "H100", 2, 22.12, 7.04, "us-central1"),
    ("gcp", "a3-highgpu-8g", "H100", 8, 88.49, 28.16, "us-central1"),
    ("gcp", "a2-ultragpu-1g", "A100-80GB", 1, 5.07, 1.62, "us-central1"),
    ("aws", "p4de.24xlarge", "A100-80GB", 8, 40.97, 16.39, "us-east-1"),
    ("aws", "g6.xlarge", "L4", 1, 0.80, 0.35, "us-east-1"),
    ("gcp", "g2-standard-8", "L4", 1, 0.85, 0.28, "us-central1"),
    ("aws", "g4dn.xlarge", "T4", 1, 0.526, 0.21, "us-east-1"),
    ("gcp", "n1-highmem-4", "T4", 1, 0.59, 0.17, "us-central1"),
    # A cluster of one's own: the price its admin configured, else 0, spot the same (kubernetes_catalog.py:325-346).
    ("kubernetes", "k8s-h100-1", "H100", 1, 0.0, 0.0, "in-cluster"),
))

_CHECK_HINTS = {
    "aws": "credentials not found; run `aws configure`",
    "gcp": "GCP tools are not installed or credentials are not set; run `gcloud init` and "
           "`gcloud auth application-default login`",
    "azure": "Azure CLI credentials not found; run `az login`",
    "lambda": "Lambda Cloud API key not found; put it in ~/.lambda_cloud/lambda_keys",
    # what 0.14.1 says where the runpod SDK is missing (clouds/runpod.py:314-315), as after `pip install artcloud[sky]`
    "runpod": 'Failed to import runpod or TOML parser. Install: pip install "skypilot[runpod]".',
    "kubernetes": "no kubeconfig found at ~/.kube/config",
}
_INSTALL_DOCS = "https://docs.skypilot.co/en/latest/getting-started/installation.html"


def enabled_clouds() -> list[str]:
    return [c.strip().lower() for c in os.environ.get(ENV_CLOUDS, "local").split(",") if c.strip()]


def cloud_display(cloud: str) -> str:
    return _CLOUD_NAMES.get(cloud.lower(), cloud)


# ----------------------------------------------------------------------------------------- disk state

def _root_from_env() -> Path:
    root = os.environ.get(ENV_ROOT)
    if not root:
        raise StandinError(
            f"{ENV_ROOT} is not set: the SkyPilot stand-in keeps its clusters on disk there "
            f"(set it to a temporary folder, e.g. pytest's tmp_path)"
        )
    return Path(root).expanduser().resolve()


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (NotADirectoryError, json.JSONDecodeError):
        return None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically: readers in other processes see the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:6]}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """A lock for read-modify-write of cluster.json (client, CLI and supervisor all write it)."""
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o600)  # FileNotFoundError if the folder is gone
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def _name_lock(root: Path, name: str) -> Iterator[None]:
    """SkyPilot's per-cluster lock: a launch of a name waits for its teardown (by hand or autodown) to end,
    and a teardown never reaches a new cluster of the same name."""
    path = Path(root) / "locks" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _update(folder: Path, change: Callable[[dict[str, Any]], Any]) -> Any:
    """Apply `change` to cluster.json under the lock; None (and nothing done) if the cluster is gone."""
    try:
        with _locked(folder):
            data = _read_json(folder / "cluster.json")
            if data is None:
                return None
            result = change(data)
            _write_json(folder / "cluster.json", data)
            return result if result is not None else data
    except (FileNotFoundError, NotADirectoryError):
        return None


# ----------------------------------------------------------------------------------------- the API server's cache

def _db(root: Path) -> dict[str, Any]:
    """The API server's cluster records (global_user_state): what `sky.status` answers from."""
    return _read_json(Path(root) / "status.json") or {}


def _db_put(root: Path, name: str, record: dict[str, Any] | None) -> None:
    """Write (None: drop) the API server's record of `name`, under the cache's lock."""
    root = Path(root)
    fd = os.open(root / ".status.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        data = _db(root)
        if record is None:
            data.pop(name, None)
        else:
            data[name] = record
        _write_json(root / "status.json", data)
    finally:
        os.close(fd)


def _observed(live: dict[str, Any] | None) -> dict[str, Any] | None:
    """The record a refresh makes of a cluster's live state (None: nothing of it on the cloud)."""
    if live is None:
        return None
    status, init_kind = live["status"], None
    if live.get("autostopping") and status == "UP":
        status = "AUTOSTOPPING"
    elif status == "UP" and live.get("health") == "unhealthy":
        status, init_kind = "INIT", "unhealthy"  # backend_utils.py:3112; global_user_state.py:2762-2767
    elif status == "INIT":
        init_kind = "launching"
    autostop = live.get("autostop") or {}
    return {"status": status, "init_kind": init_kind, "launched_at": live.get("launched_at"),
            "autostop": autostop.get("idle_minutes", -1), "to_down": bool(autostop.get("to_down")),
            "resources": live.get("resources"), "ports": live.get("ports", {}), "spot": bool(live.get("spot")),
            "instance_id": live.get("instance_id"), "updated_at": time.time()}


def _daemon_interval_s() -> float:
    """How often the API server's daemon refreshes every cluster: a minute (server/constants.py:110), scaled."""
    return float(os.environ.get(ENV_STATUS_REFRESH) or os.environ.get(ENV_MINUTE) or 60)


# ----------------------------------------------------------------------------------------- processes

def _proc_state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _alive(pid: int | None) -> bool:
    return bool(pid) and _proc_state(pid) not in (None, "Z", "X")


def _marker_of(pid: int, name: str = ENV_MARKER) -> str | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    prefix = f"{name}=".encode()
    for item in environ.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix):].decode(errors="replace")
    return None


def _kill_node(root: Path, name: str, rank: int) -> None:
    """SIGKILL every process of one node of the cluster (a task SkyPilot cancels). Scanned again until none is left:
    a child the node's shell forks after one scan (its loop's `sleep`) would outlive it."""
    marker = _marker(root, name)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        found = [pid for pid in _live_pids()
                 if _marker_of(pid) == marker and _marker_of(pid, ENV_NODE) == str(rank) and pid != os.getpid()]
        if not found:
            return
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


def _session_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[4])
    except (OSError, IndexError, ValueError):
        return None


def _live_pids() -> Iterator[int]:
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me and _alive(int(entry)):
            yield int(entry)


def _marker(root: Path, name: str) -> str:
    return str(Path(root).resolve() / "clusters" / name)


def cluster_pids(root: str | Path, name: str, *, supervisor_pid: int | None = None) -> set[int]:
    """Every live process of cluster `name`: those with its marker in their environment, and those in the
    supervisor's session (a process that cleared its environment still stays in the session)."""
    marker = _marker(Path(root), name)
    if supervisor_pid is None:
        data = _read_json(Path(marker) / "cluster.json") or {}
        supervisor_pid = data.get("supervisor_pid")
    session = supervisor_pid if supervisor_pid and _marker_of(supervisor_pid) == marker else None
    found = set()
    for pid in _live_pids():
        if _marker_of(pid) == marker or (session is not None and _session_of(pid) == session):
            found.add(pid)
    return found


def down_all(root: str | Path) -> list[str]:
    """Tear down every cluster under `root` (a fixture's last word); returns their names."""
    clusters = Path(root) / "clusters"
    names = sorted(p.name for p in clusters.iterdir() if p.is_dir()) if clusters.is_dir() else []
    sky = LocalSky(root)
    return [name for name in names if sky.down(name)]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def leftover_processes(root: str | Path) -> dict[int, str]:
    """pid -> "CLUSTER: cmdline" for every live process of any cluster under `root`, torn down or not."""
    prefix = str(Path(root).resolve() / "clusters") + os.sep
    found = {}
    for pid in _live_pids():
        marker = _marker_of(pid)
        if marker and marker.startswith(prefix):
            found[pid] = f"{marker[len(prefix):]}: {_cmdline(pid)}"
    return found


def _kill_all(root: Path, name: str, supervisor_pid: int | None, *, grace_s: float = DOWN_GRACE_S) -> None:
    """SIGTERM every process of the cluster, SIGKILL what is left after `grace_s`, wait until none is left."""
    me = os.getpid()
    seen: set[int] = set()
    deadline = time.monotonic() + grace_s
    sig = signal.SIGTERM
    while True:
        pids = cluster_pids(root, name, supervisor_pid=supervisor_pid) - {me}
        if not pids:
            return
        for pid in pids:
            if sig == signal.SIGKILL or pid not in seen:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
        seen |= pids
        if sig == signal.SIGTERM and time.monotonic() > deadline:
            sig = signal.SIGKILL
        time.sleep(0.05)


def _closed_port() -> int:
    """A port on which nothing listens (what a client reaches on Vast for any port but 8080)."""
    return _free_port()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------- the task

def _ports(resources: dict[str, Any]) -> list[int]:
    ports = resources.get("ports")
    if ports is None:
        return []
    out = []
    for item in ports if isinstance(ports, list) else [ports]:
        text = str(item)
        if "-" in text:
            lo, hi = (int(x) for x in text.split("-", 1))
            out.extend(range(lo, hi + 1))
        else:
            out.append(int(text))
    return out


def _accelerator(resources: dict[str, Any]) -> tuple[str, int] | None:
    acc = resources.get("accelerators")
    if not acc:
        return None
    if isinstance(acc, dict):
        name, count = next(iter(acc.items()))
        return str(name), int(count or 1)
    name, _, count = str(acc).partition(":")
    return name, int(float(count)) if count else 1


# ----------------------------------------------------------------------------------------- LocalSky

# Not passed on from this machine's environment: a cloud VM has none of the laptop's settings, and
# whatever the server needs (S3 credentials above all) must reach it as task envs or secrets.
_NOT_INHERITED = ("PATH", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP", "PYTHONUSERBASE",
                  "PYENV_VERSION", "PYENV_ROOT")
_NOT_INHERITED_PREFIXES = ("ARTCLOUD_", "AWS_", "SKYPILOT_", "MODAL_", "PYTEST_")


class LocalSky:
    """SkyPilot's calls (artcloud.backends.sky_api.SkyAPI), done by local processes. See the module docstring."""

    def __init__(self, root: str | Path | None = None):
        self.root = Path(root).expanduser().resolve() if root is not None else _root_from_env()
        (self.root / "clusters").mkdir(parents=True, exist_ok=True)

    # -------------------------------------------------------------------------------- paths and state

    def _dir(self, name: str) -> Path:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"cluster name {name!r} is not valid")
        return self.root / "clusters" / name

    def _state(self, name: str) -> dict[str, Any] | None:
        return _read_json(self._dir(name) / "cluster.json")

    def _job_command(self, task: dict[str, Any]) -> str:
        """The command the job runs (RecordingSky swaps it for scripted faults)."""
        return task.get("run") or ""

    def _setup_command(self, task: dict[str, Any]) -> str:
        """The job's setup (RecordingSky swaps it for scripted faults)."""
        return task.get("setup") or ""

    # -------------------------------------------------------------------------------- the calls

    def launch(self, task: dict[str, Any], *, secrets: dict[str, str], cluster_name: str,
               idle_minutes: int | None, retry_until_up: bool = False) -> Launched:
        task = copy.deepcopy(task)
        self._dir(cluster_name)  # a valid name, before anything is made
        resources = task.get("resources") or {}
        if int(task.get("num_nodes") or 1) < 1:
            raise StandinError(f"num_nodes must be 1 or more, not {task.get('num_nodes')!r}")
        env_task = self._check_envs(task, secrets)
        resources_str, price = self._pick_resources(task, resources)
        nodes = int(task.get("num_nodes") or 1)
        if nodes > 1:  # `sky status`: f"{handle.launched_nodes}x..." (utils/resources_utils.py:456); each node priced
            resources_str = f"{nodes}x" + resources_str[len("1x"):]
            price = None if price is None else price * nodes

        # SkyPilot's per-cluster lock (backend_utils.py:3421, cluster_status_lock_id :4598) while the cluster's
        # record is made: a teardown of the name finishes first.
        with _name_lock(self.root, cluster_name):
            state = self._reserve(cluster_name, resources=resources, resources_str=resources_str,
                                  retry_until_up=retry_until_up, num_nodes=int(task.get("num_nodes") or 1))
        return self._provision_and_submit(task, secrets=secrets, cluster_name=cluster_name, idle_minutes=idle_minutes,
                                          env_task=env_task, state=state, price=price)

    def _reserve(self, cluster_name: str, *, resources: dict[str, Any], resources_str: str,
                 retry_until_up: bool, num_nodes: int = 1) -> dict[str, Any]:
        """The cluster's record (a new job on an idle cluster of the name, or a new cluster), written to disk:
        INIT while it is provisioned, in the API server's records too."""
        folder = self._dir(cluster_name)
        existing = self._state(cluster_name)
        job_id = 1
        if existing is not None:
            job = existing["jobs"].get(str(existing.get("job_id")), {})
            busy = (job.get("status") in ACTIVE_JOB
                    and (_alive(existing.get("supervisor_pid")) or cluster_pids(self.root, cluster_name)))
            if busy:  # SkyPilot would queue the job; artcloud never launches twice onto a busy cluster
                raise StandinLaunchError(
                    f"cluster {cluster_name} is running job {existing.get('job_id')}: the stand-in does not queue jobs")
            job_id = int(existing.get("job_id") or 0) + 1
        folder.mkdir(parents=True, exist_ok=True)
        home = folder / "home"
        workdir = home / "sky_workdir"
        workdir.mkdir(parents=True, exist_ok=True)
        log = folder / "job.log"
        if log.exists():
            log.replace(folder / f"job-{job_id - 1}.log")
        log.touch()

        ports = _ports(resources)
        port_map = {str(p): _free_port() for p in ports}
        now = time.time()
        # The nodes: the head on 127.0.0.1 (where the task's ports are forwarded), each worker on a loopback address
        # of its own (127.A.B.RANK+1, A.B this launch's: two clusters' workers never share one), home in
        # worker{RANK}-home; SKYPILOT_NODE_IPS lists them head first (task_codegen.py:565-572).
        net = f"127.{uuid.uuid4().int % 254 + 1}.{uuid.uuid4().int % 254 + 1}"
        nodes = [{"rank": 0, "ip": "127.0.0.1", "home": "home"}] + [
            {"rank": k, "ip": f"{net}.{k + 1}", "home": f"worker{k}-home"} for k in range(1, num_nodes)]
        state = {
            "name": cluster_name,
            "status": "INIT",
            "launched_at": existing.get("launched_at", now) if existing else now,
            "resources": resources_str,
            "spot": bool(resources.get("use_spot")),
            "autostop": (existing or {}).get("autostop") or {"idle_minutes": -1, "to_down": False, "set_at": now},
            "minute_s": float(os.environ.get(ENV_MINUTE, "60")),
            "ports": port_map,
            "job_id": job_id,
            "jobs": {**(existing or {}).get("jobs", {}),
                     str(job_id): {"status": "INIT", "submitted_at": now, "exit_code": None}},
            "supervisor_pid": None,
            "retry_until_up": bool(retry_until_up),
            "health": "ok", "head_alive": True, "autostopping": False,
            "hold_autostop": os.environ.get(ENV_HOLD_AUTOSTOP),  # the node's environment has no ARTCLOUD_*
            "imds_port": (existing or {}).get("imds_port") or _free_port(),
            "instance_id": (existing or {}).get("instance_id") or uuid.uuid4().hex,  # this machine, not the name
            "nodes": nodes,
        }
        with _locked(folder):
            _write_json(folder / "cluster.json", state)
        _db_put(self.root, cluster_name, _observed(state))
        return state

    def _provision_and_submit(self, task: dict[str, Any], *, secrets: dict[str, str], cluster_name: str,
                              idle_minutes: int | None, env_task: dict[str, str], state: dict[str, Any],
                              price: float | None) -> Launched:
        folder, job_id, port_map = self._dir(cluster_name), state["job_id"], state["ports"]
        home = folder / "home"

        # PROVISION: each node of the image, as SkyPilot leaves it (uv, ~/sky-user-env); the workdir synced to every
        # node (cloud_vm_ray_backend.py:4047-4058); then the cluster is UP.
        image = sky_image.build(self.root)
        for node in state["nodes"]:
            node_home = folder / node["home"]
            (node_home / "sky_workdir").mkdir(parents=True, exist_ok=True)
            sky_image.provision(image, node_home)
            if task.get("workdir"):
                shutil.copytree(Path(task["workdir"]).expanduser(), node_home / "sky_workdir", dirs_exist_ok=True)
        env = self._environment(home, env_task, secrets, image, port_map, task, nodes=state["nodes"])
        env["AWS_EC2_METADATA_SERVICE_ENDPOINT"] = f"http://127.0.0.1:{state['imds_port']}"  # the node's IMDS

        # PRE_EXEC: autostop, before the job (execution.py:646-705), so a job that fails, setup included, is
        # autodowned like any other (the idle clock starts at the job's end).
        def up(data: dict[str, Any]) -> None:
            data["status"] = "UP"
            if idle_minutes is not None:
                data["autostop"] = {"idle_minutes": int(idle_minutes), "to_down": True, "set_at": time.time()}

        # EXEC: the job is submitted with its setup inside (detach_setup, execution.py:924); launch returns.
        setup = self._setup_command(task)
        (folder / "setup.sh").write_text(sky_image.SHELL_PREAMBLE + setup if setup else "")
        (folder / "run.sh").write_text(sky_image.SHELL_PREAMBLE + self._job_command(task))

        def submit(data: dict[str, Any]) -> None:
            up(data)
            data["jobs"][str(job_id)]["status"] = "PENDING"

        live = _update(folder, submit)
        if live is None:
            raise StandinLaunchError(f"cluster {cluster_name} was torn down during launch")
        _db_put(self.root, cluster_name, _observed(live))
        # The supervisor is this machine's Python; the job's PATH and PYTHONPATH (the image's) wait in
        # STANDIN_JOB_* until it starts the job.
        sup_env = {**env, "STANDIN_JOB_PATH": env["PATH"], "STANDIN_JOB_PYTHONPATH": env["PYTHONPATH"],
                   "PATH": os.environ.get("PATH", sky_image.SYSTEM_PATH)}
        sup_env.pop("PYTHONPATH")
        with open(folder / "supervisor.log", "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.sky_standin", "supervise", str(self.root), cluster_name, str(job_id)],
                cwd=REPO_ROOT, env=sup_env, stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )
        _update(folder, lambda d: d.__setitem__("supervisor_pid", proc.pid))
        return Launched(job_id=job_id, price_per_hour=price, resources=state["resources"])

    # -------------------------------------------------------------------------------- the API server's view

    def _refresh(self, cluster_name: str) -> dict[str, Any] | None:
        """A refresh (backend_utils.refresh_cluster_record): look at the cloud, update the cached record. A node
        found broken: SkyPilot tries to cancel the autostop on the head (backend_utils.py:3150-3183). With the
        head alive, or while autostopping, it keeps it; with the head dead the cancel fails, on a VM cloud with
        SSH's 255 and the local autostop is kept ("likely autodowned", :3166-3172), on Kubernetes with kubectl's
        own error and it is set to -1 (:3177-3179)."""
        def look(data: dict[str, Any]) -> None:
            autostop = data.get("autostop") or {}
            on_pods = "kubernetes" in str(data.get("resources") or "").lower()
            if (data.get("status") == "UP" and data.get("health") == "unhealthy" and not data.get("head_alive", True)
                    and on_pods and not data.get("autostopping") and autostop.get("idle_minutes", -1) >= 0):
                data["autostop"] = {"idle_minutes": -1, "to_down": False, "set_at": time.time()}

        record = _observed(_update(self._dir(cluster_name), look))
        _db_put(self.root, cluster_name, record)
        return record

    def _cached(self, cluster_name: str, *, refresh: bool) -> dict[str, Any] | None:
        """The API server's record: refreshed when stale. refresh=True is StatusRefreshMode.AUTO (a spot or
        autostop cluster, or one AUTOSTOPPING, older than 2 s: backend_utils.py:3329-3346); False is NONE, whose
        cache only the daemon refreshes (every ARTCLOUD_STANDIN_STATUS_REFRESH_S)."""
        self._dir(cluster_name)
        record = _db(self.root).get(cluster_name)
        if record is None:
            return None
        age = time.time() - float(record.get("updated_at") or 0)
        if refresh:
            stale = age >= CACHE_S and (record.get("spot") or record["status"] == "AUTOSTOPPING"
                                        or (record["status"] != "STOPPED" and record.get("autostop", -1) >= 0))
        else:
            stale = age >= _daemon_interval_s()
        return self._refresh(cluster_name) if stale else record

    def status(self, cluster_name: str, *, refresh: bool = False) -> ClusterInfo | None:
        record = self._cached(cluster_name, refresh=refresh)
        if record is None:
            return None
        return ClusterInfo(
            name=cluster_name,
            status=record["status"],
            launched_at=record.get("launched_at"),
            autostop_minutes=record.get("autostop", -1),
            to_down=bool(record.get("to_down")),
            resources=record.get("resources"),
            init_kind=record.get("init_kind"),
        )

    def job_status(self, cluster_name: str, job_id: int | None) -> str | None:
        record = self._cached(cluster_name, refresh=True)  # check_cluster_available refreshes (core.py:1481)
        data = self._state(cluster_name)
        if record is None or record["status"] not in SERVES or data is None:
            return None
        job = data["jobs"].get(str(job_id if job_id is not None else data.get("job_id")))
        if job is None:
            return None
        status = job["status"]
        if status in ACTIVE_JOB and data.get("supervisor_pid") and not _alive(data["supervisor_pid"]):
            return "FAILED_DRIVER"  # the supervisor died without recording the job's end
        return status

    def endpoint(self, cluster_name: str, port: int) -> str | None:
        # As sky.endpoints: the cached record (no refresh: backend_utils.py:4511), UP or AUTOSTOPPING, whatever
        # its job does (nothing may listen yet).
        record = self._cached(cluster_name, refresh=False)
        if record is None or record["status"] not in SERVES:
            return None
        local = record.get("ports", {}).get(str(port))
        if not local:
            return None
        network = os.environ.get(ENV_NETWORK, "direct")
        if network == "ingress":  # sky/provision/kubernetes/network.py: HTTPEndpoint(ip, 80, _PATH_PREFIX)
            return f"http://127.0.0.1:80/skypilot/default/{cluster_name}-2ea4/{port}"
        if network == "vast" and int(port) != 8080:  # sky/provision/vast/instance.py: announced, not forwarded
            return f"127.0.0.1:{_closed_port()}"
        return f"127.0.0.1:{local}"

    def logs(self, cluster_name: str, *, follow: bool = False, tail: int = 0) -> Iterator[str]:
        folder = self._dir(cluster_name)
        record = self._cached(cluster_name, refresh=True)  # check_cluster_available refreshes (core.py:1623)
        if record is None:
            raise ClusterDoesNotExist(f"Cluster {cluster_name!r} does not exist.")
        if record["status"] not in SERVES:
            raise ClusterNotUpError(f"Tail logs: skipped for cluster {cluster_name!r} (status: {record['status']}). "
                                    "It is only allowed for UP and AUTOSTOPPING clusters.")
        try:
            f = open(folder / "job.log", "rb")
        except FileNotFoundError as e:
            raise ClusterDoesNotExist(f"Cluster {cluster_name!r} does not exist.") from e
        return self._follow(f, cluster_name, follow=follow, tail=tail)

    def _follow(self, f, cluster_name: str, *, follow: bool, tail: int) -> Iterator[str]:
        with f:
            pending = f.read().decode(errors="replace")
            if not follow:
                lines = pending.splitlines()
                yield from (lines[-tail:] if tail > 0 else lines)
                return
            *lines, pending = pending.split("\n")
            yield from (lines[-tail:] if tail > 0 else lines)
            while follow:
                chunk = f.read()
                if chunk:
                    pending += chunk.decode(errors="replace")
                    *lines, pending = pending.split("\n")
                    yield from lines
                    continue
                status = LocalSky.job_status(self, cluster_name, None)
                if status is None or status not in ACTIVE_JOB:  # ended, or the cluster is gone: drain, stop
                    pending += f.read().decode(errors="replace")
                    *lines, pending = pending.split("\n")
                    yield from lines
                    break
                time.sleep(0.1)
            if pending:
                yield pending

    def autostop(self, cluster_name: str, idle_minutes: int, *, down: bool = True) -> None:
        def change(data: dict[str, Any]) -> None:
            data["autostop"] = {"idle_minutes": int(idle_minutes), "to_down": bool(down) and idle_minutes >= 0,
                                "set_at": time.time()}

        if self._cached(cluster_name, refresh=True) is None or _update(self._dir(cluster_name), change) is None:
            raise ClusterDoesNotExist(f"Cluster {cluster_name!r} does not exist.")
        self._refresh(cluster_name)  # set_cluster_autostop_value: the record says so at once

    def down(self, cluster_name: str) -> bool:
        """`sky down`: terminate what is left of the cluster and drop its record (also a record whose machine
        the cloud already took: a preempted one that no refresh has seen yet)."""
        data = self._state(cluster_name)
        known = _db(self.root).get(cluster_name) is not None
        if data is None and not known:
            return False
        if data is not None:
            _teardown(self.root, cluster_name, data.get("supervisor_pid"))
        _db_put(self.root, cluster_name, None)
        return True

    # -------------------------------------------------------------------------------- what clouds do to clusters
    # These change the cloud (the live state) only: the API server learns of it on its next refresh.

    def stop(self, cluster_name: str) -> None:
        """Like a cloud stopping every node: STOPPED, every process gone, the disk kept. No skylet runs on a
        stopped node: the supervisor's autodown ends with it."""
        data = self._state(cluster_name)
        if data is None:
            raise ClusterDoesNotExist(f"Cluster {cluster_name!r} does not exist.")
        self._set_status(cluster_name, "STOPPED")
        _kill_all(self.root, cluster_name, data.get("supervisor_pid"))

    def preempt(self, cluster_name: str, *, notice_s: float = 120.0) -> None:
        """What a cloud does to a spot VM: the notice on its metadata service (tests/sky_metadata.py), then,
        `notice_s` later (AWS: 2 minutes; 0: no notice at all), the machine terminated: every process gone.
        `status` shows it once refreshed. Blocks until then; a test runs it in a thread. Returns early once the
        cluster is gone anyway (the server exited and autodown took it)."""
        now = time.time()
        data = _update(self._dir(cluster_name), lambda d: d.__setitem__("preemption", {"at": now, "ends_at": now + notice_s}))
        if data is None:
            raise ClusterDoesNotExist(f"Cluster {cluster_name!r} does not exist.")
        machine = data.get("instance_id")

        def same_machine() -> dict[str, Any] | None:  # a new cluster of the same name is another machine
            found = self._state(cluster_name)
            return found if found is not None and found.get("instance_id") == machine else None

        deadline = now + notice_s
        while time.time() < deadline and same_machine() is not None:
            time.sleep(0.1)
        data = same_machine()
        if data is not None:
            _teardown(self.root, cluster_name, data.get("supervisor_pid"), abrupt=True)

    def break_cluster(self, cluster_name: str, *, head_alive: bool = False) -> None:
        """A node gone bad: a refresh then finds the cluster INIT ('unhealthy'). With `head_alive`, its runtime is
        unhealthy but the machine runs (the server may still answer) and autostop stays; without, the machine is
        down (every process gone, its disks and IP still billed) and the refresh cancels its autostop."""
        def change(data: dict[str, Any]) -> None:
            data["health"], data["head_alive"] = "unhealthy", head_alive

        data = _update(self._dir(cluster_name), change)
        if data is None:
            raise ClusterDoesNotExist(f"Cluster {cluster_name!r} does not exist.")
        if not head_alive:
            _kill_all(self.root, cluster_name, data.get("supervisor_pid"))

    def preempt_node(self, cluster_name: str, rank: int) -> None:
        """What a cloud does to one spot VM of a multi-node cluster, with no notice: that node's processes gone at
        once, the others running on. A refresh then finds the cluster INIT 'unhealthy' (backend_utils.py:3112), its
        head alive or not, its autostop kept on a VM cloud (see _refresh). The job's task for the lost node is
        retried by Ray into its placement-group bundle (STRICT_SPREAD: task_codegen.py:465-475), which cannot be
        placed on a node that is gone: its future never resolves, so the job neither fails nor ends while the rest
        run (get_or_fail, task_codegen.py:362-402, waits on it; see supervise). Losing the head loses its skylet,
        the only one (instance_setup.py: only the head starts it), so nothing autodowns the other nodes: here the
        supervisor, which plays both the head's skylet and the job's driver, dies with it."""
        def change(data: dict[str, Any]) -> None:
            data["lost_nodes"] = sorted({*data.get("lost_nodes", []), rank})
            data["health"], data["head_alive"] = "unhealthy", 0 not in data["lost_nodes"]

        data = _update(self._dir(cluster_name), change)
        if data is None:
            raise ClusterDoesNotExist(f"Cluster {cluster_name!r} does not exist.")
        if rank == 0 and data.get("supervisor_pid"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(data["supervisor_pid"], signal.SIGKILL)
        _kill_node(self.root, cluster_name, rank)

    def check_cloud(self, cloud: str) -> str | None:
        """None if enabled, else a reason in `sky check`'s words ('  AWS: disabled' and its Reason: check.py:
        658-682), here shortened to one line with each cloud's own hint."""
        key = cloud.lower()
        if key in enabled_clouds():
            return None
        hint = _CHECK_HINTS.get(key, "not a cloud this SkyPilot knows, or it is not set up")
        return f"{cloud_display(key)}: {hint} (see {_INSTALL_DOCS})"

    def enabled_clouds(self) -> list[str] | None:
        return enabled_clouds()

    def gpu_offers(self, gpu: str) -> list[GPUOffer] | None:
        """sdk.list_accelerators(gpus_only=True, name_filter=...) as InstanceTypeInfo rows (catalog/common.py:56-80)
        from CATALOG; the catalog lives online (facts.md: offline, its fetch fails): ENV_CATALOG=offline."""
        if os.environ.get(ENV_CATALOG, "").lower() == "offline":
            return None
        name = gpu.partition(":")[0].strip().lower()
        return [offer for offer in CATALOG if offer.accelerator.lower() == name]

    # -------------------------------------------------------------------------------- launch's parts

    @staticmethod
    def _check_envs(task: dict[str, Any], secrets: dict[str, str]) -> dict[str, str]:
        """The task's envs as strings, as SkyPilot checks them: a None env is a ValueError (task.py:712-719); a
        secret named with no value and none given is a managed-secret reference nobody resolves, a RuntimeError at
        launch (task.py:721-725; execution.py:160-169). A name in both is no error: the secret wins, as in
        Task.envs_and_secrets (task.py:1325-1328; the job's environment gets the secrets after the envs)."""
        envs = {}
        for key, value in (task.get("envs") or {}).items():
            if value is None:
                raise ValueError(f"Environment variable {key!r} is None. Please set a value for it in task YAML "
                                 f"or with --env flag. To set it to be empty, use an empty string ({key}: \"\" "
                                 f"in task YAML or --env {key}=\"\" in CLI).")
            envs[key] = str(value)
        unresolved = sorted(k for k, v in (task.get("secrets") or {}).items() if v is None and secrets.get(k) is None)
        if unresolved:
            raise RuntimeError(f"No value available for secret(s): {', '.join(unresolved)}. A secret with no inline "
                               "value must be provided at launch with the --secret flag (e.g. --secret NAME=value), "
                               "or resolved by a managed secrets provider. No managed secrets provider is configured.")
        return envs

    def _pick_resources(self, task: dict[str, Any], resources: dict[str, Any]) -> tuple[str, float | None]:
        """Like SkyPilot's optimizer: the cheapest enabled offer that fits (optimizer.py:110, OptimizeTarget.COST),
        failing over past clouds with no capacity (the provisioner's retries, cloud_vm_ray_backend.py:3535-3612),
        as its resources string (what `sky status` shows) and its price per hour (what the launch handle's
        resources cost: Resources.get_cost, resources.py:1847). A cloud pinned but not enabled is refused as
        optimizer.py:1750-1767 refuses it."""
        infra = str(resources.get("infra") or resources.get("cloud") or "").split("/")[0].lower() or None
        clouds = enabled_clouds()
        if infra and infra not in clouds:
            raise ResourcesUnavailableError(
                f"Task requires {cloud_display(infra)} which is not enabled. To enable access, change the task "
                f"cloud requirement or run: sky check")
        acc = _accelerator(resources)
        spot = bool(resources.get("use_spot"))
        if acc is None:
            cloud = infra or clouds[0]
            return f"1x {cloud_display(cloud)}({'[Spot]' if spot else ''}cpu-standin, cpus=8)", None
        name, count = acc
        offers = LocalSky.gpu_offers(self, name)  # not a call of the API: RecordingSky does not record it
        if offers is None:  # catalog offline: take the request as it is
            cloud = infra or clouds[0]
            return f"1x {cloud_display(cloud)}({'[Spot]' if spot else ''}standin, {{'{name}': {count}}})", None
        sold_out = {c.strip().lower() for c in os.environ.get(ENV_NO_CAPACITY, "").split(",") if c.strip()}
        # A task with `ports` needs OPEN_PORTS (resources.py:2379): the optimizer skips clouds without it
        # (clouds/cloud.py:497-510), such as vSphere (vsphere.py:57).
        closed = NO_OPEN_PORTS if _ports(resources) else frozenset()
        fits = [o for o in offers if o.count == count and o.cloud in clouds and (infra is None or o.cloud == infra)
                and o.cloud not in sold_out and o.cloud not in closed]
        if not fits:
            raise ResourcesUnavailableError(
                f"Catalog and request mismatch: no launchable resource found for task {task.get('name') or ''} "
                f"({name}:{count}{' on ' + cloud_display(infra) if infra else ''}, enabled clouds: "
                f"{', '.join(cloud_display(c) for c in clouds)}). To fix: relax its resource requirements. "
                f"Hint: `sky show-gpus {name}` lists the offers.")
        best = min(fits, key=lambda o: (o.spot_price if spot else o.price) or float("inf"))
        return (f"1x {cloud_display(best.cloud)}({'[Spot]' if spot else ''}{best.instance_type}, "
                f"{{'{best.accelerator}': {best.count}}})", best.spot_price if spot else best.price)

    def _environment(self, home: Path, envs: dict[str, str], secrets: dict[str, str], image: sky_image.Image,
                     port_map: dict[str, int], task: dict[str, Any],
                     nodes: list[dict[str, Any]] | None = None) -> dict[str, str]:
        """This machine's environment minus what a VM could not have, the image's (PATH, PYTHONPATH), the
        cluster's HOME, the task's envs and secrets, then the overrides that fit a cloud VM onto loopback."""
        env = {k: v for k, v in os.environ.items()
               if k not in _NOT_INHERITED and not k.startswith(_NOT_INHERITED_PREFIXES)}
        env.update(image.environment())
        # The model caches of this machine, as a machine image could hold them (SmolLM2's dense copy takes
        # tens of seconds to make): the cluster's own HOME would start them empty.
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        env["ARTCLOUD_CACHE"] = os.environ.get("ARTCLOUD_CACHE") or os.path.join(cache, "artcloud")
        env.setdefault("HF_HOME", os.path.join(cache, "huggingface"))
        # The job's SKYPILOT_* variables (skylet/constants.py:641-646; task_codegen.py:629-664), the head's (the
        # supervisor sets HOME and the rank of each node).
        ips = [n["ip"] for n in nodes] if nodes else ["127.0.0.1"]
        env.update(HOME=str(home), SKYPILOT_NODE_RANK="0", SKYPILOT_NUM_NODES=str(len(ips)),
                   SKYPILOT_NODE_IPS="\n".join(ips),
                   SKYPILOT_TASK_ID=f"sky-standin-{uuid.uuid4().hex[:8]}_{home.parent.name}_1")
        acc = _accelerator(task.get("resources") or {})
        env["SKYPILOT_NUM_GPUS_PER_NODE"] = str(acc[1] if acc else 0)
        env.update(envs)
        env.update({k: str(v) for k, v in secrets.items()})
        task_port = envs.get("ARTCLOUD_PORT")
        local_port = port_map.get(str(task_port)) if task_port else None
        if local_port is None and port_map:
            local_port = next(iter(port_map.values()))
        env.update({
            "ARTCLOUD_HOST": "127.0.0.1",
            "ARTCLOUD_PORT": str(local_port or _free_port()),
            ENV_MARKER: str(home.parent),
        })
        if "ARTCLOUD_TRAINER_PORT" in envs:  # the head's rendezvous port: on 127.0.0.1, shared by every cluster here
            env["ARTCLOUD_TRAINER_PORT"] = str(_free_port())
        return env

    def _set_status(self, name: str, status: str, *, job_status: str | None = None,
                    exit_code: int | None = None) -> dict[str, Any] | None:
        def change(data: dict[str, Any]) -> None:
            data["status"] = status
            if job_status is not None:
                job = data["jobs"][str(data["job_id"])]
                job["status"] = job_status
                if exit_code is not None:
                    job["exit_code"] = exit_code
                    job["ended_at"] = time.time()

        return _update(self._dir(name), change)


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _freeze_all(root: Path, name: str, supervisor_pid: int | None) -> None:
    """SIGSTOP every process of the cluster, again until no new one shows up (a child forked meanwhile)."""
    stopped: set[int] = set()
    while pids := cluster_pids(root, name, supervisor_pid=supervisor_pid) - {os.getpid()} - stopped:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGSTOP)
        stopped |= pids


def _teardown(root: Path, name: str, supervisor_pid: int | None, *, abrupt: bool = False) -> None:
    """Like terminating the VM: the folder vanishes at once (atomically, by a rename), then every process
    of the cluster is ended. `abrupt` (a spot machine taken, its notice over or never given): every process is
    frozen first and killed after, so none of them sees its disk gone (on a real VM they go together)."""
    folder = root / "clusters" / name
    trash = root / "trash" / f"{name}-{uuid.uuid4().hex[:8]}"
    trash.parent.mkdir(parents=True, exist_ok=True)
    with _name_lock(root, name):
        with contextlib.suppress(FileNotFoundError):
            with _locked(folder):  # first: no process is frozen holding it
                if abrupt:
                    _freeze_all(root, name, supervisor_pid)
                folder.rename(trash)
        _kill_all(root, name, supervisor_pid, grace_s=0.0 if abrupt else DOWN_GRACE_S)
    shutil.rmtree(trash, ignore_errors=True)


# ----------------------------------------------------------------------------------------- RecordingSky

SECRET = "<secret>"
FAULTS = ("launch_fails", "setup_fails", "no_health", "job_fails", "down_fails")


def _redact(value: Any, secret_values: list[str]) -> Any:
    if isinstance(value, str):
        for s in secret_values:
            value = value.replace(s, SECRET)
        return value
    if isinstance(value, dict):
        return {k: _redact(v, secret_values) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redact(v, secret_values) for v in value]
    return value


class RecordingSky(LocalSky):
    """LocalSky that writes every call to ROOT/calls.jsonl (secret values replaced by "<secret>") and plays
    the faults named in ARTCLOUD_STANDIN_FAULT:

    - launch_fails: launch raises ResourcesUnavailableError (as SkyPilot does when no cloud has capacity);
    - setup_fails: the setup prints an install error and exits 1: the job ends FAILED_SETUP;
    - no_health: the job runs `sleep 3600` instead of the server: RUNNING, but nothing listens on the endpoint;
    - job_fails: the job runs `echo boom >&2; exit 3`;
    - down_fails: down raises ConnectionError (the API server is gone) and the cluster stays up.
    """

    @staticmethod
    def faults() -> set[str]:
        faults = {f.strip() for f in os.environ.get(ENV_FAULT, "").split(",") if f.strip()}
        unknown = faults - set(FAULTS)
        if unknown:
            raise StandinError(f"{ENV_FAULT}: unknown fault(s) {sorted(unknown)}; known: {', '.join(FAULTS)}")
        return faults

    def _record(self, call: str, **kwargs: Any) -> None:
        secrets = kwargs.get("secrets") or {}
        values = sorted((v for v in secrets.values() if isinstance(v, str) and v), key=len, reverse=True)
        if "secrets" in kwargs:
            kwargs["secrets"] = {k: SECRET for k in secrets}
        line = json.dumps({"call": call, "t": time.time(), "kwargs": _redact(kwargs, values)}, default=str)
        with open(self.root / "calls.jsonl", "a") as f:
            f.write(line + "\n")

    def calls(self) -> list[dict[str, Any]]:
        return read_calls(self.root)

    def _setup_command(self, task: dict[str, Any]) -> str:
        if "setup_fails" in self.faults():
            return "echo 'installing artcloud'; echo 'error: the wheel cannot be installed here' >&2; exit 1"
        return super()._setup_command(task)

    def _job_command(self, task: dict[str, Any]) -> str:
        faults = self.faults()
        if "job_fails" in faults:
            return "echo boom >&2; exit 3"
        if "no_health" in faults:
            return "sleep 3600"
        return super()._job_command(task)

    def launch(self, task, *, secrets, cluster_name, idle_minutes, retry_until_up=False):
        self._record("launch", task=task, secrets=secrets, cluster_name=cluster_name, idle_minutes=idle_minutes,
                     retry_until_up=retry_until_up)
        hold = os.environ.get(ENV_HOLD_LAUNCH)
        while hold and os.path.exists(hold):  # a test holds the launch before the cluster exists
            time.sleep(0.05)
        if "launch_fails" in self.faults():
            acc = _accelerator((task or {}).get("resources") or {})
            what = f"{acc[0]}:{acc[1]}" if acc else "the requested resources"
            raise ResourcesUnavailableError(  # cloud_vm_ray_backend.py:3609-3656
                f"Failed to provision all possible launchable resources. Relax the task's resource requirements: "
                f"1x {what} (no capacity in any enabled region). To keep retrying until the cluster is up, use "
                f"the `--retry-until-up` flag.")
        return super().launch(task, secrets=secrets, cluster_name=cluster_name, idle_minutes=idle_minutes,
                              retry_until_up=retry_until_up)

    def status(self, cluster_name, *, refresh=False):
        self._record("status", cluster_name=cluster_name, refresh=refresh)
        return super().status(cluster_name, refresh=refresh)

    def job_status(self, cluster_name, job_id):
        self._record("job_status", cluster_name=cluster_name, job_id=job_id)
        return super().job_status(cluster_name, job_id)

    def endpoint(self, cluster_name, port):
        self._record("endpoint", cluster_name=cluster_name, port=port)
        return super().endpoint(cluster_name, port)

    def logs(self, cluster_name, *, follow=False, tail=0):
        self._record("logs", cluster_name=cluster_name, follow=follow, tail=tail)
        return super().logs(cluster_name, follow=follow, tail=tail)

    def autostop(self, cluster_name, idle_minutes, *, down=True):
        self._record("autostop", cluster_name=cluster_name, idle_minutes=idle_minutes, down=down)
        return super().autostop(cluster_name, idle_minutes, down=down)

    def down(self, cluster_name):
        self._record("down", cluster_name=cluster_name)
        if "down_fails" in self.faults():  # e.g. the API server went away: the cluster stays up
            raise ConnectionError("Could not connect to SkyPilot API server at http://127.0.0.1:46580")
        return super().down(cluster_name)

    def check_cloud(self, cloud):
        self._record("check_cloud", cloud=cloud)
        return super().check_cloud(cloud)

    def enabled_clouds(self):
        self._record("enabled_clouds")
        return super().enabled_clouds()

    def gpu_offers(self, gpu):
        self._record("gpu_offers", gpu=gpu)
        return super().gpu_offers(gpu)


def read_calls(root: str | Path) -> list[dict[str, Any]]:
    """The calls RecordingSky recorded under `root`, oldest first."""
    try:
        text = (Path(root) / "calls.jsonl").read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# ----------------------------------------------------------------------------------------- the supervisor

def supervise(root: Path, name: str, job_id: int) -> int:
    """The node's skylet for one job: run its setup, then its run command (their environment is ours), record its
    end, then play SkyPilot's autostop/autodown."""
    folder = root / "clusters" / name
    setup, run = (folder / "setup.sh").read_text(), (folder / "run.sh").read_text()
    data = _read_json(folder / "cluster.json")
    if data is None:
        return 0
    machine = data.get("instance_id")  # this node: a later cluster of the same name is another one
    if data.get("imds_port"):  # the cloud's metadata service, for as long as the node lives
        from tests import sky_metadata

        sky_metadata.serve(int(data["imds_port"]), lambda: _read_json(folder / "cluster.json"))
    job_env = {**os.environ, "PATH": os.environ["STANDIN_JOB_PATH"], "PYTHONPATH": os.environ["STANDIN_JOB_PYTHONPATH"]}

    nodes = data.get("nodes") or [{"rank": 0, "home": "home"}]

    def step(status: str, script: str) -> int | None:
        """Mark the job `status`, run `script` on every node into the job's log; the first failing node's exit code,
        else 0 (None: the cluster is gone). A node that fails cancels the others, as SkyPilot's get_or_fail does
        (task_codegen.py:362-402: ray.cancel(force=True) of the unready ones)."""
        if _update(folder, lambda d: d["jobs"][str(job_id)].update(status=status, **{f"{status.lower()}_at": time.time()})) is None:
            return None
        with open(folder / "job.log", "ab") as out:
            procs = [subprocess.Popen(["bash", "-c", script], cwd=folder / node["home"] / "sky_workdir",
                                      stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                      env={**job_env, "HOME": str(folder / node["home"]),
                                           "SKYPILOT_NODE_RANK": str(node["rank"]), ENV_NODE: str(node["rank"])})
                     for node in nodes]
            failed: int | None = None
            while True:
                now = _read_json(folder / "cluster.json")
                if now is None or now.get("instance_id") != machine:
                    return None
                lost = set(now.get("lost_nodes") or ())  # preempt_node: their tasks are pending for ever
                live = [(node, p) for node, p in zip(nodes, procs) if node["rank"] not in lost]
                running = [p.poll() is None for _, p in live]
                bad = [p.returncode for _, p in live if p.returncode not in (None, 0)]
                if bad and failed is None:
                    failed = bad[0]
                    for node, p in zip(nodes, procs):
                        if p.poll() is None:
                            _kill_node(root, name, node["rank"])
                if not any(running) and (failed is not None or not lost):  # a failure cancels the pending ones too
                    break
                time.sleep(0.1)
            codes = [p.returncode for _, p in live]
        return failed if failed is not None else next((c for c in codes if c != 0), 0)

    # task_codegen.py:535-537: a failed setup ends the job FAILED_SETUP; the run never starts.
    rc = step("SETTING_UP", setup) if setup else 0
    if rc is None:
        return 0
    final = "FAILED_SETUP" if rc != 0 else None
    if final is None:
        rc = step("RUNNING", run)
        if rc is None:
            return 0
        final = "SUCCEEDED" if rc == 0 else "FAILED"
    if _update(folder, lambda d: d["jobs"][str(job_id)].update(status=final, exit_code=rc, ended_at=time.time())) is None:
        return 0
    print(f"job {job_id} ended {final} (exit code {rc})", flush=True)

    while True:  # autostop (events.py:292-330): idle from the job's end, or from when autostop was last set
        data = _read_json(folder / "cluster.json")
        if (data is None or data.get("instance_id") != machine or data.get("job_id") != job_id
                or data.get("status") != "UP"):
            return 0  # torn down (maybe a new cluster of the name), relaunched (a new supervisor runs the job) or stopped
        autostop = data.get("autostop") or {}
        minutes = autostop.get("idle_minutes", -1)
        if minutes is not None and minutes >= 0:
            idle_since = max(data["jobs"][str(job_id)]["ended_at"], autostop.get("set_at") or 0)
            if time.time() >= idle_since + minutes * float(data.get("minute_s", 60)):
                _update(folder, lambda d: d.__setitem__("autostopping", True))  # events.py:362
                hold = data.get("hold_autostop")
                while hold and os.path.exists(hold):  # a test holds the cluster AUTOSTOPPING
                    time.sleep(0.05)
                if autostop.get("to_down"):
                    print(f"autodown: idle for {minutes} minute(s)", flush=True)
                    _autodown(root, name, machine)
                else:
                    print(f"autostop: idle for {minutes} minute(s)", flush=True)
                    _update(folder, lambda d: d.update(status="STOPPED", autostopping=False))
                    _kill_all(root, name, None)
                return 0
        time.sleep(0.1)


def _autodown(root: Path, name: str, machine: str | None) -> None:
    """The supervisor tears its own cluster down: the other processes first, then the files, and the
    folder vanishes (a rename) only as this process's last act, so that once status() says None, no
    process of the cluster is left."""
    folder = root / "clusters" / name
    with _name_lock(root, name):
        data = _read_json(folder / "cluster.json")
        if data is None or data.get("instance_id") != machine:
            return  # torn down meanwhile, and maybe a new cluster of the name: not this supervisor's to touch
        _kill_all(root, name, None)
        for node in data.get("nodes") or [{"home": "home"}]:
            shutil.rmtree(folder / node["home"], ignore_errors=True)
        trash = root / "trash" / f"{name}-{uuid.uuid4().hex[:8]}"
        trash.parent.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        with contextlib.suppress(FileNotFoundError):
            with _locked(folder):
                folder.rename(trash)
    os._exit(0)  # the few files left under ROOT/trash are not worth a window with a live process


def poweroff(args: list[str]) -> int:
    """`sudo shutdown -h now|+M` (or `sudo poweroff`) on a node (the image's sudo: tests/sky_image.py): what its cloud
    does to a VM that shuts itself down. AWS stops an on-demand instance (its default shutdown behaviour: SkyPilot's
    node_config, sky/templates/aws-ray.yml.j2:70-104, asks for no other) and terminates a one-time spot one; GCP's
    goes TERMINATED. Either way the node's processes end and SkyPilot's refresh finds the cluster abnormal, INIT
    (backend_utils.py:2984-2987), its autostop kept while the head lives (:3141-3144). A node task that was still
    running is retried by Ray into a bundle that cannot be placed, as for a preempted node (`preempt_node`).
    `+M` is systemd's scheduled shutdown: the command returns at once, the node goes M (stand-in) minutes later.
    A Kubernetes pod has no systemd: the command fails there."""
    folder, rank = Path(os.environ[ENV_MARKER]), int(os.environ[ENV_NODE])
    root, name = folder.parent.parent, folder.name
    data = _read_json(folder / "cluster.json")
    if data is None:
        return 1
    if "kubernetes" in str(data.get("resources") or "").lower():
        print("System has not been booted with systemd as init system (PID 1). Can't operate.", file=sys.stderr)
        return 1
    when = next((a for a in args if a == "now" or a.startswith("+")), "now")
    delay = 0.0 if when == "now" else float(when[1:]) * float(data.get("minute_s", 60))
    machine = data.get("instance_id")  # a later cluster of the same name is another machine
    if delay:
        if os.fork():
            print(f"Shutdown scheduled in {when[1:]} minute(s), use 'shutdown -c' to cancel.", flush=True)
            return 0
        os.setsid()
        time.sleep(delay)

    def change(d: dict[str, Any]) -> None:
        if d.get("instance_id") != machine:
            return
        d["stopped_nodes"] = sorted({*d.get("stopped_nodes", []), rank})
        d["lost_nodes"] = sorted({*d.get("lost_nodes", []), rank})
        d["health"], d["head_alive"] = "unhealthy", d.get("head_alive", True) and rank != 0
        _kill_node(root, name, rank)  # under the cluster's lock: no new cluster of the name comes up meanwhile

    _update(folder, change)
    if delay:
        os._exit(0)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[0] == "supervise":
        return supervise(Path(argv[1]), argv[2], int(argv[3]))
    if argv[:1] == ["poweroff"]:
        return poweroff(argv[1:])
    print("usage: python -m tests.sky_standin supervise ROOT NAME JOB_ID | poweroff [-h] [now|+MINUTES]",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
