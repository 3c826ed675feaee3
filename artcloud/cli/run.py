"""`artcloud run SCRIPT`: scheduled training jobs (CI, cron) with teardown guaranteed. See artcloud/runner.py."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import List, Optional

import typer

from artcloud.cli._app import CLIError, app, env_pairs

EXIT_CODES = """Exit codes: 0 the script finished; the script's own status when it failed; 2 bad options;
3 the sandbox could not be started; 4 --budget-usd reached; 5 the sandbox could not be confirmed gone
(run `artcloud down NAME`); 6 the final checkpoint push to S3 was not confirmed (S3 lacks a model's newest
step; the summary says which step it has; every code but 5 gives way to it); 124 --max-duration reached;
130 / 143 stopped by SIGINT / SIGTERM."""


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, epilog=EXIT_CODES)
def run(
    ctx: typer.Context,
    script: Path = typer.Argument(..., help="The training script (Python, written with the artcloud SDK; it gets its backend from artcloud.backend_from_env()). Arguments after it (after `--` if they start with '-') go to the script."),
    backend: Optional[str] = typer.Option(None, "--backend", "-b", envvar="ARTCLOUD_BACKEND", show_default="local", help="local (this machine), sky (any cloud SkyPilot reaches) or modal (a Modal Sandbox). Default: $ARTCLOUD_BACKEND, else local."),
    gpu: Optional[str] = typer.Option(None, "--gpu", envvar="ARTCLOUD_GPU", help="GPU spec: H100:1, A100-80GB:2, L4 (sky); H100, A10G (modal). Default: $ARTCLOUD_GPU, else H100."),
    spot: bool = typer.Option(False, "--spot", help="sky only: a spot machine (a third to half the price). If the cloud takes it back, the run goes on on a new one from the last checkpoint on S3; the summary counts each preemption and what the lost machine cost."),
    cloud: Optional[str] = typer.Option(None, "--cloud", help="sky only: pin a cloud (aws, gcp, ...). Default: the cheapest one `sky check` enabled."),
    s3: Optional[str] = typer.Option(None, "--s3", envvar="ARTCLOUD_S3", help="s3://BUCKET/PREFIX for every checkpoint (and a new sandbox resumes from it). Required for sky and modal. Credentials: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, endpoint ARTCLOUD_S3_ENDPOINT_URL."),
    max_duration: str = typer.Option("8h", "--max-duration", envvar="ARTCLOUD_MAX_DURATION", help="The whole run's wall-clock cap (90m, 3h): then the script is stopped, the last checkpoint pushed and the sandbox torn down (exit 124)."),
    budget_usd: Optional[float] = typer.Option(None, "--budget-usd", envvar="ARTCLOUD_BUDGET_USD", help="Stop cleanly when the estimated cost (price per hour x time since launch) reaches this many dollars (exit 4)."),
    price_per_hour: Optional[float] = typer.Option(None, "--price-per-hour", help="Dollars per hour of the sandbox. Default: SkyPilot's catalog price (sky); required with --budget-usd on modal; 0 for local."),
    lease: str = typer.Option("5m", "--lease", help="If this runner is killed outright, the server pushes its checkpoints and exits after this long without it."),
    detach: bool = typer.Option(False, "--detach", help="Run the training loop on the sandbox itself and return at once: follow it with `artcloud logs NAME -f`; the sandbox tears itself down when the loop ends. Needs --s3 (the summary lands at S3/runs/NAME/)."),
    summary: Path = typer.Option(Path("artcloud-run.json"), "--summary", help="Where the JSON summary goes; the Markdown goes next to it (.md) and is appended to $GITHUB_STEP_SUMMARY when that is set."),
    name: Optional[str] = typer.Option(None, "--name", "-n", help="The run's name, also the sandbox's (sky, modal). Default: run-DATE-TIME / artcloud-XXXXXX."),
    env: List[str] = typer.Option([], "--env", "-e", help="KEY=VALUE for the sandbox's environment. Repeatable."),
    secret: List[str] = typer.Option([], "--secret", help="NAME of an environment variable here to pass to the sandbox as a secret. Repeatable."),
    engine: Optional[str] = typer.Option(None, "--engine", help="Server engine: auto (vLLM + Unsloth when the machine has CUDA and both import, else cpu), vllm, vllm+unsloth, vllm+peft or cpu. Engine settings: --env ARTCLOUD_ENGINE_ARGS='{\"max_model_len\": 16384}' (see artcloud serve --help). Default: cpu for local, auto elsewhere."),
    path: Optional[Path] = typer.Option(None, "--path", help="local only: the server's folder (default: a fresh temporary one)."),
    billing_since: Optional[float] = typer.Option(None, "--billing-since", hidden=True, help="Count the cost from this epoch time (a detached run's launch)."),
    detached_inner: bool = typer.Option(False, "--detached-inner", hidden=True, help="This run is a --detach run's loop, on its sandbox."),
) -> None:
    """Run a training script against a sandbox of its own, then tear everything down, whatever happens.

    The runner starts the backend, runs SCRIPT (its artcloud.backend_from_env() connects to that server),
    watches the clock and the budget, and at the end (success, failure, Ctrl-C, SIGTERM, --max-duration,
    --budget-usd) stops the script, has the server push its last checkpoint, tears the sandbox down and
    checks it is gone. It writes a summary: steps, reward curve, checkpoint URIs, wall time, cost.

    Examples:

      artcloud run train.py -- --steps 50

      artcloud run train.py --backend sky --gpu L4 --s3 s3://my-bucket/runs --max-duration 3h --budget-usd 10

      artcloud run train.py --backend modal --gpu H100 --s3 s3://my-bucket/runs --detach
    """
    from artcloud.durations import parse_duration
    from artcloud.runner import RunError, Runner, RunOptions

    try:
        opts = RunOptions(
            script=script, args=list(ctx.args), backend=backend or "local", gpu=gpu, cloud=cloud, s3=s3,
            max_duration_s=parse_duration(max_duration, what="--max-duration"), budget_usd=budget_usd,
            price_per_hour=price_per_hour, lease_s=parse_duration(lease, what="--lease"), name=name, summary=summary,
            env=env_pairs(env), secrets=list(secret), engine=engine, path=path, billing_since=billing_since,
            detached_inner=detached_inner, spot=spot,
        )
        opts.check()
        if summary.suffix == ".md":
            raise RunError("--summary takes the JSON path (the Markdown goes next to it): e.g. --summary artcloud-run.json")
        if path is not None and opts.backend != "local":
            raise RunError("--path is for --backend local")
        if detach and spot:
            raise RunError("--spot with --detach: a detached loop runs on the machine itself, so nothing would be left "
                           "to replace it when the cloud takes it back; run attached (the runner replaces it), or drop --spot")
    except (RunError, ValueError) as e:
        raise CLIError(str(e)) from e
    try:
        if detach:
            from artcloud.runner import launch_detached

            code = asyncio.run(launch_detached(opts))
        else:
            code = asyncio.run(Runner(opts).run())
    except RunError as e:  # found out while starting (a backend option, a price): nothing was left running
        raise CLIError(str(e)) from e
    sys.stdout.flush()
    raise typer.Exit(code)

