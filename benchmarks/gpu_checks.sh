#!/usr/bin/env bash
# The checks a lent GPU machine runs in one call (docs/kernels.md, "On a GPU machine without the
# project's environment"): the `gpu` tests named below (default: the KV copies and the engine on
# CUDA), then the copy-stream benchmark. Wheels under .whl/ are installed to /tmp/site first when
# present; logs and the benchmark's JSON go to $OUT (default ./out).
# Run: bash benchmarks/gpu_checks.sh [pytest paths...]
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
tests=("$@")
[ ${#tests[@]} -eq 0 ] && tests=(tests/worker/test_kv_copies.py tests/worker/test_engine_equivalence.py)
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider "${tests[@]}" \
    2>&1 | tee "$OUT/tests.log" | tail -25
timeout "${BENCH_TIMEOUT:-240}" python3 benchmarks/copy_stream_bench.py --repeats "${REPEATS:-5}" \
    >"$OUT/copy_stream.json" 2>"$OUT/copy_stream.log"
echo "copy_stream_bench exit $?"
tail -30 "$OUT/copy_stream.log"
