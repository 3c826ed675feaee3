"""OpenPipe ART's `art.trajectories`: `from artcloud.trajectories import History, Trajectory, TrajectoryGroup`.
They are defined in artcloud.types."""

from artcloud.types import History, PydanticException, Trajectory, TrajectoryGroup

__all__ = ["History", "PydanticException", "Trajectory", "TrajectoryGroup"]
