"""`artcloud run SCRIPT`: a training script against a sandbox of its own, with teardown guaranteed.

    artcloud run train.py --backend sky --gpu L4 --s3 s3://bucket/runs --max-duration 3h --budget-usd 20

The runner, not the script, owns the sandbox:

1. start the backend (local, sky or modal), racing the run's clock, budget and signals;
2. run the script as a child process (its own session, dying with the runner) whose
   `artcloud.backend_from_env()` connects to that server; watch it, the clock and the budget, and read
   the server's progress (steps, rewards, checkpoints) every few seconds;
3. however it ends (the script exits, fails, SIGINT/SIGTERM, --max-duration, --budget-usd): stop the
   script (SIGTERM, then SIGKILL), ask the server for its final checkpoint push and exit
   (POST /artcloud/shutdown), tear the sandbox down and check that it is gone;
4. write the summary (JSON, and Markdown for $GITHUB_STEP_SUMMARY) and exit with a code that says why.

A runner killed outright (SIGKILL) cannot do step 3: then the server's lease, the provider's own timers
and `artcloud down --all` do (README, "Nothing is left running"). `--detach` hands the whole loop to the sandbox: see
`launch_detached`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from artcloud.durations import format_duration
from artcloud.errors import ArtcloudError, check_s3_url, first_line
from artcloud.run_summary import redacted

log = logging.getLogger("artcloud.runner")

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_LAUNCH = 3  # the sandbox could not be started
EXIT_BUDGET = 4  # --budget-usd reached: stopped cleanly
EXIT_TEARDOWN = 5  # the sandbox could not be confirmed gone: run `artcloud down NAME`
EXIT_PUSH_UNCONFIRMED = 6  # S3 does not hold each model's newest step (also `artcloud down`'s code for it)
EXIT_TIMEOUT = 124  # --max-duration reached (as timeout(1))
SERVER_MARGIN_S = 600.0  # the server's own --max-duration is the run's plus this: the runner stops it first
REPLACE_CHECK_S = 10.0  # how often a spot run asks whether its machine is still there
SNAPSHOT_EVERY_S = 5.0


class RunError(ArtcloudError):
    """Bad options: one line, exit 2."""

    code = "run_options"


@dataclass
class RunOptions:
    script: Path
    args: list[str] = field(default_factory=list)
    backend: str = "local"
    gpu: str | None = None
    cloud: str | None = None
    s3: str | None = None
    max_duration_s: float = 8 * 3600.0
    budget_usd: float | None = None
    price_per_hour: float | None = None
    lease_s: float = 300.0
    name: str | None = None
    summary: Path = Path("artcloud-run.json")
    env: dict[str, str] = field(default_factory=dict)
    secrets: list[str] = field(default_factory=list)
    engine: str | None = None
    path: Path | None = None  # the local backend's folder (default: a fresh temporary one)
    billing_since: float | None = None  # a detached run counts its cost from the launch, not from here
    detached_inner: bool = False  # this runner is the loop of a --detach run, on the sandbox
    spot: bool = False  # sky: a spot machine, replaced when preempted
    grace_s: float = 15.0  # how long the script has to exit after SIGTERM
    poll_every_s: float = 0.5

    def check(self) -> None:
        if not self.script.is_file():
            raise RunError(f"no script at {self.script}: give the path of a Python training script")
        if self.backend not in ("local", "sky", "modal"):
            raise RunError(f"--backend is local, sky or modal, not {self.backend!r}")
        if self.budget_usd is not None and self.budget_usd <= 0:
            raise RunError(f"--budget-usd must be more than 0, not {self.budget_usd}")
        if self.price_per_hour is not None and self.price_per_hour < 0:
            raise RunError(f"--price-per-hour must be 0 or more, not {self.price_per_hour}")
        if self.max_duration_s <= 0:
            raise RunError("--max-duration must be more than 0")
        if self.backend != "local" and not self.s3:
            raise RunError(f"--backend {self.backend} needs --s3 s3://BUCKET/PREFIX (or $ARTCLOUD_S3): without it the "
                           "checkpoints go away with the sandbox")
        if self.backend == "modal" and self.budget_usd is not None and self.price_per_hour is None:
            raise RunError("--budget-usd on modal needs --price-per-hour: the Modal client has no price list "
                           "(see modal.com/pricing for your GPU)")
        if self.spot and self.backend != "sky":
            raise RunError("--spot is for --backend sky (Modal has no spot machines to ask for)")
        check_s3_url(self.s3 or None, what="--s3")  # InvalidArgument, a ValueError: `artcloud run` says it in one line


@dataclass
class Ending:
    outcome: str  # succeeded, script_failed, launch_failed, interrupted, timeout, budget
    exit_code: int
    reason: str


class Runner:
    def __init__(self, opts: RunOptions, *, say: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.time):
        self.opts = opts
        self.say = say or (lambda line: print(f"artcloud run: {line}", file=sys.stderr, flush=True))
        self.clock = clock  # epoch seconds: what --max-duration and --budget-usd are counted on
        self.name = opts.name or f"run-{time.strftime('%Y%m%d-%H%M%S')}"
        self.started = clock()
        self.billing_since = opts.billing_since or self.started
        self.models: dict[str, dict[str, Any]] = {}  # the server's latest model info, by name
        self.script_exit: int | None = None
        self._stop = asyncio.Event()
        self._signal: int | None = None
        self._snapshot_at = 0.0
        self.backend: Any = None
        self._connection: Path | None = None  # where the script reads its server's address (spot runs)
        self._checked_at = 0.0

    # ------------------------------------------------------------------------------------- money, time

    def price(self) -> float | None:
        if self.opts.price_per_hour is not None:
            return self.opts.price_per_hour
        if self.opts.backend == "local":
            return 0.0
        return getattr(self.backend, "price_per_hour", None)

    def cost(self, now: float | None = None) -> float | None:
        price = self.price()
        return None if price is None else price * ((now or self.clock()) - self.billing_since) / 3600.0

    def _limit_reached(self) -> Ending | None:
        if self._stop.is_set():
            sig = self._signal or signal.SIGTERM
            return Ending("interrupted", 128 + sig, f"stopped by {signal.Signals(sig).name}")
        now = self.clock()
        if now - self.started >= self.opts.max_duration_s:
            return Ending("timeout", EXIT_TIMEOUT, f"--max-duration {format_duration(self.opts.max_duration_s)} reached")
        cost = self.cost(now)
        if self.opts.budget_usd is not None and cost is not None and cost >= self.opts.budget_usd:
            return Ending("budget", EXIT_BUDGET, f"budget ${self.opts.budget_usd:.2f} reached after "
                                                 f"{format_duration(now - self.billing_since)} at ${self.price():.2f}/h")
        return None

    def _on_signal(self, sig: int) -> None:
        if self._stop.is_set():
            self.say(f"{signal.Signals(sig).name} again: still tearing down, please wait")
            return
        self._signal = sig
        self._stop.set()
        self.say(f"{signal.Signals(sig).name}: stopping the script, pushing the last checkpoint, tearing down")

    async def _watch(self, task: asyncio.Future, *, snapshots: bool) -> Ending | None:
        """Wait for `task`, or for a signal, the clock or the budget (the Ending then)."""
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            while True:
                ending = self._limit_reached()
                if ending is not None:
                    return ending
                done, _ = await asyncio.wait({task, stop}, timeout=self.opts.poll_every_s)
                if task in done:
                    return None
                if snapshots:
                    await self._replace_if_lost()
                if snapshots and time.monotonic() - self._snapshot_at > SNAPSHOT_EVERY_S:
                    await self._snapshot()
        finally:
            stop.cancel()

    # ------------------------------------------------------------------------------------- the run

    async def run(self) -> int:
        """The whole run; returns the exit code. The summary is written whatever happens."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        workdir = Path(tempfile.mkdtemp(prefix="artcloud-run-"))  # 0700: the token file lives here
        ending: Ending | None = None
        teardown: dict[str, Any] = {"ok": True, "detail": "nothing was started"}
        try:
            ending = await self._start()
            if ending is None:
                ending = await self._run_script(workdir)
        finally:
            teardown = await self._teardown(ending)
            shutil.rmtree(workdir, ignore_errors=True)
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        if not teardown["ok"]:
            ending = Ending("teardown_failed", EXIT_TEARDOWN, teardown["detail"])
        elif teardown.get("unpushed"):
            # Checkpoints are what a run is for: one that did not reach S3 outweighs how the run ended
            # (which stays in the reason); only a sandbox left running (exit 5) is worse.
            ending = Ending("push_unconfirmed", EXIT_PUSH_UNCONFIRMED,
                            f"the final push was not confirmed for {', '.join(teardown['unpushed'])}; {ending.reason}")
        summary = await asyncio.to_thread(self._summary, ending, teardown)
        self._report(summary)
        return ending.exit_code

    def _make_backend(self) -> Any:
        from artcloud.backends.from_env import make_backend

        o = self.opts
        server_max = o.max_duration_s + SERVER_MARGIN_S
        extra: dict[str, Any] = {}
        if o.backend == "local":
            extra["path"] = o.path or Path(tempfile.mkdtemp(prefix="artcloud-run-data-"))
        if o.spot:
            extra["spot"] = True
        if o.backend == "modal":
            from artcloud.backends.modal import MAX_TIMEOUT_S

            server_max = min(server_max, MAX_TIMEOUT_S)
        try:
            return make_backend(o.backend, gpu=o.gpu, cloud=o.cloud, s3=o.s3, max_duration=f"{round(server_max)}s",
                                lease=f"{round(o.lease_s)}s", name=o.name if o.backend != "local" else None,
                                env=o.env or None, secrets=o.secrets or None, engine=o.engine, **extra)
        except ValueError as e:
            raise RunError(str(e)) from e

    async def _start(self) -> Ending | None:
        self.backend = backend = self._make_backend()
        if self.opts.backend == "sky" and self.opts.budget_usd is not None and self.opts.price_per_hour is None:
            await asyncio.to_thread(backend.provisioner.preflight)  # the catalog's price, before anything is paid for
            if backend.price_per_hour is None:
                raise RunError(f"SkyPilot's catalog has no price for {backend.gpu} here, so --budget-usd cannot be "
                               "enforced: pass --price-per-hour")
        where = "this machine" if self.opts.backend == "local" else (self.opts.gpu or "its default GPU")
        self.say(f"starting the {self.opts.backend} backend ({where})")
        start = asyncio.ensure_future(backend.start())
        try:
            ending = await self._watch(start, snapshots=False)
        except BaseException:
            start.cancel()
            raise
        if ending is not None:
            start.cancel()
            await asyncio.gather(start, return_exceptions=True)
            return ending
        if start.exception() is not None:
            return Ending("launch_failed", EXIT_LAUNCH, f"the sandbox could not be started: {start.exception()}")
        price = self.price()
        self.say(f"server up at {backend.base_url}" + (f" (${price:.2f}/h)" if price else ""))
        return None

    def _script_env(self, workdir: Path) -> dict[str, str]:
        from artcloud.backends import from_env as E

        backend = self.backend
        token_file = workdir / "token"
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(backend._token)
        ca = ""
        if backend.ca_cert:
            text = str(backend.ca_cert)
            if "-----BEGIN CERTIFICATE-----" in text:
                (workdir / "ca.pem").write_text(text)
                ca = str(workdir / "ca.pem")
            else:
                ca = str(Path(text).resolve())
        env = {k: v for k, v in os.environ.items() if k != "ARTCLOUD_BACKEND"}
        env.update({E.ENV_URL: backend.base_url, E.ENV_TOKEN_FILE: str(token_file), E.ENV_CA_FILE: ca,
                    E.ENV_CHECK_HOSTNAME: "1" if backend.check_hostname else "0", E.ENV_RUN_NAME: self.name,
                    "PYTHONUNBUFFERED": "1"})
        if getattr(backend, "relaunch_on_loss", False):  # the script follows this runner to a replacement server
            self._connection = workdir / "connection.json"
            E.write_connection(self._connection, backend, replacing=False)
            env[E.ENV_CONNECTION] = str(self._connection)
        return env

    async def _replace_if_lost(self) -> None:
        """A spot machine taken back: a new one in its place (the models resume from S3), and the script
        told where (connection.json; its backend waits for it). At most every REPLACE_CHECK_S."""
        from artcloud.backends import from_env as E
        from artcloud.backends.client import ServerGone

        backend = self.backend
        if self._connection is None or time.monotonic() - self._checked_at < REPLACE_CHECK_S:
            return
        self._checked_at = time.monotonic()
        generation = backend.generation
        try:
            await backend._check_alive()
            return
        except ServerGone as e:
            cause = e
        E.write_connection(self._connection, backend, replacing=True)
        replaced = await backend.recover(cause, generation)
        E.write_connection(self._connection, backend, replacing=False, failed=not replaced)
        if replaced:
            self.say(f"{backend.sandbox_name} was lost ({backend.replacements[-1]['reason']}); a new machine is up at "
                     f"{backend.base_url}, and the script goes on from the last checkpoint")
        else:  # not a lost machine (the server failed on a live one): the script sees the error; no more checks
            self._connection = None

    async def _run_script(self, workdir: Path) -> Ending:
        from artcloud.backends.local import _die_with_parent

        o = self.opts
        self.say(f"running {o.script} {' '.join(redacted(o.args))}".rstrip())
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(o.script), *o.args, env=self._script_env(workdir), stdin=asyncio.subprocess.DEVNULL,
            start_new_session=True,  # a terminal's Ctrl-C reaches the runner, which stops the script in order
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        waiting = asyncio.ensure_future(proc.wait())
        try:
            ending = await self._watch(waiting, snapshots=True)
        finally:
            await _stop_group(proc, waiting, self.opts.grace_s)
        code = proc.returncode
        self.script_exit = code if code >= 0 else 128 - code
        if ending is not None:
            return ending
        if code == 0:
            return Ending("succeeded", EXIT_OK, "the script finished")
        return Ending("script_failed", self.script_exit, f"the script exited with status {self.script_exit}")

    async def _snapshot(self) -> None:
        """The server's models, their history and checkpoints: what the summary reports."""
        self._snapshot_at = time.monotonic()
        backend = self.backend
        try:
            # The authenticated status: /health says only status, version and readiness to the world.
            status = await asyncio.wait_for(backend.client.status(), 15.0)
            for model in status.models:
                info = await asyncio.wait_for(backend.client.model_info(model.name, retry=False), 15.0)
                self.models[model.name] = info.model_dump()
        except Exception as e:  # the server may be busy or going: the last snapshot stands
            log.debug("progress snapshot failed: %s", e)

    # ------------------------------------------------------------------------------------- teardown

    async def _teardown(self, ending: Ending | None) -> dict[str, Any]:
        """Final push, then teardown. `ok` is whether the sandbox is confirmed gone; `unpushed` names
        each model (NAME@STEP) whose newest step S3 is not confirmed to hold, when the run has S3."""
        from artcloud.backends.client import push_verdicts

        backend = self.backend
        if backend is None:
            return {"ok": True, "detail": "nothing was started"}
        notes, unpushed = [], []
        try:  # where the start-up time went (the first rollout is the server's to know): before it goes
            await asyncio.wait_for(backend.cold_start(), 15.0)
        except Exception as e:
            log.debug("cold start figures not read: %s", e)
        try:
            answer = await backend.final_push()  # None: the server never answered (nothing to push)
        except Exception as e:
            answer = None
            notes.append(f"the final push was not confirmed ({type(e).__name__}: {first_line(e)})")
            if self.opts.s3:
                # Unknown is not safe: the steps since the last snapshot's push may be on the server only.
                unpushed = [f"{name}@{info['step']}" for name, info in self.models.items()]
        if answer is not None:
            verdicts = push_verdicts(answer)
            for info in answer.models:  # the last word on each model: after the final push
                self.models[info.name] = info.model_dump()
            bad = [v for v in verdicts if v.status == "not_pushed"]
            unpushed = [f"{v.name}@{v.step}" for v in bad]
            if bad:
                notes.append("; ".join(v.line() for v in bad))
            elif self.opts.s3:
                notes.append("final checkpoint pushed")
            else:
                notes.append("server stopped")
        what = getattr(backend, "sandbox_name", None) if self.opts.backend != "local" else "the local server"
        try:
            await asyncio.wait_for(asyncio.shield(backend.down()), 900.0)
            gone = await backend.gone()
        except Exception as e:
            return {"ok": False, "detail": f"tearing down {what} failed ({type(e).__name__}: {e}): run `artcloud down {what}`"}
        if not gone:
            return {"ok": False, "detail": f"{what} still runs after teardown: run `artcloud down {what}`"}
        notes.append(f"{what} torn down")
        return {"ok": True, "detail": "; ".join(notes), **({"unpushed": unpushed} if unpushed else {})}

    # ------------------------------------------------------------------------------------- summary

    def _checkpoints(self, info: dict[str, Any]) -> list[dict[str, Any]]:
        project, name = info["project"], info["name"]
        if self.opts.s3:
            from artcloud.storage.s3 import CheckpointStore, S3Config

            try:
                store = CheckpointStore(S3Config.from_uri(self.opts.s3))
                return [{"step": s, "uri": f"{store.config.uri}/{project}/{name}/checkpoints/{s}"}
                        for s in store.committed_steps(project, name)]
            except Exception as e:
                log.warning("could not list the checkpoints on %s: %s", self.opts.s3, e)
                return []
        path = getattr(self.backend, "path", None)
        if path is None:
            return []
        return [{"step": s, "uri": str(Path(path).resolve() / project / name / "checkpoints" / str(s))}
                for s in info.get("checkpoints", [])]

    def _summary(self, ending: Ending, teardown: dict[str, Any]) -> dict[str, Any]:
        from artcloud.backends.remote import cold_start_rows
        from artcloud.run_summary import write_summary

        ended = self.clock()
        models = []
        for info in self.models.values():
            points = self._checkpoints(info)
            models.append({
                "name": info["name"], "project": info["project"], "base_model": info["base_model"], "step": info["step"],
                "history": [{k: r.get(k) for k in ("step", "reward_mean", "reward_std", "loss", "seconds")}
                            for r in info.get("history", [])],
                "checkpoints": points,
                "final_checkpoint": points[-1]["uri"] if points else None,
            })
        cost = self.cost(ended) if self.backend is not None else 0.0
        price = self.price() if self.backend is not None else None
        local = self.opts.backend == "local"
        summary = {
            "schema": 1, "run": self.name, "script": str(self.opts.script), "args": redacted(self.opts.args),
            "backend": self.opts.backend, "gpu": None if local else self.opts.gpu,
            "sandbox": None if local else getattr(self.backend, "sandbox_name", None),
            "detached": self.opts.detached_inner or ending.outcome == "detached",
            "outcome": ending.outcome, "exit_code": ending.exit_code, "reason": ending.reason,
            "script_exit_code": self.script_exit,
            "started_at": _iso(self.started), "ended_at": _iso(ended), "wall_time_s": round(ended - self.started, 1),
            "price_per_hour": price,
            "estimated_cost_usd": None if cost is None else round(cost, 4),
            "budget_usd": self.opts.budget_usd, "max_duration_s": self.opts.max_duration_s,
            "s3": self.opts.s3, "models": models, "teardown": teardown,
            "preemptions": list(getattr(self.backend, "replacements", None) or []),
            "cold_start": cold_start_rows(getattr(self.backend, "cold_start_s", None) or {}, price),
        }
        json_path, md_path = write_summary(summary, self.opts.summary)
        summary["_paths"] = (str(json_path), str(md_path))
        if self.opts.detached_inner and self.opts.s3:
            _upload_summary(self.opts.s3, self.name, json_path, md_path)
        return summary

    def _report(self, summary: dict[str, Any]) -> None:
        steps = sum(m["step"] for m in summary["models"])
        cost = summary["estimated_cost_usd"]
        money = "cost unknown" if cost is None else f"~${cost:.2f}"
        json_path, md_path = summary.pop("_paths")
        self.say(f"{summary['outcome']} ({summary['reason']}) in {format_duration(summary['wall_time_s'])}, "
                 f"{steps} step{'s' if steps != 1 else ''}, {money}; {summary['teardown']['detail']}; "
                 f"summary: {md_path} and {json_path}; exit {summary['exit_code']}")


async def _stop_group(proc: asyncio.subprocess.Process, waiting: asyncio.Future, grace_s: float) -> None:
    """SIGTERM the script's process group, then SIGKILL after `grace_s`: nothing it started survives."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break  # the script and everything it started are gone
        if waiting.done():
            await asyncio.sleep(0.2)  # the script is gone; its children get a moment to follow
            continue
        try:
            await asyncio.wait_for(asyncio.shield(waiting), wait_s)
        except asyncio.TimeoutError:
            continue
    await waiting


async def launch_detached(opts: RunOptions) -> int:
    """`artcloud run --detach`: the training loop goes to the sandbox, and the CI runner may go home.

    The sandbox (SkyPilot cluster or Modal Sandbox) runs `artcloud run SCRIPT --backend local` itself (run_args):
    the same runner, with its server on the same machine, its own clock and budget (counted from this launch),
    its final checkpoint push and its summary, which it uploads to S3/runs/NAME/. When the loop ends the sandbox
    goes: its command exits (Modal), or SkyPilot's autodown takes the cluster a minute after the job (sky).
    `artcloud status` lists it and `artcloud logs NAME -f` follows it meanwhile; `artcloud down NAME` ends it
    early (checkpoints up to the last finished step are on S3 already)."""
    if opts.backend == "local":
        raise RunError("--detach hands the loop to a cloud sandbox: use it with --backend sky or modal")
    shown = redacted(opts.args)
    if shown != list(opts.args):
        flag = next(shown[i - 1] if a == "***" else a.partition("=")[0] for i, a in enumerate(shown) if a.endswith("***"))
        raise RunError(f"{flag} looks like a secret, and a detached run's arguments show in its sandbox's dashboard and "
                       f"logs: pass it with --secret NAME (an environment variable here; the script reads os.environ[NAME] "
                       f"there) instead")
    name = opts.name or f"artcloud-{secrets.token_hex(3)}"
    opts.name = name
    runner = Runner(opts)
    backend: Any = runner._make_backend()
    if opts.backend == "sky":
        backend.provisioner.idle_minutes = 1  # the loop's end is the job's end: the cluster goes a minute later
    launched_at = time.time()

    def run_args(catalog_price: float | None) -> list[str]:
        """The sandbox's own `artcloud run` arguments, after the script's name."""
        price = opts.price_per_hour if opts.price_per_hour is not None else catalog_price
        args = ["--backend", "local", "--engine", opts.engine or "auto", "--s3", opts.s3 or "", "--name", name,
                "--max-duration", f"{round(opts.max_duration_s)}s", "--summary", "artcloud-run.json",
                "--detached-inner", "--billing-since", f"{launched_at:.0f}"]
        if opts.budget_usd is not None:
            if price is None:
                raise RunError(f"the price of {opts.gpu or 'this GPU'} is unknown here, so --budget-usd cannot be "
                               "enforced: pass --price-per-hour")
            args += ["--budget-usd", f"{opts.budget_usd}"]
        if price is not None:
            args += ["--price-per-hour", f"{price}"]
        return args + (["--", *opts.args] if opts.args else [])

    runner.say(f"launching {name} ({opts.backend}, {opts.gpu or 'default GPU'}) to run {opts.script.name} there")
    try:
        await backend.launch_job(opts.script, run_args)
    except RunError:
        raise
    except Exception as e:
        ending = Ending("launch_failed", EXIT_LAUNCH, f"the sandbox could not be started: {e}")
    else:
        where = f"{opts.s3.rstrip('/')}/runs/{name}/summary.md"
        ending = Ending("detached", EXIT_OK, f"training on {name}; its summary will be at {where}")
        runner.say(f"{name} is training on its own: `artcloud logs {name} -f` follows it, `artcloud status` shows it, "
                   f"`artcloud down {name}` stops it; it tears itself down when the loop ends")
    finally:
        await backend.close()
    runner.backend = backend
    summary = runner._summary(ending, {"ok": True, "detail": f"left to {name} itself (--detach)"})
    runner._report(summary)
    return ending.exit_code


def _upload_summary(s3: str, run: str, *paths: Path) -> None:
    from artcloud.storage.s3 import Bucket, S3Config

    bucket = Bucket(S3Config.from_uri(s3))
    for path in paths:
        bucket._put(bucket._key("runs", run, "summary" + path.suffix), path.read_bytes())
    log.warning("summary uploaded to %s/runs/%s/", bucket.config.uri, run)


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
