"""model.log and training steps: the server's history (JSONL + SVG beside the checkpoints, resumed with
them), its log route's validation, and Weights & Biases (the real wandb, offline) reading back what it wrote."""

from __future__ import annotations

import asyncio
import json
import struct
import sys
import uuid
from pathlib import Path

import pytest
from helpers import gather_groups, rollout_groups, train
from test_s3_server import s3_env, serve_pull, wait_pushed

import artcloud
from artcloud.backends.client import ServerGone
from artcloud.backends.remote import RemoteBackend
from artcloud.storage import checkpoints

TINY = "artcloud/tiny-random"


def backend_for(server) -> RemoteBackend:
    return RemoteBackend(server.url, token=server.token, ca_cert=server.ca, heartbeat_every_s=0)


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def spread(groups) -> None:
    """Rewards that differ within each group (so a step trains) and are known to the test."""
    for g in groups:
        for i, t in enumerate(g.trajectories):
            t.reward = 0.25 * i


async def registered(server, name: str, **kw) -> tuple[RemoteBackend, artcloud.TrainableModel]:
    backend = backend_for(server)
    model = artcloud.TrainableModel(name=name, project="tests", base_model=TINY, **kw)
    await model.register(backend)
    return backend, model


def test_log_and_training_steps_land_in_the_history_beside_the_checkpoints(tiny_server, one_torch_thread):
    async def main():
        backend, model = await registered(tiny_server, "hist", report_metrics=[])
        async with backend:
            groups = await gather_groups(model, n=3)
            spread(groups)  # rewards 0, .25, .5 in each of 2 groups
            groups[0].trajectories[0].metrics["length"] = 4.0
            groups[0].trajectories[1].metrics["length"] = 6.0
            groups[1].metrics["judge_tokens"] = 10.0
            val0 = await model.log(groups, split="val", metrics={"accuracy": 0.5})
            failed = await model.log([groups[0].trajectories[2], ValueError("rollout failed")], split="test")
            trained = await model.train(groups, config=artcloud.TrainConfig(learning_rate=1e-3), progress=False)
            val1 = await model.log(groups[:1], metrics={"reward_mean": 0.9})  # split="val", step: the model's
            info = await backend.model_info("hist")
        return val0, failed, trained, val1, info

    val0, failed, trained, val1, info = asyncio.run(main())
    assert val0["split"] == "val" and val0["step"] == 0 and val0["source"] == "log"
    assert val0["reward_mean"] == pytest.approx(0.25) and val0["reward_min"] == 0 and val0["reward_max"] == 0.5
    assert val0["reward_std"] == pytest.approx((2 * 0.25 ** 2 / 3) ** 0.5)
    assert val0["trajectories"] == 6 and val0["exceptions"] == 0 and val0["accuracy"] == 0.5
    assert val0["length"] == 5.0 and val0["group_metric_judge_tokens"] == 10.0
    assert failed["split"] == "test" and failed["exceptions"] == 1 and failed["exception_rate"] == 0.5
    assert failed["trajectories"] == 1 and failed["reward_mean"] == 0.5
    # TrainResult.metrics are the step's numbers, so ART's model.log(groups, metrics=result.metrics) takes them
    assert trained.step == 1 and "reward_mean" in trained.metrics
    assert all(type(v) in (int, float) for v in trained.metrics.values()) and "step" not in trained.metrics
    assert val1["step"] == 1 and val1["reward_mean"] == 0.9  # the user's metrics win over the aggregates
    history = info.history
    assert [(r["split"], r["source"], r["step"]) for r in history] == [
        ("val", "log", 0), ("test", "log", 0), ("train", "train", 1), ("val", "log", 1)]
    assert history[2]["reward_mean"] == pytest.approx(0.25) and "loss" in history[2]

    folder = tiny_server.path / "tests" / "hist"
    assert jsonl(folder / "history.jsonl") == history  # the live copy: everything so far
    step1 = folder / "checkpoints" / "1"
    assert jsonl(step1 / "history.jsonl") == history[:3]  # as of the commit of step 1
    manifest = checkpoints.verify(step1)
    assert {"history.jsonl", "reward.svg"} <= set(manifest["files"])
    assert jsonl(folder / "checkpoints" / "0" / "history.jsonl") == []
    assert "history" not in json.loads((step1 / "trainer_state.json").read_text())  # kept once, in history.jsonl
    svg = (folder / "reward.svg").read_text()
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    assert 'class="train"' in svg and 'class="val"' in svg and 'class="test"' in svg
    assert 'class="val"' in (step1 / "reward.svg").read_text()


def test_bad_log_bodies_get_4xx_naming_the_field(tiny_server):
    bad = [
        ({"metrics": {"reward": "high"}}, "metrics.reward"),
        ({"metrics": {"ok": True}}, "metrics.ok"),
        ({"metrics": {"step": 3}}, "metrics.step"),
        ({"metrics": {f"m{i}": 1 for i in range(65)}}, "metrics"),
        ({"split": "../etc"}, "split"),
        ({"step": 99}, "step"),
        ({"step": -1}, "step"),
        ({"reward": 1}, "reward"),
    ]
    with tiny_server.client() as c:
        for body, field in bad:
            r = c.post("/artcloud/models/agent/log", json=body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["field"] == field, (body, r.json())
        for raw, field in ((b'{"metrics": {"reward": NaN}}', "metrics.reward"), (b'{"metrics": {"r": 1e999}}', "metrics.r")):
            r = c.post("/artcloud/models/agent/log", content=raw, headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["field"] == field, r.text
        r = c.post("/artcloud/models/agent/log", json={"metrics": {"bad key!": 1}})
        assert r.status_code == 400 and r.json()["error"]["field"].startswith("metrics"), r.text
        assert c.post("/artcloud/models/nobody/log", json={}).status_code == 404
        assert c.get("/artcloud/models/agent").json()["history"] == []  # nothing bad was recorded
    with tiny_server.client(token="not-the-token") as c:
        assert c.post("/artcloud/models/agent/log", json={}).status_code == 401

    async def client_side():
        backend, model = await registered(tiny_server, "agent", report_metrics=[])
        async with backend:
            with pytest.raises(artcloud.ArtcloudError, match=r"metrics\['x'\] must be a finite number") as e:
                await model.log(metrics={"x": float("nan")})
            assert isinstance(e.value, ValueError) and e.value.field == "metrics.x"
            with pytest.raises(TypeError, match=r"trajectories\[0\] is a dict"):
                await model.log([{"reward": 1}])
            with pytest.raises(artcloud.ArtcloudError, match="step") as e:
                await model.log(metrics={"x": 1.0}, step=7)  # the server's 400, naming the field
            assert e.value.field == "step" and e.value.status == 400

    asyncio.run(client_side())
    with pytest.raises(ValueError, match="'tensorboard' is not known"):
        artcloud.Model(name="m", project="p", base_model=TINY, report_metrics=["tensorboard"])


def test_a_resumed_server_continues_the_history(seaweed, start_server, tmp_path, one_torch_thread):
    bucket = f"hist-{uuid.uuid4().hex[:10]}"
    seaweed.client().create_bucket(Bucket=bucket)
    uri, env = f"s3://{bucket}/team", s3_env(seaweed)
    spec = {"name": "agent", "project": "s3", "base_model": TINY}

    def log(c, split: str, **metrics) -> dict:
        r = c.post("/artcloud/models/agent/log", json={"split": split, "metrics": metrics})
        assert r.status_code == 200, r.text
        return r.json()

    a = start_server(tmp_path / "a", "--s3", uri, env=env)
    with a.client() as c:
        assert c.post("/artcloud/models", json=spec).status_code == 200
        log(c, "val", reward_mean=0.1)
        train(c, "agent", rollout_groups(c, "agent", ["x", "y"], n=4), learning_rate=1e-3)
        log(c, "val", reward_mean=0.2)  # after the last commit: in the live copies, in no checkpoint yet
        wait_pushed(c, 1)  # "pending" covers the live history's push too
        before = c.get("/artcloud/models/agent").json()["history"]
    a.stop()
    live = seaweed.client().get_object(Bucket=bucket, Key="team/s3/agent/history.jsonl")["Body"].read().decode()
    assert [json.loads(line) for line in live.splitlines()] == before  # S3's live copy
    # The same machine again: the live file brings back what was logged after the last commit.
    a2 = start_server(a.path, "--s3", uri, env=env)
    with a2.client() as c:
        info = c.post("/artcloud/models", json=spec).json()
        assert info["resumed"] and info["history"] == before
    a2.stop()
    # A fresh machine resumes from S3: S3's live copy begins with the checkpoint's history, so it is taken,
    # with what was logged after the last commit; then the history goes on.
    b = start_server(tmp_path / "b", "--s3", uri, env=env)
    with b.client() as c:
        info = c.post("/artcloud/models", json=spec).json()
        assert info["resumed"] and info["step"] == 1 and info["history"] == before
        log(c, "val", reward_mean=0.3)
        train(c, "agent", rollout_groups(c, "agent", ["z", "w"], n=4), learning_rate=1e-3)
        after = c.get("/artcloud/models/agent").json()["history"]
        wait_pushed(c, 2)
    assert [(r["split"], r["step"]) for r in after] == [("val", 0), ("train", 1), ("val", 1), ("val", 1), ("train", 2)]
    assert after[:3] == before and after[3]["reward_mean"] == 0.3
    folder = b.path / "s3" / "agent"
    assert jsonl(folder / "history.jsonl") == after == jsonl(folder / "checkpoints" / "2" / "history.jsonl")
    # `artcloud pull` brings the history and the plot with the checkpoint, verified by its manifest.
    pulled = serve_pull("s3/agent", uri, seaweed, "--to", str(tmp_path / "pulled"))
    assert pulled.returncode == 0, pulled.stderr
    assert jsonl(tmp_path / "pulled" / "2" / "history.jsonl") == after
    assert 'class="val"' in (tmp_path / "pulled" / "2" / "reward.svg").read_text()


def test_a_history_from_disk_or_s3_is_untrusted(tmp_path):
    from artcloud.server import history

    ckpt, model_dir = tmp_path / "ckpt", tmp_path / "model"
    ckpt.mkdir()
    model_dir.mkdir()
    good = [{"step": 1, "split": "train", "source": "train", "time": 1.0, "job_id": "job-1", "reward_mean": 0.5},
            {"step": 1, "split": "val", "source": "log", "time": 2.0, "reward_mean": 0.7}]
    lines = [json.dumps(good[0]), "[1, 2]", '{"step": -1}', '{"step": 1, "loss": NaN}', '{"step": 1, "loss": "x"}',
             "not json", json.dumps({"step": 1, **{f"m{i}": 1 for i in range(200)}}), json.dumps(good[1])]
    (ckpt / "history.jsonl").write_text("\n".join(lines) + "\n")
    assert history.restore(ckpt, model_dir, 1, {}) == good  # the bad lines skipped
    assert history.restore(ckpt, model_dir, 0, {}) == []  # records after the resumed step are dropped
    # A live copy that goes on from the checkpoint's history is taken; one that does not is ignored.
    later = {"step": 1, "split": "test", "source": "log", "time": 3.0}
    (model_dir / "history.jsonl").write_text(history.to_jsonl([*good, later]))
    assert history.restore(ckpt, model_dir, 1, {}) == [*good, later]
    (model_dir / "history.jsonl").write_text(history.to_jsonl([later]))
    assert history.restore(ckpt, model_dir, 1, {}) == good
    # S3's live copy (a fresh machine's only one) by the same rule, after the disk's, validated like it.
    remote = history.parse_jsonl(history.to_jsonl([*good, later]) + '{"step": "x"}\nnot json\n', "s3")
    assert remote == [*good, later]
    assert history.restore(ckpt, tmp_path / "fresh", 1, {}, remote) == [*good, later]
    assert history.restore(ckpt, tmp_path / "fresh", 1, {}, [later]) == good
    (model_dir / "history.jsonl").write_text(history.to_jsonl([*good, later, later]))
    assert history.restore(ckpt, model_dir, 1, {}, remote) == [*good, later, later]  # the disk's goes first
    # A checkpoint from before history.jsonl kept its (training) records in the trainer state.
    (ckpt / "history.jsonl").unlink()
    old = [{"step": 1, "reward_mean": 0.5, "time": 1.0}, {"step": "two"}]
    assert history.restore(ckpt, tmp_path / "none", 1, {"history": old}) == [{**old[0], "split": "train", "source": "train"}]
    assert history.restore(ckpt, tmp_path / "none", 1, {"history": {"not": "a list"}}) == []
    assert history.metric_by_step([*good, later], "val/reward") == {1: 0.7}
    assert history.metric_by_step([*good, later], "reward_mean") == {1: 0.5}



def test_a_hostile_history_is_skipped_with_one_warning_and_bounded_work(caplog):
    """Security review 3, N6, on the parser S3's and the disk's history.jsonl go through: an integer too large for a
    float (it raised OverflowError: every register of that model was a 500), junk lines (each logged a warning: 8 MiB
    of them, 4 million lines of log), and far more records than are kept (all parsed first: 2 GB for 63 MiB)."""
    from artcloud.server import history

    huge = '{"step": 1, "loss": 1' + "0" * 400 + "}"
    good = [{"step": i, "split": "train", "source": "train", "loss": 0.5} for i in range(3)]
    assert history.parse_jsonl("\n".join([huge, '{"step": 2, "loss": 9007199254740993}', '{"step": 2, "ok": true}',
                                          json.dumps(good[0]), "x" * 100, json.dumps(good[1])]), "s3") == good[:2]
    assert history.parse_jsonl(json.dumps(good[2]) + "\r\n" + huge + "\n\n", "s3") == good[2:]

    caplog.clear()
    junk = "x\n" * (2 * history.MAX_LINES_READ)
    with caplog.at_level("WARNING", logger="artcloud.server"):
        assert history.parse_jsonl(json.dumps(good[0]) + "\n" + junk, "s3") == []  # beyond the lines it reads
    assert len(caplog.records) == 2, [r.getMessage() for r in caplog.records]
    assert f"{history.MAX_LINES_READ} line(s) skipped" in caplog.records[0].getMessage()

    many = "".join(json.dumps({"step": i, "loss": 0.5}) + "\n" for i in range(history.MAX_RECORDS + 500))
    kept = history.parse_jsonl(many + "not json\n", "s3")
    assert [r["step"] for r in kept] == list(range(500, history.MAX_RECORDS + 500))  # the newest, in order


# ---------------------------------------------------------------------------------------------- W&B


def wandb_records(path: Path):
    """The protobuf records of an offline run's .wandb file. Its format is LevelDB's log: a 7-byte header
    (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of chunks (crc32c, length, type: 1 whole,
    2 first, 3 middle, 4 last). wandb reads it in Go now (wandb-core); its protobuf classes parse a record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:7] == b":W&B" + struct.pack("<HB", 0xBEE1, 0)
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def wandb_runs(root: Path) -> list[tuple[str, list[dict]]]:
    """Each offline run under `root`: its id, and each row it logged ({key: decoded value})."""
    runs = []
    for file in sorted(root.glob("wandb/offline-run-*/run-*.wandb")):
        run_id, rows = None, []
        for record in wandb_records(file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
            elif kind == "history":
                row: dict = {}
                for item in record.history.item:  # a histogram or table comes as nested keys: val/rewards, _type
                    keys = [item.key] if item.key else list(item.nested_key)
                    if len(keys) > 1:
                        keys = ["/".join(keys[:-1]), keys[-1]]
                    target = row
                    for key in keys[:-1]:
                        target = target.setdefault(key, {})
                    target[keys[-1]] = json.loads(item.value_json)
                rows.append(row)
        runs.append((run_id, rows))
    return runs


def test_wandb_gets_each_log_and_training_step(tiny_server, tmp_path, monkeypatch, one_torch_thread):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)

    async def main():
        backend, model = await registered(tiny_server, "wb", report_metrics=["wandb"])
        # ART's update_wandb_config: merged before the run starts, given to it then; a key set twice must agree
        model.update_wandb_config({"task": "spread", "sampling": {"n": 3}})
        model.update_wandb_config({"sampling": {"temperature": 1.0}, "task": "spread"})
        with pytest.raises(artcloud.InvalidArgument, match="'sampling.n' is 3 already, not 4"):
            model.update_wandb_config({"sampling": {"n": 4}})
        async with backend:
            groups = await gather_groups(model, n=3)
            spread(groups)
            await model.log(groups, split="val", metrics={"accuracy": 0.75})
            result = await model.train(groups, config=artcloud.TrainConfig(learning_rate=1e-3), progress=False)
            model._wandb.finish()
            # A new process (or a resumed run) on the same model: the same W&B run goes on.
            again = artcloud.TrainableModel(name="wb", project="tests", base_model=TINY, report_metrics=["wandb"])
            await again.register(backend)
            await again.log(metrics={"accuracy": 1.0})
            again._wandb.finish()
            # The default (None) without WANDB_API_KEY reports nothing.
            quiet = artcloud.TrainableModel(name="wb", project="tests", base_model=TINY)
            await quiet.register(backend)
            await quiet.log(metrics={"accuracy": 0.0})
            assert quiet._wandb is None
        return groups, result

    groups, result = asyncio.run(main())
    runs = wandb_runs(tmp_path)
    assert [run_id for run_id, _ in runs] == ["wb", "wb"]  # id = the model's name, resume="allow"
    rows = [row for _, rs in runs for row in rs]
    val = next(r for r in rows if "val/reward" in r)
    assert val["training_step"] == 0 and val["val/reward"] == pytest.approx(0.25) and val["val/accuracy"] == 0.75
    assert val["val/trajectories"] == 6 and val["val/reward_max"] == 0.5
    hist = val["val/rewards"]
    assert hist["_type"] == "histogram" and sum(hist["values"]) == 6
    assert val["val/samples"]["_type"] == "table-file" and val["val/samples"]["nrows"] == 6
    tables = list(tmp_path.glob("wandb/offline-run-*/files/media/table/val/samples_*.table.json"))
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["step", "reward", "trajectory"]
    assert sorted(row[1] for row in table["data"]) == sorted(t.reward for g in groups for t in g.trajectories)
    assert all(row[2].startswith("user: ") and "\nassistant: " in row[2] for row in table["data"])
    train_row = next(r for r in rows if "train/reward" in r)
    assert train_row["training_step"] == 1 == result.step
    assert train_row["train/loss"] == pytest.approx(result.metrics["loss"])
    assert train_row["train/reward"] == pytest.approx(0.25) and train_row["train/rewards"]["_type"] == "histogram"
    assert train_row["train/samples"]["nrows"] == 6
    assert [r["val/accuracy"] for r in rows if "val/accuracy" in r] == [0.75, 1.0]  # not the quiet one's 0.0
    first = next(iter(sorted(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))))
    config = {item.key: json.loads(item.value_json) for record in wandb_records(first)
              if record.WhichOneof("record_type") == "run" for item in record.run.config.update}
    assert config["task"] == "spread" and config["sampling"] == {"n": 3, "temperature": 1.0}


def test_a_step_found_committed_after_a_lost_server_is_reported_too(tiny_server, tmp_path, monkeypatch, one_torch_thread):
    """The server goes while `train` follows its job, after the step was committed: the replacement finds the
    step there and train() returns it without training again. W&B must get that step as any other."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")

    class LosesTheStream(RemoteBackend):
        """The real server and job; the client loses the event stream at the job's end, as when a spot
        machine goes right after its step committed. Its "replacement" is the same server, which has the step."""

        async def follow_job(self, job_id, on_event=None):
            await super().follow_job(job_id)
            raise ServerGone("connection reset by the lost machine")

        async def _replace_server(self, cause):
            return {"sandbox": "stand-in", "reason": str(cause)}

    async def main():
        backend = LosesTheStream(tiny_server.url, token=tiny_server.token, ca_cert=tiny_server.ca, heartbeat_every_s=0)
        model = artcloud.TrainableModel(name="wb-lost", project="tests", base_model=TINY, report_metrics=["wandb"])
        await model.register(backend)
        async with backend:
            groups = await gather_groups(model, n=3)
            spread(groups)
            result = await model.train(groups, config=artcloud.TrainConfig(learning_rate=1e-3), progress=False)
            assert model._wandb is not None, "the step was not reported"
            run_dir = Path(model._wandb.run().dir)  # wandb keeps the first WANDB_DIR a process gave it
            model._wandb.finish()
        return result, backend, run_dir.parents[2]

    result, backend, root = asyncio.run(main())
    assert result.step == 1 and len(backend.replacements) == 1 and result.events == []  # found, not followed
    assert result.metrics["loss"] != 0
    runs = wandb_runs(root)
    rows = [row for run_id, rs in runs if run_id == "wb-lost" for row in rs]
    train_rows = [r for r in rows if "train/reward" in r]
    assert train_rows, (f"no train row in W&B; the step's metrics {result.metrics}; the runs under {root}: "
                        f"{[(run_id, [sorted(r) for r in rs]) for run_id, rs in runs]}")  # (once on a loaded clone)
    train_row = train_rows[0]
    assert train_row["training_step"] == 1 and train_row["train/loss"] == pytest.approx(result.metrics["loss"])
    assert train_row["train/reward"] == pytest.approx(0.25) and train_row["train/samples"]["nrows"] == 6


def test_wandb_asked_for_but_missing_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(artcloud.ArtcloudError) as e:
        artcloud.TrainableModel(name="m", project="p", base_model=TINY, report_metrics=["wandb"])
    assert "pip install 'artcloud[wandb]'" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)  # ART's default: a key in the environment turns W&B on
    with pytest.raises(artcloud.ArtcloudError, match=r"artcloud\[wandb\]"):
        artcloud.Model(name="m", project="p", base_model=TINY)
    artcloud.Model(name="m", project="p", base_model=TINY, report_metrics=[])  # ... and [] turns it off
