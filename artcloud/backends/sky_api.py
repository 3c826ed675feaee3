"""The one narrow seam between artcloud and SkyPilot.

Everything SkyBackend and the CLI ask of SkyPilot goes through the calls of `SkyAPI`: launch, status,
job_status, endpoint, logs, autostop, down (plus two questions asked before launching: is this cloud enabled, what
does this GPU cost). `SkyPilotAPI` makes them with the real `sky` SDK, imported lazily (it takes seconds).

Tests put a stand-in at this edge (tests/sky_standin.py) by naming it in ARTCLOUD_SKY_API=module:attr:
it runs the task's own setup and run commands as local processes, so everything behind the edge is real.
"""

from __future__ import annotations

import copy
import importlib
import io
import os
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

ENV_SKY_API = "ARTCLOUD_SKY_API"


@dataclass(frozen=True)
class ClusterInfo:
    name: str
    status: str  # SkyPilot's: INIT, UP or STOPPED
    launched_at: float | None = None  # unix seconds
    autostop_minutes: int | None = None  # None or negative: no autostop set
    to_down: bool = False  # autostop tears the cluster down (not just stops it)
    resources: str | None = None  # e.g. "1x AWS(p5.48xlarge, {'H100': 1})"


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
               idle_minutes: int | None, retry_until_up: bool = False) -> int | None:
        """Provision (or reuse) the cluster, run setup, submit `run` as a job; return the job id.
        Autodown: `idle_minutes` after the last job ends, the cluster is torn down."""

    def status(self, cluster_name: str) -> ClusterInfo | None:
        """The cluster, or None if it does not exist (never launched, or torn down)."""

    def job_status(self, cluster_name: str, job_id: int | None) -> str | None:
        """SkyPilot's status of the job (PENDING, SETTING_UP, RUNNING, SUCCEEDED, FAILED, FAILED_SETUP, ...),
        or None if it cannot be told (no such job, cluster not up)."""

    def endpoint(self, cluster_name: str, port: int) -> str | None:
        """'host:port' (no scheme) where the cluster's `port` is reachable, or None if not open yet."""

    def logs(self, cluster_name: str, *, follow: bool = False, tail: int = 0) -> Iterator[str]:
        """Lines of the latest job's output (setup and run)."""

    def autostop(self, cluster_name: str, idle_minutes: int, *, down: bool = True) -> None: ...

    def down(self, cluster_name: str) -> bool:
        """Tear the cluster down; False if there was nothing to tear down."""

    def check_cloud(self, cloud: str) -> str | None:
        """None if `cloud` is enabled; otherwise `sky check`'s reason (what is missing)."""

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
    starts by itself on first use); every call here waits for its request to finish."""

    def launch(self, task: dict[str, Any], *, secrets: dict[str, str], cluster_name: str,
               idle_minutes: int | None, retry_until_up: bool = False) -> int | None:
        import sky

        config = copy.deepcopy(task)  # from_yaml_config empties the dict it is given
        config.pop("secrets", None)  # names only; the values come next, as task secrets
        t = sky.Task.from_yaml_config(config)
        t.update_secrets(secrets)  # secrets: redacted by SkyPilot in logs and its dashboard
        request = sky.launch(t, cluster_name=cluster_name, idle_minutes_to_autostop=idle_minutes,
                             down=idle_minutes is not None, retry_until_up=retry_until_up)
        job_id, _handle = sky.stream_and_get(request)
        return job_id

    def status(self, cluster_name: str) -> ClusterInfo | None:
        import sky

        for record in sky.get(sky.status([cluster_name])):
            record = record if isinstance(record, dict) else record.model_dump()
            if record.get("name") == cluster_name:
                status = record.get("status")
                return ClusterInfo(
                    name=cluster_name,
                    status=getattr(status, "value", str(status)),
                    launched_at=record.get("launched_at"),
                    autostop_minutes=record.get("autostop"),
                    to_down=bool(record.get("to_down")),
                    resources=record.get("resources_str"),
                )
        return None

    def job_status(self, cluster_name: str, job_id: int | None) -> str | None:
        import sky
        from sky import exceptions

        try:
            found = sky.get(sky.job_status(cluster_name, [job_id] if job_id is not None else None))
        except (exceptions.ClusterDoesNotExist, exceptions.ClusterNotUpError):
            return None
        status = next(iter(found.values()), None)
        return getattr(status, "value", None if status is None else str(status))

    def endpoint(self, cluster_name: str, port: int) -> str | None:
        import sky

        try:
            found = sky.get(sky.endpoints(cluster_name, port))
        except (ValueError, RuntimeError):  # the port is not open (yet)
            return None
        return found.get(port) or found.get(str(port)) or None

    def logs(self, cluster_name: str, *, follow: bool = False, tail: int = 0) -> Iterator[str]:
        import sky

        stream = sky.tail_logs(cluster_name, job_id=None, follow=follow, tail=tail, preload_content=False)
        pending = ""
        for chunk in stream:
            if chunk is None:
                break
            pending += chunk
            *lines, pending = pending.split("\n")
            yield from lines
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
        import sky

        out = io.StringIO()
        enabled = sky.stream_and_get(sky.check((cloud,), verbose=False), output_stream=out)
        names = {c.lower() for per_workspace in enabled.values() for c in per_workspace}
        if cloud.lower() in names:
            return None
        reason = " ".join(line.strip() for line in out.getvalue().splitlines()
                          if cloud.lower() in line.lower() and line.strip())
        return reason or f"{cloud} is not enabled"

    def gpu_offers(self, gpu: str) -> list[GPUOffer] | None:
        import sky

        try:
            found = sky.get(sky.list_accelerators(gpus_only=True, name_filter=f"^{gpu}$", case_sensitive=False))
        except Exception:  # the catalog lives online; offline it cannot be read
            return None
        offers = []
        for name, infos in found.items():
            for info in infos:
                offers.append(GPUOffer(
                    cloud=str(info.cloud), instance_type=str(info.instance_type), accelerator=name,
                    count=int(info.accelerator_count), price=_price(info.price), spot_price=_price(info.spot_price),
                    region=getattr(info, "region", None),
                ))
        return offers


def _price(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if value == value and value > 0 else None  # NaN: no price
