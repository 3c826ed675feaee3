"""artcloud: train LLM agents with GRPO on LoRA adapters, on GPUs that live only as long as the job.

`import artcloud` stays light: torch, transformers, fastapi, sky, modal and boto3 load only
when a code path needs them (the server, an engine, a provisioner).
"""

from artcloud._version import __version__
from artcloud.types import (
    LoraConfig,
    TrainConfig,
    Trajectory,
    TrajectoryGroup,
)

__all__ = [
    "__version__",
    "LoraConfig",
    "TrainConfig",
    "Trajectory",
    "TrajectoryGroup",
]
