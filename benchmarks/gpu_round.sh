#!/usr/bin/env bash
# A round of GPU work on a CUDA machine, as a list of steps run in order, each under its own time limit; logs and
# JSON go to the directory $ATTNOPS_OUT (default gpu-out/), a few files in all:
#   ATTNOPS_OUT=results ATTNOPS_COMMIT=<sha> bash benchmarks/gpu_round.sh build jit tests models
# ATTNOPS_COMMIT: the commit being measured, written into the JSON and plots (where the tree has no git history).
# Steps:
#   build     the extension against the device's torch (always first)
#   tune      benchmarks/triton_tuning.py on a quiet GPU (TUNE_ARGS, TUNE_BUDGET seconds)
#   compare   benchmarks/triton_tuning.py --compare for each set in $COMPARE (KEY=VALUE..., sets separated by ;):
#             the heuristic against the heuristic with those tunables set, every format and case (COMPARE_ARGS
#             narrows it), no sweep; e.g. COMPARE="V_DEQUANT_FIRST=1;PDL=0"; COMPARE_ARGS keeps shell quotes, e.g.
#             COMPARE_ARGS="--rounds 5 --extend-cases 'verify16 32x4096' 'tree16 32x4096'"
#   fill-waves the split plan that fills two waves where one would overrun (FILL_WAVES): its GPU test, then the
#             former plan (FILL_WAVES=0) as A against FILL_WAVES=1 as B at each head shape of FILL_SHAPES (default
#             "32/8/128 32/8/96 32/4/128 16/2/128"), bf16 and fp8, cases FILL_CASES, and the models grid's 32 x 8192
#             and ragged batches both ways (FILL_ROUNDS rounds alternating): $results/fill-waves.txt
#   cuda-prefill the cuda backend's prefill over bf16/fp16 caches (off by default: ATTNOPS_CUDA_PREFILL=1): its GPU
#             tests, then the bench grid's prefill cases (bf16) on it, Triton and FlashInfer's FA3 where installed
#             (CUDA_PREFILL_ARGS adds bench options): $results/cuda-prefill.{json,txt}, cuda-prefill-tests.log
#   tiles-256 Triton's decode tile of 256 columns with a 16-bit cache (64 keys in 8 warps) against the former one
#             (32 keys in 4 warps) as B, same run, at each head shape of TILES_256_SHAPES (default "16/8/256 8/4/256
#             16/8/192 16/8/160"), bf16; the 64-row query tiles (prefill, chunked extend, 16-token verify) in 4
#             warps against 8 as B at TILES_256_QUERY_SHAPES (default "16/8/256 32/8/256"); verify of 4 and 8
#             tokens at 16/8/256 against 64 keys in 3 stages as B; then the GPU tests of these tiles:
#             $results/tiles-256.txt, tiles-256-tests.log
#   prefill-tiles Triton's prefill and chunked-extend tiles swept (benchmarks/triton_tuning.py's stage 3: BLOCK_Q,
#             BLOCK_N, num_warps, num_stages, each checked against the reference, beside the heuristic's) at each head
#             shape of PREFILL_SHAPES (default "32/8/64 32/8/128 32/8/96 16/8/256"), bf16, then the heuristic's tile
#             with FULL_TILES=1 OFFSETS_32=1 as B: $results/prefill-tiles.txt
#   overhead  benchmarks/overhead.py --profile (eager per-call cost of the op against the kernels)
#   breakdown benchmarks/decode_breakdown.py $BREAKDOWN_ARGS (a decode's time by stage: op, attention kernel
#             alone, merge, plain reads of the same bytes: through the block table as the decode reads them, and
#             contiguous; one launch). BREAKDOWN_ARGS="--backend cuda --formats nvfp4 mxfp4 fp8_e4m3 ..." for the
#             cuda backend's decode
#   splits    benchmarks/cuda_splits.py $SPLITS_ARGS (the cuda backend's decode at every split count beside its
#             plan's: $results/cuda-splits.json)
#   triton-splits Triton's decode at every CHUNK (benchmarks/triton_tuning.py's stage 2, the heuristic's tile),
#             uniform and ragged batches, bf16 and fp8, at each head shape of TRITON_SPLITS_SHAPES (default
#             "32/8/128"; head dims up to 128, whose tile is 128 keys): $results/triton-splits-HQ-HKV-D.{json,log},
#             each case's best CHUNK beside the heuristic's
#   wave-plan Triton's decode with the split size chosen on the device from the call's lengths (WAVE_PLAN=n: one
#             wave of n programs an SM) against the shapes' plan: the GPU tests with it forced (a user's graph
#             replaying new lengths, the plan against the reference), then triton_tuning.py --compare for each n
#             of WAVE_PLANS (default "3 2"), uniform and ragged batches (one long sequence among short ones),
#             bf16 and fp8, at each head shape of WAVE_SHAPES (default "32/8/128 32/4/128"):
#             $results/wave-plan-N-HQ-HKV-D.{json,log}, wave-plan.txt (each case's time with the plan over without)
#   bench     python -m attnops bench $BENCH_ARGS (JSON + PNG), on a quiet GPU
#   jit       FlashInfer's kernels for every head dim (64, 128, 256) x KV type (bf16, fp8) of the models grid,
#             JIT-built in parallel processes (`python -m attnops warmup` with FlashInfer pinned); jit-start ...
#             jit-wait: the same in the background while the steps between them run (Triton-only ones)
#   autocheck auto dispatch against every backend, same run: the models grid's two-backend cases and the unseen
#             grid (head shapes and batches the rule was not fitted to): $results/autocheck.json, $results/unseen.json
#   ab        an A/B of the Triton kernels of two source trees in one run: builds the tree in $AB_OLD in place and
#             runs each tree's benchmark on $AB_ARGS (Triton only; the A tree's must be benchmarks/bench.py, as
#             before attnops.bench): $results/ab-old.json, $results/ab-new.json
#   ab-cuda   an A/B of the CUDA kernels across source trees in one run: each tree in $AB_TREES (e.g. made by
#             `git archive <rev> | tar -x -C DIR`) built in place, in parallel, then each timed on the fp4 grid in
#             turn, $AB_ROUNDS rounds (default 2) alternating the trees, this tree's package (if installed: no need
#             to build it first) uninstalled meanwhile (an editable install would win over the tree's own) and
#             reinstalled after; AB_GRID picks another grid (e.g. models, with AB_ARGS="--formats fp8_e4m3"),
#             AB_ARGS narrows it (e.g. --cases 32-8-64);
#             $results/ab-cuda-<tree>-<round>.json and a table of each case's best time per tree
#   tests     the GPU tests, suites in parallel processes (TEST_SUITES, default "capture triton flashinfer e2e":
#             captures of the op; Triton under pytest-xdist; FlashInfer + graphs + devices; end to end; also "spec"
#             (sinks, trees, merge, page sharing, cascade, LSE), "hf" (transformers models), "cuda" (the 4-bit
#             CUDA kernels and the 16-bit prefill one), "mla" (latent attention: the ops and DeepSeek through
#             attnops.hf) and "modes" (batch-invariant mode, merge, every head dim)), one log;
#             TESTS_TIMEOUT seconds.
#             Run at most four at once: more overload a 16-core machine with compiles
#   models    python -m attnops tune on the models grid (MODELS_ARGS narrows it), writing the table to
#             $results/sm_XY.json and the records to $results/models.json
#   mla-models latent attention's cases of the models grid (DeepSeek-V3's shards of 8-128 heads, bf16 and fp8) for
#             flashinfer, cuda (fp8 too) and triton, the fi-mla peer and auto: $results/mla-models.json; then the
#             table refitted from the shipped table's own sources and those records: $results/sm_XY.json (both
#             rules), and its checks
#   serve     python -m attnops serve-bench $SERVE_ARGS (JSON + PNG)
#   serve-mla serve-bench's latent-attention point: DeepSeek-V2-Lite-shaped (random) at 8K x 32, attnops compiled + CUDA
#             graphs on a bf16 and an fp8 latent cache against transformers' static cache compiled:
#             $results/serve-mla.{json,png,txt}
#   serve-hf  serve-bench's transformers grid, in five parts under their own time limits, appended to
#             $results/serve-hf.json (+ .png): Llama-3.2-1B-shaped through transformers' modeling code in bf16,
#             and transformers' static-cache path; the same with fp8 KV; Qwen2.5-7B-shaped
#             with bf16 and fp8 KV; its transformers path; transformers' continuous batching on both. Contexts
#             1K/8K x batches 1/32/128 each, each point
#             with --profile's breakdown of its step by kind of kernel. SERVE_HF_PARTS picks parts (e.g. "3 4"),
#             each up to SERVE_TIMEOUT seconds (540)
#   cascade   benchmarks/cascade.py (64 x (32K shared + 1K own), bf16 and fp8) and its --sweep in bf16:
#             $results/cascade.{json,png,txt}, $results/cascade-sweep.{json,txt}
#   demo      python -m attnops demo $DEMO_ARGS, as a newcomer runs it: $results/demo.txt
#   fuzz-warm each fuzz backend's first chunk in one process, so that the fuzz step's workers find every kernel
#             compiled (after `jit`)
#   head-dims head dims between powers of two (80, 96, 160, 192) and 512 in Triton's padded tiles:
#             tests/test_head_dims.py's GPU tests ($results/head-dims-tests.log), then
#             `bench --grid head-dims` (decode 32 x 8192 and 128 x 4096, 32/8 heads, bf16 and fp8, beside 128 and 256):
#             $results/head-dims.{json,txt}
#   mla       benchmarks/mla_decode.py $MLA_ARGS (latent-attention decode against FlashInfer's MLA wrapper where
#             FlashInfer is installed, and the ceiling): $results/$MLA_NAME.json, .txt (MLA_NAME default mla).
#             MLA_ARGS="--sweep" times Triton's tiles and splits per case (what mla_plan is fitted to);
#             MLA_ARGS="--backend flashinfer" the op through FlashInfer's MLA backend (eager: a step's plan reused)
#   cuda-mla  the CUDA backend's sm_90a latent-attention decode (bf16 and fp8 caches): the GPU tests
#             of tests/test_cuda_mla.py ($results/cuda-mla-tests.log), then benchmarks/mla_decode.py pinned to it
#             at CUDA_MLA_HEADS heads (default 16 64 128), bf16 against FlashInfer's MLA wrapper where installed,
#             and fp8: $results/cuda-mla-{bf16,fp8_e4m3}.{json,txt}
#   cuda-mla-variants the cuda backend's latent-attention kernel in each form (ATTNOPS_CUDA_MLA_VARIANT: cp.async,
#             tma: whole tiles copied by the tensor memory accelerator, keys: at most 16 heads, the keys as the
#             MMAs' M; the regs form has its own step, cuda-mla-regs), same run: benchmarks/cuda_mla_stages.py with
#             each, then mla_decode.py (bf16, CUDA_MLA_HEADS; fp8 at 16 heads for cp.async and keys) alternating,
#             two rounds: $results/cuda-mla-{variant}-{1,2}.json, cuda-mla-variants.txt (each case's best, the
#             speedups). Their GPU tests are the cuda-mla step's
#   cuda-mla-verify the cuda backend's latent-attention verify (each query row its own block): its GPU tests, then
#             the mla grid's verify cases against Triton, FlashInfer through the op and FlashInfer's MLA wrapper,
#             same run: $results/cuda-mla-verify.{json,txt}
#   cuda-mla-merge the cuda latent-attention splits' merge by warps (ATTNOPS_CUDA_MLA_MERGE=warps: a row's loads in
#             flight together) against the default: its GPU tests, then mla_decode.py with each at MERGE_HEADS heads
#             (16 128), bf16 and fp8, alternating, two rounds: $results/cuda-mla-merge-{merge}-{format}-{1,2}.json,
#             cuda-mla-merge.txt (per case, warps' time over columns')
#   cuda-mla-regs the cuda backend's latent-attention regs form (fp8 at up to 16 heads, the cache's bytes widened in
#             registers: ATTNOPS_CUDA_MLA_VARIANT=regs): its GPU tests, then mla_decode.py at REGS_HEADS (16 8) heads
#             with it, with the keys form on fp8 and with the tma form on bf16, alternating, two rounds:
#             $results/cuda-mla-regs-{tma,keys,regs}-{1,2}.json, cuda-mla-regs.txt (each case's best per form;
#             regs' speedup over keys, and bf16's time over regs': the fp8 bar is 1.7)
#   cuda-mla-ds DeepSeek's fp8 latent layout in the cuda backend (its keys form at up to 16 heads where its splits are
#             long, the cp.async form elsewhere): its GPU tests (tests/test_cuda_mla.py -k deepseeks_layout: each
#             form), then mla_decode.py at DS_HEADS (16 128) beside the cuda backend's bf16 and fp8 e4m3 (keys where
#             it serves) and Triton over the same layout, alternating, DS_ROUNDS rounds (2), pages of DS_PAGE rows
#             (64): $results/cuda-mla-ds-{cuda-ds,cuda-bf16,cuda-fp8,triton-ds}-{round}.json,
#             cuda-mla-ds.txt (each case's best per kernel; bf16's time over the layout's, Triton's over cuda's)
#   cuda-mla-pack verify's tokens packed into the cuda latent-attention kernel's rows (the default; tokens x heads
#             fill a block's 64 rows at up to 32 heads; ATTNOPS_CUDA_MLA_PACK_VERIFY=0 turns it off): its GPU tests
#             and the kernel's verify tests,
#             the cuda latent-attention invariance test, then the mla grid's verify cases with it off and on
#             alternating, two rounds, beside FlashInfer's MLA wrapper: $results/cuda-mla-pack-{0,1}-{1,2}.json,
#             cuda-mla-pack.txt (per case, packed time over one token a block, geometric mean)
#   invariance the cost of batch-invariant mode (ATTNOPS_BATCH_INVARIANT=1) on the bench grid's Triton cases, same
#             run, two rounds alternating: $results/invariance-{0,1}-{1,2}.json, invariance.txt (per case and the
#             geometric mean; INVARIANCE_ARGS narrows the grid, e.g. "--groups decode-large verify";
#             INVARIANCE_BACKEND=cuda INVARIANCE_ARGS="--grid fp4" for the CUDA kernels; INVARIANCE_ROUNDS: 2;
#             INVARIANCE_CHUNKS="1024 4096": Triton's split size in the mode, each: invariance-{chunk}-{round}.json)
#   verify-tile Triton's verify of 4 and 8 tokens x a group of 4 (bf16) in the padded 64-row tile, the default: its GPU
#             test, then a same-run A/B at 32 x 4096 against each one's former tile and split plan as B (so "B is x"
#             below 1 means the padded tile is faster): $results/verify-tile-{4,8}.log; and fp8 e4m3, which keeps
#             its tiles, against the padded one as B ("B is x" above 1: the padded tile faster): verify-tile-fp8.log;
#             the same for 4 long sequences (8 tokens, 4 x 16384), which keep the former tile: verify-tile-few.log
#   invariance-mla the mode's cost on the cuda latent-attention kernel (the mla grid) at each split size of
#             MLA_CHUNKS (ATTNOPS_CUDA_MLA_INVARIANT_CHUNK; default 512 1024 2048) against the default mode, same run:
#             $results/invariance-mla-{0,chunk}-{round}.json, invariance-mla.txt (INVARIANCE_ROUNDS: 1)
#   cuda-skip-empty the cuda 4-bit kernels with a split past its sequence's end skipped (only its partials' LSE
#             marked empty; the merge reads no partial of weight 0: ATTNOPS_CUDA_SKIP_EMPTY_SPLITS=1) against not:
#             tests/test_cuda_backend.py's GPU tests, then the fp4 grid with each, in the default mode and in
#             batch-invariant mode, alternating, SKIP_EMPTY_ROUNDS rounds (2): $results/cuda-skip-empty-*.json,
#             cuda-skip-empty.txt (each mode's A/B, and the mode's cost with them skipped)
#   head-parts Triton's head dims between powers of two in two tiles (the power of two below, then the rest:
#             ATTNOPS_TRITON_TUNABLES=HEAD_PARTS=1) against one padded tile: tests/test_head_dims.py's GPU tests (both
#             ways), then the head-dims grid with each, alternating, HEAD_PARTS_ROUNDS rounds (2), same run:
#             $results/head-parts-{0,1}-{round}.json, head-parts.txt (per case, two tiles' time over the padded tile's)
#   pad-wrap  the same for PAD_WRAP (a padded tile's columns past the head dim read as copies of its first ones, not
#             masked: no column predicates in the loop, bf16 at 80 and 96 in 128's registers): $results/pad-wrap-*.json,
#             pad-wrap.txt (per case, wrapped time over masked)
#   fp4       python -m attnops bench --grid fp4 (4-bit decode and verify against FlashInfer's bf16, same run):
#             $results/fp4.{json,png,txt}
#   fp8       the fp8 bar (docs/bench.md): the models grid's fp8 e4m3 decode at 32 x 8192 and 128 x 4096 on every head shape
#             (per tensor and per head), every backend that serves it (FP8_BACKENDS, default cuda triton flashinfer;
#             after `jit` for FlashInfer's), one run: $results/fp8.{json,png,txt}
#   fuzz      tests/test_fuzz.py's GPU part: $FUZZ_CASES (default 1000) seeded cases each for triton, flashinfer,
#             auto dispatch and the cuda backend (FUZZ_K: a pytest -k expression), random corruptions included (after `jit` and `fuzz-warm`, so that FlashInfer's and
#             Triton's kernels are built); pytest-xdist over FUZZ_WORKERS processes; $results/fuzz.log. FUZZ_SEED
#             picks another seed
#   sanitize  the same under compute-sanitizer --tool memcheck, $SANITIZE_CASES (default 20) cases per backend, each
#             tensor its own cudaMalloc (no guard buffers, no caching allocator), so a stray access is one past an
#             allocation: $results/sanitize.log, whose last lines give memcheck's error count; SANITIZE_K: a pytest
#             -k expression (e.g. "triton")
#   A/B of the index bounds (docs/design.md, "Bad indices"): the compare step with COMPARE="BOUNDS=0"
#             COMPARE_ARGS="--no-extend --rounds 5" (the bench grid's decode cases, every format) for Triton;
#             benchmarks/cuda_bounds_ab.sh for the CUDA kernels
set -uo pipefail
results=${ATTNOPS_OUT:-gpu-out}; mkdir -p "$results"; results=$(cd "$results" && pwd)  # (steps that cd elsewhere)
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
# A same-run A/B: `python -m attnops bench ARGS` once per setting a round, the settings alternating, ROUNDS rounds,
# each run under LIMIT seconds. A setting is TAG:VAR=VALUE[,VAR=VALUE...] (the environment of its runs); its runs
# go to $results/NAME-TAG-ROUND.json, and the last line each prints is shown.
#   bench_settings NAME ROUNDS LIMIT "SETTING ..." ARGS...
bench_settings() {
  local name=$1 rounds=$2 limit=$3 settings=$4 round setting tag vars; shift 4
  for round in $(seq 1 "$rounds"); do for setting in $settings; do
    tag=${setting%%:*} vars=${setting#*:}
    env ${vars//,/ } timeout "$limit" python3 -m attnops bench "$@" \
      --json "$results/$name-$tag-$round.json" > "/tmp/$name-$tag-$round.txt" 2>&1
    tail -1 "/tmp/$name-$tag-$round.txt"
  done; done
}
# the fuzz steps' cases and seed; one CPU thread a process: the workers' float64 references on the CPU would
# otherwise each start a thread per core and contend
fuzz_env() { export ATTNOPS_FUZZ_CASES=${FUZZ_CASES:-1000} ATTNOPS_FUZZ_SEED=${FUZZ_SEED:-20} OMP_NUM_THREADS=1; }
export ATTNOPS_COMMIT=${ATTNOPS_COMMIT:-unknown}
for step in "$@"; do
  case $step in
    build)
      nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv,noheader
      python3 -m pip install --no-build-isolation --no-deps -e . > /tmp/build.log 2>&1 \
        || { grep -E "error|Error" /tmp/build.log | head -30; tail -30 /tmp/build.log; exit 1; }
      python3 -c "from attnops.backends import flashinfer_replay as r; print('C++ FlashInfer replay built:', r.built(), 'usable:', r.enabled())"
      python3 -c "from attnops.backends import cuda_mla; print('sm_90a MLA kernel runs:', cuda_mla.sm90a_built(0))"
      stamp built ;;
    tune)
      timeout $(( ${TUNE_BUDGET:-240} + 60 )) python3 benchmarks/triton_tuning.py --budget ${TUNE_BUDGET:-240} \
        ${TUNE_ARGS:-} --json "$results/tune.json" > "$results/tune.log" 2>&1
      sed -n '/=== best per case/,$p' "$results/tune.log"; stamp tune ;;
    compare)
      IFS=';' read -ra sets <<< "${COMPARE:?set COMPARE=KEY=VALUE... (several A/B runs: separate them with ;)}"
      eval "compare_args=(${COMPARE_ARGS:-})"  # (quotes kept: --extend-cases "verify16 32x4096")
      for i in "${!sets[@]}"; do
        timeout $(( ${TUNE_BUDGET:-240} + 60 )) python3 benchmarks/triton_tuning.py --budget ${TUNE_BUDGET:-240} \
          --compare ${sets[$i]} "${compare_args[@]}" --json "$results/compare-$i.json" > "$results/compare-$i.log" 2>&1
        echo "== ${sets[$i]}"; grep -E "^  |failed|Error" "$results/compare-$i.log" | tail -40
      done; stamp compare ;;
    fill-waves)
      # FILL_WAVES (heuristics.fill_waves): its GPU test, then the heuristic with it off as A against it on as B
      # (forced either way, wherever the default takes it), same run, at each head shape of FILL_SHAPES, bf16 and
      # fp8, on batches it changes and on ragged ones of the same table
      timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -m gpu tests/test_triton.py \
        -k "fill_waves or capture_and_replay" > "$results/fill-waves-tests.log" 2>&1
      tail -1 "$results/fill-waves-tests.log"
      for shape in ${FILL_SHAPES:-32/8/128 32/8/96 32/4/128 16/2/128}; do
        echo "== $shape"; ATTNOPS_TRITON_TUNABLES=FILL_WAVES=0 timeout 200 python3 benchmarks/triton_tuning.py \
          --shape ${shape//\// } --budget 150 \
          --formats bf16 fp8_e4m3 --rounds 3 --no-extend --cases ${FILL_CASES:-32x8192 ragged32x8k 31x512+8192 \
          64x8192 16x65536 128x4096} --compare FILL_WAVES=1 2>&1 | grep -E "^  |failed|Error"
      done | tee "$results/fill-waves.txt"
      # the models grid's batches it changes (32 x 8192 at 8 KV heads) and a ragged one, each setting alternating
      bench_settings fill-waves ${FILL_ROUNDS:-2} ${BENCH_TIMEOUT:-150} \
        "0:ATTNOPS_TRITON_TUNABLES=FILL_WAVES=0 1:ATTNOPS_TRITON_TUNABLES=FILL_WAVES=1" --grid models \
        --backends triton \
        --graph-only --rep-ms ${REP_MS:-20} --cases "*/bf16/32x8192" "*/per_tensor/32x8192" "*/bf16/ragged64" \
        "*/per_tensor/ragged64"
      python3 benchmarks/invariance_cost.py --labels shapes-plan fill-waves "$results"/fill-waves-0-*.json -- \
        "$results"/fill-waves-1-*.json | tee -a "$results/fill-waves.txt"; stamp fill-waves ;;
    cuda-prefill)
      # the cuda backend's prefill over 16-bit caches (csrc/cuda/prefill_sm90.cu; off by default,
      # ATTNOPS_CUDA_PREFILL=1): its GPU tests, then the bench grid's prefill cases on it, Triton and FlashInfer's FA3
      # (where installed), same run, CUDA-graph replay: $results/cuda-prefill.{json,txt}, cuda-prefill-tests.log
      ATTNOPS_CUDA_PREFILL=1 timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -m gpu tests/test_cuda_prefill.py \
        > "$results/cuda-prefill-tests.log" 2>&1; tail -3 "$results/cuda-prefill-tests.log"
      ATTNOPS_CUDA_PREFILL=1 timeout ${BENCH_TIMEOUT:-300} python3 -m attnops bench --groups prefill --formats bf16 \
        --backends cuda triton --graph-only ${CUDA_PREFILL_ARGS:-} --json "$results/cuda-prefill.json" \
        > "$results/cuda-prefill.txt" 2>&1; grep -vE "^\s*$" "$results/cuda-prefill.txt" | tail -12
      stamp cuda-prefill ;;
    tiles-256)
      for shape in ${TILES_256_SHAPES:-16/8/256 8/4/256 16/8/192 16/8/160}; do
        echo "== $shape: the 64-key tile as A, the former 32-key tile as B"
        timeout 200 python3 benchmarks/triton_tuning.py --shape ${shape//\// } --budget 150 --formats bf16 \
          --rounds 3 --no-extend --cases ${TILES_256_CASES:-1x32768 4x8192 32x4096 64x2048 32x8192 128x4096 \
          ragged64} --compare BLOCK_N=32 num_warps=4 2>&1 | grep -E "^  |failed|Error"
      done | tee "$results/tiles-256.txt"
      for shape in ${TILES_256_QUERY_SHAPES:-16/8/256 32/8/256}; do
        echo "== $shape: 64-row tiles in 4 warps as A, in 8 as B (16 tokens x a group of 2: 32 rows, unchanged)"
        timeout 250 python3 benchmarks/triton_tuning.py --shape ${shape//\// } --budget 200 --formats --rounds 3 \
          --extend-cases "prefill 8x4096" "chunked 2048 on 46000" "verify16 32x4096" --compare num_warps=8 2>&1 \
          | grep -E "^  |failed|Error"
      done | tee -a "$results/tiles-256.txt"
      echo "== 16/8/256: verify of 4 and 8 tokens, the heuristic's tile as A, 64 keys in 3 stages as B" \
        | tee -a "$results/tiles-256.txt"
      timeout 200 python3 benchmarks/triton_tuning.py --shape 16 8 256 --budget 150 --formats --rounds 3 \
        --extend-cases "verify4 32x4096" "verify8 32x4096" --compare BLOCK_N=64 num_stages=3 2>&1 \
        | grep -E "^  |failed|Error" | tee -a "$results/tiles-256.txt"
      timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -m gpu -n 6 tests/test_head_dims.py tests/test_triton.py \
        -k "256_columns or wide_heads or (padded_tiles_on_the_gpu and (160 or 192))" > "$results/tiles-256-tests.log" \
        2>&1; tail -3 "$results/tiles-256-tests.log"; stamp tiles-256 ;;
    prefill-tiles)
      for shape in ${PREFILL_SHAPES:-32/8/64 32/8/128 32/8/96 16/8/256}; do
        echo "== $shape"
        timeout 300 python3 benchmarks/triton_tuning.py --shape ${shape//\// } --budget 240 --formats \
          --extend-cases "prefill 8x4096" "chunked 2048 on 46000" 2>&1 | grep -E "^  .*best|failed|Error"
        # the heuristic's tile as A against the same with its full tiles' loop unmasked and int32 offsets as B (the
        # 64-row verify tile's settings; sm_90 SASS at 32/8/128: 902 instructions a step in that loop, 1151 before)
        timeout 200 python3 benchmarks/triton_tuning.py --shape ${shape//\// } --budget 150 --formats --rounds 3 \
          --extend-cases "prefill 8x4096" "chunked 2048 on 46000" --compare FULL_TILES=1 OFFSETS_32=1 2>&1 \
          | grep -E "B is|failed|Error"
      done | tee "$results/prefill-tiles.txt"; stamp prefill-tiles ;;
    overhead)
      timeout ${OVERHEAD_TIMEOUT:-120} python3 benchmarks/overhead.py --profile --json "$results/overhead.json" \
        > "$results/overhead.log" 2>&1; grep -E "^(flashinfer|triton) " "$results/overhead.log"; stamp overhead ;;
    breakdown)
      timeout ${BREAKDOWN_TIMEOUT:-180} python3 benchmarks/decode_breakdown.py ${BREAKDOWN_ARGS:-} \
        --json "$results/breakdown.json" > "$results/breakdown.log" 2>&1; tail -20 "$results/breakdown.log"; stamp breakdown ;;
    splits)
      timeout ${SPLITS_TIMEOUT:-300} python3 benchmarks/cuda_splits.py ${SPLITS_ARGS:-} --json "$results/cuda-splits.json" \
        > "$results/cuda-splits.log" 2>&1; cut -c1-200 "$results/cuda-splits.log" | tail -40; stamp splits ;;
    triton-splits)
      for shape in ${TRITON_SPLITS_SHAPES:-32/8/128}; do
        IFS=/ read -r hq hkv d <<< "$shape"; name=triton-splits-$hq-$hkv-$d
        timeout ${SPLITS_TIMEOUT:-150} python3 benchmarks/triton_tuning.py --shape $hq $hkv $d --formats bf16 fp8_e4m3 \
          --cases ${TRITON_SPLITS_CASES:-32x8192 128x4096 ragged64 ragged256 64x2048 1x32768 ragged32x8k 31x512+8192} \
          --tile-cases 32x8192 --no-extend --exact \
          --tiles 128,4,3 --budget $(( ${SPLITS_TIMEOUT:-150} - 20 )) --json "$results/$name.json" \
          > "$results/$name.log" 2>&1
        echo "== $shape"; grep -E "best CHUNK|fail|wrong" "$results/$name.log" | cut -c1-220
      done; stamp triton-splits ;;
    wave-plan)
      ATTNOPS_TRITON_TUNABLES=WAVE_PLAN=3 timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider \
        -m gpu tests/test_triton.py -k "wave or graph" > "$results/wave-plan-tests.log" 2>&1
      tail -1 "$results/wave-plan-tests.log"; grep -E "^FAILED" "$results/wave-plan-tests.log" | head -8
      for plan in ${WAVE_PLANS:-3 2}; do for shape in ${WAVE_SHAPES:-32/8/128 32/4/128}; do
        IFS=/ read -r hq hkv d <<< "$shape"; name=wave-plan-$plan-$hq-$hkv-$d
        timeout ${WAVE_TIMEOUT:-120} python3 benchmarks/triton_tuning.py --shape $hq $hkv $d --formats bf16 fp8_e4m3 \
          --compare WAVE_PLAN=$plan --no-extend --rounds 3 --budget $(( ${WAVE_TIMEOUT:-120} - 20 )) \
          --cases 32x8192 128x4096 ragged32x8k 31x512+8192 ragged64 64x2048 1x32768 \
          --json "$results/$name.json" > "$results/$name.log" 2>&1
        echo "== WAVE_PLAN=$plan $shape"; grep -E "^  |failed|Error" "$results/$name.log" | tail -16
      done; done 2>&1 | tee "$results/wave-plan.txt"; stamp wave-plan ;;
    bench)
      timeout ${BENCH_TIMEOUT:-300} python3 -m attnops bench ${BENCH_ARGS:-} --json "$results/bench.json" \
        --plot "$results/bench.png" > "$results/bench.txt" 2> /tmp/bench.err; tail -3 /tmp/bench.err
      grep -v unsupported "$results/bench.txt" | cut -c1-150 | tail -60; stamp bench ;;
    invariance)
      # the cost of batch-invariant mode: a backend's cases of the bench grid (INVARIANCE_ARGS narrows them) in the default
      # mode and inside the mode, alternating, same run; then each case's ratio and their geometric mean
      # (INVARIANCE_CHUNKS: Triton's split sizes in the mode, each beside the default: ATTNOPS_TRITON_INVARIANT_CHUNK)
      settings="0:ATTNOPS_BATCH_INVARIANT=0" tags=
      for chunk in ${INVARIANCE_CHUNKS:-}; do
        settings="$settings $chunk:ATTNOPS_BATCH_INVARIANT=1,ATTNOPS_TRITON_INVARIANT_CHUNK=$chunk" tags="$tags $chunk"
      done
      [ -z "$tags" ] && settings="$settings 1:ATTNOPS_BATCH_INVARIANT=1" tags=1
      bench_settings invariance ${INVARIANCE_ROUNDS:-2} ${BENCH_TIMEOUT:-300} "$settings" \
        --backends ${INVARIANCE_BACKEND:-triton} --peers --graph-only ${INVARIANCE_ARGS:-}
      for tag in $tags; do
        [ "$tag" = 1 ] || echo "== $tag keys a split"
        python3 benchmarks/invariance_cost.py "$results"/invariance-0-*.json -- "$results"/invariance-$tag-*.json
      done | tee "$results/invariance.txt"; stamp invariance ;;
    verify-tile)
      timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -m gpu -n 4 tests/test_triton.py -k short_verify \
        > "$results/verify-tile-tests.log" 2>&1; tail -1 "$results/verify-tile-tests.log"
      for former in "4:BLOCK_Q=4 BLOCK_N=128 num_warps=4 FULL_TILES=0 OFFSETS_32=0 HEADS_INNER=1 CHUNK=4096 \
                       MAX_SPLITS=1" "8:BLOCK_Q=8 BLOCK_N=64 num_warps=4 FULL_TILES=0 OFFSETS_32=0 CHUNK=1024 \
                       MAX_SPLITS=3"; do
        tokens=${former%%:*}
        timeout 300 python3 benchmarks/triton_tuning.py --budget 240 --formats --rounds 5 \
          --extend-cases "verify$tokens 32x4096" --compare ${former#*:} > "$results/verify-tile-$tokens.log" 2>&1
        grep -E "B is|failed|Error" "$results/verify-tile-$tokens.log"
      done
      # a few long sequences keep the former tile and its splits (not measured): against the padded tile as B, with
      # the plan of splits it would take (4 a sequence) and with 16
      for plan in "CHUNK=2048 MAX_SPLITS=4" "CHUNK=1024 MAX_SPLITS=16"; do
        timeout 200 python3 benchmarks/triton_tuning.py --budget 150 --formats --rounds 5 --extend-cases \
          "verify8 4x16384" --compare BLOCK_Q=16 BLOCK_N=64 num_warps=4 FULL_TILES=1 OFFSETS_32=1 $plan 2>&1 \
          | grep -E "B is|failed|Error"
      done | tee "$results/verify-tile-few.log"
      # fp8 keeps its tiles (not measured): the heuristic as A against the padded tile (fp8's 64-row settings) as B
      timeout 300 python3 benchmarks/triton_tuning.py --budget 240 --formats --rounds 5 --extend-format fp8_e4m3 \
        --extend-cases "verify4 32x4096" "verify8 32x4096" --compare BLOCK_Q=16 BLOCK_N=64 num_warps=4 num_stages=2 \
        FULL_TILES=1 OFFSETS_32=1 FP8_V_PAIRS=0 FP8_K_PAIRS=0 HEADS_INNER=0 maxnreg=0 CHUNK=4096 MAX_SPLITS=1 \
        > "$results/verify-tile-fp8.log" 2>&1; grep -E "B is|failed|Error" "$results/verify-tile-fp8.log"
      stamp verify-tile ;;
    invariance-mla)
      # the mode's cost on the cuda latent-attention kernel at each split size of $MLA_CHUNKS (default 512 1024 2048):
      # the mla grid (INVARIANCE_ARGS narrows it), the default mode and each size alternating, same run
      settings="0:ATTNOPS_BATCH_INVARIANT=0,ATTNOPS_CUDA_MLA_INVARIANT_CHUNK="
      for chunk in ${MLA_CHUNKS:-512 1024 2048}; do
        settings="$settings $chunk:ATTNOPS_BATCH_INVARIANT=1,ATTNOPS_CUDA_MLA_INVARIANT_CHUNK=$chunk"
      done
      bench_settings invariance-mla ${INVARIANCE_ROUNDS:-1} ${BENCH_TIMEOUT:-150} "$settings" \
        --grid mla --backends cuda --peers --graph-only --rep-ms ${REP_MS:-20} ${INVARIANCE_ARGS:-}
      for chunk in ${MLA_CHUNKS:-512 1024 2048}; do
        echo "== $chunk keys a split"; python3 benchmarks/invariance_cost.py "$results"/invariance-mla-0-*.json -- \
          "$results"/invariance-mla-$chunk-*.json
      done | tee "$results/invariance-mla.txt" | grep -E "==|geometric"; stamp invariance-mla ;;
    jit|jit-start)
      # jit-start: the builds run on at the lowest CPU priority while the next steps use the GPU (Triton-only
      # work); jit-wait waits for them before any step that needs FlashInfer
      for d in 64 128 256; do for kv in bf16 fp8_e4m3; do
        ATTNOPS_BACKEND=flashinfer nice -n 19 timeout ${JIT_TIMEOUT:-300} python3 -m attnops warmup --head-dim $d \
          --num-q-heads 32 --num-kv-heads 8 --kv-format $kv > /tmp/jit-$d-$kv.log 2>&1 &
        jit_pids="${jit_pids:-} $!"
      done; done
      if [ "$step" = jit ]; then
        wait $jit_pids; grep -h -iE "error|Traceback" /tmp/jit-*.log | head -20; stamp jit
      else
        stamp "jit started"
      fi ;;
    jit-wait)
      wait ${jit_pids:-}; grep -h -iE "error|Traceback" /tmp/jit-*.log | head -20; stamp "jit done" ;;
    models)
      arch=$(python3 -c "import torch; print('sm_%d%d' % torch.cuda.get_device_capability())")
      timeout ${MODELS_TIMEOUT:-540} python3 -m attnops tune --out "$results/$arch.json" --rep-ms ${REP_MS:-50} \
        --json "$results/models.json" ${MODELS_ARGS:-} > "$results/models.log" 2> /tmp/models.err
      tail -3 /tmp/models.err; sed -n '/^the rule on/,$p' "$results/models.log" | head -60; stamp models ;;
    mla-models)
      arch=$(python3 -c "import torch; print('sm_%d%d' % torch.cuda.get_device_capability())")
      timeout ${MODELS_TIMEOUT:-540} python3 -m attnops bench --grid models --cases deepseek-v3 \
        --backends flashinfer cuda triton --peers fi-mla --auto --graph-only --rep-ms ${REP_MS:-50} \
        --json "$results/mla-models.json" \
        > "$results/mla-models.txt" 2> /tmp/mla-models.err; tail -3 /tmp/mla-models.err
      sources=$(python3 -c "import json; print(' '.join(json.load(open('attnops/tables/$arch.json'))['sources']))")
      python3 -m attnops tune --from-json $sources "$results/mla-models.json" --arch $arch --out "$results/$arch.json" \
        --checks-out "$results/$arch-rule-checks.json" > "$results/mla-tune.log" 2>&1
      sed -n "/latent attention's rule/,\$p" "$results/mla-tune.log" | head -40; stamp mla-models ;;
    autocheck)
      for g in "models --cases /bf16/ /fp8_e4m3/per_tensor/:autocheck" "models-unseen:unseen"; do
        timeout ${AUTOCHECK_TIMEOUT:-240} python3 -m attnops bench --grid ${g%%:*} --backends flashinfer triton \
          --peers --auto --graph-only --rep-ms ${REP_MS:-30} --json "$results/${g##*:}.json" > /tmp/${g##*:}.txt 2>&1
        tail -1 /tmp/${g##*:}.txt
      done; stamp autocheck ;;
    ab)
      # the other tree's package must be the one imported: an editable install of this tree would win over
      # PYTHONPATH, so it is uninstalled for the A run and installed again for the B run
      (cd "${AB_OLD:?set AB_OLD to the other tree}" && python3 setup.py -q build_ext --inplace > /tmp/ab-build.log 2>&1) \
        || { tail -20 /tmp/ab-build.log; exit 1; }
      python3 -m pip uninstall -q -y attnops
      (cd "$AB_OLD" && python3 -c "import attnops; print('A:', attnops.__file__)" && timeout 200 python3 \
        benchmarks/bench.py --backends triton --peers --rep-ms 50 ${AB_ARGS:-} --json "$results/ab-old.json" \
        > /tmp/ab-old.txt 2>&1); tail -2 /tmp/ab-old.txt
      python3 -m pip install -q --no-build-isolation --no-deps -e . > /tmp/build.log 2>&1
      python3 -c "import attnops; print('B:', attnops.__file__)"
      timeout 200 python3 -m attnops bench --backends triton --peers --graph-only --rep-ms 50 ${AB_ARGS:-} \
        --json "$results/ab-new.json" > /tmp/ab-new.txt 2>&1; tail -2 /tmp/ab-new.txt; stamp ab ;;
    ab-cuda)
      trees=(${AB_TREES:?set AB_TREES to source trees}); build_pids=""
      for tree in "${trees[@]}"; do
        (cd "$tree" && MAX_JOBS=4 python3 setup.py -q build_ext --inplace > "/tmp/ab-build-$(basename "$tree").log" 2>&1) &
        build_pids="$build_pids $!"
      done
      wait $build_pids; stamp "ab-cuda built"
      installed=$(python3 -m pip show -q attnops > /dev/null 2>&1 && echo 1)
      [ -n "$installed" ] && python3 -m pip uninstall -q -y attnops
      for round in $(seq 1 ${AB_ROUNDS:-2}); do
        for tree in "${trees[@]}"; do
          name=$(basename "$tree")
          (cd "$tree" && timeout ${AB_TIMEOUT:-200} python3 -m attnops bench --grid ${AB_GRID:-fp4} --backends cuda --peers \
            --graph-only --rep-ms ${REP_MS:-30} ${AB_ARGS:-} --json "$results/ab-cuda-$name-$round.json" \
            > "/tmp/ab-cuda-$name-$round.txt" 2>&1) || { echo "$name: failed"; tail -5 "/tmp/ab-cuda-$name-$round.txt"; \
            tail -5 "/tmp/ab-build-$name.log"; }
        done
      done
      # (this tree's package back, for the steps after this one)
      [ -n "$installed" ] && python3 -m pip install -q --no-build-isolation --no-deps -e . > /tmp/build.log 2>&1
      python3 - "$results" "${trees[@]}" <<'PY' | tee "$results/ab-cuda.txt"
import glob, json, math, os, sys
results, trees = sys.argv[1], [os.path.basename(t) for t in sys.argv[2:]]
best = {}  # case -> tree -> best graph time over the rounds (us)
for tree in trees:
    for path in glob.glob(f"{results}/ab-cuda-{tree}-*.json"):
        for r in json.load(open(path))["records"]:
            if r.get("status") == "ok" and r.get("graph_us"):
                cell = best.setdefault(r["case"], {})
                cell[tree] = min(cell.get(tree, float("inf")), r["graph_us"])
print(f"{'case':<40}" + "".join(f"{t[:22]:>24}" for t in trees))
for case, cell in best.items():
    base = cell.get(trees[0])
    print(f"{case:<40}" + "".join(f"{cell[t]:>14.1f} us" + (f" x{base / cell[t]:.3f}" if base and t in cell else "")
                                   if t in cell else f"{'-':>24}" for t in trees))
for t in trees[1:]:  # the first tree's time over this one's, geometric mean over the cases both ran (> 1: faster)
    ratios = [cell[trees[0]] / cell[t] for cell in best.values() if trees[0] in cell and t in cell]
    if ratios:
        print(f"{t}: {trees[0]}'s time / its time, geometric mean over {len(ratios)} cases: "
              f"x{math.exp(sum(map(math.log, ratios)) / len(ratios)):.4f}")
PY
      stamp ab-cuda ;;
    head-dims)
      # head dims between powers of two and 512 through Triton's padded tiles: the GPU tests, then decode on the
      # head-dims grid against FlashInfer where it serves the size
      timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m gpu \
        tests/test_head_dims.py > "$results/head-dims-tests.log" 2>&1; tail -3 "$results/head-dims-tests.log"
      timeout ${BENCH_TIMEOUT:-300} python3 -m attnops bench --grid head-dims \
        --backends triton --peers --graph-only --json "$results/head-dims.json" > "$results/head-dims.txt" 2>&1
      tail -30 "$results/head-dims.txt"; stamp head-dims ;;
    mla)
      timeout ${MLA_TIMEOUT:-300} python3 benchmarks/mla_decode.py ${MLA_ARGS:-} --json "$results/${MLA_NAME:-mla}.json" \
        2>&1 | tee "$results/${MLA_NAME:-mla}.txt" | tail -40
      stamp mla ;;
    cuda-mla)
      for variant in cpasync_form tma_form keys_form regs_form warps_merge; do  # (each alone)
        timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -rA -p no:cacheprovider -m gpu \
          -k $variant tests/test_cuda_mla.py > "/tmp/cuda-mla-tests-$variant.log" 2>&1
        echo "== $variant (exit $?)"; grep -E "passed|failed|FAILED|Error" "/tmp/cuda-mla-tests-$variant.log" \
          | grep -v "^PASSED" | tail -8
      done; cat /tmp/cuda-mla-tests-*.log > "$results/cuda-mla-tests.log"
      timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu -k "not _form and not warps_merge" \
        tests/test_cuda_mla.py 2>&1 | tail -1
      for fmt in bf16 fp8_e4m3; do
        timeout ${MLA_TIMEOUT:-300} python3 benchmarks/mla_decode.py --backend cuda \
          --heads ${CUDA_MLA_HEADS:-16 64 128} --cases 1x32768 32x8192 128x4096 --kv-format $fmt \
          --json "$results/cuda-mla-$fmt.json" 2>&1 | tee "$results/cuda-mla-$fmt.txt" | tail -12
      done
      stamp cuda-mla ;;
    cuda-mla-variants)
      # (a form that fails or hangs once is left out of the rest of the step: a hang costs its timeout only once)
      variants="cp.async tma keys"
      for variant in $variants; do  # (where a tile's time goes in each form; keys: the tma form past 16 heads)
        ATTNOPS_CUDA_MLA_VARIANT=$variant timeout 120 python3 benchmarks/cuda_mla_stages.py --tokens 1 66 132 \
          --heads 16 64 128 \
          --json "$results/cuda-mla-stages-$variant.json" > "/tmp/stages-$variant.txt" 2>&1 \
          || { echo "$variant: failed"; variants=$(echo $variants | sed "s/$variant//"); }
        tail -12 "/tmp/stages-$variant.txt"
      done
      for round in 1 2; do for variant in $variants; do
        ATTNOPS_CUDA_MLA_VARIANT=$variant timeout ${MLA_TIMEOUT:-120} python3 benchmarks/mla_decode.py --backend cuda \
          --heads ${CUDA_MLA_HEADS:-16 64 128} --cases 1x32768 32x8192 128x4096 --no-flashinfer \
          --json "$results/cuda-mla-$variant-$round.json" > "$results/cuda-mla-$variant-$round.txt" 2>&1 || \
          { echo "$variant: failed"; tail -5 "$results/cuda-mla-$variant-$round.txt"; variants=$(echo $variants | sed "s/$variant//"); }
        case $variant in cp.async|keys)  # (fp8 caches: these two forms only; keys at 16 heads)
          ATTNOPS_CUDA_MLA_VARIANT=$variant timeout ${MLA_TIMEOUT:-120} python3 \
            benchmarks/mla_decode.py --backend cuda --heads 16 --cases 1x32768 32x8192 128x4096 --no-flashinfer \
            --kv-format fp8_e4m3 --json "$results/cuda-mla-$variant-fp8-$round.json" \
            > "$results/cuda-mla-$variant-fp8-$round.txt" 2>&1 || echo "$variant fp8: failed" ;;
        esac
      done; done
      python3 - "$results" <<'PY' | tee "$results/cuda-mla-variants.txt"
import glob, json, math, sys
variants = ["cp.async", "tma", "keys"]
best = {}  # case -> variant -> best time over the rounds (us)
for variant in variants:
    for path in glob.glob(f"{sys.argv[1]}/cuda-mla-{variant}-[12].json") + \
            glob.glob(f"{sys.argv[1]}/cuda-mla-{variant}-fp8-[12].json"):
        for r in json.load(open(path))["records"]:
            cell = best.setdefault(r["case"], {})
            cell[variant] = min(cell.get(variant, math.inf), r["attnops_us"])
print(f"{'case':<28}" + "".join(f"{v + ' us':>12}" for v in variants) + "   speedup over cp.async")
for case, cell in best.items():
    times = "".join(f"{cell[v]:>12.1f}" if v in cell else f"{'-':>12}" for v in variants)
    ups = " ".join(f"{v} x{cell['cp.async'] / cell[v]:.3f}" for v in variants[1:] if v in cell and "cp.async" in cell)
    print(f"{case:<28}{times}   {ups}")
for v in variants[1:]:
    ratios = [c["cp.async"] / c[v] for c in best.values() if v in c and "cp.async" in c]
    if ratios:
        print(f"{v}: geometric mean speedup over cp.async {math.exp(sum(map(math.log, ratios)) / len(ratios)):.4f}")
PY
      stamp cuda-mla-variants ;;
    cuda-mla-regs)
      # the regs form (fp8 widened in registers) against the keys form on fp8 and the tma form on bf16, at up to 16
      # heads: its GPU tests, then mla_decode.py with each, alternating, two rounds
      # (a form whose tests run out of time, or that fails once, is not timed after: a hang costs its limit once)
      forms="tma:bf16 keys:fp8_e4m3 regs:fp8_e4m3"
      timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -rA -p no:cacheprovider -m gpu -k regs_form \
        tests/test_cuda_mla.py > "$results/cuda-mla-regs-tests.log" 2>&1 \
        || { [ $? = 124 ] && echo "regs: its tests ran out of time (a hang?): not timed" && forms=${forms% *}; }
      grep -E "passed|failed|FAILED|Error" "$results/cuda-mla-regs-tests.log" | grep -v "^PASSED" | tail -8
      for round in 1 2; do for form in $forms; do
        variant=${form%%:*} fmt=${form#*:}
        ATTNOPS_CUDA_MLA_VARIANT=$variant timeout ${MLA_TIMEOUT:-120} python3 benchmarks/mla_decode.py --backend cuda \
          --heads ${REGS_HEADS:-16 8} --cases 1x32768 32x8192 128x4096 --no-flashinfer --kv-format $fmt \
          --json "$results/cuda-mla-regs-$variant-$round.json" > "/tmp/regs-$variant-$round.txt" 2>&1 \
          || { echo "$variant: failed"; tail -5 "/tmp/regs-$variant-$round.txt"; forms=${forms/$form/}; }
      done; done
      python3 - "$results" <<'PY' | tee "$results/cuda-mla-regs.txt"
import glob, json, math, sys
best = {}  # (heads, batch x length) -> form -> best time over the rounds (us)
for form in ("tma", "keys", "regs"):
    for path in glob.glob(f"{sys.argv[1]}/cuda-mla-regs-{form}-[12].json"):
        for r in json.load(open(path))["records"]:
            cell = best.setdefault((r["heads"], f"{r['batch']}x{r['kv_len']}"), {})
            cell[form] = min(cell.get(form, math.inf), r["attnops_us"])
print(f"{'heads, case':<20}{'bf16 tma us':>13}{'fp8 keys us':>13}{'fp8 regs us':>13}{'regs over keys':>16}"
      f"{'bf16 / regs':>13}")
for (heads, case), cell in sorted(best.items()):
    t = [cell.get(f, math.nan) for f in ("tma", "keys", "regs")]
    print(f"{f'{heads}, {case}':<20}{t[0]:>13.1f}{t[1]:>13.1f}{t[2]:>13.1f}{t[1] / t[2]:>16.3f}{t[0] / t[2]:>13.3f}")
PY
      stamp cuda-mla-regs ;;
    cuda-mla-ds)
      # (a hang in the tests costs their limit once: the layout's kernel is then not timed)
      forms="cuda-ds:fp8_ds_mla cuda-bf16:bf16 cuda-fp8:fp8_e4m3 triton-ds:fp8_ds_mla"
      timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -rA -p no:cacheprovider -m gpu -k deepseeks_layout \
        tests/test_cuda_mla.py > "$results/cuda-mla-ds-tests.log" 2>&1 \
        || { [ $? = 124 ] && echo "cuda-ds: its tests ran out of time (a hang?): not timed" && forms=${forms#* }; }
      grep -E "passed|failed|FAILED|Error" "$results/cuda-mla-ds-tests.log" | grep -v "^PASSED" | tail -8
      for round in $(seq 1 ${DS_ROUNDS:-2}); do for form in $forms; do
        name=${form%%:*} fmt=${form#*:}
        variant=; [ $name = cuda-fp8 ] && variant=keys
        ATTNOPS_CUDA_MLA_VARIANT=$variant timeout ${MLA_TIMEOUT:-120} python3 benchmarks/mla_decode.py \
          --backend ${name%%-*} --heads ${DS_HEADS:-16 128} --cases 1x32768 32x8192 128x4096 \
          --page-size ${DS_PAGE:-64} --no-flashinfer --kv-format $fmt --json "$results/cuda-mla-ds-$name-$round.json" \
          > "/tmp/cuda-ds-$name-$round.txt" 2>&1 || { echo "$name: failed"; tail -5 "/tmp/cuda-ds-$name-$round.txt"; }
      done; done
      python3 - "$results" <<'PY' | tee "$results/cuda-mla-ds.txt"
import glob, json, math, sys
names = ("cuda-ds", "cuda-fp8", "cuda-bf16", "triton-ds")
best = {}  # (heads, batch x length) -> kernel -> best time over the rounds (us)
for name in names:
    for path in glob.glob(f"{sys.argv[1]}/cuda-mla-ds-{name}-*.json"):
        for r in json.load(open(path))["records"]:
            cell = best.setdefault((r["heads"], f"{r['batch']}x{r['kv_len']}"), {})
            cell[name] = min(cell.get(name, math.inf), r["attnops_us"])
print(f"{'heads, case':<20}" + "".join(f"{n + ' us':>14}" for n in names) + f"{'bf16 / ds':>11}{'triton / ds':>13}")
for (heads, case), cell in sorted(best.items()):
    t = [cell.get(n, math.nan) for n in names]
    print(f"{f'{heads}, {case}':<20}" + "".join(f"{x:>14.1f}" for x in t) + f"{t[2] / t[0]:>11.3f}{t[3] / t[0]:>13.3f}")
PY
      stamp cuda-mla-ds ;;
    cuda-mla-merge)
      # the splits' merge by warps (ATTNOPS_CUDA_MLA_MERGE=warps) against the default: its GPU tests, then
      # mla_decode.py with each at MERGE_HEADS heads, bf16 and fp8, alternating, two rounds, same run
      timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -rA -p no:cacheprovider -m gpu -k warps_merge \
        tests/test_cuda_mla.py > "$results/cuda-mla-merge-tests.log" 2>&1
      grep -E "passed|failed|FAILED|Error" "$results/cuda-mla-merge-tests.log" | grep -v "^PASSED" | tail -8
      for round in 1 2; do for merge in columns warps; do for fmt in bf16 fp8_e4m3; do
        ATTNOPS_CUDA_MLA_MERGE=$merge timeout ${MLA_TIMEOUT:-120} python3 benchmarks/mla_decode.py --backend cuda \
          --heads ${MERGE_HEADS:-16 128} --cases 1x32768 32x8192 128x4096 --no-flashinfer --kv-format $fmt \
          --json "$results/cuda-mla-merge-$merge-$fmt-$round.json" > "/tmp/merge-$merge-$fmt-$round.txt" 2>&1 \
          || { echo "$merge $fmt: failed"; tail -5 "/tmp/merge-$merge-$fmt-$round.txt"; }
      done; done; done
      python3 - "$results" <<'PY' | tee "$results/cuda-mla-merge.txt"
import glob, json, math, sys
best = {}  # (format, heads, batch x length) -> merge -> best time over the rounds (us)
for merge in ("columns", "warps"):
    for path in glob.glob(f"{sys.argv[1]}/cuda-mla-merge-{merge}-*-[12].json"):
        fmt = path.rsplit("-", 2)[-2]
        for r in json.load(open(path))["records"]:
            cell = best.setdefault((fmt, r["heads"], f"{r['batch']}x{r['kv_len']}"), {})
            cell[merge] = min(cell.get(merge, math.inf), r["attnops_us"])
print(f"{'format, heads, case':<28}{'columns us':>12}{'warps us':>12}{'warps / columns':>17}")
ratios = []
for (fmt, heads, case), cell in sorted(best.items()):
    t = [cell.get(m, math.nan) for m in ("columns", "warps")]
    ratios.append(t[1] / t[0])
    print(f"{f'{fmt}, {heads}, {case}':<28}{t[0]:>12.1f}{t[1]:>12.1f}{t[1] / t[0]:>17.3f}")
finite = [r for r in ratios if r == r]
if finite:
    print(f"geometric mean of warps / columns: {math.exp(sum(map(math.log, finite)) / len(finite)):.3f}")
PY
      stamp cuda-mla-merge ;;
    cuda-mla-verify)
      timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -m gpu -k \
        "verify or long_sequence" tests/test_cuda_mla.py > "$results/cuda-mla-verify-tests.log" 2>&1
      tail -1 "$results/cuda-mla-verify-tests.log"; grep -E "^FAILED" "$results/cuda-mla-verify-tests.log" | head -8
      timeout ${MLA_TIMEOUT:-200} python3 -m attnops bench --grid mla --cases verify \
        --backends cuda triton flashinfer --peers fi-mla --graph-only --rep-ms ${REP_MS:-25} \
        --json "$results/cuda-mla-verify.json" > "$results/cuda-mla-verify.txt" 2>&1
      grep -E "verify" "$results/cuda-mla-verify.txt" | grep -v unsupported | cut -c1-130; stamp cuda-mla-verify ;;
    cuda-mla-pack)
      timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -m gpu -k "packed or verify" \
        tests/test_cuda_mla.py > "$results/cuda-mla-pack-tests.log" 2>&1
      tail -1 "$results/cuda-mla-pack-tests.log"; grep -E "^FAILED" "$results/cuda-mla-pack-tests.log" | head -8
      timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -m gpu -k cuda_latent \
        tests/test_batch_invariance.py >> "$results/cuda-mla-pack-tests.log" 2>&1
      tail -1 "$results/cuda-mla-pack-tests.log"
      bench_settings cuda-mla-pack 2 ${MLA_TIMEOUT:-150} \
        "0:ATTNOPS_CUDA_MLA_PACK_VERIFY=0 1:ATTNOPS_CUDA_MLA_PACK_VERIFY=1" \
        --grid mla --cases verify --backends cuda --peers fi-mla --graph-only --rep-ms ${REP_MS:-20}
      grep -E "verify" /tmp/cuda-mla-pack-1-1.txt | grep -v unsupported | cut -c1-130
      python3 benchmarks/invariance_cost.py --labels one-token-a-block packed "$results"/cuda-mla-pack-0-*.json -- \
        "$results"/cuda-mla-pack-1-*.json | tee "$results/cuda-mla-pack.txt"; stamp cuda-mla-pack ;;
    cuda-skip-empty)
      # the cuda 4-bit kernels with empty splits skipped (ATTNOPS_CUDA_SKIP_EMPTY_SPLITS=1) against not: the tests,
      # then the fp4 grid in the default mode and in batch-invariant mode, each setting alternating, same run
      timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 tests/test_cuda_backend.py \
        > "$results/cuda-skip-empty-tests.log" 2>&1; tail -1 "$results/cuda-skip-empty-tests.log"
      grep -E "^FAILED" "$results/cuda-skip-empty-tests.log" | head -8
      skip=ATTNOPS_CUDA_SKIP_EMPTY_SPLITS
      bench_settings cuda-skip-empty ${SKIP_EMPTY_ROUNDS:-2} ${FP4_TIMEOUT:-120} \
        "0:$skip=0 1:$skip=1 i0:ATTNOPS_BATCH_INVARIANT=1,$skip=0 i1:ATTNOPS_BATCH_INVARIANT=1,$skip=1" \
        --grid fp4 --formats nvfp4 mxfp4 --backends cuda --peers --graph-only
      { echo "== default mode: skipped over run"
        python3 benchmarks/invariance_cost.py --labels run skipped "$results"/cuda-skip-empty-0-*.json -- \
          "$results"/cuda-skip-empty-1-*.json
        echo "== batch-invariant mode: skipped over run"
        python3 benchmarks/invariance_cost.py --labels run skipped "$results"/cuda-skip-empty-i0-*.json -- \
          "$results"/cuda-skip-empty-i1-*.json
        echo "== the mode's cost with empty splits skipped"
        python3 benchmarks/invariance_cost.py "$results"/cuda-skip-empty-1-*.json -- \
          "$results"/cuda-skip-empty-i1-*.json
      } | tee "$results/cuda-skip-empty.txt" | grep -E "==|geometric"; stamp cuda-skip-empty ;;
    head-parts|pad-wrap)
      # a Triton tunable of the padded tiles off and on (HEAD_PARTS: two tiles; PAD_WRAP: the columns past the head
      # dim read as copies): the head dims GPU tests (every way), then the head-dims grid with each, alternating,
      # two rounds, same run
      key=$( [ "$step" = head-parts ] && echo HEAD_PARTS || echo PAD_WRAP )
      labels=$( [ "$step" = head-parts ] && echo "padded two-tiles" || echo "masked wrapped" )
      timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 tests/test_head_dims.py \
        > "$results/$step-tests.log" 2>&1; tail -1 "$results/$step-tests.log"
      grep -E "^FAILED" "$results/$step-tests.log" | head -8
      bench_settings $step ${HEAD_PARTS_ROUNDS:-2} ${BENCH_TIMEOUT:-150} \
        "0:ATTNOPS_TRITON_TUNABLES=$key=0 1:ATTNOPS_TRITON_TUNABLES=$key=1" \
        --grid head-dims --backends triton --peers --graph-only
      python3 benchmarks/invariance_cost.py --labels $labels "$results"/$step-0-*.json -- \
        "$results"/$step-1-*.json | tee "$results/$step.txt"; stamp $step ;;
    tests)
      limit=${TESTS_TIMEOUT:-240}
      suites=${TEST_SUITES:-capture triton flashinfer e2e}
      test_pids=""
      for suite in $suites; do
        case $suite in
          capture) files="-m gpu tests/test_capture.py" ;;
          triton) files="-m gpu -n 8 tests/test_triton.py" ;;
          flashinfer) files="tests/test_flashinfer.py tests/test_graphs.py tests/test_devices.py" ;;
          e2e) files="-m gpu tests/test_e2e.py" ;;
          spec) files="-m gpu -n 8 tests/test_sinks_tree.py tests/test_merge.py tests/test_prefix_sharing.py tests/test_cascade.py tests/test_lse.py" ;;
          hf) files="-m gpu tests/test_hf.py" ;;
          cuda) files="-m gpu tests/test_cuda_backend.py tests/test_cuda_prefill.py" ;;
          mla) files="-m gpu -n 4 tests/test_mla.py tests/test_mla_sparse.py tests/test_mla_fp8_ds.py tests/test_hf_mla.py" ;;
          modes) files="-m gpu -n 4 tests/test_batch_invariance.py tests/test_merge.py tests/test_head_dims.py" ;;
          *) echo "unknown suite $suite"; exit 2 ;;
        esac
        timeout $limit python3 -m pytest -q -rA -p no:cacheprovider $files > "/tmp/tests-$suite.log" 2>&1 &
        test_pids="$test_pids $!"
      done
      wait $test_pids  # (not a jit-start's builds)
      for suite in $suites; do echo "===== $suite"; cat "/tmp/tests-$suite.log"; done > "$results/tests.log"
      for suite in $suites; do echo "== $suite"; grep -E "passed|failed|error|FAILED|ERROR" \
        "/tmp/tests-$suite.log" | grep -v "^PASSED" | tail -8; done; stamp tests ;;
    serve)
      timeout ${SERVE_TIMEOUT:-400} python3 -m attnops serve-bench ${SERVE_ARGS:-} --json "$results/serve.json" \
        --append --plot "$results/serve.png" >> "$results/serve.txt" 2> /tmp/serve.err; tail -30 "$results/serve.txt"
      tail -3 /tmp/serve.err; stamp serve ;;
    serve-mla)
      timeout ${SERVE_TIMEOUT:-540} python3 -m attnops serve-bench --family deepseek_v2 --layers ${SERVE_MLA_LAYERS:-8} --contexts 8192 --batches 32 \
        --modes compiled+graphs transformers --kv-formats bf16 fp8_e4m3 ${SERVE_MLA_ARGS:-} --json "$results/serve-mla.json" \
        --plot "$results/serve-mla.png" > "$results/serve-mla.txt" 2> /tmp/serve-mla.err; tail -3 /tmp/serve-mla.err
      tail -8 "$results/serve-mla.txt"; stamp serve-mla ;;
    serve-hf)
      parts=("--family llama --kv-formats bf16 --modes compiled+graphs transformers"
             "--family llama --kv-formats fp8_e4m3 --modes compiled+graphs"
             "--family qwen2 --kv-formats bf16 fp8_e4m3 --modes compiled+graphs"
             "--family qwen2 --modes transformers"
             "--family llama qwen2 --modes transformers-cb")
      for i in ${SERVE_HF_PARTS:-1 2 3 4 5}; do
        part=${parts[$((i - 1))]}
        timeout ${SERVE_TIMEOUT:-540} python3 -m attnops serve-bench $part --profile \
          --json "$results/serve-hf.json" --append --plot "$results/serve-hf.png" >> "$results/serve-hf.txt" \
          2> /tmp/serve-hf.err; tail -3 /tmp/serve-hf.err
        stamp "serve-hf $part"
      done
      grep -E "x$|x  " "$results/serve-hf.txt" | tail -40 ;;
    cascade)
      timeout ${CASCADE_TIMEOUT:-200} python3 benchmarks/cascade.py --json "$results/cascade.json" \
        --plot "$results/cascade.png" > "$results/cascade.txt" 2>&1; tail -4 "$results/cascade.txt"
      timeout ${CASCADE_TIMEOUT:-200} python3 benchmarks/cascade.py --sweep --formats bf16 --rep-ms 50 \
        --json "$results/cascade-sweep.json" > "$results/cascade-sweep.txt" 2>&1; tail -10 "$results/cascade-sweep.txt"
      stamp cascade ;;
    demo)
      timeout ${DEMO_TIMEOUT:-300} python3 -m attnops demo ${DEMO_ARGS:-} > "$results/demo.txt" 2>&1
      cat "$results/demo.txt"; stamp demo ;;
    fuzz-warm)
      # each backend's first chunk in one process (every shape family is in it): Triton compiles each kernel
      # variant once into its cache, FlashInfer JIT-builds once, before the fuzz step's workers start in parallel
      # and would all compile the same variants at once
      fuzz_env
      timeout ${FUZZ_TIMEOUT:-600} python3 -m pytest -q -rf -p no:cacheprovider -m gpu tests/test_fuzz.py \
        -k "triton-0 or flashinfer-0 or auto-0" --durations=5 > "$results/fuzz-warm.log" 2>&1
      grep -E "^FAILED|passed|failed|error|s call" "$results/fuzz-warm.log" | tail -8; stamp fuzz-warm ;;
    fuzz)
      fuzz_env
      timeout ${FUZZ_TIMEOUT:-600} python3 -m pytest -q -rf -p no:cacheprovider -m gpu -n ${FUZZ_WORKERS:-6} \
        tests/test_fuzz.py ${FUZZ_K:+-k "$FUZZ_K"} --durations=10 > "$results/fuzz.log" 2>&1
      grep -E "^FAILED|passed|failed|error|s call" "$results/fuzz.log" | tail -20; stamp fuzz ;;
    fp4)
      timeout ${FP4_TIMEOUT:-420} python3 -m attnops bench --grid fp4 --backends cuda triton flashinfer --peers \
        --graph-only --rep-ms ${REP_MS:-30} --json "$results/fp4.json" --plot "$results/fp4.png" > "$results/fp4.txt" 2>&1
      grep -E " ok " "$results/fp4.txt" | tail -40; stamp fp4 ;;
    fp8)
      timeout ${FP8_TIMEOUT:-420} python3 -m attnops bench --grid models --formats fp8_e4m3 --cases '*/32x8192' \
        '*/128x4096' --backends ${FP8_BACKENDS:-cuda triton flashinfer} --peers --graph-only --rep-ms ${REP_MS:-20} \
        --json "$results/fp8.json" --plot "$results/fp8.png" > "$results/fp8.txt" 2>&1
      grep -E " ok " "$results/fp8.txt" | tail -60; stamp fp8 ;;
    sanitize)
      sanitizer=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 ATTNOPS_FUZZ_GUARD=0 ATTNOPS_FUZZ_CASES=${SANITIZE_CASES:-20} \
        timeout ${SANITIZE_TIMEOUT:-600} "$sanitizer" --tool memcheck --report-api-errors no --print-limit 20 \
        python3 -m pytest -q -rf -p no:cacheprovider -m gpu tests/test_fuzz.py ${SANITIZE_K:+-k "$SANITIZE_K"} \
        > "$results/sanitize.log" 2>&1
      echo "rc $?"; grep -E "ERROR SUMMARY|passed|failed|^FAILED|Invalid" "$results/sanitize.log" | tail -15
      stamp sanitize ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
