"""`artcloud stage-model`: put a base model's weights in the user's own S3, where servers pull them from."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from artcloud.cli._app import CLIError, app


@app.command("stage-model")
def stage_model(
    model: str = typer.Argument(..., help="The model's hub id, e.g. Qwen/Qwen2.5-7B-Instruct: the name you register models on."),
    s3: Optional[str] = typer.Option(None, "--s3", help="Where to stage it: s3://BUCKET/PREFIX, the location the server gets with --s3 (its checkpoints live there too). Default: $ARTCLOUD_S3."),
    revision: str = typer.Option("main", "--revision", help="The hub revision (branch, tag or commit) to stage. Servers load 'main'."),
    endpoint_url: Optional[str] = typer.Option(None, "--endpoint-url", help="S3 endpoint of a non-AWS store (R2, MinIO, SeaweedFS, GCS). Default: $ARTCLOUD_S3_ENDPOINT_URL, else $AWS_ENDPOINT_URL, else AWS."),
    from_folder: Optional[Path] = typer.Option(None, "--from", help="Stage this local folder (config.json, tokenizer, *.safetensors) as MODEL instead of the Hugging Face cache's copy."),
) -> None:
    """Stage a base model's weights in your S3 bucket, so every sandbox pulls them from there.

    The files come from the Hugging Face cache (HF_HOME), downloaded from the hub first if missing, or from --from.

    They go to PREFIX/models/ORG--NAME/REVISION/, the manifest (size and sha256 of each file) last; files already there are not uploaded again.

    A server started with the same --s3 then pulls MODEL from there (parallel ranged GETs, every file verified) instead of the hub; a server that downloads a model from the hub stages it by itself, in the background.

    Credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or ARTCLOUD_S3_ACCESS_KEY_ID / ARTCLOUD_S3_SECRET_ACCESS_KEY).

    Example: artcloud stage-model Qwen/Qwen2.5-7B-Instruct --s3 s3://my-bucket/runs
    """
    from artcloud.storage.s3 import S3Config, StorageError, transfer_bar
    from artcloud.storage.weights import WeightsStore, check_model_id

    uri = s3 or os.environ.get("ARTCLOUD_S3")
    if not uri:
        raise CLIError("say where to stage the model: --s3 s3://BUCKET/PREFIX (or set ARTCLOUD_S3)")
    try:
        check_model_id(model, revision)
        config = S3Config.from_uri(uri, **({"endpoint_url": endpoint_url} if endpoint_url else {}))
        folder = _source(model, revision, from_folder)
        store = WeightsStore(config)
        store.check()  # credentials, bucket and write access, before hashing gigabytes
        with transfer_bar(f"stage {model}") as update:
            manifest = store.stage(model, folder, revision, progress=lambda done, total: update(completed=done, total=total))
    except StorageError as e:
        raise CLIError(str(e)) from e
    size = sum(f["size"] for f in manifest["files"])
    print(f"staged {model} ({revision}) from {folder}: {len(manifest['files'])} files, {size / 1e9:.2f} GB "
          f"at {store.url(model, revision)}; servers with --s3 {config.uri} now pull it from there")


def _source(model: str, revision: str, from_folder: Path | None) -> Path:
    """The folder to stage: --from, else the Hugging Face cache's snapshot (downloaded if the hub answers)."""
    if from_folder is not None:
        folder = from_folder.expanduser()
        if not folder.is_dir():
            raise CLIError(f"--from {from_folder}: no such folder; give the folder holding the model's config.json")
        return folder
    try:
        from huggingface_hub import constants
        from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError
    except ImportError as e:
        raise CLIError("reading the Hugging Face cache needs huggingface_hub: pip install huggingface_hub "
                       "(or stage a local folder with --from FOLDER)") from e
    from artcloud.errors import first_line
    from artcloud.storage.weights import local_snapshot

    offline = bool(constants.HF_HUB_OFFLINE)
    try:
        folder = local_snapshot(model, revision, download=not offline)
    except RepositoryNotFoundError as e:
        raise CLIError(f"the hub has no model {model!r} (or it is private: log in with `hf auth login`)") from e
    except GatedRepoError as e:
        raise CLIError(f"{model} is gated: accept its license on huggingface.co and log in with `hf auth login`") from e
    except Exception as e:  # no network (huggingface_hub's httpx errors), a proxy, a full disk
        if not isinstance(e, (HfHubHTTPError, OSError)) and not type(e).__module__.startswith("httpx"):
            raise
        raise CLIError(f"cannot download {model} ({revision}) from the hub: {first_line(e) or type(e).__name__}") from e
    if folder is None:
        raise CLIError(f"{model} ({revision}) is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                       "HF_HUB_OFFLINE=1 forbids downloading it: unset HF_HUB_OFFLINE, or stage a folder with --from")
    return folder
