"""The one narrow seam between artcloud and SkyPilot.

Everything SkyBackend and the CLI ask of SkyPilot goes through the calls of `SkyAPI`: launch, status,
job_status, endpoint, logs, autostop, down (plus three questions asked before launching: is this cloud enabled,
which clouds are, what does this GPU cost). `SkyPilotAPI` makes them with the real `sky` SDK, imported lazily (it takes seconds).

Tests put a stand-in at this edge (tests/sky_standin.py) by naming it in ARTCLOUD_SKY_API=module:attr:
it runs the task's own setup and run commands as local processes, so everything behind the edge is real.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import io
import logging
import os
import re
import sys
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

ENV_SKY_API = "ARTCLOUD_SKY_API"
# The clouds on which SkyPilot 0.14.1 cannot open a port: OPEN_PORTS is among their unsupported features
# (sky/clouds/hyperbolic.py:44, ibm.py:54, mithril.py:45, slurm.py:49, verda.py:44, vsphere.py:57), and a task
# with `ports` requires it (resources.py:2379). artcloud's server is reached on its port, so these are never
# quoted nor picked. Kept here, not asked of `sky` (whose import takes seconds); tests/laptop/test_sky_pins.py
# pins the set against the installed SkyPilot.
NO_OPEN_PORTS = frozenset({"hyperbolic", "ibm", "mithril", "slurm", "verda", "vsphere"})
# The clouds where SkyPilot cannot autodown (AUTODOWN unsupported: sky/clouds/hyperbolic.py, primeintellect.py:30,
# verda.py, yotta.py:55), which every artcloud launch asks for (sky/execution.py:501-507 requires it), and those where
# it runs one node at most (MULTI_NODE unsupported, which num_nodes > 1 requires: sky/task.py:2141-2142; runpod.py:30,
# vast.py:29, primeintellect.py:33, yotta.py:32, ...). Pinned by tests/laptop/test_sky_pins.py likewise.
NO_AUTODOWN = frozenset({"hyperbolic", "primeintellect", "verda", "yotta"})
NO_MULTI_NODE = frozenset({"hyperbolic", "primeintellect", "runpod", "seeweb", "shadeform", "vast", "verda", "vsphere",
                           "yotta"})
# Regions of a ports cloud where SkyPilot opens no port, with a warning only (Lambda's us-south-1 has no firewall
# rules: sky/provision/lambda_cloud/instance.py:270-283): a launch there comes up with its server unreachable.
NO_PORT_REGIONS = {"lambda": frozenset({"us-south-1"})}


@dataclass(frozen=True)
class ClusterInfo:
    name: str
    status: str  # SkyPilot's ClusterStatus: INIT, UP, AUTOSTOPPING or STOPPED (utils/status_lib.py:18-44)
    launched_at: float | None = None  # unix seconds
    autostop_minutes: int | None = None  # None or negative: no autostop set
    to_down: bool = False  # autostop tears the cluster down (not just stops it)
    resources: str | None = None  # e.g. "1x AWS(p5.48xlarge, {'H100': 1})"
    # For INIT only: 'launching' (being provisioned) or 'unhealthy' (a refresh found a node in a bad state;
    # its head may still be alive). schemas/api/responses.py:126-131.
    init_kind: str | None = None


@dataclass(frozen=True)
class Launched:
    """What `launch` got: its job, and the machine SkyPilot's optimizer really chose."""

    job_id: int | None
    price_per_hour: float | None = None  # dollars, all nodes, of the launched resources (spot price if spot)
    resources: str | None = None  # e.g. "1x AWS(p5.4xlarge, {'H100': 1})"


@dataclass(frozen=True)
class GPUOffer:
    cloud: str
    instance_type: str
    accelerator: str
    count: int
    price: float | None  # dollars per hour, on demand
    spot_price: float | None
    region: str | None = None


class SkyAPI(Protocol):
    def launch(self, task: dict[str, Any], *, secrets: dict[str, str], cluster_name: str,
               idle_minutes: int | None, retry_until_up: bool = False) -> Launched:
        """Provision (or reuse) the cluster, set autostop, submit the job; return the job id and what was launched.
        The task's setup runs INSIDE the job, after this returns (SETTING_UP, then RUNNING or FAILED_SETUP:
        execution.py:924 detach_setup). Autodown: `idle_minutes` after the last job ends (a failed setup too)."""

    def status(self, cluster_name: str, *, refresh: bool = False) -> ClusterInfo | None:
        """The cluster, or None if it does not exist (never launched, or torn down). Without `refresh`, what the
        API server last saw (its daemon looks once a minute): for listing. With it, what the cloud says now (for
        an artcloud cluster, which always has autostop set): for deciding that a machine is dead or lost."""

    def job_status(self, cluster_name: str, job_id: int | None) -> str | None:
        """SkyPilot's status of the job (skylet/job_lib.py:165-203: INIT, PENDING, SETTING_UP, RUNNING,
        FAILED_DRIVER, SUCCEEDED, FAILED, FAILED_SETUP, CANCELLED), or None if it cannot be told (no such job,
        cluster not UP or AUTOSTOPPING). It refreshes the cluster's status first (check_cluster_available)."""

    def endpoint(self, cluster_name: str, port: int) -> str | None:
        """Where the cluster's `port` is reachable, as SkyPilot says it: 'host:port' for a plain TCP port (what
        artcloud's TLS needs), a URL for an HTTP(S) proxy (Kubernetes with an ingress:
        'http://IP:80/skypilot/NAMESPACE/CLUSTER/PORT'); None if not open yet."""

    def logs(self, cluster_name: str, *, follow: bool = False, tail: int = 0) -> Iterator[str]:
        """Lines of the latest job's output: its setup (the install runs inside the job), then its run."""

    def autostop(self, cluster_name: str, idle_minutes: int, *, down: bool = True) -> None: ...

    def down(self, cluster_name: str) -> bool:
        """Tear the cluster down; False if there was nothing to tear down."""

    def check_cloud(self, cloud: str) -> str | None:
        """None if `cloud` is enabled; otherwise `sky check`'s reason (what is missing)."""

    def enabled_clouds(self) -> list[str] | None:
        """The clouds `sky check` enabled (lower case), or None if that cannot be told."""

    def gpu_offers(self, gpu: str) -> list[GPUOffer] | None:
        """Offers for accelerator `gpu` (a name, no count) across clouds; [] if no cloud has it;
        None if the catalog cannot be read (offline): then the name cannot be checked."""


def sky_api() -> SkyAPI:
    """The real SkyPilot SDK, or the stand-in named by ARTCLOUD_SKY_API=module:attr."""
    spec = os.environ.get(ENV_SKY_API)
    if not spec:
        return SkyPilotAPI()
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr or "SkyAPI")()


class SkyPilotAPI:
    """The seam, made of real `sky` SDK calls. The SDK talks to a SkyPilot API server (a local one
    starts by itself on first use); every call here waits for its request to finish.

    Checked against skypilot 0.14.1 (sky/client/sdk.py, sky/task.py, sky/core.py, sky/backends/backend_utils.py,
    sky/server/requests/serializers/decoders.py); tests/laptop/test_sky_calls.py pins what can be pinned offline.
    Note that `sky.check` and `sky.list_accelerators` are NOT the SDK calls (a module and the local catalog
    function): those two come from `sky.client.sdk`.
    """

    def __init__(self) -> None:
        from artcloud.backends.deps import require

        require("sky", "a SkyPilot sandbox")  # one line that says what to install, not a traceback at first use

    def launch(self, task: dict[str, Any], *, secrets: dict[str, str], cluster_name: str,
               idle_minutes: int | None, retry_until_up: bool = False) -> Launched:
        import sky

        config = copy.deepcopy(task)  # from_yaml_config empties the dict it is given
        # Drop the names-only `secrets: {NAME: None}`: a null-valued secret is a *managed secret reference*
        # (Task.from_yaml_config), which update_secrets does not clear and which the server then fails to
        # resolve ("No value available for secret(s)", execution._resolve_managed_secrets).
        config.pop("secrets", None)
        t = sky.Task.from_yaml_config(config)
        t.update_secrets(secrets)  # inline secrets: '<redacted>' in the YAML sky logs and shows
        # `launch` echoes "Running on cluster: NAME" (client/sdk.py:1032-1034) and stream_and_get prints the
        # provisioning log (stream_response's print(..., file=output_stream)) on stdout, from this worker thread,
        # through artcloud's own output and progress bar: to artcloud's logger instead, line by line.
        with _LogLines(logging.getLogger("artcloud.sky")) as lines, _this_threads_stdout(lines):
            request = sky.launch(t, cluster_name=cluster_name, idle_minutes_to_autostop=idle_minutes,
                                 down=idle_minutes is not None, retry_until_up=retry_until_up)
            # (job_id, handle); a 3-tuple (+ credentials) only when launch(_include_credentials=True). The handle
            # (CloudVmRayResourceHandle) says what the optimizer chose: its launched_resources price that machine,
            # spot or not, where the catalog lookup before launching could only guess.
            job_id, handle = sky.stream_and_get(request, output_stream=lines)[:2]
        return Launched(job_id=job_id, **_launched(handle))

    def status(self, cluster_name: str, *, refresh: bool = False) -> ClusterInfo | None:
        import sky
        from sky.utils.common import StatusRefreshMode

        # A list of sky.schemas.api.responses.StatusResponse (pydantic; `status` a sky.ClusterStatus enum:
        # INIT, UP, AUTOSTOPPING or STOPPED); a missing or torn-down cluster is left out. The default, NONE, is
        # the API server's cache, which its daemon refreshes once a minute (client/sdk.py:1912; server/daemons.py:
        # 161-174): up to a minute after a spot VM went, it still says UP. AUTO refreshes a cluster with spot or
        # autostop (every artcloud cluster) whose record is older than 2 s (backend_utils.py:3329-3346).
        mode = StatusRefreshMode.AUTO if refresh else StatusRefreshMode.NONE
        for record in sky.get(sky.status([cluster_name], refresh=mode)):
            if record.name == cluster_name:
                return ClusterInfo(
                    name=cluster_name,
                    status=record.status.value,
                    launched_at=record.launched_at,
                    autostop_minutes=record.autostop,  # -1: none set
                    to_down=bool(record.to_down),
                    resources=record.resources_str,
                    init_kind=record.init_kind,
                )
        return None

    def job_status(self, cluster_name: str, job_id: int | None) -> str | None:
        import sky
        from sky import exceptions

        try:
            found = sky.get(sky.job_status(cluster_name, [job_id] if job_id is not None else None))
        except (exceptions.ClusterNotUpError, ValueError):
            # ClusterDoesNotExist is a ValueError. And with job_ids=None on a cluster with no job, the server's
            # {None: None} comes back as {"None": None}, which the 0.14.1 client decoder int()s: ValueError.
            return None
        # {job_id (int): sky.JobStatus or None}
        status = found.get(job_id) if job_id is not None else next(iter(found.values()), None)
        return None if status is None else status.value

    def endpoint(self, cluster_name: str, port: int) -> str | None:
        import sky
        from sky import exceptions

        try:
            found = sky.get(sky.endpoints(cluster_name, port))
        except exceptions.ClusterNotUpError:  # no such cluster, or not UP (backend_utils.get_endpoints)
            return None
        # {port (int): url}, {} while the port is not open yet. SocketEndpoint.url() is 'host:port'; an ingress's
        # HTTP(S)Endpoint.url() has a scheme and a path (sky/provision/common.py): passed on as it is, for the
        # caller to refuse (it cannot carry artcloud's own TLS).
        url = found.get(int(port))
        return url.rstrip("/") if url else None

    def logs(self, cluster_name: str, *, follow: bool = False, tail: int = 0) -> Iterator[str]:
        import sky
        from sky import exceptions

        # The streamed request never reports a missing cluster (it just yields nothing): ask first, refreshed
        # (tail_logs refreshes too: the cache may still hold a cluster the cloud took away).
        if self.status(cluster_name, refresh=True) is None:
            raise exceptions.ClusterDoesNotExist(f"Cluster {cluster_name!r} does not exist.")
        return self._lines(sky.tail_logs(cluster_name, job_id=None, follow=follow, tail=tail, preload_content=False))

    @staticmethod
    def _lines(stream: Iterator[str | None]) -> Iterator[str]:
        # rich_utils.decode_rich_status yields lines with their '\n' and None for every control message
        # (spinner updates, heartbeats) when not on the main thread: None is not the end of the stream.
        pending = ""
        for chunk in stream:
            if chunk is None:
                continue
            pending += chunk
            *lines, pending = pending.split("\n")
            yield from (line.rstrip("\r") for line in lines)
        if pending:
            yield pending

    def autostop(self, cluster_name: str, idle_minutes: int, *, down: bool = True) -> None:
        import sky

        sky.get(sky.autostop(cluster_name, idle_minutes, down=down))

    def down(self, cluster_name: str) -> bool:
        import sky
        from sky import exceptions

        try:
            sky.get(sky.down(cluster_name))
        except exceptions.ClusterDoesNotExist:
            return False
        return True

    def check_cloud(self, cloud: str) -> str | None:
        from sky.client import sdk

        out = io.StringIO()
        try:
            enabled = sdk.stream_and_get(sdk.check((cloud,), verbose=False), output_stream=out)
        except ValueError as e:  # not a cloud SkyPilot knows
            return str(e)
        # {workspace: {cloud repr, e.g. 'AWS': ['compute', 'storage']}} (sky/check.py check())
        for per_workspace in enabled.values():
            for name, capabilities in per_workspace.items():
                if name.lower() == cloud.lower() and "compute" in capabilities:
                    return None
        return self._check_reason(out.getvalue(), cloud) or f"{cloud} is not enabled (run `sky check {cloud}`)"

    @staticmethod
    def _check_reason(text: str, cloud: str) -> str:
        """`sky check`'s lines about `cloud`: '  AWS: disabled' and the indented 'Reason [...]: ...' below it."""
        import re

        lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).rstrip() for line in text.splitlines()]
        head = re.compile(rf"^\s*{re.escape(cloud)}: ", re.IGNORECASE)
        for i, line in enumerate(lines):
            if head.match(line):
                block = [line.strip()]
                for more in lines[i + 1:]:
                    if not more.startswith("    "):
                        break
                    block.append(more.strip())
                return " ".join(block)
        return ""

    def enabled_clouds(self) -> list[str] | None:
        from sky.client import sdk

        try:
            return [str(c).lower() for c in sdk.get(sdk.enabled_clouds())]
        except Exception:  # no API server, no answer: the caller prices across every cloud, and says so
            return None

    def gpu_offers(self, gpu: str) -> list[GPUOffer] | None:
        import re

        from sky.client import sdk

        try:
            found = sdk.get(sdk.list_accelerators(gpus_only=True, name_filter=f"^{re.escape(gpu)}$",
                                                  case_sensitive=False))
        except Exception:  # the catalog lives online; offline it cannot be read
            return None
        offers = []
        for name, infos in found.items():
            for info in infos:  # sky.catalog.common.InstanceTypeInfo
                offers.append(GPUOffer(
                    cloud=str(info.cloud), instance_type=info.instance_type or "",
                    accelerator=info.accelerator_name or name, count=int(info.accelerator_count),
                    price=_price(info.price), spot_price=_price(info.spot_price), region=info.region or None,
                ))
        return offers


def _price(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if value == value and value > 0 else None  # NaN: no price


def _launched(handle: Any) -> dict[str, Any]:
    """Price and description of a launch handle's resources; None where the handle does not tell."""
    resources = getattr(handle, "launched_resources", None)
    nodes = int(getattr(handle, "launched_nodes", None) or 1)
    if resources is None:
        return {}
    try:
        price = _price(resources.get_cost(3600) * nodes)
    except Exception:  # e.g. a Kubernetes or SSH node pool has no price
        price = None
    return {"price_per_hour": price, "resources": f"{nodes}x {resources}"}


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class _LogLines(io.TextIOBase):
    """A text stream that hands each line written to it to a logger (colours stripped, blank lines dropped)."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self._log, self._pending = logger, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *lines, self._pending = re.split(r"\r\n|\r|\n", self._pending + text)  # '\r': a progress line redrawn
        for line in lines:
            self._emit(line)
        return len(text)

    def _emit(self, line: str) -> None:
        line = _ANSI.sub("", line).rstrip()
        if line.strip():
            self._log.info("%s", line)

    def close(self) -> None:
        if not self.closed:
            self._emit(self._pending)
            self._pending = ""
        super().close()


_ROUTES: dict[int, Any] = {}  # thread id -> where that thread's stdout goes, while it launches
_ROUTES_LOCK = threading.Lock()


class _ThreadStdout:
    """sys.stdout while a launch runs: the launching thread's writes go to its own stream, every other thread's
    (the user's prints, a progress bar) to the stdout that was there."""

    def __init__(self, original: Any) -> None:
        self.original = original

    def _target(self) -> Any:
        return _ROUTES.get(threading.get_ident(), self.original)

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        self._target().flush()

    def __getattr__(self, name: str) -> Any:  # isatty, encoding, fileno, buffer...: the target's
        return getattr(self._target(), name)


@contextlib.contextmanager
def _this_threads_stdout(stream: Any) -> Iterator[None]:
    """What this thread prints on sys.stdout goes to `stream` meanwhile; no other thread's output changes.
    (SkyPilot's click.secho resolves sys.stdout when it writes, so only a router in its place reaches it.)"""
    me = threading.get_ident()
    if sys.stdout is None:  # no stdout at all (pythonw): nothing to keep clean
        yield
        return
    with _ROUTES_LOCK:
        if not isinstance(sys.stdout, _ThreadStdout):
            sys.stdout = _ThreadStdout(sys.stdout)
        router = sys.stdout
        _ROUTES[me] = stream
    try:
        yield
    finally:
        with _ROUTES_LOCK:
            _ROUTES.pop(me, None)
            if not _ROUTES and sys.stdout is router:  # else someone (rich's Live) swapped it since: theirs to restore
                sys.stdout = router.original
