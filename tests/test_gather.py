"""gather_trajectory_groups and TrajectoryGroup on plain coroutines (no server needed)."""

from __future__ import annotations

import asyncio

import pytest

import artcloud
from artcloud.gather import GatherError


def choice(text: str, ids: list[int]) -> dict:
    return {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}, "token_ids": ids,
            "logprobs": {"content": [{"token": "x", "logprob": -1.0}] * len(ids)}}


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
