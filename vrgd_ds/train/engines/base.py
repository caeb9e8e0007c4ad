"""What the job spine (``vrgd_ds/train/loop.py``) asks of a training engine.

The spine owns the run: the run directory, the watchdog, the pre-emption signal, the data
stream (samplers keyed by samples consumed), the LR schedule, the step loop, divergence and
disk checks, checkpoint rotation and completeness markers, resume rules and telemetry. An
engine owns the model and the optimizer as its framework builds them: the process group, one
optimizer step of ``gas`` micro-batches, an evaluation, and writing or reading one checkpoint
directory. Collectives the spine needs (a flag agreed over the ranks, a barrier) go through
``torch.distributed`` on the default group the engine has set up.
"""
from __future__ import annotations

import abc
import datetime
import os
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from vrgd_ds.optim.base import GSNROptimizer
from vrgd_ds.train.config import JobConfig
from vrgd_ds.train.resume import ResumePlan


#: where launchers put this process's rank and the number of ranks, before a process group exists
#: (torchrun/deepspeed, Open MPI, MPICH/Intel MPI, Slurm's srun)
LAUNCHER_RANK = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
LAUNCHER_WORLD = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")


def launcher_value(names: tuple[str, ...]) -> int | None:
    """The first of ``names`` the launcher set to an integer (None: none is set)."""
    for var in names:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return None


def local_cuda_device(rank: int | None) -> int:
    """This rank's GPU: ``LOCAL_RANK`` (else ``rank`` modulo the GPUs) among the GPUs it sees, or
    the one it sees where the launcher bound each task to its own GPU (Slurm's
    ``--gpus-per-task=1`` or ``--gpu-bind``: ``LOCAL_RANK`` is then the task's index on the node,
    not its device's). A ``LOCAL_RANK`` past the GPUs seen is an error naming both."""
    count = torch.cuda.device_count()
    if count == 1:
        return 0
    local = os.environ.get("LOCAL_RANK")
    local = int(local) if local is not None else (rank % count if rank is not None and count else 0)
    if local >= count:
        raise RuntimeError(f"LOCAL_RANK {local}, but this rank sees {count} GPUs (CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): start one task per GPU (Slurm: "
                           "--ntasks-per-node equal to the GPUs per node)")
    return local


class Engine(abc.ABC):
    """One training engine. Attributes set by ``__init__``: ``rank``, ``world``, ``device``,
    ``data_rank`` / ``data_world`` (the ranks that read different samples: every rank under
    DeepSpeed, the data-parallel group under Megatron). After ``setup``: ``optimizer`` (the
    VRGD optimizer whose ``param_groups`` the spine sets the LR on and whose ``gsnr_metrics``
    it logs), ``fingerprint`` (the data stream's), ``positions`` (the model's learned position
    table, ``config.position_table``: recorded in the marker, a resume compares it) and ``task`` (``"mlm"`` or ``"lm"``: the
    evaluation's metric names, ``eval/<task>_loss`` and ``eval/<task>_acc``)."""

    name: str
    task: str
    reporter: bool
    """Whether this rank's losses and evaluation sums count (one rank per data-parallel rank:
    under Megatron, the last pipeline stage's first tensor-parallel rank)."""
    rank: int
    world: int
    device: torch.device
    data_rank: int
    data_world: int
    optimizer: GSNROptimizer
    fingerprint: str
    positions: int

    @staticmethod
    @abc.abstractmethod
    def check_config(raw: dict[str, Any], job: JobConfig, finished: frozenset[int] = frozenset()) -> None:
        """Everything checkable before a process group exists; raises ``ConfigError`` naming
        the key and the fix. ``finished``: the phases the checkpoint it resumes from has finished
        (``config.finished_phases``), whose batches need not split over the ranks."""

    @classmethod
    def check_for_ranks(cls, raw: dict[str, Any], job: JobConfig, world: int,
                        finished: frozenset[int] = frozenset()) -> None:
        """``check_config``, and the checks that need the number of ranks where the engine's
        layout does (``--check-resume``, which knows the ranks without a process group)."""
        cls.check_config(raw, job, finished)

    @staticmethod
    def zero_stage(raw: dict[str, Any]) -> int:
        """The ZeRO stage the configuration asks for, as the engine reads it (0: none)."""
        return 0

    @staticmethod
    def config_errors() -> tuple[type[Exception], ...]:
        """The engine's own exceptions for a configuration it refuses (exit ``EXIT_CONFIG``)."""
        return ()

    @abc.abstractmethod
    def __init__(self, raw: dict[str, Any], job: JobConfig, backend: str | None,
                 timeout: datetime.timedelta, finished: frozenset[int] = frozenset()) -> None:
        """Joins the process group (``timeout`` for every collective) and picks the device;
        ``finished`` as ``check_config``'s."""

    @abc.abstractmethod
    def setup(self, run_dir: Path, barrier: Callable[[], None]) -> None:
        """Data (rank 0 prepares it first; ``barrier`` waits for it), model and optimizer."""

    @abc.abstractmethod
    def datasets(self, seq_len: int) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
        """(training, held-out) samples of ``seq_len``, keyed by ``(epoch, index)``."""

    @abc.abstractmethod
    def collate(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """A micro-batch from samples (a module-level function as a ``staticmethod``, so that
        DataLoader workers pickle it by name, not the engine)."""

    def set_batch(self, micro_batch: int, global_batch: int, seq_len: int) -> None:  # noqa: B027 (optional)
        """The next steps' batch (between optimizer steps: a phase begins, the adaptive batch changes)."""

    def set_lr(self, lr: float) -> None:
        """The next step's learning rate on every param group."""
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    @abc.abstractmethod
    def train_step(self, batches: Iterator[dict[str, torch.Tensor]], gas: int, seeds: list[int],
                   cosine: Any = None) -> dict[str, Any]:
        """One optimizer step of ``gas`` micro-batches from ``batches`` (``torch.manual_seed(seeds[j])``
        before micro-batch j's forward; ``cosine``: the half-batch cosine to measure). Returns
        ``loss_sum`` (the micro-batches' mean losses, summed), ``tokens``, ``skipped`` (the
        optimizer skipped the step: non-finite gradients, fp16 overflow), ``measured`` and
        optionally ``metrics`` (the engine's own rows for the step's record)."""

    @abc.abstractmethod
    def evaluate(self, batches: list[dict[str, torch.Tensor]]) -> tuple[float, float, float]:
        """This rank's (loss sum, correct predictions, predicted tokens) over ``batches``; every rank
        calls it, a rank that is not a ``reporter`` returns zeros (the spine sums over ranks)."""

    @abc.abstractmethod
    def plan(self, ckpt_dir: Path, tag: str, optimizer: dict[str, Any], policy: str) -> ResumePlan:
        """How ``tag`` loads here (another optimizer, another layout); may convert it first."""

    @abc.abstractmethod
    def save(self, ckpt_dir: Path, tag: str, state: dict[str, Any]) -> None:
        """Writes checkpoint ``tag`` (every rank calls it) with the job's ``state``."""

    @abc.abstractmethod
    def load(self, ckpt_dir: Path, tag: str, plan: ResumePlan) -> dict[str, Any] | None:
        """Loads ``tag`` per ``plan``; returns the job's state saved with it (None: not there)."""

    @abc.abstractmethod
    def checkpoint_bytes(self) -> int:
        """This rank's share of a checkpoint, in bytes (the spine sums over the ranks)."""

    @abc.abstractmethod
    def layout(self) -> dict[str, Any]:
        """What a checkpoint's marker records about the engine's layout (ZeRO stage; TP, PP, DP)."""

    def half_batch_cosine(self) -> Any:
        """The measured half-batch cosine of the adaptive batch (``halves.HalfBatchCosine``), or
        None where the engine has none (the config check refuses ``measure_cosine_every``)."""
        return None

    def close(self) -> None:  # noqa: B027 (optional)
        """Per-rank clean-up before the process group ends."""
