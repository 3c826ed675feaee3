"""Where a base model's weights come from on this server (cold start).

With an S3 location (--s3 / ARTCLOUD_S3), a model staged there (artcloud/storage/weights.py) is pulled,
verified, into the local cache and loaded from that folder; otherwise it loads as before (loading.py:
artcloud's own models, a local folder, or the hub). A model that came from the Hugging Face hub is then
staged to S3 in a background thread, so the next sandbox pulls it from the user's bucket: registration
does not wait for that upload, and one model is never staged twice at once.

`resolve_weights` is the seam: the server's start-up phases call it with a `progress(done, total)` to
say "fetching weights N/M GB".
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from artcloud.server.engines import loading
from artcloud.storage.s3 import S3Config, StorageError
from artcloud.storage.weights import (
    MODEL_ID,
    CorruptWeights,
    Progress,
    WeightsStore,
    local_snapshot,
)

log = logging.getLogger("artcloud.server")

REVISION = "main"  # a register request names a model, not a revision: the hub's default branch
_staging: set[tuple[str, str]] = set()  # (S3 location, model) being staged by this process
_staging_lock = threading.Lock()


def staged_dir(base_model: str, revision: str = REVISION) -> Path:
    """The local folder a model pulled from S3 lives in."""
    return loading.cache_dir() / "s3" / base_model.replace("/", "--") / revision


def is_hub_id(base_model: str) -> bool:
    """A name that means a hub repository (what S3 may hold), not a local folder."""
    return bool(MODEL_ID.fullmatch(base_model)) and ".." not in base_model and "--" not in base_model \
        and not Path(base_model).expanduser().is_dir()


def resolve_weights(base_model: str, s3: S3Config | None, progress: Progress | None = None,
                    revision: str = REVISION) -> Path | str:
    """The folder the engine loads `base_model` from, pulled from `s3` when staged there (and handed to
    loading.provide, so every loader of the engine finds it under the model's own name); else
    `base_model` itself, which loads as before. A corrupt staged copy raises CorruptWeights (never
    loaded); S3 failing otherwise (unreachable after retries) falls back to the usual source, loudly."""
    if s3 is None or base_model in loading.BUILT_IN or not is_hub_id(base_model):
        return base_model  # artcloud's own models are built here, never staged: no S3 round trip for them
    store = WeightsStore(s3)
    try:
        manifest = store.manifest(base_model, revision)
        if manifest is None:
            return base_model
        folder = store.pull(base_model, staged_dir(base_model, revision), revision, progress, manifest).folder
    except CorruptWeights:
        raise
    except StorageError as e:
        log.warning("cannot pull %s from %s (%s): loading it the usual way instead", base_model, s3.uri, e)
        return base_model
    loading.provide(base_model, folder)
    return folder


class BaseWeights:
    """A server's weights policy: pull from its S3 location, stage hub downloads back to it."""

    def __init__(self, s3: S3Config):
        self.s3 = s3
        self.progress: Progress | None = None  # set by whoever shows start-up progress (/health)

    def fetch(self, base_model: str) -> Path | str:
        """resolve_weights, with progress to `self.progress` and to the log (every 10 s)."""
        last = [0.0]

        def report(done: int, total: int) -> None:
            if self.progress is not None:
                self.progress(done, total)
            now = time.monotonic()
            if now - last[0] >= 10 or done == total:
                last[0] = now
                log.info("fetching weights of %s: %.2f/%.2f GB", base_model, done / 1e9, total / 1e9)

        return resolve_weights(base_model, self.s3, report)

    def stage_later(self, base_model: str, loaded_from: Path | str) -> threading.Thread | None:
        """After a load from the hub (not from S3, not artcloud's own models), stage the Hugging Face
        cache's snapshot to S3 on a background thread; None if there is nothing to do."""
        if isinstance(loaded_from, Path) or base_model in loading.BUILT_IN or not is_hub_id(base_model):
            return None
        key = (self.s3.uri, base_model)
        with _staging_lock:
            if key in _staging:
                return None
            _staging.add(key)

        def run() -> None:
            try:
                folder = local_snapshot(base_model, REVISION)
                if folder is None:
                    log.info("%s is not in the Hugging Face cache: not staging it to %s", base_model, self.s3.uri)
                    return
                store = WeightsStore(self.s3, workers=4)  # in the background: leave bandwidth to the rest
                if store.manifest(base_model, REVISION) is None:  # another server may have staged it meanwhile
                    store.stage(base_model, folder, REVISION)
            except Exception as e:  # a background convenience: the server carries on without it
                log.warning("staging %s to %s failed: %s", base_model, self.s3.uri, e)
            finally:
                with _staging_lock:
                    _staging.discard(key)

        thread = threading.Thread(target=run, name="artcloud-stage-weights", daemon=True)
        thread.start()
        return thread
