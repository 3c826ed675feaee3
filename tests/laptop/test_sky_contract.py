"""The contract with the installed SkyPilot (0.14.1): the real `sky` package checks the task we build, the
template as a plain `sky launch` task, and the calls SkyPilotAPI makes.

Offline and without an API server: sky is imported into a temporary HOME (it writes ~/.sky at import and
fixes its catalog folder then), with a tiny accelerator catalog (Resources canonicalise GPU names through
it; the real one is downloaded) and AWS/GCP marked enabled in its state database (a task that opens a port
and names no cloud needs an enabled cloud that can open ports). SKYPILOT_DISABLE_LOCAL_API_SERVER=1 makes
any stray SDK call fail at once instead of starting a server. SkyPilotAPI's SDK calls are replaced by fakes
that bind every call to the real 0.14.1 signature and answer with what the real client decoders make of
the server's JSON, so the types our code reads are SkyPilot's own.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from artcloud.backends.sky_api import ClusterInfo, Launched, SkyPilotAPI
from artcloud.backends.sky_task import SECRET_NAMES, SERVER_PORT, build_task
from artcloud.backends.wheel import build_wheel
from artcloud.tls import make_launch_secrets

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "sky" / "artcloud-server.yaml"

_ACCELERATORS_CSV = """AcceleratorName,Clouds
A100,"['AWS', 'GCP', 'Azure']"
A100-80GB,"['AWS', 'GCP', 'Azure']"
H100,"['AWS', 'GCP', 'Azure']"
L4,"['AWS', 'GCP']"
T4,"['AWS', 'GCP', 'Azure']"
"""
_METADATA_CSV = """GPU,MemoryGB,Manufacturer
A100,40,NVIDIA
A100-80GB,80,NVIDIA
H100,80,NVIDIA
L4,24,NVIDIA
T4,16,NVIDIA
"""
# Enough of AWS's catalog for `infra: aws/us-east-1` to validate (region check).
_AWS_VMS_CSV = """InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,GpuInfo,Price,SpotPrice,Region,AvailabilityZone
p5.4xlarge,H100,1,16,256,,6.88,2.75,us-east-1,use1-az1
p4de.24xlarge,A100-80GB,8,96,1152,,40.97,16.39,us-east-1,use1-az1
m6i.2xlarge,,,8,32,,0.384,0.15,us-east-1,use1-az1
"""


@pytest.fixture(scope="module")
def sky(tmp_path_factory):
    """The real `sky` package, imported into a temporary HOME with no cloud credentials."""
    home = tmp_path_factory.mktemp("skyhome")
    catalogs = home / ".sky" / "catalogs" / "v8"
    for rel, text in (("common/accelerators.csv", _ACCELERATORS_CSV), ("common/metadata.csv", _METADATA_CSV),
                      ("aws/vms.csv", _AWS_VMS_CSV)):
        (catalogs / rel).parent.mkdir(parents=True, exist_ok=True)
        (catalogs / rel).write_text(text)
    with pytest.MonkeyPatch.context() as mp:
        for key in list(os.environ):
            if key.startswith(("SKYPILOT_", "SKY_", "AWS_", "GOOGLE_", "KUBECONFIG")):
                mp.delenv(key)
        mp.setenv("HOME", str(home))
        mp.setenv("SKYPILOT_DISABLE_USAGE_COLLECTION", "1")
        mp.setenv("SKYPILOT_DISABLE_LOCAL_API_SERVER", "1")
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        import sky as sky_module
        from sky import check as sky_check
        from sky import global_user_state
        from sky.catalog import common as catalog_common
        from sky.clouds import cloud as sky_cloud

        # sky fixes its catalog folder (and writes ~/.sky) at import: an earlier import elsewhere would
        # have used another HOME, and what follows would write there.
        assert catalog_common.get_catalog_path("x").startswith(str(home)), (
            "sky was imported before this module set HOME: import it lazily everywhere else")
        assert sky_module.__version__ == "0.14.1", "the contract below is read from skypilot 0.14.1's source"
        workspace = "default"
        global_user_state.set_allowed_clouds(sky_check._get_workspace_allowed_clouds(workspace), workspace)
        global_user_state.set_enabled_clouds(["AWS", "GCP"], sky_cloud.CloudCapability.COMPUTE, workspace)
        yield sky_module


@pytest.fixture(scope="module")
def launch_secrets() -> dict[str, str]:
    ls = make_launch_secrets()
    return {"ARTCLOUD_TOKEN": ls.token, "ARTCLOUD_TLS_CERT": ls.server_cert, "ARTCLOUD_TLS_KEY": ls.server_key}


def _secret_values(secrets: dict[str, str]) -> list[str]:
    """Each secret, and a line of each PEM body (a YAML dump may fold the PEM differently)."""
    values = []
    for value in secrets.values():
        values.append(value)
        values += [line for line in value.splitlines() if len(line) > 40 and "-----" not in line][:1]
    return values


def _assert_no_secret(text: str, secrets: dict[str, str]) -> None:
    for value in _secret_values(secrets):
        assert value not in text


def _load(sky, config: dict):
    task = sky.Task.from_yaml_config(copy.deepcopy(config))  # it empties the dict it is given
    task.validate()
    return task


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
    task = _load(sky, build_task(secrets=launch_secrets, **kw).config)
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
    task = _load(sky, build_task(secrets=launch_secrets, wheel=wheel).config)
    assert task.workdir == str(wheel.parent)  # validate() made it absolute; it is already
    assert task.envs["ARTCLOUD_WHEEL"] == wheel.name
    assert (Path(task.workdir) / task.envs["ARTCLOUD_WHEEL"]).is_file()

    missing = build_task(secrets=launch_secrets, wheel=tmp_path / "gone" / wheel.name).config
    with pytest.raises(ValueError, match="Workdir must be a valid directory"):
        _load(sky, missing)


def test_detached_run_task_validates_and_runs_the_script_from_the_workdir(sky, launch_secrets, tmp_path):
    """`artcloud run --detach`: the same task, with the script in the workdir and `artcloud run` as the job."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    args = ["train.py", "--backend", "local", "--s3", "s3://b/runs", "--", "--prompt", "it's here"]
    config = build_task(secrets=launch_secrets, s3="s3://b/runs", run_args=args, workdir=tmp_path).config
    task = _load(sky, config)
    assert task.workdir == str(tmp_path) and (Path(task.workdir) / "train.py").is_file()
    # The command travels as one env of shell words; the scripts are the template's, untouched.
    assert shlex.split(task.envs["ARTCLOUD_RUN_ARGS"]) == args
    served = _load(sky, build_task(secrets=launch_secrets).config)
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


def test_launch_hands_sky_a_task_whose_secrets_are_inline_and_redacted(sky, launch_secrets, monkeypatch):
    fakes = _FakeSDK(sky, monkeypatch)
    fakes.answer("launch", lambda: _served("launch", (7, None)))  # no handle: nothing to price
    server_task = build_task(secrets=launch_secrets)
    kept = copy.deepcopy(server_task.config)

    launched = SkyPilotAPI().launch(server_task.config, secrets=server_task.secrets, cluster_name="c1",
                                    idle_minutes=10, retry_until_up=True)

    assert launched == Launched(job_id=7, price_per_hour=None, resources=None)
    assert server_task.config == kept  # the caller's dict is not emptied
    (args, kwargs), = fakes.calls["launch"]
    assert kwargs == {"cluster_name": "c1", "idle_minutes_to_autostop": 10, "down": True, "retry_until_up": True}
    task = args[0]
    task.validate()
    assert task.managed_secret_refs == []
    assert {k: v.get_secret_value() for k, v in task.secrets.items()} == launch_secrets
    assert not set(task.envs) & set(launch_secrets)
    _assert_no_secret(yaml.safe_dump(task.envs), launch_secrets)

    # What sky logs, shows and stores as "the user's YAML": no secret value.
    shown = task.to_yaml_config(use_user_specified_yaml=True)
    _assert_no_secret(yaml.safe_dump(shown), launch_secrets)
    # The plain form is what travels to the API server (dag_utils.dump_dag_to_yaml_str): the values in clear,
    # and '<redacted>'-free. Ours never writes it anywhere; the dict we keep holds the names only.
    plain = task.to_yaml_config()
    assert plain["secrets"] == launch_secrets
    assert kept["secrets"] == {name: None for name in launch_secrets}

    # No autostop asked: no autodown either.
    SkyPilotAPI().launch(server_task.config, secrets=server_task.secrets, cluster_name="c2", idle_minutes=None)
    assert fakes.calls["launch"][1][1]["down"] is False


@pytest.mark.parametrize("spot,nodes,price,resources", [
    (False, 1, 6.88, "1x AWS(p5.4xlarge, mem=256.0, {'H100': 1}, ports=['8080'])"),
    (True, 1, 2.75, "1x AWS(p5.4xlarge[Spot], mem=256.0, {'H100': 1}, ports=['8080'])"),
    (False, 2, 13.76, "2x AWS(p5.4xlarge, mem=256.0, {'H100': 1}, ports=['8080'])"),
], ids=["on-demand", "spot", "two-nodes"])
def test_launch_reports_the_machine_skypilot_launched_and_its_price(sky, launch_secrets, monkeypatch, spot, nodes,
                                                                    price, resources):
    """The price is the launched handle's, from SkyPilot's catalog (the tiny one above: 6.88, spot 2.75)."""
    from sky.backends.cloud_vm_ray_backend import CloudVmRayResourceHandle

    server_task = build_task(secrets=launch_secrets, cloud="aws", region="us-east-1", use_spot=spot)
    (asked,) = _load(sky, server_task.config).resources
    chosen = asked.copy(instance_type="p5.4xlarge")  # what the optimizer does with what was asked
    handle = CloudVmRayResourceHandle(cluster_name="c1", cluster_name_on_cloud="c1-2ea4", cluster_yaml=None,
                                      launched_nodes=nodes, launched_resources=chosen)
    fakes = _FakeSDK(sky, monkeypatch)
    got = []
    fakes.answer("launch", lambda: got.append(_served("launch", (3, handle))) or got[-1])

    launched = SkyPilotAPI().launch(server_task.config, secrets=server_task.secrets, cluster_name="c1",
                                    idle_minutes=10)

    (job_id, decoded), = got
    assert type(decoded) is CloudVmRayResourceHandle and job_id == 3
    assert launched == Launched(job_id=3, price_per_hour=pytest.approx(price), resources=resources)
    assert f"launched_resources={launched.resources}, " in repr(decoded)  # as SkyPilot itself shows the handle


def test_what_artcloud_writes_holds_no_secret(sky, launch_secrets):
    server_task = build_task(secrets=launch_secrets, env={"MY_SETTING": "1"})
    _assert_no_secret(server_task.render(), launch_secrets)
    _assert_no_secret(yaml.safe_dump(server_task.config), launch_secrets)
    assert "<redacted>" in server_task.render()
    # sky's own YAML of the task as we keep it (names only) holds nothing either.
    task = _load(sky, server_task.config)
    _assert_no_secret(yaml.safe_dump(task.to_yaml_config()), launch_secrets)
    _assert_no_secret(yaml.safe_dump(task.to_yaml_config(use_user_specified_yaml=True)), launch_secrets)


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
    _assert_no_secret(rendered, launch_secrets)
    assert shlex.split(yaml.safe_load(rendered)["envs"]["ARTCLOUD_RUN_ARGS"]) == (run_args or [])

    task = _load(sky, server_task.config)
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


# ----------------------------------------------------------------------------------------- SkyPilotAPI's calls

class _FakeSDK:
    """Replaces sky's SDK calls. Each fake binds its call to the real function's signature (TypeError if
    ours does not fit) and returns a request id; `get`/`stream_and_get` then give the answer set for it."""

    NAMES = ("launch", "status", "job_status", "endpoints", "tail_logs", "autostop", "down", "check",
             "list_accelerators", "enabled_clouds")
    NOT_IN_SKY = ("check", "list_accelerators", "enabled_clouds")  # sky.check: a module; the others: not exported

    def __init__(self, sky, monkeypatch):
        from sky.client import sdk

        self.calls: dict[str, list] = {name: [] for name in self.NAMES}
        self.answers: dict[str, object] = {}
        for name in self.NAMES:
            fake = self._fake(name, getattr(sdk, name))
            monkeypatch.setattr(sdk, name, fake)
            if name not in self.NOT_IN_SKY:
                monkeypatch.setattr(sky, name, fake)
        for target in (sky, sdk):
            monkeypatch.setattr(target, "get", self._get(sdk.get))
            monkeypatch.setattr(target, "stream_and_get", self._get(sdk.stream_and_get))

    def answer(self, name, value):
        self.answers[name] = value

    def _fake(self, name, real):
        def fake(*args, **kwargs):
            inspect.signature(real).bind(*args, **kwargs)
            self.calls[name].append((args, kwargs))
            if name == "tail_logs":
                return self.answers[name]()
            return f"req-{name}"
        return fake

    def _get(self, real):
        def get(request_id, *args, **kwargs):
            inspect.signature(real).bind(request_id, *args, **kwargs)
            answer = self.answers[request_id.removeprefix("req-")]
            if "output_stream" in kwargs and isinstance(answer, tuple) and answer[0] == "printing":
                kwargs["output_stream"].write(answer[1])
                answer = answer[2]
            return answer() if callable(answer) else answer
        return get


def _decode(name, value):
    """What sky's client makes of the server's JSON answer `value` to request `name`."""
    from sky.server import constants
    from sky.server.requests.serializers import decoders

    decoder = decoders.get_decoder(constants.REQUEST_NAME_PREFIX + name)  # the request's name: 'sky.status'
    assert decoder is not decoders.get_decoder(constants.DEFAULT_HANDLER_NAME), name
    return decoder(value)


def _served(name, value):
    """What sky's client gets for request `name` when the server's function returned `value`: the server's
    encoder (a handle is pickled), JSON on the wire, the client's decoder."""
    from sky.server import constants
    from sky.server.requests.serializers import decoders, encoders

    wire = json.loads(json.dumps(encoders.get_encoder(constants.REQUEST_NAME_PREFIX + name)(value)))
    return decoders.get_decoder(constants.REQUEST_NAME_PREFIX + name)(wire)


def _status_json(name="c1", status="UP", **more):
    return {"name": name, "launched_at": 1_700_000_000, "status": status, "autostop": 10, "to_down": True,
            "cluster_hash": "h", "cluster_ever_up": True, "user_hash": "u", "user_name": "me",
            "workspace": "default", "nodes": 1, "resources_str": "1x AWS(p5.4xlarge, {'H100': 1})",
            "last_use": "", "status_updated_at": 0, **more}


def test_status(sky, monkeypatch):
    fakes = _FakeSDK(sky, monkeypatch)
    fakes.answer("status", lambda: _decode("status", [_status_json()]))
    assert SkyPilotAPI().status("c1") == ClusterInfo(
        name="c1", status="UP", launched_at=1_700_000_000, autostop_minutes=10, to_down=True,
        resources="1x AWS(p5.4xlarge, {'H100': 1})")
    assert fakes.calls["status"] == [((["c1"],), {})]
    fakes.answer("status", lambda: _decode("status", [_status_json(status="AUTOSTOPPING", autostop=-1,
                                                                   to_down=False)]))
    assert SkyPilotAPI().status("c1").status == "AUTOSTOPPING"
    fakes.answer("status", lambda: _decode("status", []))  # torn down or never launched: left out
    assert SkyPilotAPI().status("c1") is None


def test_job_status(sky, monkeypatch):
    from sky import exceptions

    fakes = _FakeSDK(sky, monkeypatch)
    fakes.answer("job_status", lambda: _decode("job_status", {"3": "RUNNING"}))
    assert SkyPilotAPI().job_status("c1", 3) == "RUNNING"
    assert SkyPilotAPI().job_status("c1", None) == "RUNNING"
    assert [c[0] for c in fakes.calls["job_status"]] == [("c1", [3]), ("c1", None)]
    fakes.answer("job_status", lambda: _decode("job_status", {"4": None}))  # no such job
    assert SkyPilotAPI().job_status("c1", 4) is None
    # No job at all: the server's {None: None} travels as {"None": None}, which 0.14.1's decoder cannot int().
    fakes.answer("job_status", lambda: _decode("job_status", {"None": None}))
    assert SkyPilotAPI().job_status("c1", None) is None
    for error in (exceptions.ClusterDoesNotExist("Cluster 'c1' does not exist."),
                  exceptions.ClusterNotUpError("Cluster 'c1' is not up.", cluster_status=None)):
        fakes.answer("job_status", lambda error=error: (_ for _ in ()).throw(error))
        assert SkyPilotAPI().job_status("c1", 3) is None


def test_endpoint(sky, monkeypatch):
    from sky import exceptions

    fakes = _FakeSDK(sky, monkeypatch)
    fakes.answer("endpoints", lambda: _decode("endpoints", {"8080": "3.4.5.6:8080"}))  # keys become ints
    assert SkyPilotAPI().endpoint("c1", 8080) == "3.4.5.6:8080"
    assert fakes.calls["endpoints"] == [(("c1", 8080), {})]
    # A URL stays a URL (scheme and path kept): the caller must see that it is not a plain TCP port.
    fakes.answer("endpoints", lambda: _decode("endpoints", {"8080": "https://c1.example.com:8080/"}))
    assert SkyPilotAPI().endpoint("c1", 8080) == "https://c1.example.com:8080"
    fakes.answer("endpoints", lambda: _decode("endpoints", {}))  # not open yet
    assert SkyPilotAPI().endpoint("c1", 8080) is None
    fakes.answer("endpoints", lambda: (_ for _ in ()).throw(
        exceptions.ClusterNotUpError("Cluster 'c1' not found.", cluster_status=None)))
    assert SkyPilotAPI().endpoint("c1", 8080) is None


def _endpoint_url(port_details: dict, port: int) -> dict[int, str]:
    """backend_utils.get_endpoints' answer for one port: the first endpoint's url()."""
    return {port: port_details[port][0].url()}


def test_endpoint_as_skypilot_reports_a_kubernetes_ingress(sky, monkeypatch):
    """On Kubernetes with an ingress (kind, `sky local up`) the port is a path behind an HTTP proxy."""
    from sky.provision.kubernetes import network, network_utils
    from sky.provision.kubernetes import utils as kubernetes_utils

    monkeypatch.setattr(kubernetes_utils, "get_current_kube_config_context_name", lambda: "kind-skypilot")
    monkeypatch.setattr(kubernetes_utils, "get_kube_config_context_namespace", lambda context: "default")
    monkeypatch.setattr(network_utils, "get_ingress_external_ip_and_ports", lambda context: ("172.18.0.2", (80, 443)))
    found = network._query_ports_for_ingress("c1-2ea4", [SERVER_PORT], {"namespace": "default"})
    fakes = _FakeSDK(sky, monkeypatch)
    fakes.answer("endpoints", lambda: _served("endpoints", _endpoint_url(found, SERVER_PORT)))
    assert SkyPilotAPI().endpoint("c1", SERVER_PORT) == "http://172.18.0.2:80/skypilot/default/c1-2ea4/8080"


def test_endpoint_as_skypilot_reports_vast(sky, monkeypatch):
    """Vast forwards 8080 alone (to the SSH gateway's next port): the server's port must be 8080."""
    from sky.provision.vast import instance

    monkeypatch.setattr(instance, "_filter_instances",
                        lambda *a, **k: {"i-1": {"ssh_host": "ssh4.vast.ai", "ssh_port": 40022}})
    fakes = _FakeSDK(sky, monkeypatch)
    found = instance.query_ports("c1-2ea4", [str(SERVER_PORT)])
    fakes.answer("endpoints", lambda: _served("endpoints", _endpoint_url(found, SERVER_PORT)))
    assert SkyPilotAPI().endpoint("c1", SERVER_PORT) == "ssh4.vast.ai:40023"


def test_logs_skip_control_messages_and_need_the_cluster(sky, monkeypatch):
    from sky import exceptions

    fakes = _FakeSDK(sky, monkeypatch)
    fakes.answer("status", lambda: _decode("status", [_status_json()]))
    # decode_rich_status: lines with their newline; None for each spinner/heartbeat message off the main thread.
    fakes.answer("tail_logs", lambda: iter(["setting up\n", None, "serving on 8443\r\n", None, "par", "tial"]))
    assert list(SkyPilotAPI().logs("c1", follow=True, tail=5)) == ["setting up", "serving on 8443", "partial"]
    (args, kwargs), = fakes.calls["tail_logs"]
    assert kwargs == {"job_id": None, "follow": True, "tail": 5, "preload_content": False}
    fakes.answer("status", lambda: _decode("status", []))
    with pytest.raises(exceptions.ClusterDoesNotExist):
        SkyPilotAPI().logs("c1")


def test_autostop_and_down(sky, monkeypatch):
    from sky import exceptions

    fakes = _FakeSDK(sky, monkeypatch)
    fakes.answer("autostop", None)
    fakes.answer("down", None)
    SkyPilotAPI().autostop("c1", 5, down=True)
    assert fakes.calls["autostop"] == [(("c1", 5), {"down": True})]
    assert SkyPilotAPI().down("c1") is True
    fakes.answer("down", lambda: (_ for _ in ()).throw(exceptions.ClusterDoesNotExist("no")))
    assert SkyPilotAPI().down("c1") is False


# `sky check aws` as the 0.14.1 API server streamed it (no credentials; captured from a real local server).
_CHECK_AWS_OUTPUT = (
    "Checking credentials to enable infra for SkyPilot.\n\x1b[2m  AWS: disabled \x1b[0m\x1b[0m\n"
    "    Reason [compute, storage]: AWS credentials are not set. Run the following commands:\n"
    "      $ aws configure\n"
    "      $ aws configure list  # Ensure that this shows identity is set.\n"
    "    For more info: https://docs.aws.amazon.com/cli/latest/userguide/cli-configure-quickstart.html\n"
    "    Details: `aws sts get-caller-identity` failed with error: [botocore.exceptions.NoCredentialsError] "
    "Unable to locate credentials.\n\n\x1b[32m🎉 Enabled infra 🎉\x1b[0m\n  No infra to check/enabled.\n"
    "\x1b[2m\nTo enable a cloud, follow the hints above and rerun: \x1b[0m\x1b[1msky check\x1b[0m\n"
)


def test_check_cloud(sky, monkeypatch):
    fakes = _FakeSDK(sky, monkeypatch)
    fakes.answer("check", ("printing", _CHECK_AWS_OUTPUT, {"default": {}}))
    reason = SkyPilotAPI().check_cloud("aws")
    assert reason.startswith("AWS: disabled Reason [compute, storage]: AWS credentials are not set.")
    assert "aws configure" in reason and "Unable to locate credentials." in reason and "Enabled infra" not in reason
    assert fakes.calls["check"] == [((("aws",),), {"verbose": False})]
    fakes.answer("check", ("printing", "  AWS: enabled [compute, storage]\n",
                           {"default": {"AWS": ["compute", "storage"]}}))
    assert SkyPilotAPI().check_cloud("aws") is None
    fakes.answer("check", ("printing", "", {"default": {"AWS": ["storage"]}}))  # storage only: cannot launch
    assert SkyPilotAPI().check_cloud("aws") == "aws is not enabled (run `sky check aws`)"


def test_enabled_clouds(sky, monkeypatch):
    from sky import core, exceptions

    fakes = _FakeSDK(sky, monkeypatch)
    # The server's own answer, from the state database the fixture wrote (AWS and GCP enabled).
    fakes.answer("enabled_clouds", lambda: _served("enabled_clouds", core.enabled_clouds()))
    assert SkyPilotAPI().enabled_clouds() == ["aws", "gcp"]
    assert fakes.calls["enabled_clouds"] == [((), {})]  # expand=False: clouds, not each Kubernetes context
    # The encoder's declared input is Cloud objects, whose str() is capitalised.
    fakes.answer("enabled_clouds", lambda: _served("enabled_clouds", [sky.clouds.Kubernetes(), sky.AWS()]))
    assert SkyPilotAPI().enabled_clouds() == ["kubernetes", "aws"]
    fakes.answer("enabled_clouds", lambda: (_ for _ in ()).throw(
        exceptions.ApiServerConnectionError("http://127.0.0.1:46580")))
    assert SkyPilotAPI().enabled_clouds() is None


def test_gpu_offers(sky, monkeypatch):
    fakes = _FakeSDK(sky, monkeypatch)
    rows = {"H100": [["AWS", "p5.4xlarge", "H100", 1.0, 16.0, 80.0, 256.0, 6.88, 2.75, "us-east-1"],
                     ["Kubernetes", None, "H100", 2.0, None, 80.0, None, 0.0, float("nan"), "ctx"]]}
    fakes.answer("list_accelerators", lambda: _decode("list_accelerators", rows))
    offers = SkyPilotAPI().gpu_offers("H100")
    assert [(o.cloud, o.instance_type, o.accelerator, o.count, o.price, o.spot_price, o.region) for o in offers] == [
        ("AWS", "p5.4xlarge", "H100", 1, 6.88, 2.75, "us-east-1"), ("Kubernetes", "", "H100", 2, None, None, "ctx")]
    (args, kwargs), = fakes.calls["list_accelerators"]
    assert kwargs == {"gpus_only": True, "name_filter": "^H100$", "case_sensitive": False}
    SkyPilotAPI().gpu_offers("A100-80GB")
    assert fakes.calls["list_accelerators"][1][1]["name_filter"] == "^A100\\-80GB$"

    def offline():  # what the API server answers when it cannot download the catalog
        import requests

        raise requests.exceptions.ConnectionError("Failed to resolve 'raw.githubusercontent.com'")
    fakes.answer("list_accelerators", offline)
    assert SkyPilotAPI().gpu_offers("H100") is None


# ----------------------------------------------------------------------------------------- the laptop install

def _cli_env(tmp_path, **extra: str) -> dict[str, str]:
    return {**os.environ, "ARTCLOUD_HOME": str(tmp_path / "state"), "ARTCLOUD_SKY_API": "tests.sky_standin:LocalSky",
            "ARTCLOUD_STANDIN_ROOT": str(tmp_path / "cloud"), "PYTHONPATH": str(REPO), **extra}


def test_this_is_a_laptop_install_without_the_server_stack():
    import importlib.util

    assert [m for m in ("torch", "transformers", "peft", "vllm") if importlib.util.find_spec(m)] == []


def test_launch_dry_run_is_validated_by_skypilot_and_shows_no_secret(sky, tmp_path):
    env = _cli_env(tmp_path, ARTCLOUD_STANDIN_CLOUDS="local,aws", MY_SECRET="hunter2-do-not-print")
    result = subprocess.run(
        [sys.executable, "-m", "artcloud", "launch", "--gpu", "H100:1", "--cloud", "aws", "--region", "us-east-1",
         "--spot", "--secret", "MY_SECRET", "--name", "plan", "--dry-run"],
        env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
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
