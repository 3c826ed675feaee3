"""Checkpoint upload and resume: artcloud's CheckpointStore vs `aws s3 sync`, same folders, same local S3 server.

N checkpoints (default 5) are written with `checkpoints.commit`, each an adapter (default 30 MiB) and an
optimizer state (default 60 MiB) of random bytes plus trainer_state.json and manifest.json. A SeaweedFS
(`weed mini`) started here serves S3 on loopback. Every checkpoint is pushed on its own, as a trainer
would push it when written: `CheckpointStore.push` per step folder (one store, so one boto3 client, per
series) vs one `aws s3 sync STEP_DIR s3://awscli/...` process per step folder (its own bucket, path-style
addressing via AWS_CONFIG_FILE, env credentials). Measured, side by side, alternating which side goes first:

  (1) first push of all N into a fresh prefix (per repeat): total seconds and MiB/s (1 MiB = 2**20 bytes)
  (2) re-push of the same N, unchanged: seconds; artcloud must upload 0 bytes (asserted), aws's
      uploaded file count is read from its output
  (3) resume: pull of the latest step, `CheckpointStore.pull` (sha256-verified) vs `aws s3 sync` down

Targets: (1) artcloud >= 1.5x faster than aws; (2) artcloud moves 0 bytes. Medians over --repeats
(default 3). For reference (1) also times one `aws s3 sync` of the whole checkpoints folder (all N at once).
Results go to bench/out/s3_sync.json.

    .venv/bin/python bench/s3_sync.py
    .venv/bin/python bench/s3_sync.py --checkpoints 3 --adapter-mb 10 --optimizer-mb 20 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from artcloud.storage import checkpoints
from artcloud.storage.s3 import CheckpointStore, S3Config
from artcloud.storage.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedS3

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
PROJECT, MODEL = "bench", "m"
MiB = 1 << 20
console = Console(width=max(Console().width, 130))


def find_aws(flag: str | None) -> str:
    for cand in ([flag] if flag else [str(ROOT / ".venv/bin/aws"), "/tmp/awscli-venv/bin/aws"]):
        if Path(cand).is_file() or shutil.which(cand):
            return cand
    return shutil.which("aws") or "aws"


def make_checkpoints(model_dir: Path, args: argparse.Namespace) -> list[Path]:
    def writer(adapter: int, optim: int):
        def write(folder: Path) -> list[str]:
            (folder / "adapter_model.safetensors").write_bytes(os.urandom(adapter))
            (folder / "optimizer.pt").write_bytes(os.urandom(optim))
            return ["adapter_model.safetensors", "optimizer.pt"]
        return write

    return [checkpoints.commit(model_dir, step, writer(args.adapter_mb * MiB, args.optimizer_mb * MiB),
                               {"global_step": step, "rng": list(range(8))})
            for step in range(1, args.checkpoints + 1)]


class Aws:
    def __init__(self, exe: str, endpoint: str, tmp: Path):
        cfg = tmp / "aws-config"
        cfg.write_text("[default]\nregion = us-east-1\ns3 =\n  addressing_style = path\n")
        self.exe, self.endpoint = exe, endpoint
        self.env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": str(cfg),
                    "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "no-credentials"), "AWS_EC2_METADATA_DISABLED": "true"}

    def sync(self, src: str, dst: str) -> int:
        """Runs `aws s3 sync src dst`; returns how many files it transferred."""
        r = subprocess.run([self.exe, "s3", "sync", src, dst, "--endpoint-url", self.endpoint, "--no-progress"],
                           env=self.env, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"aws s3 sync {src} {dst} failed ({r.returncode}): {r.stderr[-2000:]}")
        return sum(1 for line in r.stdout.splitlines() if line.startswith(("upload:", "download:")))

    def version(self) -> str:
        return subprocess.run([self.exe, "--version"], env=self.env, capture_output=True, text=True).stdout.strip()


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run(args: argparse.Namespace, tmp: Path, s3: SeaweedS3) -> dict:
    model_dir = tmp / "local" / PROJECT / MODEL
    folders = make_checkpoints(model_dir, args)
    total = sum(f.stat().st_size for d in folders for f in d.iterdir())
    aws = Aws(find_aws(args.aws), s3.endpoint, tmp)
    console.print(f"{len(folders)} checkpoints, {total / MiB:.0f} MiB in all; {aws.version()}; SeaweedFS at {s3.endpoint}")
    for b in ("artcloud", "awscli"):
        s3.client().create_bucket(Bucket=b)

    def store(r: int) -> CheckpointStore:
        return CheckpointStore(S3Config("artcloud", f"r{r}", endpoint_url=s3.endpoint, region="us-east-1",
                                        access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY))

    def aws_dst(r: int, step: int | str = "") -> str:
        return f"s3://awscli/r{r}/{PROJECT}/{MODEL}/checkpoints/{step}".rstrip("/")

    def ac_push(st: CheckpointStore) -> dict:
        sec, res = timed(lambda: [st.push(PROJECT, MODEL, d) for d in folders])
        return {"seconds": sec, "uploaded_bytes": sum(p.uploaded_bytes for p in res),
                "uploaded_files": sum(p.uploaded_files for p in res), "skipped_files": sum(p.skipped_files for p in res)}

    def aws_push(r: int) -> dict:
        sec, n = timed(lambda: sum(aws.sync(str(d), aws_dst(r, d.name)) for d in folders))
        return {"seconds": sec, "uploaded_files": n}

    raw: dict[str, list] = {k: [] for k in ("first", "again", "pull")}
    for r in range(args.repeats):  # (1) first push, fresh prefixes; the side going first alternates
        st = store(r)
        sides = [("artcloud", lambda: ac_push(st)), ("aws", lambda: aws_push(r))]
        row = {name: fn() for name, fn in (sides if r % 2 == 0 else sides[::-1])}
        assert row["artcloud"]["uploaded_bytes"] == total - sum((d / checkpoints.MANIFEST).stat().st_size for d in folders)
        row["aws_one_sync"] = timed(lambda: aws.sync(str(model_dir / "checkpoints"), f"s3://awscli/all{r}"))[0]
        raw["first"].append(row)
        console.print(f"first push {r + 1}/{args.repeats}: artcloud {row['artcloud']['seconds']:.2f} s, "
                      f"aws {row['aws']['seconds']:.2f} s (one sync of all: {row['aws_one_sync']:.2f} s)")
    last, latest = args.repeats - 1, int(folders[-1].name)
    for r in range(args.repeats):  # (2) re-push unchanged, (3) pull latest into an empty folder
        st = store(last)
        sides = [("artcloud", lambda: ac_push(st)), ("aws", lambda: aws_push(last))]
        row = {name: fn() for name, fn in (sides if r % 2 == 0 else sides[::-1])}
        assert row["artcloud"]["uploaded_bytes"] == 0 and row["artcloud"]["uploaded_files"] == 0, row
        raw["again"].append(row)
        dest = tmp / f"pull{r}"
        pulls = [("artcloud", lambda: timed(lambda: store(last).pull(PROJECT, MODEL, latest, dest / "artcloud"))[0]),
                 ("aws", lambda: timed(lambda: aws.sync(aws_dst(last, latest), str(dest / "aws" / str(latest))))[0])]
        prow = {name: fn() for name, fn in (pulls if r % 2 == 0 else pulls[::-1])}
        checkpoints.verify(dest / "artcloud" / str(latest))
        checkpoints.verify(dest / "aws" / str(latest))
        raw["pull"].append(prow)
        shutil.rmtree(dest)

    med = lambda rows, *ks: statistics.median(_dig(x, ks) for x in rows)  # noqa: E731
    step_bytes = sum(f.stat().st_size for f in folders[-1].iterdir())
    res = {
        "total_bytes": total, "aws_version": aws.version(), "aws_exe": aws.exe,
        "first_artcloud_s": med(raw["first"], "artcloud", "seconds"), "first_aws_s": med(raw["first"], "aws", "seconds"),
        "first_aws_one_sync_s": med(raw["first"], "aws_one_sync"),
        "again_artcloud_s": med(raw["again"], "artcloud", "seconds"), "again_aws_s": med(raw["again"], "aws", "seconds"),
        "again_artcloud_uploaded_bytes": max(x["artcloud"]["uploaded_bytes"] for x in raw["again"]),
        "again_aws_uploaded_files": max(x["aws"]["uploaded_files"] for x in raw["again"]),
        "pull_artcloud_s": med(raw["pull"], "artcloud"), "pull_aws_s": med(raw["pull"], "aws"), "pull_bytes": step_bytes,
        "raw": raw,
    }
    for k in ("first", "again", "pull"):
        res[f"{k}_speedup"] = res[f"{k}_aws_s"] / res[f"{k}_artcloud_s"]
    res["first_target_met"] = res["first_speedup"] >= 1.5
    return res


def _dig(x, ks):
    for k in ks:
        x = x[k]
    return x


def show(res: dict, args: argparse.Namespace) -> None:
    t = Table(title=f"{args.checkpoints} checkpoints x ({args.adapter_mb} + {args.optimizer_mb}) MiB to local SeaweedFS, "
                    f"median of {args.repeats}")
    for col in ("", "artcloud s", "aws s3 sync s", "artcloud MiB/s", "aws MiB/s", "aws / artcloud", "note"):
        t.add_column(col, justify="left" if col in ("", "note") else "right")
    mib, pmib = res["total_bytes"] / MiB, res["pull_bytes"] / MiB
    ok = "green" if res["first_target_met"] else "red"
    t.add_row("(1) first push", f"{res['first_artcloud_s']:.2f}", f"{res['first_aws_s']:.2f}",
              f"{mib / res['first_artcloud_s']:.0f}", f"{mib / res['first_aws_s']:.0f}", f"[{ok}]{res['first_speedup']:.2f}x[/]",
              f"target >= 1.5x; aws one sync of all: {res['first_aws_one_sync_s']:.2f} s")
    t.add_row("(2) re-push unchanged", f"{res['again_artcloud_s']:.2f}", f"{res['again_aws_s']:.2f}", "-", "-",
              f"{res['again_speedup']:.2f}x", f"artcloud uploaded {res['again_artcloud_uploaded_bytes']} B, "
              f"aws {res['again_aws_uploaded_files']} files")
    t.add_row("(3) pull latest", f"{res['pull_artcloud_s']:.2f}", f"{res['pull_aws_s']:.2f}",
              f"{pmib / res['pull_artcloud_s']:.0f}", f"{pmib / res['pull_aws_s']:.0f}", f"{res['pull_speedup']:.2f}x",
              "artcloud checks every sha256")
    console.print(t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoints", type=int, default=5)
    p.add_argument("--adapter-mb", type=int, default=30)
    p.add_argument("--optimizer-mb", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3, help="each measurement; the median is reported")
    p.add_argument("--aws", default=None, help="the aws CLI (default .venv/bin/aws, /tmp/awscli-venv/bin/aws, then PATH)")
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="artcloud-s3bench-") as d:
        tmp = Path(d)
        s3 = SeaweedS3(tmp / "seaweed").start()
        try:
            res = run(args, tmp, s3)
        finally:
            s3.stop()
    show(res, args)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "s3_sync.json").write_text(json.dumps({"settings": vars(args), "time": time.time(), "results": res}, indent=2))
    console.print(f"wrote {OUT / 's3_sync.json'}")


if __name__ == "__main__":
    main()
