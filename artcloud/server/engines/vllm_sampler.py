"""The vLLM sampler: vLLM's OpenAI server as a child process on loopback, driven token-in, token-out.

Why a process and not `AsyncLLM` in ours: vLLM pins its own torch and transformers, so it may live in
another Python environment (`artcloud serve --vllm-python`, ARTCLOUD_VLLM_PYTHON); a crash in it
(CUDA OOM, a driver fault) does not take the server and its committed steps down; and it is what ART
runs, so its sleep, LoRA and logprob behaviour is vLLM's own.

- It listens on a Unix socket in a folder of mode 0700, not on a port: no other user of the machine can
  reach any of its routes (its key guards only /v1, and on a shared GPU its dev-mode routes /sleep,
  /collective_rpc ... are on); it still has a random key of its own (in its environment, never argv).
- The server keeps TLS, the token, NAME@STEP, chat rendering and tool parsing. It sends vLLM the prompt
  as token ids (POST /v1/completions), so sampling and training see the same tokens, and gets back the
  sampled token ids and their logprobs. `--logprobs-mode processed_logprobs`: the logprob of each token
  under the distribution it was drawn from, log_softmax(logits / T) (T = 1 for greedy), as the CPU
  engine returns; with top_p < 1 vLLM's are renormalised over the nucleus, the CPU engine's are not.
- Adapters: each `serve_adapter` copies the adapter's two files into the sampler's own folder (a
  checkpoint may be pruned later) and loads them under a fresh vLLM name (SLOT.VERSION), then unloads
  the previous version. vLLM keeps `max_loras` on the GPU and up to `max_cpu_loras` in host memory,
  least recently used out first; an evicted one is reloaded from its folder on demand.
- If the process dies, the sampler says so (state "restarting"; /health says degraded), answers 503
  meanwhile, starts a new one and serves every adapter again from its folder: nothing committed is lost.
- On one shared GPU it sleeps (level 1: weights to host memory, KV cache dropped) while the trainer
  runs; sleep mode needs CUDA.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from artcloud.errors import ArtcloudError, InvalidArgument
from artcloud.server.engines.base import (
    Completion,
    EngineError,
    GenerationRequest,
    RequestRefused,
    Sampler,
    SamplerUnavailable,
    TokenSink,
)
from artcloud.server.engines.children import child_env, die_with_parent, kill_group
from artcloud.types import LoraConfig

log = logging.getLogger("artcloud.engine")

BASE_NAME = "base"  # what vLLM calls the bare base model
SOCKET = "vllm.sock"
GONE_EVERY_S = 0.2  # how often a non-streamed request waiting for vLLM checks that its client is still there
ANSWER_TIMEOUT_S = 600.0
START_TIMEOUT_S = float(os.environ.get("ARTCLOUD_VLLM_START_TIMEOUT", "900"))  # a 14B model cold: minutes
MAX_RESTARTS = 5  # in a row without a healthy minute between them; then the sampler stays down
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # what --max-lora-rank accepts


def vllm_python() -> str:
    """The interpreter that runs vLLM: ARTCLOUD_VLLM_PYTHON, else the server's own."""
    return os.environ.get("ARTCLOUD_VLLM_PYTHON") or sys.executable


@dataclass
class VLLMArgs:
    """How vLLM is started: the arguments of `vllm serve`, plus where and with what."""

    model: str  # a local folder or a hub id
    python: str
    args: dict[str, Any]  # --flag value, e.g. {"max_model_len": 2048, "enforce_eager": True}
    env: dict[str, str]
    workdir: Path  # its log and its copies of the adapters

    def argv(self, uds: Path) -> list[str]:
        argv = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--served-model-name", BASE_NAME, "--uds", str(uds),
                "--enable-lora", "--return-tokens-as-token-ids", "--logprobs-mode", "processed_logprobs",
                "--disable-uvicorn-access-log"]
        for key, value in sorted(self.args.items()):
            flag = "--" + key.replace("_", "-")
            if value is True:
                argv.append(flag)
            elif value is False or value is None:
                continue
            else:
                argv += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
        return argv


def _socket_folder() -> Path:
    """A fresh folder of mode 0700 (mkdtemp) for vLLM's socket, in the temp folder: a socket's path may not
    be longer than 107 bytes, which a deep working folder would pass."""
    folder = Path(tempfile.mkdtemp(prefix="artcloud-vllm-"))
    if len(str(folder / SOCKET)) > 107:
        shutil.rmtree(folder, ignore_errors=True)
        raise EngineError(f"the temp folder's path {folder.parent} is too long for vLLM's Unix socket: set TMPDIR "
                          "to a shorter one (e.g. /tmp)")
    return folder


def _group_is_vllm(pgid: int) -> bool:
    """Whether process group `pgid` still holds a vLLM process (a pid file may outlive its group)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and b"vllm" in (stat.parent / "cmdline").read_bytes().lower():
                return True
        except (OSError, IndexError, ValueError):
            continue
    return False


class _SocketConnection(http.client.HTTPConnection):
    """HTTP/1.1 to vLLM's Unix socket, on a connection of its own that the caller may close at any time."""

    def __init__(self, path: Path, timeout: float):
        super().__init__("vllm", timeout=timeout)
        self._path = str(path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


class VLLMSampler(Sampler):
    concurrent = True  # vLLM batches continuously: a request sent while others run joins them

    def __init__(self, args: VLLMArgs, *, colocated: bool, max_context: int):
        self.cfg = args
        self.can_sleep = colocated and bool(args.args.get("enable_sleep_mode"))
        self.max_context = max_context
        self.key = secrets.token_urlsafe(24)
        self.max_lora_rank = int(args.args.get("max_lora_rank", 16))
        self.adapters: dict[str, tuple[str, Path]] = {}  # slot -> (vLLM name, our copy of its files)
        self.versions = 0
        self.state = "starting"  # starting | ready | restarting | down | closed
        self.detail: str | None = None
        self.restarts = 0
        self.asleep = False
        self.proc: subprocess.Popen | None = None
        self.in_flight = 0  # generation requests sent to vLLM and not yet answered (or given up)
        self._counting = threading.Lock()
        self._lock = threading.RLock()  # the process and the adapter table change together
        self._pool = ThreadPoolExecutor(64, thread_name_prefix="artcloud-vllm")
        import httpx

        self.socket = _socket_folder() / SOCKET
        transport = httpx.HTTPTransport(uds=str(self.socket), limits=httpx.Limits(max_connections=64))
        self._http = httpx.Client(transport=transport, timeout=httpx.Timeout(600.0, connect=10.0))
        self.url = "http://vllm"  # a name for the logs: every request goes to the socket
        (args.workdir / "adapters").mkdir(parents=True, exist_ok=True)
        try:
            self._start()
        except BaseException:
            self._http.close()
            shutil.rmtree(self.socket.parent, ignore_errors=True)
            raise
        self._watcher = threading.Thread(target=self._watch, name="artcloud-vllm-watch", daemon=True)
        self._watcher.start()

    # ------------------------------------------------------------------------------------- process

    @property
    def log_path(self) -> Path:
        return self.cfg.workdir / "vllm.log"

    def _start(self, *, ready: bool = True) -> None:
        """Start vLLM and wait until it answers; `ready=False` (a restart) leaves the state to the caller,
        which serves the adapters again first."""
        # A server killed hard (SIGKILL, OOM) cannot stop its vLLM; the next one on this folder does.
        if self.pgid_file.exists():
            try:
                stale = int(self.pgid_file.read_text())
                if _group_is_vllm(stale):
                    log.warning("stopping vLLM process group %d left by an earlier server", stale)
                    kill_group(stale, signal.SIGKILL)
            except ValueError:
                pass
        if self.state == "closed":
            raise EngineError("the vLLM sampler is closed")
        self.socket.unlink(missing_ok=True)  # a dead vLLM's: binding would fail on it
        env = {**child_env(os.environ), **self.cfg.env, "VLLM_API_KEY": self.key, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
               "VLLM_SERVER_DEV_MODE": "1" if self.can_sleep else "0", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1"}
        argv = self.cfg.argv(self.socket)
        log.info("starting vLLM (%s): %s", self.cfg.python, " ".join(argv[1:]))
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, preexec_fn=die_with_parent)
        self.pgid_file.write_text(str(self.proc.pid))  # setsid: its pid is its group's id
        if self.state == "closed":  # closed while this one was being started (a restart racing a shutdown)
            self._kill()
            raise EngineError("the vLLM sampler is closed")
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            code = self.proc.poll()
            if code is not None:
                raise EngineError(f"vLLM exited with code {code} while starting; the end of {self.log_path}:\n"
                                   + self.log_tail())
            try:
                if self._http.get(self.url + "/health", timeout=2.0).status_code == 200:
                    break
            except Exception:
                pass
            if time.monotonic() > deadline:
                self._kill()
                raise EngineError(f"vLLM did not answer within {START_TIMEOUT_S:.0f} s (ARTCLOUD_VLLM_START_TIMEOUT); "
                                   f"the end of {self.log_path}:\n" + self.log_tail())
            time.sleep(0.5)
        self.asleep = False
        if ready:
            self.state, self.detail = "ready", None
        log.info("vLLM answers on %s (pid %d)", self.socket, self.proc.pid)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _watch(self) -> None:
        """Restart vLLM when it dies, and serve every adapter again."""
        failures = 0
        while True:
            proc = self.proc
            code = proc.wait() if proc is not None else None
            if self.state == "closed":
                return
            with self._lock:
                if self.proc is not proc:  # replaced meanwhile
                    continue
                kill_group(proc.pid, signal.SIGKILL)  # its engine core may outlive it, holding the GPU
                failures = failures + 1 if time.monotonic() - getattr(self, "_ready_at", 0) < 60 else 1
                self.state = "restarting"
                self.detail = f"the vLLM sampler process exited (code {code}) and is restarting"
                log.error("%s; the end of its log:\n%s", self.detail, self.log_tail())
                if failures > MAX_RESTARTS:
                    self.state = "down"
                    self.detail = f"the vLLM sampler process died {failures} times in a row and stays down (see the server's log)"
                    log.error("vLLM died %d times in a row; giving up. Its log: %s", failures, self.log_path)
                    return
                try:
                    self._start(ready=False)
                    for slot, (_, folder) in list(self.adapters.items()):
                        self._load(slot, folder, force=True)
                    self.restarts += 1
                    self._ready_at = time.monotonic()
                    self.state, self.detail = "ready", None  # only now: every adapter is served again
                    log.info("vLLM restarted; %d adapter(s) served again", len(self.adapters))
                except Exception as e:
                    log.error("restarting vLLM failed: %s", e)
                    # /health is public: the cause (paths, model names) goes to the log only
                    self.detail = "the vLLM sampler process died and restarting it failed (see the server's log)"
                    time.sleep(min(30, 2 ** failures))

    def _kill(self) -> None:
        """Stop vLLM's whole process group (its API server, engine core and workers). The group is signalled
        even when its leader is gone: an engine core left behind would hold the GPU."""
        proc = self.proc
        if proc is None:
            return
        kill_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)  # within the server's own shutdown grace (main.GRACEFUL_SHUTDOWN_S)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(0.5)
        kill_group(proc.pid, signal.SIGKILL)
        proc.wait()
        self.pgid_file.unlink(missing_ok=True)

    @property
    def pgid_file(self) -> Path:
        return self.cfg.workdir / "vllm.pgid"

    def close(self) -> None:
        self.state = "closed"
        if self.proc is not None:
            log.info("stopping vLLM (process group %d)", self.proc.pid)
        self._kill()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()
        shutil.rmtree(self.socket.parent, ignore_errors=True)

    # ------------------------------------------------------------------------------------- HTTP

    def _post(self, path: str, payload: dict[str, Any] | None = None, *, params: dict[str, Any] | None = None,
              force: bool = False) -> Any:
        import httpx

        self._check_ready(force)
        try:
            r = self._http.post(self.url + path, json=payload, params=params,
                                headers={"Authorization": f"Bearer {self.key}"})
        except httpx.TransportError as e:
            raise self._lost(e) from e
        if r.status_code >= 400:
            raise EngineError(f"vLLM {path} answered {r.status_code}: {r.text[:500]}")
        return r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text

    def _completions_unless_gone(self, payload: dict[str, Any], req: GenerationRequest) -> dict[str, Any] | None:
        """POST /v1/completions, not streamed, on a connection of its own that is closed (None returned) once
        the request's client has gone away: vLLM aborts a request whose connection closes (@with_cancellation,
        vllm/entrypoints/serve/utils/api_utils.py:51), so an abandoned request stops generating at its next step."""
        self._check_ready()
        conn = _SocketConnection(self.socket, timeout=ANSWER_TIMEOUT_S)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(payload).encode(),
                         headers={"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"})
            deadline = time.monotonic() + ANSWER_TIMEOUT_S
            while not select.select([conn.sock], [], [], GONE_EVERY_S)[0]:
                if req.gone:
                    return None
                if time.monotonic() > deadline:
                    raise EngineError(f"vLLM did not answer /v1/completions within {ANSWER_TIMEOUT_S:.0f} s")
            r = conn.getresponse()
            body = r.read()
        except (OSError, http.client.HTTPException) as e:
            raise self._lost(e) from e
        finally:
            conn.close()
        said = f"vLLM /v1/completions answered {r.status}: {body[:500].decode(errors='replace')}"
        if 400 <= r.status < 500:  # this request, as vLLM validates it (code review 3, F6): not a broken engine
            raise RequestRefused(said)
        if r.status >= 500:
            raise EngineError(said)
        return json.loads(body)

    def _check_ready(self, force: bool = False) -> None:
        if self.state != "ready" and not force:
            raise SamplerUnavailable((self.detail or f"the vLLM sampler is {self.state}") + "; retry in a minute")

    def _lost(self, e: Exception) -> ArtcloudError:
        """What a transport error means: the process died (SamplerUnavailable), or it did not answer."""
        if self.proc is not None and self.proc.poll() is not None:
            return SamplerUnavailable(f"the vLLM sampler process exited (code {self.proc.returncode}) and is "
                                      "restarting; retry in a minute")
        return EngineError(f"the vLLM sampler did not answer ({type(e).__name__}: {e})")

    def _events(self, path: str, payload: dict[str, Any], sink: TokenSink) -> Iterator[dict[str, Any]]:
        """POST with stream=true: vLLM's Server-Sent Events, one JSON object each. Stops reading when the
        sink is cancelled; closing the response then makes vLLM abort the request."""
        import httpx

        self._check_ready()
        try:
            with self._http.stream("POST", self.url + path, json={**payload, "stream": True},
                                   headers={"Authorization": f"Bearer {self.key}"}) as r:
                if r.status_code >= 400:
                    raise ArtcloudError(f"vLLM {path} answered {r.status_code}: "
                                        f"{r.read().decode(errors='replace')[:500]}", code="sampler_error")
                for line in r.iter_lines():
                    if sink.cancelled:
                        return
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        raise ArtcloudError(f"vLLM {path} failed while streaming: {event['error']}", code="sampler_error")
                    yield event
        except httpx.TransportError as e:
            raise self._lost(e) from e

    # ------------------------------------------------------------------------------------- adapters

    def check_lora(self, lora: LoraConfig) -> None:
        if lora.rank > self.max_lora_rank:
            fits = next((r for r in VLLM_LORA_RANKS if r >= lora.rank), lora.rank)
            raise InvalidArgument(f"rank {lora.rank} is over this vLLM sampler's max_lora_rank {self.max_lora_rank}: "
                             f"register with rank <= {self.max_lora_rank}, or start the server with "
                             f"engine_args max_lora_rank={fits}")

    def serve_adapter(self, slot: str, lora: LoraConfig, folder: Path) -> None:
        self.check_lora(lora)
        with self._lock:
            self.versions += 1
            name = f"{slot}.{self.versions}"
            copy = self.cfg.workdir / "adapters" / name
            copy.mkdir()
            for f in ADAPTER_FILES:
                shutil.copyfile(folder / f, copy / f)
            old = self.adapters.get(slot)
            self.adapters[slot] = (name, copy)
            if self.state == "ready":  # else the restart serves it
                try:
                    self._load(slot, copy)
                except SamplerUnavailable:  # it died just now: the restart serves it, from self.adapters
                    pass
            if old is not None:
                self._unload(*old)

    def _load(self, slot: str, copy: Path, *, force: bool = False) -> None:
        name, _ = self.adapters[slot]
        self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(copy)}, force=force)

    def _unload(self, name: str, copy: Path) -> None:
        try:
            self._post("/v1/unload_lora_adapter", {"lora_name": name})
        except (SamplerUnavailable, RuntimeError) as e:  # a restarted vLLM never had it
            log.debug("unloading %s: %s", name, e)
        shutil.rmtree(copy, ignore_errors=True)

    def drop_adapter(self, slot: str) -> None:
        with self._lock:
            old = self.adapters.pop(slot, None)
            if old is not None:
                self._unload(*old)

    # ------------------------------------------------------------------------------------- sleep

    def sleep(self) -> None:
        if self.can_sleep and not self.asleep and self.state == "ready":
            self._post("/sleep", params={"level": 1})
            self.asleep = True

    def wake(self) -> None:
        if self.asleep and self.state == "ready":
            self._post("/wake_up")
            self.asleep = False

    # ------------------------------------------------------------------------------------- generation

    def generate(self, slot: str | None, requests: list[GenerationRequest]) -> list[list[Completion]]:
        if slot is None:
            model = BASE_NAME
        else:
            entry = self.adapters.get(slot)
            if entry is None:
                raise EngineError(f"adapter {slot!r} is not served by this vLLM sampler", code="adapter_not_loaded")
            model = entry[0]
        return list(self._pool.map(lambda r: self._one(model, r), requests))

    def _one(self, model: str, req: GenerationRequest) -> list[Completion]:
        p = req.params
        payload: dict[str, Any] = {
            "model": model, "prompt": req.prompt_ids, "n": req.n, "max_tokens": p.max_tokens,
            "temperature": p.temperature, "top_p": p.top_p, "logprobs": max(1, p.top_logprobs),
            "return_token_ids": True, "skip_special_tokens": True,
        }
        if p.stop:
            payload["stop"] = p.stop
        if p.seed is not None:
            payload["seed"] = p.seed
        with self._counting:
            self.in_flight += 1
        try:
            if req.sink is not None:
                return self._streamed(payload, req)
            out = self._completions_unless_gone(payload, req)
        finally:
            with self._counting:
                self.in_flight -= 1
        if out is None:  # its client went away: nobody reads these
            return []
        choices = sorted(out["choices"], key=lambda c: c["index"])
        return [self._completion(c, p.top_logprobs, p.temperature) for c in choices]

    def _streamed(self, payload: dict[str, Any], req: GenerationRequest) -> list[Completion]:
        """vLLM streams the completions; each chunk's tokens go to the request's sink as they arrive."""
        p, sink = req.params, req.sink
        assert sink is not None
        merged = [{"token_ids": [], "logprobs": {"token_logprobs": [], "top_logprobs": []}, "text": "",
                   "finish_reason": None} for _ in range(req.n)]
        for event in self._events("/v1/completions", payload, sink):
            for choice in event.get("choices") or []:
                part = self._completion(choice, p.top_logprobs, p.temperature)
                whole = merged[choice["index"]]
                whole["token_ids"] += part.token_ids
                whole["logprobs"]["token_logprobs"] += part.logprobs
                whole["logprobs"]["top_logprobs"] += (choice.get("logprobs") or {}).get("top_logprobs") or []
                whole["text"] += part.text
                whole["finish_reason"] = choice.get("finish_reason") or whole["finish_reason"]
                if part.token_ids:
                    sink.tokens(choice["index"], part.token_ids, part.logprobs, part.top_logprobs)
        return [self._completion(c, p.top_logprobs, p.temperature) for c in merged]

    @staticmethod
    def _completion(choice: dict[str, Any], top_k: int, temperature: float) -> Completion:
        ids = list(choice.get("token_ids") or [])
        lp = choice.get("logprobs") or {}
        logprobs = [float(x) for x in lp.get("token_logprobs") or []]
        if len(logprobs) != len(ids):
            raise EngineError(f"vLLM returned {len(ids)} token ids but {len(logprobs)} logprobs")
        tops = None
        if top_k:
            tops = []
            for d in lp.get("top_logprobs") or []:
                pairs = sorted(((int(k.split(":", 1)[1]), float(v)) for k, v in (d or {}).items()), key=lambda kv: -kv[1])
                tops.append(pairs[:top_k])
        finish = "stop" if choice.get("finish_reason") == "stop" else "length"
        return Completion(token_ids=ids, logprobs=logprobs, top_logprobs=tops, finish_reason=finish,
                          text=choice.get("text") or "", temperature=temperature)

    # ------------------------------------------------------------------------------------- state

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": "vllm", "state": self.state, "restarts": self.restarts, "asleep": self.asleep,
                               "adapters": len(self.adapters), "python": self.cfg.python, "socket": str(self.socket),
                               "in_flight": self.in_flight,
                               "args": {k: v for k, v in sorted(self.cfg.args.items())}}
        if self.proc is not None:
            out["pid"] = self.proc.pid
        if self.detail:
            out["detail"] = self.detail
        return out
