#!/usr/bin/env bash
# A whole round on a lent GPU, steps in priority order, each under its own time limit, logs under $OUT:
# build, FlashInfer backend + CUDA-graph tests, dispatch overhead, Triton GPU tests, a few benchmark cases.
#   source .device/prelude.sh && bash benchmarks/final_round.sh
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
python3 -m pip install --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
stamp built
timeout ${FI_TIMEOUT:-170} python3 -m pytest -q -p no:cacheprovider tests/test_flashinfer.py tests/test_graphs.py \
  -k "not fa3" > "$out/tests-flashinfer-graphs.log" 2>&1; tail -4 "$out/tests-flashinfer-graphs.log"; stamp fi+graphs
timeout 40 python3 benchmarks/overhead.py --json "$out/overhead.json" 2>&1 | tail -3; stamp overhead
timeout ${TRITON_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton.py \
  > "$out/tests-triton-gpu.log" 2>&1; tail -6 "$out/tests-triton-gpu.log"; stamp triton-gpu
timeout ${BENCH_TIMEOUT:-120} python3 benchmarks/bench.py --cases decode-small/1x32768 decode-large/128x4096 \
  decode-large/128x4096/nvfp4 decode-large/128x4096/fp8_e4m3-per-tensor decode-ragged/64 verify/32x4096/q4 \
  --backends triton flashinfer --peers fi-decode-tensor-core fi-prefill-fa2 --rep-ms 50 \
  --json "$out/bench-final.json" 2> "$out/bench-final.err" | tee "$out/bench-final.txt" | grep -v unsupported
stamp done
