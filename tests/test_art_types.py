"""OpenPipe ART's types, gather and utils, written as ART scripts write them (`import artcloud as art`):
unit tests on plain coroutines, and one end-to-end test that trains additional histories on tiny-random."""

from __future__ import annotations

import asyncio
import random
import warnings

import pytest
from openai.types.chat.chat_completion import Choice

import artcloud as art
import artcloud.gather
from artcloud.errors import InvalidArgument, NotSupported, WrongType
from artcloud.gather import GatherError
from artcloud.utils import DatasetBatch, iterate_dataset, limit_concurrency


async def rollout(reward: float, delay: float = 0.0, **metrics: float) -> art.Trajectory:
    await asyncio.sleep(delay)
    traj = art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}], reward=reward)
    traj.metrics.update(metrics)
    return traj


async def boom() -> art.Trajectory:
    raise RuntimeError("rollout failed")


# ------------------------------------------------------------------------------------------------ Trajectory


def test_trajectory_messages_turn_choices_into_assistant_messages_with_tool_calls():
    choice = Choice.model_validate({
        "index": 0, "finish_reason": "tool_calls",
        "message": {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "look", "arguments": '{"x": 1}'}}]},
    })
    traj = art.Trajectory(messages_and_choices=[{"role": "system", "content": "s"}, choice,
                                                {"role": "tool", "tool_call_id": "call_1", "content": "seen"}], reward=1.0)
    assert traj.messages() == [
        {"role": "system", "content": "s"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "look", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "seen"},
    ]
    assert [m["trainable"] for m in traj.for_logging()["messages"]] == [False, True, False]


def test_trajectory_log_finish_and_track_duration():
    async def main() -> art.Trajectory:
        traj = art.Trajectory(messages_and_choices=[], reward=0)  # ART's examples start empty and append
        traj.log("started")
        async with traj.track_duration("env"):
            await asyncio.sleep(0.02)
        async with traj.track_duration("env"):
            await asyncio.sleep(0.02)
        return traj.finish()

    traj = asyncio.run(main())
    assert traj.logs == ["started"]
    assert traj.metrics["env_duration"] >= 0.04 and traj.metrics["duration"] >= traj.metrics["env_duration"]
    assert "start_time" not in traj.model_dump()
    traj.metrics["won"] = True  # ART's metrics take bools and ints as they are
    assert traj.model_dump()["metrics"]["won"] is True


def test_policy_versions_are_kept_and_logged_but_not_sent():
    traj = art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}], reward=1,
                          initial_policy_version=3, final_policy_version=4)
    assert (traj.initial_policy_version, traj.final_policy_version) == (3, 4)
    logged = traj.for_logging()
    assert (logged["initial_policy_version"], logged["final_policy_version"]) == (3, 4)
    assert not {"initial_policy_version", "final_policy_version"} & set(traj.to_wire())  # the server does not read them
    with pytest.raises(ValueError, match="initial_policy_version"):
        art.Trajectory(messages_and_choices=[], initial_policy_version=-1)


@pytest.mark.parametrize("cls", [art.Trajectory, art.History, art.TrajectoryGroup])
def test_an_unknown_field_is_one_line_with_the_fix(cls):
    base = {"messages_and_choices": [{"role": "user", "content": "q"}]} if cls is not art.TrajectoryGroup else {}
    typo = "rewrd" if cls is art.Trajectory else "metdata" if cls is art.TrajectoryGroup else "tols"
    with pytest.raises(InvalidArgument) as err:
        cls(**base, **{typo: 1})
    assert err.value.field == typo and "did you mean" in str(err.value) and "\n" not in str(err.value)
    assert repr({"rewrd": "reward", "metdata": "metadata", "tols": "tools"}[typo]) in str(err.value)


def test_arts_exchanges_say_what_to_write_instead():
    with pytest.raises(NotSupported) as err:
        art.Trajectory(exchanges={"chat_completions": []}, reward=1)
    assert err.value.field == "exchanges" and "messages_and_choices" in str(err.value)


def test_additional_histories_go_over_the_wire():
    sub = art.History(messages_and_choices=[{"role": "user", "content": "sub"},
                                            {"message": {"role": "assistant", "content": "ok"}, "token_ids": [1]}],
                      tools=[{"type": "function", "function": {"name": "f"}}])
    traj = art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}], additional_histories=[sub], reward=1)
    assert sub.messages()[1] == {"role": "assistant", "content": "ok"}
    wire = traj.to_wire()
    assert wire["additional_histories"] == [sub.to_wire()]
    assert wire["additional_histories"][0]["tools"] == [{"type": "function", "function": {"name": "f"}}]
    assert "additional_histories" not in art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}]).to_wire()


# ------------------------------------------------------------------------------------------------ TrajectoryGroup


def test_group_iterates_its_trajectories_and_takes_arts_keywords():
    a, b = art.Trajectory(reward=0.0), art.Trajectory(reward=1.0)
    group = art.TrajectoryGroup([a, ValueError("lost"), b], exceptions=[KeyError("gone")], metadata={"scenario": 3},
                                metrics={"judge_cost": 0.5}, logs=["judged"])
    assert len(group) == 2 and list(group) == [a, b] and [t.reward for t in group] == [0.0, 1.0]
    assert [e.message for e in group.exceptions] == ["lost", "'gone'"]
    assert "ValueError" in group.exceptions[0].type and "lost" in group.exceptions[0].traceback
    assert (group.metadata, group.metrics, group.logs) == ({"scenario": 3}, {"judge_cost": 0.5}, ["judged"])
    assert len(art.TrajectoryGroup(trajectories=[a, b])) == 2  # ART's keyword form


def test_await_a_group_of_rollouts_as_art_does():
    async def main() -> art.TrajectoryGroup:
        return await art.TrajectoryGroup(rollout(r, delay=0.01) for r in (0.0, 1.0, 0.5))

    group = asyncio.run(main())
    assert isinstance(group, art.TrajectoryGroup) and [t.reward for t in group] == [0.0, 1.0, 0.5]
    assert group.to_wire()["trajectories"][2]["reward"] == 0.5


def test_awaiting_a_group_alone_raises_the_first_failure_and_ends_the_rest():
    ended: list[str] = []

    async def slow() -> art.Trajectory:
        try:
            await asyncio.sleep(5)
        finally:
            ended.append("slow")
        return art.Trajectory()

    async def main() -> None:
        with pytest.raises(RuntimeError, match="rollout failed"):
            await art.TrajectoryGroup([slow(), boom()])
        assert ended == ["slow"]  # cancelled and over before the error arrived

    asyncio.run(main())


# ------------------------------------------------------------------------------------------------ gather


def test_gather_takes_group_awaitables_with_arts_keywords():
    async def make_group(scenario: int) -> art.TrajectoryGroup:
        # ART's style: a coroutine per scenario that awaits its own group.
        if scenario == 2:
            raise RuntimeError("scenario failed")
        return await art.TrajectoryGroup(rollout(r, delay=0.01, turns=scenario) for r in (0.0, 1.0))

    statuses: list[str] = []
    shown = artcloud.gather._Tally.show

    def spy(self):
        shown(self)
        statuses.append(self.status)

    async def main() -> list[art.TrajectoryGroup]:
        artcloud.gather._Tally.show = spy
        try:
            return await art.gather_trajectory_groups((make_group(s) for s in range(4)), pbar_desc="gather",
                                                      max_exceptions=1, max_metrics=1)
        finally:
            artcloud.gather._Tally.show = shown

    groups = asyncio.run(main())
    assert [[t.metrics["turns"] for t in g] for g in groups] == [[0, 0], [1, 1], [3, 3]]
    assert statuses[-1].startswith("reward 0.5, exceptions 1") and "turns" not in statuses[-1]  # max_metrics=1


def test_group_awaitable_failures_past_the_limit_raise():
    async def bad() -> art.TrajectoryGroup:
        raise RuntimeError("scenario failed")

    with pytest.raises(GatherError, match="scenario failed"):
        asyncio.run(art.gather_trajectory_groups([bad()], progress=False))
    with pytest.raises(WrongType, match="awaitables that return one"):
        asyncio.run(art.gather_trajectory_groups([art.Trajectory()], progress=False))


def test_failed_rollouts_are_kept_in_the_groups_exceptions():
    groups = [art.TrajectoryGroup([rollout(0.0), rollout(1.0), boom()])]
    [group] = asyncio.run(art.gather_trajectory_groups(groups, max_exceptions=1, progress=False))
    assert len(group) == 2 and [e.message for e in group.exceptions] == ["rollout failed"]


def test_after_each_may_return_a_list_of_groups():
    async def split(group: art.TrajectoryGroup) -> list[art.TrajectoryGroup]:
        return [art.TrajectoryGroup(list(group)[:2]), art.TrajectoryGroup(list(group)[2:])]

    groups = [art.TrajectoryGroup(rollout(r) for r in (0.0, 1.0, 2.0, 3.0))]
    out = asyncio.run(art.gather_trajectory_groups(groups, after_each=split, progress=False))
    assert [[t.reward for t in g] for g in out] == [[0.0, 1.0], [2.0, 3.0]]


def test_pbar_total_completion_tokens_is_deprecated():
    with pytest.warns(DeprecationWarning, match="pbar_total_completion_tokens"):
        asyncio.run(art.gather_trajectory_groups([art.TrajectoryGroup(rollout(r) for r in (0.0, 1.0))],
                                                 pbar_total_completion_tokens=True, progress=False))


def test_gather_trajectories_keeps_order_and_puts_exceptions_in_place():
    async def two() -> list[art.Trajectory]:
        return [await rollout(7.0), await rollout(8.0)]

    out = asyncio.run(art.gather_trajectories([rollout(1.0, delay=0.02), boom(), two()], pbar_desc="val",
                                              max_exceptions=1, progress=False))
    assert out[0].reward == 1.0 and isinstance(out[1], RuntimeError) and [t.reward for t in out[2]] == [7.0, 8.0]
    with pytest.raises(GatherError, match="1 of 2 rollouts failed"):
        asyncio.run(art.gather_trajectories([rollout(1.0), boom()], progress=False))


# ------------------------------------------------------------------------------------------------ TrainConfig


def test_train_config_takes_arts_names_and_sends_artclouds():
    config = art.TrainConfig(learning_rate=1e-5, beta=0.04)
    assert config.kl_coef == 0.04 and config.beta == 0.04
    config.beta = 0.1
    assert config.kl_coef == 0.1
    assert config.model_dump() == {**art.TrainConfig().model_dump(), "learning_rate": 1e-5, "kl_coef": 0.1}
    assert art.TrainConfig().learning_rate == 5e-6  # ART's default
    dev = art.TrainConfig(epsilon=0.3, epsilon_high=0.4, loss_fn="cispo", scale_rewards=False, kl_penalty_coef=None,
                          optimizer_save_interval=10, grad_accumulation_sequences=None,
                          allow_training_without_logprobs=False)  # ART's default: what artcloud does
    assert (dev.clip_epsilon, dev.clip_epsilon_high, dev.loss, dev.scale_rewards) == (0.3, 0.4, "cispo", False)
    assert art.TrainConfig(ppo=False, loss_fn="cispo").loss == "cispo" and art.TrainConfig(ppo=True).loss == "ppo"
    # ART's kl_penalty_coef is its own knob (a penalty on the advantages), not the k3 term (kl_coef, ART's beta)
    assert (art.TrainConfig(kl_penalty_coef=0.2).kl_penalty_coef, art.TrainConfig(kl_penalty_coef=0.2).kl_coef) == (0.2, 0)


def test_train_config_defaults_are_art_0_5_18s():
    # art/local/backend.py:638-677, art/loss.py:73-82: CISPO clipped at 1.0 / 4.0, PPO at 0.2 / epsilon
    default = art.TrainConfig()
    assert (default.learning_rate, default.loss, default.clip_bounds()) == (5e-6, "cispo", (1.0, 4.0))
    assert art.TrainConfig(loss_fn="ppo").clip_bounds() == (0.2, 0.2)
    assert art.TrainConfig(loss_fn="ppo", epsilon=0.1).clip_bounds() == (0.1, 0.1)
    assert art.TrainConfig(epsilon=0.5).clip_bounds() == (0.5, 4.0)  # CISPO's high bound stays 4.0, as in ART
    # ART's own defaults passed explicitly are accepted and change nothing
    explicit = art.TrainConfig(learning_rate=5e-6, loss_fn="cispo", loss_fn_config=None, normalize_advantages=True,
                               adam_params=None, kl_penalty_coef=0.0, kl_penalty_reference_step=None,
                               kl_ref_adapter_path=None, epsilon=None, epsilon_high=None, advantage_balance=0.0,
                               scale_rewards=True, importance_sampling_level="token",
                               max_negative_advantage_importance_sampling_weight=None, mask_prob_ratio=False,
                               kimi_k2_tau=None, precalculate_logprobs=False, allow_training_without_logprobs=False,
                               plot_tensors=False, truncated_importance_sampling=None,
                               scale_learning_rate_by_reward_std_dev=False, logprob_calculation_chunk_size=1024,
                               packed_sequence_length=None, num_trajectories_learning_rate_multiplier_power=0.0)
    assert explicit.model_dump() == default.model_dump()
    assert art.TrainConfig(normalize_advantages=False).scale_rewards is False
    adam = art.TrainConfig(adam_params={"learning_rate": 1e-4, "beta1": 0.8, "beta2": 0.95, "eps": 1e-12})
    assert (adam.learning_rate, adam.adam_beta1, adam.adam_beta2, adam.adam_epsilon) == (1e-4, 0.8, 0.95, 1e-12)
    with pytest.raises(InvalidArgument, match="adam_params has no key 'beta3'"):
        art.TrainConfig(adam_params={"beta3": 0.5})


def test_train_config_says_in_one_line_what_to_write_instead():
    with pytest.raises(NotSupported, match="grad_accumulation_sequences=4.*gradient_steps") as e:
        art.TrainConfig(grad_accumulation_sequences=4)
    assert "\n" not in str(e.value) and e.value.field == "grad_accumulation_sequences"
    with pytest.raises(InvalidArgument, match="no field 'learning_rat': did you mean 'learning_rate'"):
        art.TrainConfig(learning_rat=1e-5)
    with pytest.raises(InvalidArgument, match="both 'beta' and 'kl_coef'"):
        art.TrainConfig(beta=0.1, kl_coef=0.2)


# ------------------------------------------------------------------------------------------------ utils


def test_iterate_dataset_yields_arts_batches_in_arts_order():
    data = list(range(10))
    batches = list(iterate_dataset(data, groups_per_step=4, num_epochs=2, use_tqdm=False))
    assert [(b.step, b.epoch, b.epoch_step, len(b.items)) for b in batches] == [
        (0, 0, 0, 4), (1, 0, 1, 4), (2, 0, 2, 2), (3, 1, 0, 4), (4, 1, 1, 4), (5, 1, 2, 2)]
    for epoch in range(2):  # ART's shuffle: random.seed(epoch), then random.shuffle
        indices = list(range(10))
        random.seed(epoch)
        random.shuffle(indices)
        assert [i for b in batches if b.epoch == epoch for i in b.items] == indices

    random.seed(123)
    before = random.random()
    random.seed(123)
    resumed = list(iterate_dataset(data, groups_per_step=4, num_epochs=2, initial_step=4, use_tqdm=False))
    assert random.random() == before  # the global generator is not reseeded
    assert resumed == batches[4:] and isinstance(resumed[0], DatasetBatch)
    items, epoch, global_step, epoch_step = resumed[0]  # ART's older tuple form
    assert (items, epoch, global_step, epoch_step) == (batches[4].items, 1, 4, 1)
    assert art.utils.iterate_dataset is iterate_dataset and art.DatasetBatch is DatasetBatch


def test_iterate_dataset_shows_a_tqdm_bar(capsys):
    assert len(list(iterate_dataset(list(range(3)), num_epochs=2))) == 6
    assert "Iterating dataset" in capsys.readouterr().err


def test_retry_sync_and_async():
    calls = {"sync": 0, "async": 0}
    seen: list[tuple[str, int]] = []

    @art.retry(max_attempts=3, delay=0.001, exceptions=(ConnectionError,), on_retry=lambda e, n: seen.append((str(e), n)))
    def flaky() -> str:
        calls["sync"] += 1
        if calls["sync"] < 3:
            raise ConnectionError(f"try {calls['sync']}")
        return "ok"

    @art.retry(max_attempts=2, delay=0.001)
    async def always() -> None:
        calls["async"] += 1
        raise TimeoutError("down")

    assert flaky() == "ok" and seen == [("try 1", 1), ("try 2", 2)]
    with pytest.raises(TimeoutError, match="down"):
        asyncio.run(always())
    assert calls["async"] == 2

    @art.retry(exceptions=(ConnectionError,))
    def wrong() -> None:
        raise ValueError("not retried")

    with pytest.raises(ValueError):
        wrong()


def test_limit_concurrency():
    running = {"now": 0, "max": 0}

    @limit_concurrency(2)
    async def work() -> None:
        running["now"] += 1
        running["max"] = max(running["max"], running["now"])
        await asyncio.sleep(0.01)
        running["now"] -= 1

    async def main() -> None:
        await asyncio.gather(*(work() for _ in range(6)))

    asyncio.run(main())
    asyncio.run(main())  # a second event loop gets semaphores of its own
    assert running["max"] == 2


def test_arts_type_aliases_exist():
    def rollout_messages(messages: art.Messages, tools: art.Tools) -> art.MessagesAndChoices:
        return [*messages]

    assert rollout_messages([{"role": "user", "content": "q"}], []) == [{"role": "user", "content": "q"}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert {"History", "retry", "utils", "gather_trajectories", "DatasetBatch"} <= set(art.__all__)


# ------------------------------------------------------------------------------------------------ end to end


def test_additional_histories_are_trained_on(tiny_server):
    """A sub-agent's conversation rides along in `additional_histories`: the server trains its choices too,
    each in its own context, with the trajectory's reward."""
    from artcloud.backends.remote import RemoteBackend

    async def main() -> tuple[art.TrainResult, list[art.TrajectoryGroup]]:
        backend = RemoteBackend(tiny_server.url, token=tiny_server.token, ca_cert=tiny_server.ca, heartbeat_every_s=0)
        try:
            model = art.TrainableModel(name="histories", project="tests", base_model="artcloud/tiny-random")
            await model.register(backend)
            client = model.openai_client()

            async def two_agents(prompt: str, i: int) -> art.Trajectory:
                main_msgs = [{"role": "user", "content": prompt}]
                sub_msgs = [{"role": "system", "content": "You check answers."}, {"role": "user", "content": "check"}]
                first, second = await asyncio.gather(*(
                    client.chat.completions.create(model=model.name, messages=m, max_tokens=4, logprobs=True)
                    for m in (main_msgs, sub_msgs)))
                return art.Trajectory(
                    messages_and_choices=[*main_msgs, first.choices[0]], reward=float(i),
                    additional_histories=[art.History(messages_and_choices=[*sub_msgs, second.choices[0]])])

            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(two_agents(p, i) for i in range(3)) for p in ("a", "b")), pbar_desc="gather")
            result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-3), progress=False)
            return result, groups
        finally:
            await backend.close()

    result, groups = asyncio.run(main())
    start = next(e for e in result.events if e["type"] == "start")["data"]
    assert start["trajectories"] == 6 and start["samples"] == 12  # each trajectory: its own turn + its sub-agent's
    assert result.step == 1 and result.trained

    # A history is checked as a trajectory is: its choice must follow the context it was sampled in.
    body = {"groups": [g.to_wire() for g in groups]}
    body["groups"][0]["trajectories"][1]["additional_histories"][0]["messages_and_choices"][0]["content"] = "edited"
    with tiny_server.client() as c:
        r = c.post("/artcloud/models/histories/train", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "context_mismatch"
        assert error["field"] == "groups[0].trajectories[1].additional_histories[0].messages_and_choices[2]"


def test_sampled_turns_only_in_additional_histories_are_enough_to_train():
    from artcloud.model import _check_groups

    choice = {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi"},
              "logprobs": {"content": [{"token": "hi", "logprob": -0.5, "bytes": None, "top_logprobs": []}]}}
    user = {"role": "user", "content": "play"}

    def traj(history: list) -> artcloud.Trajectory:
        return artcloud.Trajectory(messages_and_choices=[user], reward=1.0,
                                   additional_histories=[artcloud.History(messages_and_choices=history)])

    _check_groups([artcloud.TrajectoryGroup([traj([user, choice]), traj([user, choice])])])
    with pytest.raises(artcloud.InvalidArgument, match=r"trajectories\[0\] has no turn sampled"):
        _check_groups([artcloud.TrajectoryGroup([traj([user]), traj([user, choice])])])
    unlogged = {**choice, "logprobs": None}
    with pytest.raises(artcloud.InvalidArgument, match="without logprobs"):
        _check_groups([artcloud.TrajectoryGroup([traj([user, unlogged]), traj([user, choice])])])
