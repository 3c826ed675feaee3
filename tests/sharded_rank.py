"""One rank of tests/test_sharded.py's runs: `python -m torch.distributed.run --standalone --nproc-per-node N
tests/sharded_rank.py SPEC OUT` trains one step with artcloud's sharded trainer (FSDP2, gloo) on the samples
in SPEC (a pickle the test wrote; none: no step), from a fresh adapter or from SPEC's checkpoint, and saves
it to OUT (rank 0 writes it, with the step's metrics in metrics.json). SPEC may set the trainer's dtype and
checkpointing."""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

from artcloud.server.engines.sharded import ShardedPeftTrainer, join_world

spec = pickle.loads(Path(sys.argv[1]).read_bytes())
out = Path(sys.argv[2])
world = join_world("gloo")
trainer = ShardedPeftTrainer(spec["base_model"], world, dtype=spec.get("dtype", "float32"),
                             checkpointing=spec.get("checkpointing"))
if spec["resume"] is None:
    trainer.create_adapter("agent", spec["lora"])
else:
    trainer.load_adapter("agent", spec["lora"], Path(spec["resume"]), optimizer=True)
metrics = trainer.train_step("agent", spec["samples"], spec["config"], lambda m: None) if spec["samples"] else []
if world.rank == 0:
    out.mkdir(parents=True, exist_ok=True)
trainer.save_adapter("agent", out, optimizer=True)
if world.rank == 0:
    (out / "metrics.json").write_text(json.dumps(metrics))
