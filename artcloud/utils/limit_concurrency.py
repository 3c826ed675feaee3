"""OpenPipe ART's `art.utils.limit_concurrency`: at most n calls of an async function at once."""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

from artcloud.errors import InvalidArgument


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
