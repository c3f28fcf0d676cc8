import argparse, json, os, sys
import torch
sys.path.insert(0, os.getcwd())
import benchmarks.bench_linear_logprob as B
import rl_kernel_core as rk
from rl_kernel_core import linear_chunks as LC
out = sys.argv[1]
args = argparse.Namespace(warmup=3, reps=int(os.environ.get("REPS", "11")))
shapes = [(16384, 896, 151936), (16384, 1024, 151936), (16384, 2048, 151936), (16384, 4096, 128256)]
rows = []
def bits(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))
for (n, d, v) in shapes:
    h, w, t, g = B.make(n, d, v, torch.bfloat16)
    loss_in = B._loss_inputs(4, n // 4, d, v, torch.bfloat16) if d in (1024, 4096) else None
    cases = {
        "fwd": lambda: (rk.linear_logprob(h, w, t, backend="triton"),),
        "fwd_ent": lambda: tuple(rk.linear_logprob(h, w, t, backend="triton", return_entropy=True)),
        "fwd_ent_T0.7": lambda: tuple(rk.linear_logprob(h, w, t, backend="triton", return_entropy=True, temperature=0.7)),
        "fwd_bwd": lambda: B.fwd_bwd(B.ours, h, w, t, g),
    }
    if loss_in is not None:
        cases["loss"] = lambda: B.loss_fwd_bwd(B.ours_loss, *loss_in)
    for name, fn in cases.items():
        floor = (lambda: loss_in[0].view(-1, d) @ loss_in[1].T) if name == "loss" else (lambda: h @ w.T)
        rec = {"N": n, "D": d, "V": v, "case": name}
        outs = {}
        for variant in ("generic", "specialized", "generic", "specialized"):
            if variant == "generic":
                os.environ["RLK_SM90_GENERIC"] = "1"
            else:
                os.environ.pop("RLK_SM90_GENERIC", None)
            with LC.tuned(sm90="all"), torch.set_grad_enabled(name in ("fwd_bwd", "loss")):
                o = fn()
                outs.setdefault(variant, o)
                r = B.paired_ratio(fn, floor, args)
            rec.setdefault(variant, []).append(r)
        rec["same_bits"] = bits(outs["generic"], outs["specialized"])
        print(json.dumps(rec), flush=True)
        rows.append(rec)
    del h, w, t, g, loss_in, cases
    torch.cuda.empty_cache()
json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, open(os.path.join(out, "ab.json"), "w"), indent=1)
