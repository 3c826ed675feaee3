"""launch → register → rollout → train → down through SkyBackend, on a node whose image has this file's Python.

The SkyPilot stand-in (tests/sky_standin.py) makes its node from the venv running this file
(tests/sky_image.py): that Python as the image's python3, without the python3-venv package, with uv at
~/.local/bin as SkyPilot 0.14 leaves a node. `make test-pythons` runs it under 3.10 (Ubuntu 22.04's
python3), 3.12 and 3.13; the laptop side runs the same Python. 3.10 is where a first real launch broke:
`python3 -m venv` on an image without python3-venv, then a lock that needs 3.11 (uv brings a CPython that fits).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import artcloud
from artcloud.backends.sky import SkyBackend
from artcloud.backends.state import StateDir
from tests.helpers import gather_groups
from tests.sky_standin import LocalSky, down_all, leftover_processes

REPO = Path(__file__).resolve().parents[2]


def test_launch_train_down_on_this_python(tmp_path, monkeypatch):
    root = tmp_path / "cloud"
    env = {
        "HOME": str(tmp_path / "home"),
        "ARTCLOUD_HOME": str(tmp_path / "state"),
        "ARTCLOUD_SKY_API": "tests.sky_standin:LocalSky",
        "ARTCLOUD_STANDIN_ROOT": str(root),
        "ARTCLOUD_STANDIN_MINUTE_S": "0.5",
        "ARTCLOUD_STANDIN_PYTHON": sys.executable,
        "ARTCLOUD_STANDIN_NETWORK": "vast",  # only port 8080 reaches the laptop
    }
    (tmp_path / "home").mkdir()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "ARTCLOUD_S3_ENDPOINT_URL"):
        monkeypatch.delenv(key, raising=False)

    async def main() -> SkyBackend:
        backend = SkyBackend(gpu="L4:1", cluster_name="py", idle_minutes=1)
        async with backend:
            model = artcloud.TrainableModel(name="agent", project="py", base_model="artcloud/tiny-random",
                                            lora=artcloud.LoraConfig(rank=4))
            await model.register(backend)
            groups = await gather_groups(model)
            result = await model.train(groups, config=artcloud.TrainConfig(learning_rate=1e-3), progress=False)
            assert result.step == 1
            assert StateDir().load("py").price_per_hour == 0.44  # what was launched: local-l4-1

            # The server is the wheel's artcloud in a venv that uv made from the image's python3 when the gpu lock
            # serves it (3.11-3.12), else from a CPython uv installed (the stand-in's: this machine's 3.11).
            venv = root / "clusters" / "py" / "home" / "artcloud-venv"
            cfg = (venv / "pyvenv.cfg").read_text()
            mine = f"{sys.version_info.major}.{sys.version_info.minor}"
            expected = mine if (3, 11) <= sys.version_info[:2] < (3, 13) else "3.11"
            assert f"version_info = {expected}." in cfg and "uv = " in cfg
            log = "\n".join(LocalSky().logs("py"))
            assert "serving on https://" in log
        return backend

    try:
        asyncio.run(main())
        assert LocalSky().status("py") is None
        assert StateDir().load("py").state == "down"
    finally:
        down_all(root)
    assert leftover_processes(root) == {}
    assert os.path.isdir(root / "images" / f"py{sys.version_info.major}.{sys.version_info.minor}")
