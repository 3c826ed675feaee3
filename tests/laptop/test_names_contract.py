"""artcloud's sandbox names against SkyPilot's own rule (sky.utils.common_utils.check_cluster_name_is_valid):
every name artcloud takes, SkyPilot takes, so that no launch fails in SkyPilot after the wheel was built.

SkyPilot is asked in a subprocess with a temporary HOME: `import sky` writes ~/.sky and fixes its catalog
folder, which the shared fixture (tests/laptop/sky_offline.py) must do first in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from artcloud.backends.state import check_name

NAMES = ["a", "box-1", "mail-agent", "a" * 63, "a--b", "run-20260101-120000", "artcloud-0f3a9c", "x9",
         "box-", "a-", "mail-agent-", "-box", "1box", "123", "Box", "BOX-1", "box_1", "box.1", "box_", "box.",
         "", "a" * 64, "a b", "../etc", "box1\n", "bö"]

ASK_SKY = """
import json, sys
from sky.utils import common_utils
ok = {}
for name in json.loads(sys.stdin.read()):
    try:
        common_utils.check_cluster_name_is_valid(name)
        ok[name] = True
    except Exception:
        ok[name] = False
print(json.dumps(ok))
"""


def _artcloud_takes(name: str) -> bool:
    try:
        check_name(name)
        return True
    except ValueError:
        return False


def test_every_name_artcloud_takes_skypilot_takes(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path), "SKYPILOT_DISABLE_USAGE_COLLECTION": "1",
           "SKYPILOT_DISABLE_LOCAL_API_SERVER": "1"}
    out = subprocess.run([sys.executable, "-c", ASK_SKY], input=json.dumps(NAMES), env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    sky_takes = json.loads(out.stdout.splitlines()[-1])
    assert sky_takes["mail-agent"] and not sky_takes["mail-agent-"]  # SkyPilot was really asked
    assert [n for n in NAMES if _artcloud_takes(n) and not sky_takes[n]] == []
    assert {n for n in NAMES if _artcloud_takes(n)} == {"a", "box-1", "mail-agent", "a" * 63, "a--b",
                                                        "run-20260101-120000", "artcloud-0f3a9c", "x9"}
