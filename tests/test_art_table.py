"""README's "Coming from OpenPipe ART" table, checked row by row against artcloud's real attributes.

A row names an ART attribute (`art.X.y`) or a keyword (`art.X.y(kw=)`), what artcloud has for it, and a
status. same: artcloud's column is ART's name under `artcloud.` and it resolves. alias: ART's name and
artcloud's own both resolve. different: artcloud's column resolves. not supported: using ART's name (reading
it, calling or awaiting a method; passing a keyword) raises a one-line ArtcloudError that names the
replacement, or, where the note says "absent", the name does not exist. So a row cannot claim what artcloud
does not do, and a name that appears or goes away breaks the table.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import artcloud
from artcloud.errors import ArtcloudError

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
                obj = getattr(obj, part)
                continue
            except ArtcloudError:
                raise  # an ART name that says what to write instead (artcloud.NotInArtcloud)
            except AttributeError:
                try:
                    obj = importlib.import_module(".".join(parts[: k + 1]))
                    continue
                except ModuleNotFoundError:
                    raise Missing(path) from None
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
    params = inspect.signature(target).parameters
    if kw in params:
        return params[kw].kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    # backend.train(model, groups, **options): TrainConfig's fields under either name
    takes_options = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return takes_options and path.endswith(".train") and kw in training_names


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
        if found.group("kw"):  # a keyword: passing it raises, naming what to write instead
            kw, instead = found.group("kw"), NAME.fullmatch(artcloud_name).group("kw")
            target = resolve(found.group("path"))
            assert inspect.isclass(target), "a 'not supported' keyword row is a constructor's"
            with pytest.raises(ArtcloudError) as err:
                target(**{kw: None})
            assert instead in str(err.value), f"the error should name {instead}=: {err.value}"
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
