"""OpenPipe ART's `art.utils` helpers that training scripts use: `iterate_dataset`, `retry`,
`limit_concurrency`. Only ART's names live here; artcloud's own code goes in modules named for what they do.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import random
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, Sequence, TypeVar

from artcloud.errors import InvalidArgument

T = TypeVar("T")
log = logging.getLogger("artcloud")


@dataclass
class DatasetBatch(Generic[T]):
    """One step's items, with where it lies: `step` counts across epochs, `epoch_step` within one.

    Unpacks as ART's older tuple did: `for items, epoch, step, epoch_step in iterate_dataset(...)`."""

    items: list[T]
    step: int
    epoch: int
    epoch_step: int

    def __iter__(self) -> Iterator[Any]:
        return iter((self.items, self.epoch, self.step, self.epoch_step))


def iterate_dataset(dataset: Sequence[T], groups_per_step: int = 1, num_epochs: int = 1, initial_step: int = 0,
                    use_tqdm: bool = True) -> Iterator[DatasetBatch[T]]:
    """Batches of `groups_per_step` items over `num_epochs` epochs, each epoch shuffled the same way on every
    run (seeded with the epoch number, as ART does: ART's scripts resume on the same batches). Steps before
    `initial_step` are skipped, for resuming at `await model.get_step()`. The last batch of an epoch may be
    smaller. A tqdm bar counts the steps (tqdm, not rich: rich allows one live display at a time, and the
    gather and train bars run inside this loop)."""
    if groups_per_step < 1 or num_epochs < 0 or initial_step < 0:
        raise InvalidArgument("iterate_dataset needs groups_per_step >= 1, num_epochs >= 0 and initial_step >= 0")
    size = len(dataset)
    if size == 0:
        return
    steps_per_epoch = math.ceil(size / groups_per_step)
    from tqdm.auto import tqdm

    with tqdm(initial=initial_step, total=steps_per_epoch * num_epochs, desc="Iterating dataset", unit="batch",
              disable=not use_tqdm) as bar:
        for epoch in range(max(0, initial_step // steps_per_epoch), num_epochs):
            indices = list(range(size))
            random.Random(epoch).shuffle(indices)  # ART's order (random.seed(epoch)), global random untouched
            for epoch_step in range(steps_per_epoch):
                step = epoch * steps_per_epoch + epoch_step
                if step < initial_step:
                    continue
                chunk = indices[epoch_step * groups_per_step:(epoch_step + 1) * groups_per_step]
                yield DatasetBatch(items=[dataset[i] for i in chunk], step=step, epoch=epoch, epoch_step=epoch_step)
                bar.update(1)


def retry(
    max_attempts: int = 3,
    delay: float = 0.25,
    backoff_factor: float = 2.0,
    exceptions: tuple[type[BaseException], ...] = (Exception,),
    on_retry: Callable[[BaseException, int], None] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: call again on `exceptions`, up to `max_attempts` in all, sleeping `delay` seconds and
    `backoff_factor` times longer after each failure; the last failure is raised. Sync and async functions.
    `on_retry(exception, attempt)` runs before each retry (by default a warning is logged)."""
    if max_attempts < 1:
        raise InvalidArgument("retry needs max_attempts >= 1")

    def pause(func: Callable[..., Any], e: BaseException, attempt: int) -> float:
        """Reports a failed attempt; the seconds to sleep before the next."""
        if on_retry is not None:
            on_retry(e, attempt)
        else:
            log.warning("Retry %d/%d for %s after error: %s", attempt, max_attempts, func.__name__, e)
        return delay * backoff_factor ** (attempt - 1)

    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(func):
            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                import asyncio

                for attempt in range(1, max_attempts + 1):
                    try:
                        return await func(*args, **kwargs)
                    except exceptions as e:
                        if attempt == max_attempts:
                            raise
                        await asyncio.sleep(pause(func, e, attempt))

            return async_wrapper

        @functools.wraps(func)
        def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
            for attempt in range(1, max_attempts + 1):
                try:
                    return func(*args, **kwargs)
                except exceptions as e:
                    if attempt == max_attempts:
                        raise
                    time.sleep(pause(func, e, attempt))

        return sync_wrapper

    return decorator


def limit_concurrency(n: int, derive_key: Callable[..., str] | None = None,
                      ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator for async functions: at most `n` calls run at once (per `derive_key(*args, **kwargs)` when
    given, e.g. one limit per judge model)."""
    if n < 1:
        raise InvalidArgument("limit_concurrency needs n >= 1")
    import asyncio

    # One set of semaphores per event loop: a semaphore is bound to the loop it first waited in.
    per_loop: weakref.WeakKeyDictionary[Any, dict[str, asyncio.Semaphore]] = weakref.WeakKeyDictionary()

    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            key = derive_key(*args, **kwargs) if derive_key else "default"
            semaphores = per_loop.setdefault(asyncio.get_running_loop(), {})
            async with semaphores.setdefault(key, asyncio.Semaphore(n)):
                return await func(*args, **kwargs)

        return wrapper

    return decorator
