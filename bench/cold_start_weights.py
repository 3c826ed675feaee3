"""Cold start, weights: pulling a base model's weights folder from a local S3 server (SeaweedFS), four ways.

A folder of --files files of random bytes (--weights-mb in all, like a model's safetensors shards) plus a
config.json is staged with `WeightsStore.stage` into a SeaweedFS started here (`weed mini` on loopback),
then pulled into a fresh folder, side by side, alternating the order per repeat:

  artcloud      WeightsStore.pull: ranged GETs of --chunk-mb on --workers threads across all files,
                sha256 of every file checked while it downloads, renamed into place (what a sandbox runs)
  aws           `aws s3 sync s3://.../files/ DIR` (awscli's defaults: 10 concurrent requests, 8 MiB parts)
  sequential    one plain boto3 get_object per file, streamed to disk, one after the other
  download_file boto3's managed transfer (s3transfer) per file, --workers files at once, TransferConfig(
                multipart_chunksize=--chunk-mb, max_concurrency=--workers): the alternative artcloud's
                own ranged GETs were measured against

Only artcloud verifies sha256; the others trust what they got. Seconds are wall time, medians over
--weights-repeats; MB/s is 10**6 bytes per second; ratio = peer seconds / artcloud seconds (above 1:
artcloud is faster).

Two links: "loopback" straight to SeaweedFS, where client and server share this machine's cores and the
server reads from the page cache (CPU-bound: it ranks the clients' CPU cost, nothing else); and, unless
--per-connection-mbps is 0, through a TCP proxy that caps each connection at that many MB/s and delays
each request by --rtt-ms, the way one TCP stream to a cloud object store is limited (one S3 connection
gets roughly 50-100 MB/s; a VM's NIC allows 10-100 Gbit/s in all). That is where parallel connections
pay; the proxy is Python, so its own ceiling (a few hundred MB/s here) caps the parallel sides.

    .venv/bin/python bench/cold_start_weights.py                      # 1 GB, 4 files
    .venv/bin/python bench/cold_start_weights.py --weights-mb 200 --repeats 1
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: tests.seaweed

from artcloud.storage.s3 import S3Config  # noqa: E402
from artcloud.storage.weights import WeightsStore  # noqa: E402
from tests.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedS3  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench/weights"
BUCKET = "cold-start-weights"
MiB = 1 << 20


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("weights (bench/cold_start_weights.py)")
    g.add_argument("--weights-mb", type=int, default=1024, help="size of the weights folder, MiB (default 1024)")
    g.add_argument("--files", type=int, default=4, help="files it is split into (default 4)")
    g.add_argument("--chunk-mb", type=int, default=16, help="artcloud's ranged GET size, MiB (default 16)")
    g.add_argument("--workers", type=int, default=16, help="artcloud's threads (default 16)")
    g.add_argument("--weights-repeats", type=int, default=3, help="pulls per side; medians reported (default 3)")
    g.add_argument("--per-connection-mbps", type=float, default=50.0,
                   help="cap of each TCP connection through the link proxy, MB/s; 0 skips the capped link (default 50)")
    g.add_argument("--rtt-ms", type=float, default=10.0, help="delay added to each request through the proxy (default 10)")
    g.add_argument("--aws", default=None, help="the aws CLI (default: .venv/bin/aws, /tmp/awscli-venv/bin/aws, PATH)")


def find_aws(flag: str | None) -> str | None:
    for cand in ([flag] if flag else [str(ROOT / ".venv/bin/aws"), "/tmp/awscli-venv/bin/aws"]):
        if Path(cand).is_file():
            return cand
    return shutil.which("aws")


def make_weights(folder: Path, total_mb: int, files: int) -> int:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "bench"}\n')
    each = total_mb * MiB // files
    for i in range(files):
        with open(folder / f"model-{i + 1:05d}-of-{files:05d}.safetensors", "wb") as f:
            for _ in range(each // MiB):
                f.write(os.urandom(MiB))  # random: nothing compresses or dedups
            f.write(os.urandom(each % MiB))
    return sum(p.stat().st_size for p in folder.iterdir())


def aws_sync(exe: str, endpoint: str, src: str, dst: Path, tmp: Path) -> None:
    cfg = tmp / "aws-config"
    cfg.write_text("[default]\nregion = us-east-1\ns3 =\n  addressing_style = path\n")
    env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": str(cfg),
           "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "no-credentials"), "AWS_EC2_METADATA_DISABLED": "true"}
    r = subprocess.run([exe, "s3", "sync", src, str(dst), "--endpoint-url", endpoint, "--no-progress", "--only-show-errors"],
                       env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"aws s3 sync failed ({r.returncode}): {r.stderr[-2000:]}")


class LinkProxy:
    """A TCP proxy on loopback: each connection's download is capped at `mbps` MB/s, and each chunk the
    client sends (a request) waits `rtt_ms` first. A stand-in for one TCP stream to a cloud object store."""

    def __init__(self, target_port: int, mbps: float, rtt_ms: float):
        self.target_port, self.rate, self.delay = target_port, mbps * 1e6, rtt_ms / 1000
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.endpoint = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, capped: bool) -> None:
        due = time.monotonic()
        try:
            while data := src.recv(256 << 10):
                if capped:
                    due = max(due, time.monotonic()) + len(data) / self.rate
                    time.sleep(max(0.0, due - time.monotonic()))
                elif self.delay:
                    time.sleep(self.delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def measure(args: argparse.Namespace) -> list[dict]:
    tmp = Path(tempfile.mkdtemp(prefix="cold-start-weights-"))
    server = SeaweedS3(tmp / "seaweed").start()
    proxy = None
    try:
        rows, total, files = _stage(args, tmp, server)
        rows += _pulls(args, tmp, server.endpoint, "loopback", total, files)
        if args.per_connection_mbps > 0:
            proxy = LinkProxy(server.port, args.per_connection_mbps, args.rtt_ms)
            link = f"{args.per_connection_mbps:g} MB/s per connection, +{args.rtt_ms:g} ms per request"
            rows += _pulls(args, tmp, proxy.endpoint, link, total, files)
        return rows
    finally:
        if proxy is not None:
            proxy.close()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _store(args: argparse.Namespace, endpoint: str) -> WeightsStore:
    config = S3Config(bucket=BUCKET, prefix="bench", endpoint_url=endpoint, access_key_id=ACCESS_KEY,
                      secret_access_key=SECRET_KEY)
    return WeightsStore(config, workers=args.workers, chunk_mb=args.chunk_mb)


def _stage(args: argparse.Namespace, tmp: Path, server: SeaweedS3) -> tuple[list[dict], int, int]:
    server.client().create_bucket(Bucket=BUCKET)
    total = make_weights(tmp / "src", args.weights_mb, args.files)
    t0 = time.perf_counter()
    manifest = _store(args, server.endpoint).stage(MODEL, tmp / "src")
    stage_s = time.perf_counter() - t0
    shutil.rmtree(tmp / "src")  # the page cache then holds what the server serves, not our copy
    size = f"{total / 1e9:.2f} GB in {len(manifest['files'])} files"
    return [{"section": "weights", "what": f"stage {size} (artcloud stage-model, hashing included)",
             "artcloud": round(stage_s, 2), "peer": "", "peer_value": None, "unit": "s", "ratio": None,
             "note": "upload to SeaweedFS on loopback"}], total, len(manifest["files"])


def _pulls(args: argparse.Namespace, tmp: Path, endpoint: str, link: str, total: int, nfiles: int) -> list[dict]:
    from boto3.s3.transfer import TransferConfig

    store = _store(args, endpoint)
    manifest = store.manifest(MODEL)
    prefix = store.key_prefix(MODEL, "main") + "/files/"
    names = [f["path"] for f in manifest["files"]]
    aws = find_aws(args.aws)
    transfer = TransferConfig(multipart_threshold=args.chunk_mb * MiB, multipart_chunksize=args.chunk_mb * MiB,
                              max_concurrency=args.workers)
    boto = store.s3  # one client, one connection pool, for the boto3 sides too

    def artcloud(dest: Path) -> None:
        store.pull(MODEL, dest)

    def sequential(dest: Path) -> None:
        dest.mkdir(parents=True)
        for name in names:
            body = boto.get_object(Bucket=BUCKET, Key=prefix + name)["Body"]
            with open(dest / name, "wb") as f:
                for block in body.iter_chunks(MiB):
                    f.write(block)

    def download_file(dest: Path) -> None:
        dest.mkdir(parents=True)
        with ThreadPoolExecutor(args.workers) as pool:
            list(pool.map(lambda n: boto.download_file(BUCKET, prefix + n, str(dest / n), Config=transfer), names))

    sides = {"artcloud": artcloud, "sequential": sequential, "download_file": download_file}
    if aws:
        sides["aws"] = lambda dest: aws_sync(aws, endpoint, f"s3://{BUCKET}/{prefix}", dest, tmp)
    times: dict[str, list[float]] = {k: [] for k in sides}
    for rep in range(args.weights_repeats):
        order = list(sides) if rep % 2 == 0 else list(reversed(sides))
        for name in order:
            dest = tmp / "pulls" / f"{name}-{rep}" / "model"
            dest.parent.mkdir(parents=True)
            t0 = time.perf_counter()
            sides[name](dest)
            times[name].append(time.perf_counter() - t0)
            got = sum(p.stat().st_size for p in dest.iterdir() if not p.name.startswith("."))
            assert got == total, f"{name} pulled {got} bytes, not {total}"
            shutil.rmtree(dest.parent)
    med = {k: statistics.median(v) for k, v in times.items()}
    size = f"{total / 1e9:.2f} GB in {nfiles} files, {link}"
    ours = f"{args.workers} threads x {args.chunk_mb} MiB ranged GETs, sha256-verified"
    peers = {"aws": "aws s3 sync (no verification)", "sequential": "one boto3 get_object per file, in turn",
             "download_file": f"boto3 download_file, {args.workers} files at once"}
    rows = []
    for peer, label in peers.items():
        if peer not in med:
            rows.append({"section": "weights", "what": f"pull {size}", "artcloud": round(med["artcloud"], 2), "peer": label,
                         "peer_value": None, "unit": "s", "ratio": None, "note": "aws CLI not found: pip install awscli"})
            continue
        rows.append({"section": "weights", "what": f"pull {size}", "artcloud": round(med["artcloud"], 2), "peer": label,
                     "peer_value": round(med[peer], 2), "unit": "s", "ratio": round(med[peer] / med["artcloud"], 2),
                     "note": f"artcloud: {ours}; median of {args.weights_repeats}; ratio = peer s / artcloud s"})
        rows.append({"section": "weights", "what": f"pull {size}, throughput", "artcloud": round(total / med["artcloud"] / 1e6),
                     "peer": label, "peer_value": round(total / med[peer] / 1e6), "unit": "MB/s",
                     "ratio": round(med[peer] / med["artcloud"], 2), "note": "client, proxy and server share this machine's cores",
                     "key": "weights.mbps." + ("loopback" if link == "loopback" else "capped")})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(parser)
    rows = measure(parser.parse_args(argv))
    from rich.console import Console
    from rich.table import Table

    table = Table(title="cold start: weights")
    for col in ("what", "artcloud", "peer", "peer_value", "unit", "ratio", "note"):
        table.add_column(col)
    for r in rows:
        table.add_row(*(str(r[c]) if r[c] is not None else "-" for c in ("what", "artcloud", "peer", "peer_value", "unit", "ratio", "note")))
    Console(width=max(Console().width, 200)).print(table)


if __name__ == "__main__":
    sys.exit(main())
