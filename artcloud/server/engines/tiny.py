"""`artcloud/tiny-random`: a ~1 M parameter random Qwen2 model with a real tokenizer and chat template.

Built offline in well under a second, deterministically (same bytes every time), for fast tests. It
speaks nonsense, but every code path (chat template with tools, sampling, logprobs, LoRA training,
checkpoints) runs exactly as with a real model.
"""

from __future__ import annotations

from pathlib import Path

NAME = "artcloud/tiny-random"

# ChatML with Hermes-style tool calls, as Qwen2.5 writes them.
CHAT_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}You are a helpful assistant.{% endif %}

# Tools

You may call one or more functions. Function signatures are inside <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each call, return a JSON object inside <tool_call></tool_call>:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0]['role'] != 'system' %}<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' %}{% if not tools %}<|im_start|>system
{{ message['content'] }}<|im_end|>
{% endif %}
{%- elif message['role'] == 'tool' %}<|im_start|>user
<tool_response>
{{ message['content'] }}
</tool_response><|im_end|>
{% elif message['role'] == 'assistant' %}<|im_start|>assistant
{% if message['content'] %}{{ message['content'] }}{% endif %}
{%- if message.get('tool_calls') %}{% for call in message['tool_calls'] %}
<tool_call>
{"name": "{{ call['function']['name'] }}", "arguments": {{ call['function']['arguments'] if call['function']['arguments'] is string else call['function']['arguments'] | tojson }}}
</tool_call>{% endfor %}{% endif %}<|im_end|>
{% else %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

_CORPUS = """\
The quick brown fox jumps over the lazy dog. What is the capital of France? The capital of France is Paris.
You are a helpful assistant. Write a sentence of exactly five words. Call the weather tool for Berlin.
{"name": "get_weather", "arguments": {"city": "Berlin"}} <tool_call> </tool_call> <tool_response>
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100. Reinforcement learning trains agents from rewards.
Group relative policy optimisation compares several answers to the same prompt with each other.
"""


def build(folder: Path) -> Path:
    """Write the tokenizer and model into `folder` (created); returns it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=["<|im_start|>"], chat_template=CHAT_TEMPLATE)

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    model = Qwen2ForCausalLM(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
