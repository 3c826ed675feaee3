"""`artcloud launch / status / logs / down`: sandboxes on cloud GPUs, from the command line.

    artcloud launch --gpu H100:1 --s3 s3://bucket/runs     a server on a fresh cluster; prints how to connect
    artcloud status                                        what this machine launched: age, GPU, cost so far
    artcloud logs NAME [-f]                                the server's output (setup, then run)
    artcloud down NAME | --all                             tear down (a sandbox already gone is fine)

The commands register themselves on the CLI app (artcloud/cli/_app.py); heavy imports (the SkyPilot SDK) happen inside
them, so `artcloud --help` stays fast.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import typer

from artcloud.cli._app import CLIError, app, env_pairs
from artcloud.errors import first_line


def provisioner(provider: str):
    """The provider's face on the sandboxes of the registry (a record's provider): status, destroy, logs."""
    if provider == "sky":
        from artcloud.backends.sky import SkyProvisioner

        return SkyProvisioner()
    if provider == "modal":
        from artcloud.backends.modal import ModalProvisioner

        return ModalProvisioner()
    raise CLIError(f"unknown provider {provider!r} in the state registry (~/.artcloud): `artcloud down NAME` "
                   "of a newer artcloud may know it")


def _console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True)  # piped output keeps whole lines


def _money(value: float | None) -> str:
    return "?" if value is None else f"${value:,.2f}"


def _cost(value: float) -> str:
    return f"${value:.4f}" if 0 < value < 0.01 else _money(value)  # a phase of seconds costs fractions of a cent


@app.command()
def launch(
    provider: str = typer.Option("sky", "--provider", "-p", help="sky (any cloud SkyPilot reaches) or modal (a Modal Sandbox)."),
    gpu: str = typer.Option("H100:1", "--gpu", help="GPU spec as SkyPilot writes it: NAME[:COUNT], e.g. H100:1, A100-80GB:2, L4. `sky show-gpus` lists them."),
    nodes: int = typer.Option(1, "--nodes", min=1, help="Machines of --gpu. Over 1, the head trains and serves, and each other node serves rollouts as an inference replica the head spreads them over (SkyPilot only; the price counts every node)."),
    trainer_nodes: int = typer.Option(1, "--trainer-nodes", min=1, help="Of --nodes, how many train (the head and the next ones): the sharded trainer (FSDP2) over all their trainer GPUs; the rest serve rollouts."),
    cloud: Optional[str] = typer.Option(None, "--cloud", help="Pin a cloud (aws, gcp, azure, lambda, runpod, kubernetes, ...). Default: the cheapest one `sky check` enabled."),
    region: Optional[str] = typer.Option(None, "--region", help="Pin a region of --cloud."),
    spot: bool = typer.Option(False, "--spot", help="Use a spot/preemptible machine (cheaper; may vanish: checkpoints on S3 let a new one resume)."),
    idle_minutes: int = typer.Option(10, "--idle-minutes", min=0, help="SkyPilot autodown: the cluster is torn down this many minutes after the server exits."),
    lease: str = typer.Option("15m", "--lease", help="The server pushes its checkpoints and exits when no client request or heartbeat came for this long."),
    max_duration: str = typer.Option("8h", "--max-duration", help="The server exits after this long, whatever happens (90m, 8h, 1d)."),
    s3: Optional[str] = typer.Option(None, "--s3", help="s3://BUCKET/PREFIX for checkpoints (resume on a new machine). Credentials from this machine's AWS settings travel as SkyPilot secrets."),
    name: Optional[str] = typer.Option(None, "--name", "-n", help="Cluster name. Default: artcloud-XXXXXX."),
    image: Optional[str] = typer.Option(None, "--image", help="A prebuilt server image, docker:REPO:TAG (recipe: launchers/Dockerfile). Default: install this artcloud at setup."),
    disk_size: Optional[int] = typer.Option(None, "--disk", "--disk-size", min=10, help="Disk in GB (default 256: model weights)."),
    engine: str = typer.Option("auto", "--engine", help="Server engine: auto (vLLM + Unsloth when the machine has CUDA and both import, else cpu), vllm, vllm+unsloth, vllm+peft or cpu. Engine settings: --env ARTCLOUD_ENGINE_ARGS='{\"max_model_len\": 16384}' (see artcloud serve --help)."),
    env: List[str] = typer.Option([], "--env", "-e", help="KEY=VALUE for the server's environment (not for secrets). Repeatable."),
    secret: List[str] = typer.Option([], "--secret", help="NAME of an environment variable here, passed as a SkyPilot secret (redacted in logs). Repeatable."),
    startup_timeout: str = typer.Option("30m", "--startup-timeout", help="How long to wait for the server once SkyPilot has the job running."),
    retry_until_up: bool = typer.Option(False, "--retry-until-up", help="Keep retrying while no cloud has the GPU free (SkyPilot's retry)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check the GPU, cloud and S3, show the task and the plan; launch nothing."),
) -> None:
    """Launch the training server on a cloud GPU through SkyPilot, and print how to use it.

    The server speaks HTTPS with a certificate and token made for this launch (kept in ~/.artcloud,
    never in the task). It goes away by itself: it exits after --lease without a client or after
    --max-duration, and SkyPilot tears the machine down --idle-minutes later. `artcloud down NAME`
    ends it at once.

    With --provider modal: a Modal Sandbox whose hard timeout is --max-duration (24h at most), reached
    through Modal's HTTPS tunnel; --cloud, --region, --spot, --image, --disk, --idle-minutes and
    --retry-until-up are SkyPilot's and do not apply.

    Example: artcloud launch --gpu L4 --cloud gcp --s3 s3://my-bucket/runs --name mail-agent
    """
    from artcloud.backends.modal import ModalBackend
    from artcloud.backends.sky import SkyBackend
    from artcloud.durations import format_duration
    from artcloud.errors import ArtcloudError

    spec = dict(gpu=gpu, name=name, lease=lease, max_duration=max_duration, s3=s3, env=env_pairs(env),
                secrets=list(secret), engine=engine, startup_timeout=startup_timeout)
    sky_only = {"--cloud": cloud, "--region": region, "--spot": spot, "--image": image, "--disk": disk_size,
                "--retry-until-up": retry_until_up, "--idle-minutes": idle_minutes != 10, "--nodes": nodes != 1,
                "--trainer-nodes": trainer_nodes != 1}
    if provider not in ("sky", "modal"):
        raise CLIError(f"--provider is sky or modal, not {provider!r}")
    used = [flag for flag, value in sky_only.items() if value]
    if provider == "modal" and used:
        raise CLIError(f"{', '.join(used)} {'is' if len(used) == 1 else 'are'} for --provider sky, not modal")
    try:
        if provider == "sky":
            backend = SkyBackend(cloud=cloud, region=region, spot=spot, idle_minutes=idle_minutes, image=image,
                                 disk=disk_size, retry_until_up=retry_until_up, num_nodes=nodes,
                                 trainer_nodes=trainer_nodes, **spec)
            ends = f"at most {format_duration(backend.max_duration_s)}); the machine goes {idle_minutes} min later"
        else:
            backend = ModalBackend(**spec)
            ends = f"Modal ends the sandbox after {format_duration(backend.timeout_s)} at most)"
    except ValueError as e:
        raise CLIError(str(e)) from e
    out, err = _console(), _console(stderr=True)
    label = backend.sandbox_name
    teardown = f"the server exits after {format_duration(backend.lease_s)} without a client ({ends}"
    try:
        if dry_run:
            (_dry_run if provider == "sky" else _dry_run_modal)(backend, out, teardown)
            return
        # No spinner here: the backend shows its own progress bar (the server's phase) on a terminal.
        if err.is_terminal:
            err.print(f"launching {label} ({gpu}): " + ("SkyPilot provisions the machine, then artcloud installs and "
                      "starts; this takes minutes" if provider == "sky" else "building the image the first time "
                      "takes minutes"), markup=False)
        asyncio.run(_start_and_leave(backend))
    except ArtcloudError as e:
        raise CLIError(str(e)) from e
    machines = f"{nodes} x {gpu}" if nodes > 1 else gpu
    where = f"{machines}, {_money(backend.price_per_hour)}/h" if provider == "sky" else f"Modal, {gpu}"
    out.print(f"[bold green]{label}[/] is up: {backend.base_url}  ({where})")
    out.print(f"  connect from Python:  backend = artcloud.{type(backend).__name__}(name={label!r})", markup=False)
    out.print(f"  teardown:             {teardown}; `artcloud down {label}` ends it now", markup=False)
    out.print(f"  logs:                 artcloud logs {label} -f", markup=False)
    _print_cold_start(out, backend)


def _print_cold_start(out, backend) -> None:
    """Where the start-up time went, phase by phase, with its cost at the machine's price."""
    from artcloud.backends.remote import cold_start_rows
    from artcloud.run_summary import format_seconds

    rows = cold_start_rows(backend.cold_start_s, backend.price_per_hour)
    if not rows:
        return
    parts = [f"{r['phase']} {format_seconds(r['seconds'])}" + (f" ({_cost(r['cost_usd'])})" if r["cost_usd"] is not None else "")
             for r in rows]
    out.print(f"  cold start:           {', '.join(parts)}", markup=False)


def _dry_run_modal(backend, out, teardown: str) -> None:
    from artcloud._version import __version__
    from artcloud.backends.modal import server_command

    names = list(backend.provisioner.launch_secrets("x" * 32))  # the names only; the values are never printed
    command = server_command(lease_s=backend.lease_s, max_duration_s=backend.max_duration_s, s3=backend.s3,
                             engine=backend.engine)
    out.print("artcloud launch --provider modal --dry-run: nothing was created", markup=False)
    out.print(f"  sandbox   {backend.name} in app {backend.app_name}, GPU {backend.gpu}, HTTPS tunnel to port 8443",
              markup=False)
    out.print(f"  image     debian-slim + this machine's artcloud {__version__} wheel + artcloud[gpu]", markup=False)
    out.print(f"  command   {' '.join(command)}", markup=False)
    out.print(f"  teardown  {teardown}", markup=False)
    out.print(f"  secrets   {', '.join(names)} (one modal.Secret; values never shown)", markup=False)


async def _start_and_leave(backend) -> None:
    await backend.start()
    await backend.close()  # leave it running: the lease and autodown end it, or `artcloud down`


def _dry_run(backend, out, teardown: str) -> None:
    from artcloud.backends.sky_task import SERVER_PORT
    from artcloud.backends.wheel import build_wheel
    from artcloud.durations import format_duration

    plan = backend.provisioner.preflight()
    # Thrown away: only the names show.
    placeholder, launch_secrets, replica_ca = backend.provisioner.make_secrets(backend.provisioner.launch_secrets())
    with tempfile.TemporaryDirectory(prefix="artcloud-wheel-") as tmp:
        wheel = None if backend.image else build_wheel(Path(tmp))
        task = backend.provisioner.task(launch_secrets=launch_secrets, wheel=wheel, ca_cert=placeholder.ca_cert,
                                        replica_ca=replica_ca)
        checked = _validate_with_skypilot(task.config)
        shipped = (f"image {backend.image}" if backend.image else
                   f"this machine's artcloud as {wheel.name} ({wheel.stat().st_size // 1024} kB) + artcloud[gpu]")
    out.print("[bold]artcloud launch --dry-run[/]: nothing was launched")
    out.print(f"  cluster   {backend.cluster_name}", markup=False)
    nodes = backend.spec.num_nodes
    what = f"{f'{nodes} x ' if nodes > 1 else ''}{backend.gpu or 'no GPU'}{' (spot)' if backend.use_spot else ''}"
    if plan.offer is not None:
        offer = plan.offer
        out.print(f"  machine   {what} on {offer.cloud} {offer.instance_type}"
                  f"{' in ' + offer.region if offer.region else ''}, {_money(plan.price_per_hour)}/h"
                  f"{' (' + plan.note + ')' if plan.note else ''}", markup=False)
        out.print(f"  cost      at most {_money(plan.max_cost)} if it runs its whole max_duration "
                  f"({format_duration(backend.max_duration_s)}); the launch records what SkyPilot really chose",
                  markup=False)
    else:
        where = f"{backend.cloud}/{backend.region}" if backend.region else (backend.cloud or "the cheapest enabled cloud")
        out.print(f"  machine   {what} on {where}, price unknown ({plan.note})", markup=False)
    out.print(f"  server    {shipped}, HTTPS on port {SERVER_PORT}, engine {backend.engine}", markup=False)
    if nodes > 1:
        from artcloud.backends.sky_task import REPLICA_PORT

        out.print(f"  nodes     the head trains and serves; {nodes - 1} inference replica(s) on port {REPLICA_PORT}, "
                  "reached by the head inside the cluster only", markup=False)
    out.print(f"  teardown  {teardown}", markup=False)
    out.print(f"  secrets   {', '.join(task.secrets)} (values never shown or written)", markup=False)
    out.print(f"  checked   {checked}", markup=False)
    out.print("--- the SkyPilot task (secrets redacted) ---")
    out.print(task.render(), markup=False, end="")


def _live(status: str) -> str:
    """A provider's status, with what it means for the bill where that is not obvious."""
    return {"STOPPED": "STOPPED (disks bill)", "INIT": "INIT (starting, or unhealthy)"}.get(status, status)


def _validate_with_skypilot(config: dict) -> str:
    import copy
    import importlib.util

    # The repo's own sky/ folder (templates) is a namespace package when run from a checkout: only a
    # regular package is SkyPilot.
    spec = importlib.util.find_spec("sky")
    if spec is None or spec.origin in (None, "namespace"):
        return "not by SkyPilot (pip install 'artcloud[sky]')"
    import requests
    import sky
    from sky import exceptions

    cfg = copy.deepcopy(config)  # from_yaml_config empties its argument
    cfg.pop("secrets", None)  # names only: as task secrets they would become managed references
    try:
        sky.Task.from_yaml_config(cfg).validate()
    except requests.RequestException:  # GPU names are checked against a catalog SkyPilot downloads
        return "not by SkyPilot: its GPU catalog could not be downloaded (offline?)"
    except exceptions.NoCloudAccessError:  # opening a port needs an enabled cloud to ask
        return "not fully by SkyPilot: no cloud is enabled here (run `sky check`)"
    except Exception as e:
        raise CLIError(f"SkyPilot rejects the task: {str(e).strip().splitlines()[-1]}") from e
    return f"the task passes sky.Task.validate() (skypilot {sky.__version__})"


@app.command()
def status(
    as_json: bool = typer.Option(False, "--json", help="One JSON object per sandbox, for scripts."),
) -> None:
    """Every sandbox this machine launched that is still alive: age, GPU, price and estimated cost so far.

    Sandboxes that went away by themselves (lease, autodown) are marked down here as they are found gone.
    """
    from artcloud.backends.state import StateDir, launching_now
    from artcloud.durations import format_duration

    state = StateDir()
    state.prune()
    rows, gone, asked, missing = [], [], {}, {}
    for record in state.live():
        try:
            provider = asked.setdefault(record.provider, provisioner(record.provider))
            live = provider.status(record)
        except Exception as e:  # the provider cannot be asked: say so, forget nothing
            if getattr(e, "code", None) == "missing_dependency":  # the table still lists it; stderr says what to install
                missing[str(e)] = None
                rows.append((record, "unknown (not installed here)"))
            else:
                rows.append((record, f"unknown ({type(e).__name__})"))
            continue
        if live is None and launching_now(record):  # the registry is written before the provider hears of it
            rows.append((record, "LAUNCHING"))
        elif live is None:
            state.mark_down(record.name)
            gone.append(record.name)
        else:
            rows.append((record, live))
    now = time.time()
    if as_json:
        for record, live in rows:
            print(json.dumps({"name": record.name, "provider": record.provider, "status": live, "gpu": record.gpu,
                              "url": record.url, "launched_at": record.launched_at, "age_s": round(record.age_s(now)),
                              "resources": record.extra.get("resources"),
                              "price_per_hour": record.price_per_hour, "cost_so_far": record.cost_so_far(now),
                              "run": record.extra.get("run")}))
        _fail_on_missing(missing)
        return
    from rich.table import Table

    out = _console()
    if not rows:
        out.print("no live sandboxes" + (f" ({', '.join(gone)} went away by themselves)" if gone else ""))
        return
    table = Table(box=None, header_style="bold")
    for column in ("NAME", "PROVIDER", "STATUS", "MACHINE", "AGE", "$/H", "COST SO FAR", "URL"):
        table.add_column(column, justify="right" if column in ("AGE", "$/H", "COST SO FAR") else "left")
    total = 0.0
    for record, live in rows:
        cost = record.cost_so_far(now)
        total += cost or 0.0
        machine = record.extra.get("resources") or record.gpu or "-"  # what SkyPilot launched, once known
        table.add_row(record.name, record.provider, _live(live), machine, format_duration(record.age_s(now)),
                      _money(record.price_per_hour), _money(cost),
                      record.url or (f"detached run of {record.extra['run']}" if record.extra.get("run") else "-"))
    out.print(table)
    out.print(f"estimated cost so far: {_money(total)} (the launched machine at SkyPilot's catalog price; "
              "the cloud's bill is the truth)")
    dead = [record.name for record, live in rows if live in ("STOPPED", "INIT")]
    if dead:
        out.print(f"{', '.join(dead)}: stopped or unhealthy, serving nothing while disks may bill: "
                  f"`artcloud down {dead[0]}`" + (" (and the others)" if len(dead) > 1 else ""))
    if gone:
        out.print(f"gone by themselves since last time: {', '.join(gone)}")
    _fail_on_missing(missing)


def _fail_on_missing(missing: dict[str, None]) -> None:
    """After the table: a sandbox whose provider's package is missing here could not be asked, so its status
    is not known. Exit 2 with the line(s) that say what to install."""
    if missing:
        raise CLIError("; ".join(missing))


def _known(name: str):
    """The record of `name`, or a CLIError that says what to do."""
    from artcloud.backends.state import StateDir, check_name

    try:
        check_name(name)
    except ValueError as e:
        raise CLIError(str(e)) from e
    record = StateDir().load(name)
    if record is None:
        raise CLIError(f"this machine launched no sandbox named {name!r}: `artcloud status` lists them")
    return record


@app.command()
def logs(
    name: str = typer.Argument(..., help="The sandbox, as `artcloud status` names it."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines until the server exits (Ctrl-C stops following, not the server)."),
    tail: int = typer.Option(0, "--tail", min=0, help="Only the last N lines (0: all)."),
) -> None:
    """The server's output: the setup (installing artcloud) and the run (`artcloud serve`)."""
    from artcloud.backends.deps import MissingDependency

    record = _known(name)
    try:
        provider = provisioner(record.provider)
    except MissingDependency as e:
        raise CLIError(str(e)) from e
    if provider.status(record) is None:
        raise CLIError(f"{name} is gone (went {'down' if record.state == 'down' else 'away by itself'}): "
                       "its logs went with the machine")
    try:
        for line in provider.logs(record, follow=follow, tail=tail):
            print(line, flush=True)
    except KeyboardInterrupt:
        pass
    except Exception as e:
        raise CLIError(first_line(e) or type(e).__name__) from e


@app.command()
def down(
    names: List[str] = typer.Argument(None, help="Sandboxes to tear down, as `artcloud status` names them."),
    all_: bool = typer.Option(False, "--all", "-a", help="Every live sandbox this machine launched."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask before --all."),
) -> None:
    """Tear sandboxes down now. A sandbox already gone counts as done (exit 0).

    A server that still answers is first asked to push its last checkpoint to S3 and exit (artcloud
    waits up to 11 minutes for it); one line per model then says whether S3 holds its newest step. The sandbox goes
    either way: a GPU left running is worse than a lost step. Exit 6 when a push was not confirmed (the
    lines say which step is on S3), 2 when a sandbox could not be torn down.
    Example: artcloud down mail-agent
    """
    from artcloud.backends.state import StateDir
    from artcloud.runner import EXIT_PUSH_UNCONFIRMED

    state = StateDir()
    if all_ and names:
        raise CLIError("give sandbox names or --all, not both")
    if not all_ and not names:
        raise CLIError("name the sandboxes to tear down (`artcloud status` lists them), or pass --all")
    if all_:
        records = state.live()
        if not records:
            print("no live sandboxes")
            return
        if not yes and sys.stdin.isatty():
            typer.confirm(f"tear down {', '.join(r.name for r in records)}?", abort=True)
    else:
        records = [_known(name) for name in names]
    from artcloud.backends.deps import MissingDependency

    failed, unconfirmed, asked = [], [], {}
    for record in records:
        try:  # before the final push: a server asked to stop that cannot then be torn down helps nobody
            provider = asked.setdefault(record.provider, provisioner(record.provider))
        except MissingDependency as e:
            failed.append(f"{record.name} ({e})")
            continue
        stopped, lines, not_pushed = _final_push(state, record)
        for line in lines:
            print(f"{record.name}: {line}", flush=True)
        unconfirmed += [f"{record.name}/{label}" for label in not_pushed]
        try:
            existed = provider.destroy(record)
        except Exception as e:
            failed.append(f"{record.name} ({type(e).__name__}: {first_line(e)})")
            continue
        state.mark_down(record.name)
        # A Modal sandbox ends with its server's exit, which the final push asked for: still our teardown.
        print(f"{record.name}: {'torn down' if existed or stopped else 'already gone'}")
    also = f"; and the final push was not confirmed for {', '.join(unconfirmed)}" if unconfirmed else ""
    if failed:
        raise CLIError(f"could not tear down {', '.join(failed)}: run `artcloud down` again, or use the "
                       f"provider's own tool (`sky down NAME`, `modal sandbox list`){also}")
    if unconfirmed:
        print(f"artcloud: error: the final push was not confirmed for {', '.join(unconfirmed)} (torn down anyway): "
              "S3 holds only the older steps named above; train again from there", file=sys.stderr)
        raise typer.Exit(EXIT_PUSH_UNCONFIRMED)


def _final_push(state, record) -> tuple[bool, list[str], list[str]]:
    """Ask a live sandbox's server (with the credentials in the registry) to push its last checkpoint and
    exit. Returns whether the server answered (and is exiting), one line per model (or a note on why
    there was no push; none when there was no server to ask), and NAME@STEP of each model whose push the
    answer does not confirm."""
    from artcloud.backends.client import FINAL_PUSH_WAIT_S, Client, Endpoint, push_verdicts
    from artcloud.errors import ArtcloudError

    creds = state.credentials(record.name)
    if record.state != "up" or not record.url or creds is None or record.extra.get("run"):
        return False, [], []  # a detached run's loop pushes its own checkpoints
    ca, token = creds
    # SkyPilot: the launch CA alone (a bare IP, so no host name check). Modal: the public CAs of its edge.
    client = Client(Endpoint(record.url, token, ca or None, check_hostname=not ca))

    async def push() -> dict:
        try:
            # The server may spend wire.FINAL_PUSH_DEADLINE_S on the push: wait for its verdict, not less.
            return await client.shutdown(timeout=FINAL_PUSH_WAIT_S)
        finally:
            await client.drop_connection()

    try:
        answer = asyncio.run(push())
    except ArtcloudError as e:
        # Most often the server already left by itself (its lease ran out, after its own final push).
        return False, [f"no final push ({first_line(e)}); tearing down anyway"], []
    verdicts = push_verdicts(answer)
    if not verdicts:
        return True, ["server stopped (no models)"], []
    return True, [v.line(on_sandbox=True) for v in verdicts], [f"{v.name}@{v.step}" for v in verdicts if v.status == "not_pushed"]
