"""Small helpers the tests share: rollouts through the server, and trajectory groups built from them."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]


def find_python(version: str) -> str:
    """An interpreter of Python `version` on this machine (PATH, pyenv, /usr/bin), found as `make test-pythons`
    finds it (.ci/python_venvs.py): never a venv of one checkout, which a fresh clone does not have yet. Missing
    is an error, not a skip: requires-python claims it."""
    spec = importlib.util.spec_from_file_location("python_venvs", REPO / ".ci" / "python_venvs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.find_python(version)


def wait_for(what: str, check, timeout: float = 60.0, every: float = 0.1):
    """check()'s first truthy value, polled every `every` s; an AssertionError naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def process_tree(pid: int) -> list[int]:
    """`pid` and every process descended from it (Linux: /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def listening_sockets(pid: int) -> list[tuple[str, int, int]]:
    """Every TCP socket that `pid`'s process tree listens on: (address, port, pid), from /proc/net/tcp{,6} and the
    processes' file descriptors."""
    import ipaddress

    listening: dict[str, tuple[str, int]] = {}
    for table, width in (("tcp", 4), ("tcp6", 16)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            hex_address, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_address)  # 32-bit words in the host's (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
            listening[fields[9]] = (str(ipaddress.ip_address(raw)), int(hex_port, 16))
    found = []
    for each in process_tree(pid):
        try:
            fds = list(Path(f"/proc/{each}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = fd.readlink().name
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in listening:
                found.append((*listening[target[8:-1]], each))
    return found


def one_line_error(result: subprocess.CompletedProcess, *words: str) -> str:
    """A CLI that failed as it should: exit 2 and one `artcloud: error:` line holding every one of `words`."""
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("artcloud: error:"), result.stderr
    for w in words:
        assert w in lines[0]
    return lines[0]


async def gather_groups(model: Any, client: Any = None, prompts: tuple[str, ...] = ("a", "b"), n: int = 3,
                        max_tokens: int = 5) -> list[Any]:
    """A user's rollout loop through the SDK: `n` completions per prompt from `model.openai_client()` (or
    `client`), rewarded by the reply's length / 10, gathered into artcloud.TrajectoryGroups."""
    import artcloud

    client = client or model.openai_client()

    async def rollout(prompt: str) -> artcloud.Trajectory:
        messages = [{"role": "user", "content": prompt}]
        r = await client.chat.completions.create(model=model.name, messages=messages, max_tokens=max_tokens,
                                                 logprobs=True)
        choice = r.choices[0]
        return artcloud.Trajectory(messages_and_choices=[*messages, choice], reward=len(choice.message.content or "") / 10)

    return await artcloud.gather_trajectory_groups(
        [artcloud.TrajectoryGroup(rollout(p) for _ in range(n)) for p in prompts], progress=False)


def chat(client: httpx.Client, model: str, content: str = "Say something.", **kw: Any) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8, "logprobs": True, **kw}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def group_from(response: dict[str, Any], prompt: str, rewards: list[float]) -> dict[str, Any]:
    """A trajectory group: the user prompt, then each sampled choice as returned, with a reward."""
    trajectories = []
    for choice, reward in zip(response["choices"], rewards):
        trajectories.append({
            "messages_and_choices": [{"role": "user", "content": prompt}, choice],
            "reward": reward,
        })
    return {"trajectories": trajectories}


def rollout_groups(client: httpx.Client, model: str, prompts: list[str], n: int = 4, max_tokens: int = 8) -> list[dict[str, Any]]:
    groups = []
    for prompt in prompts:
        resp = chat(client, model, prompt, n=n, max_tokens=max_tokens)
        rewards = [len(c["token_ids"]) % 3 / 2 + i * 0.01 for i, c in enumerate(resp["choices"])]
        groups.append(group_from(resp, prompt, rewards))
    return groups


def events(client: httpx.Client, job_id: str, after: int = 0, follow: bool = True) -> list[dict[str, Any]]:
    with client.stream("GET", f"/artcloud/jobs/{job_id}/events", params={"after": after, "follow": follow}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line) for line in r.iter_lines() if line.strip()]


def train(client: httpx.Client, model: str, groups: list[dict[str, Any]], **config: Any) -> list[dict[str, Any]]:
    """Post a job and follow it to its end; returns its events."""
    r = client.post(f"/artcloud/models/{model}/train", json={"groups": groups, "config": config})
    assert r.status_code == 202, r.text
    evs = events(client, r.json()["job_id"])
    assert evs[-1]["type"] == "end", evs[-1]
    return evs


class TCPProxy:
    """A TCP proxy on loopback (its own thread and event loop) whose live connections can be cut."""

    def __init__(self, target_host: str, target_port: int):
        import asyncio
        import threading

        self.target = (target_host, target_port)
        self.port = 0
        self.cuts = 0
        self._writers: set = set()
        self._loop = asyncio.new_event_loop()
        self._flowing: asyncio.Event | None = None  # cleared by blackhole()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _run(self) -> None:
        import asyncio

        async def pipe(reader, writer):
            try:
                while data := await reader.read(65536):
                    await self._flowing.wait()  # blackholed: hold everything, close nothing
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        async def handle(client_reader, client_writer):
            try:
                server_reader, server_writer = await asyncio.open_connection(*self.target)
            except OSError:  # the server is gone: so is this connection
                client_writer.close()
                return
            self._writers.update({client_writer, server_writer})
            await asyncio.gather(pipe(client_reader, server_writer), pipe(server_reader, client_writer))
            self._writers.discard(client_writer)
            self._writers.discard(server_writer)

        async def main():
            self._flowing = asyncio.Event()
            self._flowing.set()
            server = await asyncio.start_server(handle, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            self._ready.set()
            await asyncio.Event().wait()

        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(main())

    def cut(self) -> None:
        """Drop every live connection, both ways (as a flaky network would)."""
        def close_all():
            for w in list(self._writers):
                w.transport.abort()
            self._writers.clear()
            self.cuts += 1

        self._loop.call_soon_threadsafe(close_all)

    def blackhole(self) -> None:
        """Stop forwarding both ways without closing anything: a partition, or a laptop that went to
        sleep. Each side's kernel still accepts what fits in its buffers, so neither side sees an error."""
        self._loop.call_soon_threadsafe(self._flowing.clear)
