"""The end-of-run report of `artcloud run`: the summary dict as JSON, and as Markdown for people and GitHub Actions.

Stdlib only (and artcloud's own): the runner imports this on a laptop, where neither torch nor rich may be installed.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from artcloud.errors import InvalidArgument
from artcloud.storage.checkpoints import write_atomic

__all__ = ["downsample", "format_seconds", "render_markdown", "sparkline", "write_summary"]

_BARS = "▁▂▃▄▅▆▇█"
_MAX_POINTS = 60  # past this a chart's data array stops being readable in the Markdown source
_TABLE_STEPS = 10

_STATUS = {
    "succeeded": "succeeded",
    "script_failed": "failed: the script failed",
    "launch_failed": "failed: launch failed",
    "interrupted": "stopped: interrupted",
    "timeout": "stopped: time limit reached",
    "budget": "stopped: budget reached",
    "detached": "detached: the loop runs on the sandbox",
    "teardown_failed": "failed: teardown failed",
}

# A step summary is often readable by everyone with access to the repository, so a secret passed as a script
# argument (`--api-key sk-...`) must not be echoed there even though the runner never means to put one in.
# A flag is secret-looking when one of its words (split at - and _) is one of these: --hf-token, --api-key,
# --openai_api_key, --apikey; not --max-tokens, --tokenizer or --keep-last.
_SECRET_WORDS = {"token", "key", "apikey", "secret", "password", "passwd", "credential", "credentials"}


def _secret_flag(arg: str) -> bool:
    return arg.startswith("-") and bool(_SECRET_WORDS & set(re.split(r"[-_]+", arg.lstrip("-").lower())))


def format_seconds(s: float) -> str:
    """3s, 41m 12s, 2h 05m.

    durations.format_duration drops the seconds under an hour ("41m"), too coarse for a run report.
    """
    s = int(round(max(s, 0.0)))
    if s < 60:
        return f"{s}s"
    minutes, seconds = divmod(s, 60)
    if minutes < 60:
        return f"{minutes}m {seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


def downsample(values: list[float], n: int) -> list[float]:
    """At most n values: the input cut into n contiguous buckets, each replaced by its mean.

    Averaging, not picking every k-th value, so a noisy reward curve keeps its trend instead of its outliers.
    """
    values = list(values)
    if n <= 0:
        return []
    if len(values) <= n:
        return values
    out = []
    for i in range(n):
        bucket = values[i * len(values) // n : (i + 1) * len(values) // n]
        out.append(sum(bucket) / len(bucket))
    return out


def sparkline(values: list[float]) -> str:
    """One bar character a value, lowest to highest; a flat series draws as a flat middle line."""
    if not values:
        return ""
    lo, hi = min(values), max(values)
    if hi - lo <= 1e-12 * max(1.0, abs(hi)):
        return _BARS[3] * len(values)
    top = len(_BARS) - 1
    return "".join(_BARS[min(top, int((v - lo) / (hi - lo) * top + 0.5))] for v in values)


def render_markdown(summary: dict) -> str:
    """A GitHub-flavoured Markdown report of one run: status, key facts, and one section a model."""
    name = summary.get("run") or "(unnamed)"
    outcome = summary.get("outcome") or "unknown"
    status = _STATUS.get(outcome, f"failed: {_cell(str(outcome))}")
    lines = [f"## artcloud run {_cell(name)}: {status}", "", "| | |", "|---|---|"]
    for key, value in _facts(summary):
        lines.append(f"| {key} | {value} |")
    lines += _cold_start_section(summary.get("cold_start"))
    models = summary.get("models") or []
    if not models:
        lines += ["", "_No models were trained in this run._"]
    for model in models:
        lines += [""] + _model_section(model)
    return "\n".join(lines) + "\n"


def write_summary(summary: dict, path: str | Path) -> tuple[Path, Path]:
    """Write the JSON at `path` and the Markdown beside it (same name, .md); return both paths.

    When $GITHUB_STEP_SUMMARY is set, the Markdown is also appended there: GitHub's contract is append,
    since several steps of one job share that file.
    """
    json_path = Path(path)
    if json_path.suffix.lower() == ".md":
        raise InvalidArgument(f"{json_path} is the Markdown path: give the JSON path; the .md is written beside it")
    md_path = json_path.with_suffix(".md")
    markdown = render_markdown(summary)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(json_path, json.dumps(summary, indent=2, ensure_ascii=False, default=str) + "\n")
    write_atomic(md_path, markdown)
    step_summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if step_summary:
        with open(step_summary, "a", encoding="utf-8") as f:
            f.write(markdown + "\n")
    return json_path, md_path


def _cell(value: object) -> str:
    # A `|` ends a table cell even inside a code span in GFM; a newline ends the row.
    return str(value).replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def _code(value: object) -> str:
    text = str(value)
    return f"`{_cell(text)}`" if "`" not in text else _cell(text)


def _usd(x: float) -> str:
    return f"${x:,.2f}"


def _num(x: object) -> str:
    return f"{x:.4g}" if _finite(x) else "—"


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def redacted(args: list) -> list[str]:
    """The script's arguments as they may be shown: the value of a secret-looking flag (--api-key X, --hf-token=X) is ***."""
    out, hide_next = [], False
    for arg in map(str, args):
        flag, eq, _ = arg.partition("=")
        if hide_next:
            out.append("***")
        elif eq and _secret_flag(flag):
            out.append(f"{flag}=***")
        else:
            out.append(arg)
        hide_next = not eq and _secret_flag(arg)
    return out


def _facts(s: dict) -> list[tuple[str, str]]:
    facts = [("script", _code(" ".join([str(s.get("script") or "?"), *redacted(s.get("args") or [])])))]
    backend = str(s.get("backend") or "?") + (f", {s['gpu']}" if s.get("gpu") else "")
    facts.append(("backend", _cell(backend + (" (detached)" if s.get("detached") else ""))))
    if s.get("sandbox"):
        facts.append(("sandbox", _code(s["sandbox"])))
    if s.get("started_at"):
        facts.append(("started", _cell(s["started_at"])))
    wall = format_seconds(s["wall_time_s"]) if _finite(s.get("wall_time_s")) else "unknown"
    if _finite(s.get("max_duration_s")):
        wall += f" (limit {format_seconds(s['max_duration_s'])})"
    facts.append(("wall time", wall))
    facts.append(("estimated cost", _cost(s)))
    lost = [p for p in (s.get("preemptions") or []) if isinstance(p, dict)]
    if lost:
        costs = [p["cost_usd"] for p in lost if _finite(p.get("cost_usd"))]
        paid = f", {_usd(sum(costs))} of machine time before {'they were' if len(lost) > 1 else 'it was'} taken back" if costs else ""
        facts.append(("preemptions", _cell(f"{len(lost)} (the run went on on a new machine from the last checkpoint on S3{paid})")))
    exit_line = f"{s.get('exit_code', '?')}"
    if s.get("script_exit_code") is not None and s.get("script_exit_code") != s.get("exit_code"):
        exit_line += f" (script: {s['script_exit_code']})"
    facts.append(("exit code", _cell(exit_line + (f": {s['reason']}" if s.get("reason") else ""))))
    teardown = s.get("teardown") or {}
    if teardown:
        state = "ok" if teardown.get("ok") else "FAILED"
        facts.append(("teardown", _cell(state + (f": {teardown['detail']}" if teardown.get("detail") else ""))))
    if s.get("s3"):
        facts.append(("S3", _code(s["s3"])))
    return facts


def _cost(s: dict) -> str:
    cost, budget, price = s.get("estimated_cost_usd"), s.get("budget_usd"), s.get("price_per_hour")
    text = _usd(cost) if _finite(cost) else "unknown (pass --price-per-hour)"
    if _finite(budget):
        text += f" of {_usd(budget)} budget"
    if _finite(cost) and _finite(price):
        text += f" (at {_usd(price)}/h)"
    return text


def _cold_start_section(rows: object) -> list[str]:
    """Where the start-up went: one row a phase (provision, install, start, weights, engine, first rollout)."""
    rows = [r for r in rows if isinstance(r, dict) and _finite(r.get("seconds"))] if isinstance(rows, list) else []
    if not rows:
        return []
    lines = ["", "### Cold start", "", "| phase | duration | cost |", "|---|---:|---:|"]
    for r in rows:
        cost = _cents(r["cost_usd"]) if _finite(r.get("cost_usd")) else "—"
        lines.append(f"| {_cell(r.get('phase', '?'))} | {_short(r['seconds'])} | {cost} |")
    total = sum(r["seconds"] for r in rows)
    costs = [r["cost_usd"] for r in rows if _finite(r.get("cost_usd"))]
    lines.append(f"| **total** | {_short(total)} | {_cents(sum(costs)) if costs else '—'} |")
    return lines


def _short(s: float) -> str:
    """Tenths under 10 s (a first rollout takes 0.4 s), else as format_seconds."""
    return f"{max(s, 0.0):.1f}s" if s < 9.95 else format_seconds(s)


def _cents(x: float) -> str:
    """A phase of seconds on a GPU costs fractions of a cent: show them."""
    return f"${x:.4f}" if 0 < abs(x) < 0.01 else _usd(x)


def _model_section(model: dict) -> list[str]:
    title = "/".join(str(p) for p in (model.get("project"), model.get("name")) if p) or "(unnamed model)"
    history = [h for h in (model.get("history") or []) if isinstance(h, dict)]
    steps = model.get("step")
    if not _finite(steps):
        steps = max((h["step"] for h in history if _finite(h.get("step"))), default=0)
    lines = [f"### {_cell(title)}", ""]
    base = f" from {_code(model['base_model'])}" if model.get("base_model") else ""
    lines.append(f"Trained {steps} step{'s' if steps != 1 else ''}{base}.")
    rewarded = [(h.get("step"), h["reward_mean"]) for h in history if _finite(h.get("reward_mean"))]
    rewards = [r for _, r in rewarded]
    if not history:
        lines += ["", "_No training history was recorded._"]
    elif not rewards:
        lines += ["", "_No step reported a reward._"]
    else:
        lines += ["", _reward_change(rewards), "", f"`{sparkline(downsample(rewards, _MAX_POINTS))}`"]
        lines += _chart(title, rewarded)
    if history:
        lines += ["", "| step | reward | loss | seconds |", "|---:|---:|---:|---:|"]
        for h in history[-_TABLE_STEPS:]:
            secs = f"{h['seconds']:.1f}" if _finite(h.get("seconds")) else "—"
            cells = [_cell(h.get("step", "?")), _num(h.get("reward_mean")), _num(h.get("loss")), secs]
            lines.append("| " + " | ".join(cells) + " |")
    checkpoints = model.get("checkpoints") or []
    count = f"{len(checkpoints)} checkpoint{'s' if len(checkpoints) != 1 else ''} in all; the full list is in the JSON"
    final = model.get("final_checkpoint")
    if not checkpoints:
        count = "no checkpoints were saved"
    lines += ["", f"Final checkpoint: {_code(final)} ({count})." if final else f"No final checkpoint ({count})."]
    return lines


def _reward_change(rewards: list[float]) -> str:
    # Three-step means, not single steps, once there are enough: one lucky batch should not set the headline.
    if len(rewards) == 1:
        return f"Mean reward: {_num(rewards[0])} (one step)."
    if len(rewards) >= 6:
        first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
        return f"Mean reward: {_num(first)} → {_num(last)} (mean of the first 3 and the last 3 steps)."
    return f"Mean reward: {_num(rewards[0])} → {_num(rewards[-1])} (first and last step)."


def _chart(title: str, rewarded: list[tuple[object, float]]) -> list[str]:
    steps = [s for s, _ in rewarded if _finite(s)]
    if len(rewarded) < 2 or len(steps) != len(rewarded) or steps[0] >= steps[-1]:
        return []  # one point, or steps the x axis cannot place, is no curve
    points = downsample([r for _, r in rewarded], _MAX_POINTS)
    lo, hi = min(points), max(points)
    pad = (hi - lo) * 0.1 or max(abs(hi) * 0.1, 0.1)
    return [
        "",
        "```mermaid",
        "xychart-beta",
        f'    title "{title.replace(chr(34), chr(39)).replace(chr(10), " ")} reward"',
        f'    x-axis "step" {_plain(steps[0])} --> {_plain(steps[-1])}',
        f'    y-axis "mean reward" {_plain(lo - pad)} --> {_plain(hi + pad)}',
        f"    line [{', '.join(_plain(p) for p in points)}]",
        "```",
    ]


def _plain(x: float) -> str:
    # Fixed-point: Mermaid's grammar does not take exponents like 1e-05.
    text = f"{x:.4f}".rstrip("0").rstrip(".")
    return "0" if text in ("", "-0") else text
