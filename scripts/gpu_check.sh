#!/usr/bin/env bash
# The GPU checks in one go, on a CUDA machine: `tests/gpu`, then `benchmarks.bench_gpu`
# (specserve's own engine, target-only and with an in-process draft). Each part has its own time limit,
# so a hang in one still leaves the other's results. Logs and the benchmark's table go to OUTDIR.
#
#   bash scripts/gpu_check.sh OUTDIR        # GPU_TESTS_TIMEOUT (300 s) and GPU_BENCH_TIMEOUT (200 s) bound the parts
set -u
out=${1:-gpu_check_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{ nvidia-smi -L; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; } \
    2>&1 | tee "$out/device.txt"
timeout "${GPU_TESTS_TIMEOUT:-300}" python3 -m pytest tests/gpu -m gpu -q -p no:cacheprovider --durations=8 2>&1 | tee "$out/tests_gpu.log"
echo "tests/gpu exit: ${PIPESTATUS[0]}" | tee -a "$out/tests_gpu.log"
timeout "${GPU_BENCH_TIMEOUT:-200}" python3 -m benchmarks.bench_gpu --out "$out/bench" 2>&1 | grep -v "Loading weights\|Writing model" | tee "$out/bench_gpu.log"
echo "bench_gpu exit: ${PIPESTATUS[0]}" | tee -a "$out/bench_gpu.log"
