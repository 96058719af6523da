#!/usr/bin/env bash
# The checks a lent GPU machine runs in one call (docs/kernels.md, "On a GPU machine without the
# project's environment"): the `gpu` tests under the paths named (default: every file with one),
# then the benchmarks in $BENCHES (default: the drafted-step benchmark). Wheels under .whl/ are
# installed to /tmp/site first when present; logs and the benchmarks' JSON go to $OUT (default
# ./out). The tests that read the whole device's memory run alone first; the rest in
# $WORKERS pytest-xdist processes (default 6: compiling the Triton kernels is most of the time).
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
[ ${#tests[@]} -eq 0 ] && mapfile -t tests < <(grep -rl "mark.gpu" tests --include="test_*.py" | sort)
alone=tests/worker/test_kv_sizing.py  # total - free of the device: no other process may hold any
began=$SECONDS
timeout "${TEST_TIMEOUT:-300}" bash -c '
    python3 -m pytest -q -m gpu -p no:cacheprovider "$0" 2>&1
    python3 -m pytest -q -m gpu -p no:cacheprovider -n "$1" --durations=15 --ignore="$0" "${@:2}" 2>&1
' "$alone" "${WORKERS:-6}" "${tests[@]}" | tee "$OUT/tests.log" | grep -v "^\(PASSED\|SKIPPED\)" | tail -45
echo "tests took $((SECONDS - began)) s"
read -r -a benches <<<"${BENCHES:-draft_step_bench.py}"
for bench in "${benches[@]}"; do
    name=${bench%.py}
    timeout "${BENCH_TIMEOUT:-240}" python3 "benchmarks/$bench" >"$OUT/$name.json" 2>"$OUT/$name.log"
    echo "$bench exit $?"
    tail -40 "$OUT/$name.log"
done
