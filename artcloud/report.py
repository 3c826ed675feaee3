"""What `model.log` and each training step report: aggregates of trajectories, and Weights & Biases.

The server keeps the history (artcloud/server/history.py): every training step's record and every
`model.log` call's land there, so a resumed run's history goes on. This module makes the numbers a log
call sends (ART's aggregates) and, when asked, mirrors each record to W&B, as ART does:

    report_metrics=["wandb"]  on Model / TrainableModel, or None (the default) with WANDB_API_KEY set;
                              [] turns it off
    run                       wandb.init(project=PROJECT, name=NAME, id=NAME, resume="allow"): a resumed
                              run (or a new process) goes on with the same W&B run
    keys                      SPLIT/NAME for each metric of the record (reward_mean as SPLIT/reward, ART's
                              name), against `training_step` as the x axis; SPLIT/rewards, a histogram of
                              the rewards; SPLIT/samples, a table of a few trajectories (step, reward, text)

wandb is imported only when W&B reporting is on.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

from artcloud.errors import InvalidArgument, WrongType
from artcloud.types import Trajectory, TrajectoryGroup

REPORTERS = ("wandb",)
MAX_SAMPLES = 8  # trajectories in a step's W&B table
MAX_TEXT = 4000  # characters of one trajectory's text in that table
_NOT_METRICS = ("step", "split", "time", "source", "job_id")


def check_reporting(value: Any) -> list[str] | None:
    """`report_metrics` as given, if valid: None (the default: W&B when WANDB_API_KEY is set) or a list of
    names from REPORTERS; and wandb installed if W&B reporting is on: a missing package is one line now,
    not an error after the first training step."""
    if value is not None and (isinstance(value, str) or not isinstance(value, (list, tuple))):
        raise WrongType(f"report_metrics must be a list such as ['wandb'] (or [] for none), not {value!r}",
                        field="report_metrics")
    unknown = [v for v in value or [] if v not in REPORTERS]
    if unknown:
        raise InvalidArgument(f"report_metrics: {unknown[0]!r} is not known; artcloud reports to {list(REPORTERS)}",
                              field="report_metrics")
    value = None if value is None else list(value)
    if wandb_enabled(value):
        _require_wandb()
    return value


def _require_wandb() -> None:
    from artcloud.backends.deps import require

    require("wandb", "W&B reporting (report_metrics=['wandb'], or WANDB_API_KEY set; report_metrics=[] turns it off)")


def wandb_enabled(report_metrics: list[str] | None) -> bool:
    """ART's rule: asked for by name, or by default when WANDB_API_KEY is set."""
    if report_metrics is None:
        return bool(os.environ.get("WANDB_API_KEY"))
    return "wandb" in report_metrics


@dataclass
class Batch:
    """What one log call reports: its aggregates, its rewards (for the histogram) and its trajectories."""

    metrics: dict[str, float] = field(default_factory=dict)
    rewards: list[float] = field(default_factory=list)
    trajectories: list[Trajectory] = field(default_factory=list)


def summarize(items: Iterable[Any] | None) -> Batch:
    """ART's aggregates of a batch: trajectories (and exceptions, a failed rollout's), or groups of them.

    reward_mean/std/min/max, trajectories (how many), exceptions and exception_rate, the mean of each
    trajectory metric under its own name, and each group metric's mean as group_metric_NAME."""
    batch = Batch()
    if items is None:
        return batch
    items = list(items)
    groups = [g for g in items if isinstance(g, TrajectoryGroup)]
    loose = [t for t in items if not isinstance(t, TrajectoryGroup)]
    exceptions = 0
    per_metric: dict[str, list[float]] = {}
    group_metrics: dict[str, list[float]] = {}
    for i, item in enumerate(loose):
        if isinstance(item, BaseException):
            exceptions += 1
        elif isinstance(item, Trajectory):
            batch.trajectories.append(item)
        else:
            raise WrongType(f"trajectories[{i}] is a {type(item).__name__}: model.log takes Trajectory objects (or "
                            "exceptions), or TrajectoryGroups", field=f"trajectories[{i}]")
    for group in groups:
        if group.pending:
            raise InvalidArgument("a group still has rollouts to run: gather it first (artcloud.gather_trajectory_groups)",
                                  field="trajectories")
        exceptions += len(getattr(group, "exceptions", None) or [])
        for name, value in group.metrics.items():
            group_metrics.setdefault(f"group_metric_{name}", []).append(float(value))
    # One trajectory from each group in turn, so a table of the first few shows several prompts.
    for i in range(max((len(g.trajectories) for g in groups), default=0)):
        batch.trajectories.extend(g.trajectories[i] for g in groups if i < len(g.trajectories))
    for t in batch.trajectories:
        batch.rewards.append(float(t.reward))
        for name, value in t.metrics.items():
            per_metric.setdefault(name, []).append(float(value))
    m = batch.metrics
    if batch.rewards:
        n = len(batch.rewards)
        mean = sum(batch.rewards) / n
        m.update(reward_mean=mean, reward_std=math.sqrt(sum((r - mean) ** 2 for r in batch.rewards) / n),
                 reward_min=min(batch.rewards), reward_max=max(batch.rewards))
    m["trajectories"] = len(batch.trajectories)
    m["exceptions"] = exceptions
    if batch.trajectories or exceptions:
        m["exception_rate"] = exceptions / (len(batch.trajectories) + exceptions)
    for source in (per_metric, group_metrics):
        for name, values in source.items():
            m.setdefault(name, sum(values) / len(values))
    return batch


def check_metrics(metrics: Any) -> dict[str, float]:
    """The user's `metrics=`: a dict of finite numbers by name."""
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise WrongType(f"metrics must be a dict of numbers by name, not {type(metrics).__name__}", field="metrics")
    out = {}
    for name, value in metrics.items():
        if type(value) is bool or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidArgument(f"metrics[{name!r}] must be a finite number, not {value!r}", field=f"metrics.{name}")
        out[str(name)] = float(value)
    return out


def trajectory_text(t: Trajectory) -> str:
    """A trajectory as text for a table: one `role: content` block per message or sampled turn."""
    parts = []
    for item in t.messages_and_choices:
        if not isinstance(item, dict):
            item = item.model_dump(mode="json", exclude_none=True) if hasattr(item, "model_dump") else {}
        message = item.get("message", item)
        content = message.get("content")
        if not isinstance(content, str):
            content = json.dumps(content) if content is not None else ""
        if message.get("tool_calls"):
            content += "\n" + json.dumps(message["tool_calls"])
        parts.append(f"{message.get('role', 'assistant')}: {content}")
    text = "\n".join(parts)
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT - 3] + "..."


class WandbReporter:
    """One model's W&B run, made on first use (wandb imported then)."""

    def __init__(self, project: str, name: str, config: dict[str, Any] | None = None):
        self.project = project
        self.name = name
        self.config = config if config is not None else {}  # the run's config (the model's update_wandb_config)
        self._run: Any = None
        self._splits: set[str] = set()

    def run(self) -> Any:
        _require_wandb()
        import wandb

        if self._run is None or getattr(self._run, "_is_finished", False):
            run = wandb.init(project=self.project, name=self.name, id=self.name, resume="allow",
                             config=dict(self.config) or None)
            run.define_metric("training_step")
            self._run, self._splits = run, set()
        return self._run

    def update_config(self, changes: dict[str, Any]) -> None:
        """The run's config gains `changes` (merge_config has checked them): at once if the run exists."""
        if self._run is not None and not getattr(self._run, "_is_finished", False):
            self._run.config.update(changes)

    def report(self, record: dict[str, Any], batch: Batch | None = None) -> dict[str, Any]:
        """Log a history record (and its batch's reward histogram and sample table) to W&B; what was logged."""
        run = self.run()
        import wandb

        split, step = record["split"], record["step"]
        if split not in self._splits:  # ART's x axis: the training step, so a late val log lands where it belongs
            run.define_metric(f"{split}/*", step_metric="training_step")
            self._splits.add(split)
        data: dict[str, Any] = {"training_step": step}
        for key, value in record.items():
            if key not in _NOT_METRICS and type(value) in (int, float):
                data[f"{split}/{'reward' if key == 'reward_mean' else key}"] = value
        if batch is not None and batch.rewards:
            data[f"{split}/rewards"] = wandb.Histogram(batch.rewards)
        if batch is not None and batch.trajectories:
            rows = [[step, t.reward, trajectory_text(t)] for t in batch.trajectories[:MAX_SAMPLES]]
            data[f"{split}/samples"] = wandb.Table(columns=["step", "reward", "trajectory"], data=rows)
        run.log(data)
        return data

    def finish(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


def merge_config(existing: dict[str, Any], updates: dict[str, Any], path: str = "") -> dict[str, Any]:
    """`existing` with `updates` merged in, nested dicts key by key, as OpenPipe ART's update_wandb_config does: a
    W&B run's config is set once, so a key already set to another value is an InvalidArgument naming it."""
    merged = dict(existing)
    for key, value in updates.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in merged:
            merged[key] = value
        elif isinstance(merged[key], dict) and isinstance(value, dict):
            merged[key] = merge_config(merged[key], value, where)
        elif merged[key] != value:
            raise InvalidArgument(f"the W&B config is set once per run: {where!r} is {merged[key]!r} already, not "
                                  f"{value!r}", field=where)
    return merged
