"""What the GPU step costs, counted without a GPU: bytes moved per parameter, launches and host
synchronisations per step, and the compiled kernels' resources; then a roofline model of the
optimizer's share of a BERT-large ZeRO-2 step on A100 and H100.

A memory-bound optimizer step is decided by the bytes it moves and the width of its accesses.
Those are counted here exactly; a GPU adds only the wall-clock.

* **Bytes** — measured from the kernels' own loads and stores: every Triton kernel the step
  launches runs on CPU tensors under Triton's interpreter, which this script instruments to
  add up the bytes of every element access a kernel makes (masked-off lanes excluded), apart
  from the small per-chunk table and partial-sum accesses. Divided by the number of
  parameters: fp32 words per parameter per step, for each member and placement, and per
  micro-step for the statistics hooks (the one-process tensor hook, and the ZeRO ``per_step``
  hook that DeepSpeed's engines get).
* **Launches per step** — Triton launches plus the torch operations ``step()`` runs on the
  device (counted with a ``TorchDispatchMode``; on a GPU each is one kernel), and the
  host-to-device table copies, for a model of 5 and of 40 tensors: independent of the number of
  tensors, and no table copies once the tensors are the same.
* **Host synchronisations** — calls of ``.item()``, ``float()``, ``int()``, ``bool()``,
  ``.tolist()`` on a tensor inside ``step()``, and torch operations that read a tensor's value
  on the host (``aten._local_scalar_dense``); on a GPU each waits for the device.
* **Compiled resources** (``--aot``) — ``python -m vrgd_ds.optim.triton_aot``: registers, spills
  and the 128-bit accesses of every specialization for sm_80 and sm_90.
* **Roofline model** — BERT-large (the config's parameter shapes, built on the meta device),
  ZeRO-2 over 8 and 64 ranks, the config's first phase (global batch, micro-batch, sequence
  length): bytes per rank per step = step words x the rank's partition + hook words x all
  parameters x micro-steps; time at 2.0 TB/s (A100-80GB) and 3.35 TB/s (H100-SXM), next to
  the step's compute time at a stated MFU (6·P + 12·L·s·d FLOPs per token; dense fp16 peaks
  312 and 989 TFLOPS). This part is a model; the counts in it are measured.

Memory floors, fp32 words read + written per parameter, state in fp32 (``FLOORS``): torch
AdamW(fused) 7 (read θ, g, m, v; write θ, m, v); DeepSpeed FusedLamb 10 (one trust ratio per
flat partition); apex FusedLAMB 13 (a gradient-norm pass, stage 1 writing the update, the
per-tensor norm pass, stage 2); VRAdam 13 = AdamW's 7 + Σg, Σg² read by the GSNR pass and again
by the update (4) + the GSNR momentum read and written (2); VRLamb 16 = the same over LAMB's
two passes. Taking the GSNR pass in the statistics hook saves its 2 words (11 and 14).

    python benchmarks/gpu_static.py [--config configs/bert_large_64k_32k_vr_lamb.json] [--mfu 0.4] [--aot]
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined: before vrgd_ds imports them

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import vrgd_ds  # noqa: E402
from vrgd_ds import REGISTRY  # noqa: E402
from vrgd_ds.optim import _triton  # noqa: E402
from vrgd_ds.optim.adam import GSNR_PLACEMENTS  # noqa: E402

BANDWIDTH = {"A100-80GB": 2.0e12, "H100-SXM": 3.35e12}  # bytes/s
PEAK_FLOPS = {"A100-80GB": 312e12, "H100-SXM": 989e12}  # dense fp16/bf16 tensor-core peaks
RANKS = (8, 64)
FLOORS = {"AdamW(fused)": 7, "DS FusedLamb": 10, "apex FusedLAMB": 13, "VRAdam": 13, "VRLamb": 16}
TARGETS = {"VRAdam": 14, "VRLamb": 17}  # words per parameter per step with the hook, accumulation 1
SYNC_METHODS = ("item", "__float__", "__int__", "__bool__", "tolist", "__index__")


def cases() -> list[tuple[str, str, dict[str, Any]]]:
    """(label, registry name, overrides): every member, the Adam family at every placement."""
    out = []
    for name in REGISTRY:
        if name in ("VRAdam", "VRLamb"):
            out += [(f"{name} {pl}", name, dict(gsnr_placement=pl)) for pl in GSNR_PLACEMENTS]
        else:
            out.append((name, name, {}))
    return out


# ---- counting ---------------------------------------------------------------------------------------


#: kernels that work on per-segment tables, not on elements: their accesses count with the scalars
TABLE_KERNELS = frozenset(("_combine", "_adam_tables_kernel", "_finish_kernel"))


class Tally:
    """Bytes of every element access the interpreted Triton kernels make (unmasked lanes only),
    apart from scalar accesses (chunk tables, partial sums, per-segment columns) and the
    accesses of the kernels that work on per-segment tables (``TABLE_KERNELS``)."""

    def __init__(self) -> None:
        self.bytes = collections.Counter()
        self._kernel = ""

    def __enter__(self) -> "Tally":
        from triton.runtime import interpreter

        cls = interpreter.InterpreterBuilder
        self._cls, self._orig = cls, (cls.create_masked_load, cls.create_masked_store)
        self._grid = interpreter.GridExecutor.__call__
        load, store = self._orig
        me = self

        def named_call(executor, *args, **kwargs):
            me._kernel = getattr(executor.fn, "__name__", "")
            try:
                return me._grid(executor, *args, **kwargs)
            finally:
                me._kernel = ""

        def counted_load(builder, ptrs, mask, *args):
            me._add("read", ptrs, mask)
            return load(builder, ptrs, mask, *args)

        def counted_store(builder, ptrs, value, mask, *args):
            me._add("written", ptrs, mask)
            return store(builder, ptrs, value, mask, *args)

        cls.create_masked_load, cls.create_masked_store = counted_load, counted_store
        interpreter.GridExecutor.__call__ = named_call
        return self

    def __exit__(self, *exc) -> None:
        from triton.runtime import interpreter

        self._cls.create_masked_load, self._cls.create_masked_store = self._orig
        interpreter.GridExecutor.__call__ = self._grid

    def _add(self, kind: str, ptrs, mask) -> None:
        size = ptrs.get_element_ty().primitive_bitwidth // 8
        where = "elements" if ptrs.data.size > 1 and self._kernel not in TABLE_KERNELS else "scalars"
        self.bytes[(kind, where)] += int(mask.data.sum()) * size

    def words(self, numel: int, where: str = "elements") -> dict[str, float]:
        r, w = self.bytes[("read", where)] / 4 / numel, self.bytes[("written", where)] / 4 / numel
        return {"read": r, "written": w, "total": r + w}


class OpCount(TorchDispatchMode):
    """torch operations run (views and metadata excluded), and the largest tensor one touched."""

    _FREE = {"view", "_unsafe_view", "alias", "detach", "t", "expand", "select", "slice", "unsqueeze", "squeeze",
             "reshape", "as_strided", "permute", "transpose", "narrow", "empty", "empty_strided", "lift_fresh",
             "_to_copy_meta",
             "_record_function_enter_new", "_record_function_exit"}  # torch.optim's profiler marks: no device work

    def __init__(self) -> None:
        super().__init__()
        self.ops, self.largest, self._paused, self.syncs = collections.Counter(), 0, 0, 0

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__.rstrip("_")
        if name == "_local_scalar_dense" and not self._paused:  # a tensor's value read on the host
            self.syncs += 1
        if name not in self._FREE and not self._paused:
            self.ops[name] += 1
            for a in list(args) + list((kwargs or {}).values()):
                for t in a if isinstance(a, (list, tuple)) else (a,):
                    if isinstance(t, torch.Tensor):
                        self.largest = max(self.largest, t.numel())
        return out


class SyncSpy:
    """Host synchronisations: reads of a tensor's value into Python."""

    def __enter__(self) -> "SyncSpy":
        self.calls, self._orig = [], {}
        for m in SYNC_METHODS:
            self._orig[m] = getattr(torch.Tensor, m)

            def spy(t, *a, _m=m, **k):
                self.calls.append(_m)
                return self._orig[_m](t, *a, **k)

            setattr(torch.Tensor, m, spy)
        return self

    def __exit__(self, *exc) -> None:
        for m, f in self._orig.items():
            setattr(torch.Tensor, m, f)


def host_syncs(syncs: SyncSpy, ops: "OpCount") -> int:
    """Host reads of a tensor's value: each dispatches ``_local_scalar_dense`` (``ops.syncs``)
    except ``tolist``, which reads the storage without a dispatch (counted by ``syncs``)."""
    return ops.syncs + syncs.calls.count("tolist")


# ---- measurements -----------------------------------------------------------------------------------


def _model(tensors: int, seed: int = 0) -> nn.ParameterList:
    """Tensors of many sizes (two chunks, whole blocks and a partial one, a few elements), then
    small ones up to ``tensors``."""
    g = torch.Generator().manual_seed(seed)
    sizes = [_triton.CHUNK + 5, 8 * _triton.BLOCK + 3, 4096, 1000, 7] + [100 + i for i in range(tensors)]
    return nn.ParameterList([nn.Parameter(torch.randn(n, generator=g)) for n in sizes[:tensors]])


def _backward(ps: nn.ParameterList, micro: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(micro):
        loss = sum(((p * (torch.randn(p.shape, generator=g) + 0.3)).sum() + 0.05 * p.square().sum()) for p in ps)
        loss.backward()


def measure_step(name: str, over: dict[str, Any], tensors: int = 5, micro: int = 2) -> dict[str, Any]:
    """One steady step (state exists, tables cached) of ``name`` on the Triton kernels."""
    info = REGISTRY[name]
    ps = _model(tensors)
    opt = info.cls(list(ps), fused="triton", lr=info.test_kwargs["lr"], **over)  # the member's defaults
    numel = sum(p.numel() for p in ps)
    _backward(ps, micro, 1)
    opt.step()
    opt.zero_grad()
    kernels = opt.kernels()
    out: dict[str, Any] = {}
    with Tally() as hook:
        _backward(ps, micro, 2)
    before = dict(kernels.counts)
    launch = kernels._launch

    def launch_uncounted(*args, **kwargs):  # the interpreter's own torch ops are no GPU kernels
        with ops.paused():
            return launch(*args, **kwargs)

    kernels._launch = launch_uncounted
    with Tally() as step, OpCount() as ops, SyncSpy() as syncs:
        opt.step()
    kernels._launch = launch
    out["triton_launches"] = kernels.counts["launches"] - before["launches"]
    out["table_copies"] = kernels.counts["table_copies"] - before["table_copies"]
    opt.zero_grad()
    _backward(ps, micro, 3)
    if opt._hook_stats is not None:  # as under DeepSpeed/DDP: the statistics come by collective, the step
        opt._hook_stats._moments.clear()  # runs its own GSNR pass
    with Tally() as own:
        opt.step()
    out["zero_step_words"] = own.words(numel)["total"]
    out["step_words"] = step.words(numel)
    out["hook_words_per_micro_step"] = hook.words(numel * micro)["total"]
    out["scalar_bytes_per_step"] = step.bytes[("read", "scalars")] + step.bytes[("written", "scalars")]
    out["torch_ops"] = sum(ops.ops.values())
    out["torch_ops_by_name"] = dict(ops.ops)
    out["largest_torch_op_tensor"] = ops.largest
    out["host_syncs"] = host_syncs(syncs, ops)
    out["numel"], out["tensors"] = numel, tensors
    return out


def measure_flat_step(name: str, segments: int) -> dict[str, Any]:
    """A steady step of ``name`` on one flat ZeRO partition of ``segments`` tensors (a rank's view:
    the statistics arrive by collective, per-tensor sums through a ``Layout``), on one rank:
    Triton launches, torch operations (by name) and host syncs."""
    from vrgd_ds.stats.layout import Layout

    sizes = [100 + i for i in range(segments)]
    p = nn.Parameter(torch.randn(sum(sizes), generator=torch.Generator().manual_seed(0)) * 0.02)
    p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 1e-3
    info = REGISTRY[name]
    opt = info.cls([p], fused="triton", lr=info.test_kwargs["lr"], weight_decay=0.01)
    layout = Layout([str(i) for i in range(segments)], sizes, group=None)
    layout.add(p, [(sum(sizes[:i]), sizes[i], i) for i in range(segments)])

    sums = [p.grad * 4], [p.grad.square() * 4 + 1e-6]

    class Reduced:  # statistics an engine's collective delivered: the same every step
        n = 4

        def moments(self, params):
            return sums

        def reset(self):
            pass

    opt.set_statistics_source(Reduced(), layout)
    opt.step()
    opt.step()
    kernels = opt.kernels()
    before = kernels.counts["launches"]
    launch = kernels._launch

    def launch_uncounted(*args, **kwargs):  # the interpreter's own torch ops are no GPU kernels
        with ops.paused():
            return launch(*args, **kwargs)

    kernels._launch = launch_uncounted
    with OpCount() as ops, SyncSpy() as syncs:
        opt.step()
    kernels._launch = launch
    return {"triton_launches": kernels.counts["launches"] - before, "torch_ops": sum(ops.ops.values()),
            "torch_ops_by_name": dict(ops.ops), "host_syncs": host_syncs(syncs, ops), "segments": segments}


def measure_hooks() -> dict[str, dict[str, float]]:
    """Words per parameter per micro-step of the statistics hooks' kernels, first and later
    micro-steps: the one-process tensor hook (``accumulate_moments``; the last backward also
    takes pass 1) and the ZeRO ``per_step`` statistics from an engine bucket (``pack_bucket`` over an
    fp16 bucket of three tensors, with ḡ summed locally or taken from the engine)."""
    k = _triton.Triton()
    n = 3 * _triton.HOOK_SPAN + 5
    out = {}
    for gdt in (torch.float32, torch.bfloat16):
        grad = torch.randn(n).to(gdt)
        sg, sq = torch.zeros(n), torch.zeros(n)
        for label, fresh, inv_n in (("first", True, 0.0), ("later", False, 0.0), ("last (+pass 1)", False, 0.25)):
            with Tally() as t:
                k.accumulate_moments(grad, sg, sq, fresh, inv_n, 1e-12)
            out[f"tensor hook, {str(gdt)[6:]} gradient, {label}"] = t.words(n)
    from vrgd_ds.optim.columns import BucketTable

    x = torch.randn(n).half()
    both = torch.zeros(2 * n + 8)
    for with_g in (False, True):
        for label, acc in (("first", False), ("later", True)):
            # one engine bucket of three tensors, written fresh or added to: its [Σg | Σg²] layout
            cuts = [0, n // 3, 2 * n // 3, n]
            table = BucketTable(torch.tensor([[a, a, n + 4 + a, b - a, int(acc)] for a, b in zip(cuts, cuts[1:])]))
            with Tally() as t:
                k.pack_bucket(x, table, both, 0.5, 0.5 if with_g else None)
            gbar = "local" if with_g else "engine"
            out[f"ZeRO per_step bucket, fp16 gradient, gbar={gbar}, {label}"] = t.words(n)
    return out


# ---- BERT-large roofline ----------------------------------------------------------------------------


def bert_shapes(config: pathlib.Path) -> dict[str, Any]:
    """Parameter count, tensors and dimensions of the config's model, built on the meta device."""
    from vrgd_ds.train.config import MODEL_SIZES, ModelConfig
    from vrgd_ds.train.model import build_model

    raw = json.loads(config.read_text())
    job = raw["job"]
    cfg = ModelConfig(**job["model"])
    phase = job["phases"][0]
    with torch.device("meta"):
        model = build_model(cfg, job["data"]["vocab_size"], phase["seq_len"], next_sentence=True)
    params = [p for p in model.parameters() if p.requires_grad]
    size = dict(MODEL_SIZES[cfg.size], **cfg.overrides)
    return dict(params=sum(p.numel() for p in params), tensors=len(params), layers=size["num_hidden_layers"],
                hidden=size["hidden_size"], vocab=job["data"]["vocab_size"], seq=phase["seq_len"],
                global_batch=phase["global_batch"],
                micro_batch=phase["micro_batch"], optimizer=raw["optimizer"]["type"])


MASKED_SHARE = 0.15  # positions the MLM head predicts: the data pipeline's mlm_probability (BERT's)


def roofline(shapes: dict[str, Any], step_words: dict[str, float], hook: dict[str, float], mfu: float) -> list[dict]:
    """Per member, ranks and GPU: the optimizer step's and the hooks' bytes and roofline time
    per rank, against the training step's compute time at ``mfu``."""
    P, L, d, s, V = shapes["params"], shapes["layers"], shapes["hidden"], shapes["seq"], shapes["vocab"]
    # 6·P counts the MLM head's transform (d × d) and tied decoder (d × V) at every position; the
    # job's model runs them at the masked ones only (vrgd_ds/train/model.py)
    flops_per_token = 6 * P + 12 * L * s * d - 6 * (1 - MASKED_SHARE) * (d * d + d * V)
    rows = []
    for ranks in RANKS:
        micro = max(1, shapes["global_batch"] // (ranks * shapes["micro_batch"]))
        tokens = shapes["global_batch"] * s / ranks
        owned = -(-P // ranks)
        for label, words in step_words.items():
            vr = label.startswith("VR")
            hook_words = (hook["first"] + (micro - 1) * hook["later"]) if vr else 0.0
            step_bytes, hook_bytes = words * owned * 4, hook_words * P * 4
            for gpu, bw in BANDWIDTH.items():
                compute = flops_per_token * tokens / (PEAK_FLOPS[gpu] * mfu)
                t_step, t_hook = step_bytes / bw, hook_bytes / bw
                rows.append(dict(member=label, ranks=ranks, micro_steps=micro, gpu=gpu, step_gb=step_bytes / 1e9,
                                 hook_gb=hook_bytes / 1e9, step_ms=t_step * 1e3, hook_ms=t_hook * 1e3,
                                 compute_ms=compute * 1e3, share=(t_step + t_hook) / (compute + t_step + t_hook)))
    return rows


# ---- report -------------------------------------------------------------------------------------------


def _aot() -> dict[str, Any] | None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "0"
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "aot.json"
        out = subprocess.run([sys.executable, "-m", "vrgd_ds.optim.triton_aot", "--json", str(path)], env=env,
                             capture_output=True, text=True, cwd=ROOT)
        if not path.exists():
            print(out.stdout, out.stderr, file=sys.stderr)
            return None
        return dict(json.loads(path.read_text()), exit=out.returncode)


def report(args: argparse.Namespace) -> dict[str, Any]:
    steps = {label: measure_step(name, over) for label, name, over in cases()}
    many = {label: measure_step(name, over, tensors=40) for label, name, over in cases()
            if label in ("VRLamb first_moment", "VRAdam first_moment", "VRLars", "Lamb")}
    flat = {(name, k): measure_flat_step(name, k) for name in ("VRLamb", "VRAdam", "Lamb", "VRMomentum", "VRLars")
            for k in (8, 64)}
    hooks = measure_hooks()
    shapes = bert_shapes(pathlib.Path(args.config))
    # ZeRO-2 in fp16 (the config): the per_step hook with ḡ summed locally (gbar "auto" in fp16)
    zero_hook = {"first": hooks["ZeRO per_step bucket, fp16 gradient, gbar=local, first"]["total"],
                 "later": hooks["ZeRO per_step bucket, fp16 gradient, gbar=local, later"]["total"]}
    # under ZeRO the statistics arrive by collective, so the step runs its own GSNR pass: the
    # words of a step whose hooks did not take it (measured with the pass, see measure_step)
    zero_step = {label: r["zero_step_words"] for label, r in steps.items()}
    rows = roofline(shapes, zero_step, zero_hook, args.mfu)
    result = dict(steps=steps, many_tensors=many, flat=flat, hooks=hooks, bert=shapes, roofline=rows, mfu=args.mfu,
                  floors=FLOORS, targets=TARGETS, aot=_aot() if args.aot else None)
    _print(result)
    return result


def _print(r: dict[str, Any]) -> None:
    first = "tensor hook, float32 gradient, first"
    print("\n## Bytes per parameter per step (fp32 words, measured from the kernels' loads and stores)\n")
    print("| member | step (hook took pass 1) | + hook, first micro-step | total | step with its own pass 1 "
          "| floor |")
    print("|---|---|---|---|---|---|")
    for label, s in r["steps"].items():
        base = label.split()[0]
        hook = r["hooks"][first]["total"] if label.startswith("VR") else 0.0
        floor = FLOORS.get(base, "")
        print(f"| {label} | {s['step_words']['total']:.2f} | {hook:.2f} | {s['step_words']['total'] + hook:.2f} "
              f"| {s['zero_step_words']:.2f} | {floor} |")
    print("\n## Statistics hooks, fp32 words per parameter per micro-step\n")
    print("| hook | read | written | total |\n|---|---|---|---|")
    for label, w in r["hooks"].items():
        print(f"| {label} | {w['read']:.2f} | {w['written']:.2f} | {w['total']:.2f} |")
    print("\n## Launches, table copies and host syncs per steady step (5 tensors / 40 tensors)\n")
    print("| member | Triton launches | torch ops | table copies | host syncs | largest torch-op tensor |")
    print("|---|---|---|---|---|---|")
    for label, s in r["steps"].items():
        m = r["many_tensors"].get(label)
        two = (lambda k: f"{s[k]} / {m[k]}") if m else (lambda k: f"{s[k]}")
        print(f"| {label} | {two('triton_launches')} | {two('torch_ops')} | {two('table_copies')} "
              f"| {two('host_syncs')} | {s['largest_torch_op_tensor']} |")
    print("\n## One ZeRO flat partition, a steady step on one rank (8 tensors / 64 tensors in it; target for "
          "VRLamb: at most 10 launches)\n")
    print("| member | Triton launches | torch ops | launches in all | host syncs |\n|---|---|---|---|---|")
    for name in dict.fromkeys(n for n, _ in r["flat"]):
        few, many = r["flat"][(name, 8)], r["flat"][(name, 64)]
        two = (lambda k: f"{few[k]} / {many[k]}")
        total = f"{few['triton_launches'] + few['torch_ops']} / {many['triton_launches'] + many['torch_ops']}"
        print(f"| {name} | {two('triton_launches')} | {two('torch_ops')} | {total} | {two('host_syncs')} |")
    b = r["bert"]
    print(f"\n## Roofline model: BERT-large ({b['params'] / 1e6:.1f}M parameters, {b['tensors']} tensors), ZeRO-2 "
          f"fp16, global batch {b['global_batch']}, micro-batch {b['micro_batch']}, seq {b['seq']}, MFU "
          f"{r['mfu']:.0%} (a model; the word counts in it are measured)\n")
    print("| member | ranks | micro-steps | step GB | hooks GB | A100: step + hooks ms | of compute ms "
          "| share | H100: step + hooks ms | of compute ms | share |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    by = {(x["member"], x["ranks"], x["gpu"]): x for x in r["roofline"]}
    for member in r["steps"]:
        for ranks in RANKS:
            a, h = by[(member, ranks, "A100-80GB")], by[(member, ranks, "H100-SXM")]
            print(f"| {member} | {ranks} | {a['micro_steps']} | {a['step_gb']:.2f} | {a['hook_gb']:.1f} "
                  f"| {a['step_ms']:.2f} + {a['hook_ms']:.1f} | {a['compute_ms']:.0f} | {a['share']:.2%} "
                  f"| {h['step_ms']:.2f} + {h['hook_ms']:.1f} | {h['compute_ms']:.0f} | {h['share']:.2%} |")
    if r["aot"]:
        recs = r["aot"]["records"]
        print(f"\n## Compiled (Triton {r['aot']['triton']}, sm_80 and sm_90): {len(recs)} specializations, "
              f"{sum(not x['ok'] for x in recs)} failures\n")
        print("| launch | specializations | max registers | spilling | 128-bit body |\n|---|---|---|---|---|")
        by = collections.defaultdict(list)
        for x in recs:
            by[x["launch"]].append(x)
        for launch, xs in by.items():
            ok = [x for x in xs if x["ok"]]
            wide = [x["wide_ok"] for x in ok if x["wide_ok"] is not None]
            spill = sum(bool(x["local_bytes"] or x["local_accesses"]) for x in ok)
            print(f"| {launch} | {len(xs)} | {max(x['registers'] for x in ok)} | {spill} "
                  f"| {f'{sum(wide)}/{len(wide)}' if wide else '-'} |")


def write_json(path: pathlib.Path, result: dict[str, Any]) -> None:
    """``report``'s figures as JSON: keys that are tuples (the flat steps' ``(member, tensors)``)
    joined by a space."""
    def keyed(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {" ".join(map(str, k)) if isinstance(k, tuple) else k: keyed(v) for k, v in obj.items()}
        return [keyed(v) for v in obj] if isinstance(obj, list) else obj

    path.write_text(json.dumps(keyed(result), indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "bert_large_64k_32k_vr_lamb.json"))
    ap.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation assumed for the compute time")
    ap.add_argument("--aot", action="store_true", help="also compile every specialization (python -m "
                                                       "vrgd_ds.optim.triton_aot; about 90 s on 2 cores when cold)")
    ap.add_argument("--json", help="write every figure to this file")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("TRITON_INTERPRET must be 1: the counts are taken from the interpreted kernels")
    result = report(args)
    if args.json:
        write_json(pathlib.Path(args.json), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
