"""What following a replaced server costs a rollout loop: `model.openai_client()` (its transport re-targets each
request at the backend's current server, token and CA: artcloud/backends/following.py) against a plain
`openai.AsyncOpenAI` with the same CA and token, on the same live server, in one run; and what an ART-style
client of the user's own costs, `AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)`
(plain HTTP to the loopback forwarder, artcloud/backends/forwarder.py, which forwards over TLS).

    python bench/openai_client.py [--requests 3000] [--concurrency 32]

The request is GET /v1/models (authenticated, no model work), so what is measured is the client and TLS path;
with --chat it is a chat completion of 16 tokens from artcloud/tiny-random, a rollout's request at its cheapest.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from artcloud.backends.remote import RemoteBackend  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402


async def rate(client, requests: int, concurrency: int, chat: bool = False) -> float:
    left = requests

    async def one() -> None:
        if chat:
            await client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=16, temperature=1.0)
        else:
            await client.models.list()

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await one()

    await one()  # warm: one connection and TLS session per pool first
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return requests / (time.perf_counter() - started)


async def main(args: argparse.Namespace) -> None:
    import openai

    from artcloud.tls import client_ssl_context

    with tempfile.TemporaryDirectory() as tmp, ServerProcess(Path(tmp) / "srv", log_level="warning") as server:
        ca = server.ca.read_text()
        plain = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.token, max_retries=0,
                                   http_client=openai.DefaultAsyncHttpxClient(verify=client_ssl_context(ca)))
        backend = RemoteBackend(server.url, token=server.token, ca_cert=ca)
        if args.chat:
            await backend.register("agent", "bench", "artcloud/tiny-random", {})
        following = backend.openai_client(max_retries=0)
        base_url, key = backend.inference_endpoint()
        own = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)
        rounds = {"plain": [], "following": [], "forwarded": []}
        for _ in range(args.rounds):  # alternate, so that drift hits all alike
            for name, client in (("plain", plain), ("following", following), ("forwarded", own)):
                rounds[name].append(await rate(client, args.requests, args.concurrency, args.chat))
        await plain.close()
        await following.close()
        await own.close()
        await backend.close()
    best = {k: max(v) for k, v in rounds.items()}
    what = "POST /v1/chat/completions (16 tokens, tiny-random)" if args.chat else "GET /v1/models"
    print(f"{what}, {args.requests} requests x {args.rounds} rounds, {args.concurrency} at a time (best round):")
    print(f"  plain openai.AsyncOpenAI      {best['plain']:8.0f} req/s")
    print(f"  model.openai_client()         {best['following']:8.0f} req/s   ({best['following'] / best['plain']:.2f}x)")
    print(f"  AsyncOpenAI(inference_base_url) {best['forwarded']:6.0f} req/s   ({best['forwarded'] / best['plain']:.2f}x)"
          "   through the loopback forwarder")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chat", action="store_true", help="chat completions of 16 tokens instead of GET /v1/models")
    asyncio.run(main(parser.parse_args()))
