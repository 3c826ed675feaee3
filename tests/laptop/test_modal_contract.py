"""The contract with the installed Modal client (1.6.4): what ModalBackend (artcloud/backends/modal.py) relies on,
read from the package itself with `inspect`. Offline: nothing here talks to a server. The behaviour behind these
pins runs against the fake control plane in tests/test_modal.py and tests/test_modal_fake.py; this file says
when a new modal release moved what they stand on. Paths in the messages are in site-packages/modal/.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import threading
import time
from pathlib import Path

import modal
import modal.exception
import pytest
from modal.sandbox import _impl_v1
from modal.sandbox._common import SandboxCreateArgs, task_id_from_response, tunnels_from_response
from modal.sandbox._impl_v1 import SandboxImplV1
from modal.sandbox._impl_v2 import SandboxImplV2
from modal.sandbox._sandbox import impl_class_for_create_args
from modal_proto import api_pb2

from artcloud import __version__ as artcloud_version
from artcloud.backends import modal as modal_backend
from artcloud.backends.state import check_name

BACKEND = Path(modal_backend.__file__)
_G = api_pb2.GenericResult


def test_the_installed_modal_is_the_one_artcloud_was_checked_against():
    assert modal.__version__ == "1.6.4"


# ----------------------------------------------------------------------------------------- what we call, as we call it

def _modal_calls() -> list[tuple[str, ast.Call]]:
    """Every `modal.<Class>.<method>(...)` (or `.aio(...)`) call in ModalBackend's module, by dotted name."""
    calls = []
    for node in ast.walk(ast.parse(BACKEND.read_text())):
        if not isinstance(node, ast.Call):
            continue
        parts, func = [], node.func
        while isinstance(func, ast.Attribute):
            parts.insert(0, func.attr)
            func = func.value
        if isinstance(func, ast.Name) and func.id == "modal" and len(parts) >= 2 and parts[0][0].isupper():
            calls.append((".".join(p for p in parts if p != "aio"), node))
    return calls


def test_every_modal_call_of_the_backend_binds_to_the_installed_signature():
    calls = _modal_calls()
    names = {name for name, _ in calls}
    assert {"Sandbox.create", "Sandbox.list", "Sandbox.from_id", "Sandbox.from_name", "App.lookup",
            "Secret.from_dict", "Image.debian_slim"} <= names, names
    for name, call in calls:
        owner, method = name.split(".")
        signature = inspect.signature(getattr(getattr(modal, owner), method))
        args = [object() for a in call.args if not isinstance(a, ast.Starred)]
        if any(isinstance(a, ast.Starred) for a in call.args):
            args += ["sh", "-c", "true"]  # Sandbox.create(*command)
        signature.bind(*args, **{k.arg: object() for k in call.keywords})  # TypeError: a renamed or gone parameter


def test_sandbox_create_takes_what_the_backend_passes():
    (create,) = [call for name, call in _modal_calls() if name == "Sandbox.create"]
    passed = {k.arg for k in create.keywords}
    assert passed == {"app", "name", "tags", "image", "env", "secrets", "gpu", "cpu", "memory", "region", "timeout",
                      "idle_timeout", "encrypted_ports"}
    params = inspect.signature(modal.Sandbox.create).parameters
    assert params["timeout"].default == 300 and params["idle_timeout"].default is None  # we always pass timeout


def test_the_handle_methods_the_backend_uses():
    sig = inspect.signature
    sig(modal.Sandbox.tunnels).bind(object(), timeout=50)
    sig(modal.Sandbox.terminate).bind(object())
    sig(modal.Sandbox.poll).bind(object())
    sig(modal.Image.build).bind(object(), object())  # image.build.aio(app) before create
    sig(modal.Image.uv_pip_install).bind(object(), requirements=["gpu.txt"])
    sig(modal.Image.pip_install).bind(object(), "artcloud==0", extra_options="--no-deps")
    sig(modal.Image.add_local_file).bind(object(), "a.whl", "/opt/a.whl", copy=True)
    sig(modal.Image.run_commands).bind(object(), "pip install x")
    assert isinstance(inspect.getattr_static(modal.App, "app_id"), property)  # Sandbox.list(app_id=app.app_id)


def test_tunnels_waits_50_s_by_default_and_times_out_as_sandbox_timeout_error():
    # _endpoint asks one tunnels() call to wait at most TUNNEL_WAIT_S, Modal's own default (sandbox/_sandbox.py:998)
    assert inspect.signature(modal.Sandbox.tunnels).parameters["timeout"].default == modal_backend.TUNNEL_WAIT_S == 50
    timed_out = api_pb2.SandboxGetTunnelsResponse(result=_G(status=_G.GENERIC_STATUS_TIMEOUT))
    with pytest.raises(modal.exception.SandboxTimeoutError):  # sandbox/_common.py:836-840
        tunnels_from_response(timed_out)


# ----------------------------------------------------------------------------------------- a GPU waits inside create

def test_a_gpu_sandbox_goes_through_v1_and_one_without_through_v2(monkeypatch):
    monkeypatch.delenv("MODAL_SANDBOX_V2", raising=False)
    assert impl_class_for_create_args(SandboxCreateArgs(gpu="H100")) is SandboxImplV1  # sandbox/_sandbox.py:72-81
    assert impl_class_for_create_args(SandboxCreateArgs()) is SandboxImplV2  # config "sandbox_v2" defaults to True


def test_v1_create_waits_21_minutes_for_scheduling_then_terminates_and_raises_resource_exhausted():
    # sandbox/_impl_v1.py:88, 157-172: what ModalBackend._scheduled bounds with startup_timeout
    assert _impl_v1._SANDBOX_SCHEDULING_TIMEOUT == 21 * 60
    source = inspect.getsource(SandboxImplV1.create)
    assert "timeout=_SANDBOX_SCHEDULING_TIMEOUT" in source
    assert "except BaseException" in source and "await asyncio.shield(impl.terminate())" in source  # a cancel too
    assert 'raise ResourceExhaustedError("Insufficient capacity to create sandbox.")' in source
    # the global tests/test_modal.py shortens is the one create reads (sandbox/_sandbox.py:62 has an unused twin)
    assert SandboxImplV1.create.__func__.__globals__ is vars(_impl_v1)
    assert _impl_v1.ResourceExhaustedError is modal.exception.ResourceExhaustedError


def test_a_task_id_is_empty_until_scheduled_and_the_wait_ends_at_its_deadline():
    # sandbox/_common.py:843-852, which the fake's SandboxGetTaskId follows
    unscheduled = api_pb2.SandboxGetTaskIdResponse()
    assert task_id_from_response(unscheduled, raise_if_task_complete=True, deadline=None) == ""
    with pytest.raises(modal.exception.TimeoutError):
        task_id_from_response(unscheduled, raise_if_task_complete=True, deadline=time.monotonic())
    ended = api_pb2.SandboxGetTaskIdResponse(task_result=_G(status=_G.GENERIC_STATUS_TERMINATED,
                                                               exception="Sandbox terminated"))
    with pytest.raises(modal.exception.ConflictError, match="Sandbox terminated"):
        task_id_from_response(ended, raise_if_task_complete=True, deadline=None)


def test_modal_errors_are_not_the_builtin_timeout_error():
    # _scheduled tells its own deadline (asyncio.TimeoutError, the builtin one on 3.11+) from Modal's errors
    for name in ("TimeoutError", "SandboxTimeoutError", "ResourceExhaustedError", "NotFoundError", "AuthError"):
        cls = getattr(modal.exception, name)
        assert issubclass(cls, modal.exception.Error) and not issubclass(cls, (TimeoutError, asyncio.TimeoutError))


def test_cancelling_an_aio_call_runs_its_clean_up_before_the_cancel_returns():
    """synchronicity cancels the coroutine on modal's own loop and waits for it (synchronicity/synchronizer.py
    _run_function_async): so when startup_timeout cancels `Sandbox.create.aio`, V1's terminate has run."""
    from modal._utils.async_utils import synchronize_api

    cleaned = threading.Event()

    async def _slow() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(0.2)  # as create's shielded terminate would
            cleaned.set()
            raise

    slow = synchronize_api(_slow, target_module=__name__)

    async def main() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(slow.aio(), 0.2)
        assert cleaned.is_set()

    asyncio.run(main())


def test_listing_by_tag_covers_v1_sandboxes():
    # _terminate_launch finds a GPU (V1) sandbox by its launch tag: with sandbox_v2 (the default), list goes
    # through the call that lists both (sandbox/_sandbox.py:1389-1392, 1399-1406)
    assert "_experimental_list" in inspect.getsource(modal.sandbox._sandbox._Sandbox.list)
    assert "(both v1 and v2)" in inspect.getdoc(modal.sandbox._sandbox._Sandbox._experimental_list)
    assert set(inspect.signature(modal.Sandbox.list).parameters) >= {"app_id", "tags"}


# ----------------------------------------------------------------------------------------- names and tags

def test_the_tags_and_names_the_backend_gives_are_modals_valid_ones():
    from modal._utils.name_utils import check_object_name, check_tag_dict

    check_tag_dict({"artcloud": artcloud_version, modal_backend.LAUNCH_TAG: "0123456789abcdef"})  # name_utils.py:56-66
    for name in ["artcloud-0f3a9c", "mail-agent", "a" * 63, "box-1"]:
        check_name(name)
        check_object_name(name, "Sandbox")  # is_valid_object_name: name_utils.py:26-34
