"""The backend a training script should use, chosen outside the script: by `artcloud run`, or by env.

    backend = artcloud.backend_from_env()      # in a script that `artcloud run` (or plain python) starts
    async with backend:
        await model.register(backend)

Under `artcloud run` the runner has already started the sandbox and owns it: the script gets a
RemoteBackend to that server (its `down()` only disconnects; the runner pushes the final checkpoint and
tears the sandbox down). Run with plain `python`, $ARTCLOUD_BACKEND (local, sky, modal) and the
$ARTCLOUD_GPU / $ARTCLOUD_S3 / ... variables below pick and configure a backend the script then owns;
with none of them set, a LocalBackend.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from artcloud.backends.client import ServerGone
from artcloud.backends.remote import RemoteBackend
from artcloud.errors import ArtcloudError, InvalidArgument, first_line

# Set by `artcloud run` for the script it starts (the token travels in a 0600 file, never in the env).
ENV_URL = "ARTCLOUD_RUN_URL"
ENV_TOKEN_FILE = "ARTCLOUD_RUN_TOKEN_FILE"
ENV_CA_FILE = "ARTCLOUD_RUN_CA_FILE"  # empty: the public CAs (Modal's HTTPS edge)
ENV_CHECK_HOSTNAME = "ARTCLOUD_RUN_CHECK_HOSTNAME"
ENV_RUN_NAME = "ARTCLOUD_RUN_NAME"
# A spot run's server may be replaced (a preempted machine): the runner keeps the current address, token and
# CA in this 0600 JSON file, and the script's backend reads it when its server is lost.
ENV_CONNECTION = "ARTCLOUD_RUN_CONNECTION"
PARENT_NOTICE_S = 60.0  # how long a script waits for the runner to notice a lost server
REPLACE_WAIT_S = 45 * 60.0  # and for the runner to bring up a new one

BACKENDS = ("local", "sky", "modal")
log = logging.getLogger("artcloud.backends")


def backend_from_env(default: Callable[[], RemoteBackend] | None = None) -> RemoteBackend:
    """The server `artcloud run` started for this script; else the backend $ARTCLOUD_BACKEND names,
    configured from $ARTCLOUD_GPU, $ARTCLOUD_S3, $ARTCLOUD_MAX_DURATION, $ARTCLOUD_LEASE; else
    `default()`; else a LocalBackend."""
    env = os.environ
    if env.get(ENV_URL):
        try:
            with open(env[ENV_TOKEN_FILE]) as f:
                token = f.read().strip()
        except (KeyError, OSError) as e:
            raise ArtcloudError(f"{ENV_URL} is set but the run's token file is not readable ({e}): "
                               "start the script with `artcloud run SCRIPT`", code="run_token_unreadable") from e
        kind = RunnerBackend if env.get(ENV_CONNECTION) else RemoteBackend
        return kind(env[ENV_URL], token=token, ca_cert=env.get(ENV_CA_FILE) or None,
                    check_hostname=env.get(ENV_CHECK_HOSTNAME, "1") != "0")
    kind = env.get("ARTCLOUD_BACKEND")
    if kind:
        return make_backend(kind, gpu=env.get("ARTCLOUD_GPU"), s3=env.get("ARTCLOUD_S3"),
                            max_duration=env.get("ARTCLOUD_MAX_DURATION"), lease=env.get("ARTCLOUD_LEASE"))
    if default is not None:
        return default()
    from artcloud.backends.local import LocalBackend

    return LocalBackend()


def make_backend(
    kind: str,
    *,
    gpu: str | None = None,
    s3: str | None = None,
    max_duration: str | float | None = None,
    lease: str | float | None = None,
    name: str | None = None,
    cloud: str | None = None,
    env: Mapping[str, str] | None = None,
    secrets: list[str] | None = None,
    engine: str | None = None,
    **extra: Any,
) -> RemoteBackend:
    """A backend of `kind` from the options `artcloud run` and the env share; None leaves a default."""
    if kind not in BACKENDS:
        raise InvalidArgument(f"backend {kind!r} is not one of {', '.join(BACKENDS)}")
    given = {k: v for k, v in dict(lease=lease, s3=s3, **extra).items() if v is not None}
    if kind == "local":
        from artcloud.backends.local import LocalBackend

        if gpu or cloud or name or env or secrets:
            used = [f for f, v in (("gpu", gpu), ("cloud", cloud), ("name", name), ("env", env), ("secrets", secrets)) if v]
            raise InvalidArgument(f"{', '.join(used)} {'does' if len(used) == 1 else 'do'} not apply to the local backend")
        return LocalBackend(engine=engine or "cpu", max_duration=max_duration, **given)
    common = dict(env=dict(env or {}), secrets=list(secrets or []), engine=engine or "auto", **given)
    if kind == "sky":
        from artcloud.backends.sky import SkyBackend

        return SkyBackend(gpu=gpu or "H100:1", cloud=cloud, name=name,
                          **({"max_duration": max_duration} if max_duration is not None else {}), **common)
    from artcloud.backends.modal import ModalBackend

    if cloud:
        # Modal's Sandbox.create takes a cloud= ("Cloud provider for the sandbox", modal sandbox/_sandbox.py:194,
        # 240), but ModalBackend does not pass one: say that, not that Modal has no choice.
        raise InvalidArgument(f"cloud={cloud!r} is for the sky backend: artcloud's modal backend does not pass a cloud "
                              "to Modal, which picks one itself; leave --cloud out, or use --backend sky to pin a cloud",
                              field="cloud")
    return ModalBackend(gpu=gpu or "H100", name=name, **({"max_duration": max_duration} if max_duration is not None else {}),
                        **common)


def write_connection(path: Path, backend: RemoteBackend, *, replacing: bool, failed: bool = False) -> None:
    """The runner's side: where the script's server is now (atomically, 0600: it holds the token)."""
    ep = backend.endpoint
    ca = ep.ca if isinstance(ep.ca, str) and "BEGIN CERTIFICATE" in ep.ca else None
    data = {"generation": ep.generation, "url": ep.url, "token": ep.token, "ca_pem": ca,
            "check_hostname": ep.check_hostname, "replacing": replacing, "failed": failed}
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _read_connection(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


class RunnerBackend(RemoteBackend):
    """The script's backend under `artcloud run --spot`: when its server is lost, it waits for the runner
    (which owns the machine) to bring up a new one, then goes there; the models register again and resume
    from S3 (RemoteBackend.recover)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._connection = os.environ[ENV_CONNECTION]
        self._runner_generation = (_read_connection(self._connection) or {}).get("generation", 0)

    async def _check_alive(self) -> None:
        found = _read_connection(self._connection) or {}
        if found.get("replacing") or found.get("generation", 0) != self._runner_generation:
            raise ServerGone(f"the server at {self.base_url} is being replaced by the runner", code="server_replaced")
        try:
            await self.client.call("GET", "/health", retry=False, timeout=10.0)
        except ServerGone:
            raise
        except ArtcloudError:
            return

    async def _replace_server(self, cause: BaseException) -> dict[str, Any] | None:
        loop = asyncio.get_running_loop()
        noticed_by = loop.time() + PARENT_NOTICE_S  # the runner checks its machine every few seconds
        replaced_by: float | None = None  # set once the runner says it is replacing it
        while True:
            found = _read_connection(self._connection) or {}
            if found.get("failed"):
                return None
            if found.get("generation", 0) != self._runner_generation and not found.get("replacing"):
                break
            if found.get("replacing") and replaced_by is None:
                replaced_by = loop.time() + REPLACE_WAIT_S
            if loop.time() > (replaced_by or noticed_by):
                return None
            await asyncio.sleep(1.0)
        await self._close_http()
        self._publish(found["url"], token=found["token"], ca=found.get("ca_pem"),
                      check_hostname=bool(found.get("check_hostname", True)))
        self.client.version_checked = False
        self._runner_generation = found["generation"]
        log.warning("the runner replaced the server: now at %s", self.base_url)
        return {"at": time.time(), "url": self.base_url, "reason": first_line(cause)}
