"""One node of a multi-node cluster lost (contract review 3, N3 and D11; code review 3, R3), through the SkyPilot
stand-in's per-node preemption (tests/sky_standin.py, `preempt_node`): the node's processes gone at once, the
others running on, SkyPilot's refreshed status INIT 'unhealthy' with its autostop kept (a VM cloud), the job never
ending (the lost node's task waits for a bundle that cannot be placed), and no skylet left once the head is gone.

- A lost worker, the head serving on: the heartbeat finds the cluster unhealthy and, on spot with S3, replaces the
  whole cluster; the model comes back at its step and trains on, nothing lost or trained twice.
- A lost trainer node inside a step (held there by a barrier): the cluster is replaced, and the step the train call
  was in is trained once, on the new cluster.
- A lost head: the worker's replica ends itself (its head watch) and its node powers itself off (the stand-in's
  `sudo shutdown`): with the head went the only skylet that autodowns. Where that cannot stop the billing (a pod, an
  Azure VM), the liveness check of the client's next failed rollouts finds the head silent, tears the cluster down
  and logs why.
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

import artcloud
from artcloud.backends.sky import SkyBackend
from artcloud.storage.s3 import CheckpointStore, S3Config
from tests.helpers import gather_groups, wait_for
from tests.sky_standin import LocalSky, _cmdline, cluster_pids
from tests.test_sky import TINY, use_s3
from tests.test_sky_nodes import role_pids
from tests.test_sky_spot import hold_step


def _refreshed_unhealthy(name: str) -> None:
    """Until SkyPilot's refresh has seen the loss (an AUTO refresh skips a record younger than 2 s)."""
    wait_for(f"{name} INIT", lambda: getattr(LocalSky().status(name, refresh=True), "status", None) == "INIT", 20,
             every=0.5)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_lost_worker_node_is_a_lost_cluster_replaced_with_no_step_lost(sky_env, monkeypatch, seaweed, caplog):
    caplog.set_level(logging.WARNING)
    s3 = use_s3(monkeypatch, seaweed, "pair")
    store = CheckpointStore(S3Config.from_uri(s3))

    async def main() -> SkyBackend:
        backend = SkyBackend(gpu="H100:1", num_nodes=2, use_spot=True, cluster_name="pair", s3=s3, idle_minutes=1,
                             heartbeat_every_s=1.0)
        async with backend:
            model = artcloud.TrainableModel(name="agent", project="pair", base_model=TINY,
                                            lora=artcloud.LoraConfig(rank=4))
            await model.register(backend)
            client = model.openai_client()
            config = artcloud.TrainConfig(learning_rate=1e-3)
            assert (await model.train(await gather_groups(model, client), config=config, progress=False)).step == 1
            model.merge_state({"offset": 1})
            await asyncio.to_thread(wait_for, "step 1 on S3", lambda: 1 in store.committed_steps("pair", "agent"), 60)
            assert not backend.replacements

            # The worker (node 1, a replica) goes. The head serves on, so no request fails: the heartbeat asks.
            (replica,) = role_pids(sky_env, "pair", "1", "replica")
            await asyncio.to_thread(LocalSky().preempt_node, "pair", 1)
            await asyncio.to_thread(wait_for, "the cluster replaced", lambda: backend.replacements, 300)
            assert (await backend.model_info("agent")).step == 1  # resumed from S3
            assert model.read_state() == {"offset": 1}
            status = (await backend.client.status()).model_dump()
            assert all(r["live"] for r in status["engines"][0]["sampler"]["replicas"])  # both nodes of the new one
            assert replica not in cluster_pids(sky_env, "pair")
            assert (await model.train(await gather_groups(model, client), config=config, progress=False)).step == 2
            history = (await backend.model_info("agent")).history
            assert [h["step"] for h in history] == [1, 2]  # none lost, none trained twice
        return backend

    backend = asyncio.run(main())
    assert store.committed_steps("pair", "agent") == [0, 1, 2]
    (lost,) = backend.replacements
    assert "a node of pair was lost" in lost["reason"], lost
    assert LocalSky().status("pair") is None and cluster_pids(sky_env, "pair") == set()
    assert "pair was lost" in "\n".join(r.getMessage() for r in caplog.records)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_trainer_node_lost_inside_a_step_is_replaced_and_the_step_trained_once(sky_env, monkeypatch, seaweed,
                                                                               tmp_path):
    s3 = use_s3(monkeypatch, seaweed, "duo")
    store = CheckpointStore(S3Config.from_uri(s3))
    # On the cluster: a training step waits in the engine while HOLD_STEP_DIR/hold exists (tests/test_sky_spot.py).
    hook_env, hold = hold_step(tmp_path)

    async def main() -> SkyBackend:
        backend = SkyBackend(gpu="H100:1", num_nodes=2, trainer_nodes=2, use_spot=True, cluster_name="duo", s3=s3,
                             idle_minutes=1, heartbeat_every_s=1.0, env=hook_env)
        async with backend:
            model = artcloud.TrainableModel(name="agent", project="duo", base_model=TINY,
                                            lora=artcloud.LoraConfig(rank=4))
            await model.register(backend)
            (engine,) = (await backend.client.status()).model_dump()["engines"]
            assert (engine["trainer"]["ranks"], engine["trainer"]["nodes"]) == (2, 2), engine["trainer"]
            config = artcloud.TrainConfig(learning_rate=1e-3)
            assert (await model.train(await gather_groups(model), config=config, progress=False)).step == 1
            await asyncio.to_thread(wait_for, "step 1 on S3", lambda: 1 in store.committed_steps("duo", "agent"), 60)

            # Step 2 held in the head's engine; the trainer node (node 1) goes meanwhile.
            (hold / "hold").touch()
            training = asyncio.ensure_future(model.train(await gather_groups(model), config=config, progress=False))
            await asyncio.to_thread(wait_for, "the step held in the engine", (hold / "in-step").exists, 120)
            assert role_pids(sky_env, "duo", "1", "trainer-node")
            await asyncio.to_thread(LocalSky().preempt_node, "duo", 1)
            await asyncio.to_thread(wait_for, "the cluster replaced", lambda: backend.replacements, 300)
            (hold / "hold").unlink()  # the old head went with its cluster; the new one trains the step unheld
            result = await training
            assert result.step == 2 and result.trained
            (engine,) = (await backend.client.status()).model_dump()["engines"]
            assert (engine["trainer"]["ranks"], engine["trainer"]["nodes"]) == (2, 2), engine["trainer"]
            assert [h["step"] for h in (await backend.model_info("agent")).history] == [1, 2]
        return backend

    backend = asyncio.run(main())
    assert store.committed_steps("duo", "agent") == [0, 1, 2]  # none lost, none trained twice
    (lost,) = backend.replacements
    assert "a node of duo was lost" in lost["reason"], lost
    assert LocalSky().status("duo") is None and cluster_pids(sky_env, "duo") == set()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_lost_head_leaves_workers_that_end_themselves_and_a_cluster_the_client_tears_down(sky_env, caplog):
    from artcloud.backends.client import ServerGone
    from artcloud.gather import GatherError

    async def main() -> None:
        backend = SkyBackend(gpu="H100:1", num_nodes=2, cluster_name="headless", idle_minutes=1)
        async with backend:
            model = artcloud.TrainableModel(name="agent", project="headless", base_model=TINY,
                                            lora=artcloud.LoraConfig(rank=4))
            await model.register(backend)
            await gather_groups(model)
            assert role_pids(sky_env, "headless", "1", "replica")
            await asyncio.to_thread(LocalSky().preempt_node, "headless", 0)

            # The worker's replica finds nothing listening at the head and ends, and its node's loop with it, which
            # powers the node off a (stand-in) minute later: nothing else would end it (the head's skylet, the only
            # one that autodowns, is gone). Until its last process ends, the node is not off.
            try:
                await asyncio.to_thread(wait_for, "the worker's processes ended",
                                        lambda: not cluster_pids(sky_env, "headless"), 120)
            except AssertionError:
                log = (sky_env / "clusters" / "headless" / "job.log").read_text()[-3000:]
                raise AssertionError(f"{[_cmdline(p)[:80] for p in cluster_pids(sky_env, 'headless')]}\n{log}") from None
            cluster = json.loads((sky_env / "clusters" / "headless" / "cluster.json").read_text())
            assert cluster.get("stopped_nodes") == [1], cluster  # it powered itself off
            assert "node 1 ended (its head is gone" in (sky_env / "clusters" / "headless" / "job.log").read_text()
            # SkyPilot's view: INIT 'unhealthy' (a node stopped, the head gone), its autostop kept.
            await asyncio.to_thread(_refreshed_unhealthy, "headless")
            info = LocalSky().status("headless", refresh=True)
            assert info.autostop_minutes == 1 and info.init_kind == "unhealthy"  # kept: backend_utils.py:3166-3172
            assert (await backend.provisioner.node_lost()) is not None

            # The client's next rollouts fail at the transport; the liveness check they run finds the head silent,
            # so the cluster dead, and tears it down (no spot replacement here: the rollouts' error stands).
            with pytest.raises(GatherError, match="Connection error"):
                await gather_groups(model)
            assert LocalSky().status("headless") is None
            with pytest.raises(ServerGone) as gone:  # and the check says why from then on
                await backend._check_alive()
            assert gone.value.code == "cluster_gone", gone.value

    caplog.set_level(logging.WARNING)
    asyncio.run(main())
    assert "the cluster headless is unhealthy, its head node not answering" in caplog.text
    assert cluster_pids(sky_env, "headless") == set()
