"""The CPU engine: the torch sampler and the peft trainer on one model in memory (torch + transformers +
peft). Also correct, if slow, on one GPU; vLLM + Unsloth is the GPU engine (choose.build_vllm_engine)."""

from __future__ import annotations

from artcloud.server.engines.base import Trainer
from artcloud.server.engines.children import Rendezvous
from artcloud.server.engines.engine import Engine, EngineArgsError
from artcloud.server.engines.peft_trainer import OPTIMIZER_FILE, PeftTrainer
from artcloud.server.engines.torch_sampler import TorchSampler

__all__ = ["CPUEngine", "OPTIMIZER_FILE"]


class CPUEngine(Engine):
    """engine_args it honours (choose.py checks their types): `max_model_len`, `max_seq_length`: bounds on
    prompt + completion tokens, each at most the model's positions; one model samples and trains here, so
    the smaller bounds both. `seed`: the sampling of requests that have no seed of their own. `trainer_procs`
    (the operator's only): train with the sharded trainer over that many processes (gloo) instead of in the
    server's own model, which then samples only (artcloud/server/engines/sharded.py). `own_sampler` (inference
    replicas beside it, `artcloud serve --replica`): the trainer trains a second copy of the model, and the
    sampler serves each committed step as the replicas do. `rendezvous` (`artcloud serve --trainer-nodes`): the
    sharded trainer's ranks here are node 0 of that many nodes."""

    def __init__(self, base_model: str, *, dtype: str = "float32", device: str = "cpu",
                 max_model_len: int | None = None, max_seq_length: int | None = None, seed: int | None = None,
                 trainer_procs: int = 1, own_sampler: bool = False, rendezvous: Rendezvous | None = None):
        model = PeftTrainer(base_model, dtype=dtype, device=device)  # the sampler's, and the trainer's if not sharded
        given = {"max_model_len": max_model_len, "max_seq_length": max_seq_length}
        bounds = {k: v for k, v in given.items() if v is not None}
        for key, bound in bounds.items():
            if bound > model.max_context:
                raise EngineArgsError(f"engine_args {key} {bound} is over the {model.max_context} positions of "
                                      f"{base_model}", field=f"engine_args.{key}")
        if bounds:
            model.max_context = min(bounds.values())  # the sampler reads it from its model
        sampler = TorchSampler(model, seed=seed)
        trainer: Trainer = model
        description = f"cpu (torch {device}, {dtype})"
        if trainer_procs > 1 or rendezvous is not None:  # the sharded trainer's ranks train; the sampler serves them
            from artcloud.server.engines.sharded import ShardedTrainer

            trainer = ShardedTrainer(base_model, trainer_procs, dtype=dtype, device=device, rendezvous=rendezvous)
            trainer.max_context = model.max_context
            sampler.shares_trainer_weights = False
            description += f", the trainer sharded over {trainer_procs} processes (FSDP2)"
            if rendezvous is not None:
                description += f" here and those of {rendezvous.nodes - 1} more node(s)"
        elif own_sampler:  # replicas serve each committed step: the sampler here does too, on a model of its own
            trainer = PeftTrainer(base_model, dtype=dtype, device=device)
            trainer.max_context = model.max_context
            sampler.shares_trainer_weights = False
        super().__init__(sampler, trainer, description=description)
