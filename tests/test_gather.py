"""gather_trajectory_groups and TrajectoryGroup on plain coroutines (no server needed)."""

from __future__ import annotations

import asyncio
import inspect

import pytest

import artcloud
from artcloud.gather import GatherError


def choice(text: str, ids: list[int]) -> dict:
    """A choice as the server returns it: the sampled ids and their logprobs, the hash of the prompt it was
    sampled from (here of prompt ids [1, 2]) and the temperature it was sampled at."""
    return {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}, "token_ids": ids,
            "logprobs": {"content": [{"token": "x", "logprob": -1.0}] * len(ids)},
            "prompt_sha256": "34fb5c825de7ca4aea6e712f19d439c1da0c92c37b423936c5f618545ca4fa1f", "temperature": 1.0}


async def ok(reward: float, delay: float = 0.0) -> artcloud.Trajectory:
    await asyncio.sleep(delay)
    return artcloud.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, choice("a", [1, 2, 3])], reward=reward)


async def boom() -> artcloud.Trajectory:
    raise RuntimeError("rollout failed")


def test_groups_resolve_concurrently_in_order():
    running = {"now": 0, "max": 0}

    async def counted(reward: float) -> artcloud.Trajectory:
        running["now"] += 1
        running["max"] = max(running["max"], running["now"])
        try:
            return await ok(reward, delay=0.05)
        finally:
            running["now"] -= 1

    groups = [artcloud.TrajectoryGroup(counted(r) for r in (0.0, 1.0)) for _ in range(5)]
    assert all(g.pending == 2 for g in groups)
    out = asyncio.run(artcloud.gather_trajectory_groups(groups, progress=False))
    assert running["max"] == 10  # every rollout was in flight at once
    assert [[t.reward for t in g.trajectories] for g in out] == [[0.0, 1.0]] * 5


def test_failures_up_to_the_limit_are_left_out():
    groups = [artcloud.TrajectoryGroup([ok(0.0), ok(1.0), boom()]), artcloud.TrajectoryGroup([ok(0.5), boom()])]
    out = asyncio.run(artcloud.gather_trajectory_groups(groups, max_exceptions=2, progress=False))
    # The first group keeps its two good rollouts; the second, left with one, is dropped (nothing to compare).
    assert len(out) == 1 and [t.reward for t in out[0].trajectories] == [0.0, 1.0]


def test_too_many_failures_raise_with_the_first_error():
    groups = [artcloud.TrajectoryGroup([ok(0.0), boom(), boom()])]
    with pytest.raises(GatherError, match="2 of 3 rollouts failed.*rollout failed") as info:
        asyncio.run(artcloud.gather_trajectory_groups(groups, max_exceptions=1, progress=False))
    assert len(info.value.exceptions) == 2


def test_fractional_limit_and_after_each():
    groups = [artcloud.TrajectoryGroup([ok(0.0), ok(1.0), ok(0.5), boom()]) for _ in range(2)]

    async def rescore(group):
        for t in group.trajectories:
            t.metrics["independent_reward"] = t.reward
            t.reward = 1.0 - t.reward
        return group

    out = asyncio.run(artcloud.gather_trajectory_groups(groups, max_exceptions=0.25, after_each=rescore, progress=False))
    assert [t.reward for t in out[0].trajectories] == [1.0, 0.0, 0.5]
    assert out[1].trajectories[0].metrics["independent_reward"] == 0.0

    dropped = asyncio.run(artcloud.gather_trajectory_groups([artcloud.TrajectoryGroup([ok(0.0), ok(1.0)])],
                                                            after_each=lambda g: None, progress=False))
    assert dropped == []


def test_unresolved_group_cannot_be_sent():
    group = artcloud.TrajectoryGroup([ok(0.0)])
    with pytest.raises(RuntimeError, match="gather_trajectory_groups"):
        group.to_wire()
    asyncio.run(group.resolve())
    assert group.to_wire()["trajectories"][0]["reward"] == 0.0


def test_nan_reward_is_refused():
    with pytest.raises(ValueError, match="finite"):
        artcloud.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}], reward=float("nan"))


# ----------------------------------------------------------------------------------------- early ends (issue 14, point 12)


class Watched:
    """Rollouts that sleep, then record that they finished; a cancelled one records that it saw CancelledError."""

    def __init__(self) -> None:
        self.finished: list[int] = []
        self.cancelled: list[int] = []

    async def slow(self, i: int, delay: float = 0.3) -> artcloud.Trajectory:
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            self.cancelled.append(i)
            raise
        self.finished.append(i)
        return await ok(float(i))


async def fails_soon() -> artcloud.Trajectory:
    await asyncio.sleep(0.05)
    raise RuntimeError("rollout failed")


def test_gather_error_cancels_and_awaits_every_other_rollout():
    watched = Watched()

    async def main():
        groups = [artcloud.TrajectoryGroup([watched.slow(0), watched.slow(1), fails_soon()]),
                  artcloud.TrajectoryGroup([watched.slow(2), watched.slow(3)])]
        with pytest.raises(GatherError, match="1 of 5 rollouts failed"):
            await artcloud.gather_trajectory_groups(groups, progress=False)
        # Already cancelled and ended when the error arrives, not merely asked to stop.
        assert sorted(watched.cancelled) == [0, 1, 2, 3]
        await asyncio.sleep(0.5)  # past their sleep: none of them finishes later
        assert watched.finished == []

    asyncio.run(main())


def test_an_after_each_error_cancels_the_other_groups_rollouts():
    watched = Watched()

    def judge(group):
        raise ValueError("the judge is down")

    async def main():
        groups = [artcloud.TrajectoryGroup([ok(0.0), ok(1.0)]), artcloud.TrajectoryGroup([watched.slow(0), watched.slow(1)])]
        with pytest.raises(ValueError, match="the judge is down"):
            await artcloud.gather_trajectory_groups(groups, after_each=judge, progress=False)
        assert sorted(watched.cancelled) == [0, 1]
        await asyncio.sleep(0.5)
        assert watched.finished == []

    asyncio.run(main())


def test_a_timeout_around_gather_cancels_every_rollout():
    watched = Watched()

    async def main():
        groups = [artcloud.TrajectoryGroup([watched.slow(2 * g), watched.slow(2 * g + 1)]) for g in range(2)]
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(artcloud.gather_trajectory_groups(groups, progress=False), 0.1)
        assert sorted(watched.cancelled) == [0, 1, 2, 3]
        await asyncio.sleep(0.5)
        assert watched.finished == []

    asyncio.run(main())


def test_trajectory_group_batches_runs_ahead_and_yields_whole_batches_as_arts():
    """ART's trajectory_group_batches: batches of batch_size finished groups while up to batch_size x
    max_concurrent_batches run; skipped batches never run; a failed group counts against its batch's
    max_batch_exceptions; leaving early cancels the rest. The order of finishing is driven by events, not sleeps."""
    started: list[int] = []
    release = {i: asyncio.Event() for i in range(7)}

    async def make(i: int) -> artcloud.TrajectoryGroup:
        started.append(i)
        await release[i].wait()
        if i == 4:
            raise RuntimeError("group 4 failed")
        return artcloud.TrajectoryGroup([await ok(float(i)), await ok(float(i) + 0.5)], metadata={"i": i})

    async def main() -> list[list[int]]:
        batches = []
        coros = [make(i) for i in range(7)]
        it = artcloud.trajectory_group_batches(iter(coros), batch_size=2, max_concurrent_batches=2,
                                               skip_batches=1, max_batch_exceptions=1, progress=False)
        pending = asyncio.ensure_future(it.__anext__())
        await asyncio.sleep(0)
        for i in (6, 3, 2):  # finishing out of order
            release[i].set()
        batches.append([g.metadata["i"] for g in await pending])
        assert not {0, 1} & set(started) and len(started) >= 4  # the skipped batch's groups never ran; 4 ran at once
        # and are closed, not left to warn "never awaited" when collected
        assert [inspect.getcoroutinestate(c) for c in coros[:2]] == [inspect.CORO_CLOSED] * 2
        release[4].set()  # fails: one exception is allowed in a batch
        release[5].set()
        batches.append([g.metadata["i"] for g in await it.__anext__()])
        with pytest.raises(StopAsyncIteration):
            await it.__anext__()
        return batches

    batches = asyncio.run(main())
    assert batches[0] in ([3, 2], [2, 3], [6, 3], [3, 6], [6, 2], [2, 6]) and len(batches[1]) >= 1
    assert sorted(sum(batches, [])) == [2, 3, 5, 6]  # every group that did not fail, once

    async def too_many() -> None:
        async def bad() -> artcloud.TrajectoryGroup:
            raise RuntimeError("no")

        async for _ in artcloud.trajectory_group_batches([bad(), bad()], batch_size=2, progress=False):
            pass

    with pytest.raises(GatherError, match=r"^[12] of a batch's groups and rollouts failed \(max_batch_exceptions=0\)"):
        asyncio.run(too_many())  # ART's default: none may fail

    cancelled = []

    async def slow(i: int) -> artcloud.TrajectoryGroup:
        try:
            await asyncio.sleep(0 if i == 0 else 60)
            return artcloud.TrajectoryGroup([await ok(1.0), await ok(0.0)])
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    async def leave_early() -> None:
        it = artcloud.trajectory_group_batches([slow(i) for i in range(3)], batch_size=1, progress=False)
        async for _ in it:
            break
        await it.aclose()

    asyncio.run(leave_early())
    assert sorted(cancelled) == [1, 2]  # nothing goes on running once the caller is done


def test_a_failed_rollout_in_a_batch_leaves_its_group_the_others_and_counts_against_the_batch():
    """As ART's GatherContext in trajectory_group_batches: a rollout that raises inside a group (ART's
    `TrajectoryGroup(rollouts)` style, awaited in the group's coroutine) leaves the group its other trajectories
    and counts against max_batch_exceptions; past it, GatherError. A group left with one trajectory is left out
    with a warning."""
    async def rollout(i: int, fail: bool) -> artcloud.Trajectory:
        if fail:
            raise RuntimeError(f"rollout {i} failed")
        return await ok(float(i))

    async def group(g: int, failing: int) -> artcloud.TrajectoryGroup:
        return await artcloud.TrajectoryGroup(rollout(10 * g + i, i < failing) for i in range(3))

    async def batches(failing: list[int], allowed: int) -> list[list[int]]:
        out = []
        async for batch in artcloud.trajectory_group_batches([group(g, f) for g, f in enumerate(failing)],
                                                             batch_size=len(failing), max_batch_exceptions=allowed,
                                                             progress=False):
            out.append([len(g.trajectories) for g in batch])
            assert all(len(g.exceptions) == 3 - len(g.trajectories) for g in batch)
        return out

    (sizes,) = asyncio.run(batches([1, 0], allowed=1))
    assert sorted(sizes) == [2, 3]
    with pytest.raises(GatherError, match=r"^2 of a batch's groups and rollouts failed \(max_batch_exceptions=1\)"):
        asyncio.run(batches([1, 1], allowed=1))
    with pytest.raises(GatherError, match="rollout 0 failed"):
        asyncio.run(batches([1, 0], allowed=0))  # ART's default
    with pytest.warns(UserWarning, match="left out a group of 1 trajectories"):
        assert asyncio.run(batches([2, 0], allowed=2)) == [[3]]
