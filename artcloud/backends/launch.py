"""What every cloud launch takes from this machine, checked here before a GPU is paid for: the user's
secrets (values read from the environment now), and for S3 the credentials and the bucket itself.
SkyBackend and ModalBackend share these; each raises the failures as its own error class."""

from __future__ import annotations

import os
import re
from typing import Any, Iterable, Mapping

from artcloud.errors import ArtcloudError

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def user_secrets(given: Mapping[str, str] | Iterable[str] | str | None, *, reserved: Iterable[str],
                 s3: str | None, error: type[ArtcloudError], valid_for_s: float | None = None) -> dict[str, str]:
    """Name → value for the sandbox: a dict as given, or names of environment variables here; plus, for
    `s3`, this machine's AWS credentials, which must stay valid for `valid_for_s` (the sandbox's longest
    life). `reserved`: artcloud's own secret names, which a user's may not take."""
    found: dict[str, str] = {}
    if isinstance(given, Mapping):
        found.update({str(k): str(v) for k, v in given.items()})
    elif given is not None:
        for key in [given] if isinstance(given, str) else given:
            if key not in os.environ:
                raise error(f"secret {key} is not set in this environment: export {key}=... first",
                            code="missing_secret", field="secrets")
            found[key] = os.environ[key]
    reserved = set(reserved)
    for key in found:
        if not _ENV_NAME.match(key):
            raise error(f"secret name {key!r} is not an environment variable name", code="bad_secret", field="secrets")
        if key in reserved:
            raise error(f"{key} is artcloud's own secret: name yours differently", code="bad_secret", field="secrets")
    if s3:
        for key, value in s3_credentials(s3, error=error, valid_for_s=valid_for_s).items():
            found.setdefault(key, value)
    return found


def s3_credentials(uri: str, *, error: type[ArtcloudError], valid_for_s: float | None = None) -> dict[str, str]:
    """The AWS credentials the sandbox needs for `uri`, from this machine's settings: ARTCLOUD_S3_ACCESS_KEY_ID /
    ARTCLOUD_S3_SECRET_ACCESS_KEY first (a key meant for this, ideally scoped to the bucket), then boto3's own
    chain (env, profiles, SSO, roles). The chain's answer is frozen and shipped: the sandbox cannot refresh it,
    so temporary credentials (a session token: SSO, assumed roles, 1-12 h) are refused when they would expire
    within `valid_for_s` seconds, or when their expiry cannot be told and `valid_for_s` is over an hour."""
    key, secret = os.environ.get("ARTCLOUD_S3_ACCESS_KEY_ID"), os.environ.get("ARTCLOUD_S3_SECRET_ACCESS_KEY")
    token = None
    if not (key and secret):
        try:
            import boto3
        except ImportError as e:
            raise error("s3= needs boto3 here: pip install 'artcloud[s3]'", code="missing_dependency") from e
        found = boto3.Session().get_credentials()
        frozen = found.get_frozen_credentials() if found is not None else None
        if frozen is None or not frozen.access_key or not frozen.secret_key:
            raise error(f"no S3 credentials on this machine for {uri}: set ARTCLOUD_S3_ACCESS_KEY_ID and "
                        "ARTCLOUD_S3_SECRET_ACCESS_KEY (a key for this bucket; see the README's Secrets), or "
                        "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or configure an AWS profile",
                        code="no_s3_credentials", field="s3")
        key, secret, token = frozen.access_key, frozen.secret_key, frozen.token
        if token and valid_for_s is not None:
            _check_lifetime(getattr(found, "_expiry_time", None), valid_for_s, error=error)
    creds = {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}
    if token:
        creds["AWS_SESSION_TOKEN"] = token
    return creds


UNKNOWN_EXPIRY_ALLOWED_S = 3600.0  # STS's default session length: shorter runs may use such credentials


def _check_lifetime(expiry: Any, valid_for_s: float, *, error: type[ArtcloudError]) -> None:
    """Temporary credentials must outlive the sandbox; `expiry` is botocore's (a datetime) or None."""
    from datetime import datetime, timezone

    from artcloud.durations import format_duration

    fix = ("set ARTCLOUD_S3_ACCESS_KEY_ID and ARTCLOUD_S3_SECRET_ACCESS_KEY to a long-lived key scoped to this "
           "bucket (README: Secrets), or shorten max_duration")
    if expiry is None:
        if valid_for_s > UNKNOWN_EXPIRY_ALLOWED_S:
            raise error(f"this machine's AWS credentials are temporary (a session token) and their expiry is "
                        f"unknown, but the sandbox may run {format_duration(valid_for_s)} and cannot renew them: {fix}",
                        code="s3_credentials_expire", field="s3")
        return
    left = (expiry - datetime.now(timezone.utc)).total_seconds()
    if left < valid_for_s:
        raise error(f"this machine's AWS credentials are temporary and expire in {format_duration(max(0.0, left))}, "
                    f"before the sandbox's {format_duration(valid_for_s)} are up (the final checkpoint push would "
                    f"fail): {fix}", code="s3_credentials_expire", field="s3")


def check_s3(uri: str, *, error: type[ArtcloudError]) -> None:
    """The bucket is reachable and writable with these credentials, checked from here before launching."""
    from artcloud.storage.s3 import CheckpointStore, S3Config, StorageError

    try:
        CheckpointStore(S3Config.from_uri(uri)).check()
    except StorageError as e:
        raise error(str(e), code="s3_unusable", field="s3") from e
