"""`python -m attnops {info,demo,bench}`."""
from __future__ import annotations

import argparse
import platform
import sys

import torch


def info(args) -> None:
    from . import __version__, formats
    from .backends import BACKENDS
    from .dispatch import STATIC_ORDER, describe_attention, explain

    print(f"attnops {__version__}  python {platform.python_version()}  torch {torch.__version__}")
    try:
        import triton
        print(f"triton {triton.__version__}")
    except ImportError:
        print("triton: not installed")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            print(f"cuda:{i}: {torch.cuda.get_device_name(i)} (sm_{major}{minor})")
    else:
        print("GPU: none (CUDA not available)")
    print("\nbackends:")
    for name, backend in BACKENDS.items():
        missing = backend.unavailable()
        print(f"  {name:<10} {'unavailable: ' + '; '.join(missing) if missing else 'ready'}  {backend.description}")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        print(f"\n{device}: order {' > '.join(STATIC_ORDER.get(device, ()))}; "
              f"Hq/Hkv/D 32/8/128, page 16 unless noted")
        q_dtype = torch.float32 if device == "cpu" else torch.bfloat16
        for kv_format in formats.KV_FORMATS:
            if kv_format == "fp32" and device != "cpu":
                continue
            for decode in (True, False):
                for scale_kind in (("per_tensor", "per_head") if formats.is_fp8(kv_format) else (None,)):
                    extra = {"scale_kind": scale_kind} if scale_kind else {}
                    e = explain(device=device, q_dtype=q_dtype, kv_format=kv_format, decode=decode, **extra)
                    why = "; ".join(f"{n}: {', '.join(r)}" for n, r in e.rejected.items())
                    label = f"{kv_format}{'/' + scale_kind if scale_kind else ''} {'decode' if decode else 'extend'}"
                    print(f"  {label:<28} -> {e.chosen or 'NONE':<10} {('(passed over ' + why + ')') if why else ''}")
    if args.verbose:
        print("\n" + str(explain(**describe_attention().__dict__)))


def bench(argv) -> None:
    """A thin front for benchmarks/bench.py, which lives in the source checkout (not in the installed package)."""
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"
    if not script.exists():
        raise SystemExit("python -m attnops bench: needs a source checkout of attnops (benchmarks/bench.py)")
    sys.path.insert(0, str(script.parent))
    import bench as bench_module
    bench_module.main(argv)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its own flags: see python -m attnops bench --help
        return bench(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m attnops",
                                     description="attnops: paged-KV-cache attention ops for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="environment, GPU arch, backends, and which backend serves which case")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=info)

    p = sub.add_parser("demo", help="a paged decode loop on a small random Llama-shaped model")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--kv-format", default=None, help="bf16 (GPU default), fp32 (CPU default), fp8_e4m3, nvfp4...")
    p.set_defaults(func=lambda a: __import__("attnops.demo", fromlist=["main"]).main(a))
    sub.add_parser("bench", help="the benchmark grid against peers and the roofline (bench --help for flags)")

    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    sys.exit(main())
