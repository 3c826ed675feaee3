"""Turning variable-length samples into tensors, and computing the policy's logprobs of them.

Shared-prompt packing: the G completions of a group usually share one prompt. Instead of running
G copies of the prompt through the model, run it once, keep its KV cache (with its autograd graph),
select that cache once per completion, and run only the completions on top. Gradients flow back
through the cache into the prompt's LoRA activations, so the result equals the unpacked computation
(tests/test_grpo.py checks logprobs and gradients), at roughly (P + G*C) / (G*(P + C)) of the cost.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from artcloud.train.grpo import token_logprobs


@functools.cache
def kv_cache_name() -> str:
    """What transformers calls the KV cache, as a model's keyword argument and output field: `cache` since
    5.24 (`past_key_values` is deprecated there), `past_key_values` before it. Python 3.10 stops at
    transformers 5.20 (5.21 needs 3.11), so both are in use."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


@dataclass
class PackedBatch:
    prompts: torch.Tensor  # (U, P) unique prompts, left-padded
    prompt_mask: torch.Tensor  # (U, P)
    prompt_of: torch.Tensor  # (B,) which unique prompt each row continues
    completions: torch.Tensor  # (B, C) right-padded
    completion_mask: torch.Tensor  # (B, C) float: 1 on the completion's tokens, 0 on padding
    old_logprobs: torch.Tensor  # (B, C)
    advantages: torch.Tensor  # (B,)
    temperatures: torch.Tensor  # (B,) the temperature each row's logprobs are taken at (advantages.logprob_temperature)
    loss_mask: torch.Tensor  # (B, C) float: 1 on the tokens that carry loss (TrainSample.trained; else completion_mask)
    sequences: torch.Tensor  # (B,) long: each row's trajectory, 0..S-1 (TrainSample.sequence; else a row of its own)

    def to(self, device: torch.device) -> "PackedBatch":
        """The same batch on `device` (the engine's: a GPU under `--engine auto`)."""
        if self.prompts.device == device:
            return self
        return PackedBatch(**{f: getattr(self, f).to(device) for f in self.__dataclass_fields__})

    @property
    def shares_prompts(self) -> bool:
        return self.prompts.shape[0] < self.completions.shape[0]


def pack(samples: Sequence[Any], pad_id: int) -> PackedBatch:
    """`samples` have prompt_ids, completion_ids, old_logprobs, advantage and temperature
    (see engines.base.TrainSample)."""
    unique: dict[tuple[int, ...], int] = {}  # each distinct prompt -> its row in `prompts`
    prompt_of = [unique.setdefault(tuple(s.prompt_ids), len(unique)) for s in samples]
    P = max(len(p) for p in unique)
    C = max(len(s.completion_ids) for s in samples)
    U, B = len(unique), len(samples)

    prompts = torch.full((U, P), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((U, P), dtype=torch.long)
    for ids, u in unique.items():
        prompts[u, P - len(ids):] = torch.tensor(ids)
        prompt_mask[u, P - len(ids):] = 1

    completions = torch.full((B, C), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((B, C))
    loss_mask = torch.zeros((B, C))
    old = torch.zeros((B, C))
    for b, s in enumerate(samples):
        n = len(s.completion_ids)
        completions[b, :n] = torch.tensor(s.completion_ids)
        completion_mask[b, :n] = 1.0
        loss_mask[b, :n] = 1.0 if s.trained is None else torch.tensor(s.trained, dtype=torch.float32)
        if s.old_logprobs:
            old[b, :n] = torch.tensor(s.old_logprobs, dtype=torch.float32)
    own: dict[Any, int] = {}  # each trajectory -> 0..S-1; a sample without one is its own
    sequences = [own.setdefault(("row", b) if s.sequence is None else s.sequence, len(own)) for b, s in enumerate(samples)]
    return PackedBatch(prompts, prompt_mask, torch.tensor(prompt_of), completions, completion_mask, old,
                       advantages=torch.tensor([float(s.advantage) for s in samples]),
                       temperatures=torch.tensor([float(s.temperature) for s in samples]),
                       loss_mask=loss_mask, sequences=torch.tensor(sequences))


def completion_logprobs(model: Any, batch: PackedBatch, *, shared: bool | None = None) -> torch.Tensor:
    """log pi_T(completion token) for every completion position, each row at its own temperature T:
    (B, C). Grad flows if enabled."""
    if shared is None:
        shared = batch.shares_prompts
    return _shared_prefix(model, batch) if shared else _full_sequences(model, batch)


def _full_sequences(model: Any, batch: PackedBatch) -> torch.Tensor:
    C = batch.completions.shape[1]
    ids = torch.cat([batch.prompts[batch.prompt_of], batch.completions], dim=1)  # (B, P + C)
    mask = torch.cat([batch.prompt_mask[batch.prompt_of], batch.completion_mask.long()], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    # Positions P-1 .. P+C-2 predict the C completion tokens. No KV cache: one pass needs none, and a layer
    # recomputed in the backward pass (activation checkpointing) would append to it a second time.
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=C + 1,
                   use_cache=False).logits
    return token_logprobs(logits[:, :-1], batch.completions, batch.temperatures)


def _shared_prefix(model: Any, batch: PackedBatch) -> torch.Tensor:
    C = batch.completions.shape[1]
    prompt_pos = (batch.prompt_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=batch.prompts, attention_mask=batch.prompt_mask, position_ids=prompt_pos, use_cache=True,
                logits_to_keep=1)
    cache = getattr(out, kv_cache_name())
    cache.batch_select_indices(batch.prompt_of)  # (U, ...) -> (B, ...), differentiable indexing
    first = out.logits[:, -1:, :][batch.prompt_of]  # (B, 1, V): predicts completion token 0

    lengths = batch.prompt_mask.sum(-1)[batch.prompt_of]  # (B,)
    positions = lengths.unsqueeze(1) + torch.arange(C, device=lengths.device).unsqueeze(0)  # (B, C)
    mask = torch.cat([batch.prompt_mask[batch.prompt_of], batch.completion_mask.long()], dim=1)
    rest = model(input_ids=batch.completions, attention_mask=mask, position_ids=positions, use_cache=True,
                 **{kv_cache_name(): cache}).logits  # (B, C, V): position j predicts token j + 1
    logits = torch.cat([first, rest[:, :-1]], dim=1)  # (B, C, V)
    return token_logprobs(logits, batch.completions, batch.temperatures)


def micro_batches(samples: Sequence[Any], vocab_size: int, max_logit_elems: int = 150_000_000, *,
                  whole_sequences: bool = False, max_tokens: int | None = None) -> list[list[Any]]:
    """Split samples so each forward's logits (rows x longest completion x vocabulary) stay under
    `max_logit_elems` floats, and (with `max_tokens`: the trainer's activation budget) its tokens, each prompt
    counted once, under `max_tokens`.

    Samples that share a prompt stay together where they fit, so packing runs the prompt once. A group
    too big on its own (8 x 2048 tokens x a 150 k vocabulary is ~10 GB of logits) is cut into chunks
    that fit, each still sharing its prompt; a sample over the budget alone goes alone. The loss of every
    micro-batch is divided by the whole step's tokens, so the accumulated gradient is the same however
    the samples are cut. `whole_sequences`: the turns of one trajectory (TrainSample.sequence) are never cut
    apart, as a loss with a ratio per trajectory needs them all at once (grpo.sequence_log_ratio).
    """
    if whole_sequences:
        by_sequence: dict[Any, list[Any]] = {}
        for i, s in enumerate(samples):
            by_sequence.setdefault(("row", i) if s.sequence is None else s.sequence, []).append(s)
        return _fit(list(by_sequence.values()), vocab_size, max_logit_elems, max_tokens, flatten=True)
    by_prompt: dict[tuple[int, ...], list[Any]] = {}
    for s in samples:
        by_prompt.setdefault(tuple(s.prompt_ids), []).append(s)
    chunks = [chunk for group in by_prompt.values() for chunk in _fit(group, vocab_size, max_logit_elems, max_tokens)]
    return _fit(chunks, vocab_size, max_logit_elems, max_tokens, flatten=True)


def _fit(items: Sequence[Any], vocab_size: int, budget: int, max_tokens: int | None = None, *,
         flatten: bool = False) -> list[list[Any]]:
    """Greedily fill batches in order, starting a new one when the next item would cross `budget` (logit floats:
    rows x longest completion x vocabulary) or `max_tokens` (what one forward runs through the model: each distinct
    prompt once, every completion). Items are samples, or (flatten=True) lists of samples kept whole. An item over
    a budget on its own gets a batch of its own. One pass, each batch's figures kept as it grows (an SFT batch may
    hold thousands of rows)."""
    batches: list[list[Any]] = []
    current: list[Any] = []
    prompts: set[tuple[int, ...]] = set()
    tokens = longest = 0
    for item in items:
        group = list(item) if flatten else [item]
        own = {tuple(s.prompt_ids) for s in group}
        completions = sum(len(s.completion_ids) for s in group)
        C = max([len(s.completion_ids) for s in group], default=0)
        grown = tokens + sum(map(len, own - prompts)) + completions
        if current and ((len(current) + len(group)) * max(C, longest) * vocab_size > budget
                        or (max_tokens is not None and grown > max_tokens)):
            batches.append(current)
            current, prompts, tokens, longest = [], set(), 0, 0
            grown = sum(map(len, own)) + completions
        current += group
        prompts |= own
        tokens, longest = grown, max(C, longest)
    if current:
        batches.append(current)
    return batches
