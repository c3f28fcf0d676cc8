import argparse, json, os, sys, time
import torch
sys.path.insert(0, os.getcwd())
import benchmarks.bench_linear_logprob as B
import rl_kernel_core as rk
from rl_kernel_core import linear_chunks as LC

out = sys.argv[1]
args = argparse.Namespace(warmup=3, reps=int(os.environ.get("REPS", "9")))
staggers = [int(s) for s in os.environ.get("STAGGERS", "0,1,2,3").split(",")]
shapes = [(16384, 896, 151936), (16384, 1024, 151936), (16384, 2048, 151936), (16384, 4096, 128256)]
rows = []
def fwd(h, w, t, ent):
    with torch.no_grad():
        r = rk.linear_logprob(h, w, t, backend="triton", return_entropy=ent)
    return r
def bits(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))
for (n, d, v) in shapes:
    h, w, t, g = B.make(n, d, v, torch.bfloat16)
    hh = h.view(4, n // 4, d)
    ref = {}
    for s in staggers:
        os.environ["RLK_SM90_STAGGER"] = str(s)
        rec = {"N": n, "D": d, "V": v, "stagger": s}
        with LC.tuned(sm90="all"):
            o = (fwd(h, w, t, False),)
            ref.setdefault("fwd", o); rec["fwd_same_bits"] = bits(o, ref["fwd"])
            rec["fwd"] = B.paired_ratio(lambda: fwd(h, w, t, False), lambda: h @ w.T, args)
            o = tuple(fwd(h, w, t, True))
            ref.setdefault("fwd_ent", o); rec["fwd_ent_same_bits"] = bits(o, ref["fwd_ent"])
            rec["fwd_ent"] = B.paired_ratio(lambda: fwd(h, w, t, True), lambda: h @ w.T, args)
        o = B.fwd_bwd(B.ours, h, w, t, g)
        ref.setdefault("fb", o); rec["fb_same_bits"] = bits(o, ref["fb"])
        rec["fwd_bwd"] = B.paired_ratio(lambda: B.fwd_bwd(B.ours, h, w, t, g), lambda: h @ w.T, args)
        if d in (1024, 4096):
            lh, lw, lt, old, adv, mask = B._loss_inputs(4, n // 4, d, v, torch.bfloat16)
            o = B.loss_fwd_bwd(B.ours_loss, lh, lw, lt, old, adv, mask)
            ref.setdefault("loss", o); rec["loss_same_bits"] = bits(o, ref["loss"])
            rec["loss"] = B.paired_ratio(lambda: B.loss_fwd_bwd(B.ours_loss, lh, lw, lt, old, adv, mask), lambda: lh.view(-1, d) @ lw.T, args)
            del lh, lw, lt, old, adv, mask
        print(json.dumps(rec), flush=True)
        rows.append(rec)
    del h, w, t, g, ref
    torch.cuda.empty_cache()
json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, open(os.path.join(out, "stagger.json"), "w"), indent=1)
