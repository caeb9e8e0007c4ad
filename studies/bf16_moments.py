"""Which statistics can bf16 training send, and how exact is the GSNR they give? Each choice's
GSNR scale against the one from exact (float64) sums of the same bf16 gradients.

bf16 training today sends the fp32 ``Σg`` beside the fp32 squares (``"gbar": "local"``, 2.0× the
fp32 gradient's bytes per step), because DeepSpeed's own mean gradient ``ḡ`` is rounded to bf16
and meets the fp32 squares in ``s − ḡ²``. The choices compared, per optimizer step:

* ``local``: fp32 ``Σg`` and ``Σg²`` summed locally and reduced (today's bf16 default; 2.0×);
* ``engine``: fp32 ``Σg²`` and DeepSpeed's ``ḡ`` (each micro-step's mean over the ranks rounded to
  bf16, as its bf16 reduction leaves it, then accumulated in fp32; 1.0×);
* ``engine, bf16 squares``: the same with the squares sent in bf16 (0.5×);
* ``shifted``: a second moment around a stale mean, ``Σ(g − c)²`` with ``c`` the last step's ``ḡ``
  (kept full-size on every rank in bf16: +2 B/param), in fp32, and DeepSpeed's ``ḡ``:
  ``var = Σ(g − c)²/n − (ḡ − c)²`` (1.0×, plus ``c``'s 0.5× where ZeRO has to all-gather it);
* ``shifted, bf16 squares``: the shifted squares sent in bf16 (0.5×, plus ``c``'s).

The model is the job's tiny BERT (``vrgd_ds.train.model``) in bf16 with fp32 master weights,
trained with LAMB on a byte-level masked-LM over the embedded corpus (the Python documentation
that ships with the interpreter), so its gradients carry real signal: the decoder bias and the
embeddings of frequent bytes reach high GSNR, where the cancellation in ``s − ḡ²`` bites. At each
step ``n`` groups (``--ranks`` × ``--micro``) of micro-batch gradients; the GSNR scale is the one
the optimizer applies, ``clamp(r / mean_tensor(r), gamma, 1)``. Reported per choice: the largest
and mean absolute error of the scale against the exact sums, the share of elements off by more
than 0.01, and the relative error of the mean raw GSNR.

    python studies/bf16_moments.py [--steps 40] [--out docs/studies/bf16_moments]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


CHOICES = {  # name: (extra bytes per step in fp32 gradients, extra memory per rank in B/param)
    "local": (2.0, 8),
    "engine": (1.0, 4),
    "engine, bf16 squares": (0.5, 4),
    "shifted": (1.0, 6),  # + c's all-gather under ZeRO (0.5)
    "shifted, bf16 squares": (0.5, 6),
}


def corpus_bytes(limit: int = 2_000_000) -> torch.Tensor:
    import pydoc_data.topics

    text = "\n".join(pydoc_data.topics.topics.values()).encode("utf-8", "replace")[:limit]
    return torch.tensor(list(text), dtype=torch.long)


def batch(data: torch.Tensor, size: int, seq: int, gen: torch.Generator, mask_id: int):
    """A masked-LM batch of byte sequences: 15% masked, labels elsewhere -100."""
    start = torch.randint(0, data.numel() - seq, (size,), generator=gen)
    ids = torch.stack([data[s:s + seq] for s in start.tolist()])
    masked = torch.rand(ids.shape, generator=gen) < 0.15
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    return torch.where(masked, torch.full_like(ids, mask_id), ids), labels


def scale(sum_g: torch.Tensor, var: torch.Tensor, n: int, gamma: float) -> tuple[torch.Tensor, float]:
    """The applied GSNR scale of one tensor from ``Σg`` and the variance (float64), and its raw mean."""
    gbar = sum_g / n
    r = gbar * gbar / (var.clamp_min(0) + 1e-12)
    mean = float(r.mean())
    if mean <= 0:
        return torch.ones_like(r), mean
    return (r / mean).clamp(gamma, 1.0), mean


def statistics(grads: list[list[torch.Tensor]], prev: list[torch.Tensor] | None, ranks: int,
               gamma: float) -> dict[str, dict[str, float]]:
    """``grads[d][i]``: group d's bf16 gradient of tensor i (groups rank-major: rank r's micro-steps
    are ``grads[r*micro:(r+1)*micro]``). Each choice's scale error against exact sums."""
    n = len(grads)
    micro = n // ranks
    out = {c: dict(max_err=0.0, sum_err=0.0, over=0.0, count=0.0, mean_r=0.0, mean_r_exact=0.0) for c in CHOICES}
    for i in range(len(grads[0])):
        g64 = torch.stack([g[i].double() for g in grads])  # the bf16 values, exactly
        exact_sum, exact_sq = g64.sum(0), (g64 * g64).sum(0)
        exact, r_exact = scale(exact_sum, exact_sq / n - (exact_sum / n) ** 2, n, gamma)
        g32 = [g[i].float() for g in grads]
        local_sum = torch.stack(g32).sum(0).double()
        local_sq = torch.stack([x * x for x in g32]).sum(0).double()
        # DeepSpeed's bf16 reduction: each micro-step's mean over the ranks in bf16, accumulated in fp32
        engine = torch.zeros_like(g32[0])
        for m in range(micro):
            ranks_sum = grads[m][i]
            for r in range(1, ranks):
                ranks_sum = ranks_sum + grads[r * micro + m][i]  # bf16 adds, as a bf16 all-reduce
            engine += (ranks_sum / ranks).float()
        engine_sum = engine.double() * ranks  # Σg = n · mean over groups
        # squares sent in bf16: each rank's local fp32 sum rounded once
        sq_bf16 = sum(torch.stack([x * x for x in g32[r * micro:(r + 1) * micro]]).sum(0).bfloat16().double()
                      for r in range(ranks))
        c = prev[i].bfloat16().float() if prev is not None else torch.zeros_like(g32[0])
        shifted_local = [torch.stack([(x - c) ** 2 for x in g32[r * micro:(r + 1) * micro]]).sum(0)
                         for r in range(ranks)]
        shifted = sum(s.double() for s in shifted_local)
        shifted_bf16 = sum(s.bfloat16().double() for s in shifted_local)
        dev = engine_sum / n - c.double()
        variants = {
            "local": (local_sum, local_sq / n - (local_sum / n) ** 2),
            "engine": (engine_sum, local_sq / n - (engine_sum / n) ** 2),
            "engine, bf16 squares": (engine_sum, sq_bf16 / n - (engine_sum / n) ** 2),
            "shifted": (engine_sum, shifted / n - dev * dev),
            "shifted, bf16 squares": (engine_sum, shifted_bf16 / n - dev * dev),
        }
        for name, (sg, var) in variants.items():
            got, r_mean = scale(sg, var, n, gamma)
            err = (got - exact).abs()
            o = out[name]
            o["max_err"] = max(o["max_err"], float(err.max()))
            o["sum_err"] += float(err.sum())
            o["over"] += float((err > 0.01).sum())
            o["count"] += err.numel()
            o["mean_r"] += r_mean * err.numel()
            o["mean_r_exact"] += r_exact * err.numel()
    return {c: dict(max_err=o["max_err"], mean_err=o["sum_err"] / o["count"], share_over_1pct=o["over"] / o["count"],
                    mean_gsnr_rel_err=abs(o["mean_r"] - o["mean_r_exact"]) / o["mean_r_exact"]) for c, o in out.items()}


def run(args: argparse.Namespace) -> dict:
    from vrgd_ds import Lamb
    from vrgd_ds.train.config import ModelConfig
    from vrgd_ds.train.model import build_model

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    data = corpus_bytes()
    vocab, mask_id = 258, 256
    master = build_model(ModelConfig(size="tiny"), vocab, args.seq, next_sentence=False)
    model = build_model(ModelConfig(size="tiny"), vocab, args.seq, next_sentence=False).bfloat16()
    model.load_state_dict({k: v.bfloat16() for k, v in master.state_dict().items()})
    params, mparams = list(model.parameters()), list(master.parameters())
    opt = Lamb(mparams, lr=args.lr, weight_decay=0.01)
    n = args.ranks * args.micro
    prev = None
    rows = []
    for step in range(1, args.steps + 1):
        grads = []
        for _ in range(n):
            ids, labels = batch(data, args.micro_batch, args.seq, gen, mask_id)
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=labels).loss.backward()
            grads.append([p.grad.detach().clone() for p in params])
        if step in args.at:
            res = statistics(grads, prev, args.ranks, args.gamma)
            rows.append(dict(step=step, **{c: res[c] for c in CHOICES}))
            print(f"step {step}: " + "; ".join(f"{c} max {r['max_err']:.3g} mean {r['mean_err']:.2e}"
                                               for c, r in res.items()), flush=True)
        for p, mp, i in zip(params, mparams, range(len(params))):
            mp.grad = torch.stack([g[i].float() for g in grads]).mean(0)
        prev = [mp.grad.clone() for mp in mparams]  # the step's mean gradient: next step's shift c
        opt.step()
        with torch.no_grad():
            for p, mp in zip(params, mparams):
                p.copy_(mp.bfloat16())
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    return dict(rows=rows, settings=settings, choices={c: dict(bytes=b, memory=m) for c, (b, m) in CHOICES.items()})


def write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = result["rows"]
    worst = {c: max(r[c]["max_err"] for r in rows) for c in CHOICES}
    mean = {c: sum(r[c]["mean_err"] for r in rows) / len(rows) for c in CHOICES}
    over = {c: max(r[c]["share_over_1pct"] for r in rows) for c in CHOICES}
    gsnr = {c: max(r[c]["mean_gsnr_rel_err"] for r in rows) for c in CHOICES}
    text = ["# bf16 statistics: the GSNR scale each choice gives, against exact sums\n",
            f"`python studies/bf16_moments.py` (steps {result['settings']['at']} of {result['settings']['steps']}, "
            f"n = {result['settings']['ranks']} ranks × {result['settings']['micro']} micro-steps, tiny BERT in bf16, "
            "byte-level MLM on the embedded corpus). The scale is clamp(r / mean_tensor(r), gamma, 1); errors are "
            "over every element of every tensor: the mean error averaged over the steps measured, the other "
            "columns the worst of them.\n",
            common.table(["choice", "bytes per step (fp32 gradients)", "extra B/param per rank",
                          "largest scale error", "mean scale error", "elements off by > 0.01",
                          "mean-GSNR relative error"],
                         [(c, f"{result['choices'][c]['bytes']:.1f}×" + (" + c's 0.5×" if c.startswith("shifted")
                                                                         else ""),
                           result["choices"][c]["memory"], f"{worst[c]:.3g}", f"{mean[c]:.2e}", f"{over[c]:.2%}",
                           f"{gsnr[c]:.2e}") for c in CHOICES])]
    (out / "README.md").write_text("\n".join(text))
    (out / "result.json").write_text(json.dumps(dict(result, machine=common.machine()), indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--at", type=int, nargs="+", default=[2, 10, 20, 40], help="steps whose statistics are compared")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--micro", type=int, default=4, help="micro-steps per rank (n = ranks × micro)")
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=4e-3)
    ap.add_argument("--gamma", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(common.DOCS / "bf16_moments"))
    args = ap.parse_args(argv)
    at = args.at
    args.at = [s for s in at if 1 <= s <= args.steps]
    if not args.at:  # before training: nothing would be compared, and write() has no row to report
        ap.error(f"no step of --at {' '.join(map(str, at))} is within --steps {args.steps} (steps 1 to {args.steps})")
    t0 = time.time()
    result = run(args)
    result["seconds"] = round(time.time() - t0, 1)
    write(result, Path(args.out))
    print(Path(args.out, "README.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
