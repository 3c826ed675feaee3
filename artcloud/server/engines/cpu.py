"""The CPU engine: torch + transformers + peft. Also correct (if not fast) on one GPU.

Generation is a plain KV-cache decoding loop over a batch: each unique prompt is prefilled once and its
cache copied for its `n` samples; finished rows leave the batch so later steps cost less.
Training is the GRPO loop of artcloud.train.loop on the LoRA parameters of one adapter, with AdamW.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import torch

from artcloud.server.engines import loading
from artcloud.server.engines.base import (
    Completion,
    Engine,
    GenerationRequest,
    StepCallback,
    StopStrings,
    TrainSample,
)
from artcloud.train import loop, packing
from artcloud.train.grpo import logprob_temperature
from artcloud.types import LoraConfig, TrainConfig

log = logging.getLogger("artcloud.engine")

OPTIMIZER_FILE = "optimizer.pt"


class CPUEngine(Engine):
    def __init__(self, base_model: str, *, dtype: str = "float32", device: str = "cpu"):
        self.base_model = base_model
        self.device = torch.device(device)
        model, self.tokenizer = loading.load(base_model, dtype=dtype)
        self.model = model.to(self.device)
        self.peft = None  # the PeftModel wrapper, made with the first adapter
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.loras: dict[str, LoraConfig] = {}
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 0) or 4096)
        eos = self.model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        eos_ids.add(self.tokenizer.eos_token_id)
        self.eos_ids = torch.tensor(sorted(i for i in eos_ids if i is not None))
        self.pad_id = self.tokenizer.pad_token_id

    # ------------------------------------------------------------------------------------- adapters

    def create_adapter(self, slot: str, lora: LoraConfig) -> None:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        cfg = PeftLoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=lora.target_modules,
            task_type="CAUSAL_LM",
        )
        cfg.base_model_name_or_path = self.base_model
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            torch.manual_seed(lora.init_seed)
            warnings.simplefilter("ignore", UserWarning)  # peft's notes about renamed base paths
            if self.peft is None:
                self.peft = get_peft_model(self.model, cfg, adapter_name=slot)
            else:
                self.peft.add_adapter(slot, cfg)
        self.loras[slot] = lora
        self.optimizers.pop(slot, None)

    def delete_adapter(self, slot: str) -> None:
        if self.peft is not None and slot in self.peft.peft_config:
            self.peft.delete_adapter(slot)
        self.loras.pop(slot, None)
        self.optimizers.pop(slot, None)

    def _params(self, slot: str) -> list[tuple[str, torch.nn.Parameter]]:
        # Sorted by name, so an optimizer state saved by one process maps onto another's parameters.
        marker = f".{slot}."
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

    def _activate(self, slot: str) -> Any:
        """The PeftModel with `slot` as its active adapter."""
        self.peft.set_adapter(slot)
        return self.peft

    # ------------------------------------------------------------------------------------- generation

    @torch.inference_mode()
    def generate(self, slot: str | None, requests: list[GenerationRequest]) -> list[list[Completion]]:
        if not requests:
            return []
        if slot is not None:
            return self._generate(self._activate(slot), requests)
        if self.peft is None:
            return self._generate(self.model, requests)
        with self.peft.disable_adapter():
            return self._generate(self.peft, requests)

    def _generate(self, model: Any, requests: list[GenerationRequest]) -> list[list[Completion]]:
        dev = self.device
        U = len(requests)
        P = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((U, P), self.pad_id, dtype=torch.long)
        mask = torch.zeros((U, P), dtype=torch.long)
        for u, r in enumerate(requests):
            ids[u, P - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[u, P - len(r.prompt_ids):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(
            input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
            use_cache=True, logits_to_keep=1,
        )
        cache = getattr(out, packing.kv_cache_name())  # `cache`, or `past_key_values` before transformers 5.24

        # One row per sample: row b continues request row_req[b].
        row_req = [u for u, r in enumerate(requests) for _ in range(r.n)]
        index = torch.tensor(row_req, device=dev)
        cache.batch_select_indices(index)
        logits = out.logits[:, -1, :][index]  # (B, V)
        mask = mask.to(dev)[index]
        next_pos = pos.to(dev)[index, -1] + 1

        B = len(row_req)
        params = [requests[u].params for u in row_req]
        temps = torch.tensor([max(p.temperature, 1e-6) for p in params], device=dev).unsqueeze(1)
        # Logprobs are of the distribution each row samples from, before top-p (greedy: T = 1), so
        # that training, dividing its logits by the same T, gets a ratio of 1 (see artcloud.train.grpo).
        lp_temps = torch.tensor([logprob_temperature(p.temperature) for p in params], device=dev).unsqueeze(1)
        greedy = torch.tensor([p.temperature == 0.0 for p in params], device=dev)
        top_p = torch.tensor([p.top_p for p in params], device=dev)
        max_tokens = [p.max_tokens for p in params]
        want_top = max(p.top_logprobs for p in params)
        # A seeded request draws all its samples from its own generator, so its output does not
        # depend on what else shares the batch.
        generators = {
            u: torch.Generator(device=dev).manual_seed(r.params.seed)
            for u, r in enumerate(requests) if r.params.seed is not None
        }
        stops = [StopStrings(self.tokenizer, p.stop) for p in params]

        tokens: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        tops: list[list[list[tuple[int, float]]]] = [[] for _ in range(B)]
        finish = ["length"] * B
        alive = list(range(B))  # row numbers of the rows still in the batch, in batch order
        eos = self.eos_ids.to(dev)

        for _ in range(max(max_tokens)):
            logp = torch.log_softmax(logits.float() / lp_temps[alive], dim=-1)  # (A, V) at each row's T
            chosen = self._sample(logits, temps[alive], top_p[alive], greedy[alive], row_req, alive, generators)
            chosen_lp = logp.gather(1, chosen.unsqueeze(1)).squeeze(1)
            top = torch.topk(logp, want_top, dim=-1) if want_top else None
            is_eos = torch.isin(chosen, eos)

            keep = []
            chosen_l, lp_l, eos_l = chosen.tolist(), chosen_lp.tolist(), is_eos.tolist()
            for a, b in enumerate(alive):
                tokens[b].append(chosen_l[a])
                lps[b].append(lp_l[a])
                if top is not None and params[b].top_logprobs:
                    k = params[b].top_logprobs
                    tops[b].append(list(zip(top.indices[a, :k].tolist(), top.values[a, :k].tolist())))
                if eos_l[a] or stops[b].check(tokens[b]):
                    finish[b] = "stop"
                elif len(tokens[b]) < max_tokens[b]:
                    keep.append(a)
            if not keep:
                break
            if len(keep) < len(alive):
                sel = torch.tensor(keep, device=dev)
                cache.batch_select_indices(sel)
                mask, next_pos, chosen = mask[sel], next_pos[sel], chosen[sel]
                alive = [alive[a] for a in keep]
            mask = torch.cat([mask, torch.ones((len(alive), 1), dtype=mask.dtype, device=dev)], dim=1)
            out = model(
                input_ids=chosen.unsqueeze(1), attention_mask=mask, position_ids=next_pos.unsqueeze(1),
                use_cache=True, **{packing.kv_cache_name(): cache},
            )
            logits = out.logits[:, -1, :]
            next_pos = next_pos + 1

        results: list[list[Completion]] = [[] for _ in requests]
        special = set(self.tokenizer.all_special_ids)
        for b in range(B):
            text = self.tokenizer.decode([t for t in tokens[b] if t not in special])
            if finish[b] == "stop":
                text = stops[b].cut(text)
            results[row_req[b]].append(
                Completion(
                    token_ids=tokens[b],
                    logprobs=lps[b],
                    top_logprobs=tops[b] if params[b].top_logprobs else None,
                    finish_reason=finish[b],
                    text=text,
                    temperature=params[b].temperature,
                )
            )
        return results

    @staticmethod
    def _sample(logits, temps, top_p, greedy, row_req, alive, generators) -> torch.Tensor:
        probs = torch.softmax(logits.float() / temps, dim=-1)
        if bool((top_p < 1.0).any()):
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # Drop a token once the mass before it already reaches top_p (the first token always stays).
            drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p.unsqueeze(1)
            drop[:, 0] = False  # also at a top_p that float32 rounds to 0 (5e-324): else nothing is left to sample
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(1, order, sorted_p)
        chosen = torch.empty(len(alive), dtype=torch.long, device=logits.device)
        seeded: dict[int, list[int]] = {}
        free = []
        for a, b in enumerate(alive):
            (seeded.setdefault(row_req[b], []) if row_req[b] in generators else free).append(a)
        if free:
            chosen[free] = torch.multinomial(probs[free], 1).squeeze(1)
        for u, rows in seeded.items():
            chosen[rows] = torch.multinomial(probs[rows], 1, generator=generators[u]).squeeze(1)
        if bool(greedy.any()):
            chosen = torch.where(greedy, logits.argmax(-1), chosen)
        return chosen

    # ------------------------------------------------------------------------------------- training

    def train_step(
        self, slot: str, samples: list[TrainSample], config: TrainConfig, on_step: StepCallback
    ) -> list[dict[str, Any]]:
        return loop.train_step(self._trainer(slot, config), samples, config, on_step)

    def _trainer(self, slot: str, config: TrainConfig) -> loop.Trainer:
        model = self._activate(slot)
        peft = self.peft

        def reference_logprobs(batch: packing.PackedBatch) -> torch.Tensor:
            with torch.no_grad(), peft.disable_adapter():
                return packing.completion_logprobs(peft, batch)

        return loop.Trainer(
            params=[p for _, p in self._params(slot)],
            optimizer=self._optimizer(slot, config),
            policy_logprobs=lambda batch: packing.completion_logprobs(model, batch),
            reference_logprobs=reference_logprobs,
            set_training=model.train,
            pad_id=self.pad_id,
            vocab_size=self.vocab_size,
            device=self.device,
        )

    # ------------------------------------------------------------------------------------- state

    def save_adapter(self, slot: str, folder: Path, *, optimizer: bool) -> list[str]:
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        # save_embedding_layers=False: LoRA never targets embeddings here, and "auto" would look the
        # base model up on the hub at every save.
        state = get_peft_model_state_dict(self.peft, adapter_name=slot, save_embedding_layers=False)
        save_file({k: v.detach().contiguous() for k, v in state.items()}, folder / "adapter_model.safetensors")
        cfg = self.peft.peft_config[slot].to_dict()
        cfg["base_model_name_or_path"] = self.base_model
        # peft keeps target_modules as a set; written as a string it would become a regex matching nothing.
        cfg = {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in cfg.items()}
        (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))
        files = ["adapter_config.json", "adapter_model.safetensors"]
        if optimizer:
            torch.save(self._optimizer(slot).state_dict(), folder / OPTIMIZER_FILE)
            files.append(OPTIMIZER_FILE)
        return files

    def load_adapter(self, slot: str, lora: LoraConfig, folder: Path, *, optimizer: bool) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        if self.peft is None or slot not in self.peft.peft_config:
            self.create_adapter(slot, lora)
        state = load_file(folder / "adapter_model.safetensors")
        result = set_peft_model_state_dict(self.peft, state, adapter_name=slot)
        unexpected = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
        if unexpected:
            raise ValueError(f"adapter in {folder} does not match this model: {unexpected[:3]}")
        self.optimizers.pop(slot, None)
        if optimizer:
            opt = self._optimizer(slot)
            opt.load_state_dict(torch.load(folder / OPTIMIZER_FILE, map_location=self.device, weights_only=True))

    def optimizer_state(self, slot: str) -> dict[str, Any]:
        return self._optimizer(slot).state_dict()

    def rng_state(self) -> dict[str, Any]:
        return {"torch": torch.get_rng_state().tolist()}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        if "torch" in state:
            torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
