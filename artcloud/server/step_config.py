"""A training step's TrainConfig as the server runs it, from what the client sent: the KL reference resolved to a
committed checkpoint folder here (a client's path is untrusted), and the learning rate scaled by the trend of the
groups' reward spread (OpenPipe ART's scale_learning_rate_by_reward_std_dev)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from artcloud.server.api_errors import ApiError
from artcloud.storage import checkpoints
from artcloud.types import TrainConfig


def resolve_reference(config: TrainConfig, model_folder: Path, name: str) -> TrainConfig:
    """`config` with its KL reference (kl_penalty_reference_step, kl_ref_adapter_path) as a committed checkpoint
    folder on this server, in kl_ref_adapter_path; ApiError 400 naming the field for one that is not: only a
    committed checkpoint under this server's root (ROOT/PROJECT/MODEL/checkpoints/STEP) is ever read."""
    if config.kl_penalty_reference_step is not None:
        folder = checkpoints.step_folder(model_folder, config.kl_penalty_reference_step)
        if folder is None:
            raise ApiError(400, "invalid_request", f"config.kl_penalty_reference_step: {name} has no committed "
                           f"checkpoint at step {config.kl_penalty_reference_step} on this server (it has "
                           f"{checkpoints.committed_steps(model_folder)})", "config.kl_penalty_reference_step")
        return config.model_copy(update={"kl_ref_adapter_path": str(folder)})
    if config.kl_ref_adapter_path is None:
        return config
    root = model_folder.parent.parent.resolve()
    folder = Path(config.kl_ref_adapter_path).resolve()
    inside = (len(folder.parents) > 3 and folder.parents[3] == root and folder.parent.name == "checkpoints"
              and checkpoints.STEP_NAME.fullmatch(folder.name) is not None)
    if not inside or checkpoints.step_folder(folder.parents[1], int(folder.name)) != folder:
        raise ApiError(400, "invalid_request", "config.kl_ref_adapter_path: not a committed checkpoint on this server: "
                       "give a TrainResult.checkpoint_path of a model registered here (or kl_penalty_reference_step "
                       "for one of this model's own steps)", "config.kl_ref_adapter_path")
    return config.model_copy(update={"kl_ref_adapter_path": str(folder)})


def reward_spread_trend(records: list[dict[str, Any]], step: int, reward_std_dev: float) -> float:
    """The learning rate's factor for scale_learning_rate_by_reward_std_dev: a line fitted to the training records'
    within-group reward std (`reward_std_dev`) by step, `step`'s own included; its value at `step` over its value at
    step 0 (the intercept). 1 with fewer than two points or an intercept <= 0 (as OpenPipe ART computed it). Held to
    [0, 1]: the rate only falls as the rewards converge; a line that crosses 0 would make it negative (gradient
    ascent), and one that rises would take it past the rate the client set."""
    points = {r["step"]: r["reward_std_dev"] for r in records
              if r.get("source") == "train" and isinstance(r.get("reward_std_dev"), (int, float))}
    points[step] = float(reward_std_dev)
    if len(points) < 2:
        return 1.0
    xs, ys = list(points), list(points.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    if intercept <= 0:
        return 1.0
    return min(max((slope * step + intercept) / intercept, 0.0), 1.0)
