"""OpenPipe ART's `art.utils.iterate_dataset`: a dataset's batches, one per training step, over epochs."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Generic, Iterator, Sequence, TypeVar

from artcloud.errors import InvalidArgument

T = TypeVar("T")


@dataclass
class DatasetBatch(Generic[T]):
    """One step's items, with where it lies: `step` counts across epochs, `epoch_step` within one.

    Unpacks as ART's older tuple did: `for items, epoch, step, epoch_step in iterate_dataset(...)`."""

    items: list[T]
    step: int
    epoch: int
    epoch_step: int

    def __iter__(self) -> Iterator[Any]:
        return iter((self.items, self.epoch, self.step, self.epoch_step))


def iterate_dataset(dataset: Sequence[T], groups_per_step: int = 1, num_epochs: int = 1, initial_step: int = 0,
                    use_tqdm: bool = True) -> Iterator[DatasetBatch[T]]:
    """Batches of `groups_per_step` items over `num_epochs` epochs, each epoch shuffled the same way on every
    run (seeded with the epoch number, as ART does: ART's scripts resume on the same batches). Steps before
    `initial_step` are skipped, for resuming at `await model.get_step()`. The last batch of an epoch may be
    smaller. A tqdm bar counts the steps (tqdm, not rich: rich allows one live display at a time, and the
    gather and train bars run inside this loop)."""
    if groups_per_step < 1 or num_epochs < 0 or initial_step < 0:
        raise InvalidArgument("iterate_dataset needs groups_per_step >= 1, num_epochs >= 0 and initial_step >= 0")
    size = len(dataset)
    if size == 0:
        return
    steps_per_epoch = math.ceil(size / groups_per_step)
    from tqdm.auto import tqdm

    with tqdm(initial=initial_step, total=steps_per_epoch * num_epochs, desc="Iterating dataset", unit="batch",
              disable=not use_tqdm) as bar:
        for epoch in range(max(0, initial_step // steps_per_epoch), num_epochs):
            indices = list(range(size))
            random.Random(epoch).shuffle(indices)  # ART's order (random.seed(epoch)), global random untouched
            for epoch_step in range(steps_per_epoch):
                step = epoch * steps_per_epoch + epoch_step
                if step < initial_step:
                    continue
                chunk = indices[epoch_step * groups_per_step:(epoch_step + 1) * groups_per_step]
                yield DatasetBatch(items=[dataset[i] for i in chunk], step=step, epoch=epoch, epoch_step=epoch_step)
                bar.update(1)
