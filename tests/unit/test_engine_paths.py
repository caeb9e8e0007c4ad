"""The DeepSpeed engine paths (vrgd_ds/ds/stage0.py, zero12.py, zero3.py) own their DeepSpeed
internals: every attribute a path reads from DeepSpeed's optimizer is in the list it checks at
attach time, and a missing one fails there, naming it. (The paths' behaviour under real
engines: tests/distributed/test_deepspeed.py.)"""
from __future__ import annotations

import ast
import inspect
import types

import pytest
import torch

pytest.importorskip("deepspeed")

import vrgd_ds  # noqa: E402
from vrgd_ds.ds import internals, stage0, zero3, zero12  # noqa: E402
from vrgd_ds.ds.paths import for_engine  # noqa: E402
from vrgd_ds.ds.sources import check_groups, expected_groups  # noqa: E402

# module, the name its code gives DeepSpeed's optimizer wrapper, the list checked at attach
WRAPPER_LISTS = [(zero12, "zopt", zero12._REQUIRED), (zero3, "zopt", zero3._REQUIRED),
                 (stage0, "wrapper", stage0._FP16_UNFUSED)]
# attributes the code sets on the wrapper (not read from DeepSpeed)
SET_HERE = {"reduce_scatter"}


def _attributes_read(module: types.ModuleType, name: str) -> set[str]:
    """``name.attr`` and ``self.name.attr`` in the module's source."""
    out = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.Attribute):
            base = node.value
            if isinstance(base, ast.Name) and base.id == name:
                out.add(node.attr)
            elif isinstance(base, ast.Attribute) and base.attr == name and isinstance(base.value, ast.Name):
                out.add(node.attr)
    return out


@pytest.mark.parametrize("module,name,required", WRAPPER_LISTS, ids=lambda x: getattr(x, "__name__", None))
def test_every_internal_a_path_reads_is_in_its_required_list(module, name, required):
    read = _attributes_read(module, name) - SET_HERE
    assert read, f"no {name}.<attr> found in {module.__name__}: the check would pass vacuously"
    missing = read - set(required) - ({zero3.AVG_SCATTER} if module is zero3 else set())
    assert not missing, f"{module.__name__} reads {sorted(missing)} without listing them in its required internals"


def test_the_engine_attributes_stage0_uses_are_listed():
    read = _attributes_read(stage0, "engine") - {"basic_optimizer", "optimizer"}  # the engine's public surface
    listed = set(stage0._ENGINE) | set(stage0._ENGINE_LATE)
    assert read <= listed, sorted(read - listed)


def _zero_engine(stage: int, drop: str) -> types.SimpleNamespace:
    required = zero3._REQUIRED if stage == 3 else zero12._REQUIRED
    zopt = type("DeepSpeedZeroOptimizer", (), {n: None for n in required if n != drop})()
    return types.SimpleNamespace(optimizer=zopt, basic_optimizer=object())


@pytest.mark.parametrize("stage,drop", [(1, "ipg_buckets"), (2, "grad_partition_insertion_offset"),
                                        (3, zero3.AVG_SCATTER), (3, "grad_position")])
def test_a_renamed_internal_fails_at_attach_naming_it(stage, drop):
    with pytest.raises(RuntimeError, match=f"lacks DeepSpeedZeroOptimizer.{drop}, which the VRGD hooks use; "
                                           f"supported DeepSpeed versions: {internals.SUPPORTED_DEEPSPEED[0]}"):
        for_engine(_zero_engine(stage, drop), stage)


def test_stage0_names_a_missing_engine_method():
    engine = types.SimpleNamespace(flatten=None, clip_fp32_gradients=None, seq_data_parallel_group=None,
                                   optimizer=None, basic_optimizer=None)
    with pytest.raises(RuntimeError, match="lacks DeepSpeedEngine.allreduce_bucket"):
        for_engine(engine, 0)


def test_an_unknown_stage_is_refused():
    with pytest.raises(internals.UnsupportedConfiguration, match="unknown ZeRO stage 4"):
        for_engine(types.SimpleNamespace(optimizer=None), 4)


def test_the_auto_scheme_follows_the_memory_rule():
    """``"squares": "auto"`` (vrgd_ds.ds.config.auto_scheme, the rule of benchmarks/comm_model.py):
    ZeRO-3 per_micro_step; stage 0 and pipelines per_step; ZeRO-1/2 hierarchical on one node or
    where per_step's full-size buffer takes more than half the free device memory, else per_step."""
    from vrgd_ds.ds.config import auto_scheme

    gb = 10**9
    assert auto_scheme(3, False, 64, 8, 56 * gb, 40 * gb) == "per_micro_step"
    assert auto_scheme(0, False, 8, 8, 56 * gb, 40 * gb) == "per_step"
    assert auto_scheme(1, True, 8, 8, 56 * gb, 40 * gb) == "per_step"
    assert auto_scheme(2, False, 8, 8, 1 * gb, 40 * gb) == "hierarchical"  # one node: nothing crosses InfiniBand
    assert auto_scheme(2, False, 64, 8, 56 * gb, 40 * gb) == "hierarchical"  # 7B in bf16: does not fit
    assert auto_scheme(2, False, 64, 8, 3 * gb, 40 * gb) == "per_step"  # BERT-large: fits
    assert auto_scheme(2, False, 64, 8, 56 * gb, None) == "per_step"  # no device memory limit known
    # one rank a node: the node buffers are the full size, nothing saved. Fails on the code before,
    # which took one GPU, or hosts of one GPU each short of memory, for a node
    assert auto_scheme(2, False, 1, 1, 1 * gb, 40 * gb) == "per_step"
    assert auto_scheme(2, False, 4, 1, 56 * gb, 40 * gb) == "per_step"
    # ZeRO-1 with accumulation on one node (a hook per parameter, whose within-node collectives hang
    # a model some ranks skip a branch of): hierarchical only where per_step does not fit. Fails on
    # the code before, which took hierarchical on one node whatever the memory
    assert auto_scheme(1, False, 8, 8, 1 * gb, 40 * gb, hooks=True) == "per_step"
    assert auto_scheme(1, False, 8, 8, 56 * gb, 40 * gb, hooks=True) == "hierarchical"


@pytest.mark.parametrize("world,gas,stage,scheme,fix", [
    (1, 4, 1, "per_micro_step", '"vrgd": {"squares": "per_step"} with gradient_accumulation_steps >= 2'),
    (1, 1, 0, "per_step", "or gradient_accumulation_steps >= 2"),
    (1, 1, 2, "per_micro_step", "or gradient_accumulation_steps >= 2"),
    (1, 1, 3, "hierarchical", "or gradient_accumulation_steps >= 2"),
])
def test_a_run_with_one_group_per_step_is_refused_naming_the_fix(world, gas, stage, scheme, fix):
    """A single rank on ZeRO-1's per-micro-step reduction has n=1 whatever its accumulation (the
    reduction runs once per step): the refusal points at per-step squares, not at more micro-steps,
    which would not help there. On the others n counts micro-steps. (The refusal at
    ``deepspeed.initialize``: tests/distributed/test_deepspeed.py, the exhaustive tier.)"""
    with pytest.raises(internals.UnsupportedConfiguration) as e:
        check_groups("VRLamb", world, gas, stage, scheme)
    assert "VRLamb: GSNR needs >= 2 gradient groups per step, this run has n=1" in str(e.value)
    assert fix in str(e.value) and "or set 'gsnr': false" in str(e.value)


@pytest.mark.parametrize("world,gas,stage,scheme", [(2, 1, 1, "per_micro_step"), (1, 2, 1, "per_step"),
                                                    (1, 2, 2, "per_micro_step"), (2, 1, 3, "per_micro_step")])
def test_two_groups_per_step_are_accepted(world, gas, stage, scheme):
    check_groups("VRLamb", world, gas, stage, scheme)
    assert expected_groups(world, gas, stage, scheme) == 2


@pytest.mark.parametrize("scheme, comm, model, warned", [
    ("per_micro_step", "bfloat16", "float32", True),   # the fused fp32 reduction replaces DeepSpeed's
    ("per_step", "bfloat16", "float32", False),        # DeepSpeed's reduction, in its dtype, untouched
    ("per_micro_step", "float32", "float32", False),
    ("per_micro_step", "bfloat16", "bfloat16", False),  # the model's dtype: nothing is lost
])
def test_an_ignored_communication_dtype_is_warned_of_under_the_scheme_in_use(scheme, comm, model, warned, caplog):
    """The warning reads the scheme ``attach`` uses, ``"auto"`` resolved (ZeRO-3: per-micro-step).
    The same through ``deepspeed.initialize``: tests/distributed/test_deepspeed.py, exhaustive."""
    import torch

    from vrgd_ds.ds.attach import warn_ignored_comm_dtype

    engine = types.SimpleNamespace(communication_data_type=getattr(torch, comm),
                                   get_data_types=lambda: (getattr(torch, model), getattr(torch, model)))
    with caplog.at_level("WARNING", logger="vrgd_ds"):
        assert warn_ignored_comm_dtype(engine, scheme) is warned
    assert ("is ignored for gradients" in caplog.text) is warned


def test_bf16_squares_with_the_automatic_scheme_are_refused_naming_both_keys():
    """``"squares": "auto"`` may pick the hierarchical scheme, which reduces ``[Σg | Σg²]`` in
    fp32 only: ``squares_dtype`` bf16 with it is refused as with ``hierarchical`` itself. Fails
    on the code before, which accepted it and ran fp32 when auto picked hierarchical (the cost
    line still reporting bf16's bytes)."""
    from vrgd_ds.ds.config import reduction_config

    with pytest.raises(internals.UnsupportedConfiguration, match=r"squares_dtype.*'auto' \('by_memory'\) may pick it"):
        reduction_config({"vrgd": {"squares": "auto", "squares_dtype": "bf16"}})
    assert reduction_config({"vrgd": {"squares": "per_step", "squares_dtype": "bf16"}}).squares_dtype == "bf16"


def test_the_scheme_chosen_by_memory_has_a_spelling_accelerate_passes():
    """HF ``Trainer`` and Accelerate (``DeepSpeedPlugin.deepspeed_config_process``) refuse every
    ``"auto"`` of a DeepSpeed config they do not fill themselves, ours included: ``"squares":
    "by_memory"`` is the same choice, and passes them. Fails on the code before, which had no other
    spelling: the scheme chosen by memory could not be had through HF or Accelerate."""
    from vrgd_ds.ds.config import reduction_config

    assert reduction_config({"vrgd": {"squares": "by_memory"}}).squares == "auto"
    with pytest.raises(internals.UnsupportedConfiguration, match=r"squares_dtype.*'auto' \('by_memory'\) may pick it"):
        reduction_config({"vrgd": {"squares": "by_memory", "squares_dtype": "bf16"}})
    accelerate = pytest.importorskip("accelerate.utils")

    def processed(block: dict) -> None:
        cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2},
               "optimizer": {"type": "VRLamb", "params": {"lr": 1e-3}}, "vrgd": block}
        accelerate.DeepSpeedPlugin(hf_ds_config=cfg).deepspeed_config_process(must_match=True)

    processed({"squares": "by_memory"})
    with pytest.raises(ValueError, match="vrgd.squares` not found in kwargs"):  # why the second spelling
        processed({"squares": "auto"})


def test_a_vrgd_block_that_is_not_an_object_is_named():
    """``"vrgd": "per_step"`` (the scheme written without its key): the error names the block and
    shows its form. Fails on the code before, whose message ("Input should be a valid dictionary or
    instance of ReductionConfig") named no key."""
    from vrgd_ds.ds.config import reduction_config
    from vrgd_ds.ds.internals import UnsupportedConfiguration

    with pytest.raises(UnsupportedConfiguration, match=r"^vrgd: 'per_step' is not an object; write it as "
                                                       r'\{"squares": "per_step"\}'):
        reduction_config({"vrgd": "per_step"})


@pytest.mark.parametrize("block, message", [
    ({"squares": "per_micro_step", "gbar": "local"}, "vrgd.gbar applies to squares 'per_step' and 'hierarchical'"),
    ({"squares": "per_micro_step", "micro_steps": "hooks"}, "vrgd.micro_steps applies to squares 'per_step'"),
    ([], r"^vrgd: \[\] is not an object"), (False, r"^vrgd: False is not an object"),
])
def test_vrgd_options_the_scheme_does_not_read_are_refused(block, message):
    """``gbar`` and ``micro_steps`` are ``per_step``'s and ``hierarchical``'s: with
    ``per_micro_step`` they are refused, as ``node_size`` is outside ``hierarchical``, and a block
    that is not an object is named even when empty. Fails on the code before, which accepted both
    options and ignored them, and took ``[]``, ``false``, ``0`` or ``""`` for an empty block."""
    from vrgd_ds.ds.config import reduction_config
    from vrgd_ds.ds.internals import UnsupportedConfiguration

    with pytest.raises(UnsupportedConfiguration, match=message):
        reduction_config({"vrgd": block})
    assert reduction_config({"vrgd": None}).squares is None


def test_deepspeeds_lamb_on_cpu_takes_fusedlambs_defaults():
    """``"type": "Lamb"`` is DeepSpeed's FusedLamb on a GPU and ours on the CPU accelerator: ours
    takes FusedLamb's defaults for what the config leaves out, so a config tested on CPU trains
    alike on a GPU; it is still Lamb (GSNR off, named Lamb) and takes Lamb's parameters. Fails on
    the code before, whose CPU Lamb had weight decay 0.01 and eps 1e-6 where FusedLamb has 0 and 1e-8."""
    import inspect

    import torch
    from deepspeed.ops.lamb import FusedLamb

    from vrgd_ds.ds.names import accepted_params, check_optimizer_block, engine_spelling, resolve

    fused = inspect.signature(FusedLamb.__init__).parameters
    cls = resolve(engine_spelling("Lamb"))
    opt = cls([torch.nn.Parameter(torch.ones(3))], lr=1e-3)
    for key in ("lr", "betas", "eps", "weight_decay", "min_coeff", "max_coeff", "bias_correction"):
        assert opt.defaults[key] == fused[key].default, key
    assert opt.name == "Lamb" and isinstance(opt, vrgd_ds.Lamb) and not opt.defaults["gsnr"]
    assert accepted_params(cls) == accepted_params(vrgd_ds.Lamb)
    assert cls([torch.nn.Parameter(torch.ones(3))], weight_decay=0.01).defaults["weight_decay"] == 0.01
    assert check_optimizer_block({"optimizer": {"type": "Lamb", "params": {"eps": 1e-6}}}) is cls


def test_deepspeeds_spellings_of_its_own_names_are_read_as_the_engine_reads_them(monkeypatch):
    """DeepSpeed lower-cases its own optimizer names in any case. On the CPU accelerator
    ``"LAMB"`` is our Lamb, as the engine builds it; on a GPU ``"Lamb"`` is DeepSpeed's FusedLamb,
    which the job refuses before any work, naming the fix; its deprecated ``cpu_offload`` is
    refused as ``offload_optimizer`` is. Fails on the code before: the check refused ``"LAMB"``
    that the engine accepts, accepted ``"Lamb"`` on a GPU (and its VR parameters) for an engine
    that then built FusedLamb, and let ``cpu_offload`` through to an engine error naming
    ``offload_optimizer``, a key not in the config."""
    import deepspeed.accelerator

    from vrgd_ds.ds.config import check_config
    from vrgd_ds.ds.internals import UnsupportedConfiguration
    from vrgd_ds.ds.names import check_optimizer_block

    from vrgd_ds.ds.names import DEEPSPEED_LAMB

    assert check_optimizer_block({"optimizer": {"type": "LAMB", "params": {"lr": 1e-3}}}) is DEEPSPEED_LAMB
    with pytest.raises(UnsupportedConfiguration, match=r"zero_optimization.cpu_offload: CPU offload is not supported"):
        check_config({"optimizer": {"type": "VRLamb"}, "zero_optimization": {"stage": 2, "cpu_offload": True}})
    monkeypatch.setattr(deepspeed.accelerator.get_accelerator(), "device_name", lambda *a: "cuda")
    with pytest.raises(UnsupportedConfiguration, match=r"optimizer.type: 'Lamb' is DeepSpeed's own 'lamb' on this "
                                                       r'accelerator.*use "VRLamb" with "params": \{"gsnr": false\}'):
        check_optimizer_block({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3, "gamma": 0.1}}})
    # written in DeepSpeed's own lower case: the same refusal (the code before suggested "Lamb")
    with pytest.raises(UnsupportedConfiguration, match=r"optimizer.type: 'lamb' is DeepSpeed's own 'lamb' on this "
                                                       r'accelerator.*use "VRLamb" with "params": \{"gsnr": false\}'):
        check_optimizer_block({"optimizer": {"type": "lamb", "params": {"lr": 1e-3}}})
    from vrgd_ds.ds.names import DEEPSPEED_DEFAULTS

    assert check_optimizer_block({"optimizer": {"type": "VRLamb", "params": {"lr": 1e-3}}}) is DEEPSPEED_DEFAULTS["VRLamb"]


@pytest.mark.parametrize("files, free, message", [
    (["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"], None,
     "saved by 2 model-parallel ranks (pipeline stages × tensor-parallel ranks)"),
    (["mp_rank_00_model_states.pt"], None, "saved without ZeRO (stage 0): its optimizer state is whole in the "
     "model-state file and loads on any number of ranks as it is; nothing to convert"),
    ([], None, "can't find *_optim_states.pt files in directory"),
    (["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"], 0,
     "(twice the checkpoint), 0 MB are free there"),
])
def test_the_universal_conversion_command_refuses_with_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys,
                                                                                 files, free, message):
    """``python -m vrgd_ds.ds.universal`` on a checkpoint it does not convert (a pipeline's or a
    tensor-parallel one's: one model-state file per model-parallel rank; a stage-0 checkpoint, which
    needs no conversion (said so: fails on the old code, which passed on DeepSpeed's "can't find
    *_optim_states.pt"); a folder without any checkpoint), or where the output's filesystem has less free space than the conversion
    writes (``free`` bytes), exits 2 with one line naming it, and leaves no output folder. Fails
    on the old code: tracebacks, for the pipeline's a partial ``tmp`` in the output folder, and
    on a full disk a conversion started (that case on the code before the space check)."""
    import shutil
    import sys

    import torch

    from vrgd_ds.ds import universal

    tag = tmp_path / "global_step1"
    tag.mkdir()
    if free is not None:
        monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - free, free))
    for name in files:
        torch.save({"optimizer_state_dict": {"zero_stage": 1}} if "optim" in name else {}, tag / name)
    if len(files) > 1 and free is None:  # the pipeline's: its ZeRO-1 optimizer file too
        torch.save({"optimizer_state_dict": {"zero_stage": 1}}, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    out = tmp_path / "global_step1_universal"
    monkeypatch.setattr(sys, "argv", ["universal", "--input_folder", str(tag), "--output_folder", str(out)])
    with pytest.raises(SystemExit) as stop:
        universal.main()
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_auto_squares_fall_back_to_per_step_on_hosts_of_unequally_many_ranks(monkeypatch, caplog):
    """``"squares": "auto"`` on ZeRO-2 where the hosts hold unequally many ranks (8 and 4 GPUs):
    the hierarchical scheme cannot form its nodes, and every rank (each judged the same gathered
    hosts) takes ``per_step``, saying why, rather than refusing the job that ``auto`` was asked to
    make work."""
    import logging

    import torch

    from vrgd_ds.ds import attach
    from vrgd_ds.ds.config import reduction_config

    def unequal(group, world):
        raise ValueError("the hosts hold unequally many ranks (a: 8, b: 4)")

    monkeypatch.setattr(attach.local, "host_node_size", unequal)
    param = types.SimpleNamespace(requires_grad=True, numel=lambda: 1000, device=torch.device("cpu"))
    engine = types.SimpleNamespace(seq_data_parallel_group=None,
                                   module=types.SimpleNamespace(parameters=lambda: iter([param])))
    with caplog.at_level(logging.WARNING, logger="vrgd_ds.ds.attach"):
        scheme = attach._auto(engine, reduction_config({"vrgd": {"squares": "auto"}}), 2, 12)
    assert scheme == "per_step"
    assert "chose per_step: the hierarchical scheme needs nodes" in caplog.text and "a: 8, b: 4" in caplog.text


def test_a_node_size_that_does_not_divide_the_ranks_is_refused_under_auto_whatever_the_memory():
    """``"node_size": 3`` on 8 ranks under ``"auto"``: refused naming it whether or not
    ``per_step`` fits (no device memory limit here, where it fits). Fails on the code before,
    which refused it only where memory made ``auto`` pick ``hierarchical``: the same config
    passed on one cluster and failed on another."""
    import torch

    from vrgd_ds.ds import attach
    from vrgd_ds.ds.config import reduction_config
    from vrgd_ds.ds.internals import UnsupportedConfiguration

    param = types.SimpleNamespace(requires_grad=True, numel=lambda: 1000, device=torch.device("cpu"))
    engine = types.SimpleNamespace(seq_data_parallel_group=None,
                                   module=types.SimpleNamespace(parameters=lambda: iter([param])))
    with pytest.raises(UnsupportedConfiguration, match="vrgd.node_size: 3 does not divide the 8 data-parallel ranks"):
        attach._auto(engine, reduction_config({"vrgd": {"squares": "auto", "node_size": 3}}), 2, 8)


def test_zero12_reduction_stream_waits_for_the_kernel_reading_the_bucket(monkeypatch):
    """With ``overlap_comm`` on a GPU, DeepSpeed 0.19.8's ``average_tensor`` makes its reduction
    stream wait for the streams that copied into the bucket (``copy_streams``), or the current
    one where none are recorded; the statistics' ``pack_bucket``, queued on the current stream
    just before, was not among them when another stream had copied (torch.compile's autograd
    streams): the in-place reduction could overwrite the bucket while the kernel read it. The
    wrapper waits for the copy streams, records, then makes the reduction stream wait for the
    current one. Stand-ins for the streams (no GPU here); fails on the code before, whose
    reduction stream never waited for the current stream."""
    events = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            events.append(f"{self.name} waits {other.name}")

    current, reduction, copy = Stream("current"), Stream("reduction"), Stream("copy")

    class Accelerator:
        def resolves_data_dependency(self):
            return False

        def current_stream(self):
            return current

    monkeypatch.setattr(zero12, "get_accelerator", lambda: Accelerator(), raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current)  # the code before asked torch.cuda
    monkeypatch.setattr(zero12, "buckets_or_hooks", lambda *args, **kwargs: [True])
    bucket = types.SimpleNamespace(params=[(0, 0, 0)], copy_streams={copy})
    zopt = types.SimpleNamespace(bit16_groups=[[torch.zeros(2)]], ipg_buckets={torch.float32: bucket},
                                 overlap_comm=True, reduction_stream=reduction,
                                 average_tensor=lambda tensor, dtype: events.append("reduce"))
    path = object.__new__(zero12.Zero12)
    path.zopt, path.engine, path.per_micro_step = zopt, None, True
    stats = types.SimpleNamespace(record_bucket=lambda *args: events.append("pack"), index=lambda p: 0)
    path.record_micro_steps(stats)
    zopt.average_tensor(torch.zeros(2), torch.float32)
    assert events == ["current waits copy", "pack", "reduction waits current", "reduce"]


@pytest.mark.parametrize("stage, refused", [(3, True), (2, False)])
def test_a_zero3_universal_load_is_refused_before_it_loads(stage, refused):
    """Fails on the old code, which let ``"load_universal": true`` through under ZeRO-3: DeepSpeed's
    ZeRO-3 universal loader restores exp_avg and exp_avg_sq only, so ``gsnr_avg`` restarted at
    p̂ = 1 unseen, and every param group took the first one's options (weight decay 0.1 on the
    no-decay group)."""
    from vrgd_ds.ds.attach import keep_wiring_on_universal_load
    from vrgd_ds.ds.internals import UnsupportedConfiguration

    loads = []
    engine = types.SimpleNamespace(load_checkpoint=lambda *a, **k: loads.append(a) or ("tag", {}),
                                   load_universal_checkpoint=lambda: True, zero_optimization_stage=lambda: stage)
    opt = vrgd_ds.VRAdam([torch.nn.Parameter(torch.zeros(2))])
    keep_wiring_on_universal_load(engine, opt)
    if refused:
        with pytest.raises(UnsupportedConfiguration, match="load_universal.*ZeRO-3.*gsnr_avg.*saved the checkpoint"):
            engine.load_checkpoint("ckpt")
        assert loads == []
    else:
        assert engine.load_checkpoint("ckpt") == ("tag", {}) and loads == [("ckpt",)]


def test_a_misspelt_top_level_block_and_a_bad_gradient_clipping_are_refused_before_any_work(caplog):
    """``"zero_optimisation"`` (DeepSpeed would ignore it and run ZeRO off), and a
    ``gradient_clipping`` DeepSpeed would read as no clipping (-1) or fail on deep in ZeRO's
    set-up (a string), are refused naming the key; a key nothing reads is said once. Fails on the
    code before, which took all three without a word."""
    from vrgd_ds.ds.config import check_config
    from vrgd_ds.ds.internals import UnsupportedConfiguration

    base = {"optimizer": {"type": "VRLamb", "params": {"lr": 1e-3}}}
    with pytest.raises(UnsupportedConfiguration, match="zero_optimisation: not a DeepSpeed config key; did you mean "
                                                       "'zero_optimization'"):
        check_config({**base, "zero_optimisation": {"stage": 2}})
    for clip in (-1.0, "0.5", True, float("inf")):
        with pytest.raises(UnsupportedConfiguration, match=f"gradient_clipping: {clip!r}: must be a finite number >= 0"):
            check_config({**base, "gradient_clipping": clip})
    # a block DeepSpeed 0.19.8 removed: its own words, before any work rather than at initialize
    with pytest.raises(UnsupportedConfiguration, match="amp: NVIDIA Apex AMP integration has been removed"):
        check_config({**base, "amp": {"enabled": True}})
    with pytest.raises(UnsupportedConfiguration, match="zero_optimization.mics_shard_size: MiCS"):
        check_config({**base, "zero_optimization": {"stage": 3, "mics_shard_size": 2}})
    with caplog.at_level("WARNING"):
        check_config({**base, "gradient_clipping": 1.0, "bf16": {"enabled": True}, "note": "x"})
    assert [r.getMessage() for r in caplog.records] == ["note: not a key DeepSpeed or vrgd_ds reads; it has no effect"]


@pytest.mark.parametrize("key, meant", [("BF16", "bf16"), ("FP16", "fp16"), ("VRGD", "vrgd"), ("vrdg", "vrgd"),
                                       ("vgrd", "vrgd"), ("bf61", "bf16"), ("Gradient_Clipping", "gradient_clipping")])
def test_a_misspelt_short_or_other_case_top_level_key_is_refused(key, meant):
    """``"BF16": {"enabled": true}`` would train in fp32 and ``"vrdg": {...}`` run the default
    scheme, DeepSpeed ignoring both; each is refused naming the key meant. Fails on the code
    before, whose difflib match was case-sensitive and, for a key of 4 letters, took one wrong
    letter (0.75) for no match: it only said they had no effect."""
    from vrgd_ds.ds.config import check_config
    from vrgd_ds.ds.internals import UnsupportedConfiguration

    with pytest.raises(UnsupportedConfiguration, match=rf"^{key}: not a DeepSpeed config key; did you mean '{meant}'"):
        check_config({"optimizer": {"type": "VRLamb", "params": {"lr": 1e-3}}, key: {"enabled": True}})


def test_a_zero_block_deepspeed_reads_another_way_is_checked_as_it_reads_it(monkeypatch):
    """DeepSpeed takes ``"stage": "2"`` as stage 2 and ``"zero_optimization": true`` as stage 1:
    the early checks read them so too. Fails on the code before, which skipped every early check
    for a stage given as a string (``gradient_allreduce_op: "sum"`` passed) and raised
    AttributeError on ``true``; and its refusal of offload on the engine named
    ``offload_optimizer`` where the config wrote DeepSpeed's deprecated ``cpu_offload``."""
    from types import SimpleNamespace

    from vrgd_ds.ds.config import NOT_COVERED, check_config
    from vrgd_ds.ds.integration import check_engine
    from vrgd_ds.ds.internals import UnsupportedConfiguration

    base = {"optimizer": {"type": "VRLamb", "params": {"lr": 1e-3}}}
    with pytest.raises(UnsupportedConfiguration, match=rf"'gradient_allreduce_op' is not supported"):
        check_config({**base, "zero_optimization": {"stage": "2"}, "gradient_allreduce_op": "sum"})
    with pytest.raises(UnsupportedConfiguration, match=r"'fp16 with zero_optimization.stage 0' is not supported"):
        check_config({**base, "zero_optimization": False, "fp16": {"enabled": True}})
    check_config({**base, "zero_optimization": True})
    assert "fp16 with zero_optimization.stage 0" in NOT_COVERED
    offload = SimpleNamespace(device="cpu")
    engine = SimpleNamespace(zero_optimization_stage=lambda: 2, zero_offload_optimizer=lambda: offload,
                             _config=SimpleNamespace(_param_dict={"zero_optimization": {"stage": 2,
                                                                                         "cpu_offload": True}}))
    with pytest.raises(UnsupportedConfiguration, match=r"'zero_optimization.cpu_offload' is not supported"):
        check_engine(engine)
    engine._config._param_dict["zero_optimization"] = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    with pytest.raises(UnsupportedConfiguration, match=r"'zero_optimization.offload_optimizer' is not supported"):
        check_engine(engine)
    # bf16 master weights, refused on the engine too (for a script's own config dict)
    engine.zero_offload_optimizer, engine.zero_offload_param = (lambda: None), (lambda: None)
    engine._config.bfloat16_config = SimpleNamespace(enabled=True, bf16_master_weights_and_grads=True)
    with pytest.raises(UnsupportedConfiguration, match=r"'bf16.bf16_master_weights_and_grads' is not supported"):
        check_engine(engine)


def test_every_top_level_key_deepspeed_reads_is_known():
    """``TOP_LEVEL_KEYS`` holds every top-level key DeepSpeed's config reads (its
    ``_initialize_params`` on a dict that records the keys asked for): a DeepSpeed key missing
    there would be said to have no effect, or refused as a near miss of another."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from vrgd_ds.ds.config import TOP_LEVEL_KEYS

    asked: set[str] = set()

    class Recording(dict):
        def get(self, key, default=None):
            asked.add(key)
            return super().get(key, default)

        def __getitem__(self, key):
            asked.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            asked.add(key)
            return super().__contains__(key)

    config = DeepSpeedConfig.__new__(DeepSpeedConfig)
    config._param_dict = Recording({"train_batch_size": 8})
    config._initialize_params(config._param_dict)
    assert len(asked) > 30 and asked <= TOP_LEVEL_KEYS, sorted(asked - TOP_LEVEL_KEYS)
    from deepspeed.runtime.config import _REMOVED_TOP_LEVEL_CONFIG_KEYS

    assert not TOP_LEVEL_KEYS & set(_REMOVED_TOP_LEVEL_CONFIG_KEYS)  # refused by name, not taken as known


@pytest.mark.parametrize("extra, key", [
    ({"zero_optimization": {"stage": 2, "zero_quantized_gradients": True}}, "zero_optimization.zero_quantized_gradients"),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}, "zero_optimization.zero_hpz_partition_size"),
    ({"zero_optimization": {"stage": 1, "elastic_checkpoint": True}}, "zero_optimization.elastic_checkpoint"),
    ({"zero_optimization": {"stage": 2, "contiguous_gradients": False}}, "zero_optimization.contiguous_gradients"),
    ({"gradient_allreduce_op": "sum"}, "gradient_allreduce_op"),
    ({"prescale_gradients": True}, "prescale_gradients"),
    ({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor"),
    ({"fp16": {"enabled": True}}, "fp16 with zero_optimization.stage 0"),
    ({"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"}},
     "data_types.grad_accum_dtype"),
    # accepted before, and untested: VRGD stepped bf16 master partitions
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}, "zero_optimization": {"stage": 2}},
     "bf16.bf16_master_weights_and_grads"),
])
def test_a_set_up_the_hooks_do_not_cover_is_refused_from_the_raw_config(extra, key):
    """The set-ups ``check_engine`` refuses on the engine, refused from the raw dict before any
    work too, in the same words (``NOT_COVERED``). Fails on the code before, which took each of
    them here and refused it only inside ``deepspeed.initialize``, after the job had prepared its
    data and built the model."""
    from vrgd_ds.ds.config import NOT_COVERED, check_config
    from vrgd_ds.ds.internals import UnsupportedConfiguration

    with pytest.raises(UnsupportedConfiguration) as e:
        check_config({"optimizer": {"type": "VRLamb", "params": {"lr": 1e-3}}, **extra})
    assert str(e.value) == f"vrgd_ds: '{key}' is not supported with VRGD optimizers: {NOT_COVERED[key]}"
    check_config({"optimizer": {"type": "VRLamb", "params": {"lr": 1e-3}}, "bf16": {"enabled": True},
                  "zero_optimization": {"stage": 2, "contiguous_gradients": True}, "gradient_allreduce_op": "mean"})


def test_the_deepspeed_job_without_a_launcher_is_one_rank_and_mpi_without_mpi4py_names_the_extra(monkeypatch):
    """``vrgd-pretrain`` typed at a shell (no launcher variables) runs as one rank, the torch
    variables set for it; under an MPI launcher without ``mpi4py`` it stops naming the ``[mpi]``
    extra; as one of several ``srun`` tasks without ``RANK``, or with the variables set in part
    for another rank, it stops saying how to start it. Fails on the old code, which left every
    case to DeepSpeed's MPI discovery: ``ModuleNotFoundError: No module named 'mpi4py'`` even for
    one rank at a shell."""
    import os

    from vrgd_ds import commands
    from vrgd_ds.train.config import ConfigError
    from vrgd_ds.train.engines import deepspeed as engine

    launch = (*engine.TORCH_LAUNCH_ENV, *engine.OTHER_LAUNCH_ENV, "SLURM_PROCID", "SLURM_STEP_NUM_TASKS",
              "AZUREML_EXPERIMENT_ID", "DLTS_JOB_ID", "SM_TRAINING_ENV")
    for var in launch:  # set first, so that monkeypatch restores each as it was (the code sets some itself)
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    assert engine.launch_environment() is False
    assert [os.environ[v] for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")] == ["0", "1", "0", "127.0.0.1"]
    assert os.environ["MASTER_PORT"].isdigit()
    assert engine.launch_environment() is False  # a launcher's variables all set: left to them
    monkeypatch.setattr(commands, "missing_modules", lambda modules: list(modules))
    cases = [({"OMPI_COMM_WORLD_SIZE": "2"}, 'mpi4py, which is not installed; install it with: pip install "vrgd-ds[mpi]"'),
             ({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "4"}, "started by srun as one of 4 tasks without RANK"),
             ({"RANK": "3"}, "set in part (RANK=3; WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK missing)")]
    for env, message in cases:
        for var in launch:
            monkeypatch.delenv(var, raising=False)
        for var, value in env.items():
            monkeypatch.setenv(var, value)
        with pytest.raises(ConfigError) as refused:
            engine.launch_environment()
        assert message in str(refused.value), (env, str(refused.value))
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("AZUREML_EXPERIMENT_ID", "x")
    assert engine.launch_environment() is True  # AzureML: DeepSpeed reads Open MPI's variables, no mpi4py
    monkeypatch.delenv("AZUREML_EXPERIMENT_ID")
    monkeypatch.setattr(commands, "missing_modules", lambda modules: [])
    assert engine.launch_environment() is True  # mpi4py there: DeepSpeed's MPI discovery
    # a MASTER_ADDR the shell exports for a cluster is not this host's rendezvous for one rank
    for var in launch:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "node9")
    assert engine.launch_environment() is False and os.environ["MASTER_ADDR"] == "127.0.0.1"
    # a batch script's own step (no srun step) on a multi-task allocation: one rank
    for var in launch:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert engine.launch_environment() is False and os.environ["WORLD_SIZE"] == "1"
