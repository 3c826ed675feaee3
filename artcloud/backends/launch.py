"""What every cloud launch takes from this machine, checked here before a GPU is paid for: the user's
secrets (values read from the environment now), and for S3 the credentials and the bucket itself.
SkyBackend and ModalBackend share these; each raises the failures as its own error class."""

from __future__ import annotations

import os
import re
from typing import Iterable, Mapping

from artcloud.backends.remote import ArtcloudError

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def user_secrets(given: Mapping[str, str] | Iterable[str] | str | None, *, reserved: Iterable[str],
                 s3: str | None, error: type[ArtcloudError]) -> dict[str, str]:
    """Name → value for the sandbox: a dict as given, or names of environment variables here; plus, for
    `s3`, this machine's AWS credentials. `reserved`: artcloud's own secret names, which a user's may not take."""
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
        for key, value in s3_credentials(s3, error=error).items():
            found.setdefault(key, value)
    return found


def s3_credentials(uri: str, *, error: type[ArtcloudError]) -> dict[str, str]:
    """The AWS credentials the sandbox needs for `uri`, from this machine's settings (ARTCLOUD_S3_* first,
    then boto3's own chain: env, profiles, SSO)."""
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
            raise error(f"no S3 credentials on this machine for {uri}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                        "(or ARTCLOUD_S3_ACCESS_KEY_ID / ARTCLOUD_S3_SECRET_ACCESS_KEY), or configure an AWS profile",
                        code="no_s3_credentials", field="s3")
        key, secret, token = frozen.access_key, frozen.secret_key, frozen.token
    creds = {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}
    if token:
        creds["AWS_SESSION_TOKEN"] = token
    return creds


def check_s3(uri: str, *, error: type[ArtcloudError]) -> None:
    """The bucket is reachable and writable with these credentials, checked from here before launching."""
    from artcloud.storage.s3 import CheckpointStore, S3Config, StorageError

    try:
        CheckpointStore(S3Config.from_uri(uri)).check()
    except StorageError as e:
        raise error(str(e), code="s3_unusable", field="s3") from e
