"""Watch the cloud's preemption notice on a spot machine, and push the last checkpoint when it comes.

A spot VM is reclaimed with a short warning: AWS posts `spot/instance-action` two minutes ahead, GCP sets
`instance/preempted` about 30 s ahead, Azure schedules a `Preempt` event. The server's lifecycle task
(lifecycle.py) polls its cloud's metadata service (the one that answers) every few seconds, each request on a
worker thread; on a notice it takes the same way out as a signal or the lease: stop taking work, push the
newest committed checkpoint of every model to S3, exit. The client relaunches on a new machine, which resumes
from that checkpoint.

SkyPilot's own `preemption` lifecycle hook (which it runs on Kubernetes) reaches the server by SIGTERM: see
sky/artcloud-server.yaml. Endpoints follow the clouds' own conventions for overriding them:
AWS_EC2_METADATA_SERVICE_ENDPOINT (botocore) and GCE_METADATA_HOST (google-auth).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import urllib.error
import urllib.request

log = logging.getLogger("artcloud.server")

POLL_S = 5.0  # AWS's advice for instance-action; GCP's and Azure's notices are no shorter than 30 s
PROBE_TIMEOUT_S = 1.0


def _get(url: str, headers: dict[str, str], method: str = "GET") -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=PROBE_TIMEOUT_S) as r:  # noqa: S310 (a fixed metadata URL)
            return r.status, r.read(65536).decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, ""


class AWS:
    name = "AWS"

    def __init__(self) -> None:
        self.base = os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://169.254.169.254").rstrip("/")

    def _token(self) -> str:
        status, token = _get(f"{self.base}/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "300"}, "PUT")
        if status != 200 or not token:
            raise OSError(f"IMDSv2 token: HTTP {status}")
        return token

    def notice(self) -> str | None:
        status, body = _get(f"{self.base}/latest/meta-data/spot/instance-action",
                            {"X-aws-ec2-metadata-token": self._token()})
        if status == 200:  # {"action": "terminate", "time": "..."}; 404 until then
            return f"AWS spot instance-action {body.strip()[:200]}"
        return None


class GCP:
    name = "GCP"

    def __init__(self) -> None:
        host = os.environ.get("GCE_METADATA_HOST", "metadata.google.internal")
        self.base = host if "://" in host else f"http://{host}"

    def notice(self) -> str | None:
        status, body = _get(f"{self.base}/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"})
        if status != 200:
            raise OSError(f"GCP metadata: HTTP {status}")
        return "GCP instance/preempted is TRUE" if body.strip().upper() == "TRUE" else None


class Azure:
    name = "Azure"

    def notice(self) -> str | None:
        status, body = _get("http://169.254.169.254/metadata/scheduledevents?api-version=2020-07-01", {"Metadata": "true"})
        if status != 200:
            raise OSError(f"Azure scheduled events: HTTP {status}")
        for event in json.loads(body or "{}").get("Events", []):
            if event.get("EventType") == "Preempt":
                return f"Azure scheduled event Preempt at {event.get('NotBefore', '?')}"
        return None


def find_cloud() -> AWS | GCP | Azure | None:
    """The cloud whose metadata service answers here, or None (not a cloud VM, or one without notices)."""
    for cloud in (AWS(), GCP(), Azure()):
        try:
            cloud.notice()
        except (OSError, ValueError):
            continue
        return cloud
    return None


class Watch:
    """The cloud's notice, asked for at most every `every_s` by the lifecycle task; each request runs on a
    worker thread (urllib blocks, the server's loop must not)."""

    def __init__(self, every_s: float = POLL_S):
        self.every_s = every_s
        self.cloud: AWS | GCP | Azure | None = None
        self._failures = 0
        self._next = 0.0

    async def start(self) -> None:
        self.cloud = await asyncio.to_thread(find_cloud)
        if self.cloud is None:
            log.warning("preemption watch: no cloud metadata service answers here; SkyPilot's preemption hook (SIGTERM) "
                        "is the only notice this server gets")
        else:
            log.info("preemption watch: polling %s's notice every %.0f s", self.cloud.name, self.every_s)

    async def notice(self) -> str | None:
        """The notice (a line for the log) once it has come, else None."""
        if self.cloud is None or time.monotonic() < self._next:
            return None
        self._next = time.monotonic() + self.every_s
        try:
            what = await asyncio.to_thread(self.cloud.notice)
        except (OSError, ValueError) as e:
            self._failures += 1
            if self._failures in (3, 100):
                log.warning("preemption watch: %s metadata does not answer (%s)", self.cloud.name, e)
            return None
        self._failures = 0
        return what
