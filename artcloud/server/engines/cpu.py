"""The CPU engine: the torch sampler and the peft trainer on one model in memory (torch + transformers +
peft). Also correct, if slow, on one GPU; vLLM + Unsloth is the GPU engine (choose.build_vllm_engine)."""

from __future__ import annotations

from artcloud.server.engines.engine import Engine, EngineArgsError
from artcloud.server.engines.peft_trainer import OPTIMIZER_FILE, PeftTrainer
from artcloud.server.engines.torch_sampler import TorchSampler

__all__ = ["CPUEngine", "OPTIMIZER_FILE"]


class CPUEngine(Engine):
    """engine_args it honours (choose.py checks their types): `max_model_len`, `max_seq_length`: bounds on
    prompt + completion tokens, each at most the model's positions; one model samples and trains here, so
    the smaller bounds both. `seed`: the sampling of requests that have no seed of their own."""

    def __init__(self, base_model: str, *, dtype: str = "float32", device: str = "cpu",
                 max_model_len: int | None = None, max_seq_length: int | None = None, seed: int | None = None):
        trainer = PeftTrainer(base_model, dtype=dtype, device=device)
        given = {"max_model_len": max_model_len, "max_seq_length": max_seq_length}
        bounds = {k: v for k, v in given.items() if v is not None}
        for key, bound in bounds.items():
            if bound > trainer.max_context:
                raise EngineArgsError(f"engine_args {key} {bound} is over the {trainer.max_context} positions of "
                                      f"{base_model}", field=f"engine_args.{key}")
        if bounds:
            trainer.max_context = min(bounds.values())  # the sampler reads it from the trainer
        super().__init__(TorchSampler(trainer, seed=seed), trainer, description=f"cpu (torch {device}, {dtype})")
