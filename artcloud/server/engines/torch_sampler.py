"""The torch sampler: a plain KV-cache decoding loop over a batch, on the trainer's own model.

Each unique prompt is prefilled once and its cache copied for its `n` samples; finished rows leave the
batch so later steps cost less. It shares the PeftTrainer's weights (the CPU engine), so an adapter
is servable the moment the trainer has it: serving an older step loads it into the same PeftModel
without an optimizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from artcloud.server.engines.base import Completion, GenerationRequest, Sampler, StopStrings
from artcloud.server.engines.peft_trainer import PeftTrainer
from artcloud.train import packing
from artcloud.train.advantages import logprob_temperature
from artcloud.types import LoraConfig


class TorchSampler(Sampler):
    shares_trainer_weights = True

    def __init__(self, trainer: PeftTrainer, seed: int | None = None):
        self.trainer = trainer
        # engine_args seed: rows without a seed of their own draw from this generator, not from torch's global
        # one (which training draws from too), so a fresh server samples the same for the same requests.
        self.generator = torch.Generator(device=trainer.device).manual_seed(seed) if seed is not None else None
        self.tokenizer = trainer.tokenizer
        self.max_context = trainer.max_context
        model = trainer.model
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        eos_ids.add(self.tokenizer.eos_token_id)
        self.eos_ids = torch.tensor(sorted(i for i in eos_ids if i is not None))

    def serve_adapter(self, slot: str, lora: LoraConfig, folder: Path) -> None:
        self.trainer.load_adapter(slot, lora, folder, optimizer=False)

    def drop_adapter(self, slot: str) -> None:
        self.trainer.delete_adapter(slot)

    def status(self) -> dict:
        return {"kind": "torch", "state": "ready", "device": str(self.trainer.device),
                "adapters": len(self.trainer.names)}

    @torch.inference_mode()
    def generate(self, slot: str | None, requests: list[GenerationRequest]) -> list[list[Completion]]:
        if not requests:
            return []
        t = self.trainer
        if slot is not None:
            return self._generate(t.activate(slot), requests)
        if t.peft is None:
            return self._generate(t.model, requests)
        with t.peft.disable_adapter():
            return self._generate(t.peft, requests)

    def _generate(self, model: Any, requests: list[GenerationRequest]) -> list[list[Completion]]:
        dev = self.trainer.device
        U = len(requests)
        P = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((U, P), self.trainer.pad_id, dtype=torch.long)
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
        # Streamed requests hear each row's token as soon as it is sampled (one call per row and step).
        sinks = [requests[u].sink for u in row_req]
        streaming = any(s is not None for s in sinks)
        rows_of = [requests[u] for u in row_req]
        sample_of = [k for r in requests for k in range(r.n)]  # row -> its sample's index in its request

        tokens: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        tops: list[list[list[tuple[int, float]]]] = [[] for _ in range(B)]
        finish = ["length"] * B
        alive = list(range(B))  # row numbers of the rows still in the batch, in batch order
        eos = self.eos_ids.to(dev)

        for _ in range(max(max_tokens)):
            logp = torch.log_softmax(logits.float() / lp_temps[alive], dim=-1)  # (A, V) at each row's T
            chosen = self._sample(logits, temps[alive], top_p[alive], greedy[alive], row_req, alive, generators,
                                  self.generator)
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
                elif len(tokens[b]) < max_tokens[b] and not rows_of[b].gone:
                    keep.append(a)  # a row whose client went away leaves the batch
            if streaming:
                for b in alive:
                    if sinks[b] is not None:
                        sinks[b].tokens(sample_of[b], tokens[b][-1:], lps[b][-1:],
                                        tops[b][-1:] if params[b].top_logprobs else None)
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
            results[row_req[b]].append(Completion(
                token_ids=tokens[b], logprobs=lps[b], top_logprobs=tops[b] if params[b].top_logprobs else None,
                finish_reason=finish[b], text=text, temperature=params[b].temperature))
        return results

    @staticmethod
    def _sample(logits, temps, top_p, greedy, row_req, alive, generators, default=None) -> torch.Tensor:
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
            chosen[free] = torch.multinomial(probs[free], 1, generator=default).squeeze(1)
        for u, rows in seeded.items():
            chosen[rows] = torch.multinomial(probs[rows], 1, generator=generators[u]).squeeze(1)
        if bool(greedy.any()):
            chosen = torch.where(greedy, logits.argmax(-1), chosen)
        return chosen
