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

import os
from typing import Any, Callable, Mapping

from artcloud.backends.remote import RemoteBackend

# Set by `artcloud run` for the script it starts (the token travels in a 0600 file, never in the env).
ENV_URL = "ARTCLOUD_RUN_URL"
ENV_TOKEN_FILE = "ARTCLOUD_RUN_TOKEN_FILE"
ENV_CA_FILE = "ARTCLOUD_RUN_CA_FILE"  # empty: the public CAs (Modal's HTTPS edge)
ENV_CHECK_HOSTNAME = "ARTCLOUD_RUN_CHECK_HOSTNAME"
ENV_RUN_NAME = "ARTCLOUD_RUN_NAME"

BACKENDS = ("local", "sky", "modal")


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
            raise RuntimeError(f"{ENV_URL} is set but the run's token file is not readable ({e}): "
                               "start the script with `artcloud run SCRIPT`") from e
        return RemoteBackend(env[ENV_URL], token=token, ca_cert=env.get(ENV_CA_FILE) or None,
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
        raise ValueError(f"backend {kind!r} is not one of {', '.join(BACKENDS)}")
    given = {k: v for k, v in dict(lease=lease, s3=s3, **extra).items() if v is not None}
    if kind == "local":
        from artcloud.backends.local import LocalBackend

        if gpu or cloud or name or env or secrets:
            used = [f for f, v in (("gpu", gpu), ("cloud", cloud), ("name", name), ("env", env), ("secrets", secrets)) if v]
            raise ValueError(f"{', '.join(used)} {'does' if len(used) == 1 else 'do'} not apply to the local backend")
        return LocalBackend(engine=engine or "cpu", max_duration=max_duration, **given)
    common = dict(env=dict(env or {}), secrets=list(secrets or []), engine=engine or "auto", **given)
    if kind == "sky":
        from artcloud.backends.sky import SkyBackend

        return SkyBackend(gpu=gpu or "H100:1", cloud=cloud, cluster_name=name,
                          **({"max_duration": max_duration} if max_duration is not None else {}), **common)
    from artcloud.backends.modal import ModalBackend

    if cloud:
        raise ValueError("cloud does not apply to the modal backend (Modal picks its own)")
    return ModalBackend(gpu=gpu or "H100", name=name, **({"timeout": max_duration} if max_duration is not None else {}),
                        **common)
