"""The `artcloud` command line: one module per command group, all registered on one typer app.

    artcloud serve --path DIR [--host H] [--port P]     the training + inference server (HTTPS)   serve.py
    artcloud pull PROJECT/MODEL [--step N] [--to DIR]    a checkpoint from S3, verified             serve.py
    artcloud launch [--gpu H100:1] [--s3 ...]            the server on a cloud GPU (SkyPilot/Modal) cloud.py
    artcloud status | logs NAME [-f] | down NAME|--all   what this machine launched, and teardown   cloud.py
    artcloud run SCRIPT [--backend sky] [--detach]       a script on a sandbox of its own           run.py
    artcloud stage-model MODEL --s3 s3://BUCKET/PREFIX   a base model's weights into your S3        stage_model.py

`_app.py` holds the app, CLIError and `main`; the command modules import only it (and never each
other), so importing them in any order works. Heavy imports happen inside the commands.
"""

# Each registers its commands on `app`; this order is the order of `artcloud --help`.
from artcloud.cli import serve  # noqa: F401,I001
from artcloud.cli import cloud  # noqa: F401
from artcloud.cli import run  # noqa: F401
from artcloud.cli import stage_model  # noqa: F401
from artcloud.cli._app import CLIError, app, main

__all__ = ["CLIError", "app", "main"]
