"""Eager per-call cost of the op against the kernel alone, on decode 1 x 512 (32/8/128, bf16), where launch cost
dominates: `torch.ops.attnops.paged_attention` minus FlashInfer's own planned `run()`, and minus the Triton
backend's bare launch. Host-timed over many back-to-back calls (the GPU work is tiny, so the host is the limit).

For FlashInfer it also times the op with the C++ replay off (ATTNOPS_FLASHINFER_REPLAY=0: every call through
attnops' Python and FlashInfer's run()), and reports how many calls the replay served.

    python benchmarks/overhead.py [--json PATH] [--profile]

--profile also runs each backend's op call under cProfile and prints where its host time goes.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import attnops  # noqa: E402
from attnops.backends import BACKENDS, flashinfer_replay  # noqa: E402
from attnops.checks import attention_call  # noqa: E402
from attnops.dispatch import STATIC_ORDER  # noqa: E402
from attnops.testing import random_paged_inputs  # noqa: E402


def per_call_us(fn, calls=3000, rounds=5):
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(best)[len(best) // 2]


def profile(name, fn, calls=2000, top=14):
    """The host functions that cost the most per op call (cProfile's own overhead inflates all of them alike)."""
    import cProfile
    import io
    import pstats
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    stream = io.StringIO()
    pstats.Stats(prof, stream=stream).sort_stats("tottime").print_stats(top)
    print(f"--- {name}: cProfile of {calls} op calls, by own time\n" + stream.getvalue()[-4000:])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--profile", action="store_true", help="cProfile each backend's op call")
    args = parser.parse_args(argv)
    inputs = random_paged_inputs([512], num_q_heads=32, num_kv_heads=8, head_dim=128, kv_format="bf16",
                                 q_dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(inputs["q"])
    results = {}
    # the call a backend runs, built once (validated, its case made) as the op builds it on every call
    call = attention_call(inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["block_table"],
                          inputs["seq_lens"], None, 128 ** -0.5, 0.0, -1, "bf16", None, None, None, None, out)
    for name in STATIC_ORDER["cuda"]:  # every GPU backend that serves this bf16 decode
        if name == "reference" or BACKENDS[name].unavailable() or BACKENDS[name].supports(call.case):
            continue
        extra = {}
        with attnops.use_backend(name):
            before = flashinfer_replay.stats()
            op_us = per_call_us(lambda: torch.ops.attnops.paged_attention(**inputs))
            op_out_us = per_call_us(lambda: torch.ops.attnops.paged_attention.out(**inputs, out=out))
            after = flashinfer_replay.stats()
            extra["replayed_calls"] = after["hits"] - before["hits"]
            extra["python_calls"] = after["misses"] - before["misses"]
            if name == "flashinfer" and flashinfer_replay.built():
                os.environ["ATTNOPS_FLASHINFER_REPLAY"] = "0"
                flashinfer_replay.clear()
                extra["op_out_no_replay_us"] = per_call_us(
                    lambda: torch.ops.attnops.paged_attention.out(**inputs, out=out))
                del os.environ["ATTNOPS_FLASHINFER_REPLAY"]
        backend = BACKENDS[name]
        if name == "flashinfer":
            wrapper = backend._plan(call)[0]
            kv = (inputs["k_cache"], inputs["v_cache"])
            bare_us = per_call_us(lambda: wrapper.run(inputs["q"], kv, out=out))
            backend_us = per_call_us(lambda: backend.paged_attention(call))
        else:
            bare_us = backend_us = per_call_us(lambda: backend.paged_attention(call))
        if args.profile:
            with attnops.use_backend(name):
                profile(name, lambda: torch.ops.attnops.paged_attention.out(**inputs, out=out))
        results[name] = dict(op_us=op_us, op_out_us=op_out_us, backend_call_us=backend_us, kernel_run_us=bare_us,
                             overhead_us=op_us - bare_us, overhead_out_us=op_out_us - bare_us, **extra)
        if "op_out_no_replay_us" in extra:
            results[name]["overhead_out_no_replay_us"] = extra["op_out_no_replay_us"] - bare_us
    for name, r in results.items():
        print(f"{name:<11} op {r['op_us']:6.1f} us  op.out {r['op_out_us']:6.1f} us  backend call "
              f"{r['backend_call_us']:6.1f} us  kernel run() {r['kernel_run_us']:6.1f} us  -> overhead "
              f"{r['overhead_us']:5.1f} us (out= {r['overhead_out_us']:5.1f} us); calls replayed "
              f"{r['replayed_calls']}, through Python {r['python_calls']}"
              + (f"; replay off: op.out {r['op_out_no_replay_us']:6.1f} us -> overhead "
                 f"{r['overhead_out_no_replay_us']:5.1f} us" if "op_out_no_replay_us" in r else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                                   results=results), indent=1))


if __name__ == "__main__":
    main()
