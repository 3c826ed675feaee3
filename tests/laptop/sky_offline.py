"""The real SkyPilot (0.14.1), offline, for tests/laptop/test_sky_contract.py and test_sky_calls.py.

sky is imported into a temporary HOME (it writes ~/.sky at import and fixes its catalog folder then), with a
tiny accelerator catalog (Resources canonicalise GPU names through it, and price instances with it; the real
one is downloaded) and AWS/GCP marked enabled in its state database (a task that opens a port and names no
cloud needs an enabled cloud that can open ports). SKYPILOT_DISABLE_LOCAL_API_SERVER=1 makes any stray SDK
call fail at once instead of starting a server. `FakeSDK` replaces SkyPilotAPI's SDK calls: it binds every
call to the real 0.14.1 signature and answers with what the real client decoders make of the server's JSON
(`decode`), or of what the server's encoder makes of a real return value (`served`), so the types our code
reads are SkyPilot's own. The fixtures reach the tests through tests/laptop/conftest.py.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
from pathlib import Path

import pytest

from artcloud.tls import make_launch_secrets

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


@pytest.fixture(scope="session")
def sky_home(tmp_path_factory) -> Path:
    """One HOME for the whole session: sky fixes its catalog folder at its first import."""
    home = tmp_path_factory.mktemp("skyhome")
    catalogs = home / ".sky" / "catalogs" / "v8"
    for rel, text in (("common/accelerators.csv", _ACCELERATORS_CSV), ("common/metadata.csv", _METADATA_CSV),
                      ("aws/vms.csv", _AWS_VMS_CSV)):
        (catalogs / rel).parent.mkdir(parents=True, exist_ok=True)
        (catalogs / rel).write_text(text)
    return home


@pytest.fixture(scope="module")
def sky(sky_home):
    """The real `sky` package, imported into a temporary HOME with no cloud credentials (the environment is
    set for each module that uses it, and put back after)."""
    home = sky_home
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
            "sky was imported before this fixture set HOME: import it lazily everywhere else")
        assert sky_module.__version__ == "0.14.1", "the contract below is read from skypilot 0.14.1's source"
        workspace = "default"
        global_user_state.set_allowed_clouds(sky_check._get_workspace_allowed_clouds(workspace), workspace)
        global_user_state.set_enabled_clouds(["AWS", "GCP"], sky_cloud.CloudCapability.COMPUTE, workspace)
        yield sky_module


@pytest.fixture(scope="module")
def launch_secrets() -> dict[str, str]:
    ls = make_launch_secrets()
    return {"ARTCLOUD_TOKEN": ls.token, "ARTCLOUD_TLS_CERT": ls.server_cert, "ARTCLOUD_TLS_KEY": ls.server_key}


def secret_values(secrets: dict[str, str]) -> list[str]:
    """Each secret, and a line of each PEM body (a YAML dump may fold the PEM differently)."""
    values = []
    for value in secrets.values():
        values.append(value)
        values += [line for line in value.splitlines() if len(line) > 40 and "-----" not in line][:1]
    return values


def assert_no_secret(text: str, secrets: dict[str, str]) -> None:
    for value in secret_values(secrets):
        assert value not in text


def load_task(sky, config: dict):
    task = sky.Task.from_yaml_config(copy.deepcopy(config))  # it empties the dict it is given
    task.validate()
    return task


class FakeSDK:
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


def decode(name, value):
    """What sky's client makes of the server's JSON answer `value` to request `name`."""
    from sky.server import constants
    from sky.server.requests.serializers import decoders

    decoder = decoders.get_decoder(constants.REQUEST_NAME_PREFIX + name)  # the request's name: 'sky.status'
    assert decoder is not decoders.get_decoder(constants.DEFAULT_HANDLER_NAME), name
    return decoder(value)


def served(name, value):
    """What sky's client gets for request `name` when the server's function returned `value`: the server's
    encoder (a handle is pickled), JSON on the wire, the client's decoder."""
    from sky.server import constants
    from sky.server.requests.serializers import decoders, encoders

    wire = json.loads(json.dumps(encoders.get_encoder(constants.REQUEST_NAME_PREFIX + name)(value)))
    return decoders.get_decoder(constants.REQUEST_NAME_PREFIX + name)(wire)
