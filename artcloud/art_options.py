"""OpenPipe ART's options, turned into artcloud's settings: a train call's keywords and `_config`
(`apply_art_options`), and a TrainableModel's `_internal_config` (`internal_config`, art.dev.InternalModelConfig).

One rule for every key: what artcloud honours is mapped onto its own setting; what only tunes speed or memory on
ART's engine (Unsloth's gradient checkpointing, 8-bit optimizers, vLLM's logging) is accepted and has no effect;
anything else is refused when it is not ART's default, in one line saying what to write instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from artcloud.errors import ArtcloudError, InvalidArgument, NotSupported, WrongType
from artcloud.types import LoraConfig, TrainConfig


def apply_art_options(config: TrainConfig, options: Mapping[str, Any], *, where: str) -> tuple[TrainConfig, bool]:
    """`config` with ART's training options applied (LocalBackend.train keywords, art.dev.TrainConfig keys:
    TrainConfig's own table of ART's names, types._from_art_names), and ART's save_checkpoint; one line for any
    that artcloud cannot honour, naming what to write instead.

    save_checkpoint=False: as with ART's LocalBackend, the result names no checkpoint (checkpoint_path None); the
    step is still committed, since that is how NAME@STEP is served and resumed."""
    from artcloud.types import _from_art_names

    if not isinstance(options, Mapping):
        raise WrongType(f"{where} must be a dict of art.dev.TrainConfig keys, not {type(options).__name__}", field=where)
    options = dict(options)
    save_checkpoint = options.pop("save_checkpoint", True)
    if not isinstance(save_checkpoint, bool):
        raise WrongType(f"{where}: save_checkpoint must be True or False, not {save_checkpoint!r}", field="save_checkpoint")
    try:
        update = _from_art_names(options)
    except ArtcloudError as e:
        e.args = (f"{where}: {e}",)  # the same error, saying which argument it is about
        raise
    return (type(config).model_validate({**config.model_dump(), **update}) if update else config), save_checkpoint


@dataclass
class Internal:
    """What an art.dev.InternalModelConfig comes to here."""

    engine_args: dict[str, Any] = field(default_factory=dict)  # the model's engine_args
    lora: dict[str, Any] = field(default_factory=dict)  # LoraConfig fields
    train_defaults: dict[str, Any] = field(default_factory=dict)  # TrainConfig fields for every step


# section -> ART key -> where it goes: ("engine", key) / ("lora", field) / ("train", field), None (speed or memory
# only: accepted, no effect), or (None, ART's default, what to write instead) for a key honoured only at its default.
_ENGINE = {k: ("engine", k) for k in ("max_model_len", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens",
                                      "max_loras", "max_cpu_loras", "max_lora_rank", "enforce_eager",
                                      "enable_prefix_caching", "enable_sleep_mode", "dtype", "kv_cache_dtype",
                                      "tensor_parallel_size", "data_parallel_size", "seed", "swap_space")}
_SPEED = None
_MAP: dict[str, dict[str, Any]] = {
    "init_args": {
        "max_seq_length": ("engine", "max_seq_length"), "load_in_4bit": ("engine", "load_in_4bit"),
        "gpu_memory_utilization": ("engine", "gpu_memory_utilization"), "max_lora_rank": ("engine", "max_lora_rank"),
        "dtype": ("engine", "dtype"), "random_state": ("lora", "init_seed"),
        "fast_inference": _SPEED, "use_gradient_checkpointing": _SPEED, "float8_kv_cache": _SPEED,
        "disable_log_stats": _SPEED, "enable_prefix_caching": _SPEED, "use_async": _SPEED, "fix_tokenizer": _SPEED,
        "load_in_8bit": (None, False, "artcloud loads the trainer in 16 bits, or 4 with load_in_4bit"),
        "load_in_16bit": (None, True, "artcloud loads the trainer in 16 bits, or 4 with load_in_4bit"),
        "full_finetuning": (None, False, "artcloud trains LoRA adapters only"),
        "trust_remote_code": (None, False, "artcloud never runs a model repository's code"),
    },
    "peft_args": {
        "r": ("lora", "rank"), "lora_alpha": ("lora", "alpha"), "lora_dropout": ("lora", "dropout"),
        "target_modules": ("lora", "target_modules"), "random_state": ("lora", "init_seed"),
        "max_seq_length": ("engine", "max_seq_length"), "use_gradient_checkpointing": _SPEED,
        "bias": (None, "none", "LoRA biases are not trained here"),
        "use_rslora": (None, False, "set alpha= for the scale instead"),
        "init_lora_weights": (None, True, "the adapter starts at LoRA B = 0, as peft's default does"),
        "modules_to_save": (None, None, "artcloud trains LoRA adapters only"),
        "layers_to_transform": (None, None, "LoRA covers every layer's target_modules"),
        "loftq_config": (None, {}, "artcloud's adapters start at LoRA B = 0"),
    },
    "trainer_args": {
        "max_grad_norm": ("train", "max_grad_norm"), "weight_decay": ("train", "weight_decay"),
        "adam_beta1": ("train", "adam_beta1"), "adam_beta2": ("train", "adam_beta2"),
        "adam_epsilon": ("train", "adam_epsilon"),
        # each step's own (backend.train(learning_rate=...)) wins, as in ART
        "learning_rate": _SPEED,
        "per_device_train_batch_size": _SPEED, "gradient_accumulation_steps": _SPEED, "gradient_checkpointing": _SPEED,
        "gradient_checkpointing_kwargs": _SPEED, "torch_empty_cache_steps": _SPEED, "optim": _SPEED, "bf16": _SPEED,
        "fp16": _SPEED, "tf32": _SPEED, "logging_steps": _SPEED, "report_to": _SPEED, "output_dir": _SPEED,
        "disable_tqdm": _SPEED, "dataloader_num_workers": _SPEED, "save_strategy": _SPEED, "seed": _SPEED,
    },
    "engine_args": _ENGINE,
}
_TOP: dict[str, tuple[Any, str]] = {
    "trainer_gpu_ids": (None, "artcloud places the trainer and vLLM itself; the server's engine_args trainer_gpus "
                              "(e.g. SkyBackend(engine_args={'trainer_gpus': 1})) sets how many GPUs train"),
    "inference_gpu_ids": (None, "artcloud places the trainer and vLLM itself; the server's engine_args trainer_gpus "
                                "(e.g. SkyBackend(engine_args={'trainer_gpus': 1})) sets how many GPUs train"),
    "rollout_weights_mode": ("lora", "vLLM serves the LoRA adapters as they are"),
    "tinker_args": (None, "artcloud trains on its own engines, not through Tinker"),
    "tinker_native_args": (None, "artcloud trains on its own engines, not through Tinker"),
    "chat_template": (None, "the server renders with the base model's own chat template"),
    "chat_template_path": (None, "the server renders with the base model's own chat template"),
    "chat_template_kwargs": (None, "the server renders with the base model's own chat template"),
    "chat_template_content_format": (None, "the server renders with the base model's own chat template"),
    "chat_template_tool_schema_format": ("default", "the server renders tools as the chat template expects"),
    "allow_unvalidated_arch": (False, None),  # artcloud keeps no list of validated architectures: any value
}


def internal_config(config: Any) -> Internal:
    """An art.dev.InternalModelConfig (a dict) as artcloud's settings; NotSupported / InvalidArgument naming the key."""
    if not isinstance(config, Mapping):
        raise WrongType(f"_internal_config must be an art.dev.InternalModelConfig (a dict), not {type(config).__name__}",
                        field="_internal_config")
    out = Internal()
    for section, value in config.items():
        where = f"_internal_config[{section!r}]"
        if section in _TOP:
            default, instead = _TOP[section]
            if instead is not None and value not in (default, None, [], {}):
                raise NotSupported(f"{where}={value!r} is OpenPipe ART's and artcloud has no counterpart: {instead}",
                                   field=f"_internal_config.{section}")
            continue
        if section not in _MAP:
            raise InvalidArgument(f"{where}: art.dev.InternalModelConfig has no key {section!r} (its keys: "
                                  f"{', '.join([*_MAP, *_TOP])})", field=f"_internal_config.{section}")
        if not isinstance(value, Mapping):
            raise WrongType(f"{where} must be a dict, not {type(value).__name__}", field=f"_internal_config.{section}")
        for key, setting in value.items():
            rule = _MAP[section].get(key, "unknown")
            if rule is _SPEED:
                continue
            if rule == "unknown":
                raise NotSupported(f"{where}[{key!r}] is not one artcloud takes: it honours "
                                   f"{', '.join(k for k, r in _MAP[section].items() if r and r[0])} and accepts (without "
                                   "effect) those that only tune ART's speed or memory", field=f"_internal_config.{section}.{key}")
            target, name = rule[0], rule[1]
            if target is None:
                if setting != name:
                    raise NotSupported(f"{where}[{key!r}]={setting!r} is OpenPipe ART's and artcloud has no counterpart: "
                                       f"{rule[2]}", field=f"_internal_config.{section}.{key}")
                continue
            bucket = {"engine": out.engine_args, "lora": out.lora, "train": out.train_defaults}[target]
            if name in bucket and bucket[name] != setting:
                raise InvalidArgument(f"_internal_config sets {name} twice, to {bucket[name]!r} and {setting!r}",
                                      field=f"_internal_config.{section}.{key}")
            bucket[name] = setting
    if out.lora:
        LoraConfig(**out.lora)  # a bad rank or dropout is told now, naming the field
    if out.train_defaults:
        TrainConfig(**out.train_defaults)
    return out
