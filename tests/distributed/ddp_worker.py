"""DDP cases for the rank pool (``pool.py``), run in its gloo process group on CPU;
``run_case`` returns every rank's result as ``[rank 0, rank 1]``.

Every rank's micro-batches are generated from (step, rank, micro-step), so each process also
runs a single-process reference that sees all ranks' gradients.
"""
from __future__ import annotations

import contextlib
import copy
import os
import sys
import traceback
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from vrgd_ds import VRAdam, VRSGD
import vrgd_ds.ddp
from vrgd_ds.ddp import DDPStats, LocalStats, attach

sys.path.insert(0, os.path.dirname(__file__))
from reference import GivenStats  # noqa: E402

STEPS = 3
MICRO = 4
BUCKET_CAP_MB = 0.0001  # 100 bytes: several buckets once DDP has rebuilt them after step 1
OPTS: dict[str, tuple[type, dict[str, Any]]] = {
    "VRSGD": (VRSGD, dict(lr=0.05)),
    "VRAdam": (VRAdam, dict(lr=1e-2)),
}

# Every all_reduce issued in this process, counted independently of DDPStats.
ALL_REDUCE_CALLS = [0]
_all_reduce = dist.all_reduce


def _counting_all_reduce(*args, **kwargs):
    ALL_REDUCE_CALLS[0] += 1
    return _all_reduce(*args, **kwargs)


dist.all_reduce = _counting_all_reduce

# DDP's own bucket reductions, which the per-step scheme makes as DDP's reducer does
DDP_REDUCTIONS = [0]
_ddp_all_reduce = vrgd_ds.ddp._ddp_all_reduce


def _counting_ddp_all_reduce(*args, **kwargs):
    DDP_REDUCTIONS[0] += 1
    return _ddp_all_reduce(*args, **kwargs)


vrgd_ds.ddp._ddp_all_reduce = _counting_ddp_all_reduce


def tiny_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """With 100-byte buckets DDP's rebuilt buckets are [b3, W3, b2], [W2], [b1, W1]: a bucket
    of several tensors and one of a single tensor (the first step: one bucket of all six)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 13), torch.nn.Tanh(), torch.nn.Linear(13, 7), torch.nn.Tanh(),
                               torch.nn.Linear(7, 3)).to(dtype)


def batch(step: int, rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(MICRO, 5, generator=g), torch.randn(MICRO, 3, generator=g)


def loss_fn(model: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = b
    dtype = next(model.parameters()).dtype
    return torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().double().view(-1) for p in model.parameters()])


def group_grads(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """One rank's gradient (its micro-batch gradients summed in ``.grad``), cast to fp32."""
    model.zero_grad(set_to_none=True)
    for b in batches:
        loss_fn(model, b).backward()
    return [p.grad.detach().float().clone() for p in model.parameters()]


def hand_sums(model: torch.nn.Module, batches: list[list[tuple[torch.Tensor, torch.Tensor]]]):
    """``Σg`` and ``Σg²`` per parameter over the groups (``batches[r]``: rank r's micro-batches)."""
    groups = [group_grads(model, per_rank) for per_rank in batches]
    sums = []
    for i in range(len(groups[0])):
        gs = [g[i] for g in groups]
        sums.append((sum(gs[1:], gs[0].clone()), sum((g * g for g in gs[1:]), gs[0] * gs[0])))
    return sums


class Reference:
    """The same optimizer class on a copy of the model, fed with sums computed by hand."""

    def __init__(self, model: torch.nn.Module, make_opt: Callable[[Any], torch.optim.Optimizer]) -> None:
        self.model = model
        self.opt = make_opt(model.parameters())
        self.stats = GivenStats()
        self.opt.set_statistics_source(self.stats)

    def step(self, batches: list[list[tuple[torch.Tensor, torch.Tensor]]], per_micro: bool = False) -> None:
        """``batches[r]``: rank r's micro-batches; the groups are the ranks, or every micro-batch
        of every rank (``per_micro``: the per-step scheme). ``.grad`` is DDP's: the mean over ranks
        of each rank's summed micro-batch gradients."""
        groups = [[b] for per_rank in batches for b in per_rank] if per_micro else batches
        sums = hand_sums(self.model, groups)
        for p, (sum_g, sum_sq) in zip(self.model.parameters(), sums):
            self.stats.sums[id(p)] = (sum_g, sum_sq)
            p.grad = sum_g / len(batches)
        self.stats.groups = len(groups)
        self.opt.step()


def rel(a: torch.Tensor, b: torch.Tensor, b0: torch.Tensor) -> float:
    return float((a - b).norm() / (b - b0).norm())


def train_case(opt_name: str, micro_steps: int, squares: str = "per_step", record: str = "auto",
               gsnr: str = "on", sync_each: bool = False, cleared: bool = False, late_zero_grad: bool = False,
               evaluate: bool = False, uneven: bool = False, **ddp_kw: Any) -> dict[str, Any]:
    """3 steps of DDP + ``attach`` against the reference; ``micro_steps`` > 1 accumulates
    under ``no_sync()`` (``sync_each``: every backward synchronises; the summed ``.grad`` is the
    same). ``gsnr``: ``on`` for every parameter, ``weights`` (the biases in a ``gsnr=False``
    group) or ``off``. ``cleared``: before each step, a step the caller skips (its backward passes
    on other batches, then ``model.zero_grad()`` and no optimizer step, as after a GradScaler
    overflow in HF Trainer's order). ``late_zero_grad``: ``opt.zero_grad()`` between the step's
    first forward and its backward (``loss = model(x); opt.zero_grad(); loss.backward()``).
    ``evaluate``: a forward under ``torch.no_grad()`` after each step. ``uneven``: rank 0 runs
    one micro-step more than the others. Returns the warnings of ``vrgd_ds`` too."""
    import logging

    rank, world = dist.get_rank(), dist.get_world_size()
    warned: list[str] = []
    catch = logging.Handler(logging.WARNING)
    catch.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("vrgd_ds").addHandler(catch)
    cls, kw = OPTS[opt_name]

    def build(params, **extra):
        params = list(params)
        if gsnr == "weights":
            return cls([{"params": [p for p in params if p.dim() > 1]},
                        {"params": [p for p in params if p.dim() == 1], "gsnr": False}], **kw, **extra)
        return cls(params, **kw, **extra, **({"gsnr": False} if gsnr == "off" else {}))

    model = tiny_model()
    ref = Reference(copy.deepcopy(model), build)
    plain = Reference(copy.deepcopy(model), lambda ps: build(ps, gamma=1.0))  # no variance reduction
    p0 = flat(model)
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB, **ddp_kw)
    opt = build(ddp.parameters())
    stats = attach(ddp, opt, squares=squares, **({"micro_steps": record} if squares == "per_step" else {}))
    counters = lambda: (stats.counters.collectives, stats.counters.bytes_sent)  # noqa: E731 (every source's)
    launches = lambda: getattr(stats, "stat_counters", None) and stats.stat_counters.launches  # noqa: E731
    steps, seen = [], []
    if squares == "per_step":
        moments = stats.moments

        def recording(params):
            g, sq = moments(params)
            seen.append(([x.detach().clone() for x in g], [x.detach().clone() for x in sq], stats.n))
            return g, sq

        stats.moments = recording
    for step in range(STEPS):
        (collectives, sent), calls, reductions, packs = counters(), ALL_REDUCE_CALLS[0], DDP_REDUCTIONS[0], launches()
        if not late_zero_grad:
            opt.zero_grad()
        for skipped in ([True] if cleared else []) + [False]:
            at = step + 50 if skipped else step
            mine = micro_steps + int(uneven and rank == 0)
            for j in range(mine):
                last = j == mine - 1
                with contextlib.nullcontext() if sync_each or last else ddp.no_sync():
                    loss = loss_fn(ddp, batch(at, rank, j))
                    if late_zero_grad and j == 0 and not skipped:
                        opt.zero_grad()
                    loss.backward()
            if skipped:
                ddp.zero_grad()
        opt.step()
        if evaluate:
            with torch.no_grad():
                loss_fn(ddp, batch(step + 100, rank, 0))
        now_collectives, now_sent = counters()
        steps.append(dict(
            n=opt.gsnr_metrics().get("gsnr/n"),  # none with GSNR off everywhere
            collectives=now_collectives - collectives,
            all_reduce_calls=ALL_REDUCE_CALLS[0] - calls,
            ddp_reductions=DDP_REDUCTIONS[0] - reductions,
            launches=(launches() - packs) if packs is not None else None,
            hooks=getattr(stats, "stat_counters", None) and stats.stat_counters.hooks,
            buckets=getattr(stats, "buckets", None),
            # DDP's own buckets, as its reducer holds them now (rebuilt after the first step)
            ddp_bucket_numels=[b.buffer().numel() for b in ddp.reducer._get_zeros_like_grad_buckets()],
            bytes_sent=now_sent - sent,
        ))
        batches = [[batch(step, r, j) for j in range(micro_steps)] for r in range(world)]
        ref.step(batches, per_micro=squares == "per_step")
        plain.step(batches, per_micro=squares == "per_step")
    logging.getLogger("vrgd_ds").removeHandler(catch)
    a, b, c = flat(model), flat(ref.model), flat(plain.model)
    return dict(err=rel(a, b, p0), contrast=rel(c, b, p0), moved=float((b - p0).norm()), steps=steps, warned=warned,
                param_numels=[p.numel() for p in model.parameters()], params=a.tolist(),
                moments=[[[x.tolist() for x in g], [x.tolist() for x in q], n] for g, q, n in seen])


def low_precision_case(dtype: torch.dtype) -> dict[str, Any]:
    """The hook on a low-precision model: statistics are sums of the fp32 casts of the
    ranks' gradients and squares of those casts; ``.grad`` is their fp32 mean rounded once."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_model(dtype)
    local = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB)
    opt = VRSGD(ddp.parameters(), lr=0.05)
    stats = attach(ddp, opt, squares="per_micro_step")
    loss_fn(ddp, batch(0, rank, 0)).backward()
    want = hand_sums(local, [[batch(0, r, 0)] for r in range(world)])
    params = list(model.parameters())
    sum_g, sum_sq = stats.moments(params)
    out = dict(
        n=stats.n,
        grad_dtypes=sorted({str(p.grad.dtype) for p in params}),
        stat_dtypes=sorted({str(t.dtype) for t in sum_g + sum_sq}),
        sum_g_err=max(float((a - w[0]).abs().max()) for a, w in zip(sum_g, want)),
        sum_sq_err=max(float((a - w[1]).abs().max()) for a, w in zip(sum_sq, want)),
        grad_err=max(float((p.grad.float() - (w[0] / world).to(dtype).float()).abs().max())
                     for p, w in zip(params, want)),
        sum_sq_scale=max(float(w[1].abs().max()) for w in want),
    )
    opt.zero_grad()
    out["n_after_reset"] = stats.n
    return out


def bad_cases() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    ddp = DDP(tiny_model(), bucket_cap_mb=BUCKET_CAP_MB)
    try:
        attach(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))
        out["non_gsnr"] = "no error"
    except TypeError as exc:
        out["non_gsnr"] = str(exc)
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    ddp1 = DDP(tiny_model(), process_group=singles[rank])
    try:
        attach(ddp1, VRSGD(ddp1.parameters(), lr=0.05))
        out["one_rank"] = "no error"
    except ValueError as exc:
        out["one_rank"] = str(exc)
    ddp1b = DDP(tiny_model(), process_group=singles[rank])
    out["one_rank_gsnr_off"] = isinstance(attach(ddp1b, VRSGD(ddp1b.parameters(), lr=0.05, gsnr=False)),
                                         (DDPStats, LocalStats))
    # the optimizer inside a wrapper (Accelerate's AcceleratedOptimizer: HF Trainer's trainer.optimizer)
    ddpw = DDP(tiny_model(), bucket_cap_mb=BUCKET_CAP_MB)
    wrapped = VRSGD(ddpw.parameters(), lr=0.05)
    out["wrapped"] = attach(ddpw, SimpleNamespace(optimizer=wrapped)) is wrapped.statistics_source
    ddp2 = DDP(tiny_model(), bucket_cap_mb=BUCKET_CAP_MB)
    try:
        attach(ddp2, VRSGD(tiny_model().parameters(), lr=0.05))
        out["foreign_params"] = "no error"
    except ValueError as exc:
        out["foreign_params"] = str(exc)
    ddp3 = DDP(tiny_model(), bucket_cap_mb=BUCKET_CAP_MB)
    try:
        attach(ddp3, VRSGD(ddp3.parameters(), lr=0.05), squares="per_micro_step", micro_steps="hooks")
        out["micro_steps_fused"] = "no error"
    except ValueError as exc:
        out["micro_steps_fused"] = str(exc)
    return out


def join_case(squares: str) -> dict[str, Any]:
    """A training forward under ``ddp.join()`` (uneven inputs), then (the refusal taken) an
    evaluation under it: what each raised."""
    rank = dist.get_rank()
    ddp = DDP(tiny_model(), bucket_cap_mb=BUCKET_CAP_MB)
    opt = VRSGD(ddp.parameters(), lr=0.05)  # held: the statistics go with their optimizer
    attach(ddp, opt, squares=squares)
    out: dict[str, Any] = {}
    try:
        with ddp.join():
            loss_fn(ddp, batch(0, rank, 0)).backward()
        out["train"] = "no error"
    except RuntimeError as exc:
        out["train"] = str(exc)
    with torch.no_grad():
        loss_fn(ddp, batch(0, rank, 0))  # an evaluation: no statistics, not refused
    out["evaluated"] = True
    return out


def three_rank_case() -> dict[str, Any]:
    """DDP on 3 of the pool's ranks (a world size that is not a power of 2), one backward a step
    (the per-step scheme's bucket path): the gradients DDP hands the optimizer, and after 3 steps
    the weights of VRAdam with ``gamma=1``, against plain DDP with VRAdam's GSNR off, bit for bit."""
    three = dist.new_group([0, 1, 2])  # every rank of the pool takes part in making it
    rank = dist.get_rank()
    if rank == 3:
        return dict(idle=True)
    runs = {}
    for name, attached, options in (("plain", False, dict(gsnr=False)), ("attached", True, dict(gamma=1.0))):
        ddp = DDP(tiny_model(), bucket_cap_mb=BUCKET_CAP_MB, process_group=three)
        opt = VRAdam(ddp.parameters(), lr=1e-2, **options)
        if attached:
            attach(ddp, opt)
        grads = []
        for step in range(STEPS):
            opt.zero_grad()
            loss_fn(ddp, batch(step, rank, 0)).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in ddp.parameters()]))
            opt.step()
        runs[name] = (grads, flat(ddp.module))
    (plain_grads, plain), (grads, mine) = runs["plain"], runs["attached"]
    return dict(idle=False, grads_differ=[int((a != b).sum()) for a, b in zip(grads, plain_grads)],
                weights_differ=int((mine != plain).sum()), moved=float((plain - flat(tiny_model())).norm()))


def spread_case() -> dict[str, Any]:
    """One step of VRAdam on DDP where the ranks accumulate 1, 2, 3 and 2 micro-batches under
    ``no_sync()`` (4 ranks): the counts sum to 4 × 2, as if every rank had run 2. Returns the
    step's error on this rank, or that it stepped."""
    rank = dist.get_rank()
    ddp = DDP(tiny_model(), bucket_cap_mb=BUCKET_CAP_MB)
    opt = VRAdam(ddp.parameters(), lr=1e-2)
    attach(ddp, opt)
    mine = (1, 2, 3, 2)[rank]
    opt.zero_grad()
    for j in range(mine):
        with contextlib.nullcontext() if j == mine - 1 else ddp.no_sync():
            loss_fn(ddp, batch(0, rank, j)).backward()
    try:
        opt.step()
    except RuntimeError as exc:
        return dict(error=str(exc))
    return dict(stepped=True)


class _Branches(torch.nn.Module):
    """``a(x)``, plus ``b(x)`` where ``use_b``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.a(x) + self.b(x) if use_b else self.a(x)


def branch_case(micro_steps: int = 2) -> dict[str, Any]:
    """One step of VRAdam on DDP (``find_unused_parameters``) whose GSNR group holds only branch
    ``b``, which rank 1's ``micro_steps`` micro-batches (under ``no_sync()`` but the last: the
    tensor hooks' path) skip: rank 0 counts ``micro_steps`` backward passes, rank 1 none. Returns
    the step's error on this rank, or that it stepped."""
    rank = dist.get_rank()
    model = _Branches()
    ddp = DDP(model, find_unused_parameters=True)
    opt = VRAdam([{"params": list(model.a.parameters()), "gsnr": False}, {"params": list(model.b.parameters())}],
                 lr=1e-2)
    attach(ddp, opt)
    opt.zero_grad()
    for j in range(micro_steps):
        with contextlib.nullcontext() if j == micro_steps - 1 else ddp.no_sync():
            x, y = batch(0, rank, j)
            torch.nn.functional.mse_loss(ddp(x, rank == 0), y).backward()
    try:
        opt.step()
    except RuntimeError as exc:
        return dict(error=str(exc))
    return dict(stepped=True)


def step(ddp: DDP, opt: Any, at: int) -> torch.Tensor:
    """Step ``at`` of 2 micro-steps, the first under ``no_sync()``; returns the gradient stepped on."""
    rank = dist.get_rank()
    opt.zero_grad()
    with ddp.no_sync():
        loss_fn(ddp, batch(at, rank, 0)).backward()
    loss_fn(ddp, batch(at, rank, 1)).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in ddp.parameters()])
    opt.step()
    return grads


def scaler_case(squares: str) -> dict[str, Any]:
    """3 steps of 2 micro-steps (the first under ``no_sync()``) of VRAdam with a GradScaler at
    S = 2^20 told to the optimizer, against the same steps unscaled. The gradients are small
    (the loss times 1e-6), so the GSNR floor ``gsnr_eps`` meets a variance that S² left in the
    statistics would make 2^40 times larger. Returns the largest parameter difference."""
    rank = dist.get_rank()
    ends = []
    for enabled in (True, False):
        ddp = DDP(tiny_model(), bucket_cap_mb=BUCKET_CAP_MB)
        opt = VRAdam(ddp.parameters(), lr=1e-2, gsnr_eps=1e-12)
        attach(ddp, opt, squares=squares)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20, enabled=enabled)
        opt.set_grad_scaler(scaler)
        for at in range(STEPS):
            opt.zero_grad()
            with ddp.no_sync():
                scaler.scale(loss_fn(ddp, batch(at, rank, 0)) * 1e-6).backward()
            scaler.scale(loss_fn(ddp, batch(at, rank, 1)) * 1e-6).backward()
            scaler.step(opt)
            scaler.update()
        ends.append(flat(ddp.module))
    return dict(diff=float((ends[0] - ends[1]).abs().max()), moved=float((ends[1] - flat(tiny_model())).abs().max()))


def reattach_case(squares: str) -> dict[str, Any]:
    """A new VRAdam attached to a DDP model whose first optimizer was attached and stepped once,
    then 2 steps (2 micro-steps each, the first under ``no_sync()``), against the same 2 steps
    of a VRAdam attached to a fresh DDP model holding the weights of that moment. Also: the first
    optimizer gets no more statistics, and attaching with the other ``squares`` is refused."""
    ddp = DDP(tiny_model(), bucket_cap_mb=BUCKET_CAP_MB)
    first = VRAdam(ddp.parameters(), lr=1e-2)
    attach(ddp, first, squares=squares)
    step(ddp, first, 0)
    weights = copy.deepcopy(ddp.module.state_dict())
    second = VRAdam(ddp.parameters(), lr=1e-2)
    attach(ddp, second, squares=squares)
    for at in (1, 2):
        step(ddp, second, at)
    other = "per_micro_step" if squares == "per_step" else "per_step"
    try:
        attach(ddp, VRAdam(ddp.parameters(), lr=1e-2), squares=other)
        refused = None
    except ValueError as e:
        refused = str(e)
    try:
        step(ddp, first, 3)
        stale = None
    except RuntimeError as e:
        stale = str(e)
    fresh_model = tiny_model()
    fresh_model.load_state_dict(weights)
    fresh = DDP(fresh_model, bucket_cap_mb=BUCKET_CAP_MB)
    opt = VRAdam(fresh.parameters(), lr=1e-2)
    attach(fresh, opt, squares=squares)
    for at in (1, 2):
        step(fresh, opt, at)
    return dict(weights_differ=int((flat(fresh_model) != flat(ddp.module)).sum()) if stale else None,
                n=second.gsnr_metrics()["gsnr/n"], refused=refused, stale=stale)


def deleted_case(squares: str) -> dict[str, Any]:
    """A VRAdam attached and stepped once (2 micro-steps, the first under ``no_sync()``), then
    deleted with the garbage collector off, and 2 steps of torch's SGD on the same DDP model,
    against the same SGD steps on a fresh DDP model holding the weights of that moment: whether
    the statistics went with their optimizer, and the SGD run's gradients and weights against
    plain DDP's. The callbacks chained on the step's collectives are kept until after the
    deletion, as the process group's thread may still hold one that has run while the step goes
    on, so that a callback holding the statistics shows every time, not by chance."""
    import gc
    import weakref

    ddp = DDP(tiny_model(), bucket_cap_mb=BUCKET_CAP_MB)
    first = VRAdam(ddp.parameters(), lr=1e-2)
    stats = weakref.ref(attach(ddp, first, squares=squares))
    kept, all_reduce = [], dist.all_reduce

    class Kept:  # a work or its future, the callbacks chained on it kept
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def get_future(self) -> Any:
            return Kept(self.inner.get_future())

        def then(self, callback: Any) -> Any:
            kept.append(callback)
            return self.inner.then(callback)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    def keeping(*args, **kwargs):
        work = all_reduce(*args, **kwargs)
        return Kept(work) if work is not None else work

    dist.all_reduce = keeping
    try:
        step(ddp, first, 0)
    finally:
        dist.all_reduce = all_reduce
    weights = copy.deepcopy(ddp.module.state_dict())

    def hooks() -> int:  # tensor hooks on the parameters (the per-step scheme's, while a step accumulates)
        return sum(len(p._backward_hooks or {}) for p in ddp.parameters())

    hooked = hooks()
    gc.disable()
    try:
        del first
        freed = stats() is None
    finally:
        gc.enable()
    kept.clear()
    hooked = (hooked, hooks())
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.1)
    grads = [step(ddp, sgd, at) for at in (1, 2)]
    fresh_model = tiny_model()
    fresh_model.load_state_dict(weights)
    fresh = DDP(fresh_model, bucket_cap_mb=BUCKET_CAP_MB)
    plain = torch.optim.SGD(fresh.parameters(), lr=0.1)
    plain_grads = [step(fresh, plain, at) for at in (1, 2)]
    return dict(freed=freed, hooked=hooked, grads_differ=[int((a != b).sum()) for a, b in zip(grads, plain_grads)],
                weights_differ=int((flat(fresh_model) != flat(ddp.module)).sum()))


def cases() -> dict[str, Callable[[], dict[str, Any]]]:
    return {
        "VRSGD": lambda: train_case("VRSGD", 1),
        "VRAdam": lambda: train_case("VRAdam", 1),
        "VRSGD_no_sync": lambda: train_case("VRSGD", 2),
        "VRAdam_no_sync": lambda: train_case("VRAdam", 3),
        "VRSGD_bucket_view": lambda: train_case("VRSGD", 1, gradient_as_bucket_view=True),
        "VRAdam_sync_each": lambda: train_case("VRAdam", 3, sync_each=True),
        "fused_VRAdam_sync_each": lambda: train_case("VRAdam", 2, squares="per_micro_step", sync_each=True),
        "hooks_VRSGD": lambda: train_case("VRSGD", 1, record="hooks"),
        "hooks_VRAdam": lambda: train_case("VRAdam", 1, record="hooks"),
        "hooks_VRSGD_no_sync": lambda: train_case("VRSGD", 2, record="hooks"),
        "hooks_VRAdam_no_sync": lambda: train_case("VRAdam", 3, record="hooks"),
        "hooks_VRSGD_bucket_view": lambda: train_case("VRSGD", 1, record="hooks", gradient_as_bucket_view=True),
        "VRAdam_gsnr_weights": lambda: train_case("VRAdam", 1, gsnr="weights"),
        "VRAdam_gsnr_weights_no_sync": lambda: train_case("VRAdam", 2, gsnr="weights"),
        "VRSGD_gsnr_off": lambda: train_case("VRSGD", 1, gsnr="off"),
        "VRAdam_cleared": lambda: train_case("VRAdam", 1, cleared=True),
        "VRAdam_no_sync_cleared": lambda: train_case("VRAdam", 2, cleared=True),
        "fused_VRAdam_cleared": lambda: train_case("VRAdam", 1, squares="per_micro_step", cleared=True),
        "fused_VRAdam_no_sync_cleared": lambda: train_case("VRAdam", 2, squares="per_micro_step", cleared=True),
        "VRAdam_no_sync_late_zero_grad": lambda: train_case("VRAdam", 2, late_zero_grad=True),
        "VRAdam_no_sync_uneven": lambda: train_case("VRAdam", 2, uneven=True),
        "VRAdam_evaluated": lambda: train_case("VRAdam", 1, evaluate=True),
        "VRAdam_sync_each_late_zero_grad": lambda: train_case("VRAdam", 2, sync_each=True, late_zero_grad=True),
        "fused_VRSGD": lambda: train_case("VRSGD", 1, squares="per_micro_step"),
        "fused_VRAdam": lambda: train_case("VRAdam", 1, squares="per_micro_step"),
        "fused_VRSGD_no_sync": lambda: train_case("VRSGD", 2, squares="per_micro_step"),
        "fused_VRAdam_no_sync": lambda: train_case("VRAdam", 2, squares="per_micro_step"),
        "fused_VRSGD_bucket_view": lambda: train_case("VRSGD", 1, squares="per_micro_step",
                                                      gradient_as_bucket_view=True),
        "bf16": lambda: low_precision_case(torch.bfloat16),
        "fp16": lambda: low_precision_case(torch.float16),
        "bad": bad_cases,
        "three_ranks": three_rank_case,
        "spread": spread_case,
        "branch_no_sync": branch_case,
        "join": lambda: join_case("per_step"),
        "fused_join": lambda: join_case("per_micro_step"),
        "scaler": lambda: scaler_case("per_step"),
        "fused_scaler": lambda: scaler_case("per_micro_step"),
        "reattach": lambda: reattach_case("per_step"),
        "fused_reattach": lambda: reattach_case("per_micro_step"),
        "deleted": lambda: deleted_case("per_step"),
        "fused_deleted": lambda: deleted_case("per_micro_step"),
    }


def run_case(case: dict) -> list[dict[str, Any]]:
    """Case ``case["name"]`` on every rank; every rank's result (an error is recorded, not raised:
    the other rank must still reach the gather)."""
    try:
        result = cases()[case["name"]]()
    except Exception as exc:  # noqa: BLE001 (reported per rank to the test)
        result = dict(error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    return gathered
