"""The typer app every command registers on, the one error the CLI prints, and `main`.

This module imports nothing of the command modules: they import it (artcloud/cli/__init__.py loads
them all), so there is no import cycle.
"""

from __future__ import annotations

import sys

import typer

from artcloud.errors import ArtcloudError

app = typer.Typer(
    name="artcloud",
    help="Train LLM agents with GRPO on LoRA adapters, on GPUs that live only as long as the job.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class CLIError(ArtcloudError):
    """Printed as one line on stderr; the process exits with status 2."""

    code = "cli_usage"


@app.callback()
def _root() -> None:
    """artcloud: a training server you can run here or on a short-lived cloud GPU."""


def env_pairs(pairs: list[str]) -> dict[str, str]:
    """--env KEY=VALUE options (launch, run) as a dict."""
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CLIError(f"--env takes KEY=VALUE, not {pair!r}")
        env[key] = value
    return env


def main(argv: list[str] | None = None) -> None:
    from artcloud.backends.sky_server import LocalSkyServer

    sky_server = LocalSkyServer()  # SkyPilot's SDK may start its local API server; we stop what we started
    try:
        _main(argv)
    finally:
        said = sky_server.after()
        if said:
            print(said, file=sys.stderr)


def _main(argv: list[str] | None) -> None:
    try:
        app(args=argv, standalone_mode=True)
    except CLIError as e:
        print(f"artcloud: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:
        # artcloud.backends.deps.MissingDependency (and the like), from whichever command met it: its message
        # names the pip extra to install. Matched by its stable code, so that this module imports no backend.
        if getattr(e, "code", None) != "missing_dependency":
            raise
        print(f"artcloud: error: {e}", file=sys.stderr)
        sys.exit(2)
