"""SkyBackend: `artcloud serve` on a short-lived GPU machine in any cloud SkyPilot supports.

    backend = artcloud.SkyBackend(gpu="H100:1", s3="s3://my-bucket/runs")
    async with backend:                      # launch (or attach), wait for /health; down on exit
        await model.register(backend)

This module adds only how the server comes to life and goes away (SkyProvisioner, the provider's face: the
lifecycle itself is in sandbox.py); once it answers, everything is the RemoteBackend protocol. Starting:

1. attach: a cluster of that name that this machine launched (CA and token in the state registry) is
   reused, not launched twice;
2. preflight, before anything is provisioned: the GPU name against SkyPilot's catalog (and its price),
   the cloud (`sky check`'s reason, passed on), the S3 location and credentials, checked from here;
3. launch: a fresh CA, certificate and token; a wheel of this very artcloud; the task from
   sky/artcloud-server.yaml; the record saved *before* SkyPilot is asked, so a dying laptop still leaves
   a name that `artcloud down` finds;
4. ready: /health over HTTPS with backoff and a deadline; a failed job or a vanished cluster fails fast
   with the server's last log lines, and what was started is torn down (unless keep=True).

Teardown in layers: `down()` / `async with`; the server's lease (no request or heartbeat for `lease` →
final checkpoint push → exit); SkyPilot's autodown `idle_minutes` after the server job ends; `max_duration`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets as _secrets
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from artcloud.backends.client import ServerGone
from artcloud.backends.launch import check_s3, user_secrets
from artcloud.backends.providers import Claim, Credentials, Provisioner
from artcloud.backends.sandbox import SandboxBackend, heartbeat_every
from artcloud.backends.sky_api import NO_PORT_REGIONS, ClusterInfo, GPUOffer, Launched, SkyAPI, sky_api
from artcloud.backends.sky_task import (
    REPLICA_SECRETS,
    RESERVED,
    SERVER_PORT,
    TRAINER_KEY,
    ServerTask,
    build_task,
    describe,
)
from artcloud.backends.spec import SandboxSpec, renamed
from artcloud.backends.state import SandboxRecord, StateDir
from artcloud.errors import ArtcloudError, InvalidArgument
from artcloud.tls import LaunchSecrets, make_launch_secrets

log = logging.getLogger("artcloud.sky")

PROVIDER = "sky"
PREEMPTION_LINE = "preemption notice ("  # what the server logs when its cloud announces the end (server/preemption.py)
# A cluster job's statuses that mean it ended (skylet/job_lib.py:165-203; FAILED_PRECHECKS and the like are a
# managed job's, jobs/state.py:761-765, never a cluster job's). SUCCEEDED: the server exited. FAILED_SETUP: the
# install failed (setup runs inside the job: execution.py:924).
FAILED_JOB = ("FAILED", "FAILED_SETUP", "FAILED_DRIVER", "CANCELLED", "SUCCEEDED")
STARTING_JOB = ("INIT", "PENDING", "SETTING_UP")  # submitted, not yet running the task's `run`
HEAD_PROBE_S = 5.0  # how long a TCP connect to the head's port may take before the head counts as not answering


class SkyError(ArtcloudError):
    """Launching, reaching or tearing down a SkyPilot sandbox failed; the message says what to do."""

    code = "sky_failed"


def parse_gpu(gpu: str) -> tuple[str, int]:
    """'H100:8' → ('H100', 8); 'L4' → ('L4', 1)."""
    name, _, count = gpu.partition(":")
    if not name or (count and not count.isdigit()) or (count and int(count) < 1):
        raise InvalidArgument(f"gpu {gpu!r} is not a GPU spec: write NAME or NAME:COUNT, e.g. 'H100:1' or 'A100-80GB:2'")
    return name, int(count or 1)


# SkyPilot's Kubernetes, and its SSH node pools (which are Kubernetes: sky/clouds/ssh.py:28).
POD_CLOUDS = frozenset({"kubernetes", "k8s", "ssh"})


def unusable_cloud(cloud: str | None, num_nodes: int = 1) -> tuple[str, str] | None:
    """Why `cloud` cannot host artcloud's server, as (code, message), or None: SkyPilot cannot open a port there
    (NO_OPEN_PORTS), cannot autodown there (NO_AUTODOWN: every artcloud launch asks for it, so that no machine bills
    on with nobody watching), or runs one node at most there and `num_nodes` is more (NO_MULTI_NODE). A launch would
    only fail once SkyPilot's optimizer or provisioner weighs it (SDK contract 3, N2)."""
    from artcloud.backends.sky_api import NO_AUTODOWN, NO_MULTI_NODE, NO_OPEN_PORTS

    if not cloud:
        return None
    name = cloud.lower()
    others = ("cloud='aws', 'gcp', 'azure', 'kubernetes', 'lambda' or 'runpod'" if num_nodes == 1
              else "cloud='aws', 'gcp', 'azure' or 'lambda'")
    if name in NO_OPEN_PORTS:
        return "cloud_without_ports", (f"artcloud needs an open port ({SERVER_PORT}) to reach its server, and SkyPilot "
                                       f"cannot open one on {cloud}: pin a cloud that can (e.g. {others}) or leave "
                                       "cloud unset for the cheapest enabled one")
    if name in NO_AUTODOWN:
        return "cloud_without_autodown", (f"artcloud has SkyPilot take the machine down once its server ends "
                                          f"(autodown), and SkyPilot cannot on {cloud}: pin a cloud that can (e.g. "
                                          f"{others}) or leave cloud unset for the cheapest enabled one")
    if num_nodes > 1 and name in NO_MULTI_NODE:
        return "cloud_single_node", (f"SkyPilot runs one node at most on {cloud}, and num_nodes is {num_nodes}: pin a "
                                     f"cloud that runs several (e.g. {others}), or use num_nodes=1")
    if num_nodes > 1 and name in POD_CLOUDS:
        # Its Service (LoadBalancer or ingress) for `ports` selects every pod of the cluster by its name label
        # (sky/provision/kubernetes/network.py:55-62, 113-120; instance.py:2211-2212): (N-1)/N of the connections
        # would land on a worker, where nothing listens (SDK contract 3, N1).
        return "cloud_single_node", (f"SkyPilot's {cloud} sends port {SERVER_PORT} to every pod of a cluster, and "
                                     f"artcloud's server runs on the first: use num_nodes=1 there, or pin a VM cloud "
                                     "for several nodes (e.g. cloud='aws', 'gcp', 'azure' or 'lambda')")
    return None


def port_closed(cloud: str | None, region: str | None) -> bool:
    """Whether SkyPilot opens no port in this cloud's region (NO_PORT_REGIONS: SDK contract 3, N6)."""
    return bool(cloud and region) and region.lower() in NO_PORT_REGIONS.get(cloud.lower(), ())


def pick_offer(offers: list[GPUOffer], gpu: str, *, cloud: str | None, use_spot: bool,
               enabled: list[str] | None = None, num_nodes: int = 1) -> GPUOffer | None:
    """The cheapest offer for `gpu` (on `cloud` if given, else among the `enabled` clouds when known), as
    SkyPilot's optimizer picks it; never one on a cloud that cannot host artcloud's server (`unusable_cloud`: no open
    port, no autodown, or one node where `num_nodes` are asked for). Raises ValueError if none can serve it."""
    from artcloud.backends.deps import sky_cloud_install

    name, count = parse_gpu(gpu)
    if not offers:
        raise InvalidArgument(f"SkyPilot knows no GPU named {name!r}: `sky show-gpus` lists the names (e.g. H100, A100-80GB, L4)")
    unusable = unusable_cloud(cloud, num_nodes)
    if unusable:
        raise InvalidArgument(unusable[1], code=unusable[0], field="cloud")
    usable = [o for o in offers if unusable_cloud(o.cloud, num_nodes) is None and not port_closed(o.cloud, o.region)]
    if not usable:
        needs = "an open port and autodown" + (f", on {num_nodes} nodes" if num_nodes > 1 else "")
        raise InvalidArgument(f"{name} is only on {', '.join(sorted({o.cloud for o in offers}))}, where SkyPilot "
                              f"cannot give artcloud's server what it needs ({needs}): `sky show-gpus` lists the other "
                              "GPUs")
    offers = usable
    if cloud:
        offers = [o for o in offers if o.cloud.lower() == cloud.lower()]
        if not offers:
            raise InvalidArgument(f"{cloud} offers no {name}: `sky show-gpus {name}` lists the clouds that do")
    elif enabled is not None:
        clouds = sorted({o.cloud for o in offers})
        offers = [o for o in offers if o.cloud.lower() in enabled]
        if not offers:
            install = next(filter(None, map(sky_cloud_install, clouds)), None)
            raise InvalidArgument(f"no enabled cloud offers {name} (enabled: {', '.join(enabled) or 'none'}; {name} is "
                                  f"on {', '.join(clouds)}): set one of those up"
                                  + (f" (e.g. {install}, and its credentials)" if install else "")
                                  + ", then `sky check`")
    fitting = [o for o in offers if o.count == count]
    if not fitting:
        counts = sorted({o.count for o in offers})
        raise InvalidArgument(f"no machine has {count}x {name}: choose a count among {counts}, e.g. gpu='{name}:{counts[0]}'")
    priced = [o for o in fitting if (o.spot_price if use_spot else o.price) is not None]
    if not priced:
        return None
    return min(priced, key=lambda o: o.spot_price if use_spot else o.price)


@dataclass(frozen=True)
class Plan:
    """What a launch would get, before anything is paid for: `SkyBackend(...).plan()`."""

    cluster_name: str
    gpu: str | None
    use_spot: bool
    offer: GPUOffer | None  # the machine the optimizer would choose (cheapest enabled offer); None: unknown
    max_duration_s: float
    note: str = ""  # why the price is unknown, or what it assumes
    num_nodes: int = 1

    @property
    def price_per_hour(self) -> float | None:
        """Every node's."""
        if self.offer is None:
            return None
        one = self.offer.spot_price if self.use_spot else self.offer.price
        return None if one is None else one * self.num_nodes

    @property
    def max_cost(self) -> float | None:
        """The price for the whole max_duration: what a run that is never stopped early costs at most."""
        price = self.price_per_hour
        return None if price is None else price * self.max_duration_s / 3600.0

    def __str__(self) -> str:
        from artcloud.durations import format_duration

        nodes = f"{self.num_nodes} nodes of " if self.num_nodes > 1 else ""
        what = f"{nodes}{self.gpu or 'no GPU'}{' (spot)' if self.use_spot else ''}"
        if self.offer is None:
            return f"{self.cluster_name}: {what}, price unknown ({self.note or 'no catalog'})"
        where = f"{self.offer.cloud} {self.offer.instance_type}" + (f" in {self.offer.region}" if self.offer.region else "")
        return (f"{self.cluster_name}: {what} on {where}, ${self.price_per_hour:,.2f}/h; "
                f"at most ${self.max_cost:,.2f} for max_duration {format_duration(self.max_duration_s)}"
                + (f" ({self.note})" if self.note else ""))


class SkyProvisioner(Provisioner):
    """What artcloud asks SkyPilot, through the one seam (sky_api.py): any cluster of the registry (status, down,
    logs), and, made for one cluster's name and spec, its launch, endpoint and liveness."""

    error = SkyError
    launched_by = "SkyPilot "

    def __init__(self, api: SkyAPI | None = None, *, name: str = "", spec: SandboxSpec | None = None,
                 state: StateDir | None = None, idle_minutes: int = 10, retry_until_up: bool = False,
                 trainer_nodes: int = 1):
        self.api = api or sky_api()
        self.name, self.spec, self.state = name, spec, state
        self.env = {**spec.env, **spec.engine_env()} if spec is not None else {}  # the server's plain environment
        self.idle_minutes, self.retry_until_up, self.trainer_nodes = idle_minutes, retry_until_up, trainer_nodes
        self.offer: GPUOffer | None = None  # the catalog's guess before launching
        self.resources: str | None = None  # what SkyPilot launched, e.g. "1x AWS(p5.4xlarge, {'H100': 1})"
        self.record: SandboxRecord | None = None  # the registry's record of this cluster, once launched or attached
        self._job_id: int | None = None
        self._reaped = False  # torn down for being dead (by alive/existing/gone): nothing left to tear down

    # ------------------------------------------------------------------------------------- any cluster of the registry

    def status(self, record: SandboxRecord) -> str | None:
        info = self.api.status(record.name, refresh=True)  # the registry marks it down on None: not from a cache
        return None if info is None else info.status

    def destroy(self, record: SandboxRecord) -> bool:
        return self.api.down(record.name)

    def logs(self, record: SandboxRecord, *, follow: bool = False, tail: int = 0) -> Iterator[str]:
        return self.api.logs(record.name, follow=follow, tail=tail)

    # ------------------------------------------------------------------------------------- before a launch

    def launch_secrets(self) -> dict[str, str]:
        """The user's secrets (values read here, now) and, for S3, this machine's AWS credentials."""
        return user_secrets(self.spec.secrets, reserved=RESERVED, s3=self.spec.s3, error=SkyError,
                            valid_for_s=self.spec.max_duration)

    def preflight(self) -> Plan:
        """Everything that can be checked before a machine is paid for (blocking; run in a thread): the cloud,
        the GPU and its price (the plan), the S3 location and credentials."""
        plan = self.plan()
        if self.spec.s3:
            check_s3(self.spec.s3, error=SkyError)
        return plan

    def _price(self) -> str:
        """The offer SkyPilot's optimizer would take (the cheapest fitting one on an enabled cloud): sets
        self.offer and self.price_per_hour; returns what the guess assumes, or why there is none."""
        gpu, cloud = self.spec.gpu, self.spec.cloud
        if not gpu:
            return "no GPU: the price of a CPU machine is not looked up"
        offers = self.api.gpu_offers(parse_gpu(gpu)[0])
        if offers is None:
            log.warning("SkyPilot's GPU catalog cannot be read (offline?): %s is not checked and its price is unknown", gpu)
            return "SkyPilot's GPU catalog cannot be read (offline?)"
        enabled = None if cloud else self.api.enabled_clouds()
        try:
            best = pick_offer(offers, gpu, cloud=cloud, use_spot=self.spec.spot, enabled=enabled,
                              num_nodes=self.spec.num_nodes)
        except ValueError as e:
            raise SkyError(str(e), code="unknown_gpu", field="gpu") from e
        if best is None:
            return "no price in the catalog"
        self.offer = best
        one = best.spot_price if self.spec.spot else best.price
        self.price_per_hour = None if one is None else one * self.spec.num_nodes  # the cluster's: every node
        if not cloud and enabled is None:
            return "cheapest of every cloud: which clouds are enabled could not be told"
        return ""

    def plan(self) -> Plan:
        """See SkyBackend.plan."""
        from artcloud.backends.deps import sky_cloud_install

        cloud = self.spec.cloud
        unusable = unusable_cloud(cloud, self.spec.num_nodes)
        if unusable:  # before `sky check`: set up or not, it cannot serve
            raise SkyError(unusable[1], code=unusable[0], field="cloud")
        if cloud:
            reason = self.api.check_cloud(cloud)
            install = reason and sky_cloud_install(cloud, reason)
            if install:  # `sky check` found no SDK: artcloud[sky] brings SkyPilot alone
                raise SkyError(f"{cloud}'s SDK is not installed: {install}, then `sky check {cloud}` "
                               f"(sky check says: {reason})", code="cloud_sdk_missing", field="cloud")
            if reason:
                raise SkyError(f"{cloud} is not enabled in SkyPilot: {reason} (then run `sky check {cloud}`)",
                               code="cloud_not_enabled", field="cloud")
        note = self._price()
        return Plan(cluster_name=self.name, gpu=self.spec.gpu, use_spot=self.spec.spot, offer=self.offer,
                    max_duration_s=self.spec.max_duration, note=note, num_nodes=self.spec.num_nodes)

    def task(self, *, launch_secrets: dict[str, str], wheel: Path | None, run_args: list[str] | None = None,
             workdir: Path | None = None, preload: str | None = None, ca_cert: str | None = None,
             replica_ca: str | None = None) -> ServerTask:
        spec, env = self.spec, dict(self.env)
        region = os.environ.get("ARTCLOUD_S3_REGION") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if spec.s3 and region:
            env.setdefault("ARTCLOUD_S3_REGION", region)
        if spec.s3 and os.environ.get("ARTCLOUD_S3_ATTEMPTS"):
            env.setdefault("ARTCLOUD_S3_ATTEMPTS", os.environ["ARTCLOUD_S3_ATTEMPTS"])
        if preload:  # model.register started it: the base model loads while the client waits for /health
            env["ARTCLOUD_PRELOAD"] = preload
        return build_task(
            secrets=launch_secrets, gpu=spec.gpu, cloud=spec.cloud, region=spec.region, use_spot=spec.spot,
            disk_size=spec.disk, image=spec.image, engine=spec.engine, lease_s=spec.lease,
            max_duration_s=spec.max_duration, s3=spec.s3, s3_endpoint_url=os.environ.get("ARTCLOUD_S3_ENDPOINT_URL"),
            env=env, wheel=wheel, run_args=run_args, workdir=workdir, num_nodes=spec.num_nodes, ca_cert=ca_cert,
            replica_ca=replica_ca, trainer_nodes=self.trainer_nodes,
        )

    # ------------------------------------------------------------------------------------- this cluster

    async def existing(self, record: SandboxRecord | None) -> bool:
        """A cluster of this name that this machine launched and that still serves: attach to it. One of ours
        that is dead (stopped, or unhealthy once up) is torn down first: it serves nothing and may bill."""
        name = self.name
        info = await asyncio.to_thread(self.api.status, name, refresh=True)
        if info is None:
            return False
        ours = record is not None and record.provider == PROVIDER
        if ours:
            reason = await self._dead(info, record)
            if reason is not None:  # a new one is launched in its place
                await self._reap(reason)
                return False
        if not ours or self.state.credentials(name) is None:
            raise SkyError(
                f"a SkyPilot cluster named {name!r} exists, but artcloud did not launch it from this machine: "
                "choose another cluster_name (or remove it with `sky down " + name + "` if it is yours to remove)",
                code="name_taken", field="cluster_name")
        return True

    async def adopt(self, record: SandboxRecord, creds: tuple[str, str]) -> Credentials:
        self.record, self.price_per_hour, self.resources = record, record.price_per_hour, record.extra.get("resources")
        return Credentials(token=creds[1], ca=creds[0])

    def make_secrets(self, user_secrets: Mapping[str, str]) -> tuple[LaunchSecrets, dict[str, str], str | None]:
        """A launch's secrets: its TLS (the client's trust), then the task's secrets: the server's token and TLS
        pair, the trainer key where several nodes train, the replicas' own token and TLS pair where nodes serve as
        replicas (their CA, public, comes back apart), and the user's."""
        tls = make_launch_secrets()
        launch_secrets = {"ARTCLOUD_TOKEN": tls.token, "ARTCLOUD_TLS_CERT": tls.server_cert,
                          "ARTCLOUD_TLS_KEY": tls.server_key, **user_secrets}
        if self.trainer_nodes > 1:  # what the trainer nodes share instead of the token
            launch_secrets[TRAINER_KEY] = _secrets.token_hex(32)
        if self.spec.num_nodes <= self.trainer_nodes:
            return tls, launch_secrets, None
        replicas = make_launch_secrets()  # a CA of their own: a replica's certificate is no head's to the client
        launch_secrets.update(zip(REPLICA_SECRETS, (replicas.token, replicas.server_cert, replicas.server_key)))
        return tls, launch_secrets, replicas.ca_cert

    async def launch(self, job: tuple[Path, Callable[[float | None], list[str]]] | None, *, preload: str | None,
                     deadline: float, claim: Claim) -> Credentials:
        from artcloud import bootstrap_health
        from artcloud.backends.wheel import build_wheel

        name, spec = self.name, self.spec
        user_secrets = self.launch_secrets()
        await asyncio.to_thread(self.preflight)
        tls, launch_secrets, replica_ca = self.make_secrets(user_secrets)
        self._reaped = False
        record = SandboxRecord(
            name=name, provider=PROVIDER, gpu=spec.gpu, cloud=spec.cloud, price_per_hour=self.price_per_hour,
            max_duration_s=spec.max_duration, idle_minutes=self.idle_minutes, s3=spec.s3,
        )
        if job is not None:
            record.extra["run"] = job[0].name
        with tempfile.TemporaryDirectory(prefix="artcloud-wheel-") as tmp:
            wheel = None if spec.image else build_wheel(Path(tmp))
            if wheel is not None:  # answers /health ("installing") while the setup installs the wheel
                shutil.copy(Path(bootstrap_health.__file__), Path(tmp) / "bootstrap_health.py")
            run_args = None
            if job is not None:  # the script travels in the workdir, next to the wheel
                shutil.copy(job[0], Path(tmp) / job[0].name)
                run_args = [job[0].name, *job[1](self.price_per_hour)]
            task = self.task(launch_secrets=launch_secrets, wheel=wheel, run_args=run_args,
                             workdir=Path(tmp) if job is not None else None, preload=None if job else preload,
                             ca_cert=tls.ca_cert, replica_ca=replica_ca)
            log.info("launching %s: %s", name, describe(task))
            self.record = record
            claim(record, tls.ca_cert, tls.token)
            # Returns once the job is submitted: the install (the task's setup) runs inside the job, and is
            # watched (and bounded by startup_timeout) with the server's start, by the ready poll.
            launched: Launched = await asyncio.to_thread(
                self.api.launch, task.config, secrets=task.secrets, cluster_name=name,
                idle_minutes=self.idle_minutes, retry_until_up=self.retry_until_up)
        self._job_id = launched.job_id
        if launched.price_per_hour is not None:  # what was launched, not the catalog's guess
            if self.price_per_hour is not None and abs(launched.price_per_hour - self.price_per_hour) > 0.005:
                log.info("%s: launched %s at $%.2f/h (the catalog's guess was $%.2f/h)", name, launched.resources,
                         launched.price_per_hour, self.price_per_hour)
            self.price_per_hour = record.price_per_hour = launched.price_per_hour
        if launched.resources:
            self.resources = record.extra["resources"] = launched.resources
        self.state.save(record)
        return Credentials(token=tls.token, ca=tls.ca_cert)

    async def endpoint(self, deadline: float) -> str | None:
        name = self.name
        endpoint = await asyncio.to_thread(self.api.endpoint, name, SERVER_PORT)
        if endpoint and ("://" in endpoint or "/" in endpoint):
            raise SkyError(
                f"SkyPilot exposes port {SERVER_PORT} of {name} as {endpoint}, an HTTP ingress path (Kubernetes "
                "with `ports: ingress`, or kind / `sky local up`), which cannot carry artcloud's own TLS: set "
                "`kubernetes: ports: loadbalancer` in ~/.sky/config.yaml, or launch on another cloud",
                code="endpoint_unusable", field="cloud")
        return f"https://{endpoint}" if endpoint else None

    def holds(self) -> bool:
        return not self._reaped  # torn down for being dead: the next start launches anew

    async def last_lines(self, lines: int) -> list[str]:
        return await asyncio.to_thread(self.log_tail, lines)

    async def teardown(self, *, exiting: bool) -> None:
        if not self._reaped:
            await asyncio.to_thread(self.destroy, self._named())

    def _named(self) -> SandboxRecord:
        """What the registry face finds the cluster by (its name): the registry's record, or one made for it."""
        return self.record or SandboxRecord(name=self.name, provider=PROVIDER)

    def log_tail(self, lines: int = 40) -> list[str]:
        try:
            return list(self.logs(self._named(), tail=lines))[-lines:]
        except Exception as e:  # the cluster may not exist at all: the error itself is the news
            log.debug("no logs for %s: %s", self.name, e)
            return []

    async def _tail_text(self, lines: int = 20) -> str:
        """The server's last lines, indented, for an error message."""
        return "\n".join("  " + line for line in await self.last_lines(lines))

    # ------------------------------------------------------------------------------------- liveness

    @staticmethod
    def dead(info: ClusterInfo, *, head_answers: bool | None = None) -> str | None:
        """Why a cluster that exists serves nothing and nothing will take it down, or None. STOPPED: every node
        stopped (a stopped node runs no skylet, so autodown never fires while its disks bill). INIT 'unhealthy'
        with its autostop cancelled: SkyPilot's refresh cancels it when the head node is not alive
        (backend_utils.py:3120-3183). INIT 'unhealthy' whose head does not answer (`head_answers` False): on a VM
        cloud the refresh's cancel goes to the dead head, fails with SSH 255 and the autostop is kept
        (backend_utils.py:3157-3176), while the head's skylet, the only one that autodowns, is gone with it: the
        other nodes bill with nobody to end them. INIT otherwise is a launch in progress, or a node that is unwell
        while its head runs (its autostop stands): not dead (AUTOSTOPPING neither: it is on its way down)."""
        if info.status == "STOPPED":
            return "stopped (its disks still bill, and a stopped cluster never autodowns)"
        if info.status == "INIT" and info.init_kind == "unhealthy":
            if info.autostop_minutes is None or info.autostop_minutes < 0:
                return "unhealthy, its head node down (SkyPilot's status is INIT and its autostop is cancelled)"
            if head_answers is False:
                return ("unhealthy, its head node not answering (SkyPilot's status is INIT; the autostop it could not "
                        "cancel is kept, but with the head gone nothing runs it)")
        return None

    @staticmethod
    def nodes(info: ClusterInfo) -> int:
        """The cluster's node count, from SkyPilot's resources line ('2x(gpus=H100:1, ...)': f'{launched_nodes}x...'
        in resources_utils.py:456); 1 when it does not say."""
        count = re.match(r"\s*(\d+)x", info.resources or "")
        return max(1, int(count.group(1))) if count else 1

    async def _dead(self, info: ClusterInfo, record: SandboxRecord | None = None) -> str | None:
        """dead(), the head probed where SkyPilot's record alone cannot tell (INIT 'unhealthy', autostop kept)."""
        kept = info.autostop_minutes is not None and info.autostop_minutes >= 0
        if info.status == "INIT" and info.init_kind == "unhealthy" and kept:
            return self.dead(info, head_answers=await self._head_answers(record or self.record))
        return self.dead(info)

    @staticmethod
    async def _head_answers(record: SandboxRecord | None) -> bool | None:
        """Whether anything accepts a TCP connection at the head's port (nothing is sent: no token is needed); a
        lost VM's address answers nothing, or refuses. None when no address is known (a detached run serves none)."""
        url = record.url if record is not None else None
        if not url:
            return None
        from urllib.parse import urlsplit

        where = urlsplit(url)
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(where.hostname, where.port or 443), HEAD_PROBE_S)
        except (OSError, asyncio.TimeoutError):
            return False
        writer.close()
        return True

    async def node_lost(self) -> str | None:
        """Why a node of this multi-node cluster is lost, or None: SkyPilot's refreshed status INIT 'unhealthy'
        after it was UP. SkyPilot never brings a node back into a cluster, and the job's task for a lost node is
        retried by Ray into a bundle that cannot be placed (task_codegen.py:465-475), so the job never ends and
        autodown never fires: the cluster stays so, billing, until someone downs it."""
        if self.spec.num_nodes <= 1:
            return None
        info = await asyncio.to_thread(self.api.status, self.name, refresh=True)
        if info is not None and info.status == "INIT" and info.init_kind == "unhealthy" and self.nodes(info) > 1:
            return f"a node of {self.name} was lost (SkyPilot's status is INIT 'unhealthy')"
        return None

    async def _reap(self, reason: str) -> None:
        """Down a cluster of ours that is dead but may bill. Not `keep`-able: nothing is left to debug."""
        log.warning("the cluster %s is %s: tearing it down", self.name, reason)
        await asyncio.to_thread(self.destroy, self._named())
        self.state.mark_down(self.name)
        self._reaped = True

    async def alive(self, *, answered: bool = True) -> None:
        name = self.name
        info = await asyncio.to_thread(self.api.status, name, refresh=True)
        if info is None:
            raise ServerGone(f"the cluster {name} is gone (torn down, preempted or autodowned): "
                             "launch again; training resumes from the last checkpoint pushed to S3", code="cluster_gone")
        reason = await self._dead(info)
        if reason is not None:
            tail = await self._tail_text()
            await self._reap(reason)
            raise ServerGone(f"the cluster {name} was {reason}: torn down; launch again, training resumes from the "
                             "last checkpoint pushed to S3" + (f". Its last lines:\n{tail}" if tail else ""),
                             code="cluster_dead")
        status = await asyncio.to_thread(self.api.job_status, name, self._job_id)
        if status == "FAILED_SETUP":
            await self._raise_setup_failed()
        if status in FAILED_JOB:
            tail = await self._tail_text()
            raise ServerGone(f"the server job on {name} ended ({status}); its last lines:\n{tail}", code="server_exited")

    async def _raise_setup_failed(self) -> None:
        """The install failed (the task's setup, inside the job: FAILED_SETUP): a launch failure, with its lines."""
        tail = await self._tail_text()
        raise ServerGone(f"could not launch {self.name}: installing artcloud on it failed (SkyPilot job "
                          f"FAILED_SETUP); the setup's last lines:\n{tail}", code="setup_failed")

    async def job_started(self, deadline: float) -> None:
        """`artcloud run --detach`: the job's setup (the install) runs after launch returns; the run is launched
        once the job RUNS. FAILED_SETUP, a vanished cluster, or still installing at startup_timeout fail it."""
        delay, longest = self.poll_s
        while True:
            status = await asyncio.to_thread(self.api.job_status, self.name, self._job_id)
            if status == "FAILED_SETUP":
                await self._raise_setup_failed()
            if status is not None and status not in STARTING_JOB:
                return  # RUNNING, or already over: the run's own summary says how it went
            if status is None:
                await self.alive()  # gone or dead: why
            if time.monotonic() > deadline:
                raise SkyError(f"the job on {self.name} was still installing (SkyPilot job {status}) after "
                               f"startup_timeout: raise it, or see `artcloud logs {self.name}`",
                               code="startup_timeout")
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, longest)

    async def lost(self, cause: BaseException) -> bool:
        """The cluster is gone or dead, a node of any rank of it was lost, or its server exited on the cloud's
        preemption notice (the machine goes a little later). A server that failed on a machine that is still fine
        is not replaced."""
        info = await asyncio.to_thread(self.api.status, self.name, refresh=True)
        if info is None or await self._dead(info) is not None:
            return True
        if info.status == "INIT" and info.init_kind == "unhealthy" and self.nodes(info) > 1:
            return True  # see node_lost: such a cluster never heals
        return await self.going()

    async def going(self) -> bool:
        lines = await asyncio.to_thread(self.log_tail, 400)
        return any(PREEMPTION_LINE in line for line in lines)

    async def gone(self, *, ours: bool) -> bool:
        """True when nothing of the cluster is left. A cluster of ours that exists but is dead (stopped, or
        unhealthy after being up) is torn down first: it serves nothing and may still bill."""
        info = await asyncio.to_thread(self.api.status, self.name, refresh=True)
        if info is None:
            return True
        reason = await self._dead(info)
        if reason is None or not ours:
            return False
        await self._reap(reason)
        return await asyncio.to_thread(self.api.status, self.name, refresh=True) is None


class SkyBackend(SandboxBackend):
    """The training server on a SkyPilot cluster of its own, reached over HTTPS.

    gpu: SkyPilot's accelerator spec ('H100:1', 'A100-80GB:2', 'L4'); None for a CPU machine.
    num_nodes: machines of `gpu` (SkyPilot's num_nodes). Over 1, the head node trains and serves as with one, and
        each other node runs an inference replica (`artcloud replica`) that the head spreads rollouts over and
        hands every step to; only the head's port is open to the world. Prices count every node.
    trainer_nodes: of those, how many train (the head and the next ones): the peft trainer sharded (FSDP2) over
        all their trainer GPUs, torchrun's rendezvous on the head; the rest serve rollouts.
    cloud, region: pin the cloud (and region); default: the cheapest among those `sky check` enabled.
    spot: a spot machine; with s3=, a preempted one is replaced and training goes on from S3.
    name: the cluster's name; a running artcloud cluster of that name is attached to; default: artcloud-XXXXXX.
    idle_minutes: SkyPilot autodown, this many minutes after the server job ends.
    lease: the server exits (after a final checkpoint push) when no request or heartbeat came for this long.
    max_duration: the server exits after this long, whatever happens ("90m", "8h", or seconds).
    s3: s3://BUCKET/PREFIX for checkpoints; credentials from this machine's AWS settings travel as secrets.
    env: plain environment for the server; secrets: names of environment variables here, or a dict,
        that reach the server as SkyPilot secrets (redacted in SkyPilot's logs and dashboard).
    image: a prebuilt server image ('docker:...', recipe in launchers/Dockerfile) instead of installing
        this artcloud's wheel at setup. disk: GB (default 256: model weights).
    keep: leave the cluster up when start-up fails and on leaving `async with` (lease and autodown still apply).
    The names are SandboxSpec's, the same on every backend (cluster_name, use_spot and disk_size still work).
    """

    error = SkyError
    RENAMED = {"cluster_name": "name", "use_spot": "spot", "disk_size": "disk"}

    def __init__(
        self,
        gpu: str | None = "H100:1",
        *,
        num_nodes: int = 1,
        trainer_nodes: int = 1,
        cloud: str | None = None,
        region: str | None = None,
        spot: bool = False,
        name: str | None = None,
        idle_minutes: int = 10,
        lease: str | float = "15m",
        max_duration: str | float = "8h",
        s3: str | None = None,
        env: Mapping[str, str] | None = None,
        secrets: Mapping[str, str] | Iterable[str] | None = None,
        image: str | None = None,
        disk: int | None = None,
        engine: str = "auto",
        engine_args: Mapping[str, Any] | None = None,
        keep: bool = False,
        startup_timeout: str | float = "30m",
        retry_until_up: bool = False,
        state_dir: str | Path | None = None,
        api: SkyAPI | None = None,
        **kwargs: Any,
    ):
        given = dict(gpu=gpu, cloud=cloud, region=region, spot=spot, name=name, lease=lease, max_duration=max_duration,
                     s3=s3, env=env, secrets=secrets, image=image, disk=disk, engine=engine, engine_args=engine_args,
                     keep=keep, startup_timeout=startup_timeout, num_nodes=num_nodes)
        given.update(renamed({k: kwargs.pop(k) for k in list(kwargs) if k in self.RENAMED}, self.RENAMED, "SkyBackend"))
        self.spec = spec = SandboxSpec(**given)
        if spec.gpu is not None:
            parse_gpu(spec.gpu)
        if spec.region and not spec.cloud:  # SkyPilot's regions belong to a cloud (Modal's do not)
            raise InvalidArgument("region= needs cloud= too (e.g. cloud='aws', region='us-east-1')", field="region")
        if port_closed(spec.cloud, spec.region):
            raise InvalidArgument(f"SkyPilot opens no port in {spec.cloud}'s {spec.region} (no firewall rules there), "
                                  "and artcloud reaches its server on one: pin another region of it", field="region")
        if idle_minutes < 0:
            raise InvalidArgument(f"idle_minutes must be 0 or more, not {idle_minutes}", field="idle_minutes")
        if spec.image is not None and not str(spec.image).startswith("docker:"):
            raise InvalidArgument(f"image {spec.image!r} must be a docker image, written 'docker:REPO/NAME:TAG'", field="image")
        if spec.lease is None or spec.max_duration is None:
            raise InvalidArgument("a SkyPilot sandbox needs a lease and a max_duration: they are what ends it when no "
                                  "one does", field="lease" if spec.lease is None else "max_duration")
        self.gpu, self.cloud, self.region, self.use_spot = spec.gpu, spec.cloud, spec.region, spec.spot
        self.cluster_name = spec.name or f"artcloud-{_secrets.token_hex(3)}"
        self.lease_s, self.max_duration_s, self.startup_timeout_s = spec.lease, spec.max_duration, spec.startup_timeout
        self.s3, self.image, self.disk_size, self.engine = spec.s3, spec.image, spec.disk, spec.engine
        self.keep = spec.keep
        self.state = StateDir(Path(state_dir) if state_dir is not None else None)
        self.api: SkyAPI = api or sky_api()
        if (isinstance(trainer_nodes, bool) or not isinstance(trainer_nodes, int)
                or not 1 <= trainer_nodes <= spec.num_nodes):
            raise InvalidArgument(f"trainer_nodes is a whole number from 1 to num_nodes ({spec.num_nodes}), not "
                                  f"{trainer_nodes!r}", field="trainer_nodes")
        self.provisioner = SkyProvisioner(self.api, name=self.cluster_name, spec=spec, state=self.state,
                                          idle_minutes=int(idle_minutes), retry_until_up=retry_until_up,
                                          trainer_nodes=trainer_nodes)
        self.env = self.provisioner.env
        # A spot machine may be taken away: with S3 to resume from, a new one takes its place (see recover).
        self.relaunch_on_loss = bool(spec.spot and spec.s3)
        if spec.spot and not spec.s3:
            log.warning("spot=True without s3=: a preempted machine takes its checkpoints with it, and training "
                        "cannot resume elsewhere; give s3='s3://BUCKET/PREFIX'")
        kwargs.setdefault("heartbeat_every_s", heartbeat_every(self.lease_s))
        # The launch CA signs one certificate and its key is thrown away: the CA alone identifies the
        # server, whatever address the cloud gives it, so host names are not checked.
        kwargs.setdefault("check_hostname", False)
        super().__init__("https://pending.invalid", token="", ca_cert="", **kwargs)

    def __repr__(self) -> str:
        where = self.base_url if self._owns else "not started"
        return f"SkyBackend(name={self.cluster_name!r}, gpu={self.gpu!r}, {where})"

    def plan(self) -> Plan:
        """The machine a launch would get and what it costs, per hour and for max_duration; launches
        nothing (it asks SkyPilot's catalog and `sky check`). The real price is known once launched:
        `price_per_hour` then comes from what SkyPilot launched."""
        return self.provisioner.plan()

    async def launch_job(self, script: Path, run_args: Callable[[float | None], list[str]]) -> None:
        """`artcloud run --detach`: the cluster runs the training loop itself (`artcloud run SCRIPT
        --backend local ...`, its own server on the same machine) instead of serving this client.
        `run_args(price_per_hour)` gives that command's arguments once the catalog's price is known.
        Returns once the job runs, its install done (a failed install raises, with its last lines); the cluster goes
        `idle_minutes` after the loop ends."""
        if self._owns or await asyncio.to_thread(self.api.status, self.cluster_name, refresh=True) is not None:
            raise SkyError(f"a cluster named {self.cluster_name} exists: choose another name for the run",
                           code="name_taken", field="cluster_name")
        self.client.shut_down = True  # no server of ours to ask for a final push: the loop pushes its own
        await self._launch(job=(Path(script), run_args))
