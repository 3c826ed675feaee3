"""The peft trainer sharded over several processes: FSDP2 (`torch.distributed.fsdp.fully_shard`) under torchrun.

One `ShardedPeftTrainer` runs on each rank, with every sample; the shared GRPO loop (artcloud.train.loop,
given a `World`) has each rank train a slice of every minibatch's groups, and the update equals the
single-process one. The base model's weights are sharded layer by layer (a model too big for one device
fits in several); the LoRA weights and AdamW's state are sharded with them.

Checkpoints are the peft trainer's layout exactly: rank 0 writes the gathered adapter (PEFT) and AdamW's
state indexed by the LoRA parameters sorted by name, so a checkpoint resumes on any world size and with
any trainer (1 -> 2 -> 1 ranks, CPU or GPU). Every method is collective: each rank calls it, in the same
order. Not built yet: the driver in the server that starts the ranks and sends them these calls.

gloo on a CPU, NCCL on GPUs. gloo has no pre-multiplied sum, so FSDP's default average over ranks stays,
and the loop scales each rank's loss by the world's size instead.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from artcloud.errors import NotSupported
from artcloud.server.engines.peft_trainer import OPTIMIZER_FILE, PeftTrainer
from artcloud.train import loop
from artcloud.types import LoraConfig, TrainConfig

COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # a rank that died leaves the others waiting this long at most


def join_world(backend: str | None = None) -> loop.World:
    """This process's rank in the group torchrun started (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the
    environment), and a sum across it."""
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)

    def total(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=_collective_device())
        dist.all_reduce(t)
        return t.tolist()

    return loop.World(rank=dist.get_rank(), size=dist.get_world_size(), sum=total)


def _collective_device() -> torch.device:
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


class ShardedPeftTrainer(PeftTrainer):
    """The peft trainer on one rank of `world`. It holds one adapter: the model is sharded when it is made."""

    def __init__(self, base_model: str, world: loop.World, *, dtype: str = "float32", device: str = "cpu"):
        super().__init__(base_model, dtype=dtype, device=device)
        self.world = world

    def create_adapter(self, slot: str, lora: LoraConfig) -> None:
        if self.peft is not None:
            raise NotSupported(f"the sharded trainer holds one adapter per base model (it has {next(iter(self.names))!r}): "
                               "register other models on a server of their own")
        super().create_adapter(slot, lora)  # the same seeded initialisation on every rank
        from torch.distributed.fsdp import fully_shard

        for layer in self.peft.base_model.model.model.layers:
            fully_shard(layer)
        fully_shard(self.peft)

    def delete_adapter(self, slot: str) -> None:
        raise NotSupported("the sharded trainer cannot delete its adapter: stop its server instead")

    def _policy(self, slot: str, config: TrainConfig) -> loop.TrainablePolicy:
        policy = super()._policy(slot, config)
        policy.world = self.world
        return policy

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
        """Every rank reads the same files (a checkpoint of any trainer, any world size) and keeps its shard."""
        from safetensors.torch import load_file
        from torch.distributed.tensor import distribute_tensor

        if slot not in self.names:
            self.create_adapter(slot, lora)
        saved = load_file(folder / "adapter_model.safetensors")
        marker = f".{self.names[slot]}."
        params = self._params(slot)
        with torch.no_grad():
            for name, p in params:
                plain = name.replace(marker, ".")
                if plain not in saved or saved[plain].shape != p.shape:
                    raise NotSupported(f"adapter in {folder} does not match this model at {plain}: another LoRA shape")
                p.copy_(distribute_tensor(saved[plain].to(p.dtype), p.device_mesh, p.placements))
        self.optimizers.pop(slot, None)
        if optimizer:
            state = torch.load(folder / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
            for i, st in state["state"].items():
                _, p = params[i]
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v.shape == p.shape:  # exp_avg, exp_avg_sq: sharded like p
                        st[k] = distribute_tensor(v.to(p.dtype), p.device_mesh, p.placements)
            self._optimizer(slot).load_state_dict(state)

    def rng_state(self) -> dict[str, Any]:
        return {"torch": torch.get_rng_state().tolist(), "world_size": self.world.size}


def _full(t: Any) -> Any:
    """A sharded tensor gathered whole (a collective) on the CPU; anything else as it is."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().to("cpu") if isinstance(t, torch.Tensor) else t
