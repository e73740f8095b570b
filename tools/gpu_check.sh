#!/usr/bin/env bash
# The GPU check: run on a CUDA machine (an H200) without network access. Installs nothing.
# Expects PyTorch with CUDA and Triton; nvidia-ml-py, flash-attn, transformer-engine and
# bitsandbytes may be absent (the tests that need them skip). The server's packages (FastAPI,
# uvicorn, pydantic) are not needed: only the test files that hold gpu-marked tests are collected.
#
#   OUT=/some/dir bash tools/gpu_check.sh      # results in $OUT, or ./gpu-results when OUT is unset
#
# 1. env.txt: torch / CUDA / device / nvidia-smi / which optional packages are present
# 2. gpu-bench-fp16.md/json: tools/gpu_bench.py, Llama-2-7B shape unquantized (decode, verify(K), draft)
# 3. gpu-kernels.md/json: tools/gpu_kernels.py, copy and matmul ceilings, FP8 / INT8 Linears vs fp16
# 4. gpu-bench-w8a16.md/json, gpu-bench-int8.md/json: tools/gpu_bench.py with INT8 FFNs (W8A16, W8A8)
# 5. gpu-load.md/json: tools/gpu_load.py, Engine.from_pretrained and generate on a 1B-shaped checkpoint
# 6. gpu-w8a16-tune.md/json: tools/gpu_w8a16_tune.py, the Triton W8A16 GEMM's launch configurations vs fp16
# 7. pytest-gpu.txt: python -m pytest -m gpu -q over the files holding gpu-marked tests
# Every step has its own time limit; the whole check takes about 6 minutes (at most ~12 by the limits). Exit status 0 only
# when every step passed.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu-results}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=()

python - > "$OUT/env.txt" 2>&1 <<'PY'
import importlib.util, platform
import torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, "capability", torch.cuda.get_device_capability(0), "memory GiB",
          round(p.total_memory / 2**30, 1), "SMs", p.multi_processor_count)
for m in ("triton", "pynvml", "flash_attn", "transformer_engine", "bitsandbytes", "transformers", "tokenizers",
          "pytest_timeout"):
    print(m, "present" if importlib.util.find_spec(m) else "absent")
PY
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu \
    --format=csv >> "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log, record the exit status
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit} s)"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    status+=("$name: exit $rc in $((SECONDS - t0)) s")
}

step bench-fp16 90 python tools/gpu_bench.py --device cuda --ffn fp16 --ks 1,2,3,4,5,6,7,8 --out "$OUT" --budget-s 55
step kernels 70 python tools/gpu_kernels.py --device cuda --out "$OUT"
step bench-w8a16 60 python tools/gpu_bench.py --device cuda --ffn w8a16 --batches 1,8,32 --ks 1,4,8 --out "$OUT" \
    --budget-s 30
step bench-int8 50 python tools/gpu_bench.py --device cuda --ffn int8 --batches 1,8 --ks 1,4,8 --out "$OUT" \
    --budget-s 20
step load 80 python tools/gpu_load.py --device cuda --out "$OUT" --work "${TMPDIR:-/tmp}"
step w8a16-tune 100 python tools/gpu_w8a16_tune.py --out "$OUT" --rows 1,8,32 --budget-s 70

files=$(grep -l "mark.gpu" tests/test_*.py)
per_test=()
python -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 150)
step pytest-gpu 240 python -m pytest -m gpu -q -p no:cacheprovider -rfE "${per_test[@]}" $files

printf '%s\n' "${status[@]}" | tee "$OUT/status.txt"
! grep -qv "exit 0 " "$OUT/status.txt"
