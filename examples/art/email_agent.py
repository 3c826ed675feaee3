"""An email research agent with tools (OpenAI function calling), written for OpenPipe ART's API.

The agent answers a question about a small local inbox by calling tools: `search_inbox`, `read_email`
and `return_final_answer`; the reward checks the answer and the emails it cites. No external service:
the inbox is this file's data, and the reward is computed here (no LLM judge).

An ART user's script, run on artcloud. It follows the flow of ART's own ART-E example
(github.com/OpenPipe/ART, examples/art-e and examples/art_e; Apache-2.0), written anew here: tools
passed to the chat completion and kept on the trajectory, `art.utils.iterate_dataset` over the
scenarios, validation groups logged with `model.log`, `delete_checkpoints(best_checkpoint_metric=...)`
and `model.train`. The inbox, tools and reward are this file's own. Only three lines are artcloud's,
each marked with the line an ART script has.

    python examples/art/email_agent.py
"""

import asyncio
import json
import random
from dataclasses import dataclass

import openai

import artcloud as art  # ART: import art
from artcloud.local import LocalBackend  # ART: from art.local import LocalBackend
from artcloud.utils import iterate_dataset  # ART: from art.utils import iterate_dataset

BASE_MODEL = "Qwen/Qwen2.5-7B-Instruct"
GROUPS_PER_STEP = 2
NUM_EPOCHS = 3
ROLLOUTS_PER_GROUP = 8
MAX_TURNS = 6
MAX_COMPLETION_TOKENS = 256

INBOX = [
    {"id": "m1", "from": "maya@acme.test", "date": "2026-03-08", "subject": "Budget deck",
     "body": "I own the quarterly budget deck; the draft will be ready on Friday."},
    {"id": "m2", "from": "sam@acme.test", "date": "2026-04-03", "subject": "Northwind escalation",
     "body": "The Northwind escalation call is at 3 PM UTC. Start with the login outage."},
    {"id": "m3", "from": "riley@finch.test", "date": "2026-04-18", "subject": "Finch renewal",
     "body": "We approved a 12% renewal discount. Please send the order form."},
    {"id": "m4", "from": "ops@acme.test", "date": "2026-04-20", "subject": "Office move",
     "body": "The Berlin office moves to the fourth floor on May 2."},
]


@dataclass
class Scenario:
    question: str
    answer: str
    source: str


SCENARIOS = [
    Scenario("When will the quarterly budget draft be ready?", "friday", "m1"),
    Scenario("What time is the Northwind escalation call?", "3 pm", "m2"),
    Scenario("What renewal discount did Finch approve?", "12%", "m3"),
    Scenario("Which floor does the Berlin office move to?", "fourth", "m4"),
]

TOOLS = [
    {"type": "function", "function": {
        "name": "search_inbox", "description": "Find emails whose subject or body contains every keyword.",
        "parameters": {"type": "object", "properties": {"keywords": {"type": "array", "items": {"type": "string"}}},
                       "required": ["keywords"]}}},
    {"type": "function", "function": {
        "name": "read_email", "description": "Read one email by its id.",
        "parameters": {"type": "object", "properties": {"message_id": {"type": "string"}}, "required": ["message_id"]}}},
    {"type": "function", "function": {
        "name": "return_final_answer", "description": "Give the final answer and the ids of the emails it rests on.",
        "parameters": {"type": "object", "properties": {"answer": {"type": "string"},
                                                        "sources": {"type": "array", "items": {"type": "string"}}},
                       "required": ["answer", "sources"]}}},
]


def search_inbox(keywords: list[str]) -> list[dict]:
    words = [str(k).lower() for k in keywords]
    return [{"id": m["id"], "subject": m["subject"], "date": m["date"]} for m in INBOX
            if all(w in (m["subject"] + " " + m["body"]).lower() for w in words)]


def read_email(message_id: str) -> dict:
    return next((m for m in INBOX if m["id"] == message_id), {"error": f"no email {message_id!r}"})


@art.retry(exceptions=(openai.APITimeoutError,))
async def rollout(model: art.Model, scenario: Scenario, step: int, is_validation: bool) -> art.Trajectory:
    trajectory = art.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "You answer questions about the user's inbox. Use the tools; "
                                          "finish with return_final_answer."},
            {"role": "user", "content": scenario.question},
        ],
        tools=TOOLS,
        metadata={"question": scenario.question, "step": step, "validation": is_validation},
        reward=0,
    )
    client = model.openai_client()
    for turn in range(MAX_TURNS):
        response = await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=trajectory.messages(),
            tools=TOOLS,
            max_completion_tokens=MAX_COMPLETION_TOKENS,
        )
        choice = response.choices[0]
        trajectory.messages_and_choices.append(choice)
        calls = choice.message.tool_calls or []
        if not calls:
            # No tool call ends the episode; a long non-answer costs a little more than a short one.
            text = choice.message.content or ""
            trajectory.log(f"turn {turn}: no tool call")
            trajectory.reward = -1 - min(len(text), 1000) / 1000
            break
        call = calls[0]
        try:
            args = json.loads(call.function.arguments)
        except json.JSONDecodeError:
            trajectory.reward = -0.5
            trajectory.metrics["bad_arguments"] = 1
            break
        if call.function.name == "return_final_answer":
            correct = scenario.answer in str(args.get("answer", "")).lower()
            cited = scenario.source in [str(s) for s in args.get("sources", [])]
            trajectory.reward = float(correct) + 0.2 * float(cited)
            trajectory.metrics["correct"] = float(correct)
            trajectory.metrics["cited"] = float(cited)
            break
        if call.function.name == "search_inbox":
            result = search_inbox(args.get("keywords", []))
        elif call.function.name == "read_email":
            result = read_email(str(args.get("message_id", "")))
        else:
            result = {"error": f"no tool {call.function.name!r}"}
        trajectory.messages_and_choices.append(
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}
        )
    trajectory.metrics["turns"] = turn + 1
    return trajectory.finish()


async def main() -> None:
    random.seed(42)
    model = art.TrainableModel(name="email-agent-001", project="email-agent", base_model=BASE_MODEL)
    backend = LocalBackend()
    await model.register(backend)

    for batch in iterate_dataset(SCENARIOS, groups_per_step=GROUPS_PER_STEP, num_epochs=NUM_EPOCHS,
                                 initial_step=await model.get_step()):
        train_groups = await art.gather_trajectory_groups(
            (
                art.TrajectoryGroup(rollout(model, s, batch.step, False) for _ in range(ROLLOUTS_PER_GROUP))
                for s in batch.items
            ),
            pbar_desc=f"train {batch.epoch}/{batch.epoch_step}",
            max_exceptions=ROLLOUTS_PER_GROUP,
        )
        val_groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model, s, batch.step, True) for _ in range(2)) for s in SCENARIOS[:1]),
            pbar_desc="val",
        )
        await model.log(val_groups)
        rewards = [t.reward for group in train_groups for t in group]
        print(f"step {batch.step}: {sum(len(g) for g in train_groups)} rollouts, mean reward {sum(rewards) / len(rewards):.3f}")
        await model.delete_checkpoints(best_checkpoint_metric="val/reward")
        await model.train(train_groups, config=art.TrainConfig(learning_rate=1e-5), verbose=False)
    print(f"{model.name} trained to step {await model.get_step()}")


if __name__ == "__main__":
    asyncio.run(main())
