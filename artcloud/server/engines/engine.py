"""The Engine the server uses: one sampler plus one trainer on one base model.

The two halves meet only through adapter checkpoints: after each committed step the server calls
`publish(slot, lora, folder)`, and the sampler serves what the trainer saved there. A sampler that
shares the trainer's weights (the CPU engine) needs nothing for that.

On one shared accelerator the two take turns (`colocated`): before a training step the sampler sleeps
(vLLM frees its weights and KV cache) and the trainer's weights and optimizer come back; before the
next generation the trainer is offloaded and the sampler wakes. The turn changes only when the other
half is needed, so a run of rollouts or of training steps never pays for it twice. With the sampler on
its own accelerators (dedicated mode) or on a CPU, nothing is switched.

Every method runs on the host's single engine thread (server/models.py), except `generate` on a
sampler that batches by itself (vLLM: `concurrent`), which the server calls from several threads at once
so that new requests join vLLM's running batch. A gate keeps generations and trainer work apart: a
training step waits for generations in flight, and generations wait for the step. A waiting step holds new
generations back, so steady traffic (to other models on this base) never starves training.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from artcloud.errors import InvalidArgument
from artcloud.server.engines.base import (
    Completion,
    GenerationRequest,
    Sampler,
    StepCallback,
    Trainer,
    TrainSample,
)
from artcloud.types import LoraConfig, TrainConfig

log = logging.getLogger("artcloud.engine")


class EngineArgsError(InvalidArgument):
    """engine_args this engine cannot take; the message names the key, `field` is engine_args.KEY."""

    code = "invalid_engine_args"


class Engine:
    def __init__(self, sampler: Sampler, trainer: Trainer, *, colocated: bool = False, description: str = ""):
        self.sampler = sampler
        self.trainer = trainer
        # Take turns on one accelerator: only where the sampler can really free it.
        self.colocated = colocated and sampler.can_sleep
        self.description = description or f"{type(sampler).__name__} + {type(trainer).__name__}"
        self.turn = "sampler"  # who holds the accelerator now (matters only when colocated)
        self.switches = 0  # turn changes so far (GET /artcloud/status)
        self._gate = threading.Condition()
        self._generating = 0  # generations in flight
        self._training = False
        self._training_waits = 0  # trainer work waiting for generations in flight to end
        self.notes: list[str] = []  # what a client should hear about how it was made (engine_args left out)

    @property
    def concurrent(self) -> bool:
        """generate may be called from several threads at once."""
        return self.sampler.concurrent

    @contextmanager
    def _sampling(self):
        with self._gate:
            while self._training or self._training_waits:
                self._gate.wait()
            if self._generating == 0:
                self._sampler_turn()
            self._generating += 1
        try:
            yield
        finally:
            with self._gate:
                self._generating -= 1
                self._gate.notify_all()

    @contextmanager
    def _trainer_work(self):
        with self._gate:
            self._training_waits += 1
            while self._generating:
                self._gate.wait()
            self._training_waits -= 1
            self._training = True
            self._trainer_turn()
        try:
            yield
        finally:
            with self._gate:
                self._training = False
                self._gate.notify_all()

    # What the server reads from an engine.
    @property
    def base_model(self) -> str:
        return self.trainer.base_model

    @property
    def tokenizer(self) -> Any:
        return self.trainer.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.trainer.vocab_size

    @property
    def max_context(self) -> int:
        return min(self.trainer.max_context, self.sampler.max_context)

    # ------------------------------------------------------------------------------------- turns

    def _sampler_turn(self) -> None:
        if self.colocated and self.turn != "sampler":
            self.trainer.offload()
            self.sampler.wake()
            self.turn = "sampler"
            self.switches += 1

    def _trainer_turn(self) -> None:
        if self.colocated and self.turn != "trainer":
            self.sampler.sleep()
            self.trainer.to_device()
            self.turn = "trainer"
            self.switches += 1

    # ------------------------------------------------------------------------------------- adapters

    def create_adapter(self, slot: str, lora: LoraConfig) -> None:
        """A fresh adapter in the trainer. It is servable once published (the server commits step 0 and
        publishes it right away); a weight-sharing sampler serves it at once."""
        self.trainer.create_adapter(slot, lora)

    def delete_adapter(self, slot: str) -> None:
        self.trainer.delete_adapter(slot)
        if not self.sampler.shares_trainer_weights:
            self.sampler.drop_adapter(slot)

    def load_adapter(self, slot: str, lora: LoraConfig, folder: Path, *, optimizer: bool) -> None:
        """`optimizer=True`: the trainer's adapter (resume, rollback), served from the same folder.
        `optimizer=False`: an older step to serve only; the trainer never holds it."""
        if optimizer:
            self.trainer.load_adapter(slot, lora, folder, optimizer=True)
            self.publish(slot, lora, folder)
            return
        self._serve(slot, lora, folder)

    def publish(self, slot: str, lora: LoraConfig, folder: Path) -> None:
        """A step of `slot` was committed to `folder`: serve it."""
        if not self.sampler.shares_trainer_weights:
            self._serve(slot, lora, folder)

    def _serve(self, slot: str, lora: LoraConfig, folder: Path) -> None:
        with self._gate:
            self._sampler_turn()
        self.sampler.serve_adapter(slot, lora, folder)

    # ------------------------------------------------------------------------------------- work

    def generate(self, slot: str | None, requests: list[GenerationRequest]) -> list[list[Completion]]:
        if not requests:
            return []
        with self._sampling():
            return self.sampler.generate(slot, requests)

    def train_step(
        self, slot: str, samples: list[TrainSample], config: TrainConfig, on_step: StepCallback
    ) -> list[dict[str, Any]]:
        with self._trainer_work():
            return self.trainer.train_step(slot, samples, config, on_step)

    def save_adapter(self, slot: str, folder: Path, *, optimizer: bool) -> list[str]:
        return self.trainer.save_adapter(slot, folder, optimizer=optimizer)

    def rng_state(self) -> dict[str, Any]:
        return self.trainer.rng_state()

    def set_rng_state(self, state: dict[str, Any]) -> None:
        self.trainer.set_rng_state(state)

    # ------------------------------------------------------------------------------------- state

    def status(self) -> dict[str, Any]:
        out = {"engine": self.description, "max_context": self.max_context, "colocated": self.colocated, "turn": self.turn,
               "switches": self.switches, "sampler": self.sampler.status()}
        trainer = self.trainer.status()
        return out if trainer is None else {**out, "trainer": trainer}

    def close(self) -> None:
        for part in (self.sampler, self.trainer):
            try:
                part.close()
            except Exception as e:  # closing one half must not keep the other running
                log.warning("closing %s: %s", type(part).__name__, e)
