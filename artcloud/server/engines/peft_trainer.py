"""The peft trainer: LoRA adapters on a transformers model, trained by the shared GRPO loop with AdamW.

It is the CPU engine's trainer (sharing its model with the TorchSampler), the GPU trainer where Unsloth
cannot load a model (beside a vLLM sampler), and the base of the Unsloth trainer, which differs only
in how the model is loaded and how its first adapter is made (unsloth_trainer.py).

Checkpoints are the PEFT layout (adapter_config.json + adapter_model.safetensors) plus `optimizer.pt`:
AdamW's state over the LoRA parameters sorted by name, so that any trainer on the same base model and
LoRA config (this one, Unsloth, on a CPU or a GPU) resumes it.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import torch

from artcloud.errors import InvalidArgument
from artcloud.server.engines import loading
from artcloud.server.engines.base import StepCallback, Trainer, TrainSample
from artcloud.train import loop, packing
from artcloud.types import LoraConfig, TrainConfig

log = logging.getLogger("artcloud.engine")

OPTIMIZER_FILE = "optimizer.pt"
# What a training step's backward pass keeps per token of a forward pass, in floats of hidden size per layer: ~60
# with LoRA on all 7 projections (measured on SmolLM2-135M: 4 MB a token over its 30 layers of width 576).
ACTIVATION_FLOATS = 60
CPU_ACTIVATION_BYTES = 1 << 30  # the most those may take at once on a CPU (micro-batches are cut to fit)


class PeftTrainer(Trainer):
    # Shared-prompt packing (artcloud.train.packing) runs a group's prompt once and its completions on
    # its KV cache; a trainer whose model cannot take a cache with grad sets this False.
    packs_prompts = True

    def __init__(self, base_model: str, *, dtype: str = "float32", device: str = "cpu", **load_args: Any):
        self.base_model = base_model
        self.device = torch.device(device)
        self.dtype = dtype
        model, self.tokenizer = self._load(base_model, dtype, **load_args)
        self.model = model if self._placed_by_loader else model.to(self.device)
        self.peft = None  # the PeftModel wrapper, made with the first adapter
        self.names: dict[str, str] = {}  # slot -> the adapter's name inside the PeftModel
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 0) or 4096)
        self.pad_id = self.tokenizer.pad_token_id
        self.on_device = True

    _placed_by_loader = False  # Unsloth puts the model on the GPU itself

    def _load(self, base_model: str, dtype: str, **load_args: Any) -> tuple[Any, Any]:
        return loading.load(base_model, dtype=dtype)

    def _peft_config(self, lora: LoraConfig) -> Any:
        from peft import LoraConfig as PeftLoraConfig

        cfg = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=lora.target_modules, task_type="CAUSAL_LM")
        cfg.base_model_name_or_path = self.base_model
        return cfg

    def _first_adapter(self, slot: str, lora: LoraConfig) -> tuple[Any, str]:
        """(the PeftModel, the adapter's name in it), made with the first adapter."""
        from peft import get_peft_model

        return get_peft_model(self.model, self._peft_config(lora), adapter_name=slot), slot

    # ------------------------------------------------------------------------------------- adapters

    def create_adapter(self, slot: str, lora: LoraConfig) -> None:
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            torch.manual_seed(lora.init_seed)
            warnings.simplefilter("ignore", UserWarning)  # peft's notes about renamed base paths
            if self.peft is None:
                self.peft, name = self._first_adapter(slot, lora)
            else:
                if slot in self.names:
                    self.peft.delete_adapter(self.names[slot])
                self.peft.add_adapter(slot, self._peft_config(lora))
                name = slot
        self.names[slot] = name
        self.optimizers.pop(slot, None)

    def delete_adapter(self, slot: str) -> None:
        name = self.names.pop(slot, None)
        if name is not None and name in self.peft.peft_config:
            self.peft.delete_adapter(name)
        self.optimizers.pop(slot, None)

    def _params(self, slot: str) -> list[tuple[str, torch.nn.Parameter]]:
        # Sorted by name, so an optimizer state saved by one process maps onto another's parameters.
        marker = f".{self.names[slot]}."
        return sorted((n, p) for n, p in self.peft.named_parameters() if marker in n)

    def _optimizer(self, slot: str, config: TrainConfig | None = None) -> torch.optim.Optimizer:
        opt = self.optimizers.get(slot)
        if opt is None:
            params = [p for _, p in self._params(slot)]
            opt = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.99), weight_decay=0.0)
            self.optimizers[slot] = opt
        if config is not None:
            for g in opt.param_groups:
                g["lr"] = config.learning_rate
                g["weight_decay"] = config.weight_decay
        return opt

    def activate(self, slot: str) -> Any:
        """The PeftModel with `slot` as its active adapter."""
        self.peft.set_adapter(self.names[slot])
        return self.peft

    # ------------------------------------------------------------------------------------- training

    def train_step(
        self, slot: str, samples: list[TrainSample], config: TrainConfig, on_step: StepCallback
    ) -> list[dict[str, Any]]:
        return loop.train_step(self._policy(slot, config), samples, config, on_step)

    def _policy(self, slot: str, config: TrainConfig) -> loop.TrainablePolicy:
        model = self.activate(slot)
        peft = self.peft
        shared = None if self.packs_prompts else False

        def reference_logprobs(batch: packing.PackedBatch) -> torch.Tensor:
            with torch.no_grad(), peft.disable_adapter():
                return packing.completion_logprobs(peft, batch, shared=shared)

        # The server resolved it to a checkpoint folder; read only when a KL knob is on (else nothing uses it).
        reference = getattr(config, "kl_ref_adapter_path", None) if getattr(config, "kl_reference", False) else None
        return loop.TrainablePolicy(
            params=[p for _, p in self._params(slot)],
            optimizer=self._optimizer(slot, config),
            policy_logprobs=lambda batch: packing.completion_logprobs(model, batch, shared=shared),
            reference_logprobs=reference_logprobs,
            set_training=model.train,
            pad_id=self.pad_id,
            vocab_size=self.vocab_size,
            device=self.device,
            reference_weights=self._reference_weights(slot, Path(reference)) if reference else None,
            max_micro_tokens=self._micro_tokens() if self.device.type == "cpu" else None,
        )

    def _micro_tokens(self) -> int:
        """On a CPU, the tokens one forward pass may hold so that what its backward pass keeps stays within
        CPU_ACTIVATION_BYTES (host memory is the server's whole budget; on a GPU, the logits' budget alone cuts).
        Per token: ACTIVATION_FLOATS floats of every layer's width."""
        config = self.model.config
        per_token = 4 * ACTIVATION_FLOATS * config.num_hidden_layers * config.hidden_size
        return max(1, CPU_ACTIVATION_BYTES // per_token)

    def _reference_weights(self, slot: str, folder: Path) -> list[torch.Tensor]:
        """The LoRA weights of the adapter saved in `folder`, in the order and layout of `slot`'s parameters."""
        from safetensors.torch import load_file

        saved = load_file(folder / "adapter_model.safetensors")
        marker = f".{self.names[slot]}."
        out = []
        for name, p in self._params(slot):
            plain = name.replace(marker, ".")
            if plain not in saved or saved[plain].shape != p.shape:
                raise InvalidArgument(f"the KL reference adapter in {folder.name} does not match this model at {plain}: "
                                      "another base model or LoRA shape", field="config.kl_ref_adapter_path")
            out.append(self._like(saved[plain], p))
        return out

    def _like(self, t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """`t` as a copy of parameter `p` is held (its device and dtype)."""
        return t.to(device=p.device, dtype=p.dtype)

    # ------------------------------------------------------------------------------------- placement

    def to_device(self) -> None:
        if not self.on_device:
            self._move(self.device)
            self.on_device = True

    def offload(self) -> None:
        if self.on_device and self.device.type != "cpu":
            self._move(torch.device("cpu"))
            self.on_device = False
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def _move(self, device: torch.device) -> None:
        quantized = getattr(self.model, "is_loaded_in_4bit", False) or getattr(self.model, "is_loaded_in_8bit", False)
        if quantized:
            # bitsandbytes weights cannot move; the LoRA weights and the optimizer state can.
            for _, p in (self.peft.named_parameters() if self.peft is not None else []):
                if p.requires_grad:
                    p.data = p.data.to(device)
        else:
            self.model.to(device)
        for opt in self.optimizers.values():
            for state in opt.state.values():
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        state[k] = v.to(device)

    # ------------------------------------------------------------------------------------- state

    def save_adapter(self, slot: str, folder: Path, *, optimizer: bool) -> list[str]:
        from peft import get_peft_model_state_dict

        # save_embedding_layers=False: LoRA never targets embeddings here, and "auto" would look the
        # base model up on the hub at every save.
        state = get_peft_model_state_dict(self.peft, adapter_name=self.names[slot], save_embedding_layers=False)
        files = self._write_adapter(slot, state, folder)
        if optimizer:
            state = _cpu(self._optimizer(slot).state_dict())
            torch.save(state, folder / OPTIMIZER_FILE)
            files.append(OPTIMIZER_FILE)
        return files

    def _write_adapter(self, slot: str, state: dict[str, torch.Tensor], folder: Path) -> list[str]:
        """The PEFT layout: `state` (keys without the adapter's name) and the adapter's config."""
        from safetensors.torch import save_file

        name = self.names[slot]
        # Tensors are saved in the dtype of the trainer.
        save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()},
                  folder / "adapter_model.safetensors")
        cfg = self.peft.peft_config[name].to_dict()
        cfg["base_model_name_or_path"] = self.base_model
        # peft keeps target_modules as a set; written as a string it would become a regex matching nothing.
        cfg = {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in cfg.items()}
        (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))
        return ["adapter_config.json", "adapter_model.safetensors"]

    def load_adapter(self, slot: str, lora: LoraConfig, folder: Path, *, optimizer: bool) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        if slot not in self.names:
            self.create_adapter(slot, lora)
        name = self.names[slot]
        state = load_file(folder / "adapter_model.safetensors")
        # Another trainer (another dtype, a CPU checkpoint on a GPU) may have written it: peft casts.
        result = set_peft_model_state_dict(self.peft, state, adapter_name=name)
        unexpected = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
        if unexpected:
            raise InvalidArgument(f"adapter in {folder} does not match this model: {unexpected[:3]}")
        self.optimizers.pop(slot, None)
        if optimizer:
            opt = self._optimizer(slot)
            opt.load_state_dict(torch.load(folder / OPTIMIZER_FILE, map_location=self.device, weights_only=True))

    def rng_state(self) -> dict[str, Any]:
        return {"torch": torch.get_rng_state().tolist()}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        if "torch" in state:
            torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def _cpu(obj: Any) -> Any:
    """An optimizer state dict with every tensor on the CPU (a GPU checkpoint must load on a CPU)."""
    if isinstance(obj, torch.Tensor):
        return obj.to("cpu")
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cpu(v) for v in obj]
    return obj

