"""The contract with the installed SkyPilot (0.14.1): the real `sky` package checks the task we build, the
template as a plain `sky launch` task, and the shell scripts as a node runs them. Offline, in the temporary HOME
of tests/laptop/sky_offline.py; SkyPilotAPI's calls are pinned in test_sky_calls.py.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from sky_offline import assert_no_secret, load_task

from artcloud.backends.sky_task import SECRET_NAMES, SERVER_PORT, build_task
from artcloud.backends.wheel import build_wheel

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "sky" / "artcloud-server.yaml"


# ----------------------------------------------------------------------------------------- the task we build

@pytest.mark.parametrize("kw,accelerators,infra,spot,disk,image", [
    ({}, {"H100": 1}, None, False, 256, None),
    ({"image": "docker:nvcr.io/nvidia/pytorch:24.08-py3"}, {"H100": 1}, None, False, 256,
     {None: "docker:nvcr.io/nvidia/pytorch:24.08-py3"}),
    ({"cloud": "aws", "region": "us-east-1", "use_spot": True, "disk_size": 100}, {"H100": 1}, "aws/us-east-1",
     True, 100, None),
    ({"gpu": "A100-80GB:2"}, {"A100-80GB": 2}, None, False, 256, None),
    ({"gpu": None}, None, None, False, 256, None),
], ids=["default", "image", "aws-spot", "a100x2", "no-gpu"])
def test_built_task_validates_and_resources_round_trip(sky, launch_secrets, kw, accelerators, infra, spot, disk,
                                                       image):
    task = load_task(sky, build_task(secrets=launch_secrets, **kw).config)
    (res,) = task.resources
    assert res.accelerators == accelerators
    assert res.ports == ["8080"]
    assert res.use_spot is spot
    assert res.disk_size == disk
    assert res.image_id == image
    assert (res.infra.to_str() or None) == infra
    # Resources has no __eq__ (identity): compare what defines them, their YAML.
    (again,) = sky.Resources.from_yaml_config(res.to_yaml_config())
    assert again.to_yaml_config() == res.to_yaml_config()
    assert (again.accelerators, again.ports, again.use_spot, again.disk_size, again.image_id) == (
        accelerators, ["8080"], spot, disk, image)
    # ... and the task: envs, setup and run survive to_yaml_config -> from_yaml_config.
    back = sky.Task.from_yaml_config(task.to_yaml_config())
    assert (back.envs, back.setup, back.run, back.name) == (task.envs, task.setup, task.run, task.name)


def test_task_with_a_wheel_has_its_workdir(sky, launch_secrets, tmp_path):
    wheel = build_wheel(tmp_path / "wheel")
    task = load_task(sky, build_task(secrets=launch_secrets, wheel=wheel).config)
    assert task.workdir == str(wheel.parent)  # validate() made it absolute; it is already
    assert task.envs["ARTCLOUD_WHEEL"] == wheel.name
    assert (Path(task.workdir) / task.envs["ARTCLOUD_WHEEL"]).is_file()

    missing = build_task(secrets=launch_secrets, wheel=tmp_path / "gone" / wheel.name).config
    with pytest.raises(ValueError, match="Workdir must be a valid directory"):
        load_task(sky, missing)


def test_detached_run_task_validates_and_runs_the_script_from_the_workdir(sky, launch_secrets, tmp_path):
    """`artcloud run --detach`: the same task, with the script in the workdir and `artcloud run` as the job."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    args = ["train.py", "--backend", "local", "--s3", "s3://b/runs", "--", "--prompt", "it's here"]
    config = build_task(secrets=launch_secrets, s3="s3://b/runs", run_args=args, workdir=tmp_path).config
    task = load_task(sky, config)
    assert task.workdir == str(tmp_path) and (Path(task.workdir) / "train.py").is_file()
    # The command travels as one env of shell words; the scripts are the template's, untouched.
    assert shlex.split(task.envs["ARTCLOUD_RUN_ARGS"]) == args
    served = load_task(sky, build_task(secrets=launch_secrets).config)
    assert (task.setup, task.run) == (served.setup, served.run)
    assert served.envs["ARTCLOUD_RUN_ARGS"] == ""  # empty: `artcloud serve` (what the run script does with it: below)


# ----------------------------------------------------------------------------------------- secrets

def test_names_only_secrets_are_managed_references_in_sky(sky, launch_secrets):
    """Why SkyPilotAPI.launch drops `secrets: {NAME: None}` before update_secrets: a null secret is a
    managed-secret reference, update_secrets leaves it there, and the server then looks for a provider."""
    config = build_task(secrets=launch_secrets).config
    assert config["secrets"] == {name: None for name in SECRET_NAMES}
    task = sky.Task.from_yaml_config(copy.deepcopy(config))
    assert sorted(ref.name for ref in task.managed_secret_refs) == sorted(SECRET_NAMES)
    task.update_secrets(launch_secrets)
    assert task.managed_secret_refs  # still there: the launch would carry both


def test_what_artcloud_writes_holds_no_secret(sky, launch_secrets):
    server_task = build_task(secrets=launch_secrets, env={"MY_SETTING": "1"})
    assert_no_secret(server_task.render(), launch_secrets)
    assert_no_secret(yaml.safe_dump(server_task.config), launch_secrets)
    assert "<redacted>" in server_task.render()
    # sky's own YAML of the task as we keep it (names only) holds nothing either.
    task = load_task(sky, server_task.config)
    assert_no_secret(yaml.safe_dump(task.to_yaml_config()), launch_secrets)
    assert_no_secret(yaml.safe_dump(task.to_yaml_config(use_user_specified_yaml=True)), launch_secrets)


# ----------------------------------------------------------------------------------------- the template itself

def test_template_loads_in_sky_and_wants_its_secrets_at_launch(sky):
    from sky import dag as dag_lib
    from sky import execution

    task = sky.Task.from_yaml(str(TEMPLATE))  # no secrets needed to load...
    task.validate()
    assert task.secrets == {}
    assert sorted(ref.name for ref in task.managed_secret_refs) == sorted(SECRET_NAMES)
    dag = dag_lib.Dag()
    dag.add(task)
    with pytest.raises(RuntimeError, match="No value available for secret"):  # ...the server asks at launch
        execution._resolve_managed_secrets(dag)


def _header_command(prog: str) -> list[str]:
    """The `sky PROG ...` command of the template's header comment, continuation lines joined."""
    lines = [line[1:].strip() for line in TEMPLATE.read_text().splitlines() if line.startswith("#")]
    text = "\n".join(lines).replace("\\\n", " ")
    for line in text.splitlines():
        if line.startswith(f"sky {prog} "):
            return shlex.split(line.split("#", 1)[0])[2:]
    raise AssertionError(f"no `sky {prog}` in the header of {TEMPLATE}")


def test_header_usage_is_a_valid_sky_launch(sky, launch_secrets, tmp_path, monkeypatch):
    from sky.client.cli import command

    args = _header_command("launch")
    (tmp_path / "sky").mkdir()
    (tmp_path / "sky" / TEMPLATE.name).write_text(TEMPLATE.read_text())
    monkeypatch.chdir(tmp_path)
    for name, value in launch_secrets.items():
        monkeypatch.setenv(name, value)  # `--secret NAME` reads the local environment
    workdir = args[args.index("--workdir") + 1]
    wheel_name = dict(a.split("=", 1) for a in args if "=" in a)["ARTCLOUD_WHEEL"]
    (tmp_path / workdir).mkdir()
    (tmp_path / workdir / wheel_name).write_bytes(b"")

    ctx_params = command.launch.make_context("launch", args).params  # every flag exists, with these types
    assert ctx_params["idle_minutes_to_autostop"] == 10 and ctx_params["down"] is True
    assert dict(ctx_params["secret"]) == launch_secrets
    # What `sky launch` does with them next (client/cli/command.py, before it calls sdk.launch).
    task = command._make_task_or_dag_from_entrypoint_with_overrides(
        ctx_params["entrypoint"], workdir=ctx_params["workdir"], env=list(ctx_params["env"]),
        secret=list(ctx_params["secret"]))
    task.validate()
    assert task.managed_secret_refs == []  # --secret NAME filled each null secret
    assert {k: v.get_secret_value() for k, v in task.secrets.items()} == launch_secrets
    assert task.envs["ARTCLOUD_WHEEL"] == wheel_name
    assert Path(task.workdir) == tmp_path / workdir

    status = command.status.make_context("status", _header_command("status")).params
    assert status["endpoint"] == SERVER_PORT == 8080 and status["clusters"] == (ctx_params["cluster"],)
    (res,) = task.resources  # the template as it is, before build_task fills it, opens that same port
    assert res.ports == ["8080"] and task.envs["ARTCLOUD_PORT"] == "8080"


def test_a_task_of_several_nodes_validates_and_opens_only_the_heads_port(sky, launch_secrets):
    """num_nodes reaches SkyPilot's Task; the replicas' port stays out of `ports` (the cluster's own network)."""
    from artcloud.backends.sky_task import REPLICA_PORT, REPLICA_SECRETS

    with pytest.raises(ValueError, match="nodes that serve as replicas need their own CA"):  # security review 3, N5
        build_task(secrets=launch_secrets, num_nodes=3, ca_cert="x")
    launch_secrets = {**launch_secrets, **{name: f"{name.lower()}-value" for name in REPLICA_SECRETS}}
    config = build_task(secrets=launch_secrets, num_nodes=3, ca_cert="-----BEGIN CERTIFICATE-----\nx\n",
                        replica_ca="-----BEGIN CERTIFICATE-----\nreplicas\n").config
    task = load_task(sky, config)
    assert task.envs["ARTCLOUD_REPLICA_CA"].endswith("replicas\n") and "ARTCLOUD_REPLICA_CA" not in task.secrets
    assert {ref.name for ref in task.managed_secret_refs} >= set(REPLICA_SECRETS)
    (res,) = task.resources
    assert task.num_nodes == 3 and res.ports == ["8080"] and str(REPLICA_PORT) not in res.ports
    assert task.envs["ARTCLOUD_REPLICA_PORT"] == str(REPLICA_PORT) and task.envs["ARTCLOUD_TLS_CA"].startswith("-----BEGIN")
    assert "ARTCLOUD_TLS_CA" not in task.secrets  # public: a certificate, not its key
    assert task.envs["ARTCLOUD_TRAINER_NODES"] == "1"
    keyed = {**launch_secrets, "ARTCLOUD_TRAINER_KEY": "k" * 64}
    two = load_task(sky, build_task(secrets=keyed, num_nodes=3, trainer_nodes=2, ca_cert="x", replica_ca="y").config)
    assert two.envs["ARTCLOUD_TRAINER_NODES"] == "2"
    assert "ARTCLOUD_TRAINER_KEY" in {ref.name for ref in two.managed_secret_refs}
    # The run script learns the secrets' names only (each role keeps those it needs), never their values.
    assert two.envs["ARTCLOUD_SECRET_NAMES"].split() == sorted(keyed) and "k" * 64 not in str(two.envs)
    with pytest.raises(ValueError, match="several trainer nodes need the secret ARTCLOUD_TRAINER_KEY"):
        build_task(secrets=launch_secrets, num_nodes=3, trainer_nodes=2, ca_cert="x", replica_ca="y")
    with pytest.raises(ValueError, match="one node"):
        build_task(secrets=launch_secrets, num_nodes=2, ca_cert="x", replica_ca="y", run_args=["train.py"])
    with pytest.raises(ValueError, match="trainer_nodes is 1 to num_nodes"):
        build_task(secrets=launch_secrets, num_nodes=2, ca_cert="x", replica_ca="y", trainer_nodes=3)


# ----------------------------------------------------------------------------------------- the shell scripts

def test_setup_and_run_are_valid_bash(launch_secrets):
    config = build_task(secrets=launch_secrets, s3="s3://bucket/prefix").config
    assert "timeout" in config["run"] and "$HOME/.local/bin/uv" in config["setup"]  # the belt; SkyPilot 0.14's uv
    for script in (config["setup"], config["run"]):
        result = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
        assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("max_duration,seconds", [("8h", 29400), ("480m", 29400), ("90s", 690)])
def test_run_timeout_arithmetic(launch_secrets, max_duration, seconds):
    run = build_task(secrets=launch_secrets).config["run"]
    match = re.search(r'"(\$\(\( .* \+ 600 \)\))"', run)
    assert match, run
    script = f'echo "{match.group(1)}"'
    env = {**os.environ, "PY": sys.executable, "ARTCLOUD_MAX_DURATION": max_duration}
    result = subprocess.run(["bash", "-c", script], env=env, text=True, capture_output=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(seconds)
    assert build_task(secrets=launch_secrets).config["envs"]["ARTCLOUD_MAX_DURATION"] == "8h"


# A python for the run script: `-c` (its LIMIT arithmetic) runs the real one; anything else prints argv.
_FAKE_PYTHON = """#!{python}
import json, os, sys
if sys.argv[1:2] == ["-c"]:
    os.execv({python!r}, [{python!r}, *sys.argv[1:]])
print(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "token": os.environ.get("ARTCLOUD_TOKEN")}}))
"""
_AWKWARD_ARGS = ["train.py", "--prompt", "it's a \"quoted\" word", "two  spaces", "$HOME `id` $(echo no) ${X:-y}", "",
                 "*", "back\\slash", "line\nbreak", "--", "-n"]


@pytest.mark.parametrize("run_args", [_AWKWARD_ARGS, None], ids=["detached-run", "serve"])
def test_run_script_as_a_node_runs_it_hands_artcloud_its_arguments_intact(sky, launch_secrets, tmp_path, run_args):
    """The template's `run` in SkyPilot's own job script (envs and secrets as `export` lines, in ~/sky_workdir),
    real bash and `timeout`, and a "$PY" that prints its argv: each argument arrives as it was given."""
    from sky import task as task_lib
    from sky.skylet import log_lib

    home, venv = tmp_path / "home", tmp_path / "venv"
    (home / "sky_workdir").mkdir(parents=True)
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(_FAKE_PYTHON.format(python=sys.executable))
    (venv / "bin" / "python").chmod(0o755)
    server_task = build_task(secrets=launch_secrets, run_args=run_args, env={"ARTCLOUD_VENV": str(venv)})
    rendered = server_task.render()  # what `--dry-run` prints
    assert_no_secret(rendered, launch_secrets)
    assert shlex.split(yaml.safe_load(rendered)["envs"]["ARTCLOUD_RUN_ARGS"]) == (run_args or [])

    task = load_task(sky, server_task.config)
    task.update_secrets(server_task.secrets)
    script = log_lib.make_task_bash_script(task.run, env_vars=task_lib.get_plaintext_envs_and_secrets(
        task.envs_and_secrets))
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "PYTHONPATH": str(REPO)}
    result = subprocess.run(["bash", "-c", script], env=env, text=True, capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got["cwd"] == str(home / "sky_workdir") and got["token"] == launch_secrets["ARTCLOUD_TOKEN"]
    if run_args:
        assert got["argv"] == ["-m", "artcloud", "run", *_AWKWARD_ARGS]
    else:
        assert got["argv"] == ["-m", "artcloud", "serve", "--path", f"{home}/artcloud-data", "--host", "0.0.0.0",
                               "--port", "8080", "--engine", "auto", "--lease", "15m", "--max-duration", "8h"]


# ----------------------------------------------------------------------------------------- the laptop install

def _cli_env(tmp_path, **extra: str) -> dict[str, str]:
    return {**os.environ, "ARTCLOUD_HOME": str(tmp_path / "state"), "ARTCLOUD_SKY_API": "tests.sky_standin:LocalSky",
            "ARTCLOUD_STANDIN_ROOT": str(tmp_path / "cloud"), "PYTHONPATH": str(REPO), **extra}


def test_this_is_a_laptop_install_without_the_server_stack():
    import importlib.util

    assert [m for m in ("torch", "transformers", "peft", "vllm") if importlib.util.find_spec(m)] == []


@pytest.mark.parametrize("nodes", [[], ["--nodes", "3", "--trainer-nodes", "2"]], ids=["one-node", "three-nodes"])
def test_launch_dry_run_is_validated_by_skypilot_and_shows_no_secret(sky, tmp_path, nodes):
    env = _cli_env(tmp_path, ARTCLOUD_STANDIN_CLOUDS="local,aws", MY_SECRET="hunter2-do-not-print")
    result = subprocess.run(
        [sys.executable, "-m", "artcloud", "launch", "--gpu", "H100:1", "--cloud", "aws", "--region", "us-east-1",
         "--spot", "--secret", "MY_SECRET", "--name", "plan", "--dry-run", *nodes],
        env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    if nodes:  # the trainer key and the replicas' own secrets are made for the plan too, and shown as names only
        for name in ("ARTCLOUD_TRAINER_KEY", "ARTCLOUD_REPLICA_TOKEN", "ARTCLOUD_REPLICA_TLS_KEY"):
            assert f"{name}: <redacted>" in result.stdout, result.stdout
    assert "passes sky.Task.validate() (skypilot 0.14.1)" in result.stdout
    assert "nothing was launched" in result.stdout and "MY_SECRET: <redacted>" in result.stdout
    assert "hunter2" not in result.stdout + result.stderr and "PRIVATE KEY" not in result.stdout
    clusters = tmp_path / "cloud" / "clusters"
    assert not (clusters.exists() and any(clusters.iterdir())) and not (tmp_path / "state" / "sandboxes").exists()


def test_launch_dry_run_offline_says_what_it_could_not_check(tmp_path):
    home = tmp_path / "home"  # no catalog: SkyPilot would download it, and there is no network here
    home.mkdir()
    env = _cli_env(tmp_path, HOME=str(home), SKYPILOT_DISABLE_USAGE_COLLECTION="1")
    result = subprocess.run([sys.executable, "-m", "artcloud", "launch", "--gpu", "L4", "--dry-run"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "not by SkyPilot: its GPU catalog could not be downloaded (offline?)" in result.stdout
