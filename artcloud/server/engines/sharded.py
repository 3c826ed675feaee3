"""The peft trainer sharded over several processes: FSDP2 (`torch.distributed.fsdp.fully_shard`).

One `ShardedPeftTrainer` runs on each rank, with every sample; the shared GRPO loop (artcloud.train.loop,
given a `World`) has each rank train a slice of every minibatch's groups, and the update equals the
single-process one. The base model's weights are sharded layer by layer (a model too big for one device
fits in several); the LoRA weights and AdamW's state are sharded with them.

Checkpoints are the peft trainer's layout exactly: rank 0 writes the gathered adapter (PEFT) and AdamW's
state indexed by the LoRA parameters sorted by name, so a checkpoint resumes on any world size and with
any trainer (1 -> 2 -> 1 ranks, CPU or GPU). Every method is collective: each rank calls it, in the same
order: `ShardedTrainer`, the server's side, starts the ranks (`python -m artcloud.server.engines.local_group K
FOLDER -- python -m artcloud.server.engines.sharded ...`: they meet in a FileStore and talk over loopback, with
nothing listening on the network) and sends rank 0 each call over a Unix socket in that folder of mode 0700; rank 0
passes it to the others, sealed with the group's key (`Sealed`), and answers. A rank that dies takes its group down
(local_group stops the others): the call fails, the server rolls the model back with load_adapter, and that call
starts a new group.

gloo on a CPU, NCCL on GPUs. gloo has no pre-multiplied sum, so FSDP's default average over ranks stays,
and the loop scales each rank's loss by the world's size instead.

Several nodes (`Rendezvous`): the server's torchrun is node 0 of a static rendezvous on the head, and `follow`
(`artcloud trainer-node`) runs each other node's torchrun, which joins every group the head starts; its ranks learn
the model from rank 0. The ranks of every node prove the trainer nodes' shared key (KEY_ENV) to each other before the
group trains: torchrun's rendezvous lets anyone in. No torchrun sees every node: a rank lost on one node fails the
others at their next exchange with it (gloo and NCCL see the peer's connection close), and the server's next call
starts a new group.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import logging
import os
import pickle
import secrets
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, NoReturn

import torch

from artcloud.errors import ArtcloudError, NotSupported
from artcloud.server.engines import loading, local_group
from artcloud.server.engines.base import EngineError, StepCallback, Trainer, TrainSample
from artcloud.server.engines.children import KEY_ENV, Rendezvous, child_env, die_with_parent, kill_group
from artcloud.server.engines.peft_trainer import OPTIMIZER_FILE, PeftTrainer
from artcloud.train import loop
from artcloud.types import LoraConfig, TrainConfig

log = logging.getLogger("artcloud.engine")

COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # a rank that died leaves the others waiting this long at most


def join_world(backend: str | None = None) -> loop.World:
    """This process's rank in the group local_group or torchrun started (RANK and WORLD_SIZE in the environment, with
    local_group's store or torchrun's MASTER_ADDR/PORT), and a sum across it."""
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        store = os.environ.get(local_group.STORE_ENV)
        if store:  # one node (local_group): a FileStore in the server's 0700 folder, nothing on the network
            dist.init_process_group(backend, init_method=f"file://{store}", rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=COLLECTIVE_TIMEOUT)
        else:  # several nodes: torchrun's rendezvous (MASTER_ADDR/PORT)
            dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)

    def total(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=_collective_device())
        dist.all_reduce(t)
        return t.tolist()

    return loop.World(rank=dist.get_rank(), size=dist.get_world_size(), sum=total)


def _collective_device() -> torch.device:
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


class IntruderError(EngineError):
    """A rank that does not hold the group's key, or a message to the ranks that is not rank 0's."""

    code = "trainer_intruder"


class Sealed:
    """Rank 0's messages to the other ranks, sealed with the group's key (KEY_ENV: the trainer nodes' shared secret,
    not the client's token). torch.distributed authenticates nobody: whoever reaches torchrun's store or a rank's
    port can join a group as a node, or stand in for a peer (security review 3, N2). So each rank first proves it
    holds the key (an HMAC of rank 0's fresh nonce and its rank, all-gathered and checked by every rank) before any
    sample is sent, and a rank unpickles a message only once its HMAC checks: raw bytes until then. Collective:
    every rank makes one, then calls `broadcast` in the same order."""

    def __init__(self, world: loop.World, key: str):
        import torch.distributed as dist

        if not key:
            raise IntruderError(f"this rank has no group key ({KEY_ENV} is not set)")
        self.world, self.key, self.sent = world, key.encode(), 0
        nonce = self._tensor(os.urandom(32) if world.rank == 0 else bytes(32))
        dist.broadcast(nonce, src=0)
        self.nonce = self._bytes(nonce)
        tags = [self._tensor(bytes(32)) for _ in range(world.size)]
        dist.all_gather(tags, self._tensor(self._mac(b"member", world.rank)))
        strangers = [r for r, tag in enumerate(tags)
                     if not hmac.compare_digest(self._bytes(tag), self._mac(b"member", r))]
        if strangers:
            self._refuse(f"rank(s) {', '.join(map(str, strangers))} of the trainer group do not hold its key "
                         f"({KEY_ENV}): the group stops before any sample is sent. Something else reached the "
                         "rendezvous port, or a trainer node has another key")

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0: sends `obj` (and returns it); any other rank: returns rank 0's, checked before it is unpickled."""
        import torch.distributed as dist

        self.sent += 1
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.world.rank == 0 else b""
        head = self._tensor(len(data).to_bytes(8, "big") + self._mac(b"size", self.sent, len(data).to_bytes(8, "big"))
                            + self._mac(b"body", self.sent, data) if self.world.rank == 0 else bytes(72))
        dist.broadcast(head, src=0)
        raw = self._bytes(head)
        size = int.from_bytes(raw[:8], "big")
        if not hmac.compare_digest(raw[8:40], self._mac(b"size", self.sent, raw[:8])):
            self._refuse("a message to the trainer's ranks was not sealed with the group's key: the group stops")
        body = self._tensor(data) if self.world.rank == 0 else torch.empty(size, dtype=torch.uint8,
                                                                           device=_collective_device())
        dist.broadcast(body, src=0)
        if self.world.rank == 0:
            return obj
        data = self._bytes(body)
        if not hmac.compare_digest(raw[40:], self._mac(b"body", self.sent, data)):
            self._refuse("a message to the trainer's ranks was not sealed with the group's key: the group stops")
        return pickle.loads(data)

    @staticmethod
    def _refuse(message: str) -> NoReturn:
        """This rank leaves the group (gloo's threads end: exiting with them running aborts) and raises."""
        import torch.distributed as dist

        log.error("%s", message)
        dist.destroy_process_group()
        raise IntruderError(message)

    def _mac(self, label: bytes, number: int, data: bytes = b"") -> bytes:
        nonce = getattr(self, "nonce", b"")
        return hmac.new(self.key, label + nonce + number.to_bytes(8, "big") + data, hashlib.sha256).digest()

    @staticmethod
    def _tensor(data: bytes) -> torch.Tensor:
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        return t.to(_collective_device())

    @staticmethod
    def _bytes(t: torch.Tensor) -> bytes:
        return t.cpu().numpy().tobytes()


class ShardedPeftTrainer(PeftTrainer):
    """The peft trainer on one rank of `world`. It holds one adapter: the model is sharded when it is made.
    In bfloat16 (on GPUs) the base weights stay bfloat16 and the LoRA weights and AdamW's state float32, as in
    the peft trainer. `checkpointing` (default: on CUDA): each decoder layer's activations are recomputed in
    the backward pass instead of kept (torch's composable checkpoint, which keeps parameter names), and a
    group's prompt is no longer run once for all its completions (that reuses a KV cache through the layers)."""

    def __init__(self, base_model: str, world: loop.World, *, dtype: str = "float32", device: str = "cpu",
                 checkpointing: bool | None = None, sealed: Sealed | None = None):
        """`sealed`: the group's channel from rank 0 (default: one made here, from KEY_ENV: a collective)."""
        super().__init__(base_model, dtype=dtype, device=device)
        self.world = world
        self.sealed = sealed or Sealed(world, os.environ.get(KEY_ENV, ""))
        self.checkpointing = self.device.type == "cuda" if checkpointing is None else checkpointing
        if self.checkpointing:
            self.packs_prompts = False

    def create_adapter(self, slot: str, lora: LoraConfig) -> None:
        if self.peft is not None:
            raise NotSupported(f"the sharded trainer holds one adapter per base model (it has {next(iter(self.names))!r}): "
                               "register other models on a server of their own")
        super().create_adapter(slot, lora)  # the same seeded initialisation on every rank
        from torch.distributed._composable import checkpoint
        from torch.distributed.fsdp import fully_shard

        for layer in self.peft.base_model.model.model.layers:
            if self.checkpointing:
                checkpoint(layer)
            fully_shard(layer)
        fully_shard(self.peft)

    def delete_adapter(self, slot: str) -> None:
        """A slot this trainer does not hold (an older step the sampler served) is nothing to delete, as in the peft
        trainer; its one adapter cannot go (FSDP sharded the model around it)."""
        if slot in self.names:
            raise NotSupported("the sharded trainer cannot delete its adapter: stop its server instead")

    def _policy(self, slot: str, config: TrainConfig) -> loop.TrainablePolicy:
        policy = super()._policy(slot, config)
        policy.world = self.world
        return policy

    def _like(self, t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """`t` sharded as parameter `p` is."""
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(t.to(p.dtype), p.device_mesh, p.placements)

    # ------------------------------------------------------------------------------------- state

    def save_adapter(self, slot: str, folder: Path, *, optimizer: bool) -> list[str]:
        """Gathered on every rank (each parameter and optimizer tensor in turn: a collective), written by
        rank 0 as the peft trainer writes them."""
        marker = f".{self.names[slot]}."
        lora = {name.replace(marker, "."): _full(p) for name, p in self._params(slot)}
        opt_state = None
        if optimizer:
            own = self._optimizer(slot).state_dict()  # numbered in _params' order: sorted by name
            opt_state = {"state": {i: {k: _full(v) for k, v in st.items()} for i, st in own["state"].items()},
                         "param_groups": own["param_groups"]}
        if self.world.rank != 0:
            return []
        files = self._write_adapter(slot, lora, folder)
        if opt_state is not None:
            torch.save(opt_state, folder / OPTIMIZER_FILE)
            files.append(OPTIMIZER_FILE)
        return files

    def load_adapter(self, slot: str, lora: LoraConfig, folder: Path, *, optimizer: bool) -> None:
        """Rank 0 reads the files (a checkpoint of any trainer, any world size: `folder` is on the head's disk, which
        ranks on other nodes do not see) and sends their bytes to every rank; each keeps its shard."""
        from safetensors.torch import load as load_bytes
        from torch.distributed.tensor import distribute_tensor

        if slot not in self.names:
            self.create_adapter(slot, lora)
        adapter, optimizer_bytes = self._read_on_rank_0(folder, optimizer)
        saved = load_bytes(adapter)
        del adapter
        marker = f".{self.names[slot]}."
        params = self._params(slot)
        with torch.no_grad():
            for name, p in params:
                plain = name.replace(marker, ".")
                if plain not in saved or saved[plain].shape != p.shape:
                    raise NotSupported(f"adapter in {folder} does not match this model at {plain}: another LoRA shape")
                p.copy_(distribute_tensor(saved[plain].to(p.dtype), p.device_mesh, p.placements))
        self.optimizers.pop(slot, None)
        if optimizer_bytes is not None:
            state = torch.load(io.BytesIO(optimizer_bytes), map_location="cpu", weights_only=True)
            for i, st in state["state"].items():
                _, p = params[i]
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v.shape == p.shape:  # exp_avg, exp_avg_sq: sharded like p
                        st[k] = distribute_tensor(v.to(p.dtype), p.device_mesh, p.placements)
            self._optimizer(slot).load_state_dict(state)

    def _read_on_rank_0(self, folder: Path, optimizer: bool) -> tuple[bytes, bytes | None]:
        """The adapter's bytes and (`optimizer`) AdamW's, read by rank 0 and broadcast (a collective). A file rank 0
        cannot read fails the call alike on every rank, and the group goes on."""
        files: Any = None
        if self.world.rank == 0:
            try:
                files = ((folder / "adapter_model.safetensors").read_bytes(),
                         (folder / OPTIMIZER_FILE).read_bytes() if optimizer else None)
            except OSError as e:
                files = f"cannot read the checkpoint in {folder}: {e.strerror or e}"
        files = self.sealed.broadcast(files)
        if isinstance(files, str):
            raise EngineError(files, code="checkpoint_invalid")
        return files


def _full(t: Any) -> Any:
    """A sharded tensor gathered whole (a collective) on the CPU; anything else as it is."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().to("cpu") if isinstance(t, torch.Tensor) else t


# ----------------------------------------------------------------------------------------- the server's side

START_TIMEOUT_S = 600.0  # the ranks starting, then each loading the model
GROUP_KEY = "artcloud/group"  # in torchrun's store on the head: the id of the group it holds (Sealed's nonce)
GROUP_FILE_ENV = "ARTCLOUD_GROUP_FILE"  # where a trainer node's first rank writes that id, for `follow`
CALLS = ("create_adapter", "delete_adapter", "train_step", "save_adapter", "load_adapter", "rng_state", "set_rng_state")


class ShardedTrainer(Trainer):
    """The sharded trainer as the server's engine sees it: `procs` ranks of ShardedPeftTrainer in other
    processes, each call made on all of them. The tokenizer and the model's shape are read here (no weights)."""

    def __init__(self, base_model: str, procs: int, *, dtype: str = "float32", device: str = "cpu",
                 env: dict[str, str] | None = None, rendezvous: Rendezvous | None = None):
        """`device` "cpu" or "cuda" (rank r on the r-th GPU the environment shows); `env`: more environment for
        the ranks (CUDA_VISIBLE_DEVICES: the trainer's GPUs). `rendezvous`: the ranks here are node 0 of that many
        trainer nodes, whose `artcloud trainer-node` joins each group this starts."""
        from transformers import AutoConfig, AutoTokenizer

        where = loading.resolve(base_model)
        self.base_model, self.procs, self.dtype, self.device, self.env = base_model, procs, dtype, device, dict(env or {})
        self.rendezvous = rendezvous
        self.ranks = procs  # in all nodes: known once the group is up
        self.tokenizer = AutoTokenizer.from_pretrained(where)
        loading.prepare_tokenizer(self.tokenizer, base_model)
        config = AutoConfig.from_pretrained(where)
        self.vocab_size = int(config.vocab_size)
        self.max_context = int(getattr(config, "max_position_embeddings", 0) or 4096)
        self.pad_id = self.tokenizer.pad_token_id
        self.restarts = -1  # groups started so far, less the first
        self.proc: subprocess.Popen | None = None
        self.conn: socket.socket | None = None
        self._folder: Path | None = None
        self._lock = threading.Lock()
        self._start()

    # ------------------------------------------------------------------------------------- the ranks

    def _start(self) -> None:
        self._folder = Path(tempfile.mkdtemp(prefix="artcloud-ranks-"))  # mode 0700
        path = self._folder / "control.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen(1)
        rank = ["-m", "artcloud.server.engines.sharded", str(path), self.base_model, self.dtype, self.device]
        if self.rendezvous is not None:
            argv = [sys.executable, "-m", "torch.distributed.run", *self.rendezvous.torchrun(self.procs, 0), *rank]
        else:
            argv = [sys.executable, "-m", "artcloud.server.engines.local_group", str(self.procs), str(self._folder),
                    "--", sys.executable, *rank]
        log.info("starting the sharded trainer: %d ranks of %s (%s, %s)", self.procs, self.base_model, self.device, self.dtype)
        # The ranks' shared secret: the trainer nodes' (the same on each), or one of this group's own on one node.
        key = self.rendezvous.key if self.rendezvous is not None else secrets.token_hex(32)
        env = {**child_env(os.environ), **self.env, KEY_ENV: key}
        if self.device == "cpu":  # 1 thread a rank would leave cores idle: they are shared out
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.procs)))
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent, env=env)
        self.restarts += 1
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while not select.select([listener], [], [], 0.5)[0]:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise EngineError(f"the sharded trainer's ranks did not start (exit code {self.proc.poll()}; "
                                      "their errors are in the server's log above)", code="trainer_failed")
            self.conn, _ = listener.accept()
            kind, ready = _recv(self.conn)
            if kind == "error":
                raise _rebuilt(ready)
        except BaseException:
            self._stop()
            raise
        finally:
            listener.close()
        self.ranks = int(ready["ranks"])
        log.info("the sharded trainer is up: %d ranks on %s%s", ready["ranks"], ready["backend"],
                 f" over {self.rendezvous.nodes} nodes" if self.rendezvous is not None else "")

    def _stop(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.proc is not None and self.proc.poll() is None:
            kill_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def _call(self, name: str, *args: Any, on_event: Callable[[Any], None] | None = None, **kwargs: Any) -> Any:
        with self._lock:
            if self.conn is None or self.proc is None or self.proc.poll() is not None:
                code = self.proc.poll() if self.proc is not None else None
                self._stop()
                self._start()  # a group that died: a fresh one, which holds no adapter yet
                if name not in ("create_adapter", "load_adapter"):
                    raise EngineError(f"the sharded trainer's ranks had stopped (exit code {code}; their errors "
                                      "are in the server's log) and were started again: the model is reloaded from its "
                                      "last committed step", code="trainer_failed")
            assert self.conn is not None
            try:
                _send(self.conn, (name, args, kwargs))
                while True:
                    kind, value = _recv(self.conn)
                    if kind == "event" and on_event is not None:
                        on_event(value)
                    elif kind == "result":
                        return value
                    elif kind == "error":
                        raise _rebuilt(value)
            except (OSError, EOFError) as e:
                try:  # the group stops the other ranks, then exits
                    code = self.proc.wait(timeout=30) if self.proc is not None else None
                except subprocess.TimeoutExpired:
                    code = None
                self._stop()
                raise EngineError(f"the sharded trainer's ranks stopped during {name} (exit code {code}; their "
                                  "errors are in the server's log): the step is not committed, and the next call starts "
                                  "them again", code="trainer_failed") from e

    # ------------------------------------------------------------------------------------- Trainer

    def create_adapter(self, slot: str, lora: LoraConfig) -> None:
        self._call("create_adapter", slot, lora)

    def delete_adapter(self, slot: str) -> None:
        self._call("delete_adapter", slot)

    def train_step(self, slot: str, samples: list[TrainSample], config: TrainConfig,
                   on_step: StepCallback) -> list[dict[str, Any]]:
        return self._call("train_step", slot, samples, config, on_event=on_step)

    def save_adapter(self, slot: str, folder: Path, *, optimizer: bool) -> list[str]:
        return self._call("save_adapter", slot, folder, optimizer=optimizer)

    def load_adapter(self, slot: str, lora: LoraConfig, folder: Path, *, optimizer: bool) -> None:
        self._call("load_adapter", slot, lora, folder, optimizer=optimizer)

    def rng_state(self) -> dict[str, Any]:
        return self._call("rng_state")

    def set_rng_state(self, state: dict[str, Any]) -> None:
        self._call("set_rng_state", state)

    def status(self) -> dict[str, Any]:
        return {"kind": "sharded", "ranks": self.ranks, "nodes": self.rendezvous.nodes if self.rendezvous else 1,
                "restarts": self.restarts, "pid": self.proc.pid if self.proc is not None else None}

    def close(self) -> None:
        with self._lock:
            if self.conn is not None and self.proc is not None and self.proc.poll() is None:
                try:
                    _send(self.conn, ("close", (), {}))
                    self.proc.wait(timeout=30)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            self._stop()


# ----------------------------------------------------------------------------------------- a rank's side


def serve_rank(control: str, base_model: str, dtype: str, device: str) -> None:
    """One rank: the trainer, and the calls rank 0 receives from the server, made on every rank in order. On
    another node (`follow`) the model and dtype are rank 0's, told after the group forms."""
    import torch.distributed as dist

    world = join_world()
    if device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    conn = None
    if world.rank == 0:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(control)
    try:
        sealed = Sealed(world, os.environ.get(KEY_ENV, ""))
    except IntruderError as e:
        if conn is not None:  # the server's start fails with this, not a bare "did not start"
            _send(conn, ("error", _portable(e)))
        raise
    _note_group(world, sealed.nonce.hex())
    base_model, dtype = sealed.broadcast((base_model, dtype))
    trainer = ShardedPeftTrainer(base_model, world, dtype=dtype, device=device, sealed=sealed)
    if conn is not None:
        _send(conn, ("ready", {"ranks": world.size, "backend": dist.get_backend()}))
    while True:
        name, args, kwargs = sealed.broadcast(_recv(conn) if conn is not None else None)
        if name == "close":
            break
        if name not in CALLS:
            raise EngineError(f"not a trainer call: {name}")
        if name == "train_step":
            args = (*args, (lambda m: _send(conn, ("event", m))) if conn is not None else (lambda m: None))
        try:
            result = getattr(trainer, name)(*args, **kwargs)
        except ArtcloudError as e:  # raised alike on every rank (the loop sums its checks): the group goes on
            if conn is not None:
                _send(conn, ("error", _portable(e)))
            continue
        if conn is not None:
            _send(conn, ("result", result))
    dist.destroy_process_group()


def _note_group(world: loop.World, group: str) -> None:
    """Under torchrun over several nodes: rank 0 marks the head's store with this group's id, and each other node's
    first rank tells its `follow` which group it joined (so that `follow` knows a stale store from the next one)."""
    if os.environ.get(local_group.STORE_ENV) or "MASTER_ADDR" not in os.environ:
        return  # one node (local_group): no store on the network, no `follow`
    if world.rank == 0:
        from torch.distributed import TCPStore

        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=30))
        store.set(GROUP_KEY, group)
    where = os.environ.get(GROUP_FILE_ENV)
    if where and os.environ.get("LOCAL_RANK", "0") == "0":
        Path(where).write_text(group)


def _portable(e: ArtcloudError) -> dict[str, Any]:
    """An error that crosses to the server: its class's name and what rebuilds it."""
    out = {"cls": type(e).__name__, "message": str(e), "code": getattr(e, "code", None)}
    if isinstance(e, loop.NonFiniteError):
        out.update(cause=e.cause, gradient_step=e.gradient_step)
    return out


def _rebuilt(info: dict[str, Any]) -> ArtcloudError:
    if info["cls"] == "NonFiniteError":
        return loop.NonFiniteError(info["cause"], info["gradient_step"])
    if info["cls"] == "NotSupported":
        return NotSupported(info["message"])
    return EngineError(info["message"], code=info["code"] or "trainer_failed")


def _send(conn: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    conn.sendall(struct.pack("!Q", len(data)) + data)


def _recv(conn: socket.socket | None) -> Any:
    """The next message. Both ends are this module, in processes the server started, over a socket in a
    folder only its user can open: the pickles are its own."""
    assert conn is not None
    size = struct.unpack("!Q", _exactly(conn, 8))[0]
    return pickle.loads(_exactly(conn, size))


def _exactly(conn: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the other end closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def follow(rendezvous: Rendezvous, node_rank: int, procs: int, device: str, stop: threading.Event,
           *, again_s: float = 2.0) -> None:
    """`artcloud trainer-node`: this node's `procs` ranks of every group the head's ShardedTrainer starts, until
    `stop` is set. A group ends when a rank of it dies (torchrun stops the rest) or the server closes it; the
    next one is joined once the head's store holds another group than the one that ended (torchrun waits for the
    head's at the rendezvous)."""
    group_file = Path(tempfile.mkdtemp(prefix="artcloud-node-")) / "group"  # mode 0700: this node's first rank's
    try:
        while not stop.is_set():
            argv = [sys.executable, "-m", "torch.distributed.run", *rendezvous.torchrun(procs, node_rank),
                    "-m", "artcloud.server.engines.sharded", "", "", "", device]
            env = {**child_env(os.environ), KEY_ENV: rendezvous.key, GROUP_FILE_ENV: str(group_file)}
            if device == "cpu":
                env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // procs)))
            group_file.unlink(missing_ok=True)
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent, env=env)
            log.info("trainer node %d: %d rank(s) waiting for the group at %s", node_rank, procs, rendezvous.master)
            while proc.poll() is None:
                if stop.wait(0.5):
                    kill_group(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return
            log.info("trainer node %d: the group ended (exit code %s): joining the next one", node_rank,
                     proc.returncode)
            ended = group_file.read_text() if group_file.exists() else None
            stop.wait(again_s)
            _until_new_group(rendezvous.master, ended, stop)
    finally:
        shutil.rmtree(group_file.parent, ignore_errors=True)


def _until_new_group(master: str, ended: str | None, stop: threading.Event, *, limit_s: float = 60.0) -> None:
    """Wait (up to `limit_s`) while the head's store is the one of the group that ended (`ended`: its id, None when
    this node never learned it): torchrun's static rendezvous would join that stale store, which knows nothing of
    the next group. A store that holds another group, or none yet, or no store, is the next group's to join: the
    head restarts its group at once, and checking only the port made a node wait out the limit (code review 3, R4)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and not stop.is_set() and _holds(master, ended):
        stop.wait(0.5)


def _holds(master: str, group: str | None) -> bool:
    """Whether the store at `master` is the one of `group` (None: whether there is a store at all)."""
    from torch.distributed import TCPStore

    host, _, port = master.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1.0).close()
    except OSError:
        return False  # no store: the next one is not up yet, and torchrun waits for it
    if group is None:
        return True
    try:
        store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5))
        return store.check([GROUP_KEY]) and store.get(GROUP_KEY).decode() == group
    except (RuntimeError, ValueError):  # it closed meanwhile
        return False


if __name__ == "__main__":
    serve_rank(*sys.argv[1:5])
