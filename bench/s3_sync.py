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
(default 3). Each aws side includes its processes' start (about 1 s of CPU each), which is what a
trainer shelling out per checkpoint pays; for reference (1) also times one `aws s3 sync` of the whole
checkpoints folder (all N at once). CPU seconds are reported as client (this process, or the aws
processes) + server (SeaweedFS); client and server share the machine's cores. Results go to
bench/out/s3_sync.json.

    .venv/bin/python bench/s3_sync.py
    .venv/bin/python bench/s3_sync.py --checkpoints 3 --adapter-mb 10 --optimizer-mb 20 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: tests.seaweed

from artcloud.storage import checkpoints  # noqa: E402
from artcloud.storage.s3 import CheckpointStore, S3Config  # noqa: E402
from tests.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedS3  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
PROJECT, MODEL = "bench", "m"
MiB = 1 << 20
console = Console(width=max(Console().width, 160))


def find_aws(flag: str | None) -> str:
    for cand in ([flag] if flag else [str(ROOT / ".venv/bin/aws"), "/tmp/awscli-venv/bin/aws"]):
        if Path(cand).is_file() or shutil.which(cand):
            return cand
    return shutil.which("aws") or "aws"


def make_checkpoints(model_dir: Path, args: argparse.Namespace) -> list[Path]:
    files = {"adapter_model.safetensors": args.adapter_mb * MiB, "optimizer.pt": args.optimizer_mb * MiB}

    def write(folder: Path) -> list[str]:
        for name, size in files.items():
            (folder / name).write_bytes(os.urandom(size))  # random: nothing compresses or dedups
        return list(files)

    return [checkpoints.commit(model_dir, step, write, {"global_step": step, "rng": [step] * 8})
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


def proc_cpu(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def measure(fn, server_pid: int) -> dict:
    """Wall seconds, client CPU (this process + the aws children) and SeaweedFS CPU of fn(), plus what fn returns."""
    ch = lambda: (lambda r: r.ru_utime + r.ru_stime)(resource.getrusage(resource.RUSAGE_CHILDREN))  # noqa: E731
    c0, w0, t0 = time.process_time() + ch(), proc_cpu(server_pid), time.perf_counter()
    out = fn()
    out = out if isinstance(out, dict) else {}
    return {"seconds": time.perf_counter() - t0, "client_cpu_s": time.process_time() + ch() - c0,
            "server_cpu_s": proc_cpu(server_pid) - w0, **out}


def both(sides: dict, flip: bool, pid: int) -> dict:
    return {name: measure(sides[name], pid) for name in (["aws", "artcloud"] if flip else ["artcloud", "aws"])}


def run(args: argparse.Namespace, tmp: Path, s3: SeaweedS3) -> dict:
    model_dir, pid = tmp / "local" / PROJECT / MODEL, s3.proc.pid
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
        res = [st.push(PROJECT, MODEL, d) for d in folders]
        return {"uploaded_bytes": sum(p.uploaded_bytes for p in res), "uploaded_files": sum(p.uploaded_files for p in res),
                "skipped_files": sum(p.skipped_files for p in res)}

    def aws_push(r: int) -> dict:
        return {"uploaded_files": sum(aws.sync(str(d), aws_dst(r, d.name)) for d in folders)}

    raw: dict[str, list] = {k: [] for k in ("first", "again", "pull")}
    payload = total - sum((d / checkpoints.MANIFEST).stat().st_size for d in folders)  # push counts the manifest apart
    for r in range(args.repeats):  # (1) first push into fresh prefixes; the side going first alternates
        st = store(r)
        row = both({"artcloud": lambda: ac_push(st), "aws": lambda: aws_push(r)}, r % 2 == 1, pid)
        assert row["artcloud"]["uploaded_bytes"] == payload, row
        row["aws_one_sync"] = measure(lambda: aws.sync(str(model_dir / "checkpoints"), f"s3://awscli/all{r}"), pid)
        raw["first"].append(row)
        console.print(f"first push {r + 1}/{args.repeats}: artcloud {row['artcloud']['seconds']:.2f} s, "
                      f"aws {row['aws']['seconds']:.2f} s (one sync of all: {row['aws_one_sync']['seconds']:.2f} s)")
    last, latest = args.repeats - 1, int(folders[-1].name)
    for r in range(args.repeats):  # (2) re-push unchanged, (3) pull the latest step into an empty folder
        st = store(last)
        row = both({"artcloud": lambda: ac_push(st), "aws": lambda: aws_push(last)}, r % 2 == 1, pid)
        assert row["artcloud"]["uploaded_bytes"] == 0 and row["artcloud"]["uploaded_files"] == 0, row
        raw["again"].append(row)
        dest = tmp / f"pull{r}"
        raw["pull"].append(both({"artcloud": lambda: store(last).pull(PROJECT, MODEL, latest, dest / "artcloud"),
                                 "aws": lambda: aws.sync(aws_dst(last, latest), str(dest / "aws" / str(latest)))},
                                r % 2 == 1, pid))
        checkpoints.verify(dest / "artcloud" / str(latest))
        checkpoints.verify(dest / "aws" / str(latest))
        shutil.rmtree(dest)

    res: dict = {"total_bytes": total, "pull_bytes": sum(f.stat().st_size for f in folders[-1].iterdir()),
                 "aws_version": aws.version(), "aws_exe": aws.exe}
    for k, rows in raw.items():
        for side in ("artcloud", "aws") + (("aws_one_sync",) if k == "first" else ()):
            for m in ("seconds", "client_cpu_s", "server_cpu_s"):
                res[f"{k}_{side}_{m}"] = statistics.median(x[side][m] for x in rows)
        res[f"{k}_speedup"] = res[f"{k}_aws_seconds"] / res[f"{k}_artcloud_seconds"]
    res["again_artcloud_uploaded_bytes"] = max(x["artcloud"]["uploaded_bytes"] for x in raw["again"])
    res["again_aws_uploaded_files"] = max(x["aws"]["uploaded_files"] for x in raw["again"])
    res["first_target_met"] = res["first_speedup"] >= 1.5
    res["raw"] = raw
    return res


def show(res: dict, args: argparse.Namespace) -> None:
    t = Table(title=f"{args.checkpoints} checkpoints x ({args.adapter_mb} + {args.optimizer_mb}) MiB, local SeaweedFS, "
                    f"median of {args.repeats}; CPU s = client + server")
    for col in ("", "artcloud s", "aws s", "artcloud MiB/s", "aws MiB/s", "aws / artcloud", "artcloud CPU s", "aws CPU s", "note"):
        t.add_column(col, justify="left" if col in ("", "note") else "right")
    rows = {"first": ("(1) first push", res["total_bytes"], "target >= 1.5x; one aws sync of all N: "
                      f"{res['first_aws_one_sync_seconds']:.2f} s"),
            "again": ("(2) re-push unchanged", 0, f"artcloud uploaded {res['again_artcloud_uploaded_bytes']} B, "
                      f"aws {res['again_aws_uploaded_files']} files"),
            "pull": ("(3) pull latest", res["pull_bytes"], "artcloud verifies every sha256")}
    for k, (label, size, note) in rows.items():
        sec = {s: res[f"{k}_{s}_seconds"] for s in ("artcloud", "aws")}
        cpu = {s: f"{res[f'{k}_{s}_client_cpu_s']:.1f} + {res[f'{k}_{s}_server_cpu_s']:.1f}" for s in ("artcloud", "aws")}
        rate = {s: f"{size / MiB / sec[s]:.0f}" if size else "-" for s in sec}
        ok = "" if k != "first" else "green" if res["first_target_met"] else "red"
        speed = f"[{ok}]{res[f'{k}_speedup']:.2f}x[/]" if ok else f"{res[f'{k}_speedup']:.2f}x"
        t.add_row(label, f"{sec['artcloud']:.2f}", f"{sec['aws']:.2f}", rate["artcloud"], rate["aws"], speed,
                  cpu["artcloud"], cpu["aws"], note)
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
