"""A stand-in for SkyPilot at artcloud's seam (artcloud/backends/sky_api.py), for tests.

Name it in ARTCLOUD_SKY_API=tests.sky_standin:LocalSky and every SkyPilot call SkyBackend or the CLI makes
lands here. It does the real work behind the edge: `launch` runs the task's own `setup` and `run` commands
as local processes, so the real wheel is pip-installed into a fresh venv and the real `artcloud serve`
answers on loopback. Only what a cloud VM would make different is changed, at the edge:

- the "cluster" is a folder ROOT/clusters/NAME: `home/` is its $HOME (the workdir is copied to
  home/sky_workdir, like SkyPilot's sync), `cluster.json` its state, `job.log` the job's output;
- the server listens on 127.0.0.1 and a free local port (the task's port 8443 maps to it in `endpoint`);
- the node is a machine image (tests/sky_image.py): the image's own python3 (3.10 with
  ARTCLOUD_STANDIN_PYTHON=.venv-py3.10/bin/python, as on Ubuntu 22.04) without the python3-venv package, uv at
  ~/.local/bin/uv and an activated ~/sky-user-env, as SkyPilot 0.14 leaves a node; the task's own setup makes
  its venv and installs the wheel there (`--no-deps --no-index`: the image's preinstalled packages stand in
  for PyPI);
- the job inherits this machine's environment (HF_HUB_OFFLINE, ...) but not what a cloud VM could not have:
  ARTCLOUD_*, AWS_*, SKYPILOT_*, MODAL_*, PYTHONPATH, this machine's PATH (pyenv, venvs); the model caches are
  shared (ARTCLOUD_CACHE, HF_HOME point at this machine's);
- a detached supervisor process (`python -m tests.sky_standin supervise ROOT NAME JOB`) runs the job and
  then does SkyPilot's autodown: `idle_minutes` x ARTCLOUD_STANDIN_MINUTE_S seconds after the job ended,
  the cluster is torn down.

All state is on disk under ARTCLOUD_STANDIN_ROOT (the CLI runs in subprocesses). Every process of a
cluster carries ARTCLOUD_STANDIN_CLUSTER=ROOT/clusters/NAME in its environment: that is how `down` finds
them all, including the ones GNU `timeout` moved into a process group of their own.

Environment:
    ARTCLOUD_STANDIN_ROOT      the folder for all state (required)
    ARTCLOUD_STANDIN_MINUTE_S  seconds in an autostop "minute" (default 60; tests use e.g. 0.5)
    ARTCLOUD_STANDIN_CLOUDS    enabled clouds, comma-separated (default "local")
    ARTCLOUD_STANDIN_CATALOG   "offline": gpu_offers() cannot read the catalog (returns None)
    ARTCLOUD_STANDIN_NO_CAPACITY  clouds whose offers are sold out: launch fails over to the next cheapest, as
                               SkyPilot's provisioner does (so the launched price differs from the catalog's best)
    ARTCLOUD_STANDIN_PYTHON    the image's Python: a venv's python of this machine (tests/sky_image.py)
    ARTCLOUD_STANDIN_NETWORK   how ports reach the laptop: "direct" (default: host:port), "ingress" (Kubernetes
                               with an ingress, as on kind: an http:// URL with a path, no TCP), "vast" (only
                               port 8080 is forwarded; any other port is announced but nothing answers there)
    ARTCLOUD_STANDIN_FAULT     RecordingSky only: launch_fails, no_health, job_fails, down_fails (comma-separated)

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

from artcloud.backends.sky_api import ClusterInfo, GPUOffer, Launched
from tests import sky_image

ENV_ROOT = "ARTCLOUD_STANDIN_ROOT"
ENV_MINUTE = "ARTCLOUD_STANDIN_MINUTE_S"
ENV_CLOUDS = "ARTCLOUD_STANDIN_CLOUDS"
ENV_CATALOG = "ARTCLOUD_STANDIN_CATALOG"
ENV_FAULT = "ARTCLOUD_STANDIN_FAULT"
ENV_NETWORK = "ARTCLOUD_STANDIN_NETWORK"
ENV_NO_CAPACITY = "ARTCLOUD_STANDIN_NO_CAPACITY"
ENV_MARKER = "ARTCLOUD_STANDIN_CLUSTER"  # set on every process of a cluster: ROOT/clusters/NAME

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
    """Like sky.exceptions.ClusterDoesNotExist (a ValueError there too)."""


# ----------------------------------------------------------------------------------------- catalog

_CLOUD_NAMES = {"aws": "AWS", "gcp": "GCP", "azure": "Azure", "lambda": "Lambda", "runpod": "RunPod",
                "kubernetes": "Kubernetes", "local": "Local"}

# (cloud, instance type, accelerator, count, $/h, spot $/h, region): made up, but of the right size.
CATALOG: tuple[GPUOffer, ...] = tuple(GPUOffer(*row) for row in (
    ("local", "local-h100-1", "H100", 1, 2.49, 1.25, "local"),
    ("local", "local-l4-1", "L4", 1, 0.44, 0.22, "local"),
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
))

_CHECK_HINTS = {
    "aws": "credentials not found; run `aws configure`",
    "gcp": "GCP tools are not installed or credentials are not set; run `gcloud init` and "
           "`gcloud auth application-default login`",
    "azure": "Azure CLI credentials not found; run `az login`",
    "lambda": "Lambda Cloud API key not found; put it in ~/.lambda_cloud/lambda_keys",
    "runpod": "RunPod API key not found; run `runpod config`",
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


# ----------------------------------------------------------------------------------------- processes

def _proc_state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _alive(pid: int | None) -> bool:
    return bool(pid) and _proc_state(pid) not in (None, "Z", "X")


def _marker_of(pid: int) -> str | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    prefix = f"{ENV_MARKER}=".encode()
    for item in environ.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix):].decode(errors="replace")
    return None


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

    # -------------------------------------------------------------------------------- the calls

    def launch(self, task: dict[str, Any], *, secrets: dict[str, str], cluster_name: str,
               idle_minutes: int | None, retry_until_up: bool = False) -> Launched:
        task = copy.deepcopy(task)
        self._dir(cluster_name)  # a valid name, before anything is made
        resources = task.get("resources") or {}
        if int(task.get("num_nodes") or 1) != 1:
            raise StandinError("the stand-in runs single-node tasks only")
        env_task = self._check_envs(task, secrets)
        resources_str, price = self._pick_resources(task, resources)

        # SkyPilot's cluster lock while the cluster's record is made: a teardown of the name finishes first.
        with _name_lock(self.root, cluster_name):
            state = self._reserve(cluster_name, resources=resources, resources_str=resources_str,
                                  retry_until_up=retry_until_up)
        return self._provision_and_submit(task, secrets=secrets, cluster_name=cluster_name, idle_minutes=idle_minutes,
                                          env_task=env_task, state=state, price=price)

    def _reserve(self, cluster_name: str, *, resources: dict[str, Any], resources_str: str,
                 retry_until_up: bool) -> dict[str, Any]:
        """The cluster's record (a new job on an idle cluster of the name, or a new cluster), written to disk."""
        folder = self._dir(cluster_name)
        existing = self._state(cluster_name)
        job_id = 1
        if existing is not None:
            job = existing["jobs"].get(str(existing.get("job_id")), {})
            busy = (job.get("status") in ACTIVE_JOB
                    and (_alive(existing.get("supervisor_pid")) or cluster_pids(self.root, cluster_name)))
            if busy:
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
        state = {
            "name": cluster_name,
            "status": "INIT",
            "launched_at": existing.get("launched_at", now) if existing else now,
            "resources": resources_str,
            "autostop": {"idle_minutes": -1, "to_down": False, "set_at": now},
            "minute_s": float(os.environ.get(ENV_MINUTE, "60")),
            "ports": port_map,
            "job_id": job_id,
            "jobs": {**(existing or {}).get("jobs", {}),
                     str(job_id): {"status": "INIT", "submitted_at": now, "exit_code": None}},
            "supervisor_pid": None,
            "retry_until_up": bool(retry_until_up),
            "imds_port": (existing or {}).get("imds_port") or _free_port(),
            "instance_id": (existing or {}).get("instance_id") or uuid.uuid4().hex,  # this machine, not the name
        }
        with _locked(folder):
            _write_json(folder / "cluster.json", state)
        return state

    def _provision_and_submit(self, task: dict[str, Any], *, secrets: dict[str, str], cluster_name: str,
                              idle_minutes: int | None, env_task: dict[str, str], state: dict[str, Any],
                              price: float | None) -> Launched:
        folder, job_id, port_map = self._dir(cluster_name), state["job_id"], state["ports"]
        home = folder / "home"
        workdir = home / "sky_workdir"
        log = folder / "job.log"

        # "Provisioning": a node of the image, as SkyPilot leaves it (uv, ~/sky-user-env).
        image = sky_image.build(self.root)
        sky_image.provision(image, home)
        if task.get("workdir"):
            shutil.copytree(Path(task["workdir"]).expanduser(), workdir, dirs_exist_ok=True)

        env = self._environment(home, env_task, secrets, image, port_map, task)
        env["AWS_EC2_METADATA_SERVICE_ENDPOINT"] = f"http://127.0.0.1:{state['imds_port']}"  # the node's IMDS
        self._set_status(cluster_name, "UP", job_status="SETTING_UP")

        setup = task.get("setup")
        if setup:
            with open(log, "ab") as out:
                rc = subprocess.run(["bash", "-c", sky_image.SHELL_PREAMBLE + setup], cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True).returncode
            if rc != 0:
                if self._set_status(cluster_name, "UP", job_status="FAILED_SETUP", exit_code=rc) is None:
                    raise StandinLaunchError(f"cluster {cluster_name} was torn down during setup")
                raise StandinLaunchError(
                    f"Failed to run setup commands on cluster {cluster_name} (exit code {rc}). "
                    f"Last lines of the job log:\n{_tail(log, 20)}")

        # SkyPilot sets autostop after setup, just before the job is submitted (a failed setup leaves the
        # cluster UP with no autostop: whoever launched it must take it down).
        run = self._job_command(task)
        (folder / "run.sh").write_text(sky_image.SHELL_PREAMBLE + run)

        def submit(data: dict[str, Any]) -> None:
            data["jobs"][str(job_id)]["status"] = "PENDING"
            if idle_minutes is not None:
                data["autostop"] = {"idle_minutes": int(idle_minutes), "to_down": True, "set_at": time.time()}

        if _update(folder, submit) is None:
            raise StandinLaunchError(f"cluster {cluster_name} was torn down during launch")
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

    def status(self, cluster_name: str) -> ClusterInfo | None:
        data = self._state(cluster_name)
        if data is None:
            return None
        autostop = data.get("autostop") or {}
        return ClusterInfo(
            name=cluster_name,
            status=data["status"],
            launched_at=data.get("launched_at"),
            autostop_minutes=autostop.get("idle_minutes", -1),
            to_down=bool(autostop.get("to_down")),
            resources=data.get("resources"),
        )

    def job_status(self, cluster_name: str, job_id: int | None) -> str | None:
        data = self._state(cluster_name)
        if data is None or data["status"] != "UP":
            return None
        job = data["jobs"].get(str(job_id if job_id is not None else data.get("job_id")))
        if job is None:
            return None
        status = job["status"]
        if status in ("PENDING", "RUNNING") and data.get("supervisor_pid") and not _alive(data["supervisor_pid"]):
            return "FAILED_DRIVER"  # the supervisor died without recording the job's end
        return status

    def endpoint(self, cluster_name: str, port: int) -> str | None:
        data = self._state(cluster_name)
        # As sky.endpoints: a cluster that is UP has its ports, whatever its job does (SkyPilot sets UP before
        # the task's setup runs; nothing may listen yet).
        if data is None or data["status"] != "UP":
            return None
        local = data.get("ports", {}).get(str(port))
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
        if self._state(cluster_name) is None:
            raise ClusterDoesNotExist(f"Cluster {cluster_name!r} does not exist.")
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

        if _update(self._dir(cluster_name), change) is None:
            raise ClusterDoesNotExist(f"Cluster {cluster_name!r} does not exist.")

    def down(self, cluster_name: str) -> bool:
        data = self._state(cluster_name)
        if data is None:
            return False
        _teardown(self.root, cluster_name, data.get("supervisor_pid"))
        return True

    # -------------------------------------------------------------------------------- what clouds do to clusters

    def stop(self, cluster_name: str) -> None:
        """Like `sky stop` (or a cloud stopping every node): STOPPED, every process gone, the disk kept. No
        skylet runs on a stopped node: the supervisor's autodown ends with it."""
        data = self._state(cluster_name)
        if data is None:
            raise ClusterDoesNotExist(f"Cluster {cluster_name!r} does not exist.")
        self._set_status(cluster_name, "STOPPED")
        _kill_all(self.root, cluster_name, data.get("supervisor_pid"))

    def preempt(self, cluster_name: str, *, notice_s: float = 120.0) -> None:
        """What a cloud does to a spot VM: the notice on its metadata service (tests/sky_metadata.py), then,
        `notice_s` later (AWS: 2 minutes; 0: no notice at all), the machine terminated: every process gone,
        the cluster gone from `status`. Blocks until then; a test runs it in a thread. Returns early once the
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
            _teardown(self.root, cluster_name, data.get("supervisor_pid"))

    def break_cluster(self, cluster_name: str) -> None:
        """What SkyPilot's refresh does to a cluster whose node is broken: INIT (unhealthy), autostop cancelled;
        the node (and whatever bills on it) is still there."""
        def change(data: dict[str, Any]) -> None:
            data["status"] = "INIT"
            data["autostop"] = {"idle_minutes": -1, "to_down": False, "set_at": time.time()}

        if _update(self._dir(cluster_name), change) is None:
            raise ClusterDoesNotExist(f"Cluster {cluster_name!r} does not exist.")

    def check_cloud(self, cloud: str) -> str | None:
        key = cloud.lower()
        if key in enabled_clouds():
            return None
        hint = _CHECK_HINTS.get(key, "not a cloud this SkyPilot knows, or it is not set up")
        return f"{cloud_display(key)}: {hint} (see {_INSTALL_DOCS})"

    def enabled_clouds(self) -> list[str] | None:
        return enabled_clouds()

    def gpu_offers(self, gpu: str) -> list[GPUOffer] | None:
        if os.environ.get(ENV_CATALOG, "").lower() == "offline":
            return None
        name = gpu.partition(":")[0].strip().lower()
        return [offer for offer in CATALOG if offer.accelerator.lower() == name]

    # -------------------------------------------------------------------------------- launch's parts

    @staticmethod
    def _check_envs(task: dict[str, Any], secrets: dict[str, str]) -> dict[str, str]:
        """The task's envs as strings; like SkyPilot, a None env or secret is an error."""
        envs = {}
        for key, value in (task.get("envs") or {}).items():
            if value is None:
                raise ValueError(f"Environment variable {key!r} is None. Please set a value for it in task YAML "
                                 f"or with --env flag.")
            envs[key] = str(value)
        for key, value in (task.get("secrets") or {}).items():
            if value is None and secrets.get(key) is None:
                raise ValueError(f"Secret {key!r} is None. Please set a value for it with --secret flag.")
        overlap = set(envs) & set(secrets)
        if overlap:
            raise ValueError(f"Environment variables and secrets share names: {sorted(overlap)}")
        return envs

    def _pick_resources(self, task: dict[str, Any], resources: dict[str, Any]) -> tuple[str, float | None]:
        """Like SkyPilot's optimizer: the cheapest enabled offer that fits, as its resources string (what
        `sky status` shows) and its price per hour (what the launch handle's resources cost)."""
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
        fits = [o for o in offers if o.count == count and o.cloud in clouds and (infra is None or o.cloud == infra)
                and o.cloud not in sold_out]
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
                     port_map: dict[str, int], task: dict[str, Any]) -> dict[str, str]:
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
        env.update(HOME=str(home), SKYPILOT_NODE_RANK="0", SKYPILOT_NUM_NODES="1", SKYPILOT_NODE_IPS="127.0.0.1",
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
            "ARTCLOUD_PIP_ARGS": "--no-deps --no-index",
            ENV_MARKER: str(home.parent),
        })
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


def _teardown(root: Path, name: str, supervisor_pid: int | None) -> None:
    """Like terminating the VM: the folder vanishes at once (atomically, by a rename), then every process
    of the cluster is ended."""
    folder = root / "clusters" / name
    trash = root / "trash" / f"{name}-{uuid.uuid4().hex[:8]}"
    trash.parent.mkdir(parents=True, exist_ok=True)
    with _name_lock(root, name):
        with contextlib.suppress(FileNotFoundError):
            with _locked(folder):
                folder.rename(trash)
        _kill_all(root, name, supervisor_pid)
    shutil.rmtree(trash, ignore_errors=True)


# ----------------------------------------------------------------------------------------- RecordingSky

SECRET = "<secret>"
FAULTS = ("launch_fails", "no_health", "job_fails", "down_fails")


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
        if "launch_fails" in self.faults():
            acc = _accelerator((task or {}).get("resources") or {})
            what = f"{acc[0]}:{acc[1]}" if acc else "the requested resources"
            raise ResourcesUnavailableError(
                f"Failed to provision all possible launchable resources. Relax the task's resource requirements: "
                f"1x {what} (no capacity in any enabled region). To keep retrying until the cluster is up, use "
                f"the `--retry-until-up` flag.")
        return super().launch(task, secrets=secrets, cluster_name=cluster_name, idle_minutes=idle_minutes,
                              retry_until_up=retry_until_up)

    def status(self, cluster_name):
        self._record("status", cluster_name=cluster_name)
        return super().status(cluster_name)

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
    """Run the job (its environment is ours), record its end, then play SkyPilot's autostop/autodown."""
    folder = root / "clusters" / name
    run = (folder / "run.sh").read_text()
    data = _read_json(folder / "cluster.json")
    if data is None:
        return 0
    workdir = folder / "home" / "sky_workdir"
    machine = data.get("instance_id")  # this node: a later cluster of the same name is another one
    if data.get("imds_port"):  # the cloud's metadata service, for as long as the node lives
        from tests import sky_metadata

        sky_metadata.serve(int(data["imds_port"]), lambda: _read_json(folder / "cluster.json"))

    def started(d: dict[str, Any]) -> None:
        d["jobs"][str(job_id)].update(status="RUNNING", started_at=time.time())

    if _update(folder, started) is None:
        return 0
    with open(folder / "job.log", "ab") as out:
        job_env = {**os.environ, "PATH": os.environ["STANDIN_JOB_PATH"],
                   "PYTHONPATH": os.environ["STANDIN_JOB_PYTHONPATH"]}
        rc = subprocess.run(["bash", "-c", run], cwd=workdir, stdin=subprocess.DEVNULL, stdout=out,
                            stderr=subprocess.STDOUT, env=job_env).returncode

    def ended(d: dict[str, Any]) -> None:
        d["jobs"][str(job_id)].update(status="SUCCEEDED" if rc == 0 else "FAILED", exit_code=rc, ended_at=time.time())

    if _update(folder, ended) is None:
        return 0
    print(f"job {job_id} ended with exit code {rc}", flush=True)

    while True:  # autostop: the cluster is idle from the job's end (or from when autostop was last set)
        data = _read_json(folder / "cluster.json")
        if (data is None or data.get("instance_id") != machine or data.get("job_id") != job_id
                or data.get("status") != "UP"):
            return 0  # torn down (maybe a new cluster of the name), relaunched (a new supervisor runs the job) or stopped
        autostop = data.get("autostop") or {}
        minutes = autostop.get("idle_minutes", -1)
        if minutes is not None and minutes >= 0:
            idle_since = max(data["jobs"][str(job_id)]["ended_at"], autostop.get("set_at") or 0)
            if time.time() >= idle_since + minutes * float(data.get("minute_s", 60)):
                if autostop.get("to_down"):
                    print(f"autodown: idle for {minutes} minute(s)", flush=True)
                    _autodown(root, name, machine)
                else:
                    print(f"autostop: idle for {minutes} minute(s)", flush=True)
                    _update(folder, lambda d: d.__setitem__("status", "STOPPED"))
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
        for part in ("home",):
            shutil.rmtree(folder / part, ignore_errors=True)
        trash = root / "trash" / f"{name}-{uuid.uuid4().hex[:8]}"
        trash.parent.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        with contextlib.suppress(FileNotFoundError):
            with _locked(folder):
                folder.rename(trash)
    os._exit(0)  # the few files left under ROOT/trash are not worth a window with a live process


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[0] == "supervise":
        return supervise(Path(argv[1]), argv[2], int(argv[3]))
    print("usage: python -m tests.sky_standin supervise ROOT NAME JOB_ID", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
