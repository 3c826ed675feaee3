"""A model's metric history, kept by the server: one record per training step and per `model.log` call.

Records are flat JSON objects. Every record has
    step    int, the model's step it describes (a training step's record: the step it committed)
    split   "train" for training steps; what model.log named ("val", "train", ...) for logged ones
    time    unix seconds when the server recorded it
    source  "train" (written by a training step) or "log" (POST /artcloud/models/{name}/log)
and every other key is a metric (a finite number), but a training record's `job_id` (a string):
    source=train  job_id, seconds, gradient_steps, groups, groups_skipped_equal_rewards, trajectories, samples,
                  reward_mean, reward_std, reward_min, reward_max, loss, grad_norm, clip_fraction, mean_ratio, kl
    source=log    what the client sent: model.log sends reward_mean/std/min/max, trajectories, exceptions,
                  exception_rate, each trajectory metric's mean under its own name, each group metric's mean
                  as group_metric_NAME, and the user's own `metrics=` (which win)

Where it is kept: in memory (GET /artcloud/models/{name} answers it), and as `history.jsonl` (one record a
line) plus `reward.svg` (reward_mean per step, one line per split) in two places:
  - inside every checkpoint folder, listed in its manifest: written in the checkpoint's temporary folder, so
    they are committed with the step (never half-written), verified, pushed to S3 and pulled (`artcloud
    pull`) with it. A resume restores the history from the checkpoint it resumes from;
  - in the model's folder, next to checkpoints/, replaced atomically after every record: the live copy,
    which also holds what was logged since the last commit. A resume on the same disk takes it when the
    checkpoint's history is where it begins;
and, with S3, history.jsonl alone under the model's prefix (PREFIX/PROJECT/NAME/history.jsonl), pushed by
the model's pusher after every model.log record (a training record is in its step's checkpoint already):
the live copy of a machine that may be gone. A fresh machine
resuming from S3 takes it by the same rule, so what was logged after the last commit is not lost.
Records of steps after the resumed one (a step set aside, or lost with its machine) are dropped on resume.

What comes from disk or S3 is untrusted: bounded in size, and a record that is not well-formed is skipped.
"""

from __future__ import annotations

import html
import json
import logging
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any

from artcloud.server.api_errors import ApiError
from artcloud.wire import MAX_METRICS, RESERVED, LogRequest

log = logging.getLogger("artcloud.server")

HISTORY_FILE = "history.jsonl"
PLOT_FILE = "reward.svg"
MAX_RECORDS = 20_000  # per model; logging beyond it is refused (409), a training step still records
MAX_HISTORY_BYTES = 64 << 20  # a history.jsonl read from disk or S3
MAX_LINES_READ = 4 * MAX_RECORDS  # lines of it looked at, from its end, for the newest MAX_RECORDS good ones


def training_record(step: int, job_id: str, stats: dict[str, Any], steps: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """A training step's record: the batch's stats, and the mean of each per-gradient-step metric."""
    record = {k: v for k, v in stats.items() if k != "skipped_groups"}
    record.update(step=step, split="train", source="train", job_id=job_id, time=time.time(), seconds=seconds,
                  gradient_steps=len(steps))
    for key in ("loss", "grad_norm", "clip_fraction", "mean_ratio", "kl", "kl_policy_ref", "learning_rate"):
        values = [s[key] for s in steps if key in s]
        if values:
            record[key] = sum(values) / len(values)
    return {k: v for k, v in record.items() if not isinstance(v, float) or math.isfinite(v)}  # JSON has no NaN


def log_record(req: LogRequest, step: int) -> dict[str, Any]:
    return {**req.metrics, "step": step, "split": req.split, "time": time.time(), "source": "log"}


def check_log(req: LogRequest, records: list[dict[str, Any]], name: str) -> None:
    """ApiError unless `req` may join `records`, model `name`'s history."""
    reserved = next((k for k in req.metrics if k in RESERVED), None)
    if reserved is not None:
        raise ApiError(400, "invalid_request", f"metrics.{reserved}: '{reserved}' is a field of every history record, "
                       "not a metric name: rename it", f"metrics.{reserved}")
    if len(records) >= MAX_RECORDS:
        raise ApiError(409, "history_full", f"{name} already has {len(records)} history records, the "
                       "most a model keeps: log less often, or fewer splits", "name")


def metric_by_step(records: list[dict[str, Any]], metric: str) -> dict[int, float]:
    """`metric` of each step: a bare name reads training records, `SPLIT/NAME` that split's (the last
    record of a step wins); `reward` means `reward_mean`, as ART's `val/reward`."""
    split, _, name = metric.rpartition("/") if "/" in metric else ("train", "", metric)
    name = "reward_mean" if name == "reward" else name
    out = {}
    for r in records:
        if r.get("split", "train") == split and _number(r.get(name)):
            out[r["step"]] = r[name]
    return out


# ---------------------------------------------------------------------------------------------- files


def to_jsonl(records: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r, sort_keys=True, allow_nan=False) + "\n" for r in records)


def write_files(folder: Path, records: list[dict[str, Any]]) -> list[str]:
    """history.jsonl and reward.svg into `folder` (a checkpoint's temporary folder); their names."""
    (folder / HISTORY_FILE).write_text(to_jsonl(records))
    (folder / PLOT_FILE).write_text(reward_svg(records))
    return [HISTORY_FILE, PLOT_FILE]


def write_live(model_dir: Path, records: list[dict[str, Any]]) -> None:
    """The model folder's copies, each replaced atomically (a reader sees the old file or the new one)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    for name, text in ((HISTORY_FILE, to_jsonl(records)), (PLOT_FILE, reward_svg(records))):
        tmp = model_dir / f".{name}.{uuid.uuid4().hex[:8]}.tmp"
        tmp.write_text(text)
        os.replace(tmp, model_dir / name)


def read_jsonl(path: Path) -> list[dict[str, Any]] | None:
    """The well-formed records of a history.jsonl (None if there is none, or it is too large to be one)."""
    try:
        if path.stat().st_size > MAX_HISTORY_BYTES:
            log.warning("%s is over %d bytes: not read", path, MAX_HISTORY_BYTES)
            return None
        text = path.read_text(errors="replace")
    except OSError:
        return None
    return parse_jsonl(text, str(path))


def parse_jsonl(text: str, where: str) -> list[dict[str, Any]]:
    """The well-formed records of a history.jsonl's text (from `where`, for the log), the newest MAX_RECORDS; the rest
    is skipped, with one warning. The text may be anyone's (S3): it is read from its end, line by line, and no more
    than MAX_LINES_READ lines are looked at (security review 3, N6: 8 MiB of junk lines logged 4 million warnings, and
    63 MiB of records took 2 GB to parse whole)."""
    records: list[dict[str, Any]] = []
    skipped, last_problem, end, looked = 0, "", len(text), 0
    while end > 0 and len(records) < MAX_RECORDS and looked < MAX_LINES_READ:
        start = text.rfind("\n", 0, end) + 1
        line, end = text[start:end], start - 1
        if not line.strip():
            continue
        looked += 1
        try:
            record, problem = valid_record(json.loads(line))
        except (ValueError, OverflowError, TypeError, RecursionError) as e:  # ValueError: JSONDecodeError, huge ints
            record, problem = None, f"not JSON ({type(e).__name__})"
        if problem is not None:
            skipped += 1
            last_problem = last_problem or problem  # the last bad line's: the text is read from its end
            continue
        records.append(record)
    if skipped:
        log.warning("%s: %d line(s) skipped (the last: %s)", where, skipped, last_problem)
    if end > 0 and looked >= MAX_LINES_READ:
        log.warning("%s: only its last %d lines were read", where, looked)
    records.reverse()
    return records


def valid_record(record: Any) -> tuple[Any, str | None]:
    """`record` and what is wrong with it (None: it is well-formed, see the module's docstring). Records
    older than `split` and `source` (artcloud before issue 17 kept only training records) are training records."""
    if not isinstance(record, dict):
        return record, "not a JSON object"
    record = {"split": "train", "source": "train", **record}
    if type(record.get("step")) is not int or record["step"] < 0:
        return record, "'step' is not an integer >= 0"
    if len(record) > MAX_METRICS + 32:
        return record, f"more than {MAX_METRICS + 32} keys"
    for key, value in record.items():
        if key in ("split", "source", "job_id"):
            ok = isinstance(value, str) and len(value) <= 200
        elif key == "step":
            ok = True
        else:
            ok = isinstance(key, str) and len(key) <= 128 and _number(value)
        if not ok:
            return record, f"bad {key[:40]!r}"
    return record, None


def restore(checkpoint: Path, model_dir: Path, step: int, state: dict[str, Any],
            remote: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The history a model resumed at `step` from `checkpoint` continues (see the module's docstring):
    the checkpoint's, or a live copy it begins: the model folder's, else `remote` (S3's, parsed)."""
    records = read_jsonl(checkpoint / HISTORY_FILE)
    if records is None:  # a checkpoint written before history.jsonl: the history was in the trainer state
        records, old = [], state.get("history")
        for r in (old if isinstance(old, list) else [])[-MAX_RECORDS:]:
            record, problem = valid_record(r)
            if problem is None:
                records.append(record)
    for live in (read_jsonl(model_dir / HISTORY_FILE), remote):
        if live is not None and live[:len(records)] == records:
            records = live
            break
    return [r for r in records if r["step"] <= step]


# ---------------------------------------------------------------------------------------------- the plot

_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")


def reward_svg(records: list[dict[str, Any]], width: int = 640, height: int = 360) -> str:
    """reward_mean per step, one line per split (train first, then val, then the rest): plain SVG, so
    the server needs no plotting library and a browser shows it as it is."""
    series: dict[str, dict[int, float]] = {}
    for r in records:
        if _number(r.get("reward_mean")):
            series.setdefault(r.get("split", "train"), {})[r["step"]] = float(r["reward_mean"])
    order = sorted(series, key=lambda s: (s != "train", s != "val", s))[:len(_COLORS)]
    left, right, top, bottom = 56, 16, 28, 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
           'font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="18" text-anchor="middle">reward (mean) per step</text>']
    points = [(s, y) for name in order for s, y in series[name].items()]
    if not points:
        out.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle" fill="gray">no rewards recorded yet</text>')
        return "\n".join(out + ["</svg>"]) + "\n"
    x0, x1 = min(s for s, _ in points), max(s for s, _ in points)
    y0, y1 = min(y for _, y in points), max(y for _, y in points)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    pw, ph = width - left - right, height - top - bottom

    def xy(step: int, y: float) -> str:
        return f"{left + (step - x0) / (x1 - x0) * pw:.1f},{top + (y1 - y) / (y1 - y0) * ph:.1f}"

    out.append(f'<polyline points="{left},{top} {left},{top + ph} {left + pw},{top + ph}" fill="none" stroke="black"/>')
    for y, anchor_y in ((y1, top + 4), (y0, top + ph)):
        out.append(f'<text x="{left - 6}" y="{anchor_y}" text-anchor="end">{y:.3g}</text>')
    for s, anchor in ((x0, "start"), (x1, "end")):
        out.append(f'<text x="{left if anchor == "start" else left + pw}" y="{top + ph + 16}" text-anchor="{anchor}">{s}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 6}" text-anchor="middle">step</text>')
    for i, name in enumerate(order):
        color, data = _COLORS[i], sorted(series[name].items())
        path = " ".join(xy(s, y) for s, y in data)
        out.append(f'<polyline class="{html.escape(name)}" points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        out.extend(f'<circle cx="{xy(s, y).split(",")[0]}" cy="{xy(s, y).split(",")[1]}" r="2.5" fill="{color}"/>'
                   for s, y in data)
        out.append(f'<text x="{left + 8 + 90 * i}" y="{top + 14}" fill="{color}">{html.escape(name)}</text>')
    return "\n".join(out + ["</svg>"]) + "\n"


def _number(value: Any) -> bool:
    """A metric: a finite float, or an int a float holds exactly (a larger one overflowed math.isfinite: N6)."""
    return type(value) is float and math.isfinite(value) or type(value) is int and abs(value) <= 2**53
