"""The client SDK against real servers: LocalBackend, TrainableModel, gather, the annealer, faults."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
from helpers import TCPProxy

import artcloud
from artcloud.backends.client import VersionMismatch
from artcloud.backends.remote import RemoteBackend
from artcloud.errors import ArtcloudError

TINY = "artcloud/tiny-random"


async def rollout(client, model, prompt: str, **kw) -> artcloud.Trajectory:
    messages = [{"role": "user", "content": prompt}]
    r = await client.chat.completions.create(model=model.name, messages=messages, max_tokens=8, logprobs=True, **kw)
    choice = r.choices[0]
    # Reward: longer answers are better (anything that varies within a group will do here).
    return artcloud.Trajectory(messages_and_choices=[*messages, choice], reward=len(choice.message.content or "") / 20)


def groups_for(client, model, prompts, n=4):
    return [artcloud.TrajectoryGroup(rollout(client, model, p) for _ in range(n)) for p in prompts]


async def model_with_groups(backend, name: str, prompts: int, n: int = 4):
    """A registered TrainableModel on tiny-random, its OpenAI client, and gathered groups to train on."""
    model = artcloud.TrainableModel(name=name, project="sdk", base_model=TINY)
    await model.register(backend)
    client = model.openai_client()
    groups = await artcloud.gather_trajectory_groups(groups_for(client, model, [f"p{i}" for i in range(prompts)], n=n), progress=False)
    return model, client, groups


def test_import_artcloud_is_light():
    code = "import sys, artcloud; print(' '.join(m for m in ('torch','transformers','fastapi','uvicorn','sky','modal','boto3','peft','vllm','unsloth') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert out.stdout.strip() == ""


def test_register_rollouts_train_through_local_backend(tmp_path):
    async def main():
        async with artcloud.LocalBackend(path=tmp_path / "local") as backend:
            model = artcloud.TrainableModel(name="agent", project="sdk", base_model=TINY, lora=artcloud.LoraConfig(rank=4))
            await model.register(backend)
            assert "token" not in repr(backend).lower() and backend._token not in repr(backend)
            client = model.openai_client()
            groups = await artcloud.gather_trajectory_groups(groups_for(client, model, ["one", "two"]), progress=False)
            assert [len(g.trajectories) for g in groups] == [4, 4]
            result = await model.train(groups, config=artcloud.TrainConfig(learning_rate=1e-3), progress=False)
            assert result.step == 1 and result.trained and model.inference_name() == "agent@1"
            assert await model.get_step() == 1
            assert [e["type"] for e in result.events][-1] == "end"
            served = await client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "x"}], max_tokens=2)
            assert served.model == "agent@1"
            pid = backend._proc.pid
        return pid

    pid = asyncio.run(main())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_backend_goes_on_in_a_second_event_loop(tmp_path):
    """A script that calls asyncio.run() twice (register, then train), or a notebook without top-level await: the
    second loop's calls work, and the heartbeats, whose task ended with the first loop, beat again in the second (code
    review 3, F10: `Event loop is closed`, and a lease that could expire under a live client)."""
    backend = artcloud.LocalBackend(path=tmp_path / "local", lease="2m", heartbeat_every_s=0.1)
    beats: list[asyncio.AbstractEventLoop] = []
    heartbeat = backend.client.heartbeat

    async def counted() -> None:
        beats.append(asyncio.get_running_loop())
        await heartbeat()

    backend.client.heartbeat = counted

    async def until_a_beat() -> None:
        loop, deadline = asyncio.get_running_loop(), time.monotonic() + 60
        while loop not in beats:
            assert time.monotonic() < deadline, "no heartbeat from this event loop in 60 s"
            await asyncio.sleep(0.05)

    async def first():
        model, _, groups = await model_with_groups(backend, "agent", 1)
        await until_a_beat()
        return model, groups

    async def second(model, groups) -> int:
        assert await model.get_step() == 0  # the first call from this loop
        await until_a_beat()
        await model.train(groups, progress=False)
        return await model.get_step()

    try:
        model, groups = asyncio.run(first())
        assert asyncio.run(second(model, groups)) == 1
        assert len(set(map(id, beats))) == 2
    finally:
        asyncio.run(backend.down())


def test_annealer_sets_the_default_temperature_and_explicit_wins(tmp_path):
    async def main():
        async with artcloud.LocalBackend(path=tmp_path / "local") as backend:
            model = artcloud.TrainableModel(name="cool", project="sdk", base_model=TINY)
            model.set_temperature_annealer(artcloud.LinearTemperatureAnnealer(start=0.0, end=1.0, steps=2))
            await model.register(backend)
            assert (await backend.model_info("cool")).temperature == 0.0
            client = model.openai_client()
            msgs = [{"role": "user", "content": "same?"}]
            greedy = [(await client.chat.completions.create(model="cool", messages=msgs, max_tokens=10)).choices[0].message.content for _ in range(2)]
            assert greedy[0] == greedy[1]  # temperature 0 by default now
            hot = {(await client.chat.completions.create(model="cool", messages=msgs, max_tokens=10, temperature=2.0, seed=s)).choices[0].message.content for s in range(3)}
            assert hot != {greedy[0]}  # an explicit temperature wins
            groups = await artcloud.gather_trajectory_groups(groups_for(client, model, ["a"], n=3), progress=False)
            groups[0].trajectories[0].reward += 1.0  # never all equal
            await model.train(groups, progress=False)
            assert (await backend.model_info("cool")).temperature == pytest.approx(0.5)

    asyncio.run(main())


def test_bad_calls_say_what_to_do(tmp_path):
    model = artcloud.TrainableModel(name="m", project="sdk", base_model=TINY)
    with pytest.raises(RuntimeError, match="register"):
        asyncio.run(model.train([]))

    async def main():
        async with artcloud.LocalBackend(path=tmp_path / "local") as backend:
            await model.register(backend)
            client = model.openai_client()
            with pytest.raises(ValueError, match="no trajectory groups"):
                await model.train([])
            one = await artcloud.TrajectoryGroup([rollout(client, model, "x")]).resolve()
            with pytest.raises(ValueError, match="at least 2"):
                await model.train([one])
            msgs = [{"role": "user", "content": "x"}]
            plain = await client.chat.completions.create(model="m", messages=msgs, max_tokens=3, logprobs=False)
            no_lp = artcloud.TrajectoryGroup(trajectories=[artcloud.Trajectory(messages_and_choices=[*msgs, plain.choices[0]], reward=r) for r in (0, 1)])
            with pytest.raises(ValueError, match="without logprobs .sampled with logprobs=False"):
                await model.train([no_lp])
            assert await model.get_step() == 0

    asyncio.run(main())


def test_version_mismatch_names_both_versions(tmp_path, monkeypatch):
    async def main():
        async with artcloud.LocalBackend(path=tmp_path / "local") as backend:
            monkeypatch.setattr("artcloud.backends.client.__version__", "0.0.1")
            with pytest.raises(VersionMismatch, match=rf"{artcloud.__version__}.*0\.0\.1"):
                await backend.health()

    asyncio.run(main())


def test_remote_backend_refuses_plain_http():
    with pytest.raises(ValueError, match="HTTPS only"):
        RemoteBackend("http://localhost:1234", token="t" * 20, ca_cert="x")


def test_port_in_use_is_one_clear_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        async def main():
            backend = artcloud.LocalBackend(path=tmp_path / "local", port=port)
            with pytest.raises(ArtcloudError, match="already in use"):
                await backend.start()
            assert not backend.running

        asyncio.run(main())


def test_cut_connection_during_training_loses_no_event_and_trains_once(tmp_path):
    async def main():
        async with artcloud.LocalBackend(path=tmp_path / "local") as local:
            model, _, groups = await model_with_groups(local, "flaky", prompts=6)
            port = urlparse(local.base_url).port
            proxy = TCPProxy("127.0.0.1", port)
            remote = RemoteBackend(f"https://localhost:{proxy.port}", token=local._token, ca_cert=local.ca_cert)
            await remote.start()
            via_proxy = artcloud.TrainableModel(name="flaky", project="sdk", base_model=TINY)
            await via_proxy.register(remote)

            seen = []
            original = remote.follow_job

            async def follow_and_cut(job_id, on_event=None, **kw):
                def cut_after_first(event):
                    seen.append(event.seq)
                    if event.seq == 1:
                        proxy.cut()  # the stream (and every pooled connection) dies mid-job
                    if on_event:
                        on_event(event)
                return await original(job_id, cut_after_first, **kw)

            remote.follow_job = follow_and_cut
            result = await via_proxy.train(groups, config=artcloud.TrainConfig(gradient_steps=3), progress=False)
            await remote.close()
            assert proxy.cuts == 1
            assert seen == list(range(1, len(result.events) + 1))  # every event once, in order
            assert [e["type"] for e in result.events] == ["queued", "start", "step", "step", "step", "end"]
            assert result.step == 1 and await model.get_step() == 1  # trained exactly once

    asyncio.run(main())


def test_killing_the_client_leaves_no_server(tmp_path):
    script = textwrap.dedent(f"""
        import asyncio, artcloud
        async def main():
            backend = artcloud.LocalBackend(path={str(tmp_path / 'local')!r})
            await backend.start()
            print(backend._proc.pid, flush=True)
            await asyncio.sleep(600)
        asyncio.run(main())
    """)
    client = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    server_pid = int(client.stdout.readline())
    os.kill(server_pid, 0)  # it runs
    client.send_signal(signal.SIGKILL)  # no atexit, no finally: the hardest way to die
    client.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            return
        try:  # reap it if it became our zombie
            os.waitpid(server_pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.2)
    os.kill(server_pid, signal.SIGKILL)
    pytest.fail("the server outlived its client")


def test_server_dying_mid_training_is_a_clear_error(tmp_path):
    async def main():
        async with artcloud.LocalBackend(path=tmp_path / "local") as backend:
            model, _, groups = await model_with_groups(backend, "doomed", prompts=8)
            original = backend.follow_job

            async def follow_and_kill(job_id, on_event=None, **kw):
                def kill_on_start(event):
                    if event.type == "start":
                        backend._proc.kill()  # the server dies mid-job
                return await original(job_id, kill_on_start, **kw)

            backend.follow_job = follow_and_kill
            t0 = time.monotonic()
            with pytest.raises(artcloud.ServerGone, match="exited"):
                await model.train(groups, config=artcloud.TrainConfig(gradient_steps=4), progress=False)
            assert time.monotonic() - t0 < 60  # told at once, not after minutes of retries
        # A new server on the same path resumes at the last committed step (the interrupted one never was).
        async with artcloud.LocalBackend(path=tmp_path / "local") as backend:
            await model.register(backend)
            assert model.step == 0

    asyncio.run(main())


def test_the_demo_loop_at_a_small_scale(tmp_path):
    out = tmp_path / "curve.png"
    run = subprocess.run(
        [sys.executable, "examples/five_words.py", "--model", TINY, "--steps", "3", "--prompts", "2", "--group", "3",
         "--max-tokens", "6", "--out", str(out), "--path", str(tmp_path / "srv")],
        capture_output=True, text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stdout.count("mean reward") >= 3 and "the server is stopped" in run.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _terminal_like_sigint() -> None:
    """The child gets SIGINT as a shell's child would: unblocked and at its default. A test worker's own
    state (a library that blocked or ignored SIGINT around a spawn of its own) is inherited otherwise."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_during_training_stops_the_server(tmp_path):
    script = textwrap.dedent(f"""
        import asyncio, artcloud
        async def rollout(client, model, prompt):
            msgs = [{{"role": "user", "content": prompt}}]
            r = await client.chat.completions.create(model=model.name, messages=msgs, max_tokens=24, logprobs=True)
            return artcloud.Trajectory(messages_and_choices=[*msgs, r.choices[0]], reward=len(r.choices[0].message.content))
        async def main():
            async with artcloud.LocalBackend(path={str(tmp_path / 'local')!r}) as backend:
                model = artcloud.TrainableModel(name="m", project="sdk", base_model={TINY!r})
                await model.register(backend)
                client = model.openai_client()
                groups = await artcloud.gather_trajectory_groups(
                    [artcloud.TrajectoryGroup(rollout(client, model, f"p{{i}}") for _ in range(4)) for i in range(16)], progress=False)
                print(backend._proc.pid, flush=True)
                for _ in range(50):  # far longer than the test waits: Ctrl-C lands mid-training
                    await model.train(groups * 8, config=artcloud.TrainConfig(gradient_steps=64), progress=False,
                                      verbose=True)  # each event on stderr: the test waits for "start"
        asyncio.run(main())
    """)
    client = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=_terminal_like_sigint)
    server_pid = int(client.stdout.readline())
    seen = []
    while not any("train m start" in line for line in seen):  # the server says the step has started
        line = client.stderr.readline()
        assert line, "the client ended before training started:\n" + "".join(seen)
        seen.append(line)
    client.send_signal(signal.SIGINT)
    try:
        _, err = client.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        masks = [line for line in Path(f"/proc/{client.pid}/status").read_text().splitlines() if line.startswith("Sig")]
        client.kill()
        os.kill(server_pid, signal.SIGKILL)
        raise AssertionError(f"the client went on for 60 s after Ctrl-C; its signal masks: {masks}") from None
    assert client.returncode != 0 and "KeyboardInterrupt" in err
    with pytest.raises(ProcessLookupError):
        os.kill(server_pid, 0)
