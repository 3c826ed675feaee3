"""How the server ends: one task on the server's loop waits for the first reason, then ends it one way.

The reasons, all timed on time.monotonic() (a clock step on a fresh VM must not end a lease):
- the lease (`--lease`: no client request or heartbeat for that long; lease.py) or `--max-duration`;
- the parent's death (`--parent-pid`, LocalBackend's; it also asks Linux for PR_SET_PDEATHSIG);
- the cloud's preemption notice (`--watch-preemption`, preemption.py);
- POST /artcloud/shutdown (`shutdown`: no new training, wait for jobs if asked, freeze every model, push,
  answer), once its answer has gone out;
- a signal: uvicorn's own handler sets `should_exit`, and the task sees it at its next tick.

The way out: event streams end at once (`draining`), uvicorn takes its graceful path, whose lifespan exit
pushes every model's newest committed step (all at once, within FINAL_PUSH_DEADLINE_S: `push_all`) and
releases the S3 claims, and the process exits. If that path hangs, one timer ends the process with status 1.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable

from artcloud.durations import format_duration
from artcloud.server.api_errors import ApiError
from artcloud.server.lease import Lease

if TYPE_CHECKING:
    from artcloud.server.preemption import Watch
    from artcloud.server.prompted import PromptedModel
    from artcloud.server.training import ModelTrainer

log = logging.getLogger("artcloud.server")

# Once the server starts to end, the graceful path gets this long (well past FINAL_PUSH_DEADLINE_S and
# uvicorn's graceful wait); then the process leaves anyway. A hung shutdown must not keep a GPU running.
FORCE_EXIT_AFTER_S = 1800.0
EXIT_DELAY_S = 0.2  # after the shutdown answer is sent, before uvicorn is asked to stop
TICK_S = 0.5


class Lifecycle:
    def __init__(self, trainers: Callable[[], Iterable[ModelTrainer]],
                 prompted: Callable[[], Iterable[PromptedModel]] = lambda: (), lease: Lease | None = None):
        self._trainers = trainers
        self._prompted = prompted
        self.lease = lease or Lease()
        self.stopping = False  # POST /artcloud/shutdown has begun: no new training
        self.draining = False  # the server is ending: event streams end now, not at uvicorn's graceful timeout
        # Set by main.run (in-process, as in tests, the server is a stand-in or None).
        self.server: Any = None  # the uvicorn.Server: its should_exit starts the graceful path
        self.parent_pid: int | None = None
        self.preemption: Watch | None = None
        self.force_after_s = FORCE_EXIT_AFTER_S

    async def run(self, tick_s: float = TICK_S) -> None:
        """The lifecycle task (the app's lifespan runs it): returns once the server has begun to end."""
        self.lease.touch()  # the lease starts when we serve, not when we began
        if self.preemption is not None:
            await self.preemption.start()
        while not self.draining:
            reason = self.lease.ended()
            if reason is not None:
                self.end(f"{reason}: pushing checkpoints and shutting down")
            elif self.parent_pid is not None and os.getppid() != self.parent_pid:
                self.end(f"parent process {self.parent_pid} is gone: shutting down")
            elif self.server is not None and self.server.should_exit:
                self.end("asked to stop (a signal): pushing checkpoints and shutting down")
            elif self.preemption is not None and (notice := await self.preemption.notice()):
                self.end(f"preemption notice ({notice}): pushing the last checkpoints and exiting")
            else:
                await asyncio.sleep(tick_s)

    def end(self, why: str) -> None:
        """Begin the way out (once; a second reason is ignored)."""
        if self.draining:
            return
        log.warning("%s", why)
        self.draining = True
        if self.server is None:
            return
        self.server.should_exit = True
        # A thread, not a loop timer: it must fire even if the graceful path blocks the loop.
        timer = threading.Timer(self.force_after_s, _force_exit, (self.force_after_s,))
        timer.daemon = True
        timer.start()

    # ------------------------------------------------------------------------------------- shutdown

    def check_open(self) -> None:
        """409 once a shutdown has begun: no new training."""
        if self.stopping:
            raise ApiError(409, "shutting_down", "the server is shutting down (POST /artcloud/shutdown): it takes no new "
                           "training jobs; start a new server to train more")

    async def shutdown(self, wait_for_training_s: float = 0.0, every_s: float = 0.1) -> list[dict[str, Any]]:
        """POST /artcloud/shutdown's work, before its answer: from now on no new training; wait up to
        `wait_for_training_s` for queued and running jobs, freeze every model (a step still computing finishes
        with the error `shutting_down` and commits nothing), push. Returns each model's info (as GET
        /artcloud/models/NAME) after the push, with `training` true where a job was still at work, and `error`
        where the push did not finish. Calling it again is harmless."""
        self.stopping = True
        trainers = list(self._trainers())
        deadline = time.monotonic() + wait_for_training_s
        while any(t.busy for t in trainers) and time.monotonic() < deadline:
            await asyncio.sleep(every_s)
        for trainer in trainers:
            await trainer.freeze()
        errors = await self.push_all()
        # Prompted models too, after the trained ones (push_all's order): a failed push of a history is said as well
        # (code review 3, R7: it was in no answer, and `artcloud down` exited 0).
        models = [*trainers, *self._prompted()]
        return [{**m.info(), "training": getattr(m, "busy", False), **({"error": error} if error else {})}
                for m, error in zip(models, errors)]

    async def push_all(self, close: bool = False) -> list[str | None]:
        """The final pushes: every model's newest committed step and every prompted model's history, all at once,
        so within one FINAL_PUSH_DEADLINE_S (each pusher's bound) however many there are. Trained models first,
        in order; each entry None or why its push failed. `close` (the lifespan exit): each then releases its S3
        claim."""
        models = [*self._trainers(), *self._prompted()]
        return list(await asyncio.gather(*(m.close() if close else m.final_push() for m in models)))

    async def exit_soon(self) -> None:
        """Runs once the shutdown answer is sent; the short delay lets it leave the socket before uvicorn stops."""
        asyncio.get_running_loop().call_later(
            EXIT_DELAY_S, self.end, "shutting down at a client's request (POST /artcloud/shutdown)")


def _force_exit(after_s: float) -> None:
    log.error("the server did not shut down %s after it began to: exiting now", format_duration(after_s))
    logging.shutdown()
    os._exit(1)
