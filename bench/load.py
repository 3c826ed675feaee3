"""Server load: does `artcloud serve` stay correct, responsive and flat in memory under many clients?

For each model, N concurrent client loops send chat completions (a short user message, logprobs=true,
max_tokens 16, temperature 1.0) for D seconds, after an untimed warm-up of the same load (at least
--warmup seconds, and until every client has had an answer: connections open, the first batch done):

  artcloud:    a real `artcloud serve` child process over HTTPS (its own launch CA and token), a model
               registered on the base model; tiny-random with 256 clients, then SmolLM2 with 32
  HTTPS floor: the peer, under the same load in the same run: a minimal FastAPI app in its own process,
               served by uvicorn through artcloud's own TLS setup (a launch CA and certificate from
               `make_launch_secrets`, the same socket, TLS wrapper and bearer-token check), answering the
               same route with a canned copy of a real artcloud response of that model (same shape, size)

The floor is what HTTP + TLS + JSON alone cost on this machine, so artcloud / floor says how much of the
throughput and latency is the engine and how much the stack. The two never run at the same time; the
load client runs in this process and shares the machine's cores with the server (printed).

Per side: requests started in the window (each awaited to its end), errors by kind (HTTP status or
exception type; a 200 without choices, logprobs or usage counts too; goal 0), latency p50 / p99 over
those requests, requests/s and completion tokens/s (responses that came back inside the window, over D),
the CPU the server and the client used (cores), and the server's RSS (VmRSS from /proc/PID/status,
sampled every second) at the window's start and end and its peak (goal: end / start flat). For artcloud
also the engine batches run (GET /artcloud/status, else /health on an older server) and so the mean batch
size, from which the script says what bounds the throughput.

Then tiny-random's load runs again on the same server with --flood connections (1,000) held open from another
loopback address without the token (TLS done, then nothing, or half a request head; one the server closes
is opened again): the authenticated clients' rate, p50, p99, errors and the server's RSS, with and without.

Bounded: each client stops starting requests after D seconds, each request has a timeout, and the
whole run a request cap; both servers listen on 127.0.0.1 only and end with their parent.

    .venv/bin/python bench/load.py                                           # 256 x 60 s tiny, 32 x 60 s SmolLM2
    .venv/bin/python bench/load.py --clients 32 --seconds 10 --skip-smollm2  # a smoke run
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PYTHONUNBUFFERED", "1")

import argparse
import asyncio
import json
import math
import platform
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: tests.server_process

from tests.server_process import ServerProcess as Server  # noqa: E402
from tests.server_process import proc_memory  # noqa: E402

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
TINY = "artcloud/tiny-random"
ROUTE = "/v1/chat/completions"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
TOPICS = ["the sea", "a cat", "rain", "coffee", "the moon", "trains", "a library", "winter", "bees", "a bridge",
          "music", "bread", "a river", "clocks", "the desert", "maps", "a garden", "snow", "a lighthouse", "chess"]


def console():
    from rich.console import Console

    return Console(width=max(Console().width, 130))


def body(model: str, client: int, k: int, max_tokens: int) -> dict[str, Any]:
    """A short, varied user message: the same request shape a GRPO rollout sends."""
    topic = TOPICS[(client + k) % len(TOPICS)]
    return {"model": model, "messages": [{"role": "user", "content": f"Write one short sentence about {topic}."}],
            "max_tokens": max_tokens, "temperature": 1.0, "logprobs": True}


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU time of a process (all its threads), from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (fields 14 and 15)


def percentile(sorted_values: list[float], p: float) -> float | None:
    """Nearest rank: the smallest value with at least p% of the values at or below it."""
    if not sorted_values:
        return None
    return sorted_values[max(0, math.ceil(p / 100 * len(sorted_values)) - 1)]


# ----------------------------------------------------------------------------------------- the floor


def floor_worker(args: argparse.Namespace) -> None:
    """Runs in its own process: the HTTPS floor on 127.0.0.1 with a fresh launch CA and token, answering
    ROUTE with the canned response in --canned. Prints its URL; ends with its parent or after --max-s."""
    import hmac

    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from artcloud.server.main import bind
    from artcloud.server.tls_only import server_context, wrap_uvicorn_protocol
    from artcloud.tls import make_launch_secrets

    folder = Path(args.floor_dir)
    paths = make_launch_secrets().write(folder / ".tls")
    token = paths.token.read_text().strip()
    canned = json.loads(Path(args.canned).read_text())

    class BearerToken:  # what artcloud's TokenAuth does, minus the lease bookkeeping
        def __init__(self, app: Any):
            self.app, self.expected = app, f"Bearer {token}".encode()

        async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                given = next((v for k, v in scope.get("headers", []) if k == b"authorization"), b"")
                if not hmac.compare_digest(given, self.expected):
                    return await JSONResponse({"error": {"code": "invalid_token"}}, status_code=401)(scope, receive, send)
            return await self.app(scope, receive, send)

    app = FastAPI()
    app.add_middleware(BearerToken)

    @app.post(ROUTE)
    async def chat_completions(request: dict[str, Any]) -> dict[str, Any]:
        return canned  # parsed JSON in, a dict out, serialised by FastAPI: as artcloud's route does

    sock = bind("127.0.0.1", 0)
    url = f"https://localhost:{sock.getsockname()[1]}"
    config = uvicorn.Config(app, loop="asyncio", log_level="warning", timeout_keep_alive=30)
    config.load()
    wrap_uvicorn_protocol(config, server_context(str(paths.server_cert), str(paths.server_key)), hint=url)
    server = uvicorn.Server(config)

    def watch(parent: int = os.getppid(), started: float = time.monotonic()) -> None:
        while not server.should_exit:
            if os.getppid() != parent or time.monotonic() - started > args.max_s:
                server.should_exit = True
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()
    print(f"floor serving on {url}", flush=True)
    server.run(sockets=[sock])


class Floor:
    """The floor as a child process of this one, with the url / token / ssl_context of a ServerProcess."""

    def __init__(self, folder: Path, canned: dict, max_s: float):
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        (folder / "canned.json").write_text(json.dumps(canned))
        self.log = folder / "floor.log"
        self.max_s = max_s
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout: float = 60) -> "Floor":
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--floor-worker", "--floor-dir", str(self.folder),
                 "--canned", str(self.folder / "canned.json"), "--max-s", str(self.max_s)],
                stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not self.url:
            found = re.findall(r"floor serving on (https://\S+)", self.log.read_text(errors="replace"))
            if found:
                self.url = found[-1]
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the floor did not start:\n{self.log.read_text(errors='replace')[-3000:]}")
            else:
                time.sleep(0.1)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    @property
    def token(self) -> str:
        return (self.folder / ".tls" / "token").read_text().strip()

    def ssl_context(self):
        from artcloud.tls import client_ssl_context

        return client_ssl_context(self.folder / ".tls" / "ca.pem")


# ----------------------------------------------------------------------------------------- the load


async def engine_batches(http: httpx.AsyncClient, model: str) -> int | None:
    """Engine calls made so far for `model`: GET /artcloud/status (authenticated), else /health (older
    servers put `engines` there); None when neither says."""
    for path in ("/artcloud/status", "/health"):
        try:
            r = await http.get(path)
            engines = r.json().get("engines") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            continue
        if isinstance(engines, list):
            return sum(e.get("batches", 0) for e in engines if e.get("base_model") == model)
    return None


def check(r: httpx.Response) -> tuple[str | None, int]:
    """(error kind or None, completion tokens) for one response."""
    if r.status_code != 200:
        return f"HTTP {r.status_code}", 0
    try:
        data = r.json()
        choice, = data["choices"]
        if choice["logprobs"] is None:
            return "200 without logprobs", 0
        return None, int(data["usage"]["completion_tokens"])
    except (ValueError, KeyError, TypeError):
        return "malformed 200", 0


async def load(server: Server | Floor, model: str, base_model: str, clients: int, args: argparse.Namespace,
               name: str, seconds: float) -> dict:
    """`clients` closed loops asking `model` of `server` for warm-up + `seconds`; the window's figures.
    Engine batches are counted for `base_model`."""
    pid = server.proc.pid
    headers = {"Authorization": f"Bearer {server.token}"}
    ssl_context = server.ssl_context()
    # Its own connection: every load client's is busy while we read the counters.
    side = httpx.AsyncClient(base_url=server.url, verify=ssl_context, headers=headers, timeout=60)
    records: list[tuple[float, float, str | None, int]] = []  # (sent, answered, error kind, tokens)
    examples: dict[str, str] = {}
    rss: list[tuple[float, float]] = []  # (time, VmRSS MiB)
    sent = 0
    warm = 0  # clients that have had their first answer
    all_warm = asyncio.Event()
    window_end = math.inf  # set once the warm-up is over; the loops stop starting requests then

    async def client(i: int) -> None:
        # One httpx client (one connection) per loop, as separate rollout workers would have. One shared
        # pool of N connections costs the client O(N) per request in httpcore's pool bookkeeping: at 32
        # connections it already doubled the client's CPU per request and made it the bottleneck.
        async with httpx.AsyncClient(base_url=server.url, verify=ssl_context, headers=headers, timeout=args.timeout) as http:
            await send_until(http, i)

    async def send_until(http: httpx.AsyncClient, i: int) -> None:
        nonlocal sent, warm
        k = 0
        while time.monotonic() < window_end and sent < args.max_requests:
            sent += 1
            t0 = time.monotonic()
            try:
                r = await http.post(ROUTE, json=body(model, i, k, args.max_tokens))
                kind, tokens = check(r)
                if kind is not None and kind not in examples:
                    examples[kind] = r.text[:300]
            except Exception as e:  # every failure is a figure, not the end of the run
                kind, tokens = type(e).__name__, 0
                examples.setdefault(kind, repr(e)[:300])
            records.append((t0, time.monotonic(), kind, tokens))
            k += 1
            if k == 1:
                warm += 1
                if warm == clients:
                    all_warm.set()

    async def sample_rss(until: asyncio.Event) -> None:
        while not until.is_set():
            rss.append((time.monotonic(), proc_memory(pid)["VmRSS"]))
            try:
                await asyncio.wait_for(until.wait(), 1.0)
            except asyncio.TimeoutError:
                pass

    done = asyncio.Event()
    sampler = asyncio.create_task(sample_rss(done))
    try:
        start = time.monotonic()
        loops = asyncio.gather(*(client(i) for i in range(clients)))
        # Warm-up: --warmup seconds and until every client has had an answer, so that every connection is
        # open and the engine's first, slow batch is behind us (a fresh SmolLM2 took ~50 s for its first
        # one on a busy machine); bounded by --timeout.
        await asyncio.sleep(args.warmup)
        try:
            await asyncio.wait_for(all_warm.wait(), max(0.0, start + args.timeout - time.monotonic()))
        except asyncio.TimeoutError:
            pass  # counted below as warm_clients < clients
        window_start = time.monotonic()
        window_end = window_start + seconds
        batches0 = await engine_batches(side, base_model)
        batches_t0 = time.monotonic()
        rss_start = proc_memory(pid)["VmRSS"]
        cpu0 = (time.monotonic(), cpu_seconds(pid), cpu_seconds())
        await asyncio.sleep(max(0.0, window_end - time.monotonic()))
        cpu1 = (time.monotonic(), cpu_seconds(pid), cpu_seconds())
        rss_end = proc_memory(pid)["VmRSS"]
        await loops  # the in-flight requests end (each within --timeout)
        drained = time.monotonic()
        batches1 = await engine_batches(side, base_model)
        memory_after = proc_memory(pid)
    finally:
        done.set()
        await sampler
        await side.aclose()

    window = [r for r in records if window_start <= r[0] < window_end]
    ok = [r for r in window if r[2] is None]
    answered = [r for r in records if r[2] is None and window_start <= r[1] < window_end]
    errors: dict[str, int] = {}
    for r in window:
        if r[2] is not None:
            errors[r[2]] = errors.get(r[2], 0) + 1
    warmup_errors = sum(1 for r in records if r[0] < window_start and r[2] is not None)
    latencies = sorted(r[1] - r[0] for r in window)
    peak = max([rss_start, rss_end, *(m for t, m in rss if window_start <= t <= window_end)])
    result = {
        "side": name, "clients": clients, "seconds": seconds, "requests": len(window), "ok": len(ok),
        "errors": errors, "error_examples": examples, "warmup_requests": sum(1 for r in records if r[0] < window_start),
        "warmup_errors": warmup_errors, "warmup_s": window_start - start, "warm_clients": warm,
        "capped": sent >= args.max_requests,
        "requests_per_s": len(answered) / seconds, "completion_tokens_per_s": sum(r[3] for r in answered) / seconds,
        "completion_tokens_mean": sum(r[3] for r in ok) / len(ok) if ok else None,
        "latency_s": {"p50": percentile(latencies, 50), "p99": percentile(latencies, 99),
                      "mean": sum(latencies) / len(latencies) if latencies else None,
                      "max": latencies[-1] if latencies else None},
        "drain_s": drained - window_end,
        "server_cores": (cpu1[1] - cpu0[1]) / (cpu1[0] - cpu0[0]), "client_cores": (cpu1[2] - cpu0[2]) / (cpu1[0] - cpu0[0]),
        "rss_mib": {"start": rss_start, "end": rss_end, "peak": peak, "end_over_start": rss_end / rss_start,
                    "after_drain": memory_after["VmRSS"], "lifetime_peak": memory_after["VmHWM"]},
        "rss_samples_mib": [(round(t - window_start, 1), round(m, 1)) for t, m in rss],
    }
    if batches0 is not None and batches1 is not None:
        # The counter counts finished engine calls, so it pairs with the responses that came back after it was read.
        served = sum(1 for r in records if r[2] is None and r[1] >= batches_t0)
        n = batches1 - batches0
        result["engine"] = {"batches": n, "requests": served, "mean_batch": served / n if n else None,
                            "seconds_per_batch": (drained - batches_t0) / n if n else None}
    return result


# ----------------------------------------------------------------------------------------- one model


class Flood:
    """`n` TLS connections from another loopback address (127.0.0.2) that finish the handshake and then send
    nothing (every third sends half a request head): what a peer without the token can throw at the server.
    One the server closes is opened again, so the flood holds at what the server lets it have."""

    def __init__(self, url: str, n: int):
        import socket
        import ssl

        self.host, self.port = url.removeprefix("https://").rsplit(":", 1)
        self.n, self.socket_mod, self.ssl_mod = n, socket, ssl
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        self.ctx.check_hostname, self.ctx.verify_mode = False, ssl.CERT_NONE
        self.held: list[Any] = []
        self.opened = self.refused = self.closed = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _open(self) -> None:
        try:
            raw = self.socket_mod.create_connection((self.host, int(self.port)), timeout=2, source_address=("127.0.0.2", 0))
            conn = self.ctx.wrap_socket(raw, server_hostname="x")
            if self.opened % 3 == 0:
                conn.sendall(b"GET /artcloud/status HTTP/1.1\r\nHost: x\r\n")
            conn.setblocking(False)
            self.held.append(conn)
            self.opened += 1
        except OSError:
            self.refused += 1

    def _run(self) -> None:
        while not self.stop.is_set():
            for _ in range(min(50, self.n - len(self.held))):  # a burst at a time: the server's loop breathes
                self._open()
            alive = []
            for conn in self.held:
                try:
                    gone = conn.recv(1) == b""
                except (self.ssl_mod.SSLWantReadError, BlockingIOError):
                    gone = False  # nothing to read: still open
                except OSError:  # reset
                    gone = True
                if gone:
                    conn.close()
                    self.closed += 1
                else:
                    alive.append(conn)
            self.held = alive
            self.stop.wait(0.2)
        for conn in self.held:
            conn.close()

    def __enter__(self) -> "Flood":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join(30)


def batcher_cap() -> int | None:
    """The server batcher's default row cap (requests x n per engine call), for the verdict."""
    import inspect

    try:
        from artcloud.server.batching import Batcher

        return inspect.signature(Batcher.__init__).parameters["max_rows"].default
    except (ImportError, KeyError):
        return None


def bench_model(model: str, clients: int, args: argparse.Namespace, out) -> dict:
    budget_s = args.warmup + args.seconds + args.timeout + 900  # a run that hangs still ends
    result: dict[str, Any] = {"model": model, "clients": clients}
    with tempfile.TemporaryDirectory(prefix="artcloud-load-") as tmp:
        out.print(f"[bold]{model}[/]: artcloud serve, {clients} clients x {args.seconds:g} s (after a warm-up)")
        server = Server(Path(tmp) / "data", "--max-duration", f"{budget_s:.0f}s",
                        log_level="warning").start()
        try:
            with server.client() as c:
                t0 = time.perf_counter()
                r = c.post("/artcloud/models", json={"name": "bench", "project": "bench", "base_model": model})
                r.raise_for_status()
                result["register_s"] = time.perf_counter() - t0
                r = c.post(ROUTE, json=body("bench", 0, 0, args.max_tokens))
                r.raise_for_status()
                canned = r.json()  # the floor answers with this very response
            result["artcloud"] = asyncio.run(load(server, "bench", model, clients, args, "artcloud", args.seconds))
            if args.flood and model == TINY:
                out.print(f"[bold]{model}[/]: the same load again, with {args.flood} TLS connections without the token "
                          "held open from 127.0.0.2 meanwhile")
                with Flood(server.url, args.flood) as flood:
                    result["flooded"] = asyncio.run(load(server, "bench", model, clients, args, "flooded", args.seconds))
                result["flood"] = {"connections": args.flood, "opened": flood.opened, "refused": flood.refused,
                                   "closed_by_server": flood.closed, "log_bytes": server.log.stat().st_size}
        finally:
            server.stop()
        result["response_bytes"] = len(json.dumps(canned))
        if not args.skip_floor:
            out.print(f"[bold]{model}[/]: HTTPS floor (canned {result['response_bytes']} B response), same load")
            floor = Floor(Path(tmp) / "floor", canned, max_s=budget_s).start()
            try:
                result["floor"] = asyncio.run(load(floor, "bench", model, clients, args, "floor", args.seconds))
            finally:
                floor.stop()
    result["bound"] = verdict(result)
    return result


def verdict(res: dict) -> str:
    """One paragraph: what bounds artcloud's throughput here, from the measured figures."""
    a, f = res["artcloud"], res.get("floor")
    cores = len(os.sched_getaffinity(0))
    used = a["server_cores"] + a["client_cores"]
    parts = []
    if not a["ok"]:
        return (f"no request started in the {a['seconds']:g} s window came back: one engine batch takes longer than "
                f"the window here; give a longer --seconds.")
    if f is not None and a["requests_per_s"] > 0:
        times = f["requests_per_s"] / a["requests_per_s"]
        share = f["latency_s"]["p50"] / a["latency_s"]["p50"] if a["latency_s"]["p50"] else float("nan")
        if times >= 2:
            parts.append(f"the engine bounds it: the HTTPS floor answers {times:.1f}x as many requests/s under the same "
                         f"load, and its p50 is {100 * share:.1f}% of artcloud's, so HTTP + TLS + JSON are a small part")
        else:
            parts.append(f"the HTTP/TLS stack bounds it: the floor answers only {times:.1f}x as many requests/s")
        if f["server_cores"] + f["client_cores"] >= 0.85 * cores:
            parts.append("the floor itself is CPU-bound (its server and this load client fill the cores), so the "
                         "stack's own ceiling is at least what it shows")
    engine = a.get("engine")
    if engine and engine["batches"]:
        cap = batcher_cap()
        full = f" (the batcher's cap is {cap} rows" + (", so batches are full" if cap and engine["mean_batch"] >= 0.9 * cap else "") + ")"
        parts.append(f"{engine['batches']} engine batches of {engine['mean_batch']:.1f} requests on average{full if cap else ''}, "
                     f"one every {engine['seconds_per_batch']:.2f} s")
    parts.append(f"the server used {a['server_cores']:.2f} cores and the load client {a['client_cores']:.2f} of the {cores} "
                 f"they share" + (" (the CPU is saturated)" if used >= 0.85 * cores else
                                  f" (the rest went to waiting, or to other processes: load average {os.getloadavg()[0]:.1f})"))
    clients = res["clients"]
    if a["requests_per_s"] > 0:  # closed loops: each client always has one request outstanding
        parts.append(f"with {clients} clients always waiting, latency follows: {clients} / {a['requests_per_s']:.1f} "
                     f"requests/s = {clients / a['requests_per_s']:.1f} s per request (Little's law)")
    return "; ".join(parts) + "."


# ----------------------------------------------------------------------------------------- report


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def show(res: dict, args: argparse.Namespace, out) -> None:
    from rich.table import Table

    a, f = res["artcloud"], res.get("floor")
    t = Table(title=f"{res['model']}: {res['clients']} concurrent clients x {a['seconds']:g} s, chat completions "
                    f"(max_tokens {args.max_tokens}, logprobs)")
    for col in ["", "artcloud", "HTTPS floor", "artcloud / floor"]:
        t.add_column(col, justify="left" if not col else "right")

    def row(label: str, key, spec: str, ratio: bool = True) -> None:
        va, vf = key(a), key(f) if f else None
        r = va / vf if ratio and va is not None and vf else None
        t.add_row(label, fmt(va, spec), fmt(vf, spec), fmt(r, ".2f"))

    row("warm-up before the window (s)", lambda s: s["warmup_s"], ".1f", ratio=False)
    row("requests (started in the window)", lambda s: s["requests"], "d", ratio=False)
    t.add_row("errors (goal 0)", *(", ".join(f"{k}: {n}" for k, n in s["errors"].items()) or "0" if s else "-" for s in (a, f)), "")
    row("requests / s", lambda s: s["requests_per_s"], ".1f")
    row("completion tokens / s", lambda s: s["completion_tokens_per_s"], ".0f")
    row("latency p50 (s)", lambda s: s["latency_s"]["p50"], ".3f")
    row("latency p99 (s)", lambda s: s["latency_s"]["p99"], ".3f")
    row("latency max (s)", lambda s: s["latency_s"]["max"], ".3f")
    row("server CPU (cores)", lambda s: s["server_cores"], ".2f")
    row("load client CPU (cores)", lambda s: s["client_cores"], ".2f")
    row("server RSS at start (MiB)", lambda s: s["rss_mib"]["start"], ".0f")
    row("server RSS at end (MiB)", lambda s: s["rss_mib"]["end"], ".0f")
    row("server RSS peak (MiB)", lambda s: s["rss_mib"]["peak"], ".0f")
    t.add_row("server RSS end / start (goal ~1.00)", *(fmt(s["rss_mib"]["end_over_start"], ".3f") if s else "-" for s in (a, f)), "")
    out.print(t)
    if a.get("engine"):
        e = a["engine"]
        out.print(f"  artcloud engine: {e['batches']} batches for {e['requests']} requests since the window began, "
                  f"mean batch {fmt(e['mean_batch'], '.1f')}")
    else:
        out.print("  artcloud engine: the server reports no batch counter (neither /artcloud/status nor /health has `engines`)")
    for s in (a, f):
        if s and (s["warmup_errors"] or s["capped"] or s["errors"] or s["warm_clients"] < s["clients"]):
            out.print(f"  [yellow]{s['side']}: {s['warmup_errors']} warm-up errors; "
                      f"{s['warm_clients']} of {s['clients']} clients answered before the window"
                      + ("; hit --max-requests" if s["capped"] else "")
                      + "".join(f"; {k} e.g. {v!r}" for k, v in s["error_examples"].items()) + "[/]")
    out.print(f"  what bounds it: {res['bound']}")
    if res.get("flooded"):
        g, fl = res["flooded"], res["flood"]
        t = Table(title=f"{res['model']}: the same clients with {fl['connections']} connections without the token "
                        "held open meanwhile (security review 1)")
        for col in ["", "no flood", "flood", "flood / no flood"]:
            t.add_column(col, justify="left" if not col else "right")
        for label, key, spec in (("requests / s", lambda s: s["requests_per_s"], ".1f"),
                                 ("latency p50 (s)", lambda s: s["latency_s"]["p50"], ".3f"),
                                 ("latency p99 (s)", lambda s: s["latency_s"]["p99"], ".3f"),
                                 ("server RSS peak (MiB)", lambda s: s["rss_mib"]["peak"], ".0f")):
            va, vg = key(a), key(g)
            t.add_row(label, fmt(va, spec), fmt(vg, spec), fmt(vg / va if va and vg is not None else None, ".2f"))
        t.add_row("errors (goal 0)", *(", ".join(f"{k}: {n}" for k, n in s["errors"].items()) or "0" for s in (a, g)), "")
        out.print(t)
        out.print(f"  the flood opened {fl['opened']} TLS connections, {fl['refused']} more were refused, the server "
                  f"closed {fl['closed_by_server']} (no request head within its deadline); server log: {fl['log_bytes']} bytes")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=256, help="concurrent clients on artcloud/tiny-random")
    p.add_argument("--smollm2-clients", type=int, default=32, help="concurrent clients on SmolLM2-135M-Instruct")
    p.add_argument("--seconds", type=float, default=60, help="measured window per side and model")
    p.add_argument("--warmup", type=float, default=5,
                   help="untimed seconds of the same load first; the warm-up also lasts until every client has had an answer")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=120, help="per request; a request that takes longer is an error")
    p.add_argument("--max-requests", type=int, default=200_000, help="hard cap on requests per side and model")
    p.add_argument("--skip-tiny", action="store_true")
    p.add_argument("--skip-smollm2", action="store_true")
    p.add_argument("--skip-floor", action="store_true", help="artcloud only, no peer")
    p.add_argument("--flood", type=int, default=1000,
                   help="tiny-random again, with this many TLS connections without the token held open (0: no flood phase)")
    p.add_argument("--json", type=Path, help="also write every figure here")
    p.add_argument("--floor-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--floor-dir", help=argparse.SUPPRESS)
    p.add_argument("--canned", help=argparse.SUPPRESS)
    p.add_argument("--max-s", type=float, default=3600, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.floor_worker:
        return floor_worker(args)

    out = console()
    cores = len(os.sched_getaffinity(0))
    machine = {"cores": cores, "cpu_count": os.cpu_count(), "platform": platform.platform(),
               "python": sys.version.split()[0], "load_average_at_start": os.getloadavg()}
    out.print(f"machine: {cores} cores ({platform.machine()}, {platform.platform()}, Python {machine['python']}); "
              f"load average {' '.join(f'{x:.2f}' for x in machine['load_average_at_start'])}. "
              f"The load client runs in this process and shares these cores with the server.")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4 * args.clients + 64:  # a socket per client here, and one in the server
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4 * args.clients + 1024), hard))

    runs = ([] if args.skip_tiny else [(TINY, args.clients)]) + ([] if args.skip_smollm2 else [(SMOLLM2, args.smollm2_clients)])
    results = []
    for model, clients in runs:
        res = bench_model(model, clients, args, out)
        show(res, args, out)
        results.append(res)
    machine["load_average_at_end"] = os.getloadavg()
    out.print(f"load average at the end: {' '.join(f'{x:.2f}' for x in machine['load_average_at_end'])}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("floor_worker", "floor_dir", "canned", "max_s")}
        args.json.write_text(json.dumps({"settings": settings, "time": time.time(), "machine": machine, "results": results}, indent=2))
        out.print(f"wrote {args.json}")
    # Exit 1 when artcloud answered any request with an error (goal 0), so `make bench-load` fails loudly.
    sys.exit(1 if any(r["artcloud"]["errors"] or (r.get("flooded") or {}).get("errors") for r in results) else 0)


if __name__ == "__main__":
    main()
