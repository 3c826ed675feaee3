"""The offline SkyPilot fixtures (sky_offline.py) for the SkyPilot contract tests in this folder."""

from sky_offline import launch_secrets, sky, sky_home  # noqa: F401  (fixtures)
