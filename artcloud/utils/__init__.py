"""OpenPipe ART's `art.utils` helpers that training scripts use, under ART's module names: `iterate_dataset`,
`retry`, `limit_concurrency`, and `sft` (supervised fine-tuning from a JSONL file). Only ART's names live here;
artcloud's own code goes in modules named for what they do.
"""

from artcloud.utils.iterate_dataset import DatasetBatch, iterate_dataset
from artcloud.utils.limit_concurrency import limit_concurrency
from artcloud.utils.retry import retry

__all__ = ["DatasetBatch", "iterate_dataset", "limit_concurrency", "retry"]
