"""The ranks of tests/test_sharded.py's runs: `python -m artcloud.server.engines.local_group N FOLDER -- python
tests/sharded_rank.py SPEC` (as the server starts its ranks) does each run in SPEC (a pickle the test wrote: a list
of runs) in turn, in one group of ranks (torch, gloo and the model start once): one step with artcloud's sharded
trainer (FSDP2, gloo) on the run's samples (none: no step), from a fresh adapter or from the run's checkpoint, saved
to the run's `out` (rank 0 writes it, with the step's metrics in metrics.json). A run may set the trainer's dtype
and checkpointing."""

from __future__ import annotations

import gc
import json
import pickle
import sys
from pathlib import Path

from artcloud.server.engines.sharded import ShardedPeftTrainer, join_world

world = join_world("gloo")
for run in pickle.loads(Path(sys.argv[1]).read_bytes()):
    out = Path(run["out"])
    trainer = ShardedPeftTrainer(run["base_model"], world, dtype=run.get("dtype", "float32"),
                                 checkpointing=run.get("checkpointing"))
    if run["resume"] is None:
        trainer.create_adapter("agent", run["lora"])
    else:
        trainer.load_adapter("agent", run["lora"], Path(run["resume"]), optimizer=True)
    metrics = trainer.train_step("agent", run["samples"], run["config"], lambda m: None) if run["samples"] else []
    if world.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    trainer.save_adapter("agent", out, optimizer=True)
    if world.rank == 0:
        (out / "metrics.json").write_text(json.dumps(metrics))
    del trainer
    gc.collect()
