"""Device diagnostic: do FlashInfer and Triton differ by rounding or by a bug in the e2e flow?"""
import sys, tempfile, pathlib, torch
sys.path.insert(0, "tests")
import test_e2e as t
import attnops
from attnops.model import LlamaForCausalLM
from attnops.testing import relative_error
from attnops.generate import DecodeStep

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("reference", "flashinfer", "triton") if DEV == "cuda" else ("reference", "cpu")
path = pathlib.Path(tempfile.mkdtemp())
t.make_checkpoint(path, hidden_size=t.TINY["num_attention_heads"] * 64, head_dim=64)

def forced(model, cache, prompts, force, backend):
    """prefill, then decode steps feeding force[b][step] (teacher forcing)"""
    with attnops.use_backend(backend):
        seq_ids = list(range(len(prompts)))
        for s in seq_ids:
            cache.allocate(s)
        meta = cache.prepare(seq_ids, [len(p) for p in prompts], decode=False)
        dev = cache.device
        toks = torch.tensor([x for p in prompts for x in p], device=dev)
        pos = torch.cat([torch.arange(len(p), device=dev) for p in prompts])
        prefill = model(toks, pos, cache, meta).float()
        last = prefill[meta.cu_seqlens_q[1:].long() - 1]
        step = DecodeStep(model, cache, max_batch=len(prompts), max_pages=8, buckets=(4,))
        out = [last]
        for i in range(len(force[0])):
            token = torch.tensor([f[i] for f in force], device=dev)
            out.append(step(seq_ids, token).float().clone())
        return prefill, torch.stack(out, 1)  # [B, steps+1, V]

prompts = t.PROMPTS
# oracle: fp32 model, fp32 KV, reference backend; its greedy tokens are the forced inputs
m32 = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, device=DEV)
_, _, greedy = t.attnops_greedy(m32, t.new_cache(kv_format="fp32", device=DEV, head_dim=64), prompts, steps=40)
force = [g[1:] + [0] for g in greedy]
_, oracle = forced(m32, t.new_cache(kv_format="fp32", device=DEV, head_dim=64), prompts, force, "reference")
m16 = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device=DEV)
for kv_format in ("bf16", "fp8_e4m3"):
    res = {}
    for backend in NAMES:
        try:
            res[backend] = forced(m16, t.new_cache(kv_format=kv_format, device=DEV, head_dim=64), prompts, force, backend)[1]
        except Exception as e:
            print(kv_format, backend, "failed", type(e).__name__, str(e)[:200])
    for name, lg in res.items():
        errs = [relative_error(lg[:, s], oracle[:, s]) for s in range(lg.shape[1])]
        agree = (lg.argmax(-1) == oracle.argmax(-1)).float().mean().item()
        print(f"{kv_format} {name:10s} vs fp32 oracle: rel err mean {sum(errs)/len(errs):.2e} max {max(errs):.2e}; argmax agrees {agree:.3f}")
    names = list(res)
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            a, b = res[names[i]], res[names[j]]
            errs = [relative_error(a[:, s], b[:, s]) for s in range(a.shape[1])]
            dis = (a.argmax(-1) != b.argmax(-1)).nonzero().tolist()
            top2 = a.topk(2, -1).values
            margin = (top2[..., 0] - top2[..., 1])
            print(f"{kv_format} {names[i]} vs {names[j]}: rel err mean {sum(errs)/len(errs):.2e} max {max(errs):.2e};"
                  f" argmax disagreements {dis[:8]} margins there {[round(margin[b, s].item(), 4) for b, s in dis[:8]]};"
                  f" median margin {margin.median().item():.3f}; max |dlogit| {(a-b).abs().max().item():.3f}")
# the e2e serve flow itself, per backend
for kv_format in ("bf16",):
    res = {}
    for backend in NAMES:
        cache = t.new_cache(num_pages=24, kv_format=kv_format, device=DEV, head_dim=64)
        res[backend] = t.serve(m16, t.SCHEDULE, backend=backend, cache=cache)[0]
    for name in NAMES[1:]:
        firsts = {k: next((i for i, (x, y) in enumerate(zip(res["reference"][k], res[name][k])) if x != y), None) for k in res[name]}
        print("serve", kv_format, name, "vs reference first diff per request:", firsts)
