"""ART 0.5.18's `train-sft` skill template (art/skills/train-sft/SKILL.md: "JSONL file training pattern", the
LocalBackend setup and the post-training block), filled in for a small task: answering in a fixed house style from
a JSONL file of conversations.

An ART user's script, run on artcloud, with the hyperparameters the skill computes for a small file (epochs,
batch size 2, peak learning rate 2e-4, a linear schedule with warmup) and ART's own `_internal_config` (vLLM's
gpu_memory_utilization: on the CPU engine it has no effect, and a warning says so). Only its imports are
artcloud's, each marked with the line an ART script has.

    python examples/art/train_sft.py            # writes its data file first, if it is not there
"""

import asyncio
import json
import os

import artcloud as art  # ART: import art
from artcloud.local import LocalBackend  # ART: from art.local import LocalBackend
from artcloud.utils.sft import train_sft_from_file  # ART: from art.utils.sft import train_sft_from_file

BASE_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PROJECT_NAME = "sft-project"
RUN_NAME = "house-style-001"
FILE_PATH = "house_style.jsonl"
EPOCHS = 3
BATCH_SIZE = 2
PEAK_LR = 2e-4
SCHEDULE_TYPE = "linear"
WARMUP_RATIO = 0.1


def write_example_file(path: str) -> None:
    """The task's data: a row per conversation, in ART's format (`messages`, optional `tools`)."""
    rows = []
    for city, country in [("Paris", "France"), ("Tokyo", "Japan"), ("Lima", "Peru"), ("Rome", "Italy")]:
        rows.append({"messages": [{"role": "system", "content": "You answer in the house style."},
                                  {"role": "user", "content": f"Where is {city}?"},
                                  {"role": "assistant", "content": f"{city} lies in {country}. Anything else?"}]})
    rows.append({"messages": [{"role": "user", "content": "What is the weather in Oslo?"},
                              {"role": "assistant", "content": "", "tool_calls": [
                                  {"id": "call_1", "type": "function",
                                   "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
                              {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
                              {"role": "assistant", "content": "Rain in Oslo. Anything else?"}],
                 "tools": [{"type": "function", "function": {"name": "weather", "parameters": {
                     "type": "object", "properties": {"city": {"type": "string"}}}}}]})
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


async def main():
    if not os.path.exists(FILE_PATH):
        write_example_file(FILE_PATH)

    backend = LocalBackend()
    model = art.TrainableModel(
        name=RUN_NAME,
        project=PROJECT_NAME,
        base_model=BASE_MODEL,
        _internal_config=art.dev.InternalModelConfig(
            engine_args={"gpu_memory_utilization": 0.7},
        ),
    )
    await model.register(backend)

    await train_sft_from_file(
        model=model,
        file_path=FILE_PATH,
        epochs=EPOCHS,
        batch_size=BATCH_SIZE,
        peak_lr=PEAK_LR,
        schedule_type=SCHEDULE_TYPE,
        warmup_ratio=WARMUP_RATIO,
        verbose=True,
    )

    # --- Training complete ---
    step = await model.get_step()
    inference_name = model.get_inference_name()
    client = model.openai_client()

    print("\n" + "=" * 60)
    print("SFT TRAINING COMPLETE")
    print("=" * 60)
    print(f"  Model:          {inference_name}")
    print(f"  Base model:     {BASE_MODEL}")
    print(f"  Training step:  {step}")
    print(f"  Inference URL:  {client.base_url}")
    print("=" * 60)

    print("\n--- Python usage (openai SDK) ---\n")
    print(f'''\
from openai import OpenAI

client = OpenAI(
    base_url="{client.base_url}",
    api_key="not-needed",
)

response = client.chat.completions.create(
    model="{inference_name}",
    messages=[
        {{"role": "user", "content": "Your prompt here"}},
    ],
)
print(response.choices[0].message.content)
''')

    await backend.close()


if __name__ == "__main__":
    asyncio.run(main())
