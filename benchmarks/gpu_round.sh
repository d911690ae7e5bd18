#!/usr/bin/env bash
# One round on a lent GPU (device tool): build the extension against the GPU's torch, run the GPU tests, run
# benchmark groups. Usage (from the repo root, with .device carried; see ../shared/device/make-bundle):
#   source .device/prelude.sh && bash benchmarks/gpu_round.sh "<pytest args>" "<bench args>" [tag]
# Logs and JSON go to $OUT (or ./gpu-out).
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
tests=${1:-"tests -m gpu"}; bench_args=${2:-""}; tag=${3:-round}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv | tee "$out/gpu.txt"
start=$(date +%s)
if ! python3 -m pip install --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1; then
  echo "build failed (tail below); retrying without csrc/cpu" ; tail -20 "$out/build.log"
  mv csrc/cpu /tmp/cpu-aside && python3 -m pip install --no-build-isolation --no-deps -e . >> "$out/build.log" 2>&1 || exit 1
fi
echo "built in $(( $(date +%s) - start )) s"
python3 -m attnops info 2>&1 | head -12
if [ -n "$tests" ]; then
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -x $tests -p no:cacheprovider 2>&1 | tee "$out/tests-$tag.log" | tail -25
fi
if [ -n "$bench_args" ]; then
  python3 benchmarks/bench.py $bench_args --json "$out/bench-$tag.json" --plot "$out/bench-$tag.png" 2> "$out/bench-$tag.err" | tee "$out/bench-$tag.txt"
  tail -5 "$out/bench-$tag.err"
fi
echo "round done in $(( $(date +%s) - start )) s"
