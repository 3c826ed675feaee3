"""The acceptance workloads of issues 17 and 38: ART users' scripts (examples/art), ART 0.5.18's own skill templates
among them, run on artcloud unchanged.

Each script is an OpenPipe ART script whose only artcloud lines are its imports (each marked with the
ART line it replaces). The harness, not the script, shrinks the workload: it rewrites the script's
`NAME = value` constants (the base model to tiny-random, two training steps, few and short rollouts),
asserting that each one is there exactly once so that a changed script fails loudly here, then runs it
as a user would (`python script.py`, in a fresh working directory and HOME) and checks what it left:
exit status 0 and the model's committed checkpoint of its last step on disk.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "art"
TINY = repr("artcloud/tiny-random")

# script -> (its constants as the harness sets them, the model's project and name, its last step)
WORKLOADS = {
    "twenty_forty_eight.py": (
        {"BASE_MODEL": TINY, "TRAIN_STEPS": "2", "ROLLOUTS_PER_GROUP": "3", "MAX_COMPLETION_TOKENS": "12"},
        "2048-multi-turn", "agent-001", 2,
    ),
    "tic_tac_toe.py": (
        {"BASE_MODEL": TINY, "STEPS": "2", "ROLLOUTS_PER_STEP": "3", "MAX_COMPLETION_TOKENS": "12"},
        "tic-tac-toe", "tic-tac-toe-001", 2,
    ),
    "email_agent.py": (
        {"BASE_MODEL": TINY, "NUM_EPOCHS": "1", "GROUPS_PER_STEP": "2", "ROLLOUTS_PER_GROUP": "3", "MAX_TURNS": "2",
         "MAX_COMPLETION_TOKENS": "12"},
        "email-agent", "email-agent-001", 2,
    ),
    # ART 0.5.18's skill templates (art/skills/train-rl, train-sft), filled in; their judge and teacher are the
    # scripted OpenAI-compatible endpoint of tests/test_ruler.py (JUDGED below)
    "train_rl.py": (
        {"BASE_MODEL": TINY, "NUM_EPOCHS": "1", "ROLLOUTS_PER_GROUP": "3", "MAX_COMPLETION_TOKENS": "8",
         "JUDGE_MODEL": repr("openai/judge")},
        "capitals", "capitals-001", 2,
    ),
    "train_sft.py": ({"BASE_MODEL": TINY, "EPOCHS": "2"}, "sft-project", "house-style-001", 1),
    "distill_then_rl.py": (
        {"BASE_MODEL": TINY, "EPOCHS": "1", "RL_STEPS": "2", "ROLLOUTS_PER_GROUP": "3", "MAX_COMPLETION_TOKENS": "8"},
        "distill", "agent-001", 3,
    ),
}
JUDGED = {"train_rl.py": "OPENAI", "distill_then_rl.py": "TEACHER"}  # the endpoint's variables' prefix


def shrink(source: str, constants: dict[str, str]) -> str:
    for name, value in constants.items():
        source, n = re.subn(rf"^{name} = .+$", f"{name} = {value}", source, flags=re.M)
        assert n == 1, f"the script should set {name} once at the top (`{name} = ...`), found {n}: update WORKLOADS"
    return source


def as_art_script(source: str) -> str:
    """The script as an ART user has it: each artcloud line replaced by the ART line its comment names."""
    body = source
    docstring = ast.get_docstring(ast.parse(source), clean=False)
    if docstring:
        body = source.replace(docstring, "", 1)
    lines = []
    for line in body.splitlines():
        if "artcloud" in line:
            found = re.fullmatch(r"(?:import|from) artcloud\b.*#\s*ART: (.+)", line)
            assert found, f"an artcloud line that is not a marked import: {line!r}"
            line = found.group(1)
        lines.append(line)
    return "\n".join(lines)


@pytest.mark.parametrize("script", sorted(WORKLOADS))
def test_the_script_is_an_art_script_with_only_its_imports_changed(script):
    art = as_art_script((EXAMPLES / script).read_text())
    assert "artcloud" not in art
    assert re.search(r"^import art$", art, flags=re.M)
    ast.parse(art)


@pytest.mark.parametrize("script", sorted(WORKLOADS))
def test_art_example_trains_on_tiny_random(script, tmp_path, judge):
    constants, project, name, last = WORKLOADS[script]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shrunk = run_dir / script
    shrunk.write_text(shrink((EXAMPLES / script).read_text(), constants))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "OPENAI_"))}
    env.update(HOME=str(tmp_path), HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    if script in JUDGED:
        from test_ruler import answer

        def reply(body: dict) -> str:  # RULER's judge: a score per trajectory it is shown; a teacher: an answer
            ids = re.findall(r'<trajectory id="(\d+)">', body["messages"][-1]["content"])
            return answer([(i, (int(i) % 3) / 2) for i in ids]) if ids else "Bonjour, mon ami."

        endpoint = judge(*[reply] * 60)
        env.update({f"{JUDGED[script]}_BASE_URL": endpoint.base_url, f"{JUDGED[script]}_API_KEY": "sk-test"})
    out = subprocess.run([sys.executable, str(shrunk)], cwd=run_dir, env=env, capture_output=True, text=True,
                         timeout=300)
    tail = (out.stdout + out.stderr)[-4000:]
    assert out.returncode == 0, f"{script} exited with {out.returncode}:\n{tail}"
    # The backend's folder lies under the working directory (its path is the script's business).
    models = [p for p in run_dir.rglob(f"{project}/{name}") if (p / "checkpoints").is_dir()]
    assert len(models) == 1, f"no single checkpoints folder for {project}/{name} under {run_dir}:\n{tail}"
    steps = sorted(int(p.parent.name) for p in (models[0] / "checkpoints").glob("*/manifest.json"))
    assert steps and steps[-1] == last, f"committed steps {steps}, expected the last to be {last}:\n{tail}"
    if script == "tic_tac_toe.py":  # backend.train's result names the checkpoint it committed
        printed = re.findall(r"^step (\d+): checkpoint (.+)$", out.stdout, flags=re.M)
        assert [s for s, _ in printed] == ["1", "2"], tail
        assert Path(printed[-1][1]).resolve() == (models[0] / "checkpoints" / "2").resolve() or \
            Path(run_dir, printed[-1][1]).resolve() == (models[0] / "checkpoints" / "2").resolve(), tail
    elif script == "train_sft.py":  # the template's post-training block
        assert "SFT TRAINING COMPLETE" in out.stdout and "Training step:  1" in out.stdout, tail
        assert "engine_args gpu_memory_utilization: the GPU engine's" in out.stderr, tail  # said once, not an error
    elif script == "distill_then_rl.py":
        assert "distilled student-001 to step 1" in out.stdout and "agent-001 starts at step 1" in out.stdout, tail
        assert f"{name} trained to step {last}" in out.stdout, tail
    else:
        assert f"{name} trained to step {last}" in out.stdout, tail
