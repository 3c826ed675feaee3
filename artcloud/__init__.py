"""artcloud: train LLM agents with GRPO on LoRA adapters, on GPUs that live only as long as the job.

`import artcloud` stays light: torch, transformers, fastapi, sky, modal and boto3 load only when a code
path needs them (the server, an engine, a provisioner). Backends and the model classes load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from artcloud._version import __version__
from artcloud.errors import (
    APIError,
    ArtcloudError,
    BadRequest,
    Conflict,
    InvalidArgument,
    MissingDependency,
    ModelLocked,
    NotFound,
    NotInArtcloud,
    NotSupported,
    RateLimited,
    TimedOut,
    Unauthorized,
    Unavailable,
    WrongState,
    WrongType,
)
from artcloud.types import LoraConfig, TrainConfig, Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from artcloud import dev, local, trajectories, utils  # OpenPipe ART's modules: artcloud.utils.iterate_dataset, ...
    from artcloud.backends.client import ServerGone, VersionMismatch
    from artcloud.backends.from_env import backend_from_env
    from artcloud.backends.local import LocalBackend
    from artcloud.backends.modal import ModalBackend, ModalError
    from artcloud.backends.remote import Backend, RemoteBackend
    from artcloud.backends.sky import SkyBackend, SkyError
    from artcloud.backends.spec import SandboxSpec
    from artcloud.gather import GatherError, gather_trajectories, gather_trajectory_groups, trajectory_group_batches
    from artcloud.model import LinearTemperatureAnnealer, Model, TrainableModel
    from artcloud.rewards import RulerError, ruler, ruler_score_group
    from artcloud.storage.checkpoints import CorruptCheckpoint
    from artcloud.storage.s3 import StorageError, pull_checkpoint
    from artcloud.streaming import collect_stream
    from artcloud.types import (
        History,
        LocalTrainResult,
        Messages,
        MessagesAndChoices,
        Tools,
        TrainResult,
        TrainSFTConfig,
    )
    from artcloud.utils import DatasetBatch, retry

# Loaded on first use: module -> the names it gives `artcloud` ("utils" is the module itself).
_LAZY = {name: module for module, names in {
    "artcloud.backends.local": ["LocalBackend"],
    "artcloud.backends.client": ["ServerGone", "VersionMismatch"],
    "artcloud.backends.remote": ["RemoteBackend", "Backend"],
    "artcloud.backends.sky": ["SkyBackend", "SkyError"],
    "artcloud.backends.spec": ["SandboxSpec"],
    "artcloud.backends.modal": ["ModalBackend", "ModalError"],
    "artcloud.backends.from_env": ["backend_from_env"],
    "artcloud.storage.s3": ["StorageError", "pull_checkpoint"],
    "artcloud.storage.checkpoints": ["CorruptCheckpoint"],
    "artcloud.gather": ["gather_trajectory_groups", "GatherError", "gather_trajectories", "trajectory_group_batches"],
    "artcloud.model": ["Model", "TrainableModel", "LinearTemperatureAnnealer"],
    "artcloud.rewards": ["ruler", "ruler_score_group", "RulerError"],
    "artcloud.streaming": ["collect_stream"],
    # OpenPipe ART's names and modules
    "artcloud.types": ["History", "Messages", "MessagesAndChoices", "Tools", "TrainSFTConfig", "LocalTrainResult",
                       "TrainResult"],
    "artcloud.utils": ["retry", "DatasetBatch", "utils"],
    "artcloud.dev": ["dev"],
    "artcloud.local": ["local"],
    "artcloud.trajectories": ["trajectories"],
}.items() for name in names}

__all__ = [
    "__version__", "LoraConfig", "TrainConfig", "Trajectory", "TrajectoryGroup",
    "LocalBackend", "RemoteBackend", "Backend", "SkyBackend", "SandboxSpec", "SkyError", "ModalBackend", "ModalError",
    "ArtcloudError", "ServerGone", "VersionMismatch", "backend_from_env", "gather_trajectory_groups", "GatherError",
    "Model", "TrainableModel", "TrainResult", "LinearTemperatureAnnealer", "pull_checkpoint",
    "ruler", "ruler_score_group", "RulerError", "collect_stream",
    "InvalidArgument", "WrongType", "NotSupported", "NotInArtcloud", "WrongState", "TimedOut", "MissingDependency",
    "StorageError", "CorruptCheckpoint",
    "APIError", "BadRequest", "Unauthorized", "NotFound", "Conflict", "ModelLocked", "RateLimited", "Unavailable",
    "History", "Messages", "MessagesAndChoices", "Tools", "gather_trajectories", "retry", "DatasetBatch", "utils",
    "TrainSFTConfig", "LocalTrainResult", "trajectory_group_batches", "dev", "local", "trajectories",
]


# OpenPipe ART's top-level names that artcloud has no counterpart for, and what to write instead (README's
# "Coming from OpenPipe ART" table lists them as not supported).
_NOT_IN_ARTCLOUD = {
    "ServerlessBackend": "train on a cloud GPU of your own with artcloud.SkyBackend(gpu=...) or "
                         "artcloud.ModalBackend(...)",
    "auto_trajectory": "build an artcloud.Trajectory in the rollout from the Choices your client returns",
    "capture_auto_trajectory": "build an artcloud.Trajectory in the rollout from the Choices your client returns",
    "yield_trajectory": "return an artcloud.Trajectory from the rollout",
    "capture_yielded_trajectory": "return an artcloud.Trajectory from the rollout",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        if name in _NOT_IN_ARTCLOUD:
            raise NotInArtcloud(f"art.{name} is OpenPipe ART's and artcloud has no counterpart: "
                                f"{_NOT_IN_ARTCLOUD[name]}")
        raise AttributeError(f"module 'artcloud' has no attribute {name!r}")
    import importlib

    imported = importlib.import_module(module)
    value = imported if module == f"artcloud.{name}" else getattr(imported, name)  # a submodule, or a name in one
    globals()[name] = value
    return value
