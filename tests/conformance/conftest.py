"""tests/conformance: the engine pairs (test_engines.py) everywhere; the CUDA-only paths (test_cuda.py:
sleep and wake, offloading, 4-bit, dedicated mode) where torch sees CUDA, i.e. in bench/gpu_check.sh."""

import torch

collect_ignore = [] if torch.cuda.is_available() else ["test_cuda.py"]
