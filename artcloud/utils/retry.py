"""OpenPipe ART's `art.utils.retry`: call again on failure, with backoff (sync and async functions)."""

from __future__ import annotations

import functools
import inspect
import logging
import time
from typing import Any, Callable

from artcloud.errors import InvalidArgument

log = logging.getLogger("artcloud")


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
