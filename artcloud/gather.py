"""Run many rollouts at once and collect them into trajectory groups, with a progress bar.

OpenPipe ART's forms work too: groups given as awaitables (`make_group(scenario)` coroutines), `await
TrajectoryGroup(rollouts)` inside them, `pbar_desc`, `max_metrics`, an `after_each` that returns a list of
groups, and `gather_trajectories`. One thing differs on purpose: whatever ends a gather early cancels
every rollout still running and waits for it to end, so none goes on calling the server unobserved.
"""

from __future__ import annotations

import asyncio
import inspect
import warnings
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Sequence

from artcloud.errors import ArtcloudError, InvalidArgument, WrongType
from artcloud.types import Trajectory, TrajectoryGroup, cancel_and_wait, check_trajectory, current_tally, resolve_group

AfterEach = Callable[[TrajectoryGroup], "TrajectoryGroup | list[TrajectoryGroup] | None | Awaitable[Any]"]


class GatherError(ArtcloudError):
    """More rollouts failed than `max_exceptions` allows; `.exceptions` holds them all."""

    code = "gather_failed"

    def __init__(self, message: str, exceptions: list[BaseException]):
        super().__init__(message)
        self.exceptions = exceptions


def _completion_tokens(traj: Trajectory) -> int:
    total = 0
    for items in (traj.messages_and_choices, *(h.messages_and_choices for h in traj.additional_histories)):
        for item in items:
            fields = item if isinstance(item, dict) else getattr(item, "model_extra", None) or {}
            total += len(fields.get("token_ids") or [])
    return total


class _Tally:
    """One gather's counts (a types.Tally: rollouts started inside it, `await group` within a group coroutine
    too, find it through types.current_tally and report here), shown on a rich progress bar: rollouts done
    of all, the mean reward and metrics, failures, tokens."""

    def __init__(self, description: str, enabled: bool, max_metrics: int | None, max_exceptions: int | float):
        self.description, self.enabled, self.max_metrics = description, enabled, max_metrics
        self.max_exceptions = max_exceptions
        self.total = self.done = self.tokens = 0
        self.errors: list[BaseException] = []
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.status = ""
        self._seen: set[int] = set()
        self._progress: Any = None
        self._task: Any = None

    def over_limit(self) -> bool:
        limit = self.max_exceptions
        if isinstance(limit, float) and limit < 1:
            limit *= self.total
        return len(self.errors) > limit

    def expect(self, n: int) -> None:
        self.total += n
        self.show()

    def seen(self, traj: Trajectory) -> bool:
        return id(traj) in self._seen

    def record(self, traj: Trajectory) -> None:
        if self.seen(traj):
            return
        self._seen.add(id(traj))
        self.done += 1
        self.tokens += _completion_tokens(traj)
        for key, value in {"reward": traj.reward, **traj.metrics}.items():
            self.sums[key] = self.sums.get(key, 0.0) + float(value)
            self.counts[key] = self.counts.get(key, 0) + 1
        self.show()

    def failed(self, e: BaseException) -> bool:
        """Counts a failed rollout; True when that is one too many (the caller raises)."""
        self.errors.append(e)
        self.show()
        return self.over_limit()

    def __enter__(self) -> "_Tally":
        if self.enabled and self.total:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[status]}"), TimeElapsedColumn(), transient=True)
            self._progress.start()
            self._task = self._progress.add_task(self.description, total=self.total, status=self.status)
        return self

    def show(self) -> None:
        means = [(k, self.sums[k] / self.counts[k]) for k in self.sums]
        parts = [f"{k} {v:.3g}" for k, v in means[: self.max_metrics]]
        if self.errors:
            parts.append(f"exceptions {len(self.errors)}")
        if self.tokens:
            parts.append(f"{self.tokens} tokens")
        self.status = ", ".join(parts)
        if self._progress is not None:
            self._progress.update(self._task, completed=self.done + len(self.errors), total=self.total,
                                  status=self.status)

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.stop()


class _BatchFailures:
    """The types.Tally that the rollouts of trajectory_group_batches' groups report to: only their failures count,
    with the groups' own, against the batch's limit."""

    def __init__(self, limit: int | float):
        self.limit = limit
        self.errors: list[BaseException] = []

    def expect(self, n: int) -> None:
        pass

    def record(self, traj: Trajectory) -> None:
        pass

    def failed(self, e: BaseException) -> bool:
        self.errors.append(e)
        return self.over_limit()

    def over_limit(self) -> bool:
        return len(self.errors) > self.limit


async def gather_trajectory_groups(
    groups: Iterable[TrajectoryGroup | Awaitable[TrajectoryGroup]],
    *,
    max_exceptions: int | float = 0,
    after_each: AfterEach | None = None,
    progress: bool = True,
    description: str = "rollouts",
    pbar_desc: str | None = None,
    max_metrics: int | None = None,
    pbar_total_completion_tokens: bool = False,
) -> list[TrajectoryGroup]:
    """Run every group's pending rollouts concurrently and return the groups, in order.

    `groups` holds TrajectoryGroups (built from rollout coroutines) or awaitables that return one (ART's
    style). A rollout that raises is left out of its group (and kept in its `exceptions`); a group left with
    fewer than 2 trajectories is dropped (GRPO needs something to compare); a group awaitable that raises
    drops its group. More failures than `max_exceptions` (a count, or a fraction of all rollouts when < 1)
    raise GatherError. `after_each(group)` runs on each finished group (e.g. to score it with a judge) and
    may return it, a replacement, a list of groups, or None to drop it.
    The bar shows the mean reward and metrics (the first `max_metrics` of them), failures and tokens.
    `pbar_desc` is ART's name for `description`. Whatever ends the call early (GatherError, an error in
    `after_each`, a cancellation) first cancels every rollout still running and waits for it to end.
    """
    if pbar_total_completion_tokens:
        warnings.warn("pbar_total_completion_tokens is deprecated in ART and does nothing in artcloud: the bar "
                      "always shows the completion tokens", DeprecationWarning, stacklevel=2)
    items = list(groups)
    state = _Tally(pbar_desc if pbar_desc is not None else description, progress, max_metrics, max_exceptions)

    async def finish(group: TrajectoryGroup) -> list[TrajectoryGroup]:
        if len(group.trajectories) < 2:
            return []
        if after_each is None:
            return [group]
        out = after_each(group)
        if not isinstance(out, (TrajectoryGroup, list)) and inspect.isawaitable(out):
            out = await out
        if out is None:
            return []
        out = out if isinstance(out, list) else [out]
        for g in out:
            if not isinstance(g, TrajectoryGroup):
                raise WrongType(f"after_each returned {type(g).__name__}: return a TrajectoryGroup, a list of them, "
                                "or None")
        return out

    async def from_group(group: TrajectoryGroup) -> list[TrajectoryGroup]:
        await resolve_group(group, counted=True)
        return await finish(group)

    async def from_awaitable(awaitable: Awaitable[TrajectoryGroup]) -> list[TrajectoryGroup]:
        try:
            group = await awaitable
        except Exception as e:  # as ART: the group is lost, and counts as one failure
            if state.over_limit() or state.failed(e):
                raise
            state.expect(-1)
            return []
        if not isinstance(group, TrajectoryGroup):
            raise WrongType(f"a group awaitable returned {type(group).__name__}, not an artcloud.TrajectoryGroup")
        # Its placeholder becomes its trajectories, less those an `await group` inside it has counted.
        unseen = [t for t in group.trajectories if not state.seen(t)]
        state.expect(len(unseen) - 1)
        for traj in unseen:
            state.record(traj)
        return await finish(group)

    for item in items:
        if not isinstance(item, TrajectoryGroup) and not inspect.isawaitable(item):
            raise WrongType(f"gather_trajectory_groups got a {type(item).__name__}: pass TrajectoryGroups, or "
                            "awaitables that return one")
    token = current_tally.set(state)
    try:
        # Every group (and, in resolve_group, every rollout) is a task of its own, started here, so that
        # whatever ends this call early can cancel the ones still running.
        tasks: list[asyncio.Future] = []
        for item in items:
            if isinstance(item, TrajectoryGroup):
                state.total += item.pending + len(item.trajectories)
                for traj in item.trajectories:
                    state.record(traj)
                tasks.append(asyncio.ensure_future(from_group(item)))
            else:
                state.total += 1  # how many trajectories it holds is known when it is done
                tasks.append(asyncio.ensure_future(from_awaitable(item)))
    finally:
        current_tally.reset(token)

    finished = await _settle(state, tasks, asyncio.gather(*tasks))
    return [g for out in finished for g in out]


async def gather_trajectories(
    trajectories: Iterable[Awaitable[Trajectory] | Awaitable[Iterable[Trajectory]]],
    *,
    max_exceptions: int | float = 0,
    progress: bool = True,
    description: str = "rollouts",
    pbar_desc: str | None = None,
    pbar_total_completion_tokens: bool = False,
) -> Sequence[Trajectory | list[Trajectory] | BaseException]:
    """ART's `gather_trajectories`: await rollouts that are not grouped (e.g. for evaluation), in order.

    Each item gives a Trajectory or a list of them; a failed one gives its exception in its place, up to
    `max_exceptions`; past it, GatherError (after cancelling and awaiting the rest, as gathering groups does).
    """
    if pbar_total_completion_tokens:
        warnings.warn("pbar_total_completion_tokens is deprecated in ART and does nothing in artcloud",
                      DeprecationWarning, stacklevel=2)
    if isinstance(trajectories, TrajectoryGroup):
        raise InvalidArgument("gather_trajectories takes rollouts, not a TrajectoryGroup: use gather_trajectory_groups")
    items = list(trajectories)
    state = _Tally(pbar_desc if pbar_desc is not None else description, progress, None, max_exceptions)
    state.total = len(items)

    async def one(task: asyncio.Future) -> Trajectory | list[Trajectory] | BaseException:
        try:
            result = await task
        except Exception as e:
            if state.failed(e):
                raise
            return e
        out = check_trajectory(result) if isinstance(result, Trajectory) else [check_trajectory(t) for t in result]
        for traj in [out] if isinstance(out, Trajectory) else out:
            state.record(traj)
        return out

    token = current_tally.set(state)
    try:
        tasks = [asyncio.ensure_future(t) for t in items]
    finally:
        current_tally.reset(token)
    return await _settle(state, tasks, asyncio.gather(*(one(t) for t in tasks)))


async def _settle(state: _Tally, tasks: list[asyncio.Future], everything: Awaitable[list[Any]]) -> list[Any]:
    """Await `everything` (what gathers `tasks`) under the bar. Whatever ends it early (a failure too many, an
    after_each error, our own cancellation) first cancels every task and waits for it to end."""
    with state:
        try:
            return await everything
        except BaseException as e:
            await cancel_and_wait(tasks)
            if isinstance(e, Exception) and state.over_limit():
                errors = state.errors
                raise GatherError(f"{len(errors)} of {state.total} rollouts failed (max_exceptions="
                                  f"{state.max_exceptions}); the first: {type(errors[0]).__name__}: {errors[0]}",
                                  errors) from e
            raise


async def trajectory_group_batches(
    groups: Iterable[TrajectoryGroup | Awaitable[TrajectoryGroup]],
    *,
    batch_size: int,
    max_batch_exceptions: int | float = 0,
    max_concurrent_batches: int = 4,
    skip_batches: int = 0,
    pbar_desc: str | None = "batches",
    pbar_total_completion_tokens: bool = False,
    progress: bool = True,
) -> AsyncIterator[list[TrajectoryGroup]]:
    """OpenPipe ART's `trajectory_group_batches`: batches of `batch_size` finished groups, in the order they
    finish, while up to `batch_size * max_concurrent_batches` groups run at once (the next batch's rollouts run
    while the caller trains on this one). The first `skip_batches * batch_size` groups are never run (resuming).
    A rollout that raises is left out of its group (kept in its `exceptions`), and a group that raises is left
    out of the batch; each counts against `max_batch_exceptions` of the batch (a count, or a fraction of
    `batch_size` when < 1), as in ART; one too many raises GatherError. A group left with fewer than 2
    trajectories is left out with a warning (GRPO compares 2 or more; train() refuses it). The last batch may be
    smaller. Leaving the loop early, or an error, cancels every group still running and waits for it to end.

        async for batch in art.trajectory_group_batches(make_group(s) for s in scenarios), batch_size=4):
            await backend.train(model, batch)
    """
    if batch_size < 1 or max_concurrent_batches < 1 or skip_batches < 0:
        raise InvalidArgument("trajectory_group_batches needs batch_size >= 1, max_concurrent_batches >= 1 and "
                              "skip_batches >= 0")
    if pbar_total_completion_tokens:
        warnings.warn("pbar_total_completion_tokens is deprecated in ART and does nothing in artcloud",
                      DeprecationWarning, stacklevel=2)
    everything = list(groups)
    unstarted = everything[batch_size * skip_batches:]
    for skipped in everything[:batch_size * skip_batches]:
        if inspect.iscoroutine(skipped):
            skipped.close()  # never run: closed, not left to warn "never awaited"
    for item in unstarted:
        if not isinstance(item, TrajectoryGroup) and not inspect.isawaitable(item):
            raise WrongType(f"trajectory_group_batches got a {type(item).__name__}: pass TrajectoryGroups, or "
                            "awaitables that return one")
    limit = max_batch_exceptions * batch_size if isinstance(max_batch_exceptions, float) and max_batch_exceptions < 1 \
        else max_batch_exceptions

    async def one(item: TrajectoryGroup | Awaitable[TrajectoryGroup]) -> TrajectoryGroup:
        group = await (resolve_group(item) if isinstance(item, TrajectoryGroup) else item)
        if not isinstance(group, TrajectoryGroup):
            raise WrongType(f"a group awaitable returned {type(group).__name__}, not an artcloud.TrajectoryGroup")
        return group

    pending: set[asyncio.Future] = set()
    batch: list[TrajectoryGroup] = []
    failures = _BatchFailures(limit)  # the rollouts' (resolve_group reports to it) and the groups'
    bar = _Tally(pbar_desc or "batches", progress, None, max_batch_exceptions)
    try:
        while unstarted or pending:
            token = current_tally.set(failures)  # each task copies the context it starts in
            try:
                while unstarted and len(pending) < batch_size * max_concurrent_batches:
                    pending.add(asyncio.ensure_future(one(unstarted.pop(0))))
            finally:
                current_tally.reset(token)
            with bar:
                bar.total = batch_size
                bar.show()
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:  # every exception retrieved, before any is raised
                error = task.exception()
                if error is not None:
                    if not any(error is e for e in failures.errors):  # a rollout's, counted already
                        failures.errors.append(error)
                elif len(task.result().trajectories) >= 2:  # as gather: GRPO needs two to compare
                    batch.append(task.result())
                else:
                    warnings.warn(f"trajectory_group_batches left out a group of {len(task.result().trajectories)} "
                                  "trajectories: GRPO compares 2 or more of the same prompt", stacklevel=2)
            errors = failures.errors
            if failures.over_limit():
                raise GatherError(f"{len(errors)} of a batch's groups and rollouts failed (max_batch_exceptions="
                                  f"{max_batch_exceptions}); the first: {type(errors[0]).__name__}: {errors[0]}",
                                  errors) from errors[0]
            bar.done = len(batch)
            if len(batch) >= batch_size:
                out, batch, failures.errors = batch[:batch_size], batch[batch_size:], []
                yield out
        if batch:
            yield batch
    finally:
        await cancel_and_wait(list(pending))
