"""README's "Coming from OpenPipe ART" table, checked row by row against artcloud's real attributes.

A row names an ART 0.5.18 attribute (`art.X.y`, a module path such as `art.utils.sft.train_sft_from_file`
included) or a keyword (`art.X.y(kw=)`), what artcloud has for it, and a status. same: artcloud's column is
ART's name under `artcloud.` and it resolves. alias: ART's name and artcloud's own both resolve. different:
artcloud's column resolves. not supported: using ART's name (reading it, calling or awaiting a method; passing
a keyword with a value other than ART's default) raises a one-line ArtcloudError that names the replacement,
or, where the note says "absent", the name (or keyword) does not exist. So a row cannot claim what artcloud
does not do, and a name that appears or goes away breaks the table.

`backend.train`'s keywords and `art.dev.TrainConfig`'s keys are checked once more: each at ART's default must
give artcloud's defaults (ART_TRAIN_DEFAULTS, copied from ART 0.5.18's art/local/backend.py:638-677), and each
of ART's names listed below must have a row (`test_the_table_covers_art_0_5_18`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import artcloud
from artcloud.art_options import apply_art_options
from artcloud.errors import ArtcloudError, NotSupported

README = Path(__file__).resolve().parents[1] / "README.md"
NAME = re.compile(r"(?P<path>artcloud(?:\.\w+)+)(?:\((?P<kw>\w+)=\))?")
STATUSES = {"same", "alias", "different", "not supported"}


def table_rows() -> list[tuple[str, str, str, str]]:
    text = README.read_text()
    start, end = text.index("<!-- art-table:start -->"), text.index("<!-- art-table:end -->")
    rows = []
    for line in text[start:end].splitlines():
        if not line.startswith("| `art"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 4, f"a row needs 4 cells (ART | artcloud | status | note): {line}"
        rows.append((cells[0].strip("`"), cells[1].strip("`"), cells[2], cells[3]))
    return rows


ROWS = table_rows()

# ART 0.5.18's LocalBackend.train keywords and their defaults (art/local/backend.py:638-677; verbose aside), and
# art.dev.TrainConfig's `ppo`: what an ART script passes when it passes ART's default explicitly.
ART_TRAIN_DEFAULTS: dict[str, Any] = {
    "learning_rate": 5e-6, "loss_fn": "cispo", "loss_fn_config": None, "normalize_advantages": True,
    "adam_params": None, "kl_penalty_coef": 0.0, "kl_penalty_reference_step": None, "kl_ref_adapter_path": None,
    "epsilon": None, "epsilon_high": None, "advantage_balance": 0.0, "scale_rewards": True,
    "importance_sampling_level": "token", "max_negative_advantage_importance_sampling_weight": None,
    "mask_prob_ratio": False, "kimi_k2_tau": None, "precalculate_logprobs": False,
    "allow_training_without_logprobs": False, "plot_tensors": False, "truncated_importance_sampling": None,
    "scale_learning_rate_by_reward_std_dev": False, "logprob_calculation_chunk_size": 1024,
    "packed_sequence_length": None, "num_trajectories_learning_rate_multiplier_power": 0.0, "save_checkpoint": True,
    "ppo": False,
}
# art.dev.TrainConfig's keys with no backend.train keyword (Megatron's MoE routing replay), at ART's defaults
ART_DEV_DEFAULTS: dict[str, Any] = {"moe_routing_replay_bundle": None, "moe_routing_replay_path": None,
                                    "moe_routing_replay_strict": True}
# A value other than ART's default, for a 'not supported' keyword that artcloud takes at ART's default only.
NOT_ART_DEFAULT: dict[str, Any] = {
    "loss_fn_config": {"clip": 0.2}, "precalculate_logprobs": True, "allow_training_without_logprobs": True,
    "plot_tensors": True, "grad_accumulation_sequences": 4, "moe_routing_replay_bundle": object(),
    "moe_routing_replay_path": "routes.pt",
    "_openai_client_config": {"server_args": {"port": 8000}},
}

# ART 0.5.18's names that the table must list (the brief of issue 38): its top level (`__init__.py`'s `__all__`),
# Model's and TrainableModel's members and keywords (model.py), LocalBackend's (local/backend.py), art.dev's
# names and TrainConfig keys, art.utils.sft's functions and keywords, and the rest of what its scripts use.
def _names(prefix: str, names: str) -> list[str]:
    return [f"{prefix}{n}" for n in names.split()]


def _keywords(target: str, names: str) -> list[str]:
    return [f"{target}({n}=)" for n in names.split()]


ART_0_5_18 = [
    *_names("art.", "dev auto_trajectory capture_auto_trajectory gather_trajectories gather_trajectory_groups "
                    "trajectory_group_batches Backend LocalBackend LocalTrainResult ServerlessBackend "
                    "ServerlessTrainResult Messages MessagesAndChoices Tools Model TrainableModel retry TrainSFTConfig "
                    "TrainConfig TrainResult Trajectory TrajectoryGroup capture_yielded_trajectory yield_trajectory"),
    "art.local.LocalBackend", "art.local.backend.LocalBackend", "art.trajectories.History",
    *_keywords("art.Model", "name project entity id config inference_api_key inference_base_url inference_model_name "
                            "base_path report_metrics"),
    *_names("art.Model.", "run_id trainable safe_model_dump backend register openai_client litellm_completion_params "
                          "get_inference_name overwrite_state write_state merge_state read_state update_wandb_config "
                          "metrics_builder activate_metrics_context log get_step"),
    *_keywords("art.TrainableModel", "name project entity id run_id config base_model base_path report_metrics "
                                     "_internal_config"),
    *_names("art.TrainableModel.", "cost_calculator set_cost_calculator model_dump safe_model_dump register "
                                   "delete_checkpoints train_sft"),
    *_keywords("art.TrainableModel.train_sft", "config _config verbose"),
    *_keywords("art.TrainConfig", "learning_rate kl_penalty_coef grad_accumulation_sequences"),
    *_keywords("art.TrainSFTConfig", "learning_rate batch_size"),
    *_keywords("art.LocalBackend", "in_process path gpu_cost_per_hour_usd"),
    *_names("art.LocalBackend.", "close register adapter_lease prune_model_adapters train "
                                 "supports_automatic_train_step_metrics automatic_gpu_cost_per_hour_usd "
                                 "_experimental_pull_model_checkpoint _experimental_pull_from_s3 _experimental_push_to_s3 "
                                 "_experimental_fork_checkpoint"),
    *_keywords("art.LocalBackend.train", " ".join(k for k in ART_TRAIN_DEFAULTS if k != "ppo") + " verbose"),
    *_names("art.dev.", "EngineArgs InternalModelConfig InitArgs PeftArgs TinkerArgs TinkerNativeArgs "
                        "TinkerTrainingClientArgs TrainerArgs get_openai_server_config is_dedicated_mode "
                        "OpenAIServerConfig ServerArgs TrainSFTConfig TrainConfig validate_dedicated_config"),
    *_keywords("art.dev.TrainConfig", "advantage_balance allow_training_without_logprobs epsilon epsilon_high "
                                      "importance_sampling_level kimi_k2_tau kl_penalty_coef kl_ref_adapter_path "
                                      "logprob_calculation_chunk_size mask_prob_ratio "
                                      "max_negative_advantage_importance_sampling_weight moe_routing_replay_bundle "
                                      "moe_routing_replay_path moe_routing_replay_strict "
                                      "num_trajectories_learning_rate_multiplier_power packed_sequence_length "
                                      "plot_tensors ppo precalculate_logprobs scale_learning_rate_by_reward_std_dev "
                                      "scale_rewards truncated_importance_sampling"),
    *_names("art.utils.sft.", "train_sft_from_file create_sft_dataset_iterator create_lr_schedule iterate_file "
                              "get_file_row_count SFTChunk resolve_sft_batch_size"),
    *_keywords("art.utils.sft.train_sft_from_file", "epochs batch_size peak_lr schedule_type warmup_ratio initial_step "
                                                    "final_step _config verbose shuffle_buffer_size"),
    *_keywords("art.utils.sft.create_sft_dataset_iterator", "chunk_size epochs batch_size peak_lr schedule_type "
                                                            "warmup_ratio shuffle seed initial_step show_progress"),
    *_keywords("art.utils.sft.create_lr_schedule", "total_steps peak_lr method warmup_steps min_lr"),
    *_keywords("art.utils.sft.iterate_file", "epochs shuffle_buffer_size seed initial_skip"),
    *_names("art.utils.", "iterate_dataset limit_concurrency retry format_message get_model_step log_http_errors "
                          "record_provenance"),
    *_keywords("art.utils.iterate_dataset", "groups_per_step num_epochs initial_step use_tqdm"),
    *_keywords("art.utils.limit_concurrency", "derive_key"),
    *_keywords("art.retry", "max_attempts delay backoff_factor exceptions on_retry"),
    *_names("art.rewards.", "ruler ruler_score_group"),
    *_keywords("art.rewards.ruler", "judge_model extra_litellm_params rubric tools debug"),
    *_keywords("art.rewards.ruler_score_group", "judge_model extra_litellm_params rubric swallow_exceptions debug"),
]


# Instances to look attributes up on (a pydantic field or an attribute set in __init__ is not on the class).
def _instance(cls: type) -> Any:
    tiny = {"name": "t", "project": "p", "base_model": "artcloud/tiny-random"}
    traj = {"messages_and_choices": [{"role": "user", "content": "hi"}], "reward": 0.5}
    if cls is artcloud.TrainableModel or cls is artcloud.Model:
        return cls(**tiny)
    if cls is artcloud.Trajectory:
        return cls(**traj)
    if cls is artcloud.TrajectoryGroup:
        return cls([artcloud.Trajectory(**traj)])
    if cls is artcloud.TrainConfig:
        return cls()
    return None


class Missing(Exception):
    pass


def resolve(path: str) -> Any:
    """`artcloud.a.b.c` as an object, importing submodules on the way; Missing when some part is absent.
    A member of a class resolves to the class's attribute, or to its name when only instances have it."""
    parts = path.split(".")
    assert parts[0] == "artcloud", path
    obj: Any = artcloud
    for k, part in enumerate(parts[1:], start=1):
        if inspect.ismodule(obj):
            try:
                found = getattr(obj, part)
            except ArtcloudError:
                raise  # an ART name that says what to write instead (artcloud.NotInArtcloud)
            except AttributeError:
                found = _submodule(parts[: k + 1])
                if found is None:
                    raise Missing(path) from None
            # `utils.iterate_dataset.iterate_dataset`: the package's function of that name hides the module
            if k + 1 < len(parts) and not inspect.ismodule(found) and not hasattr(found, parts[k + 1]):
                found = _submodule(parts[: k + 1]) or found
            obj = found
            continue
        if inspect.isclass(obj) and not hasattr(obj, part):
            fields = set(getattr(obj, "model_fields", {}))
            if dataclasses.is_dataclass(obj):
                fields |= {f.name for f in dataclasses.fields(obj)}
            instance = _instance(obj)
            if part in fields or (instance is not None and part in dir(instance)):
                obj = part  # an instance attribute: nothing further to walk into
                continue
            raise Missing(path)
        try:
            obj = inspect.getattr_static(obj, part)
        except AttributeError:
            raise Missing(path) from None
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
    return obj


def _submodule(parts: list[str]) -> Any:
    """The module `artcloud.a.b`, or None where there is none (a module that fails to import still raises)."""
    name = ".".join(parts)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        return None


def _typed_dict_keys(target: Any) -> set[str] | None:
    """An art.dev typed dict's keys (a TypedDict class), or None for anything else."""
    if inspect.isclass(target) and issubclass(target, dict) and hasattr(target, "__total__"):
        return set(target.__annotations__)
    return None


def _art_training_names() -> set[str]:
    """Every name backend.train and train(_config=) take (types._from_art_names, art_options.apply_art_options):
    TrainConfig's fields, ART's names for them, ART's knobs taken at their defaults only or without effect."""
    from artcloud.types import _ART_ALIASES, _ART_MET, _ART_UNSUPPORTED

    return {*artcloud.TrainConfig.model_fields, *_ART_ALIASES, *_ART_UNSUPPORTED, *_ART_MET, "ppo",
            "normalize_advantages", "adam_params", "save_checkpoint"}


def accepts(path: str, kw: str) -> bool:
    target = resolve(path)
    if isinstance(target, property):
        return False
    from artcloud.types import _ART_ALIASES

    # TrainConfig and the train calls also take ART's names for its fields (types._ART_ALIASES: beta, epsilon...).
    training_names = {*artcloud.TrainConfig.model_fields, *_ART_ALIASES}
    if inspect.isclass(target) and kw in getattr(target, "model_fields", {}):
        return True
    if target is artcloud.TrainConfig:
        return kw in training_names
    keys = _typed_dict_keys(target)
    if keys is not None:  # art.dev's typed dicts: plain dicts of these keys
        return kw in keys
    params = inspect.signature(target).parameters
    if kw in params:
        return params[kw].kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    # backend.train(model, groups, **options): TrainConfig's fields under either name, and ART's other knobs
    takes_options = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return takes_options and path.endswith(".train") and kw in _art_training_names()


def check_resolves(name: str) -> None:
    found = NAME.fullmatch(name)
    assert found, f"not an artcloud name: {name!r}"
    path, kw = found.group("path"), found.group("kw")
    if kw:
        assert accepts(path, kw), f"{path} takes no {kw}="
    else:
        resolve(path)


def as_artcloud(art_name: str) -> str:
    assert art_name.startswith("art."), art_name
    return "artcloud." + art_name[len("art."):]


def test_the_table_is_there_and_well_formed():
    assert len(ROWS) > 80
    names = [r[0] for r in ROWS]
    assert len(names) == len(set(names)), "a name listed twice"
    for art_name, artcloud_name, status, _ in ROWS:
        assert status in STATUSES, f"{art_name}: unknown status {status!r}"
        assert NAME.fullmatch(as_artcloud(art_name)), f"not an ART name: {art_name!r}"
        assert artcloud_name == "—" or NAME.fullmatch(artcloud_name), f"{art_name}: bad artcloud name {artcloud_name!r}"


def test_every_name_in_artclouds_all_resolves():
    for name in artcloud.__all__:
        getattr(artcloud, name)


@pytest.mark.parametrize("art_name,artcloud_name,status,note", ROWS, ids=[r[0] for r in ROWS])
def test_row(art_name, artcloud_name, status, note, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))  # constructing a backend must not touch the real HOME
    mine = as_artcloud(art_name)
    if status == "same":
        assert artcloud_name == mine, f"a 'same' row names the same thing: {artcloud_name} != {mine}"
        check_resolves(mine)
    elif status == "alias":
        assert artcloud_name != mine, "an alias names artcloud's own name"
        check_resolves(artcloud_name)
        check_resolves(mine)
    elif status == "different":
        check_resolves(artcloud_name)
    else:
        found = NAME.fullmatch(mine)
        assert found, mine
        if found.group("kw"):  # a keyword: passing it (other than at ART's default) raises, naming the fix
            path, kw = found.group("path"), found.group("kw")
            instead = NAME.fullmatch(artcloud_name).group("kw") or "" if artcloud_name != "—" else ""
            if note.startswith("absent"):
                assert not accepts(path, kw), f"{path} takes {kw}=: the row says it is absent"
                if path.endswith(".train") or _typed_dict_keys(resolve(path)) is not None:  # refused, in one line
                    with pytest.raises(ArtcloudError) as err:
                        apply_art_options(artcloud.TrainConfig(), {kw: None}, where="_config")
                    assert "\n" not in str(err.value)
                return
            value = NOT_ART_DEFAULT.get(kw)
            target = resolve(path)
            with pytest.raises(ArtcloudError) as err:
                if path.endswith(".train") or _typed_dict_keys(target) is not None:  # backend.train, _config
                    assert kw in {**ART_TRAIN_DEFAULTS, **ART_DEV_DEFAULTS}, f"{kw}: ART's default is not listed here"
                    apply_art_options(artcloud.TrainConfig(), {kw: value}, where="backend.train")
                elif inspect.iscoroutinefunction(target):  # a method: on an instance, refused before any I/O
                    owner = resolve(path.rsplit(".", 1)[0])
                    asyncio.run(target(_instance(owner), None, **{kw: value}))
                else:
                    assert inspect.isclass(target), "a 'not supported' keyword row is a constructor's, a method's or a train's"
                    target(**{kw: value})
            assert instead in str(err.value) and "\n" not in str(err.value), f"the error should name {instead}=: {err.value}"
        elif note.startswith("absent"):
            with pytest.raises(Missing):
                resolve(mine)
        else:
            with pytest.raises(ArtcloudError) as err:
                use(resolve(mine))
            # the replacement, as the message writes it: `LocalBackend(s3=...)` for the column's `LocalBackend(s3=)`
            instead = artcloud_name.split(".")[-1].removesuffix("=)") if artcloud_name != "—" else ""
            assert instead in str(err.value) and "\n" not in str(err.value), f"the error should name {artcloud_name}: {err.value}"


def use(target: Any) -> None:
    """Use what a 'not supported' class member resolved to: read a property, or call and await a method."""
    import asyncio

    if isinstance(target, property):
        target.fget(None)
    elif inspect.iscoroutinefunction(target):
        asyncio.run(target(None))


# Rows whose promise is behaviour, not just a name: checked on real objects.

def _group() -> Any:
    trajs = [artcloud.Trajectory(messages_and_choices=[{"role": "user", "content": f"{i}"}], reward=i) for i in range(3)]
    return artcloud.TrajectoryGroup(trajs), trajs


def test_iterating_a_group_yields_its_trajectories_and_len_counts_them():
    group, trajs = _group()
    assert list(group) == trajs and all(isinstance(t, artcloud.Trajectory) for t in group)
    assert len(group) == 3


def test_train_config_defaults_and_beta_as_in_art():
    assert artcloud.TrainConfig().learning_rate == 5e-6
    assert artcloud.TrainConfig(beta=0.25).kl_coef == 0.25


def test_trajectory_messages_are_the_plain_conversation():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert artcloud.Trajectory(messages_and_choices=messages, reward=0).messages() == messages


def test_get_inference_name_is_name_at_step():
    model = artcloud.TrainableModel(name="agent", project="p", base_model="artcloud/tiny-random")
    assert model.get_inference_name(step=3) == model.inference_name(step=3) == "agent@3"


def test_the_table_covers_art_0_5_18():
    listed = {r[0] for r in ROWS}
    missing = [name for name in ART_0_5_18 if name not in listed]
    assert not missing, f"ART 0.5.18 names without a row: {missing}"


TRAIN_KEYWORD = re.compile(r"art\.(LocalBackend\.train|dev\.TrainConfig)\((?P<kw>\w+)=\)")


def test_train_keywords_at_arts_defaults_train_as_artclouds_defaults():
    """Each backend.train keyword and art.dev.TrainConfig key the table lists, at ART's default, changes nothing:
    artcloud's defaults are ART's. One listed as same/alias/different is honoured at any value (not one that
    artcloud takes at ART's default only)."""
    from artcloud.types import _ART_UNSUPPORTED

    checked = 0
    for art_name, _, status, note in ROWS:
        found = TRAIN_KEYWORD.fullmatch(art_name)
        if not found or found.group("kw") == "verbose" or note.startswith("absent"):
            continue
        kw = found.group("kw")
        assert apply_art_options(artcloud.TrainConfig(), {kw: {**ART_TRAIN_DEFAULTS, **ART_DEV_DEFAULTS}[kw]}, where="t") == \
            (artcloud.TrainConfig(), True), kw
        if status != "not supported":
            assert kw not in _ART_UNSUPPORTED, f"{art_name}: taken at ART's default only, so 'not supported'"
        checked += 1
    assert checked > 40
    assert apply_art_options(artcloud.TrainConfig(), ART_TRAIN_DEFAULTS, where="t") == (artcloud.TrainConfig(), True)


def test_the_loss_defaults_are_arts():
    assert artcloud.TrainConfig().loss == "cispo" and artcloud.TrainConfig().clip_bounds() == (1.0, 4.0)
    assert artcloud.TrainConfig(loss_fn="ppo").clip_bounds() == (0.2, 0.2)
    assert artcloud.TrainConfig(ppo=True, epsilon=0.1).clip_bounds() == (0.1, 0.1)
    assert artcloud.TrainConfig(normalize_advantages=False).scale_rewards is False
    assert apply_art_options(artcloud.TrainConfig(), {"save_checkpoint": False}, where="t")[1] is False
    config = artcloud.TrainConfig(adam_params={"beta1": 0.8, "eps": 1e-6})
    assert (config.adam_beta1, config.adam_epsilon) == (0.8, 1e-6)


def test_the_rl_optimizer_defaults_are_arts_and_none_is_no_clipping():
    # ART's LocalBackend: trainer_args max_grad_norm=0.1 (art/dev/get_model_config.py), weight decay 0.1 on every RL
    # step (art/unsloth/train.py).
    config = artcloud.TrainConfig()
    assert (config.max_grad_norm, config.weight_decay, config.adam_beta1, config.adam_beta2) == (0.1, 0.1, 0.9, 0.99)
    assert artcloud.TrainConfig(max_grad_norm=None).max_grad_norm is None  # a value, not "the default"
    assert artcloud.TrainConfig(epsilon=None).clip_bounds() == (1.0, 4.0)  # ART's None: the default


def test_a_train_result_built_as_arts_has_its_fields_in_arts_order():
    result = artcloud.LocalTrainResult(5, {"loss": 1.0}, "/ckpt/5")
    assert (result.step, result.metrics, result.checkpoint_path) == (5, {"loss": 1.0}, "/ckpt/5")
    assert tuple(result) == (5, {"loss": 1.0}, "/ckpt/5")


def test_sft_auto_batch_is_arts_local_default():
    assert artcloud.TrainSFTConfig().batch == 2 and artcloud.TrainSFTConfig().learning_rate == 5e-5


@pytest.mark.parametrize("bad", [{"batch_size": 0}, {"learning_rate": -1e-5}, {"learning_rate": []},
                                 {"learning_rate": [1e-5, float("nan")]}, {"learning_rate": float("inf")}])
def test_a_bad_sft_config_is_refused_naming_its_field(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        artcloud.TrainSFTConfig(**bad)


def test_an_openai_client_config_refused_names_its_keys_not_its_values():
    model = artcloud.TrainableModel(name="t", project="p", base_model="artcloud/tiny-random")
    with pytest.raises(NotSupported, match="server_args") as refused:
        asyncio.run(model.register(None, _openai_client_config={"server_args": {"api_key": "sk-secret-1234"}}))
    assert "sk-secret" not in str(refused.value)


def test_internal_config_maps_onto_artclouds_settings():
    model = artcloud.TrainableModel(name="t", project="p", base_model="artcloud/tiny-random", _internal_config={
        "engine_args": {"max_model_len": 64}, "peft_args": {"r": 4, "lora_alpha": 8},
        "init_args": {"use_gradient_checkpointing": "unsloth"}})
    assert model.engine_args == {"max_model_len": 64} and (model.lora.rank, model.lora.alpha) == (4, 8)


def test_local_backend_takes_a_gpu_price(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert artcloud.LocalBackend(path=tmp_path, gpu_cost_per_hour_usd=2.5).price_per_hour == 2.5
    assert artcloud.LocalBackend(path=tmp_path).price_per_hour is None
    with pytest.raises(artcloud.InvalidArgument, match="gpu_cost_per_hour_usd must be dollars per hour"):
        artcloud.LocalBackend(path=tmp_path, gpu_cost_per_hour_usd=-1)


@pytest.mark.parametrize("field", ["kimi_k2_tau", "kl_coef", "kl_penalty_coef", "truncated_importance_sampling"])
def test_a_knob_that_is_nan_or_infinite_is_refused_naming_it(field):
    for value in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=field):
            artcloud.TrainConfig(**{field: value})
