"""The end-of-run report: Markdown a person can read on GitHub, JSON a program can read back."""

from __future__ import annotations

import json
import re

import pytest

from artcloud.run_summary import downsample, format_seconds, render_markdown, sparkline, write_summary


def history(n: int, reward=lambda i: 0.1 + 0.02 * i) -> list[dict]:
    return [{"step": i, "reward_mean": reward(i), "loss": 0.05 / i, "seconds": 40.0 + i} for i in range(1, n + 1)]


def model(n: int = 30, **kw) -> dict:
    m = {
        "name": "agent-1", "project": "mail", "base_model": "Qwen/Qwen2.5-7B-Instruct", "step": n,
        "history": history(n),
        "checkpoints": [{"step": i, "uri": f"s3://bucket/runs/mail/agent-1/checkpoints/{i}"} for i in range(1, n + 1)],
        "final_checkpoint": f"s3://bucket/runs/mail/agent-1/checkpoints/{n}" if n else None,
    }
    m.update(kw)
    return m


def summary(**kw) -> dict:
    s = {
        "schema": 1, "run": "nightly-7f3a2c", "script": "examples/ci/train.py", "args": ["--steps", "50"],
        "backend": "sky", "gpu": "H100:1", "sandbox": "artcloud-ab12cd", "detached": False,
        "outcome": "succeeded", "exit_code": 0, "reason": "the script exited with status 0", "script_exit_code": 0,
        "started_at": "2026-12-03T10:30:00Z", "ended_at": "2026-12-03T11:11:12Z", "wall_time_s": 2472.0,
        "price_per_hour": 2.49, "estimated_cost_usd": 1.71, "budget_usd": 5.0, "max_duration_s": 10800.0,
        "s3": "s3://bucket/runs", "models": [model()],
        "teardown": {"ok": True, "detail": "artcloud-ab12cd torn down"},
    }
    s.update(kw)
    return s


def mermaid_points(md: str) -> list[float]:
    block = re.search(r"```mermaid\n(.*?)```", md, re.S)
    assert block, md
    assert "xychart-beta" in block.group(1) and 'y-axis "mean reward"' in block.group(1)
    line = re.search(r"line \[(.*)\]", block.group(1)).group(1)
    return [float(x) for x in line.split(",")]


def sparkline_of(md: str) -> str:
    return re.search(r"^`([▁▂▃▄▅▆▇█]+)`$", md, re.M).group(1)


def table_steps(md: str) -> list[int]:
    return [int(m) for m in re.findall(r"^\| (\d+) \|", md, re.M)]


def test_format_seconds():
    assert [format_seconds(s) for s in (3, 59.6, 2472, 7500, 0)] == ["3s", "1m 00s", "41m 12s", "2h 05m", "0s"]


def test_downsample_averages_buckets():
    assert downsample([1, 2, 3], 60) == [1, 2, 3]
    assert downsample([1, 3, 5, 7], 2) == [2.0, 6.0]
    out = downsample(list(range(1000)), 60)
    assert len(out) == 60 and out[0] < 10 and out[-1] > 990


def test_sparkline_follows_the_curve():
    line = sparkline([0.1, 0.2, 0.4, 0.8])
    assert len(line) == 4 and line[0] == "▁" and line[-1] == "█"
    assert list(line) == sorted(line)
    assert sparkline([0.5, 0.5]) == "▄▄" and sparkline([]) == ""


def test_a_30_step_run():
    md = render_markdown(summary())
    assert md.startswith("## artcloud run nightly-7f3a2c: succeeded\n")
    points = mermaid_points(md)
    assert len(points) == 30 and points[0] == pytest.approx(0.12) and points[-1] == pytest.approx(0.7)
    assert 'x-axis "step" 1 --> 30' in md
    spark = sparkline_of(md)
    assert len(spark) == 30 and spark[0] < spark[-1]
    assert table_steps(md) == list(range(21, 31))
    assert "| 30 | 0.7 | 0.001667 | 70.0 |" in md
    # the headline change is over 3-step means: (0.12+0.14+0.16)/3 -> (0.66+0.68+0.70)/3
    assert "Mean reward: 0.14 → 0.68 (mean of the first 3 and the last 3 steps)." in md
    assert "Trained 30 steps" in md
    assert "Final checkpoint: `s3://bucket/runs/mail/agent-1/checkpoints/30` (30 checkpoints in all" in md
    assert "checkpoints/29" not in md  # the full list belongs to the JSON
    assert "| wall time | 41m 12s (limit 3h 00m) |" in md
    assert "| backend | sky, H100:1 |" in md
    assert "| script | `examples/ci/train.py --steps 50` |" in md
    assert "| exit code | 0: the script exited with status 0 |" in md
    assert "| teardown | ok: artcloud-ab12cd torn down |" in md


def test_a_long_run_is_downsampled_to_60_points():
    md = render_markdown(summary(models=[model(500)]))
    points = mermaid_points(md)
    assert len(points) == 60 and points[0] < points[-1]
    assert len(sparkline_of(md)) == 60
    assert table_steps(md) == list(range(491, 501))


def test_cost_with_and_without_a_price():
    assert "| estimated cost | $1.71 of $5.00 budget (at $2.49/h) |" in render_markdown(summary())
    md = render_markdown(summary(price_per_hour=None, estimated_cost_usd=None, budget_usd=None))
    assert "| estimated cost | unknown (pass --price-per-hour) |" in md
    md = render_markdown(summary(price_per_hour=None, estimated_cost_usd=None))
    assert "| estimated cost | unknown (pass --price-per-hour) of $5.00 budget |" in md


def test_a_failed_run_says_why():
    md = render_markdown(summary(
        outcome="budget", exit_code=3, script_exit_code=None, reason="budget $5.00 reached after 41m",
        teardown={"ok": False, "detail": "sky down timed out"},
    ))
    assert md.startswith("## artcloud run nightly-7f3a2c: stopped: budget reached\n")
    assert "| exit code | 3: budget $5.00 reached after 41m |" in md
    assert "| teardown | FAILED: sky down timed out |" in md
    md = render_markdown(summary(outcome="script_failed", exit_code=1, script_exit_code=1))
    assert md.startswith("## artcloud run nightly-7f3a2c: failed:")


def test_no_models():
    md = render_markdown(summary(models=[]))
    assert "_No models were trained in this run._" in md
    assert "```mermaid" not in md and "###" not in md


def test_a_model_with_no_history():
    md = render_markdown(summary(models=[model(0, step=0, history=[], checkpoints=[])]))
    assert "Trained 0 steps" in md and "_No training history was recorded._" in md
    assert "No final checkpoint (no checkpoints were saved)." in md
    assert "```mermaid" not in md and "| step | reward |" not in md


def test_a_single_step():
    md = render_markdown(summary(models=[model(1)]))
    assert "Trained 1 step from" in md
    assert "Mean reward: 0.12 (one step)." in md
    assert "```mermaid" not in md  # one point is no curve
    assert sparkline_of(md) == "▄"
    assert table_steps(md) == [1]
    assert "(1 checkpoint in all" in md


def test_missing_and_none_rewards():
    h = history(8)
    h[2]["reward_mean"] = None
    del h[5]["reward_mean"]
    h[6]["loss"] = None
    md = render_markdown(summary(models=[model(8, history=h)]))
    assert len(mermaid_points(md)) == 6 and len(sparkline_of(md)) == 6
    assert "| 3 | — |" in md and "| 6 | — |" in md and "| 7 | 0.24 | — |" in md
    none = [{"step": i, "loss": 0.1} for i in (1, 2)]
    md = render_markdown(summary(models=[model(2, history=none)]))
    assert "_No step reported a reward._" in md and "```mermaid" not in md
    assert table_steps(md) == [1, 2]


def test_pipes_are_escaped_in_table_cells():
    md = render_markdown(summary(
        args=["--filter", "a|b"], reason="exit 1 | see log", teardown={"ok": True, "detail": "x|y"},
    ))
    assert "| script | `examples/ci/train.py --steps 50`" not in md
    assert r"--filter a\|b` |" in md
    assert r"| exit code | 0: exit 1 \| see log |" in md
    assert r"| teardown | ok: x\|y |" in md


def test_secret_looking_arguments_are_not_echoed():
    md = render_markdown(summary(args=["--api-key", "sk-abc123", "--hf-token=hf_xyz", "--steps", "5", "--max-tokens", "8",
                                       "--tokenizer", "gpt2", "--openai_api_key", "sk-def"]))
    assert "sk-abc123" not in md and "hf_xyz" not in md and "sk-def" not in md
    # a word of the flag must be the secret one: --max-tokens and --tokenizer are shown (a detached run refuses
    # secret-looking flags, so a false match would refuse a normal run)
    assert "--api-key *** --hf-token=*** --steps 5 --max-tokens 8 --tokenizer gpt2 --openai_api_key ***" in md


def test_write_summary_writes_json_and_markdown(tmp_path, monkeypatch):
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    s = summary()
    json_path, md_path = write_summary(s, tmp_path / "out" / "nested" / "summary.json")
    assert json_path == tmp_path / "out" / "nested" / "summary.json"
    assert md_path == tmp_path / "out" / "nested" / "summary.md"
    assert json.loads(json_path.read_text()) == s
    assert list(json.loads(json_path.read_text())) == list(s)  # insertion order kept
    assert json_path.read_text().startswith('{\n  "schema": 1,')
    assert md_path.read_text() == render_markdown(s)
    assert sorted(p.name for p in json_path.parent.iterdir()) == ["summary.json", "summary.md"]  # no tmp left


def test_write_summary_appends_to_the_github_step_summary(tmp_path, monkeypatch):
    step_summary = tmp_path / "step_summary.md"
    step_summary.write_text("# earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(step_summary))
    write_summary(summary(run="first-run"), tmp_path / "a.json")
    write_summary(summary(run="second-run", outcome="timeout"), tmp_path / "b.json")
    text = step_summary.read_text()
    assert text.startswith("# earlier step\n")
    assert "## artcloud run first-run: succeeded" in text
    assert "## artcloud run second-run: stopped: time limit reached" in text
    assert text.index("first-run") < text.index("second-run")


def test_write_summary_wants_the_json_path(tmp_path):
    with pytest.raises(ValueError, match="give the JSON path"):
        write_summary(summary(), tmp_path / "summary.md")
    assert not list(tmp_path.iterdir())


def test_cold_start_table_says_where_the_start_up_went():
    from artcloud.backends.remote import cold_start_rows

    rows = cold_start_rows({"first rollout": 0.42, "provision": 61.0, "install": 125.5, "engine": 30.0, "weights": 44.0},
                           price_per_hour=2.49)
    assert [r["phase"] for r in rows] == ["provision", "install", "weights", "engine", "first rollout"]
    md = render_markdown(summary(cold_start=rows))
    table = md[md.index("### Cold start"):md.index("### mail/agent-1")]
    assert "| provision | 1m 01s | $0.04 |" in table and "| install | 2m 06s | $0.09 |" in table
    assert "| first rollout | 0.4s | $0.0003 |" in table  # seconds on a GPU cost fractions of a cent
    assert "| **total** | 4m 21s | $0.18 |" in table
    local = render_markdown(summary(cold_start=cold_start_rows({"start": 2.0, "engine": 0.5}, None)))
    assert "| start | 2.0s | — |" in local and "| **total** | 2.5s | — |" in local  # no price: no cost
    assert "Cold start" not in render_markdown(summary()) and "Cold start" not in render_markdown(summary(cold_start=[{"x": 1}]))
    assert json.loads(json.dumps(summary(cold_start=rows)))["cold_start"] == rows
