#!/usr/bin/env bash
# One call on a lent GPU (device tool), as a list of steps run in order, each under its own time limit, logs and
# JSON under $OUT (few files: the device tool brings back only a handful). A lent machine starts bare and each
# call's limit is 10 minutes, so a call does a whole round:
#   source .device/prelude.sh && ATTNOPS_COMMIT=<sha> bash benchmarks/gpu_session.sh build tune overhead tests
# ATTNOPS_COMMIT: the commit being measured, written into the JSON and plots; type in this machine's
# `git rev-parse --short HEAD` (on the lent machine git HEAD is the last landed commit, not the tree it runs).
# Steps:
#   build     the extension against the device's torch (always first)
#   tune      benchmarks/triton_tuning.py on a quiet GPU (TUNE_ARGS, TUNE_BUDGET seconds)
#   compare   benchmarks/triton_tuning.py --compare for each set in $COMPARE (KEY=VALUE..., sets separated by ;):
#             the heuristic against the heuristic with those tunables set, every format and case (COMPARE_ARGS
#             narrows it), no sweep; e.g. COMPARE="V_DEQUANT_FIRST=1;PDL=0"
#   overhead  benchmarks/overhead.py --profile (eager per-call cost of the op against the kernels)
#   breakdown benchmarks/decode_breakdown.py $BREAKDOWN_ARGS (a decode's time by stage: op, attention kernel
#             alone, merge, a plain read of the same bytes, one launch)
#   bench     benchmarks/bench.py $BENCH_ARGS (JSON + PNG), on a quiet GPU
#   tests     the GPU tests, suites in parallel processes (TEST_SUITES, default "triton flashinfer e2e": Triton
#             under pytest-xdist; FlashInfer + graphs + devices; end to end), one log; TESTS_TIMEOUT seconds
#   serve     benchmarks/serve_bench.py $SERVE_ARGS (JSON + PNG)
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
export ATTNOPS_COMMIT=${ATTNOPS_COMMIT:-unknown}
for step in "$@"; do
  case $step in
    build)
      nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv,noheader
      python3 -m pip install --no-build-isolation --no-deps -e . > /tmp/build.log 2>&1 \
        || { grep -E "error|Error" /tmp/build.log | head -30; tail -30 /tmp/build.log; exit 1; }
      python3 -c "from attnops.backends import flashinfer_replay as r; print('C++ FlashInfer replay built:', r.built(), 'usable:', r.enabled())"
      stamp built ;;
    tune)
      timeout $(( ${TUNE_BUDGET:-240} + 60 )) python3 benchmarks/triton_tuning.py --budget ${TUNE_BUDGET:-240} \
        ${TUNE_ARGS:-} --json "$out/tune.json" > "$out/tune.log" 2>&1
      sed -n '/=== best per case/,$p' "$out/tune.log"; stamp tune ;;
    compare)
      IFS=';' read -ra sets <<< "${COMPARE:?set COMPARE=KEY=VALUE... (several A/B runs: separate them with ;)}"
      for i in "${!sets[@]}"; do
        timeout $(( ${TUNE_BUDGET:-240} + 60 )) python3 benchmarks/triton_tuning.py --budget ${TUNE_BUDGET:-240} \
          --compare ${sets[$i]} ${COMPARE_ARGS:-} --json "$out/compare-$i.json" > "$out/compare-$i.log" 2>&1
        echo "== ${sets[$i]}"; grep -E "^  |failed|Error" "$out/compare-$i.log" | tail -40
      done; stamp compare ;;
    overhead)
      timeout ${OVERHEAD_TIMEOUT:-120} python3 benchmarks/overhead.py --profile --json "$out/overhead.json" \
        > "$out/overhead.log" 2>&1; grep -E "^(flashinfer|triton) " "$out/overhead.log"; stamp overhead ;;
    breakdown)
      timeout ${BREAKDOWN_TIMEOUT:-180} python3 benchmarks/decode_breakdown.py ${BREAKDOWN_ARGS:-} \
        --json "$out/breakdown.json" > "$out/breakdown.log" 2>&1; tail -20 "$out/breakdown.log"; stamp breakdown ;;
    bench)
      timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench.py ${BENCH_ARGS:-} --json "$out/bench.json" \
        --plot "$out/bench.png" > "$out/bench.txt" 2> /tmp/bench.err; tail -3 /tmp/bench.err
      grep -v unsupported "$out/bench.txt" | cut -c1-150 | tail -60; stamp bench ;;
    tests)
      limit=${TESTS_TIMEOUT:-240}
      suites=${TEST_SUITES:-triton flashinfer e2e}
      for suite in $suites; do
        case $suite in
          triton) files="-m gpu -n 8 tests/test_triton.py" ;;
          flashinfer) files="tests/test_flashinfer.py tests/test_graphs.py tests/test_devices.py" ;;
          e2e) files="-m gpu tests/test_e2e.py" ;;
        esac
        timeout $limit python3 -m pytest -q -rA -p no:cacheprovider $files > "/tmp/tests-$suite.log" 2>&1 &
      done
      wait
      for suite in $suites; do echo "===== $suite"; cat "/tmp/tests-$suite.log"; done > "$out/tests.log"
      for suite in $suites; do echo "== $suite"; grep -E "passed|failed|error|FAILED|ERROR" \
        "/tmp/tests-$suite.log" | grep -v "^PASSED" | tail -8; done; stamp tests ;;
    serve)
      timeout ${SERVE_TIMEOUT:-400} python3 benchmarks/serve_bench.py ${SERVE_ARGS:-} --json "$out/serve.json" \
        --append --plot "$out/serve.png" >> "$out/serve.txt" 2> /tmp/serve.err; tail -30 "$out/serve.txt"
      tail -3 /tmp/serve.err; stamp serve ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
