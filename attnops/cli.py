"""`python -m attnops {info,demo,warmup,bench,serve-bench,tune}`."""
from __future__ import annotations

import argparse
import platform
import sys

import torch

from .formats import KV_FORMATS


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
        print(f"  {name:<10} {backend.description}")
        print(f"  {'':<10} {'unavailable: ' + '; '.join(missing) if missing else 'ready'}")
    from .backends import flashinfer_replay
    if not flashinfer_replay.built():
        replay = "not in this build (build attnops with a CUDA torch after installing FlashInfer to get it)"
    elif flashinfer_replay.enabled():
        replay = "on"
    else:
        replay = "off (ATTNOPS_FLASHINFER_REPLAY=0, or tvm-ffi's library cannot be loaded)"
    print(f"  a step's later FlashInfer calls replayed from C++: {replay}")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        from .dispatch import arch_table, rule_arch
        from .env import device_arch
        arch = rule_arch(device_arch(torch.device(device)))
        measured = arch_table(arch).get("rule") if arch else None
        order = (f"the rule measured on sm_{arch[0]}{arch[1]} (attnops/tables; `python -m attnops tune` prints it), "
                 f"then " if measured else "") + " > ".join(STATIC_ORDER.get(device, ()))
        print(f"\n{device}: order {order}; Hq/Hkv/D 32/8/128, page 16 unless noted")
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
        from .cases import MLACase
        from .dispatch import explain_case
        for kv_format in ("fp32" if device == "cpu" else "bf16", "fp8_e4m3", "fp8_ds_mla"):  # DeepSeek's R 512,
            # P 64, 16 heads
            case = MLACase(device_type=device, arch=device_arch(torch.device(device)), q_dtype=q_dtype,
                           kv_format=kv_format, latent_dim=512, rope_dim=64, num_heads=16, page_size=64, decode=True)
            e = explain_case(case)
            why = "; ".join(f"{n}: {', '.join(r)}" for n, r in e.rejected.items())
            label = f"MLA {kv_format} decode"
            print(f"  {label:<28} -> {e.chosen or 'NONE':<10} {('(passed over ' + why + ')') if why else ''}")
    if args.verbose:
        print("\n" + str(explain(**describe_attention().__dict__)))


def warmup_shapes(args) -> list[dict]:
    """The attention shapes to warm: the flags' one, or every distinct one of the layers of --config's model
    (read by transformers where it is installed, so that per-layer head dims count; else the JSON's own fields). A
    latent-attention model (DeepSeek-V2/V3's MLA) has one: its heads and latent row (latent_dim, rope_dim)."""
    import json
    from pathlib import Path
    if not args.config:
        return [dict(num_q_heads=args.num_q_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim)]
    path = Path(args.config)
    try:
        import transformers

        from .hf import model_shape
        config = transformers.AutoConfig.from_pretrained(path.parent if path.is_file() else path)
        shape = model_shape(config)
        if shape.latent_dim:  # (a sparse one's: the keys its indexer picks a query, its own kernel variant)
            return [dict(num_q_heads=shape.num_attention_heads, latent_dim=shape.latent_dim,
                         rope_dim=shape.rope_dim, topk=getattr(config, "index_topk", 0) or 0)]
        layers = zip(shape.layer_kv_heads or [shape.num_key_value_heads],
                     shape.layer_head_dims or [shape.head_dim])
        return [dict(num_q_heads=shape.num_attention_heads, num_kv_heads=h, head_dim=d)
                for h, d in dict.fromkeys(layers)]
    except ImportError:  # no transformers: the config's own fields (a multimodal one's text_config)
        config = json.loads((path if path.is_file() else path / "config.json").read_text())
        config = config.get("text_config", config)
        heads = config["num_attention_heads"]
        if config.get("kv_lora_rank"):
            return [dict(num_q_heads=heads, latent_dim=config["kv_lora_rank"],
                         rope_dim=config["qk_rope_head_dim"], topk=config.get("index_topk") or 0)]
        return [dict(num_q_heads=heads, num_kv_heads=config.get("num_key_value_heads", heads),
                     head_dim=config.get("head_dim") or config["hidden_size"] // heads)]


def _warm_step(shape: dict, cache, mode: str, q_len: int, dtype, device) -> dict:
    """One tiny step of `mode` on `cache` (layer 0): the cache write and the attention call of the shape's op;
    returns the attention op's arguments (for explain)."""
    cache.allocate(mode)
    meta = cache.prepare([mode], q_len, decode=mode == "decode")
    heads, tokens = shape["num_q_heads"], meta.num_tokens
    if "latent_dim" in shape:
        latent, rope = shape["latent_dim"], shape["rope_dim"]
        torch.ops.attnops.mla_cache_write(torch.randn(tokens, latent, device=device, dtype=dtype),
                                          torch.randn(tokens, rope, device=device, dtype=dtype),
                                          slot_mapping=meta.slot_mapping, **cache.write_args(0))
        op_args = dict(q_nope=torch.randn(tokens, heads, latent, device=device, dtype=dtype),
                       q_pe=torch.randn(tokens, heads, rope, device=device, dtype=dtype),
                       block_table=meta.block_table, seq_lens=meta.seq_lens, cu_seqlens_q=meta.cu_seqlens_q,
                       scale=(latent + rope) ** -0.5, **cache.attention_args(0))
        if shape.get("topk"):  # the sparse form: each query's picks (here the first positions, -1 past its own)
            picks = torch.arange(shape["topk"], dtype=torch.int32, device=device).expand(tokens, -1)
            op_args["topk_indices"] = torch.where(picks < meta.seq_lens.max(), picks, -1).contiguous()
        torch.ops.attnops.mla_attention(**op_args)
        return op_args
    k = torch.randn(tokens, shape["num_kv_heads"], shape["head_dim"], device=device, dtype=dtype)
    torch.ops.attnops.reshape_and_cache(k, k, slot_mapping=meta.slot_mapping, **cache.write_args(0))
    q = torch.randn(tokens, heads, shape["head_dim"], device=device, dtype=dtype)
    op_args = dict(q=q, block_table=meta.block_table, seq_lens=meta.seq_lens, cu_seqlens_q=meta.cu_seqlens_q,
                   **cache.attention_args(0))
    torch.ops.attnops.paged_attention(**op_args)
    return op_args


def warmup(args) -> None:
    """Runs one tiny call of every configuration a model needs (decode, verify, prefill; its dtypes and KV format;
    each distinct head shape of its layers) so that FlashInfer JIT-builds and Triton compiles now, not on a
    server's first request."""
    from tqdm import tqdm

    from .dispatch import explain
    from .serving.kv_cache import LatentKVCache, PagedKVCache

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    shapes = warmup_shapes(args)
    steps = [("prefill", 300), ("verify", 4), ("decode", 1)]
    with tqdm(total=len(shapes) * len(steps), desc="attnops warmup", unit="config") as progress:
        for shape in shapes:
            if "latent_dim" in shape:
                cache = LatentKVCache(1, 64, args.page_size, shape["latent_dim"], shape["rope_dim"],
                                      kv_format=args.kv_format, device=device)
                label = f"MLA {shape['num_q_heads']}/{shape['latent_dim']}+{shape['rope_dim']}" + \
                    (f" top-{shape['topk']}" if shape.get("topk") else "")
            else:
                cache = PagedKVCache(1, 64, args.page_size, shape["num_kv_heads"], shape["head_dim"],
                                     kv_format=args.kv_format, device=device)
                label = f"{shape['num_q_heads']}/{shape['num_kv_heads']}/{shape['head_dim']}"
            for mode, q_len in steps:
                op_args = _warm_step(shape, cache, mode, q_len, dtype, device)
                progress.write(f"  {label} {mode:<8} -> {explain(**op_args).chosen}")
                progress.update(1)
    if device == "cuda":
        torch.cuda.synchronize()


def demo(args) -> None:
    """The serving kit's demo on a transformers decoder served through attnops.hf (built here: the demo's layer
    does not reach up to attnops.hf): --model (a family or a checkpoint; default llama), --checkpoint DIR the same
    as --model DIR."""
    from .serving import demo as serving_demo
    if args.model and args.checkpoint:
        sys.exit("demo: --model and --checkpoint each name the model: give one")
    name = args.checkpoint or args.model or "llama"
    try:
        from . import hf
        from .hf import families
    except ImportError as e:  # transformers is missing, or too old
        sys.exit(f"demo: {e}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # what run_demo runs in
    # a real-shaped model is slow on a CPU
    tiny = device.type == "cpu" and (name in families.FAMILIES or name in families.MLA_FAMILIES)
    flag = "--checkpoint" if args.checkpoint else "--model"
    try:
        model = hf.serving_model(families.load(name, device=device, dtype=dtype, tiny=tiny))
    except (ValueError, OSError) as e:  # not a family, or a checkpoint transformers cannot load
        sys.exit(f"demo: {flag}: {e}")
    serving_demo.main(args, model=model, description=f"{families.describe(name, tiny)} (transformers' modeling code)")


def run_benchmark(module: str, argv) -> None:
    """The benchmark commands live in attnops.bench (installed with the package) and parse their own flags."""
    import importlib
    importlib.import_module(f"attnops.bench.{module}").main(argv)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    benchmarks = {"bench": "run", "serve-bench": "serve", "tune": "tune"}
    if argv[:1] and argv[0] in benchmarks:  # their own flags: see python -m attnops bench --help
        return run_benchmark(benchmarks[argv[0]], argv[1:])
    parser = argparse.ArgumentParser(prog="python -m attnops",
                                     description="attnops: paged-KV-cache attention ops for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="environment, GPU arch, backends, and which backend serves which case")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also print the full explanation of one case (32/8/128 bf16 decode on this device)")
    p.set_defaults(func=info)

    p = sub.add_parser("demo", help="a paged decode loop on a transformers decoder served through attnops (needs "
                                    "attnops[hf]): a random Llama-shaped model, or --model")
    p.add_argument("--batch", type=int, default=4, help="sequences decoded together (default 4)")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens of each random prompt (default 32)")
    p.add_argument("--steps", type=int, default=32, help="tokens generated per sequence (default 32)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--kv-format", default=None, help="bf16 (GPU default), fp32 (CPU default), fp8_e4m3, nvfp4...")
    p.add_argument("--modes", nargs="+", choices=("compiled+graphs", "compiled", "eager"),
                   help="how the decode step runs, each mode a run of its own: compiled+graphs = torch.compile'd and "
                        "CUDA-graph replayed (GPU only). Default: compiled+graphs then eager on a GPU, eager on a CPU")
    p.add_argument("--model", default=None,
                   help="the transformers decoder served through attnops: a family, random weights of a real "
                        "model's shape on a GPU, tiny on a CPU (llama: Llama-3.2-1B, the default; qwen2: "
                        "Qwen2.5-7B, qwen3: Qwen3-8B, mistral: Mistral-7B, gemma2: gemma-2-2b, gpt-oss: "
                        "gpt-oss-20b, phi3: Phi-3-mini; deepseek_v3: DeepSeek-V3's latent attention, 4 of its "
                        "layers; deepseek_v32: DeepSeek-V3.2's, its indexer's sparse picks), or a "
                        "checkpoint directory or hub name")
    p.add_argument("--checkpoint", default=None, help="a Hugging Face checkpoint directory: the same as --model DIR")
    p.set_defaults(func=demo)
    p = sub.add_parser("warmup", help="build every kernel configuration a model needs now (FlashInfer JIT, "
                                      "Triton compile), so a server does not stall on its first request")
    p.add_argument("--config", help="a Hugging Face config.json or its directory (heads and head_dim read from it; "
                                    "every distinct shape of its layers, as Gemma-4's head dims 256 and 512; a "
                                    "DeepSeek-V2/V3 config warms latent attention, mla_attention)")
    p.add_argument("--num-q-heads", type=int, default=32, help="query heads (default 32; or from --config)")
    p.add_argument("--num-kv-heads", type=int, default=8, help="KV heads (default 8; or from --config)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim (default 128; or from --config)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="q, key and value dtype")
    p.add_argument("--kv-format", default="bf16", help="the cache's format: " + ", ".join(KV_FORMATS) +
                   " (latent attention: bf16, fp16, fp32, fp8_e4m3, fp8_ds_mla)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.set_defaults(func=warmup)
    sub.add_parser("bench", help="the benchmark grid against peers and the roofline (bench --help for flags)")
    sub.add_parser("serve-bench", help="decode tokens/s of a model family through attnops (eager, compiled, "
                                       "compiled + CUDA graphs) and through transformers (serve-bench --help)")
    sub.add_parser("tune", help="measure every backend on this GPU and write its dispatch table (tune --help)")

    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    sys.exit(main())
