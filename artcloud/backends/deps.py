"""The optional packages a provider needs (artcloud[sky], [sky-CLOUD], [modal], [s3]), checked before they are used.

A laptop install may lack them; without this check the user meets `ModuleNotFoundError: No module named
'sky'` deep in a traceback. MissingDependency carries the one line that says what to install.
"""

from __future__ import annotations

import importlib.util
import re

from artcloud.errors import MissingDependency  # defined with the other errors; still importable from here

EXTRAS = {"sky": ("SkyPilot", "sky"), "modal": ("Modal's client", "modal"), "boto3": ("boto3", "s3"),
          "wandb": ("wandb (Weights & Biases)", "wandb")}
# SkyPilot installs no cloud's SDK: each is an extra of its own (skypilot[aws], ...). artcloud[sky-CLOUD] is
# artcloud[sky] plus skypilot[CLOUD], for the clouds that have GPUs, can open artcloud's port and need an SDK
# (Lambda, Fluidstack, Paperspace, ... need none: artcloud[sky] is enough there). pyproject.toml lists the same;
# tests/laptop/test_sky_pins.py pins both against the installed SkyPilot's extras.
SKY_CLOUD_EXTRAS = ("aws", "gcp", "azure", "kubernetes", "nebius", "runpod", "vast", "oci", "do", "cudo", "seeweb")
_SKY_CLOUD_ALIASES = {"k8s": "kubernetes", "ssh": "kubernetes", "digitalocean": "do"}  # SSH node pools: kubernetes' SDK
# How `sky check` says a cloud's Python SDK is missing (clouds/aws.py:1063-1066, runpod.py:314-315, vast.py:314,
# adaptors/*.py "Failed to import dependencies"); a missing system tool (`socat`) is no pip install.
_SDK_MISSING = re.compile(r"pip install|Failed to import|No module named", re.IGNORECASE)


def installed(module: str) -> bool:
    """Whether `module` is importable as a real package. A folder named like it (a checkout's top-level
    `sky/`, which holds YAML templates) is only a namespace package: that is not SkyPilot."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # ValueError: sys.modules[module] is None (an import that was blocked)
        return False
    return spec is not None and spec.origin not in (None, "namespace")


def require(module: str, purpose: str) -> None:
    """Raise MissingDependency, naming the extra to install, unless `module` (a key of EXTRAS) is installed."""
    if not installed(module):
        what, extra = EXTRAS[module]
        raise MissingDependency(f"{purpose} needs {what}, which is not installed here: pip install 'artcloud[{extra}]'")


def sky_cloud_install(cloud: str, reason: str | None = None) -> str | None:
    """`pip install 'artcloud[sky-CLOUD]'` for a cloud whose SDK is an extra, or None. With `reason` (what
    `sky check` said), only when that reason is a missing SDK."""
    key = _SKY_CLOUD_ALIASES.get(cloud.lower(), cloud.lower())
    if key not in SKY_CLOUD_EXTRAS or (reason is not None and not _SDK_MISSING.search(reason)):
        return None
    return f"pip install 'artcloud[sky-{key}]'"
