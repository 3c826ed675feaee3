"""The CPU engine: the torch sampler and the peft trainer on one model in memory (torch + transformers +
peft). Also correct, if slow, on one GPU; vLLM + Unsloth is the GPU engine (gpu.py)."""

from __future__ import annotations

from artcloud.server.engines.engine import Engine
from artcloud.server.engines.peft_trainer import OPTIMIZER_FILE, PeftTrainer
from artcloud.server.engines.torch_sampler import TorchSampler

__all__ = ["CPUEngine", "OPTIMIZER_FILE"]


class CPUEngine(Engine):
    def __init__(self, base_model: str, *, dtype: str = "float32", device: str = "cpu"):
        trainer = PeftTrainer(base_model, dtype=dtype, device=device)
        super().__init__(TorchSampler(trainer), trainer, description=f"cpu (torch {device}, {dtype})")
