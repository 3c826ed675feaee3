"""The SkyPilot task that runs `artcloud serve`: sky/artcloud-server.yaml, filled from SkyBackend's arguments.

The template is a plain SkyPilot YAML (usable with `sky launch` as it is); filling it only sets resources,
envs and the workdir that carries the wheel, never its scripts' text. Secrets (token, TLS key, S3
credentials) never enter the task dict: they travel next to it and reach SkyPilot as task secrets, which
SkyPilot redacts in the task YAML it stores and shows. They are not secret from SkyPilot itself: its API
server keeps the launch request whole, and the machine's setup/run scripts hold them as `export` lines, so
whoever can read those can read them. Hence short-lived, scoped credentials (README, "Secrets").
`render` shows a task with every secret redacted.
"""

from __future__ import annotations

import copy
import shlex
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from artcloud import locks
from artcloud._version import __version__
from artcloud.errors import InvalidArgument

TEMPLATE_NAME = "artcloud-server.yaml"
SERVER_PORT = 8080  # the one port every SkyPilot cloud forwards (Vast forwards no other)
# The replicas' port on the other nodes of a cluster: never in `ports` (open to the world); the nodes reach each
# other inside the cluster (AWS: the cluster's security group admits all traffic from itself,
# sky/provision/aws/config.py:658-667).
REPLICA_PORT = 8081
TRAINER_PORT = 29500  # the sharded trainer's rendezvous on the head (torchrun's master port), inside the cluster too
SECRET_NAMES = ("ARTCLOUD_TOKEN", "ARTCLOUD_TLS_CERT", "ARTCLOUD_TLS_KEY")
# The trainer nodes' shared secret (server/engines/children.py KEY_ENV), not the client's token: each rank of the
# sharded trainer proves it before the group trains, torchrun's rendezvous having no secret of its own.
TRAINER_KEY = "ARTCLOUD_TRAINER_KEY"
# The replicas' own token, certificate and key (their CA apart from the launch's): a replica node's secrets let no one
# act as the head's server, nor call it (security review 3, N5). The head holds the token, to call them.
REPLICA_SECRETS = ("ARTCLOUD_REPLICA_TOKEN", "ARTCLOUD_REPLICA_TLS_CERT", "ARTCLOUD_REPLICA_TLS_KEY")
RESERVED = (*SECRET_NAMES, TRAINER_KEY, *REPLICA_SECRETS)  # artcloud's own secrets: a user's may not take these names
HOOK_CLOUDS = ("kubernetes", "k8s", "ssh")  # where SkyPilot runs the template's preemption hook (a pod's SIGTERM)
REDACTED = "<redacted>"


def load_template() -> dict[str, Any]:
    """The template shipped inside the package (artcloud/templates is a link to the top-level sky/)."""
    import yaml

    text = resources.files("artcloud").joinpath("templates", TEMPLATE_NAME).read_text()
    return yaml.safe_load(text)


@dataclass
class ServerTask:
    """The filled task (no secrets in it) and the secrets that go with it."""

    config: dict[str, Any]
    secrets: dict[str, str] = field(repr=False)

    def render(self) -> str:
        """The task as YAML, secrets redacted: what `artcloud launch --dry-run` prints."""
        import yaml

        class Dumper(yaml.SafeDumper):
            pass

        def text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:  # scripts as `|` blocks, as written
            style = "|" if "\n" in value else None
            return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

        Dumper.add_representer(str, text)
        shown = copy.deepcopy(self.config)
        shown["secrets"] = {name: REDACTED for name in self.secrets}
        return yaml.dump(shown, Dumper=Dumper, sort_keys=False, width=100)


def build_task(
    *,
    secrets: dict[str, str],
    gpu: str | None = "H100:1",
    cloud: str | None = None,
    region: str | None = None,
    use_spot: bool = False,
    disk_size: int | None = None,
    image: str | None = None,
    engine: str = "auto",
    lease_s: float = 900.0,
    max_duration_s: float = 8 * 3600.0,
    s3: str | None = None,
    s3_endpoint_url: str | None = None,
    env: dict[str, str] | None = None,
    wheel: Path | None = None,
    run_args: list[str] | None = None,
    workdir: Path | None = None,
    num_nodes: int = 1,
    ca_cert: str | None = None,
    replica_ca: str | None = None,
    trainer_nodes: int = 1,
) -> ServerTask:
    """Fill the template. `secrets` must hold the token and the server's certificate and key (PEM);
    it may hold more (S3 credentials, the user's own). `wheel`: a wheel file whose folder becomes the
    task's workdir, so the sandbox installs exactly this client's artcloud. `run_args`: run
    `artcloud run ARGS...` (a detached training loop, its script in the workdir) instead of the server;
    `workdir`: the folder to sync when there is no wheel (a prebuilt image). `num_nodes` over 1: the other nodes
    run inference replicas on REPLICA_PORT, reached by the head at their private IPs and trusted through the
    launch's CA (`ca_cert`, public: it goes in the envs); the first `trainer_nodes` of them (the head included)
    train instead, the sharded trainer's ranks meeting at the head's TRAINER_PORT."""
    missing = [name for name in SECRET_NAMES if not secrets.get(name)]
    if missing:
        raise InvalidArgument(f"the task needs the secrets {', '.join(missing)}")
    if region and not cloud:
        raise InvalidArgument("a region needs its cloud too: pass cloud= (e.g. cloud='aws', region='us-east-1')")
    if num_nodes > 1 and run_args is not None:
        raise InvalidArgument("artcloud run trains on one node: leave num_nodes at 1", field="num_nodes")
    if not 1 <= trainer_nodes <= num_nodes:
        raise InvalidArgument(f"trainer_nodes is 1 to num_nodes ({num_nodes}), not {trainer_nodes}: the nodes that "
                              "train, the head first", field="trainer_nodes")
    if num_nodes > 1 and not ca_cert:
        raise InvalidArgument("several nodes need the launch's CA certificate (ca_cert): the head checks its replicas with it")
    if num_nodes > trainer_nodes and not (replica_ca and all(secrets.get(n) for n in REPLICA_SECRETS)):
        raise InvalidArgument(f"nodes that serve as replicas need their own CA (replica_ca) and the secrets "
                              f"{', '.join(REPLICA_SECRETS)}: the launch's are the head's alone", field="secrets")
    if trainer_nodes > 1 and len(secrets.get(TRAINER_KEY, "")) < 32:
        raise InvalidArgument(f"several trainer nodes need the secret {TRAINER_KEY} (32 characters or more), which "
                              "their ranks prove to each other", field="secrets")
    config = load_template()
    if num_nodes > 1:
        config["num_nodes"] = int(num_nodes)

    res = config["resources"]
    if gpu:
        res["accelerators"] = gpu
    else:
        res.pop("accelerators", None)
    if cloud:
        res["infra"] = f"{cloud}/{region}" if region else cloud
        if cloud.lower() not in HOOK_CLOUDS:
            # The preemption hook runs only on Kubernetes (skylet/skylet.py:94-126), but a task that declares a
            # hook makes every `sky down` first run a command on the head (core.py:949, 953-1010): up to SSH's
            # 30 s timeout on a dead head, the very ones artcloud reaps. Pinned elsewhere, it is left out.
            config.pop("config", None)
    res["use_spot"] = bool(use_spot)
    config["envs"]["ARTCLOUD_WATCH_PREEMPTION"] = "1" if use_spot else "0"
    if disk_size is not None:
        res["disk_size"] = int(disk_size)
    res["ports"] = SERVER_PORT
    if image:
        res["image_id"] = image

    envs = config["envs"]
    envs.update({
        "ARTCLOUD_VERSION": __version__,
        "ARTCLOUD_ENGINE": engine,
        "ARTCLOUD_PORT": str(SERVER_PORT),
        "ARTCLOUD_LEASE": format_duration_exact(lease_s),
        "ARTCLOUD_MAX_DURATION": format_duration_exact(max_duration_s),
        "ARTCLOUD_S3": s3 or "",
        "ARTCLOUD_S3_ENDPOINT_URL": s3_endpoint_url or "",
    })
    if image:
        envs["ARTCLOUD_INSTALL"] = "0"
        envs["ARTCLOUD_WHEEL"] = ""
    elif wheel is not None:
        envs["ARTCLOUD_WHEEL"] = wheel.name
        config["workdir"] = str(wheel.parent)
    if workdir is not None and "workdir" not in config:
        config["workdir"] = str(workdir)
    if num_nodes > 1:
        envs["ARTCLOUD_TLS_CA"] = str(ca_cert)
        envs["ARTCLOUD_REPLICA_CA"] = str(replica_ca or "")
        envs["ARTCLOUD_TRAINER_NODES"] = str(trainer_nodes)
        envs["ARTCLOUD_TRAINER_PORT"] = str(TRAINER_PORT)
        # Only the names, for the run script: SkyPilot exports every secret on every node, and each role keeps those
        # it needs (the trainer nodes the trainer key, the replicas their own token and TLS pair).
        envs["ARTCLOUD_SECRET_NAMES"] = " ".join(sorted(secrets))
    if run_args is not None:  # same shell (venv, timeout belt), another command: `artcloud run`
        envs["ARTCLOUD_RUN_ARGS"] = shlex.join(run_args)
    for key, value in (env or {}).items():
        if key in secrets:
            raise InvalidArgument(f"{key} is given both as an env and as a secret: keep it a secret only")
        envs[key] = str(value)
    if not (env or {}).get("ARTCLOUD_PYTHON"):  # the Pythons the lock of the extras installed serves
        envs["ARTCLOUD_PYTHON"] = locks.python_request(envs["ARTCLOUD_EXTRAS"])

    # Only the names: the values stay in ServerTask.secrets and go to SkyPilot as task secrets.
    config["secrets"] = {name: None for name in secrets}
    return ServerTask(config=config, secrets=dict(secrets))


def format_duration_exact(seconds: float) -> str:
    """Seconds as the server's --lease / --max-duration take them, without rounding away precision."""
    whole = int(round(seconds))
    if whole % 60:
        return f"{whole}s"
    return f"{whole // 3600}h" if whole % 3600 == 0 else f"{whole // 60}m"


def describe(task: ServerTask) -> str:
    """One line about what the task asks for."""
    res = task.config["resources"]
    where = res.get("infra") or "the cheapest enabled cloud"
    nodes = int(task.config.get("num_nodes") or 1)
    if nodes > 1:
        trainers = int(task.config["envs"].get("ARTCLOUD_TRAINER_NODES") or 1)
        where += (f", {nodes} nodes (the head serves; {trainers} train, {nodes - trainers} serve rollouts on port "
                  f"{REPLICA_PORT}, inside the cluster)")
    spot = " (spot)" if res.get("use_spot") else ""
    lease, max_d = task.config["envs"]["ARTCLOUD_LEASE"], task.config["envs"]["ARTCLOUD_MAX_DURATION"]
    return (f"{res.get('accelerators') or 'no GPU'}{spot} on {where}, port {res['ports']}; "
            f"the server exits after {lease} without a client, or after {max_d} at most")

