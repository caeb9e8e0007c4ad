"""The DeepSpeed engine of the job: BERT (``transformers``) under ``deepspeed.initialize`` with a
VRGD optimizer from the config's ``"optimizer"`` block, ZeRO 0-3, fp16/bf16.

One engine serves every phase: at a phase boundary (or an adaptive batch change) the micro-batch
and the global batch are set on it (``set_train_micro_batch_size`` / ``set_train_batch_size``),
so the optimizer state, VRGD statistics and loss scaler carry over. Accumulation boundaries are
set explicitly each micro-step (``set_gradient_accumulation_boundary``): DeepSpeed's own count
(``micro_steps % gradient_accumulation_steps``) would misalign once the accumulation changes.

Checkpoints are DeepSpeed's (``save_checkpoint`` with the job's state as client state,
``save_latest=False``: the spine writes ``latest`` once every rank is done). A checkpoint of
another number of ranks is converted once to DeepSpeed's universal form
(``vrgd_ds.ds.universal``, keeping the GSNR momentum) and loaded that way.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import os
import shutil
import socket
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

import vrgd_ds
from vrgd_ds.data_pipeline.samples import collate
from vrgd_ds.train import checkpoints as ckpt
from vrgd_ds.train.config import ConfigError, JobConfig, deepspeed_config
from vrgd_ds.train.data import JobData, prepare_data
from vrgd_ds.train.engines.base import Engine, local_cuda_device
from vrgd_ds.train.model import build_model, check_model, masked_positions_of
from vrgd_ds.train.resume import ConversionFailed, ResumePlan, convert_command, plan_resume

logger = logging.getLogger(__name__)

STATE_KEY = "vrgd_job"  # the job's state in DeepSpeed's client state


def _inputs(batch: dict[str, torch.Tensor], device: torch.device, next_sentence: bool) -> dict[str, torch.Tensor]:
    """The model's inputs on ``device``, with the masked positions found here, on the host, so that
    the model's head gathers them without a device sync (``model.masked_positions_model``)."""
    keys = ("input_ids", "token_type_ids", "attention_mask", "labels") + (("next_sentence_label",) if next_sentence else ())
    inputs = {k: batch[k].to(device, non_blocking=True) for k in keys}
    inputs["masked_positions"] = masked_positions_of(batch["labels"]).to(device, non_blocking=True)
    return inputs


@contextlib.contextmanager
def zero3_weights_of(tag: str) -> Iterator[None]:
    """DeepSpeed 0.19.8 loads a ZeRO-3 checkpoint without its optimizer states (the weights and
    data position of ``checkpoint.optimizer_state`` "reset_if_incompatible") through
    ``zero_to_fp32`` with no tag (``DeepSpeedEngine._load_checkpoint``), so from the checkpoint the
    directory's ``latest`` names, whatever tag was asked: the weights of ``tag`` meanwhile."""
    import deepspeed.runtime.engine as ds_engine

    original = ds_engine.get_fp32_state_dict_from_zero_checkpoint
    ds_engine.get_fp32_state_dict_from_zero_checkpoint = functools.partial(original, tag=tag)
    try:
        yield
    finally:
        ds_engine.get_fp32_state_dict_from_zero_checkpoint = original


#: what torch.distributed's env:// start reads; DeepSpeed asks MPI for them where one is missing
TORCH_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
#: variables of an MPI launcher (Open MPI, MPICH/Intel MPI, PMIx), whose ranks DeepSpeed's
#: ``init_distributed`` finds through mpi4py, or on AzureML and SageMaker from Open MPI's variables
OTHER_LAUNCH_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


def launch_environment() -> bool:
    """Whether DeepSpeed's ``init_distributed`` is to discover the ranks through MPI
    (``auto_mpi_discovery``). Started by ``deepspeed``, ``torchrun`` or ``launch/slurm.sbatch``
    (the torch variables all set): no. Under ``mpirun``: yes, and ``mpi4py`` must be there, else
    the job stops naming the extra (DeepSpeed's import error named none); on AzureML and SageMaker
    DeepSpeed reads Open MPI's variables without it. With no launcher at all (``vrgd-pretrain``
    typed at a shell, or a batch script's own step): one rank, the variables set for it here, its
    rendezvous on this host (DeepSpeed would ask ``mpi4py`` for a world of one). Under ``srun``
    without the script's mapping of Slurm's variables (a step of several tasks, no ``RANK``):
    refused, since each task would train alone."""
    from vrgd_ds.commands import missing_modules

    if all(var in os.environ for var in TORCH_LAUNCH_ENV):
        return False
    if any(var in os.environ for var in OTHER_LAUNCH_ENV):
        # AzureML (outside DLTS) and SageMaker: DeepSpeed reads Open MPI's variables itself, no mpi4py
        hosted = ("AZUREML_EXPERIMENT_ID" in os.environ and "DLTS_JOB_ID" not in os.environ) or \
            "SM_TRAINING_ENV" in os.environ
        if not hosted and missing_modules(["mpi4py"]):
            raise ConfigError("started by an MPI launcher without the torch.distributed variables ("
                              + ", ".join(TORCH_LAUNCH_ENV) + "): DeepSpeed finds the ranks through mpi4py, which "
                              "is not installed; install it with: pip install \"vrgd-ds[mpi]\"")
        return True
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "1")  # an srun step's (a batch script's own step has none)
    if "SLURM_PROCID" in os.environ and tasks.isdigit() and int(tasks) > 1 and "RANK" not in os.environ:
        raise ConfigError(f"started by srun as one of {tasks} tasks without RANK, WORLD_SIZE and MASTER_ADDR: each "
                          "task would train alone. Start the job through launch/slurm.sbatch (it sets them from "
                          "SLURM_PROCID, SLURM_NTASKS and the first node), or through deepspeed or torchrun")
    given = {var: os.environ[var] for var in TORCH_LAUNCH_ENV if var in os.environ}
    if given and (given.get("WORLD_SIZE", "1") != "1" or given.get("RANK", "0") != "0"):
        shown = ", ".join(f"{k}={v}" for k, v in given.items())
        raise ConfigError(f"the torch.distributed variables are set in part ({shown}; "
                          f"{', '.join(v for v in TORCH_LAUNCH_ENV if v not in given)} missing): start the job "
                          "through deepspeed, torchrun or mpirun, which set them all")
    for var, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(var, value)
    if "MASTER_PORT" not in os.environ:  # this host's rendezvous (a MASTER_ADDR the shell exports names another)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        with socket.socket() as sock:  # a port the OS has free now
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    logger.info("no launcher: one rank (RANK=%s, WORLD_SIZE=%s, MASTER_ADDR=%s, MASTER_PORT=%s); start through "
                "deepspeed, torchrun or mpirun for several", os.environ["RANK"], os.environ["WORLD_SIZE"],
                os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    return False


class DeepSpeedEngine(Engine):
    name = "deepspeed"
    task = "mlm"
    reporter = True  # every rank's loss counts

    @staticmethod
    def config_errors() -> tuple[type[Exception], ...]:
        from vrgd_ds.ds.integration import UnsupportedConfiguration

        return (UnsupportedConfiguration,)

    @staticmethod
    def check_config(raw: dict[str, Any], job: JobConfig, finished: frozenset[int] = frozenset()) -> None:
        from vrgd_ds.ds.config import check_config
        from vrgd_ds.ds.integration import UnsupportedConfiguration

        if raw.get("scheduler") is not None:  # DeepSpeed would step it, and the job set the LR over it: no effect but on betas
            raise ConfigError("scheduler: the job sets the learning rate from its phases (job.phases[*].lr, "
                              "warmup_fraction, decay_power), over any DeepSpeed scheduler's, which would still step "
                              "(OneCycle's momentum cycling rewriting the optimizer's betas); remove the block")
        try:
            check_config(raw)
        except UnsupportedConfiguration as e:
            raise ConfigError(str(e)) from None
        check_model(job.model, max(p.seq_len for p in job.phases))
        if (raw.get("fp16") or {}).get("enabled"):
            from deepspeed.accelerator import get_accelerator

            accelerator = get_accelerator()
            if not accelerator.is_fp16_supported():  # refused before the data is prepared, not at initialize
                raise ConfigError(f"fp16.enabled: DeepSpeed's {accelerator.device_name()} accelerator has no fp16 here "
                                  "(its CPU one only with native fp16 kernels, AVX512-FP16 or AMX-FP16); --set "
                                  "fp16.enabled=false for fp32, or use bf16")

    @staticmethod
    def zero_stage(raw: dict[str, Any]) -> int:
        """``zero_optimization``'s stage as DeepSpeed reads it (``true`` is stage 1, ``"2"`` is 2)."""
        from vrgd_ds.ds.config import zero_block

        return int((zero_block(raw) or {}).get("stage", 0))

    @classmethod
    def check_for_ranks(cls, raw: dict[str, Any], job: JobConfig, world: int,
                        finished: frozenset[int] = frozenset()) -> None:
        """``check_config``, and every phase's batch split over the ``world`` ranks, each a
        data-parallel rank under ZeRO (``phase_settings``), before the process group exists."""
        from vrgd_ds.train.config import phase_settings
        from vrgd_ds.train.schedule import PhaseSchedule

        cls.check_config(raw, job, finished)
        phase_settings(job, world, PhaseSchedule(job).steps, finished)

    def __init__(self, raw: dict[str, Any], job: JobConfig, backend: str | None,
                 timeout: datetime.timedelta, finished: frozenset[int] = frozenset()) -> None:
        import deepspeed

        from vrgd_ds.ds import shm

        self.raw, self.job, self.finished = raw, job, finished
        cuda = torch.cuda.is_available()
        shm.prepare_build()
        deepspeed.init_distributed(dist_backend=backend or ("nccl" if cuda else "gloo"),
                                   auto_mpi_discovery=launch_environment(), timeout=timeout)
        self.rank, self.world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.data_rank, self.data_world = self.rank, self.world
        if cuda:
            torch.cuda.set_device(local_cuda_device(self.rank))
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def setup(self, run_dir: Path, barrier: Callable[[], None]) -> None:
        import deepspeed

        from vrgd_ds.ds import shm

        barrier()  # every rank has mapped its peers' shared memory (CPU accelerator)
        shm.unlink_own_segment(self.rank)
        job = self.job
        self.data: JobData = prepare_data(job, run_dir, self.rank, barrier, sorted({p.seq_len for p in job.phases}))
        self.next_sentence = self.data.next_sentence is not None
        self.fingerprint = self.data.fingerprint()
        torch.manual_seed(job.seed)  # the same initial weights on every rank and every start
        model = build_model(job.model, self.data.vocab_size, max(p.seq_len for p in job.phases), self.next_sentence)
        self.positions = model.config.max_position_embeddings
        ds_cfg = self._initial_config()
        wd = float(ds_cfg.get("optimizer", {}).get("params", {}).get("weight_decay", 0.0))
        groups = vrgd_ds.param_groups(model, weight_decay=wd)
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_cfg)
        self.optimizer = self.engine.basic_optimizer

    def _initial_config(self) -> dict[str, Any]:
        """DeepSpeed's config for ``initialize``, with the batch of the first phase the resumed
        checkpoint has not finished (the job sets each phase's batch when the phase starts): a
        finished phase's may not split over these ranks. Every phase finished, a step of one
        micro-batch per rank (no step is taken)."""
        job = self.job
        index = next((i for i in range(len(job.phases)) if i not in self.finished), None)
        if index is not None:
            return deepspeed_config(self.raw, job.phases[index], self.world, index)
        last = job.phases[-1]
        return deepspeed_config(self.raw, last.model_copy(update={"global_batch": last.micro_batch * self.world}),
                                self.world, len(job.phases) - 1)

    def datasets(self, seq_len: int):
        return self.data.split(seq_len)

    collate = staticmethod(collate)  # a module-level function: DataLoader workers pickle it by name

    def set_batch(self, micro_batch: int, global_batch: int, seq_len: int) -> None:
        self.engine.set_train_micro_batch_size(micro_batch)
        self.engine.set_train_batch_size(global_batch)

    def half_batch_cosine(self):
        from vrgd_ds.train.halves import HalfBatchCosine

        return HalfBatchCosine(self.engine, torch.distributed)

    def train_step(self, batches: Iterator[dict[str, torch.Tensor]], gas: int, seeds: list[int],
                   cosine: Any = None) -> dict[str, Any]:
        if cosine is not None:
            cosine.start(gas)
        loss_sum, tokens = 0.0, 0
        skipped_before = self.optimizer.skipped_steps
        for j in range(gas):
            batch = next(batches)
            tokens += int(batch["attention_mask"].sum())
            self.engine.set_gradient_accumulation_boundary(j == gas - 1)
            torch.manual_seed(seeds[j])
            if cosine is not None:
                cosine.micro_step(j)
            loss = self.engine(**_inputs(batch, self.device, self.next_sentence)).loss
            self.engine.backward(loss)
            self.engine.step()
            loss_sum += float(loss.detach())
        return dict(loss_sum=loss_sum, tokens=tokens, skipped=self.optimizer.skipped_steps > skipped_before,
                    measured=cosine.finish() if cosine is not None else None)

    @torch.no_grad()
    def evaluate(self, batches):
        self.engine.eval()
        loss, correct, count = 0.0, 0.0, 0.0
        for batch in batches:
            inputs = _inputs(batch, self.device, self.next_sentence)
            inputs.pop("next_sentence_label", None)
            out = self.engine(**inputs)  # the logits of the masked positions (model.masked_positions_model)
            logits = (out.prediction_logits if self.next_sentence else out.logits).float()
            labels = inputs["labels"].flatten().index_select(0, inputs["masked_positions"])
            loss += float(torch.nn.functional.cross_entropy(logits, labels, reduction="sum"))
            correct += float((logits.argmax(-1) == labels).sum())
            count += float(labels.numel())
        self.engine.train()
        return loss, correct, count

    # -- checkpoints ---------------------------------------------------------------------------

    def layout(self) -> dict[str, Any]:
        return {"zero_stage": self.engine.zero_optimization_stage()}

    def plan(self, ckpt_dir: Path, tag: str, optimizer: dict[str, Any], policy: str) -> ResumePlan:
        """``resume.plan_resume``; converts ``tag`` to universal form here, once, if the number of
        ranks changed."""
        plan = plan_resume(ckpt_dir, tag, optimizer, self.world, self.engine.zero_optimization_stage(), policy)
        if plan.switched:
            self.optimizer.report_load = False  # the plan's line says it once
        if not plan.universal:
            return plan
        # rank 0 alone decides whether the conversion is there: the record is what its conversion
        # writes last, so a rank reading it for itself could find it written and skip the collective
        # below while rank 0 waits in it
        error = None
        if self.rank == 0 and ckpt.converted(ckpt_dir, tag) is None:
            try:
                from vrgd_ds.ds.universal import convert

                out = ckpt_dir / ckpt.UNIVERSAL / tag
                shutil.rmtree(out, ignore_errors=True)  # a conversion cut short
                keys = convert(str(ckpt_dir / tag), str(out))
                ckpt.record_conversion(ckpt_dir, tag, plan.saved_world, keys)
            except Exception as e:  # noqa: BLE001 (reported on every rank below)
                error = f"{type(e).__name__}: {e}"
                shutil.rmtree(ckpt_dir / ckpt.UNIVERSAL / tag, ignore_errors=True)
        flag = torch.tensor([1.0 if error else 0.0], device=self.device)
        torch.distributed.broadcast(flag, src=0)  # every rank, whatever it would have read on disk
        if flag.item():
            raise ConversionFailed(f"{ckpt_dir / tag}: saved on {plan.saved_world} ranks, resumed on {self.world}; "
                                   f"converting it to a universal checkpoint failed ({error or 'see rank 0'}). Convert "
                                   f"it by hand to see why: {convert_command(ckpt_dir, tag)}; or resume it on "
                                   f"{plan.saved_world} ranks")
        return plan

    def load(self, ckpt_dir: Path, tag: str, plan: ResumePlan) -> dict[str, Any] | None:
        config = self.engine._config
        before = config.load_universal_checkpoint
        # DeepSpeed 0.19.8 reads the flag at load time (engine.load_universal_checkpoint())
        config.load_universal_checkpoint = plan.universal
        # (a universal load keeps the optimizer's wiring as built: vrgd_ds.ds.attach)
        try:
            load_dir = ckpt_dir / ckpt.UNIVERSAL if plan.universal else ckpt_dir
            with zero3_weights_of(tag):
                path, client = self.engine.load_checkpoint(str(load_dir), tag=tag,
                                                           load_optimizer_states=plan.optimizer_states,
                                                           load_lr_scheduler_states=plan.optimizer_states)
        finally:
            config.load_universal_checkpoint = before
        # ZeRO's load puts the saved clip_grad back over the config's (_load_global_state); the
        # config decides, as for optimizer.params (Job._apply_configured_options)
        zero, configured = self.engine.optimizer, self.engine.gradient_clipping()
        if path is not None and getattr(zero, "clip_grad", configured) != configured:
            if self.rank == 0:
                logger.warning("gradient_clipping: the checkpoint has %s, the config %s; continuing with the config's",
                               zero.clip_grad, configured)
            zero.clip_grad = configured
        return (client or {}).get(STATE_KEY) if path is not None else None

    def save(self, ckpt_dir: Path, tag: str, state: dict[str, Any]) -> None:
        self.engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={STATE_KEY: state}, save_latest=False)

    def checkpoint_bytes(self) -> int:
        """The optimizer state and fp32 master partitions of this rank, and rank 0's module."""
        opt = self.optimizer
        local = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if torch.is_tensor(t))
        local += sum(p.numel() * 4 for g in opt.param_groups for p in g["params"])
        if self.rank == 0:
            local += sum(p.numel() * p.element_size() for p in self.engine.module.parameters())
        return local


ENGINE = DeepSpeedEngine
