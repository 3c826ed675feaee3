"""SkyPilotAPI's calls against the installed SkyPilot (0.14.1), offline: each SDK call is bound to its real
signature and answered with what SkyPilot's own client decoders produce (tests/laptop/sky_offline.py)."""

from __future__ import annotations

import copy
import inspect
import sys

import pytest
import yaml
from sky_offline import FakeSDK, assert_no_secret, decode, load_task, served

from artcloud.backends.sky_api import ClusterInfo, Launched, SkyPilotAPI
from artcloud.backends.sky_task import SERVER_PORT, build_task

# ----------------------------------------------------------------------------------------- launch

def test_launch_hands_sky_a_task_whose_secrets_are_inline_and_redacted(sky, launch_secrets, monkeypatch):
    fakes = FakeSDK(sky, monkeypatch)
    fakes.answer("launch", lambda: served("launch", (7, None)))  # no handle: nothing to price
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
    assert_no_secret(yaml.safe_dump(task.envs), launch_secrets)

    # What sky logs, shows and stores as "the user's YAML": no secret value.
    shown = task.to_yaml_config(use_user_specified_yaml=True)
    assert_no_secret(yaml.safe_dump(shown), launch_secrets)
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
    (asked,) = load_task(sky, server_task.config).resources
    chosen = asked.copy(instance_type="p5.4xlarge")  # what the optimizer does with what was asked
    handle = CloudVmRayResourceHandle(cluster_name="c1", cluster_name_on_cloud="c1-2ea4", cluster_yaml=None,
                                      launched_nodes=nodes, launched_resources=chosen)
    fakes = FakeSDK(sky, monkeypatch)
    got = []
    fakes.answer("launch", lambda: got.append(served("launch", (3, handle))) or got[-1])

    launched = SkyPilotAPI().launch(server_task.config, secrets=server_task.secrets, cluster_name="c1",
                                    idle_minutes=10)

    (job_id, decoded), = got
    assert type(decoded) is CloudVmRayResourceHandle and job_id == 3
    assert launched == Launched(job_id=3, price_per_hour=pytest.approx(price), resources=resources)
    assert f"launched_resources={launched.resources}, " in repr(decoded)  # as SkyPilot itself shows the handle


def test_launch_output_goes_to_the_artcloud_sky_logger_not_stdout(sky, launch_secrets, monkeypatch, caplog, capsys):
    """What SkyPilot prints while it launches (`launch`'s echo, client/sdk.py:1032-1034, and the provisioning log that
    stream_and_get prints, 2487+) reaches logging.getLogger("artcloud.sky") line by line, from the worker thread that
    launches; stdout carries only what other threads print meanwhile (a progress bar, the user's own lines)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import click
    from sky.client import sdk
    from sky.utils import message_utils, rich_utils

    fakes = FakeSDK(sky, monkeypatch)
    fake_launch, real_stream_and_get = sky.launch, sdk.stream_and_get

    def launch(task, cluster_name=None, **kwargs):  # the real client's echo (client/sdk.py:1033-1034), then the fake
        click.secho("Running on cluster: ", fg="cyan", nl=False)
        click.secho(cluster_name)
        return fake_launch(task, cluster_name=cluster_name, **kwargs)

    spinner = message_utils.encode_payload(rich_utils.Control.INIT.encode("[bold cyan]Launching[/]"))
    wire = ("\x1b[1mConsidered resources (1 node):\x1b[0m\n" + spinner + "\n"
            "⚙︎ Launching on AWS us-east-1 (us-east-1a).\n  Uploading  50%\r  Uploading 100%\r\n"
            "\x1b[32m✓ Cluster launched: c1.\x1b[0m  View logs: sky logs --provision c1\n").encode()
    streaming, printed = threading.Event(), threading.Event()

    class Response:  # what the API server sends, in two chunks cut inside a character
        def iter_content(self, chunk_size=None):
            streaming.set()
            printed.wait(10)  # the main thread prints while this one streams
            yield from (wire[:120], wire[120:])

    def stream_and_get(request_id, **kwargs):  # the real printing path: stream_response and its decoder
        inspect.signature(real_stream_and_get).bind(request_id, **kwargs)
        sdk.stream_response(None, Response(), kwargs.get("output_stream"), get_result=False)
        return served("launch", (7, None))

    monkeypatch.setattr(sky, "launch", launch)
    monkeypatch.setattr(sky, "stream_and_get", stream_and_get)
    caplog.set_level("INFO", logger="artcloud.sky")
    stdout = sys.stdout
    server_task = build_task(secrets=launch_secrets)
    with ThreadPoolExecutor(1) as pool:  # as SkyBackend calls it: asyncio.to_thread
        done = pool.submit(SkyPilotAPI().launch, server_task.config, secrets=server_task.secrets, cluster_name="c1",
                           idle_minutes=10)
        assert streaming.wait(10)
        print("the main thread's own line")
        printed.set()
        assert done.result(30) == Launched(job_id=7)

    assert capsys.readouterr().out == "the main thread's own line\n"
    assert [r.getMessage() for r in caplog.records if r.name == "artcloud.sky"] == [
        "Running on cluster: c1", "Considered resources (1 node):", "⚙︎ Launching on AWS us-east-1 (us-east-1a).",
        "  Uploading  50%", "  Uploading 100%", "✓ Cluster launched: c1.  View logs: sky logs --provision c1"]
    assert sys.stdout is stdout and fakes.calls["launch"]


# ----------------------------------------------------------------------------------------- the other calls

def _status_json(name="c1", status="UP", **more):
    return {"name": name, "launched_at": 1_700_000_000, "status": status, "autostop": 10, "to_down": True,
            "cluster_hash": "h", "cluster_ever_up": True, "user_hash": "u", "user_name": "me",
            "workspace": "default", "nodes": 1, "resources_str": "1x AWS(p5.4xlarge, {'H100': 1})",
            "last_use": "", "status_updated_at": 0, **more}


def test_status(sky, monkeypatch):
    fakes = FakeSDK(sky, monkeypatch)
    fakes.answer("status", lambda: decode("status", [_status_json()]))
    assert SkyPilotAPI().status("c1") == ClusterInfo(
        name="c1", status="UP", launched_at=1_700_000_000, autostop_minutes=10, to_down=True,
        resources="1x AWS(p5.4xlarge, {'H100': 1})")
    from sky.utils.common import StatusRefreshMode

    # Listing reads the API server's cache (sky.status's own default); deciding that a machine is gone refreshes
    # a cluster with autostop or spot, i.e. every artcloud cluster (AUTO, not FORCE: no cloud call per poll).
    assert SkyPilotAPI().status("c1", refresh=True) is not None
    assert fakes.calls["status"] == [((["c1"],), {"refresh": StatusRefreshMode.NONE}),
                                     ((["c1"],), {"refresh": StatusRefreshMode.AUTO})]
    fakes.answer("status", lambda: decode("status", [_status_json(status="AUTOSTOPPING", autostop=-1,
                                                                   to_down=False)]))
    assert SkyPilotAPI().status("c1").status == "AUTOSTOPPING"
    # INIT is a launch in progress or a node found unwell: init_kind tells them apart (responses.py:126-131).
    fakes.answer("status", lambda: decode("status", [_status_json(status="INIT", init_kind="unhealthy")]))
    info = SkyPilotAPI().status("c1", refresh=True)
    assert (info.status, info.init_kind) == ("INIT", "unhealthy")
    fakes.answer("status", lambda: decode("status", []))  # torn down or never launched: left out
    assert SkyPilotAPI().status("c1") is None


def test_job_status(sky, monkeypatch):
    from sky import exceptions

    fakes = FakeSDK(sky, monkeypatch)
    fakes.answer("job_status", lambda: decode("job_status", {"3": "RUNNING"}))
    assert SkyPilotAPI().job_status("c1", 3) == "RUNNING"
    assert SkyPilotAPI().job_status("c1", None) == "RUNNING"
    assert [c[0] for c in fakes.calls["job_status"]] == [("c1", [3]), ("c1", None)]
    fakes.answer("job_status", lambda: decode("job_status", {"4": None}))  # no such job
    assert SkyPilotAPI().job_status("c1", 4) is None
    # No job at all: the server's {None: None} travels as {"None": None}, which 0.14.1's decoder cannot int().
    fakes.answer("job_status", lambda: decode("job_status", {"None": None}))
    assert SkyPilotAPI().job_status("c1", None) is None
    for error in (exceptions.ClusterDoesNotExist("Cluster 'c1' does not exist."),
                  exceptions.ClusterNotUpError("Cluster 'c1' is not up.", cluster_status=None)):
        fakes.answer("job_status", lambda error=error: (_ for _ in ()).throw(error))
        assert SkyPilotAPI().job_status("c1", 3) is None


def test_endpoint(sky, monkeypatch):
    from sky import exceptions

    fakes = FakeSDK(sky, monkeypatch)
    fakes.answer("endpoints", lambda: decode("endpoints", {"8080": "3.4.5.6:8080"}))  # keys become ints
    assert SkyPilotAPI().endpoint("c1", 8080) == "3.4.5.6:8080"
    assert fakes.calls["endpoints"] == [(("c1", 8080), {})]
    # A URL stays a URL (scheme and path kept): the caller must see that it is not a plain TCP port.
    fakes.answer("endpoints", lambda: decode("endpoints", {"8080": "https://c1.example.com:8080/"}))
    assert SkyPilotAPI().endpoint("c1", 8080) == "https://c1.example.com:8080"
    fakes.answer("endpoints", lambda: decode("endpoints", {}))  # not open yet
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
    fakes = FakeSDK(sky, monkeypatch)
    fakes.answer("endpoints", lambda: served("endpoints", _endpoint_url(found, SERVER_PORT)))
    assert SkyPilotAPI().endpoint("c1", SERVER_PORT) == "http://172.18.0.2:80/skypilot/default/c1-2ea4/8080"


def test_endpoint_as_skypilot_reports_vast(sky, monkeypatch):
    """Vast forwards 8080 alone (to the SSH gateway's next port): the server's port must be 8080."""
    from sky.provision.vast import instance

    monkeypatch.setattr(instance, "_filter_instances",
                        lambda *a, **k: {"i-1": {"ssh_host": "ssh4.vast.ai", "ssh_port": 40022}})
    fakes = FakeSDK(sky, monkeypatch)
    found = instance.query_ports("c1-2ea4", [str(SERVER_PORT)])
    fakes.answer("endpoints", lambda: served("endpoints", _endpoint_url(found, SERVER_PORT)))
    assert SkyPilotAPI().endpoint("c1", SERVER_PORT) == "ssh4.vast.ai:40023"


def test_logs_skip_control_messages_and_need_the_cluster(sky, monkeypatch):
    from sky import exceptions

    fakes = FakeSDK(sky, monkeypatch)
    fakes.answer("status", lambda: decode("status", [_status_json()]))
    # decode_rich_status: lines with their newline; None for each spinner/heartbeat message off the main thread.
    fakes.answer("tail_logs", lambda: iter(["setting up\n", None, "serving on 8443\r\n", None, "par", "tial"]))
    assert list(SkyPilotAPI().logs("c1", follow=True, tail=5)) == ["setting up", "serving on 8443", "partial"]
    (args, kwargs), = fakes.calls["tail_logs"]
    assert kwargs == {"job_id": None, "follow": True, "tail": 5, "preload_content": False}
    fakes.answer("status", lambda: decode("status", []))
    with pytest.raises(exceptions.ClusterDoesNotExist):
        SkyPilotAPI().logs("c1")


def test_autostop_and_down(sky, monkeypatch):
    from sky import exceptions

    fakes = FakeSDK(sky, monkeypatch)
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
    fakes = FakeSDK(sky, monkeypatch)
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


def test_a_cloud_whose_sdk_is_missing_is_named_as_the_artcloud_extra(sky, monkeypatch, capsys):
    """artcloud[sky] brings SkyPilot without any cloud's SDK. What the API server's own `sky check runpod` streams
    where the runpod SDK is missing (this venv) becomes one line naming `pip install 'artcloud[sky-runpod]'`."""
    import importlib.util

    from sky import check, global_user_state

    from artcloud.backends.sky import SkyBackend, SkyError

    assert importlib.util.find_spec("runpod") is None, "this test runs where RunPod's SDK is not installed"
    for name in ("set_allowed_clouds", "set_enabled_clouds", "set_check_results"):  # the state the other tests read
        monkeypatch.setattr(global_user_state, name, lambda *args, **kwargs: None)
    capsys.readouterr()
    answer = check.check(quiet=False, verbose=False, clouds=("runpod",))  # the server side of sdk.check, offline
    fakes = FakeSDK(sky, monkeypatch)
    fakes.answer("check", ("printing", capsys.readouterr().out, answer))
    with pytest.raises(SkyError) as raised:
        SkyBackend(gpu="H100:1", cloud="runpod", api=SkyPilotAPI()).plan()
    assert raised.value.code == "cloud_sdk_missing" and raised.value.field == "cloud"
    assert str(raised.value).startswith("runpod's SDK is not installed: pip install 'artcloud[sky-runpod]', then "
                                        "`sky check runpod` (sky check says: RunPod: disabled Reason [compute]: "
                                        'Failed to import runpod or TOML parser. Install: pip install "skypilot[runpod]".')
    assert "\n" not in str(raised.value)


def test_enabled_clouds(sky, monkeypatch):
    from sky import core, exceptions

    fakes = FakeSDK(sky, monkeypatch)
    # The server's own answer, from the state database the fixture wrote (AWS and GCP enabled).
    fakes.answer("enabled_clouds", lambda: served("enabled_clouds", core.enabled_clouds()))
    assert SkyPilotAPI().enabled_clouds() == ["aws", "gcp"]
    assert fakes.calls["enabled_clouds"] == [((), {})]  # expand=False: clouds, not each Kubernetes context
    # The encoder's declared input is Cloud objects, whose str() is capitalised.
    fakes.answer("enabled_clouds", lambda: served("enabled_clouds", [sky.clouds.Kubernetes(), sky.AWS()]))
    assert SkyPilotAPI().enabled_clouds() == ["kubernetes", "aws"]
    fakes.answer("enabled_clouds", lambda: (_ for _ in ()).throw(
        exceptions.ApiServerConnectionError("http://127.0.0.1:46580")))
    assert SkyPilotAPI().enabled_clouds() is None


def test_gpu_offers(sky, monkeypatch):
    fakes = FakeSDK(sky, monkeypatch)
    rows = {"H100": [["AWS", "p5.4xlarge", "H100", 1.0, 16.0, 80.0, 256.0, 6.88, 2.75, "us-east-1"],
                     ["Kubernetes", None, "H100", 2.0, None, 80.0, None, 0.0, float("nan"), "ctx"]]}
    fakes.answer("list_accelerators", lambda: decode("list_accelerators", rows))
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
