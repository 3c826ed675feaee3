"""Chat rendering and tool calls: templates that know tools, templates that don't, and parsing."""

from __future__ import annotations

import copy
import json

import pytest

from artcloud.server.chat import normalise_messages, parse_tool_calls, render_prompt, template_knows_tools

TINY = "artcloud/tiny-random"

PLAIN_CHATML = (
    "{% for m in messages %}<|im_start|>{{m['role']}}\n{{m['content']}}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Berlin?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Berlin"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "SUNNY_21C"},
    {"role": "user", "content": "Thanks, and tomorrow?"},
]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from artcloud.server.engines import loading

    # The tokenizer alone (what loading.load returns with the model), without loading the weights.
    return AutoTokenizer.from_pretrained(loading.resolve(TINY))


@pytest.fixture(scope="module")
def plain_tok(tok):
    t = copy.deepcopy(tok)
    t.chat_template = PLAIN_CHATML
    assert tok.chat_template != PLAIN_CHATML  # the copy does not touch the shared tokenizer
    return t


# ------------------------------------------------------------------------------------------ parsing


def test_parse_one_call():
    content, calls = parse_tool_calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Berlin"}}\n</tool_call>')
    assert content is None
    assert len(calls) == 1
    call = calls[0]
    assert call["type"] == "function"
    assert call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert isinstance(call["function"]["arguments"], str)  # OpenAI: arguments are a JSON string
    assert json.loads(call["function"]["arguments"]) == {"city": "Berlin"}


def test_parse_two_calls_and_content_outside():
    text = (
        "Let me check both.\n"
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {"y": [1, 2]}}</tool_call>\n'
        "Done."
    )
    content, calls = parse_tool_calls(text)
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"x": 1}, {"y": [1, 2]}]
    assert calls[0]["id"] != calls[1]["id"]
    assert "Let me check both." in content and "Done." in content
    assert "<tool_call>" not in content


def test_parse_invalid_json_left_in_content():
    text = "<tool_call>{not json at all}</tool_call>"
    content, calls = parse_tool_calls(text)
    assert calls == []
    assert content == text

    mixed = 'hi <tool_call>{"name": "ok", "arguments": {}}</tool_call> <tool_call>{broken</tool_call>'
    content, calls = parse_tool_calls(mixed)
    assert [c["function"]["name"] for c in calls] == ["ok"]
    assert "<tool_call>{broken</tool_call>" in content
    assert '"ok"' not in content
    assert content.startswith("hi")

    # valid JSON but no name: not a call, stays in the text
    content, calls = parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>')
    assert calls == [] and "arguments" in content


def test_parse_non_object_block_beside_a_call_stays_in_content():
    """A block that is not a call (here a JSON list) must stay in the content even when another block is a call."""
    text = '<tool_call>{"name": "ok", "arguments": {}}</tool_call> <tool_call>["name", 1]</tool_call>'
    content, calls = parse_tool_calls(text)
    assert [c["function"]["name"] for c in calls] == ["ok"]
    assert content is not None and '["name", 1]' in content


def test_parse_arguments_forms():
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"k\\": 2}"}</tool_call>')
    assert calls[0]["function"]["arguments"] == '{"k": 2}'  # a string stays as it is
    _, calls = parse_tool_calls('<tool_call>{"name": "f"}</tool_call>')
    assert json.loads(calls[0]["function"]["arguments"]) == {}


def test_parse_no_calls():
    assert parse_tool_calls("just text") == ("just text", [])


# ------------------------------------------------------------------------------------------ normalising


def test_developer_role_and_content_parts():
    msgs = normalise_messages(
        [
            {"role": "developer", "content": "Rules."},
            {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "image_url", "image_url": {}},
                                         {"type": "text", "text": "world"}]},
            {"role": "assistant", "content": None, "name": None},
        ],
        None,
        True,
    )
    assert msgs == [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "Hello world"},
        {"role": "assistant", "content": ""},
    ]


def test_normalise_keeps_tool_fields_for_tool_templates():
    msgs = normalise_messages(CONVERSATION, TOOLS, True)
    assert msgs[2]["tool_calls"] == CONVERSATION[2]["tool_calls"]
    assert msgs[3] == {"role": "tool", "content": "SUNNY_21C", "tool_call_id": "call_1"}
    assert msgs[0] == {"role": "system", "content": "Be brief."}  # the template lists the tools itself


# ------------------------------------------------------------------------------------------ rendering


def test_tiny_template_knows_tools(tok, plain_tok):
    assert template_knows_tools(tok)
    assert not template_knows_tools(plain_tok)


def test_render_with_tool_template(tok):
    ids = render_prompt(tok, CONVERSATION, TOOLS)
    assert all(isinstance(i, int) for i in ids)
    text = tok.decode(ids)
    assert "<tools>" in text and '"get_weather"' in text and "Weather for a city" in text
    assert "Be brief." in text
    assert "<tool_call>" in text and '"city": "Berlin"' in text
    assert "<tool_response>\nSUNNY_21C\n</tool_response>" in text
    assert text.rstrip("\n").endswith("<|im_start|>assistant")
    # same tokens as the template's own text, with no extra special tokens
    expected = tok.apply_chat_template(
        normalise_messages(CONVERSATION, TOOLS, True), tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert text == expected
    assert ids == tok(expected, add_special_tokens=False)["input_ids"]


def test_render_without_tools(tok):
    text = tok.decode(render_prompt(tok, [{"role": "user", "content": "Hi there"}], None))
    assert "<tools>" not in text
    assert "<|im_start|>user\nHi there<|im_end|>" in text


def test_render_tools_into_plain_template(plain_tok):
    ids = render_prompt(plain_tok, CONVERSATION, TOOLS)
    text = plain_tok.decode(ids)
    # tools go into the (existing, first) system message
    assert text.startswith("<|im_start|>system\nBe brief.")
    system = text.split("<|im_end|>")[0]
    assert "<tools>" in system and json.dumps(TOOLS[0]) in system
    assert text.count("<|im_start|>system") == 1
    # the assistant's call and the tool's answer are text, not dropped
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Berlin"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\nSUNNY_21C\n</tool_response><|im_end|>" in text
    assert "<|im_start|>tool" not in text
    assert "Thanks, and tomorrow?" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_plain_template_tools_without_system_message(plain_tok):
    text = plain_tok.decode(render_prompt(plain_tok, [{"role": "user", "content": "Hi"}], TOOLS))
    assert text.startswith("<|im_start|>system\nYou may call one or more functions")
    assert '"get_weather"' in text
    assert "<|im_start|>user\nHi<|im_end|>" in text


def test_plain_template_developer_and_parts(plain_tok):
    msgs = [
        {"role": "developer", "content": [{"type": "text", "text": "Rule "}, {"type": "text", "text": "one."}]},
        {"role": "user", "content": [{"type": "text", "text": "Q?"}]},
    ]
    text = plain_tok.decode(render_prompt(plain_tok, msgs, None))
    assert text == "<|im_start|>system\nRule one.<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n"
    assert "developer" not in text


def test_tool_call_roundtrip_through_parse(plain_tok):
    """A parsed call rendered back as history shows the same name and arguments."""
    content, calls = parse_tool_calls('ok <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    history = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": content, "tool_calls": calls},
    ]
    text = plain_tok.decode(render_prompt(plain_tok, history, TOOLS))
    assert "ok\n<tool_call>" in text
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text


def test_token_bytes_rebuild_multibyte_text(tok):
    """OpenAI's `bytes` field: the raw bytes of each token, even when a token is half a character."""
    from artcloud.server.chat import token_bytes

    text = "héllo ☃ Paris"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces = [token_bytes(tok, i) for i in ids]
    assert bytes(b for piece in pieces for b in piece).decode("utf-8") == text

    def whole(piece: list[int]) -> bool:
        try:
            bytes(piece).decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False

    # The tiny vocabulary splits the snowman into byte tokens: some tokens are not text on their own.
    assert not all(whole(p) for p in pieces)


# ------------------------------------------------------------------------------------------ responses


def test_prompt_sha256_is_of_4_byte_little_endian_ids():
    """The documented encoding, so that any client or sampler can compute the same hash."""
    import hashlib

    from artcloud.server.chat import prompt_sha256

    assert prompt_sha256([1, 258, 70000]) == hashlib.sha256(
        bytes([1, 0, 0, 0]) + bytes([2, 1, 0, 0]) + bytes([0x70, 0x11, 0x01, 0x00])
    ).hexdigest()
    assert prompt_sha256([]) == hashlib.sha256(b"").hexdigest()
    assert prompt_sha256([1, 2]) != prompt_sha256([2, 1]) != prompt_sha256([1, 2, 0])


def test_each_choice_carries_its_prompt_hash_and_temperature(tok):
    from artcloud.server.chat import completion_response, prompt_sha256
    from artcloud.server.engines.base import Completion

    prompt = render_prompt(tok, [{"role": "user", "content": "Hi"}], None)
    ids = tok("Paris", add_special_tokens=False)["input_ids"]
    comps = [Completion(token_ids=ids, logprobs=[-0.5] * len(ids), top_logprobs=None, finish_reason="stop",
                        text="Paris", temperature=t) for t in (0.7, 0.0)]
    body = completion_response(served_as="m@1", prompt_ids=prompt, completions=comps, tokenizer=tok,
                               want_logprobs=True, want_token_ids=False, parse_tools=False)
    assert [c["prompt_sha256"] for c in body["choices"]] == [prompt_sha256(prompt)] * 2
    assert [c["temperature"] for c in body["choices"]] == [0.7, 0.0]
    assert "token_ids" not in body["choices"][0]  # the hash comes even without the ids
