"""The optional packages a provider needs (artcloud[sky], [modal], [s3]), checked before they are used.

A laptop install may lack them; without this check the user meets `ModuleNotFoundError: No module named
'sky'` deep in a traceback. MissingDependency carries the one line that says what to install.
"""

from __future__ import annotations

import importlib.util

from artcloud.errors import ArtcloudError

EXTRAS = {"sky": ("SkyPilot", "sky"), "modal": ("Modal's client", "modal"), "boto3": ("boto3", "s3"),
          "wandb": ("wandb (Weights & Biases)", "wandb")}


class MissingDependency(ArtcloudError):
    """An optional package is not installed here; the message names the pip extra that brings it."""

    code = "missing_dependency"


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
        raise MissingDependency(f"{purpose} needs {what}, which is not installed here: pip install 'artcloud[{extra}]'",
                                code="missing_dependency")
