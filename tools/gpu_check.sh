#!/usr/bin/env bash
# The GPU check: run on a CUDA machine (an H200) without network access. Installs nothing.
# Expects PyTorch with CUDA, Triton and nvidia-ml-py; flash-attn, transformer-engine and
# bitsandbytes may be absent (the tests that need them skip).
#
#   OUT=/some/dir bash tools/gpu_check.sh      # results in $OUT, or ./gpu-results when OUT is unset
#
# 1. env.txt: torch / CUDA / device / which optional packages are present
# 2. pytest-gpu.txt: python -m pytest -m gpu -q (capped at 240 s)
# 3. gpu-bench.md / gpu-bench.json: tools/gpu_bench.py (measurements stop starting after 150 s)
# Finishes within ~6 minutes. Exit status 0 only when both the tests and the bench passed.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu-results}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

python - > "$OUT/env.txt" 2>&1 <<'PY'
import importlib.util
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
for m in ("triton", "pynvml", "flash_attn", "transformer_engine", "bitsandbytes", "transformers", "tokenizers"):
    print(m, "present" if importlib.util.find_spec(m) else "absent")
PY
cat "$OUT/env.txt"

timeout 240 python -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors tests \
    2>&1 | tee "$OUT/pytest-gpu.txt"
test_rc=${PIPESTATUS[0]}

timeout 210 python tools/gpu_bench.py --device cuda --out "$OUT" --budget-s 150 2>&1 | tee "$OUT/gpu-bench.log"
bench_rc=${PIPESTATUS[0]}

echo "pytest -m gpu: exit $test_rc; gpu_bench: exit $bench_rc; results in $OUT"
[ "$test_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
