"""Nightly GRPO training on Modal, from a Modal cron: no CI runner, no cloud account but Modal's.

Every night at 03:00 UTC a small CPU container on Modal runs `artcloud run` on train.py (the file next to
this one) with `--backend modal`: the training server comes up in a Modal Sandbox with an H100, the script
trains, checkpoints go to S3, and the sandbox is torn down however the run ends. A last
`artcloud down --all --yes` in the same container removes anything the run could not.

Deploy (once, and again after editing this file or train.py):

    modal secret create artcloud-nightly \\
        AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... ARTCLOUD_S3=s3://BUCKET/PREFIX
    modal deploy examples/ci/modal_cron.py

The secret `artcloud-nightly` must hold AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (write access to the
checkpoint bucket) and ARTCLOUD_S3 (s3://BUCKET/PREFIX); ARTCLOUD_S3_ENDPOINT_URL is optional (an
S3-compatible store other than AWS). No Modal token is needed: code running on Modal creates sandboxes in
its own workspace. To try it once without waiting for the night: `modal run examples/ci/modal_cron.py`.

What it costs at most: Modal's catalog has no price the runner can read, so PRICE_PER_HOUR says what an
H100 costs (about $3.95/h at the time of writing: check modal.com/pricing and update it); the run stops
at BUDGET_USD or after MAX_DURATION, whichever comes first: at most min($10, 3 h x $3.95 = $11.85) a night,
plus a few cents for this CPU container and S3 storage.

Importing this module contacts nobody: Modal is reached only by `modal deploy` / `modal run`.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import modal

TRAIN_PY = Path(__file__).with_name("train.py")  # added to the image; `modal deploy` uploads it
REMOTE_TRAIN_PY = "/root/train.py"
GPU = "H100"
MAX_DURATION = "3h"  # the runner stops the script, pushes the last checkpoint and tears down by then
BUDGET_USD = "10"
PRICE_PER_HOUR = "3.95"  # Modal's H100 price per hour; the budget is counted against it
STEPS = "50"
SUMMARY = "/tmp/artcloud-run.json"  # printed to the function's log at the end (`modal app logs artcloud-nightly`)
# This container's own limit: above MAX_DURATION, so that the runner ends a long run, not Modal.
TIMEOUT_S = 3 * 3600 + 15 * 60

app = modal.App("artcloud-nightly")

# artcloud comes from this checkout (it is not on PyPI): the files a wheel is built from, copied into a layer,
# then installed with the runner's extras. `.parent` never fails, also where Modal imports this file in the
# container (/root/modal_cron.py), where the image is not built again.
REPO = Path(__file__).resolve().parent.parent.parent
SOURCE = "/root/artcloud-src"
PACKAGE_FILES = ("pyproject.toml", "README.md", "LICENSE")
PACKAGE_DIRS = ("artcloud", "sky")  # sky/: the SkyPilot templates the package links to (artcloud/templates)
EXTRAS = "s3,modal"

image = modal.Image.debian_slim(python_version="3.12")
for _name in PACKAGE_FILES:
    image = image.add_local_file(REPO / _name, f"{SOURCE}/{_name}", copy=True)
for _name in PACKAGE_DIRS:
    image = image.add_local_dir(REPO / _name, f"{SOURCE}/{_name}", copy=True, ignore=["**/__pycache__"])
image = (
    image.run_commands(f"pip install '{SOURCE}[{EXTRAS}]'")
    .add_local_file(TRAIN_PY, REMOTE_TRAIN_PY)
)


def run_command(s3: str) -> list[str]:
    """The `artcloud run` command line the cron runs (a function so that tests can read it)."""
    return [
        "artcloud", "run", REMOTE_TRAIN_PY,
        "--backend", "modal",
        "--gpu", GPU,
        "--max-duration", MAX_DURATION,
        "--budget-usd", BUDGET_USD,
        "--price-per-hour", PRICE_PER_HOUR,
        "--s3", s3,
        "--summary", SUMMARY,
        "--", "--steps", STEPS,
    ]


@app.function(
    image=image,
    schedule=modal.Cron("0 3 * * *"),
    secrets=[modal.Secret.from_name("artcloud-nightly")],
    timeout=TIMEOUT_S,
)
def nightly() -> None:
    s3 = os.environ.get("ARTCLOUD_S3")
    if not s3:
        raise RuntimeError("the Modal secret 'artcloud-nightly' has no ARTCLOUD_S3 (s3://BUCKET/PREFIX)")
    try:
        code = subprocess.run(run_command(s3), check=False).returncode
    finally:
        # Belt and braces: whatever this container launched and the runner could not tear down.
        subprocess.run(["artcloud", "down", "--all", "--yes"], check=False)
        for path in (Path(SUMMARY).with_suffix(".md"), Path(SUMMARY)):
            if path.exists():
                print(path.read_text())
                break
    if code != 0:
        raise RuntimeError(f"artcloud run exited {code} (4: budget reached, 124: max duration, 5: teardown "
                           f"not confirmed; see the summary above)")


@app.local_entrypoint()
def main() -> None:
    """`modal run examples/ci/modal_cron.py`: one run now, on Modal, as the cron would."""
    nightly.remote()
