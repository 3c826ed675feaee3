"""Several samplers of one base model serving as one: the head's own sampler beside `artcloud replica` servers
on the cluster's other nodes (multi-node rollouts; the server on the head stays the one endpoint clients see).

Routing (as SGLang's cache-aware router does): the set remembers which replica took each prompt, by the hashes
of its 16-token blocks. A request whose prompt begins with a prompt seen before, for at least half its length
(the next turn of a multi-turn rollout), goes to the same replica, whose prefix cache holds it; any other goes
to the least loaded replica (ties broken by a hash of the prompt, so that the spread does not depend on
timing). A replica with SPILL samples more in flight than the least loaded one takes no more of its own.

Adapters: every committed step is served on every live replica. A replica that fails (its process died,
its node went, it answered a 5xx) leaves the rotation at once; its requests go to the others, except a
streamed request that has already sent tokens (those cannot be taken back): that one request fails with 503 and
the client retries it, so no rollout is lost silently. A request a replica refuses as bad (a 4xx: RequestRefused)
fails alone, with 400, and the replica stays. A background check asks each replica that left whether
it answers again (its node's supervisor restarts it); one that does gets every served adapter again and
rejoins.
"""

from __future__ import annotations

import hashlib
import json
import logging
import ssl
import tarfile
import tempfile
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from artcloud.errors import InvalidArgument
from artcloud.server.engines.base import (
    Completion,
    EngineError,
    GenerationRequest,
    RequestRefused,
    Sampler,
    SamplerUnavailable,
    TokenSink,
)
from artcloud.types import LoraConfig

log = logging.getLogger("artcloud.replicas")

BLOCK = 16  # tokens per remembered prefix block (vLLM's prefix cache block)
MATCH = 0.5  # of a prompt, the least a remembered prefix must cover to keep its replica
REMEMBERED = 1 << 16  # prefix blocks remembered (the oldest are forgotten)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # what a replica is handed of a step
LORA_HEADER = "X-Artcloud-Lora"
SPILL = 8  # samples in flight more than the least loaded replica before a request leaves its affinity
FAILURES = (SamplerUnavailable, EngineError, OSError)  # what takes a replica out (not a bad request: 4xx)


@dataclass(eq=False)
class Replica:
    name: str
    sampler: Sampler
    live: bool = True
    load: int = 0  # samples in flight
    served: int = 0  # requests answered
    failures: int = 0
    last_error: str = ""
    turn: threading.Lock | None = None  # a sampler that does not batch by itself (the torch sampler): one call at a time

    @classmethod
    def of(cls, name: str, sampler: Sampler, **kw: Any) -> "Replica":
        return cls(name, sampler, turn=None if sampler.concurrent else threading.Lock(), **kw)

    def call(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)`, one call at a time on a sampler that is not concurrent."""
        if self.turn is None:
            return fn(*args)
        with self.turn:
            return fn(*args)


class _Watched(TokenSink):
    """The request's own sink, noting whether any token went out (then the request cannot move)."""

    def __init__(self, inner: TokenSink):
        self.inner = inner
        self.sent = False

    @property
    def cancelled(self) -> bool:  # type: ignore[override]
        return self.inner.cancelled

    def tokens(self, sample, token_ids, logprobs, top_logprobs) -> None:
        self.sent = True
        self.inner.tokens(sample, token_ids, logprobs, top_logprobs)

    def started(self, served_as: str) -> None:
        self.inner.started(served_as)


class ReplicaSet(Sampler):
    concurrent = True

    def __init__(self, samplers: list[Sampler], names: list[str] | None = None, *, recheck_s: float = 5.0):
        if not samplers:
            raise InvalidArgument("a ReplicaSet needs at least one sampler")
        for s in samplers:
            if s.shares_trainer_weights:  # serving a step would load over the trainer's own adapter
                raise InvalidArgument(f"{type(s).__name__} shares the trainer's weights: give the set a sampler of its own")
        names = names or [f"replica{i}" for i in range(len(samplers))]
        self.replicas = [Replica.of(n, s, live=False) for n, s in zip(names, samplers)]
        self.max_context = min(s.max_context for s in samplers)
        self.can_sleep = any(s.can_sleep for s in samplers)
        self.moved = 0  # requests sent again to another replica after theirs failed
        self._adapters: dict[str, tuple[LoraConfig, Path]] = {}  # what every replica must serve
        self._seen: OrderedDict[bytes, Replica] = OrderedDict()  # prefix block hash -> the replica that took it
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=4 * len(samplers), thread_name_prefix="replica")
        self._stop = threading.Event()
        back = self.check()  # each joins once it answers (a replica still starting joins at a later check)
        if len(back) < len(self.replicas):
            log.warning("inference replicas not answering yet: %s (checked again every %.0f s)",
                        ", ".join(r.name for r in self.replicas if not r.live), recheck_s)
        self._checker = threading.Thread(target=self._recheck, args=(recheck_s,), daemon=True, name="replica-check")
        self._checker.start()

    # ------------------------------------------------------------------------------------- routing

    @staticmethod
    def _blocks(prompt_ids: list[int]) -> list[bytes]:
        """The hash of each whole BLOCK-token prefix of the prompt, shortest first."""
        out, h = [], b""
        for start in range(0, len(prompt_ids) - BLOCK + 1, BLOCK):
            block = b"".join(t.to_bytes(4, "big", signed=True) for t in prompt_ids[start:start + BLOCK])
            h = hashlib.blake2b(h + block, digest_size=12).digest()
            out.append(h)
        return out

    @staticmethod
    def _tie(replica: Replica, prompt: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(prompt + replica.name.encode(), digest_size=8).digest(), "big")

    def pick(self, request: GenerationRequest) -> Replica:
        """The replica for `request` (its samples counted in its load; the caller gives them back with `_done`)."""
        blocks = self._blocks(request.prompt_ids)  # hashed before the lock: other threads pick meanwhile
        prompt = hashlib.blake2b(str(request.prompt_ids).encode(), digest_size=16).digest()
        with self._lock:
            live = [r for r in self.replicas if r.live]
            if not live:
                raise SamplerUnavailable("every inference replica is down (they are being restarted): retry in a few seconds")
            least = min(live, key=lambda r: (r.load, -self._tie(r, prompt)))
            chosen = least
            for k in range(len(blocks) - 1, -1, -1):
                seen = self._seen.get(blocks[k])
                if seen is not None:
                    if seen.live and (k + 1) * BLOCK >= MATCH * len(request.prompt_ids) and seen.load - least.load < SPILL:
                        chosen = seen
                    break
            for h in blocks:
                self._seen[h] = chosen
                self._seen.move_to_end(h)
            while len(self._seen) > REMEMBERED:
                self._seen.popitem(last=False)
            chosen.load += request.n
            return chosen

    def _done(self, replica: Replica, requests: list[GenerationRequest]) -> None:
        with self._lock:
            replica.load -= sum(r.n for r in requests)

    def _fail(self, replica: Replica, error: BaseException) -> None:
        with self._lock:
            if replica.live:
                log.warning("inference replica %s left the rotation: %s", replica.name, error)
            replica.live = False
            replica.failures += 1
            replica.last_error = str(error)[:300]

    # ------------------------------------------------------------------------------------- sampling

    def generate(self, slot: str | None, requests: list[GenerationRequest]) -> list[Any]:
        """Each request's completions, or its own failure (an ArtcloudError in its place)."""
        results: list[Any] = [None] * len(requests)
        watched = [_Watched(r.sink) if r.sink is not None else None for r in requests]
        originals = [r.sink for r in requests]
        for r, w in zip(requests, watched):
            r.sink = w
        try:
            pending = list(range(len(requests)))
            while pending:
                groups: dict[Replica, list[int]] = {}
                try:
                    for i in pending:
                        groups.setdefault(self.pick(requests[i]), []).append(i)
                except SamplerUnavailable:
                    for replica, idx in groups.items():
                        self._done(replica, [requests[i] for i in idx])
                    raise
                futures = {replica: self._pool.submit(replica.call, replica.sampler.generate, slot,
                                                      [requests[i] for i in idx])
                           for replica, idx in groups.items()}
                wait(futures.values())  # every replica answers before any load is given back or any error raised
                for replica, idx in groups.items():
                    self._done(replica, [requests[i] for i in idx])
                pending = []
                for replica, future in futures.items():
                    idx = groups[replica]
                    try:
                        out = future.result()  # anything but a replica's failure or a refusal is the caller's
                    except RequestRefused as e:  # these requests are bad, not the replica (code review 3, F6)
                        for i in idx:
                            results[i] = e
                        continue
                    except FAILURES as e:
                        self._fail(replica, e)
                        for i in idx:  # each request on its own (F5): a streamed one that sent tokens fails alone
                            if watched[i] is not None and watched[i].sent:
                                results[i] = SamplerUnavailable(f"the inference replica serving this streamed request "
                                                                f"failed after its first tokens ({e}): send the "
                                                                "request again")
                            else:
                                self.moved += 1
                                pending.append(i)
                        continue
                    if len(out) != len(idx):
                        raise EngineError(f"replica {replica.name} answered {len(out)} results for {len(idx)} requests")
                    replica.served += len(idx)
                    for i, completions in zip(idx, out):
                        results[i] = completions
            return [r if r is not None else [] for r in results]
        finally:
            for r, sink in zip(requests, originals):
                r.sink = sink

    # ------------------------------------------------------------------------------------- adapters

    def serve_adapter(self, slot: str, lora: LoraConfig, folder: Path) -> None:
        with self._lock:
            self._adapters[slot] = (lora, folder)
            live = [r for r in self.replicas if r.live]
        served = 0
        for replica, future in [(r, self._pool.submit(r.call, r.sampler.serve_adapter, slot, lora, folder)) for r in live]:
            try:
                future.result()
                served += 1
            except FAILURES as e:
                self._fail(replica, e)
        if not served:
            raise SamplerUnavailable(f"no inference replica could take adapter {slot}: they are being restarted, and "
                                     "each gets it when it is back")

    def drop_adapter(self, slot: str) -> None:
        with self._lock:
            self._adapters.pop(slot, None)
            live = [r for r in self.replicas if r.live]
        for replica in live:
            try:
                replica.call(replica.sampler.drop_adapter, slot)
            except FAILURES as e:
                self._fail(replica, e)

    # ------------------------------------------------------------------------------------- health

    def check(self) -> list[str]:
        """Ask every replica out of the rotation whether it answers again, all at once (one that loads the model
        takes minutes: security review 3, N10); one that does is given every served adapter and rejoins. Returns
        the names that rejoined."""
        out = [r for r in self.replicas if not r.live]
        if not out:
            return []
        with ThreadPoolExecutor(max_workers=len(out), thread_name_prefix="replica-check") as pool:
            rejoined = list(pool.map(self._rejoin, out))
        return [r.name for r, back in zip(out, rejoined) if back]

    def _rejoin(self, replica: Replica) -> bool:
        try:
            replica.sampler.status()
            with self._lock:
                adapters = dict(self._adapters)
            for slot, (lora, folder) in adapters.items():
                replica.call(replica.sampler.serve_adapter, slot, lora, folder)
        except FAILURES as e:
            replica.last_error = str(e)[:300]
            return False
        with self._lock:
            missed = {s: a for s, a in self._adapters.items() if adapters.get(s) != a}
        for slot, (lora, folder) in missed.items():  # published while it was being given the others
            try:
                replica.call(replica.sampler.serve_adapter, slot, lora, folder)
            except FAILURES as e:
                replica.last_error = str(e)[:300]
                return False
        with self._lock:
            replica.live = True
        if replica.failures:
            log.warning("inference replica %s is back in the rotation (%d adapters served again)", replica.name,
                        len(adapters) + len(missed))
        else:
            log.info("inference replica %s joined the rotation", replica.name)
        return True

    def _recheck(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - a bug here must not end the checks
                log.exception("checking the inference replicas failed")

    def sleep(self) -> None:
        for r in self.replicas:
            if r.sampler.can_sleep:
                r.sampler.sleep()

    def wake(self) -> None:
        for r in self.replicas:
            if r.sampler.can_sleep:
                r.sampler.wake()

    def status(self) -> dict[str, Any]:
        with self._lock:
            replicas = [{"name": r.name, "url": getattr(r.sampler, "url", None), "live": r.live, "in_flight": r.load,
                         "served": r.served, "failures": r.failures,
                         **({"last_error": r.last_error} if r.last_error else {})} for r in self.replicas]
        live = sum(r["live"] for r in replicas)
        return {"kind": "replicas", "state": "ready" if live else "restarting", "live": live, "moved": self.moved,
                "replicas": replicas}

    def close(self) -> None:
        self._stop.set()
        for r in self.replicas:
            try:
                r.sampler.close()
            except Exception as e:  # noqa: BLE001 - one replica's close must not keep the others open
                log.warning("closing replica %s: %s", r.name, e)
        self._pool.shutdown(wait=False, cancel_futures=True)


# ------------------------------------------------------------------------------------- a replica on another node


def ca_context(ca: str | Path) -> ssl.SSLContext:
    """Trust the launch's own CA. The head reaches replicas at the nodes' private IPs, which the launch's
    certificate does not name; the CA is this launch's alone, so the certificate still proves the peer."""
    context = ssl.create_default_context(cafile=str(ca))
    context.check_hostname = False
    return context


class RemoteSampler(Sampler):
    """A replica, as a sampler the head's ReplicaSet routes to. Its failures are SamplerUnavailable or
    EngineError (the set takes it out of the rotation); a 4xx is a bug of ours and raised as EngineError too."""

    concurrent = True

    def __init__(self, url: str, token: str, ca: str | Path, base_model: str, engine_args: dict[str, Any] | None = None,
                 *, max_context: int, load_timeout_s: float = 1800.0):
        import httpx

        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"},
                                  verify=ca_context(ca), timeout=httpx.Timeout(30.0, read=600.0))
        self.base_model, self.engine_args = base_model, dict(engine_args or {})
        self.max_context = max_context  # the head's: the same model, the same engine_args
        self.load_timeout_s = load_timeout_s
        self.epoch: str | None = None  # the replica process this one loaded the model on (None: not yet)

    def __repr__(self) -> str:
        return f"RemoteSampler({self.url!r})"

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        import httpx

        try:
            response = self._http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise SamplerUnavailable(f"replica {self.url} does not answer ({type(e).__name__}: {e})") from e
        if response.status_code >= 500:
            raise SamplerUnavailable(f"replica {self.url} answered {response.status_code}: {response.text[:200]}")
        if response.status_code >= 400:  # bad input of ours, not a broken replica
            raise RequestRefused(f"replica {self.url} refused {method} {path}: {response.status_code} "
                                 f"{response.text[:300]}")
        try:
            return response.json()
        except ValueError as e:
            raise EngineError(f"replica {self.url} answered {method} {path} with something that is not JSON") from e

    def status(self) -> dict[str, Any]:
        """The replica's status; one that has not loaded the model yet, or restarted since (another epoch), loads
        it first (ReplicaSet.check then serves it every adapter)."""
        info = self._call("GET", "/replica/status")
        if info.get("epoch") != self.epoch or info.get("base_model") != self.base_model:
            info = self._call("POST", "/replica/models", json={"base_model": self.base_model,
                                                               "engine_args": self.engine_args},
                              timeout=self.load_timeout_s)
            if info.get("max_context") is not None and info["max_context"] < self.max_context:
                raise EngineError(f"replica {self.url} takes {info['max_context']} tokens of context, the head "
                                  f"{self.max_context}: give both the same engine_args")
            self.epoch = info.get("epoch")
        return {"kind": "remote", "state": "ready", "url": self.url, "sampler": info.get("sampler")}

    def serve_adapter(self, slot: str, lora: LoraConfig, folder: Path) -> None:
        """The step's files as a tar, spooled to disk and streamed: ReplicaSet hands each step to every replica at
        once, and an in-memory tar (and its copy) per replica was twice the adapter each (security review 3, N10)."""
        with tempfile.TemporaryFile() as raw:
            with tarfile.open(fileobj=raw, mode="w:") as tar:
                for name in ADAPTER_FILES:
                    tar.add(folder / name, arcname=name)
            size = raw.tell()
            raw.seek(0)
            self._call("PUT", f"/replica/adapters/{slot}", content=iter(lambda: raw.read(1 << 20), b""),
                       headers={LORA_HEADER: lora.model_dump_json(), "Content-Type": "application/x-tar",
                                "Content-Length": str(size)})

    def drop_adapter(self, slot: str) -> None:
        self._call("DELETE", f"/replica/adapters/{slot}")

    def generate(self, slot: str | None, requests: list[GenerationRequest]) -> list[list[Completion]]:
        import httpx

        body = {"slot": slot, "requests": [{"prompt_ids": r.prompt_ids, "n": r.n, "params": asdict(r.params),
                                            "stream": r.sink is not None} for r in requests]}
        try:
            with self._http.stream("POST", "/replica/generate", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    said = f"replica {self.url} answered {response.status_code}: {response.text[:300]}"
                    if response.status_code >= 500 or response.status_code == 404:  # 404: it restarted, lost adapters
                        raise SamplerUnavailable(said)
                    raise RequestRefused(said)
                for line in response.iter_lines():
                    if all(r.gone for r in requests):
                        break  # nobody waits for them: closing the stream stops them on the replica
                    if not line:
                        continue
                    item = json.loads(line)
                    if "tokens" in item:
                        i, sample, ids, lps, top = item["tokens"]
                        sink = requests[i].sink
                        if sink is not None:
                            sink.tokens(sample, ids, lps, [[tuple(t) for t in step] for step in top] if top else None)
                    elif "done" in item:
                        return [[_completion(c) for c in cs] for cs in item["done"]]
                    elif "error" in item:
                        said = f"replica {self.url}: {item['error'].get('message')}"
                        if item["error"].get("refused"):
                            raise RequestRefused(said)
                        raise EngineError(said)
        except httpx.HTTPError as e:
            raise SamplerUnavailable(f"replica {self.url} went away mid-answer ({type(e).__name__}: {e})") from e
        except (ValueError, KeyError, TypeError) as e:
            raise EngineError(f"replica {self.url} answered something that is not a generation ({e})") from e
        if all(r.gone for r in requests):
            return [[] for _ in requests]  # nobody waits for them
        raise SamplerUnavailable(f"replica {self.url} ended its answer before its results")

    def close(self) -> None:
        self._http.close()


def _completion(c: dict[str, Any]) -> Completion:
    top = c.get("top_logprobs")
    return Completion(token_ids=c["token_ids"], logprobs=c["logprobs"],
                      top_logprobs=[[tuple(t) for t in step] for step in top] if top is not None else None,
                      finish_reason=c["finish_reason"], text=c["text"], temperature=c["temperature"])
