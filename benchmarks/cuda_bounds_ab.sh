#!/usr/bin/env bash
# What the CUDA kernels' index bounds cost (docs/design.md, "Bad indices"), measured in one run on a CUDA machine:
# this tree copied twice, once as it is and once built with ATTNOPS_CUDA_BOUNDS=0 (the kernel without its checks of
# seq_lens, block_table and cu_seqlens_q, which is never shipped), both timed on the fp4 grid's 4-bit decode and
# verify cases in alternating rounds by gpu_round.sh's ab-cuda step. Its last lines give, per case, each build's
# best CUDA-graph time, and the geometric mean of the ratio: "no-bounds: bounds's time / its time ... x1.00xx"
# (x1.01 would mean the bounds cost 1%).
#   ATTNOPS_OUT=results AB_ROUNDS=3 bash benchmarks/cuda_bounds_ab.sh
# Results: $ATTNOPS_OUT/ab-cuda-{bounds,no-bounds}-<round>.json and ab-cuda.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
for tree in bounds no-bounds; do
  mkdir -p "$work/$tree"
  tar --exclude=./build --exclude='*.so' --exclude=./.git --exclude="./${ATTNOPS_OUT:-gpu-out}" -cf - . \
    | tar -xf - -C "$work/$tree"
done
sed -i '1i #define ATTNOPS_CUDA_BOUNDS 0' "$work/no-bounds/csrc/cuda/fp4_paged_attention.cu"
AB_TREES="$work/bounds $work/no-bounds" bash benchmarks/gpu_round.sh ab-cuda
