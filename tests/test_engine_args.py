"""engine_args: the vLLM engine's settings, from the operator (--engine-args, ARTCLOUD_ENGINE_ARGS, a
backend's engine_args=) and per model (RegisterRequest.engine_args, TrainableModel(engine_args=)).
A client may set sizes and switches only; what artcloud sets itself (loopback host, port, key) no one
may; the CPU engine takes those it honours (max_model_len, max_seq_length, dtype, seed) and names the rest.
The vLLM side is tests/test_vllm_server.py."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import uuid

import pytest
from conftest import TINY

import artcloud
from artcloud.backends.spec import SandboxSpec
from artcloud.server.engines.choose import check_engine_args

MESSAGES = [{"role": "user", "content": "Tell me something."}]  # 43 tokens with tiny-random's default system prompt


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


def test_the_cpu_engine_takes_the_engine_args_it_honours_and_names_the_rest(tmp_path):
    from fastapi.testclient import TestClient

    from artcloud.server.app import create_app
    from artcloud.server.registry import Registry

    token = "t" * 32
    long_prompt = [{"role": "user", "content": "word " * 20}]

    def app(engine_args=None, folder="d"):
        return TestClient(create_app(Registry(tmp_path / folder, engine="cpu", engine_args=engine_args), token),
                          headers={"Authorization": f"Bearer {token}"})

    def register(c, name, args):
        return c.post("/artcloud/models", json={"name": name, "project": "p", "base_model": TINY, "engine_args": args})

    with app() as c:
        r = register(c, "a", {"max_model_len": 64, "trust_remote_code": True})
        error = r.json()["error"]
        assert r.status_code == 400 and error["code"] == "invalid_engine_args", r.text
        assert "'trust_remote_code' cannot be set per model" in error["message"] and "\n" not in error["message"]
        r = register(c, "a", {"max_model_len": 4096})  # over tiny-random's 2048 positions
        assert r.status_code == 400 and r.json()["error"]["field"] == "engine_args.max_model_len", r.text
        assert not c.get("/artcloud/status").json()["engines"]  # nothing loaded by a refused register

        # A bound on prompt + completion tokens, for real; and the dtype the weights load in.
        assert register(c, "a", {"max_model_len": 64, "dtype": "bfloat16"}).status_code == 200
        assert c.get("/artcloud/status").json()["engines"][0]["engine"] == "cpu (torch cpu, bfloat16)"
        out = c.post("/v1/chat/completions", json={"model": "a", "messages": MESSAGES, "max_tokens": 500, "seed": 1}).json()
        assert out["usage"]["prompt_tokens"] == 43 and out["usage"]["total_tokens"] == 64, out["usage"]
        assert out["choices"][0]["finish_reason"] == "length"
        r = c.post("/v1/chat/completions", json={"model": "a", "messages": long_prompt})
        assert r.status_code == 400 and "this model takes at most 64" in r.json()["error"]["message"], r.text

    # The operator's (artcloud serve --engine-args, LocalBackend(engine_args=)) are the defaults under a model's.
    with app({"max_seq_length": 50}) as c:
        assert register(c, "b", None).status_code == 200
        r = c.post("/v1/chat/completions", json={"model": "b", "messages": long_prompt})
        assert r.status_code == 400 and "this model takes at most 50" in r.json()["error"]["message"], r.text

    # seed: requests without a seed of their own sample the same on a fresh server with the same seed.
    def unseeded(seed):
        with app(folder=f"seed-{uuid.uuid4().hex}") as c:  # a fresh server each time
            assert register(c, "s", {"seed": seed}).status_code == 200
            body = {"model": "s", "messages": MESSAGES, "max_tokens": 8, "n": 2}
            return [[ch["token_ids"] for ch in c.post("/v1/chat/completions", json=body).json()["choices"]]
                    for _ in range(2)]

    first = unseeded(7)
    assert first == unseeded(7) and first[0] != first[1] and first != unseeded(8)
    with app(folder="bad-seed") as c:
        r = register(c, "s", {"seed": -1})
        assert r.status_code == 400 and r.json()["error"]["field"] == "engine_args.seed", r.text
    # The GPU engine's settings (ART's templates set gpu_memory_utilization) are taken without effect, and said so.
    with app(folder="gpu-args") as c:
        r = register(c, "g", {"max_model_len": 64, "gpu_memory_utilization": 0.8, "enforce_eager": True})
        assert r.status_code == 200, r.text
        assert r.json()["warnings"] == ["engine_args enforce_eager, gpu_memory_utilization: the GPU engine's (vLLM's, "
                                        "Unsloth's), without effect on the CPU engine, which takes max_model_len, "
                                        "max_seq_length, dtype, seed, trainer_procs"]
    # Any other vLLM flag of the operator's is refused by the CPU engine, naming it.
    with pytest.raises(artcloud.InvalidArgument, match="^engine_args block_size: not for the CPU engine"):
        Registry(tmp_path / "e", engine="cpu", engine_args={"block_size": 16})


def test_auto_falling_back_to_the_cpu_engine_keeps_the_operators_engine_args_it_can_take(monkeypatch, tmp_path, caplog):
    import torch

    from artcloud.server.engines import choose

    caplog.set_level(logging.WARNING, "artcloud.engine")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    factory = choose.engine_factory("auto", workdir=tmp_path, engine_args={"max_model_len": 64, "gpu_memory_utilization": 0.8})
    assert factory.func is choose.cpu_engine and factory.keywords == {"defaults": {"max_model_len": 64}}
    assert "it ignores engine_args gpu_memory_utilization" in caplog.text


def test_several_gpus_are_placed_by_the_models_size_or_as_the_operator_says():
    """Trainer on the first GPUs, vLLM replicas on the rest (choose.gpu_placement), on 80 GB GPUs."""
    from artcloud.server.engines.choose import EngineArgsError, gpu_placement

    gpus = [str(i) for i in range(16)]

    def place(gb: float, n: int, **args):
        p = gpu_placement(gpus[:n], int(gb * 1e9), int(80e9), args)
        return len(p.trainer), p.tensor_parallel, p.replicas, p.vllm[0]

    assert place(15, 8) == (1, 1, 7, "1")  # a 7B model: as before sharding, the trainer on GPU 0
    assert place(15, 2) == (1, 1, 1, "1")
    assert place(65, 8) == (4, 2, 2, "4")  # 32B: replicas of 2 GPUs, the trainer sharded over what is left
    assert place(141, 8) == (4, 4, 1, "4")  # 70B
    assert place(141, 16) == (8, 4, 2, "8")
    assert place(15, 8, trainer_gpus=2) == (2, 1, 6, "2")
    assert place(15, 8, tensor_parallel_size=2) == (2, 2, 3, "2")
    line = gpu_placement(gpus[:8], int(65e9), int(80e9), {}).line
    assert line.startswith("trainer sharded over GPUs 0,1,2,3 (FSDP2), vLLM on GPUs 4,5,6,7: 2 replicas of 2 GPUs")
    for args, n, field, said in [({"trainer_gpus": 8}, 8, "engine_args.trainer_gpus", "from 1 to 7 on 8 GPUs"),
                                 ({"trainer_gpus": 1.5}, 8, "engine_args.trainer_gpus", "not 1.5"),
                                 ({"tensor_parallel_size": 0}, 8, "engine_args.tensor_parallel_size", "not 0"),
                                 ({}, 4, "engine_args.trainer_gpus", "4 GPUs cannot hold the trainer")]:
        with pytest.raises(EngineArgsError, match=said) as caught:
            gpu_placement(gpus[:n], int(141e9 if not args else 15e9), int(80e9), args)
        assert caught.value.field == field


def test_a_models_weight_size_is_counted_in_bfloat16(tmp_path):
    from artcloud.server.engines.choose import weight_bytes

    for stored, size, counted in [("float32", 4000, 2000), ("bfloat16", 4000, 4000), (None, 4000, 4000)]:
        folder = tmp_path / str(stored)
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"torch_dtype": stored} if stored else {}))
        (folder / "model-00001.safetensors").write_bytes(b"\0" * (size // 2))
        (folder / "model-00002.safetensors").write_bytes(b"\0" * (size // 2))
        assert weight_bytes(folder) == counted, stored


def test_the_vllm_engine_refuses_a_placement_it_cannot_run(tmp_path):
    """Checked before anything loads: trainer_gpus on a CPU, trainer_procs on GPUs, more than one trainer GPU on a
    shared one, Unsloth sharded."""
    from artcloud.server.engines.choose import EngineArgsError, build_vllm_engine

    for n, trainer, args, said in [(0, "peft", {"trainer_gpus": 2}, "trainer_gpus is for CUDA GPUs"),
                                   (0, "peft", {"trainer_procs": 0}, "trainer_procs must be a whole number"),
                                   (2, "peft", {"trainer_procs": 2}, "trainer_procs is for a CPU"),
                                   (1, "peft", {"trainer_gpus": 2}, "on one GPU the trainer and vLLM share it"),
                                   (0, "unsloth", {"trainer_procs": 2}, "Unsloth trains on one device")]:
        with pytest.raises(EngineArgsError, match=said):
            build_vllm_engine(TINY, trainer=trainer, workdir=tmp_path, engine_args=args, cuda_devices=n)


def test_arts_engine_args_on_a_local_backend_take_effect_or_are_named_in_a_warning(tmp_path):
    """ART's `_internal_config=art.dev.InternalModelConfig(engine_args=...)` (its own SFT template's): on
    LocalBackend's CPU engine, max_model_len bounds what the model samples; vLLM's memory setting has no effect
    there, and one warning names it."""
    async def main() -> None:
        async with artcloud.LocalBackend(tmp_path / "local") as backend:
            model = artcloud.TrainableModel(name="short", project="p", base_model=TINY,
                                            _internal_config=artcloud.dev.InternalModelConfig(
                                                engine_args={"max_model_len": 64, "gpu_memory_utilization": 0.7}))
            with pytest.warns(UserWarning, match=r"^short: engine_args gpu_memory_utilization: the GPU engine's"):
                await model.register(backend)
            r = await model.openai_client().chat.completions.create(model=model.name, messages=MESSAGES, max_tokens=500,
                                                                     temperature=0)  # greedy: no EOS drawn by chance
            assert r.usage.total_tokens == 64 and r.choices[0].finish_reason == "length", r.usage
            await backend.down()

    asyncio.run(main())


def test_serve_reads_engine_args_from_the_flag_or_the_environment_and_says_what_is_wrong(tmp_path):
    base = [sys.executable, "-m", "artcloud", "serve", "--path", str(tmp_path), "--port", "0"]
    r = subprocess.run(base + ["--engine-args", "{not json"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--engine-args is not JSON" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(base + ["--engine-args", "[1]"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "must be a JSON object" in r.stderr
    env = {**__import__("os").environ, **SandboxSpec(engine_args={"port": 9}).engine_env()}
    r = subprocess.run(base + ["--engine", "vllm"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0 and "'port' is set by artcloud" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(base + ["--vllm-python", str(tmp_path / "nope")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "no executable there" in r.stderr


def test_backends_hand_engine_args_to_the_server_they_start(tmp_path):
    from artcloud.backends.local import LocalBackend

    assert json.loads(SandboxSpec(engine_args={"max_model_len": 8192}).engine_env()["ARTCLOUD_ENGINE_ARGS"]) == {
        "max_model_len": 8192}
    assert SandboxSpec().engine_env() == {}
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


def test_vllm_cpu_settings_the_servers_environment_sets_win_over_the_defaults(monkeypatch):
    """vllm_defaults binds vLLM's CPU threads to every core unless the operator's environment says otherwise (the
    Makefile once set VLLM_CPU_OMP_THREADS_BIND=nobind for the conformance suite and the default overrode it)."""
    from artcloud.server.engines.choose import vllm_defaults

    for key in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    assert vllm_defaults(0)[1] == {"VLLM_CPU_OMP_THREADS_BIND": "0-3", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                                   "VLLM_CPU_KVCACHE_SPACE": "1"}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert vllm_defaults(0)[1] == {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                                   "VLLM_CPU_KVCACHE_SPACE": "3"}
    assert vllm_defaults(1)[1] == {}  # CUDA: vLLM's own
