"""POST /artcloud/shutdown, coordinated: stop taking training, freeze every model, push, answer, exit.

From the moment a shutdown starts, training POSTs get 409 `shutting_down`. It waits up to
`wait_for_training_s` for queued and running jobs, then freezes every model (a step still computing
finishes with the error `shutting_down` and commits nothing), pushes each model's newest committed
checkpoint to S3, and answers each model's state after the push. Only then is the process asked to
exit, through uvicorn's graceful path (the lifespan exit releases the S3 claims). Calling it again is
harmless.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable

from artcloud.server.errors import ApiError

if TYPE_CHECKING:
    from artcloud.server.models import ServedModel
    from artcloud.server.prompted import PromptedModel

log = logging.getLogger("artcloud.server")

EXIT_DELAY_S = 0.2  # after the shutdown answer is sent, before uvicorn is asked to stop


class Shutdown:
    def __init__(self, models: Callable[[], Iterable[ServedModel]],
                 prompted: Callable[[], Iterable[PromptedModel]] = lambda: ()):
        self._models = models
        self._prompted = prompted
        self.stopping = False
        # The process is about to exit (the lease, --max-duration, a signal, a shutdown request): event
        # streams end now instead of holding uvicorn's graceful wait open. Set from any thread.
        self.draining = False
        # Set by serve.run: asks uvicorn to take its graceful path (None when the app runs in-process).
        self.request_exit: Callable[[], None] | None = None

    def check_open(self) -> None:
        """409 once a shutdown has begun: no new training."""
        if self.stopping:
            raise ApiError(409, "shutting_down", "the server is shutting down (POST /artcloud/shutdown): it takes no new "
                           "training jobs; start a new server to train more")

    async def run(self, wait_for_training_s: float = 0.0, every_s: float = 0.1) -> list[dict[str, Any]]:
        """Returns each model's info (as GET /artcloud/models/NAME) after the final push, with `training`
        true where a job was still at work, and `error` where the push did not finish."""
        self.stopping = True
        models = list(self._models())
        deadline = time.monotonic() + wait_for_training_s
        while any(m.trainer.busy for m in models) and time.monotonic() < deadline:
            await asyncio.sleep(every_s)
        for model in models:
            await model.trainer.freeze()
        out = []
        for model in models:
            error = await model.trainer.final_push()
            entry: dict[str, Any] = {**model.info(), "training": model.trainer.busy}
            if error is not None:
                entry["error"] = error
            out.append(entry)
        for prompted in self._prompted():  # their histories too: the machine may go as soon as this answers
            await prompted.flush()
        return out

    def drain(self) -> None:
        self.draining = True

    async def exit_soon(self) -> None:
        """Runs once the answer is sent; the short delay lets it leave the socket before uvicorn stops."""
        if self.request_exit is not None:
            asyncio.get_running_loop().call_later(EXIT_DELAY_S, self.request_exit)
