"""`artcloud run --detach`: the training loop goes to the sandbox, and the CI runner may go home.

The sandbox (SkyPilot cluster or Modal Sandbox) runs `artcloud run SCRIPT --backend local` itself: the
same runner, with its server on the same machine, its own clock and budget (counted from this launch),
its final checkpoint push and its summary, which it uploads to S3/runs/NAME/. When the loop ends the
sandbox goes: its command exits (Modal), or SkyPilot's autodown takes the cluster a minute after the job
(sky). `artcloud status` lists it and `artcloud logs NAME -f` follows it meanwhile; `artcloud down NAME`
ends it early (checkpoints up to the last finished step are on S3 already).
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from artcloud.runner import EXIT_LAUNCH, EXIT_OK, Ending, RunError, Runner, RunOptions


def inner_args(opts: RunOptions, name: str, launched_at: float, price: float | None) -> list[str]:
    """The sandbox's own `artcloud run` arguments, after the script's name."""
    args = ["--backend", "local", "--engine", opts.engine or "auto", "--s3", opts.s3 or "", "--name", name,
            "--max-duration", f"{round(opts.max_duration_s)}s", "--summary", "artcloud-run.json",
            "--detached-inner", "--billing-since", f"{launched_at:.0f}"]
    if opts.budget_usd is not None:
        if price is None:
            raise RunError(f"the price of {opts.gpu or 'this GPU'} is unknown here, so --budget-usd cannot be enforced: "
                           "pass --price-per-hour")
        args += ["--budget-usd", f"{opts.budget_usd}"]
    if price is not None:
        args += ["--price-per-hour", f"{price}"]
    return args + (["--", *opts.args] if opts.args else [])


async def launch_detached(opts: RunOptions) -> int:
    if opts.backend == "local":
        raise RunError("--detach hands the loop to a cloud sandbox: use it with --backend sky or modal")
    name = opts.name or f"artcloud-{secrets.token_hex(3)}"
    opts.name = name
    runner = Runner(opts)
    backend: Any = runner._make_backend()
    if opts.backend == "sky":
        backend.idle_minutes = 1  # the loop's end is the job's end: the cluster goes a minute later
    launched_at = time.time()

    def run_args(catalog_price: float | None) -> list[str]:
        price = opts.price_per_hour if opts.price_per_hour is not None else catalog_price
        return inner_args(opts, name, launched_at, price)

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
