"""engine_args: the vLLM engine's settings, from the operator (--engine-args, ARTCLOUD_ENGINE_ARGS, a
backend's engine_args=) and per model (RegisterRequest.engine_args, TrainableModel(engine_args=)).
A client may set sizes and switches only; what artcloud sets itself (loopback host, port, key) no one
may; the CPU engine has none. The vLLM side is tests/test_vllm_server.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import TINY

from artcloud.backends.remote import engine_args_env
from artcloud.server.engines.choose import check_engine_args


def test_a_client_may_set_sizes_but_not_paths_ports_or_remote_code():
    check_engine_args({"max_model_len": 4096, "gpu_memory_utilization": 0.8, "load_in_4bit": True}, from_client=True)
    for bad, says in [({"host": "0.0.0.0"}, "set by artcloud"), ({"api_key": "x"}, "set by artcloud"),
                      ({"trust_remote_code": True}, "cannot be set per model"), ({"chat_template": "/etc/x"}, "cannot be set per model"),
                      ({"max-model-len": 1}, "not a flag name"), ({"dtype": "x" * 65}, "short string")]:
        with pytest.raises(ValueError, match=says):
            check_engine_args(bad, from_client=True)
    # The operator may set any vLLM flag but artcloud's own.
    check_engine_args({"speculative_config": {"method": "ngram"}, "trust_remote_code": True}, from_client=False)
    with pytest.raises(ValueError, match="set by artcloud"):
        check_engine_args({"port": 1}, from_client=False)


def test_register_refuses_engine_args_the_cpu_engine_or_a_loaded_base_model_cannot_take(tiny_server):
    with tiny_server.client() as c:
        def register(name, args):
            return c.post("/artcloud/models", json={"name": name, "project": "tests", "base_model": TINY, "engine_args": args})

        r = register("e1", {"host": "0.0.0.0"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_engine_args", r.text
        assert r.json()["error"]["field"] == "engine_args"
        # tiny-random is loaded already (by `agent`), without engine_args: a model on it cannot change them.
        r = register("e2", {"max_model_len": 512})
        assert r.status_code == 409 and r.json()["error"]["code"] == "engine_args_conflict", r.text
        assert "e2" not in [m["name"] for m in c.get("/artcloud/status").json()["models"]]


def test_the_cpu_engine_has_no_engine_args(tmp_path):
    from fastapi.testclient import TestClient

    from artcloud.server.app import create_app
    from artcloud.server.state import Registry

    token = "t" * 32
    with TestClient(create_app(Registry(tmp_path / "d", engine="cpu"), token), headers={"Authorization": f"Bearer {token}"}) as c:
        r = c.post("/artcloud/models", json={"name": "a", "project": "p", "base_model": TINY, "engine_args": {"max_model_len": 512}})
        assert r.status_code == 400 and r.json()["error"]["field"] == "engine_args", r.text
        assert "apply to the vllm engines" in r.json()["error"]["message"]


def test_serve_reads_engine_args_from_the_flag_or_the_environment_and_says_what_is_wrong(tmp_path):
    base = [sys.executable, "-m", "artcloud", "serve", "--path", str(tmp_path), "--port", "0"]
    r = subprocess.run(base + ["--engine-args", "{not json"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--engine-args is not JSON" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(base + ["--engine-args", "[1]"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "must be a JSON object" in r.stderr
    env = {**__import__("os").environ, **engine_args_env({"port": 9})}
    r = subprocess.run(base + ["--engine", "vllm"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0 and "'port' is set by artcloud" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(base + ["--vllm-python", str(tmp_path / "nope")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "no executable there" in r.stderr


def test_backends_hand_engine_args_to_the_server_they_start(tmp_path):
    from artcloud.backends.local import LocalBackend

    assert json.loads(engine_args_env({"max_model_len": 8192})["ARTCLOUD_ENGINE_ARGS"]) == {"max_model_len": 8192}
    assert engine_args_env(None) == {}
    local = LocalBackend(tmp_path, engine="vllm", engine_args={"max_model_len": 8192})
    assert local.engine_env == {"ARTCLOUD_ENGINE_ARGS": '{"max_model_len": 8192}'}
    with pytest.raises(ValueError, match="engine_args must be a dict"):
        LocalBackend(tmp_path, engine_args=[("a", 1)])


def test_sky_and_modal_backends_put_engine_args_in_the_servers_environment(tmp_path):
    from artcloud.backends.modal import ModalBackend
    from artcloud.backends.sky import SkyBackend

    args = {"gpu_memory_utilization": 0.8, "load_in_4bit": True}
    modal = ModalBackend(engine_args=args, state_dir=tmp_path / "m")
    sky = SkyBackend(engine_args=args, state_dir=tmp_path / "s", api=object())
    for backend in (modal, sky):
        assert json.loads(backend.env["ARTCLOUD_ENGINE_ARGS"]) == args
