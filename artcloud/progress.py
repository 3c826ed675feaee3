"""How a training job shows itself to the caller: a rich progress bar over its events (`JobProgress`), and the
numbers of its history record (`record_numbers`: what TrainResult.metrics holds). model.py's train and
supervised.py's train_sft share them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from artcloud.wire import Event


def record_numbers(record: Mapping[str, Any]) -> dict[str, float]:
    """A history record's metrics: its numbers, without the step (ART scripts pass TrainResult.metrics on to
    `model.log(metrics=...)`, which takes metrics only)."""
    return {k: v for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "time")}


class JobProgress:
    """A rich progress bar over a job's gradient steps, with the latest loss; `verbose` also prints
    each event as a line (ART's verbose=True)."""

    def __init__(self, name: str, total: int, enabled: bool, verbose: bool = False):
        self.enabled = enabled
        self.verbose = verbose
        self.name = name
        self.total = total
        self._progress = None
        self._task = None

    def __enter__(self) -> "JobProgress":
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("[bold]train {task.fields[name]}"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[status]}"), TimeElapsedColumn(), transient=True)
            self._progress.start()
            self._task = self._progress.add_task("train", total=self.total, name=self.name, status="queued")
        return self

    def update(self, event: Event) -> None:
        data = event.data
        if self.verbose:
            from rich.console import Console

            shown = {k: v for k, v in data.items() if not isinstance(v, (dict, list))}
            Console(stderr=True).print(f"[dim]train {self.name}[/dim] {event.type}: "
                                       + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items()),
                                       markup=True, highlight=False)
        if self._progress is None:
            return
        if event.type == "start" and data.get("kind") == "sft":
            self._progress.update(self._task, status="supervised fine-tuning")
        elif event.type == "start":
            self._progress.update(self._task, status=f"{data.get('samples', 0)} samples, reward {data.get('reward_mean', 0):.3f}")
        elif event.type == "step":
            self._progress.update(self._task, completed=data["gradient_step"], total=data["gradient_steps"],
                                  status=f"loss {data['loss']:.4f}, grad norm {data['grad_norm']:.3f}")

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.stop()
