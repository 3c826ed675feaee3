"""SandboxSpec: what a sandbox is, written once and checked once, whoever asks for it.

SkyBackend, ModalBackend and LocalBackend, `artcloud launch`, `artcloud run` and `backend_from_env` all build one,
with the same names for the same things on every provider:

    gpu, num_nodes, cloud, region, spot, disk, image, engine, engine_args, env, secrets, s3,
    lease, max_duration, startup_timeout, name, keep

Durations follow artcloud.durations (a string with its unit, a timedelta, or seconds). What only one provider has
stays on its backend (SkyPilot's idle_minutes and retry_until_up, Modal's idle_timeout, cpu and memory). Spellings
of earlier releases (SkyBackend's cluster_name, use_spot and disk_size, ModalBackend's timeout) still work, with a
DeprecationWarning, through `renamed`.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from artcloud.backends.state import check_name
from artcloud.durations import parse_duration
from artcloud.errors import InvalidArgument, check_s3_url
from artcloud.wire import ENGINES  # checked here too: a typo fails before a machine is paid for


@dataclass(frozen=True)
class SandboxSpec:
    gpu: str | None = "H100:1"
    cloud: str | None = None
    region: str | None = None
    spot: bool = False
    disk: int | None = None  # GB
    image: Any = None  # a docker image ("docker:REPO:TAG") for SkyPilot, a modal.Image for Modal
    engine: str = "auto"
    engine_args: Mapping[str, Any] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    secrets: Mapping[str, str] | Iterable[str] | None = field(default=None, repr=False)
    s3: str | None = None
    lease: float | None = 900.0  # seconds; None: the server never ends for want of a client
    max_duration: float | None = 8 * 3600.0  # seconds; None: no cap
    startup_timeout: float = 1800.0  # seconds, from the launch call to a ready server
    name: str | None = None
    keep: bool = False
    num_nodes: int = 1  # machines of `gpu` each: the head trains and serves, the others serve rollouts (replicas)

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        for name in ("lease", "max_duration", "startup_timeout"):
            value = getattr(self, name)
            if value is not None:
                put(name, parse_duration(value, what=name))
        if self.startup_timeout is None:
            raise InvalidArgument("startup_timeout must be a duration, e.g. '30m'", field="startup_timeout")
        check_s3_url(self.s3)
        if self.disk is not None and (isinstance(self.disk, bool) or not isinstance(self.disk, int) or self.disk < 10):
            raise InvalidArgument(f"disk is a whole number of GB, 10 or more, not {self.disk!r}", field="disk")
        if isinstance(self.num_nodes, bool) or not isinstance(self.num_nodes, int) or self.num_nodes < 1:
            raise InvalidArgument(f"num_nodes is a whole number of machines, 1 or more, not {self.num_nodes!r}",
                                  field="num_nodes")
        if self.engine not in ENGINES:
            raise InvalidArgument(f"unknown engine {self.engine!r}: choose one of {', '.join(ENGINES)}", field="engine")
        if self.engine_args is not None and not (isinstance(self.engine_args, Mapping)
                                                 and all(isinstance(k, str) for k in self.engine_args)):
            raise InvalidArgument("engine_args must be a dict of engine settings, e.g. {'max_model_len': 8192}",
                                  field="engine_args")
        put("env", {str(k): str(v) for k, v in (self.env or {}).items()})
        if self.name is not None:
            check_name(self.name)


    def engine_env(self) -> dict[str, str]:
        """How a backend hands engine_args to the server it starts: ARTCLOUD_ENGINE_ARGS (JSON), which `artcloud
        serve` reads like --engine-args. Not a secret: it holds sizes and switches."""
        if not self.engine_args:
            return {}
        return {"ARTCLOUD_ENGINE_ARGS": json.dumps(dict(self.engine_args), sort_keys=True)}


def renamed(old: Mapping[str, Any], names: Mapping[str, str], owner: str) -> dict[str, Any]:
    """{new name: value} for the old spellings in `old` (keys of `names`), each with a DeprecationWarning naming
    the new one."""
    new: dict[str, Any] = {}
    for key, value in old.items():
        warnings.warn(f"{owner}({key}=...) is now {names[key]}=..., the same name on every backend; {key}= goes "
                      "in the next release", DeprecationWarning, stacklevel=3)
        new[names[key]] = value
    return new
