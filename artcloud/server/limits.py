"""What one token holder (or a bug in the user's loop) may ask of the server, with sane defaults.

The server sits on a public port with a paid GPU behind it. Every limit is a flag of `artcloud serve`,
and every refusal is a 4xx whose message names the flag, so a user who needs more knows what to raise.
"""

from __future__ import annotations

from dataclasses import dataclass

from artcloud.errors import InvalidArgument


@dataclass(frozen=True)
class Limits:
    # Request bodies. A training request of 64 groups x 8 trajectories x 1,000 sampled tokens with
    # logprobs is ~40 MB of JSON; parsing takes several times that in memory.
    max_body_mb: float = 128.0
    # Training bodies read and parsed at once (429 above it). A body over 4 MiB is parsed in a child
    # process (server/train_body.py) that may take up to ~35x its bytes (108 MiB of tiny logprob entries:
    # 3.7 GB for 7 s), so this times --max-body-mb bounds the memory bodies can cost.
    max_train_bodies: int = 2
    # n x max_tokens of one chat request: the tokens one request may make the engine generate.
    max_request_tokens: int = 131_072
    # Samples (n of each request) waiting for or in generation per base model: beyond it a chat request
    # gets 429 at once instead of queueing behind minutes of work.
    max_queued_samples: int = 8192
    # Training jobs waiting per model (the one running not counted): a loop that posts without
    # waiting gets 429 instead of queueing hours of GPU work.
    max_queued_jobs: int = 8
    # Finished jobs (and their event logs) kept per model, in memory and on disk; the oldest go first.
    max_kept_jobs: int = 100
    # Base models resident at once: each is a whole engine (a 7B model is ~15 GB of GPU memory).
    max_base_models: int = 1
    # Models (LoRA adapters with their optimizer state) registered at once.
    max_models: int = 32

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)

    def check(self) -> None:
        for name in ("max_body_mb", "max_train_bodies", "max_request_tokens", "max_queued_samples", "max_queued_jobs", "max_kept_jobs", "max_base_models", "max_models"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"--{name.replace('_', '-')} must be positive")
