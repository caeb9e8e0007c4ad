"""FSDP2 cases for the rank pools (``pool.py``), on CPU ranks (gloo): ``vrgd_ds.fsdp.attach`` on a
model sharded with ``fully_shard`` against the same optimizer class on the unsharded model in one
process, which sees every rank's micro-batches.

The reference is the single-process optimizer as users run it (its tensor hooks: every
``backward()`` one gradient group), fed each rank's micro-batches in turn with the loss weighted
as the loop weights it (``/ accumulation``, and ``/ chunks`` for a loss taken in chunks), its
``.grad`` then divided by the data-parallel size, as FSDP's reduction averages. Every rank's
micro-batches are generated from (step, rank, micro-step), so each rank runs the reference too.
"""
from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
import torch.distributed as dist

import vrgd_ds
import vrgd_ds.fsdp
from vrgd_ds.optim.registry import REGISTRY

STEPS = 3
ROWS = 4
OPTS: dict[str, dict[str, Any]] = {
    "VRLamb": dict(lr=0.05),
    "VRAdam": dict(lr=1e-2),
    "VRSGD": dict(lr=0.05, momentum=0.9),
    "VRLars": dict(lr=0.05),
    "VRMerit": dict(lr=0.05),
}


class Net(torch.nn.Module):
    """Three linear blocks; the last has fewer rows than 4 ranks (uneven dim 0, and an empty shard
    on 4 ranks), and ``spare``, a parameter of the first block that no forward uses, when asked."""

    def __init__(self, unused: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(6, 7)
        self.b = torch.nn.Linear(7, 5)
        self.c = torch.nn.Linear(5, 3)
        if unused:
            self.a.spare = torch.nn.Parameter(torch.randn(3, 2))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.b(torch.tanh(self.a(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.body(x))


def batch(step: int, rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 3, generator=g)


def backward(model: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor], weight: float, chunks: int) -> None:
    """One micro-batch's backward; with ``chunks`` > 1 the loss in chunks of the rows, one
    backward each (the body's graph kept for the next chunk)."""
    x, y = b
    dtype = next(model.parameters()).dtype
    if chunks == 1:
        (torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y) * weight).backward()
        return
    h = model.body(x.to(dtype))
    for i, (hc, yc) in enumerate(zip(h.chunk(chunks), y.chunk(chunks))):
        loss = torch.nn.functional.mse_loss(model.c(hc).float(), yc) * (weight / chunks)
        loss.backward(retain_graph=i < chunks - 1)


def shard(model: Net, layout: str, world: int, ignored: set | None = None, average: bool = False) -> Any:
    """``ignored``: parameters the root's ``fully_shard`` leaves out (``ignored_params``);
    ``average``: FSDP's averaging reduce-scatter (default: its sum reduction, then one division)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    elif layout == "pipeline":  # each half of the ranks a stage: the model sharded over its half only
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "shard"))["shard"]
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    for block in (model.a, model.b, model.c):
        if not ignored or not ignored & set(block.parameters()):
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    for m in model.modules():
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(not average)
    return mesh


def _fsdp_params(model: torch.nn.Module):
    """(name, FSDPParam) of every sharded parameter."""
    names = {id(p): n for n, p in model.named_parameters()}
    for m in model.modules():
        if hasattr(m, "_get_fsdp_state"):
            for group in m._get_fsdp_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    yield names[id(fp.sharded_param)], fp


def flat(params) -> torch.Tensor:
    return torch.cat([p.detach().double().reshape(-1) for p in params])


def every_rank(result: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, result)
    return out


def train_case(case: dict) -> list[dict[str, Any]]:
    """Every rank's result: ``case``: opt, layout ("fsdp" | "hsdp"), acc (micro-steps per step),
    chunks, unused."""
    return every_rank(_train(case))


def _train(case: dict) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    name, acc, chunks = case["opt"], case["acc"], case.get("chunks", 1)
    cls = REGISTRY[name].cls
    kw = OPTS[name]
    model = Net(case.get("unused", False))
    ref, plain = copy.deepcopy(model), copy.deepcopy(model)
    p0 = flat(ref.parameters())
    shard(model, case["layout"], world, average=case.get("average", False))
    opt = cls(model.parameters(), **kw)
    stats = vrgd_ds.fsdp.attach(model, opt, squares_dtype=case.get("squares", "fp32"))
    ref_opt, plain_opt = cls(ref.parameters(), **kw), cls(plain.parameters(), **{**kw, "gamma": 1.0})
    steps = []
    for step in range(STEPS):
        if case.get("cleared"):  # a step the caller skipped (GradScaler's overflow), then model.zero_grad()
            for j in range(acc):  # (HF Trainer's order): none of it is the next step's
                backward(model, batch(step + 100, rank, j), 1.0 / acc, chunks)
            model.zero_grad()
        sent, calls, reductions = stats.counters.bytes_sent, stats.counters.collectives, stats.reductions
        layout_calls = opt._layout.counters.collectives
        for j in range(acc):
            if case.get("no_sync"):  # accumulate unreduced until the last micro-step
                model.set_requires_gradient_sync(j == acc - 1)
            if case.get("defer_all_reduce"):  # HSDP: reduce-scatter each micro-step, all-reduce at the last
                model.set_requires_all_reduce(j == acc - 1)
            backward(model, batch(step, rank, j), 1.0 / acc, chunks)
        opt.step()
        metrics = opt.gsnr_metrics()
        opt.zero_grad()
        steps.append(dict(n=metrics["gsnr/n"], bytes=stats.counters.bytes_sent - sent,
                          collectives=stats.counters.collectives - calls, reductions=stats.reductions - reductions,
                          layout_collectives=opt._layout.counters.collectives - layout_calls,
                          launches=stats.stat_counters.launches, hooks=stats.stat_counters.hooks))
        for net, o in ((ref, ref_opt), (plain, plain_opt)):
            for r in range(world):
                if case.get("no_sync"):  # a rank's accumulated gradient is one group: one backward of its sum
                    sum(torch.nn.functional.mse_loss(net(b[0]), b[1]) / acc
                        for b in (batch(step, r, j) for j in range(acc))).backward()
                    continue
                for j in range(acc):
                    backward(net, batch(step, r, j), 1.0 / acc, chunks)
            for p in net.parameters():
                if p.grad is not None:
                    p.grad.div_(world)
            o.step()
            o.zero_grad()
    full = flat(p.full_tensor() for p in model.parameters())
    want, base = flat(ref.parameters()), flat(plain.parameters())
    local_numel = sum(p._local_tensor.numel() for p in model.parameters())
    padded = {name: fp.padded_sharded_param_size.numel() for name, fp in _fsdp_params(model)}
    return dict(padded=sum(padded.values()), spare_padded=padded.get("a.spare", 0), arena=stats.arena.numel(),
                shard=world // (2 if case["layout"] == "hsdp" else 1), err=float((full - want).norm() / (want - p0).norm()),
                contrast=float((base - want).norm() / (want - p0).norm()),
                steps=steps, buffer_bytes=stats.buffer_bytes(), local_numel=local_numel,
                numel=sum(p.numel() for p in model.parameters()),
                state_types=sorted({type(v).__name__ for st in opt.state.values() for k, v in st.items()
                                    if k != "step"}))


def base_replicated_case(case: dict) -> list[dict[str, Any]]:
    """Lamb (GSNR off) on HSDP of 2 replicas, each a shard of 1 rank, with FSDP's all-reduce hook
    set: FSDP reduces as it would, and the per-tensor sums count each replica's copy once; the
    trained parameters against Lamb in one process. With ``case["titan"]``, built by torchtitan's
    container (``vrgd_optimizer("Lamb")``), as torchtitan does at data_parallel_shard_degree 1."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Net(False)
    ref = copy.deepcopy(model)
    p0 = flat(ref.parameters())
    shard(model, "hsdp", world)
    hooked = []
    model.b.set_all_reduce_hook(lambda reduced: hooked.append(reduced.numel()))
    ref_opt = vrgd_ds.Lamb(ref.parameters(), lr=0.05)
    if case.get("titan"):
        from vrgd_ds.fsdp.torchtitan import VRGDOptimizersContainer, vrgd_optimizer

        opt = VRGDOptimizersContainer(vrgd_optimizer("Lamb", lr=0.05), model_parts=[model])
        attached = opt.statistics[0] if opt.statistics else None
    else:
        opt = vrgd_ds.Lamb(model.parameters(), lr=0.05)
        attached = vrgd_ds.fsdp.attach(model, opt)
    for step in range(STEPS):
        for j in range(2):
            backward(model, batch(step, rank, j), 0.5, 1)
        opt.step()
        opt.zero_grad()
        for r in range(world):
            for j in range(2):
                backward(ref, batch(step, r, j), 0.5, 1)
        for p in ref.parameters():
            p.grad.div_(world)
        ref_opt.step()
        ref_opt.zero_grad()
    full, want = flat(p.full_tensor() for p in model.parameters()), flat(ref.parameters())
    return every_rank(dict(err=float((full - want).norm() / (want - p0).norm()), hooked=len(hooked),
                           statistics=attached is not None))


def refusal_case(case: dict) -> list[dict[str, Any]]:
    """What attach says to a set-up it does not cover (``case["what"]``), on every rank."""
    return every_rank(_refusal(case))


def _refusal(case: dict) -> dict[str, Any]:
    world = dist.get_world_size()
    model = Net(False)
    what = case["what"]
    # replicated: HSDP over 2 ranks, a shard of 1 rank (replication alone)
    layouts = {"pipeline": "pipeline", "replicated": "hsdp", "titan_one_shard": "hsdp", "uneven_replicas": "hsdp"}
    if what == "titan_tp_base":  # tensor parallelism alone (a custom parallelize_fn): DTensors, no FSDP module
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        parallelize_module(model.a, init_device_mesh("cpu", (world,)), ColwiseParallel())
    else:
        shard(model, layouts.get(what, "fsdp"), world,
              {model.c.bias} if what == "ignored" else None)
    if what == "offload":  # CPUOffloadPolicy needs an accelerator to offload from: its flag, as FSDP sets it
        next(fp for _, fp in _fsdp_params(model)).offload_to_cpu = True
    if what == "bf16_reduce":  # MixedPrecisionPolicy(param_dtype=torch.bfloat16): FSDP then reduces in bf16
        from torch.distributed.fsdp import MixedPrecisionPolicy

        for module in (model.a, model.b, model.c):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                group.mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if what == "unfrozen":
        for p in model.a.parameters():
            p.requires_grad_(False)
    if what in ("titan_one_shard", "titan_tp_base"):  # torchtitan's container on a model sharded over 1 rank
        # (HSDP 2 × 1), or a base member on a tensor-parallel model without FSDP
        from vrgd_ds.fsdp.torchtitan import VRGDOptimizersContainer, vrgd_optimizer

        try:
            VRGDOptimizersContainer(vrgd_optimizer("VRLamb" if what == "titan_one_shard" else "Lamb", lr=0.1),
                                    model_parts=[model])
        except Exception as e:  # noqa: BLE001
            return dict(type=type(e).__name__, message=str(e))
        return dict(type=None, message="")
    opt = (vrgd_ds.Lamb if what == "moved_base" else vrgd_ds.VRLamb)(model.parameters(), lr=0.1)
    if what == "fused_group":
        opt.param_groups[0]["fused"] = True
    try:
        stats = vrgd_ds.fsdp.attach(model, opt)
        if what == "twice":
            vrgd_ds.fsdp.attach(model, vrgd_ds.VRAdam(model.parameters(), lr=0.1))
        if what == "twice_base":  # a base optimizer leaves FSDP's reduce-scatter alone
            vrgd_ds.fsdp.attach(model, vrgd_ds.Lamb(model.parameters(), lr=0.1))
        if what in ("comm_after", "hook_after"):  # FSDP's options set after attach, then a backward
            if what == "comm_after":
                model.b.set_allocate_memory_from_process_group_for_comm(False)  # a new default reduce-scatter
            else:
                model.b.set_all_reduce_hook(lambda reduced: None)
            backward(model, batch(0, dist.get_rank(), 0), 0.5, 1)
        if what in ("moved", "moved_base"):  # model.to() after attach: FSDP2 makes new local shards
            model.to("cpu")
            rank = dist.get_rank()
            for j in range(2):
                backward(model, batch(0, rank, j), 0.5, 1)
            opt.step()
        if what == "rebuilt":  # the optimizer deleted, another built and attached (a new hyper-parameter)
            import gc

            gone = weakref.ref(stats)
            rank = dist.get_rank()
            for j in range(2):
                backward(model, batch(0, rank, j), 0.5, 1)
            opt.step()
            # freed as the optimizer goes, by reference counting: the collector runs when a rank's
            # allocations say, so statistics only it frees would leave the ranks' collectives apart
            gc.disable()
            try:
                del opt, stats
                freed = gone() is None
                opt = vrgd_ds.VRAdam(model.parameters(), lr=0.1)
                try:  # the last step's gradients are still there: refused, then cleared
                    vrgd_ds.fsdp.attach(model, opt)
                    held = ""
                except vrgd_ds.fsdp.UnsupportedFSDPConfiguration as e:
                    held = str(e)
                model.zero_grad()
                stats = vrgd_ds.fsdp.attach(model, opt)
                for j in range(2):
                    backward(model, batch(0, rank, j), 0.5, 1)
                opt.step()
            finally:
                gc.enable()
            return dict(type=None, message="", freed=freed, n=opt.gsnr_metrics()["gsnr/n"], held=held)
    except Exception as e:  # noqa: BLE001 (the message is the result)
        return dict(type=type(e).__name__, message=str(e))
    if what == "unfrozen":  # a block frozen when attached, unfrozen after a step (progressive unfreezing)
        rank = dist.get_rank()
        try:
            for step in range(2):
                for p in model.a.parameters():
                    p.requires_grad_(step == 1)
                for j in range(2):
                    backward(model, batch(step, rank, j), 0.5, 1)
                opt.step()
                opt.zero_grad()
        except Exception as e:  # noqa: BLE001
            return dict(type=type(e).__name__, message=str(e))
    if what == "uneven_sync":  # one module accumulates its first micro-step unreduced, the others do not
        rank = dist.get_rank()
        try:
            for j in range(2):
                model.b.set_requires_gradient_sync(j == 1, recurse=False)
                backward(model, batch(0, rank, j), 0.5, 1)
            opt.step()
        except Exception as e:  # noqa: BLE001
            return dict(type=type(e).__name__, message=str(e), reductions=stats.reductions)
    if what == "uneven_replicas":  # HSDP 2 × 2, the replicas' all-reduce deferred to a replica's last
        rank = dist.get_rank()  # micro-step: replica 1 (ranks 2 and 3) runs one micro-step more
        acc = 2 + rank // 2
        try:
            for j in range(acc):
                model.set_requires_all_reduce(j == acc - 1)
                backward(model, batch(0, rank, j), 1.0 / acc, 1)
            opt.step()
        except Exception as e:  # noqa: BLE001
            return dict(type=type(e).__name__, message=str(e))
        return dict(type=None, message="", n=opt.gsnr_metrics()["gsnr/n"])
    return dict(type=None, message="")


__all__ = ["train_case", "refusal_case"]


def _steps(model: Net, opt: Any, steps: range, acc: int) -> None:
    """Training steps where rank r's micro-step j reads the micro-batch of global index r·acc + j:
    2 ranks × acc 2 read what 4 ranks × acc 1 read (the loss weight 1/(ranks·acc) alike)."""
    rank = dist.get_rank()
    for step in steps:
        for j in range(acc):
            backward(model, batch(step, rank * acc + j, 0), 1.0 / acc, 1)
        opt.step()
        opt.zero_grad()


def _full(model: Net) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def dcp_case(case: dict) -> list[dict[str, Any]]:
    """``phase="save"`` (4 ranks): 2 steps of VRLamb, a DCP checkpoint of model and optimizer
    (``torch.distributed.checkpoint.state_dict``), then the uninterrupted third step's parameters
    saved beside it. ``phase="load"`` (any ranks): a fresh model and optimizer, the state-only
    init step that ``get_state_dict`` runs on a fresh optimizer, the checkpoint loaded, the third
    step taken; its parameters against the uninterrupted ones."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    world, root = dist.get_world_size(), case["dir"]
    acc = 4 // world
    model = Net(False)
    shard(model, "fsdp", world)
    opt = vrgd_ds.VRLamb(model.parameters(), lr=0.05, beta3=0.9)
    stats = vrgd_ds.fsdp.attach(model, opt)
    out: dict[str, Any] = {}
    if case["phase"] == "save":
        _steps(model, opt, range(2), acc)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/ckpt")
        _steps(model, opt, range(2, 3), acc)
        full = _full(model)
        if dist.get_rank() == 0:
            torch.save(full, f"{root}/expected.pt")
        dist.barrier()
        return every_rank(out)
    before = _full(model)
    msd, osd = get_state_dict(model, opt)  # a fresh optimizer: the state-only init step runs here
    out["init_steps"] = sorted({float(st["step"]) for st in opt.state.values()})
    out["init_state_types"] = sorted({type(v).__name__ for st in opt.state.values() for k, v in st.items()
                                      if k != "step"})
    out["init_gsnr_avg_zero"] = all(not bool(st["gsnr_avg"].to_local().any()) for st in opt.state.values())
    out["init_moved"] = any(bool((a != b).any()) for a, b in zip(before, _full(model)))
    out["init_reductions"] = stats.reductions
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=f"{root}/ckpt")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out["loaded_steps"] = sorted({float(st["step"]) for st in opt.state.values()})
    _steps(model, opt, range(2, 3), acc)
    want = torch.load(f"{root}/expected.pt")
    got = _full(model)
    out["bit_equal"] = all(torch.equal(a, b) for a, b in zip(got, want))
    out["max_diff"] = max(float((a - b).abs().max()) for a, b in zip(got, want))
    out["moved"] = max(float((a - b).abs().max()) for a, b in zip(before, got))
    return every_rank(out)


def base_case(case: dict) -> list[dict[str, Any]]:
    """FSDP's reduction is untouched: the gradients with the statistics attached are bit-equal to
    plain FSDP's, and VRLamb at ``gamma = 1`` trains bit-equal to Lamb (both attached: Lamb's
    trust ratios need the per-tensor sums across shards too)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    nets = [Net(False) for _ in range(3)]
    for net in nets:
        shard(net, "fsdp", world)
    vr = vrgd_ds.VRLamb(nets[0].parameters(), lr=0.05, gamma=1.0, beta3=0.0)
    base = vrgd_ds.Lamb(nets[1].parameters(), lr=0.05)
    vrgd_ds.fsdp.attach(nets[0], vr)
    vrgd_ds.fsdp.attach(nets[1], base)
    grads_equal = False
    for step in range(STEPS):
        for j in range(2):
            for net in nets:
                backward(net, batch(step, rank, j), 0.5, 1)
        if step == 0:  # the plain model (no optimizer) has the same parameters until the first step
            grads_equal = all(torch.equal(a.grad.to_local(), c.grad.to_local())
                              for a, c in zip(nets[0].parameters(), nets[2].parameters()))
        for opt in (vr, base):
            opt.step()
            opt.zero_grad()
        nets[2].zero_grad()
    return every_rank(dict(grads_equal=grads_equal, params_equal=all(
        torch.equal(a.to_local(), b.to_local()) for a, b in zip(nets[0].parameters(), nets[1].parameters()))))


def zero_shard_case(case: dict) -> list[dict[str, Any]]:
    """An embedding of 8 rows on 2 ranks (rank 0's shard rows 0-3, rank 1's rows 4-7) read at
    rows 0-3 only, so that rank 1's whole shard has a zero gradient, stepped by Lamb (GSNR off)
    at lr 0, as a warmup from 0 takes its first step, then at lr 0.1: every rank takes both steps
    (one step count), and nobody waits in a collective the other skipped."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = torch.nn.Embedding(8, 4)
    fully_shard(net, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("shard",)))
    net.set_force_sum_reduction_for_comms(True)
    opt = vrgd_ds.Lamb(net.parameters(), lr=0.0)
    vrgd_ds.fsdp.attach(net, opt)
    rows = torch.tensor([0, 1, 2, 3])
    for lr in (0.0, 0.1):
        for g in opt.param_groups:
            g["lr"] = lr
        net(rows).pow(2).sum().backward()
        local_zero = not bool(net.weight.grad.to_local().any())
        opt.step()
        opt.zero_grad()
    steps = sorted({int(st["step"].max()) for st in opt.state.values()})
    return every_rank(dict(rank=rank, local_zero=local_zero, steps=steps))


class TPNet(torch.nn.Module):
    """A block as torchtitan parallelises a transformer's: a norm (sequence parallel), a colwise
    and a rowwise linear layer, and a colwise head whose output is replicated."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(6)
        self.a = torch.nn.Linear(6, 8)
        self.b = torch.nn.Linear(8, 6)
        self.c = torch.nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(torch.tanh(self.a(self.norm(x)))))


def tp_batch(step: int, dp_rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * dp_rank + micro)
    return torch.randn(2, 4, 6, generator=g), torch.randn(2, 4, 4, generator=g)


def tp_case(case: dict) -> list[dict[str, Any]]:
    """FSDP + tensor parallelism on a 2 × 2 mesh (data, tensor): every rank of a data-parallel
    rank's tensor-parallel pair reads the same micro-batch, its half of the sequence entering the
    sequence-parallel norm."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    name, acc = case["opt"], case["acc"]
    cls, kw = REGISTRY[name].cls, OPTS[name]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    model = TPNet()
    ref, plain = copy.deepcopy(model), copy.deepcopy(model)
    p0 = flat(ref.parameters())
    sp = case.get("sequence_parallel", True)
    parallelize_module(model, mesh["tp"], {
        "norm": SequenceParallel(), "a": ColwiseParallel(input_layouts=Shard(1)),
        "b": RowwiseParallel(output_layouts=Shard(1)),
        "c": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())} if sp else {
        # the norm left to FSDP alone: a DTensor on the data-parallel mesh, the same on both
        # tensor-parallel ranks of a pair (its input, and its gradient after ColwiseParallel's
        # backward all-reduce, are)
        "a": ColwiseParallel(), "b": RowwiseParallel(), "c": ColwiseParallel(output_layouts=Replicate())})
    for m in (model.norm, model.a, model.b, model.c):
        fully_shard(m, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    for m in model.modules():
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)
    opt = cls(model.parameters(), **kw)
    try:
        stats = vrgd_ds.fsdp.attach(model, opt)
    except vrgd_ds.fsdp.UnsupportedFSDPConfiguration as e:
        return every_rank(dict(refused=str(e)))

    def loss(net: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor | None = None) -> torch.Tensor:
        return torch.nn.functional.mse_loss(net(b[0] if x is None else x), b[1]) / acc

    ref_opt, plain_opt = cls(ref.parameters(), **kw), cls(plain.parameters(), **{**kw, "gamma": 1.0})
    ns = []
    for step in range(STEPS):
        for j in range(acc):
            b = tp_batch(step, dp, j)
            loss(model, b, b[0].chunk(2, dim=1)[tp] if sp else None).backward()
        opt.step()
        ns.append(opt.gsnr_metrics()["gsnr/n"])
        opt.zero_grad()
        for net, o in ((ref, ref_opt), (plain, plain_opt)):
            for d in range(2):
                for j in range(acc):
                    loss(net, tp_batch(step, d, j)).backward()
            for p in net.parameters():
                p.grad.div_(2)
            o.step()
            o.zero_grad()
    full = flat(p.full_tensor() for p in model.parameters())
    want, base = flat(ref.parameters()), flat(plain.parameters())
    return every_rank(dict(err=float((full - want).norm() / (want - p0).norm()),
                           contrast=float((base - want).norm() / (want - p0).norm()), n=ns,
                           dropped=int(opt._layout._drop.sum()) if opt._layout._drop is not None else 0,
                           placements={n: str(p.placements) for n, p in model.named_parameters()},
                           reductions=stats.reductions))
