"""Run many rollouts at once and collect them into trajectory groups, with a progress bar."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Awaitable, Callable, Iterable

from artcloud.errors import ArtcloudError, WrongType
from artcloud.types import Trajectory, TrajectoryGroup

AfterEach = Callable[[TrajectoryGroup], "TrajectoryGroup | None | Awaitable[TrajectoryGroup | None]"]


class GatherError(ArtcloudError):
    """More rollouts failed than `max_exceptions` allows; `.exceptions` holds them all."""

    code = "gather_failed"

    def __init__(self, message: str, exceptions: list[BaseException]):
        super().__init__(message)
        self.exceptions = exceptions


def _completion_tokens(traj: Trajectory) -> int:
    total = 0
    for item in traj.messages_and_choices:
        ids = item.get("token_ids") if isinstance(item, dict) else (getattr(item, "model_extra", None) or {}).get("token_ids")
        total += len(ids or [])
    return total


async def gather_trajectory_groups(
    groups: Iterable[TrajectoryGroup],
    *,
    max_exceptions: int | float = 0,
    after_each: AfterEach | None = None,
    progress: bool = True,
    description: str = "rollouts",
) -> list[TrajectoryGroup]:
    """Run every group's pending rollouts concurrently and return the groups, in order.

    A rollout that raises is left out of its group; a group left with fewer than 2 trajectories is
    dropped (GRPO needs something to compare). More failures than `max_exceptions` (a count, or a
    fraction of all rollouts when < 1) raise GatherError. `after_each(group)` runs on each finished
    group (e.g. to score it with a judge) and may return a replacement, or None to drop it.
    Whatever ends the call early (GatherError, an error in `after_each`, a cancellation) first cancels
    every rollout still running and waits for it to end: none goes on calling the server unobserved.
    """
    groups = list(groups)
    total = sum(g.pending + len(g.trajectories) for g in groups)
    limit = max_exceptions * total if isinstance(max_exceptions, float) and max_exceptions < 1 else max_exceptions
    errors: list[BaseException] = []
    state = {"done": 0, "tokens": 0, "reward": 0.0}

    bar = _Bar(description, total, enabled=progress)

    async def one(rollout: "asyncio.Future[Trajectory]") -> Trajectory | None:
        try:
            traj = await rollout
        except Exception as e:  # collected, counted against max_exceptions
            errors.append(e)
            bar.advance(state, errors)
            if len(errors) > limit:
                raise
            return None
        if not isinstance(traj, Trajectory):
            raise WrongType(f"a rollout returned {type(traj).__name__}, not an artcloud.Trajectory")
        state["done"] += 1
        state["tokens"] += _completion_tokens(traj)
        state["reward"] += traj.reward
        bar.advance(state, errors)
        return traj

    async def run_group(group: TrajectoryGroup, rollouts: list[asyncio.Future]) -> TrajectoryGroup | None:
        results = await asyncio.gather(*(one(r) for r in rollouts))
        group.trajectories.extend(t for t in results if t is not None)
        if len(group.trajectories) < 2:
            return None
        if after_each is not None:
            out = after_each(group)
            group = await out if inspect.isawaitable(out) else out
        return group

    # Every rollout is a task of its own, started here, so that whatever ends this call early can cancel
    # the ones still running: otherwise they would go on calling the server, unobserved.
    tasks: list[asyncio.Future] = []
    group_tasks = []
    for group in groups:
        pending, group._pending = group._pending, []
        rollouts = [asyncio.ensure_future(p) for p in pending]
        tasks += rollouts
        group_tasks.append(asyncio.ensure_future(run_group(group, rollouts)))
    tasks += group_tasks

    with bar:
        try:
            finished = await asyncio.gather(*group_tasks)
        except BaseException as e:  # a failure, an after_each error, or our own cancellation
            await _cancel_and_wait(tasks)
            if isinstance(e, Exception) and len(errors) > limit:
                raise GatherError(
                    f"{len(errors)} of {total} rollouts failed (max_exceptions={max_exceptions}); the first: "
                    f"{type(errors[0]).__name__}: {errors[0]}", errors) from e
            raise
    return [g for g in finished if g is not None]


async def _cancel_and_wait(tasks: list[asyncio.Future]) -> None:
    """Cancel every task and wait until each has ended (Python 3.10 has no TaskGroup to do it)."""
    for task in tasks:
        task.cancel()
    pending = {t for t in tasks if not t.done()}
    cancelled_again = False
    while pending:
        try:
            _, pending = await asyncio.wait(pending)
        except asyncio.CancelledError:  # cancelled while cleaning up: finish the clean-up first
            cancelled_again = True
    for task in tasks:
        if not task.cancelled():
            task.exception()  # retrieved: no "exception was never retrieved" warnings for the siblings
    if cancelled_again:
        raise asyncio.CancelledError


class _Bar:
    def __init__(self, description: str, total: int, enabled: bool):
        self.description, self.total, self.enabled = description, total, enabled
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> "_Bar":
        if self.enabled and self.total:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[status]}"), TimeElapsedColumn(), transient=True)
            self._progress.start()
            self._task = self._progress.add_task(self.description, total=self.total, status="")
        return self

    def advance(self, state: dict[str, Any], errors: list[BaseException]) -> None:
        if self._progress is None:
            return
        done = state["done"]
        status = f"{state['tokens']} tokens, reward {state['reward'] / done:.3f}" if done else ""
        if errors:
            status += f", {len(errors)} failed"
        self._progress.update(self._task, completed=done + len(errors), status=status)

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.stop()
