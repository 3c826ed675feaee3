"""SkyBackend(num_nodes=3) through the SkyPilot stand-in: three node processes on loopback (the head on 127.0.0.1, the
workers on addresses of their own), the task's own setup and run on each, as SkyPilot runs a multi-node task."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import artcloud
from artcloud.backends.sky import SkyBackend
from artcloud.backends.sky_task import REPLICA_PORT
from tests.helpers import gather_groups
from tests.sky_standin import ENV_NODE, _cmdline, _marker_of, cluster_pids

TINY = "artcloud/tiny-random"


def role_pids(root, name: str, node: str, role: str) -> set[int]:
    """The `artcloud ROLE` process of the cluster's node `node` (not the `timeout` or the shell that run it)."""
    return {pid for pid in cluster_pids(root, name) if _marker_of(pid, ENV_NODE) == node
            and f" -m artcloud {role} " in _cmdline(pid) and Path(_cmdline(pid).split()[0]).name.startswith("python")}


def replica_pids(root, name: str) -> set[int]:
    return role_pids(root, name, "2", "replica")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_three_nodes_two_train_two_serve_rollouts_and_a_lost_replica_comes_back(sky_env):
    """Node 0 (the head) serves and trains, node 1 trains with it (`artcloud trainer-node`: one group of ranks over
    both), node 2 serves rollouts (`artcloud replica`)."""
    async def main() -> SkyBackend:
        backend = SkyBackend(gpu="H100:1", num_nodes=3, trainer_nodes=2, name="three", idle_minutes=1)
        assert backend.plan().price_per_hour == pytest.approx(3 * 2.49)  # the plan counts every node
        async with backend:
            assert backend.price_per_hour == pytest.approx(3 * 2.49)  # so does what was launched
            model = artcloud.TrainableModel(name="agent", project="nodes", base_model=TINY,
                                            lora=artcloud.LoraConfig(rank=4))
            await model.register(backend)

            async def replicas() -> list[dict]:
                return (await backend.client.status()).model_dump()["engines"][0]["sampler"]["replicas"]

            (engine,) = (await backend.client.status()).model_dump()["engines"]
            assert (engine["trainer"]["ranks"], engine["trainer"]["nodes"]) == (2, 2), engine["trainer"]

            # Each role holds only the secrets it needs (security review 3, N5): the trainer node the trainer key, the
            # replica a token and TLS pair of its own (under a CA of its own), not the head's; the head its own, the
            # trainer key and the replicas' token (to call them).
            (trainer_node,) = role_pids(sky_env, "three", "1", "trainer-node")
            (replica,) = replica_pids(sky_env, "three")
            (server,) = role_pids(sky_env, "three", "0", "serve")
            names = ("ARTCLOUD_TOKEN", "ARTCLOUD_TLS_KEY", "ARTCLOUD_TRAINER_KEY", "ARTCLOUD_REPLICA_TOKEN",
                     "ARTCLOUD_REPLICA_TLS_KEY", "ARTCLOUD_REPLICA_TLS_CERT")
            held = {pid: {n: _marker_of(pid, n) for n in names if _marker_of(pid, n) is not None}
                    for pid in (trainer_node, replica, server)}
            assert set(held[trainer_node]) == {"ARTCLOUD_TRAINER_KEY"}, held
            assert set(held[replica]) == {"ARTCLOUD_TOKEN", "ARTCLOUD_TLS_KEY"}, held
            assert set(held[server]) == {"ARTCLOUD_TOKEN", "ARTCLOUD_TLS_KEY", "ARTCLOUD_TRAINER_KEY",
                                         "ARTCLOUD_REPLICA_TOKEN"}, held
            assert held[replica]["ARTCLOUD_TOKEN"] == held[server]["ARTCLOUD_REPLICA_TOKEN"]
            assert held[replica]["ARTCLOUD_TOKEN"] != held[server]["ARTCLOUD_TOKEN"]
            assert held[replica]["ARTCLOUD_TLS_KEY"] != held[server]["ARTCLOUD_TLS_KEY"]
            # The replica's certificate is no head's to a client: the launch's CA, which the client trusts, refuses it.
            from artcloud.tls import client_ssl_context

            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                async with httpx.AsyncClient(verify=client_ssl_context(backend.client.endpoint.ca,
                                                                       check_hostname=False)) as http:
                    await http.get(f"{(await replicas())[1]['url']}/health")

            head, worker = await replicas()
            assert head["live"] and worker["live"] and worker["url"].endswith(f":{REPLICA_PORT}")
            assert not worker["url"].startswith("https://127.0.0.1:")  # the worker's own address, from SKYPILOT_NODE_IPS
            groups = await gather_groups(model, prompts=tuple(f"prompt {i}" for i in range(8)), n=2, max_tokens=6)
            assert all(r["served"] > 0 for r in await replicas())  # rollouts on both nodes
            result = await model.train(groups, config=artcloud.TrainConfig(learning_rate=1e-3), progress=False)
            assert result.step == 1

            # The trainer node's process dies (an OOM kill, say): its node's loop starts it again, where a node that
            # exits non-zero would fail the job and SkyPilot would stop the head (contract review 3, N4).
            os.kill(trainer_node, signal.SIGKILL)
            for _ in range(600):
                again = role_pids(sky_env, "three", "1", "trainer-node")
                if again - {trainer_node}:
                    break
                await asyncio.sleep(0.1)
            assert again - {trainer_node}, again
            assert (await backend.client.status()).model_dump()["engines"]  # the head serves on

            # The worker's replica dies: rollouts go on on the head; the node's loop starts it again, and the head
            # hands it the adapters before it rejoins.
            pids = replica_pids(sky_env, "three")
            assert len(pids) == 1, pids
            os.kill(pids.pop(), signal.SIGKILL)
            await gather_groups(model, prompts=tuple(f"again {i}" for i in range(8)), n=2, max_tokens=6)
            for _ in range(900):  # the node's loop waits 5 s, the replica starts, the head checks every 5 s
                worker = (await replicas())[1]
                if worker["live"] and worker["failures"]:
                    break
                await asyncio.sleep(0.2)
            assert worker["live"] and worker["failures"] >= 1, worker
            before = worker["served"]
            await gather_groups(model, prompts=tuple(f"new {i}" for i in range(8)), n=2, max_tokens=6)
            assert (await replicas())[1]["served"] > before
        return backend

    backend = asyncio.run(main())
    assert backend.api.status("three") is None
    assert cluster_pids(sky_env, "three") == set()  # every node's processes, the loops and the ranks included


def test_several_nodes_are_refused_in_one_line_where_they_cannot_be(sky_env):
    from artcloud.backends.modal import ModalBackend
    from artcloud.errors import InvalidArgument
    from tests.helpers import one_line_error

    with pytest.raises(InvalidArgument, match=r"Function \(modal.clustered\), not for a Sandbox") as e:
        ModalBackend(num_nodes=2)
    assert e.value.field == "num_nodes"
    for bad in (0, 1.5, True):
        with pytest.raises(InvalidArgument, match="num_nodes is a whole number"):
            SkyBackend(num_nodes=bad)
    result = subprocess.run([sys.executable, "-m", "artcloud", "launch", "--provider", "modal", "--nodes", "2"],
                            capture_output=True, text=True, timeout=120)
    one_line_error(result, "--nodes", "for --provider sky")
