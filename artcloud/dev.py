"""OpenPipe ART's `art.dev`: the typed dicts ART scripts pass as `_internal_config=` and `_config=`.

They are plain dicts at run time, as in ART (`art.dev.InternalModelConfig(engine_args={...})` is a dict). What
artcloud does with each key is `artcloud.model.internal_config` (a TrainableModel's `_internal_config`) and
`artcloud.types.TrainConfig` (a train call's `_config`): a key artcloud honours is mapped onto its own setting, one
that only tunes speed or memory on ART's engine is accepted and has no effect, and any other is refused when set
to a non-default value, in one line saying what to write instead. The keys are listed here so that a script's
`art.dev.X(...)` calls read the same; ART's full vLLM and Hugging Face argument lists are not repeated.
"""

from __future__ import annotations

from typing import Any, Literal

from typing_extensions import TypedDict


class EngineArgs(TypedDict, total=False):
    """vLLM's engine arguments for the model (artcloud's `engine_args`; the CPU engine warns and ignores vLLM's)."""

    max_model_len: int
    gpu_memory_utilization: float
    max_num_seqs: int
    max_num_batched_tokens: int
    max_loras: int
    max_cpu_loras: int
    max_lora_rank: int
    enforce_eager: bool
    enable_prefix_caching: bool
    enable_sleep_mode: bool
    dtype: str
    kv_cache_dtype: str
    tensor_parallel_size: int
    data_parallel_size: int
    seed: int
    swap_space: float


class InitArgs(TypedDict, total=False):
    """Unsloth's FastLanguageModel.from_pretrained arguments (ART's `init_args`)."""

    max_seq_length: int
    load_in_4bit: bool
    load_in_8bit: bool
    load_in_16bit: bool
    gpu_memory_utilization: float
    fast_inference: bool
    use_gradient_checkpointing: str
    dtype: str | None
    max_lora_rank: int
    random_state: int


class PeftArgs(TypedDict, total=False):
    """The LoRA adapter (ART's `peft_args`; artcloud's LoraConfig)."""

    r: int
    lora_alpha: int
    lora_dropout: float
    target_modules: list[str]
    random_state: int
    use_gradient_checkpointing: str
    bias: str
    use_rslora: bool


class TrainerArgs(TypedDict, total=False):
    """The optimizer's settings for every step (ART's `trainer_args`, Hugging Face TrainingArguments' names)."""

    max_grad_norm: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_epsilon: float
    learning_rate: float


class TinkerArgs(TypedDict, total=False):
    """ART's Tinker backend's settings: no counterpart here."""

    renderer_name: str
    training_client_args: dict[str, Any]


class InternalModelConfig(TypedDict, total=False):
    """A TrainableModel's engine settings (`_internal_config=`); artcloud.model.internal_config maps them."""

    init_args: InitArgs
    engine_args: EngineArgs
    peft_args: PeftArgs
    trainer_args: TrainerArgs
    tinker_args: TinkerArgs | None
    trainer_gpu_ids: list[int]
    inference_gpu_ids: list[int]
    rollout_weights_mode: Literal["lora", "merged"]
    chat_template_kwargs: dict[str, object]
    chat_template: str
    chat_template_path: str
    chat_template_content_format: str
    chat_template_tool_schema_format: Literal["default", "vllm_openai"]
    allow_unvalidated_arch: bool


class TrainConfig(TypedDict, total=False):
    """ART's experimental training keys (`train(_config=...)`), each a field of artcloud.TrainConfig under the same
    name or an alias of one (`epsilon`, `ppo`, ...)."""

    advantage_balance: float
    allow_training_without_logprobs: bool
    epsilon: float
    epsilon_high: float | None
    importance_sampling_level: Literal["token", "sequence", "average", "geometric_average"]
    kimi_k2_tau: float | None
    kl_penalty_coef: float
    kl_ref_adapter_path: str | None
    logprob_calculation_chunk_size: int
    mask_prob_ratio: bool
    max_negative_advantage_importance_sampling_weight: float
    moe_routing_replay_bundle: Any
    moe_routing_replay_path: str | None
    moe_routing_replay_strict: bool
    num_trajectories_learning_rate_multiplier_power: float
    packed_sequence_length: int | None
    plot_tensors: bool
    ppo: bool
    precalculate_logprobs: bool
    scale_learning_rate_by_reward_std_dev: bool
    scale_rewards: bool
    truncated_importance_sampling: float | None


class TrainSFTConfig(TypedDict, total=False):
    """ART's experimental SFT keys (`train_sft(_config=...)`): none are defined; an empty dict is accepted."""


class ServerArgs(TypedDict, total=False):
    """ART's vLLM OpenAI server arguments: artcloud's server is its own (`artcloud serve`)."""

    api_key: str
    chat_template: str
    port: int


class OpenAIServerConfig(TypedDict, total=False):
    """ART's `register(backend, _openai_client_config=...)`: accepted empty; artcloud's server is its own."""

    log_file: str
    server_args: ServerArgs
    engine_args: EngineArgs


__all__ = ["EngineArgs", "InitArgs", "InternalModelConfig", "OpenAIServerConfig", "PeftArgs", "ServerArgs",
           "TinkerArgs", "TrainConfig", "TrainSFTConfig", "TrainerArgs"]
