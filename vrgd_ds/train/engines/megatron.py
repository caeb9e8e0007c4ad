"""The Megatron-core engine of the job: a GPT from ``megatron.core.models`` in Megatron's
``DistributedDataParallel`` (its distributed optimizer by default), tensor, pipeline and data
parallelism (several model chunks a stage with ``virtual_pipeline_model_parallel_size``),
Megatron's schedule (``get_forward_backward_func``; the interleaved one with chunks) and gradient
finalisation, and a VRGD optimizer through ``vrgd_ds.megatron.get_megatron_optimizer``.

The config is the job's file with ``"job": {"engine": "megatron", ...}``, the ``"optimizer"``
block (``type`` and ``params``, as in a DeepSpeed config) and a ``"megatron"`` block
(``MegatronBlock``: the GPT's shape, the parallel sizes, precision, the DDP options)::

    "megatron": {"model": {"num_layers": 24, "hidden_size": 2048, "num_attention_heads": 16},
                 "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "precision": "bf16"}

Data: the job's prepared corpus (``job.data``, as for BERT), its training documents' tokens cut
into windows of ``seq_len + 1`` (``data.Windows``); the ranks of one data-parallel rank read the
same micro-batches. ``job.phases`` work as for BERT: ``global_batch`` = ``micro_batch`` ×
accumulation × data-parallel ranks.

Checkpoints are Megatron dist-checkpointing (``torch_dist``) directories: the model's
``sharded_state_dict``, the optimizer's (``vrgd_ds.megatron.checkpoint``: ``vrgd_model_space``,
every state key in model space) and the job's state, so a checkpoint resumes on another tensor-,
pipeline- or data-parallel size. Without a GPU the ranks run on the CPU with gloo
(``vrgd_ds.megatron.cpu_ranks`` answers Megatron's CUDA assumptions, with a log line).
"""
from __future__ import annotations

import datetime
import json
import logging
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vrgd_ds.optim.registry import REGISTRY, OptimizerBlockError, checked_group
from vrgd_ds.train.config import ConfigError, JobConfig, gradient_accumulation, position_table, validation_error
from vrgd_ds.train.data import JobData, prepare_data, stack
from vrgd_ds.train.engines.base import LAUNCHER_RANK, LAUNCHER_WORLD, Engine, launcher_value, local_cuda_device
from vrgd_ds.train.resume import ResumePlan, gpt_change, plan_resume, wrapper_change
from vrgd_ds.train.seeds import hashed_seed

logger = logging.getLogger(__name__)

BLOCK = "megatron"
KEYS = ("job", "optimizer", BLOCK, "checkpoint")  # the file's top-level keys for this engine
STATE_KEY = "vrgd_job"  # the job's state (JSON text) in the dist-checkpoint's common part
CLIPPING = "megatron.clip_grad"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class GPTShape(_Strict):
    """``megatron.model``: the GPT (``TransformerConfig`` fields; local layer spec)."""

    num_layers: int = Field(ge=1)
    """Transformer layers (split over the pipeline stages)."""
    hidden_size: int = Field(ge=1)
    """Width of the residual stream."""
    num_attention_heads: int = Field(ge=1)
    """Attention heads (split over the tensor-parallel ranks)."""
    ffn_hidden_size: int | None = Field(None, ge=1)
    """Default: 4 × hidden_size."""
    hidden_dropout: float = Field(0.1, ge=0.0, lt=1.0)
    """Dropout after the attention and MLP blocks."""
    attention_dropout: float = Field(0.1, ge=0.0, lt=1.0)
    """Dropout of the attention probabilities."""
    max_position_embeddings: int | None = Field(None, ge=1)
    """Learned positions (default: the longest phase's ``seq_len``). A checkpoint resumes only
    into the same number, so a run whose later phases (added at a resume) will be longer sets
    the longest from its start."""
    vocab_size: int | None = Field(None, ge=1)
    """Default: the tokenizer's, padded to a multiple of 128 × tensor-parallel size (Megatron's
    ``make_vocab_size_divisible_by``); given, it must hold every token id."""
    share_embeddings_and_output_weights: bool = False
    """The output layer uses the word embedding's weight (Megatron's tie). With pipeline stages the
    last stage holds a copy, summed with the first stage's once per step: a member with the GSNR
    needs ``megatron.tied_across_stages`` "gsnr_off" there. A checkpoint resumes only into the same tie."""


class MegatronBlock(_Strict):
    """The ``"megatron"`` block."""

    model: GPTShape
    """The GPT's shape."""
    tensor_model_parallel_size: int = Field(1, ge=1)
    """Ranks each layer's weights are split over (TP × PP divides the ranks; the rest is DP)."""
    pipeline_model_parallel_size: int = Field(1, ge=1)
    """Pipeline stages the layers are split over."""
    virtual_pipeline_model_parallel_size: int | None = Field(None, ge=2)
    """Model chunks per pipeline stage (Megatron's interleaved schedule: stage s holds layer blocks
    s, s + PP, ...; a smaller bubble for more exchanges). Needs 2 or more stages, the layers a
    multiple of PP × this, and each phase's micro-batches per data-parallel rank a multiple of PP.
    A checkpoint resumes on another number of chunks (dist-checkpointing reshards; tested from 2
    chunks to 1 and from 1 to 2)."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """bf16/fp16: the model in that dtype inside Megatron's ``Float16Module``, gradients reduced in
    fp32, fp32 main parameters in the optimizer (fp16 with Megatron's dynamic loss scale)."""
    use_distributed_optimizer: bool = True
    """Megatron's distributed optimizer: the optimizer state sharded over the data-parallel ranks."""
    overlap_grad_reduce: bool = False
    """Reduce each gradient bucket while the backward goes on (Megatron's overlap)."""
    bucket_size: int | None = Field(None, ge=1)
    """Elements per gradient bucket (default: Megatron's); Megatron buckets only with ``overlap_grad_reduce``,
    and with model chunks only the first chunk's gradients (the others reduce at the step's end, as
    in Megatron-LM's training)."""
    clip_grad: float = Field(1.0, ge=0.0)
    """Global gradient-norm clipping (0: off)."""
    tied_across_stages: Literal["refuse", "gsnr_off"] = "refuse"
    """The tensors Megatron sums across pipeline stages (an embedding tied across them):
    ``"refuse"`` a member with the GSNR on them, ``"gsnr_off"`` step them as the base optimizer,
    every other tensor with its GSNR (``get_megatron_optimizer``'s argument, docs/megatron.md)."""


def parse_block(raw: dict[str, Any]) -> MegatronBlock:
    """The validated ``"megatron"`` block; errors name the key."""
    if not isinstance(raw.get(BLOCK), dict):
        raise ConfigError(f'{BLOCK}: the megatron engine needs a "{BLOCK}" block, e.g. {{"model": {{"num_layers": 2, '
                          '"hidden_size": 64, "num_attention_heads": 4}}}} (configs/megatron/)')
    try:
        return MegatronBlock.model_validate(raw[BLOCK])
    except ValidationError as e:
        raise validation_error(e, BLOCK, MegatronBlock) from None


def check(raw: dict[str, Any], job: JobConfig, world: int | None,
          finished: frozenset[int] = frozenset()) -> MegatronBlock:
    """Every check of a Megatron job's config that needs no process group; ``world``: the ranks
    (None: not known yet, the layout's checks wait for the process group); ``finished``: the
    phases the resumed checkpoint has finished, whose batches need not split over them."""
    extra = [k for k in raw if k not in KEYS]
    if extra:
        raise ConfigError(f"{extra[0]}: not a key of a megatron-engine config (it has {', '.join(KEYS)}); "
                          "DeepSpeed's keys (zero_optimization, fp16, bf16, gradient_clipping, ...) belong to "
                          "job.engine \"deepspeed\": set precision and clipping in the megatron block")
    block = parse_block(raw)
    try:
        _, group = checked_group(raw.get("optimizer"), CLIPPING)  # the options the member's param group gets
    except OptimizerBlockError as e:
        raise ConfigError(str(e)) from None
    if "model" in raw.get("job", {}):
        raise ConfigError("job.model: describes the BERT of the deepspeed engine; the megatron engine's GPT is "
                          f"{BLOCK}.model")
    if job.data.next_sentence is not None:
        raise ConfigError("job.data.next_sentence: a BERT task; the megatron engine trains a causal language model")
    longest = max(p.seq_len for p in job.phases)
    if block.model.max_position_embeddings is not None and block.model.max_position_embeddings < longest:
        raise ConfigError(f"{BLOCK}.model.max_position_embeddings: {block.model.max_position_embeddings} positions are "
                          f"fewer than the longest phase's seq_len {longest}; raise it or remove it (the default is "
                          "that length)")
    for i, p in enumerate(job.phases):
        if p.adaptive_batch is not None:
            raise ConfigError(f"job.phases[{i}].adaptive_batch: not supported by the megatron engine; use job.engine "
                              "\"deepspeed\" for an adaptive batch, or a fixed global_batch")
    if block.bucket_size is not None and not block.overlap_grad_reduce:
        raise ConfigError(f"{BLOCK}.bucket_size: Megatron's DDP buckets gradients only with {BLOCK}.overlap_grad_reduce "
                          "true (without it, one bucket holds them all); set both, or remove bucket_size")
    tp, pp = block.tensor_model_parallel_size, block.pipeline_model_parallel_size
    if block.model.num_attention_heads % tp:
        raise ConfigError(f"{BLOCK}.model.num_attention_heads: {block.model.num_attention_heads} heads do not split "
                          f"over tensor_model_parallel_size {tp}")
    if block.model.hidden_size % block.model.num_attention_heads:
        raise ConfigError(f"{BLOCK}.model.hidden_size: {block.model.hidden_size} is not a multiple of "
                          f"num_attention_heads {block.model.num_attention_heads}")
    if block.model.num_layers % pp:
        raise ConfigError(f"{BLOCK}.model.num_layers: {block.model.num_layers} layers do not split into "
                          f"pipeline_model_parallel_size {pp} stages")
    vpp = block.virtual_pipeline_model_parallel_size
    if vpp is not None and pp < 2:
        raise ConfigError(f"{BLOCK}.virtual_pipeline_model_parallel_size: model chunks interleave pipeline stages, and "
                          f"pipeline_model_parallel_size is {pp}; set it to 2 or more, or remove the key")
    if vpp is not None and block.model.num_layers % (pp * vpp):
        raise ConfigError(f"{BLOCK}.model.num_layers: {block.model.num_layers} layers do not split into {pp} stages × "
                          f"{vpp} model chunks (virtual_pipeline_model_parallel_size)")
    if (block.model.share_embeddings_and_output_weights and pp > 1 and group.get("gsnr")
            and block.tied_across_stages == "refuse"):
        raise ConfigError(f"{BLOCK}.model.share_embeddings_and_output_weights: with {pp} pipeline stages the tied "
                          "weight's copies on the first and last stage are summed once per step, so no micro-batch "
                          f"gradient of it is whole and {raw['optimizer']['type']} cannot take its GSNR; set "
                          f"{BLOCK}.tied_across_stages to \"gsnr_off\" (it then steps as the base optimizer, every "
                          "other tensor with its GSNR), untie the embeddings, or use pipeline_model_parallel_size 1")
    ffn = block.model.ffn_hidden_size or 4 * block.model.hidden_size
    for key, size in (("vocab_size", block.model.vocab_size), ("ffn_hidden_size", ffn)):
        if size is not None and size % tp:
            raise ConfigError(f"{BLOCK}.model.{key}: {size}" + ("" if block.model.ffn_hidden_size or key != "ffn_hidden_size"
                              else " (4 × hidden_size)") + f" does not split over tensor_model_parallel_size {tp}")
    if world is not None:
        if world % (tp * pp):
            raise ConfigError(f"{BLOCK}.tensor_model_parallel_size × pipeline_model_parallel_size = {tp} × {pp} does "
                              f"not divide the {world} ranks; change the sizes or the number of ranks")
        for i, p in enumerate(job.phases):
            if i in finished:
                continue
            try:
                gas = gradient_accumulation(p, world // (tp * pp), i)
            except ConfigError as e:
                raise ConfigError(f"{e} (data-parallel ranks: {world} ranks / (TP {tp} × PP {pp}))") from None
            if vpp is not None and gas % pp:
                raise ConfigError(f"job.phases[{i}].global_batch: {p.global_batch} gives {gas} micro-batches of "
                                  f"{p.micro_batch} per data-parallel rank, and with {BLOCK}."
                                  f"virtual_pipeline_model_parallel_size Megatron's interleaved schedule runs them in "
                                  f"groups of pipeline_model_parallel_size {pp}: make them a multiple of {pp}")
    return block


def init_process_group(backend: str | None, timeout: datetime.timedelta) -> torch.device:
    """NCCL on GPUs; gloo with ``cpu_ranks`` on CPU ranks. Returns this rank's device."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_cuda_device(launcher_value(LAUNCHER_RANK)))
        dist.init_process_group(backend or "nccl", timeout=timeout)
        return torch.device("cuda", torch.cuda.current_device())
    from vrgd_ds.megatron import cpu_ranks

    cpu_ranks.apply()
    dist.init_process_group(backend or "gloo", timeout=timeout)
    if dist.get_rank() == 0:
        logger.info("no GPU: megatron-core runs on CPU ranks with gloo (vrgd_ds.megatron.cpu_ranks)")
    return torch.device("cpu")


def padded_vocab(vocab: int, tp: int, multiple: int = 128) -> int:
    """Megatron's ``make_vocab_size_divisible_by``: a multiple of ``multiple`` × ``tp``."""
    step = multiple * tp
    return -(-vocab // step) * step


def _interleaved_exchange(vpp: int | None) -> dict[str, bool]:
    """The stages' exchange with model chunks: Megatron-LM's default there, each send and receive
    posted on its own and overlapped with compute (``overlap_p2p_comm``), not megatron-core's
    batched default (``batch_p2p_comm``). With 2 stages the batched exchange posts a send and a
    receive for each direction to and from the same rank, in the same order on both: messages
    between two ranks match in the order posted, so a gradient met an activation's receive (seen in
    this job, 4 layers over 2 stages of 2 chunks: a first step's global grad norm of 98.8, against
    1.44 with this exchange). One chunk a stage keeps megatron-core's default."""
    return {} if vpp is None else {"overlap_p2p_comm": True, "batch_p2p_comm": False}


def build_gpt(block: MegatronBlock, optimizer: dict[str, Any], vocab_size: int, max_seq: int, seed: int,
              device: torch.device):
    """The GPT chunks of this pipeline stage (one, or ``virtual_pipeline_model_parallel_size``), each
    in Megatron's DDP, and their VRGD optimizer (model-parallel state initialised first). Returns
    ``(TransformerConfig, [ddp, ...], ChainedOptimizer)``; each param group decays by
    ``optimizer.params.weight_decay`` times Megatron's ``wd_mult`` (0 for biases and norms)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from vrgd_ds.megatron import get_megatron_optimizer

    m, tp, pp = block.model, block.tensor_model_parallel_size, block.pipeline_model_parallel_size
    vpp = block.virtual_pipeline_model_parallel_size
    half = {"bf16": block.precision == "bf16", "fp16": block.precision == "fp16"}
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(block.precision, torch.float32)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     virtual_pipeline_model_parallel_size=vpp)
    torch.manual_seed(seed)  # the same initial weights on every start
    if device.type == "cuda":
        from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

        get_cuda_rng_tracker().reset()
        model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(num_layers=m.num_layers, hidden_size=m.hidden_size,
                               num_attention_heads=m.num_attention_heads, ffn_hidden_size=m.ffn_hidden_size,
                               hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
                               use_cpu_initialization=device.type == "cpu", tensor_model_parallel_size=tp,
                               pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                               params_dtype=dtype, pipeline_dtype=dtype, **half, **_interleaved_exchange(vpp))
    chunks = []
    for v in range(vpp or 1):  # chunk v of stage s: layer block v × PP + s (Megatron's assignment)
        where = {} if vpp is None else {"ignore_virtual": False, "vp_stage": v}
        model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=vocab_size, max_sequence_length=max_seq,
                         pre_process=ps.is_pipeline_first_stage(**where), post_process=ps.is_pipeline_last_stage(**where),
                         share_embeddings_and_output_weights=m.share_embeddings_and_output_weights,
                         vp_stage=None if vpp is None else v)
        if device.type == "cuda":
            model.cuda()
        if block.precision != "fp32":
            model = Float16Module(config, model)
        chunks.append(DistributedDataParallel(config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=block.overlap_grad_reduce,
            use_distributed_optimizer=block.use_distributed_optimizer, bucket_size=block.bucket_size), model,
            disable_bucketing=v > 0))  # as Megatron's training: the later chunks' gradients reduce at the step's end
    params = dict(optimizer.get("params") or {})
    # the block means what it means on the DeepSpeed engine: an option it does not name takes the member's
    # default, not Megatron's OptimizerConfig's (adam_eps 1e-8, sgd_momentum), which get_megatron_optimizer fills in
    member = REGISTRY[optimizer["type"]].cls([torch.zeros(1, requires_grad=True)], **params).param_groups[0]
    params.update({k: member[k] for k in ("betas", "eps", "momentum") if k in member and k not in params})
    ocfg = OptimizerConfig(optimizer="adam", lr=params.pop("lr", member["lr"]),
                           weight_decay=params.pop("weight_decay", member["weight_decay"]),
                           clip_grad=block.clip_grad, use_distributed_optimizer=block.use_distributed_optimizer,
                           params_dtype=dtype, **half)
    opt = get_megatron_optimizer(ocfg, chunks, optimizer=optimizer["type"], optimizer_kwargs=params,
                                 tied_across_stages=block.tied_across_stages)
    for chained in opt.chained_optimizers:  # Megatron's per-group multiplier, which its own scheduler applies
        for g in chained.optimizer.param_groups:  # (this job sets the LR itself): no decay on biases and norms
            g["weight_decay"] = ocfg.weight_decay * g.get("wd_mult", 1.0)
    return config, chunks, opt


def _attention_mask(seq: int, device: torch.device) -> torch.Tensor:
    return torch.tril(torch.ones(1, 1, seq, seq, device=device)) < 0.5


class MegatronEngine(Engine):
    name = "megatron"
    task = "lm"

    @staticmethod
    def config_errors() -> tuple[type[Exception], ...]:
        from vrgd_ds.megatron.internals import UnsupportedMegatronConfiguration

        return (UnsupportedMegatronConfiguration,)

    @staticmethod
    def check_config(raw: dict[str, Any], job: JobConfig, finished: frozenset[int] = frozenset()) -> None:
        from vrgd_ds.megatron.internals import check_version

        try:  # megatron-core installed, at the release vrgd_ds.megatron reads
            check_version()
        except (ImportError, RuntimeError) as e:
            raise ConfigError(f"job.engine 'megatron': {e}") from None
        check(raw, job, launcher_value(LAUNCHER_WORLD), finished)

    @classmethod
    def check_for_ranks(cls, raw: dict[str, Any], job: JobConfig, world: int,
                        finished: frozenset[int] = frozenset()) -> None:
        cls.check_config(raw, job, finished)
        check(raw, job, world, finished)

    def __init__(self, raw: dict[str, Any], job: JobConfig, backend: str | None,
                 timeout: datetime.timedelta, finished: frozenset[int] = frozenset()) -> None:
        from megatron.core import parallel_state as ps

        self.raw, self.job = raw, job
        self.device = init_process_group(backend, timeout)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.block = check(raw, job, self.world, finished)
        ps.initialize_model_parallel(tensor_model_parallel_size=self.block.tensor_model_parallel_size,
                                     pipeline_model_parallel_size=self.block.pipeline_model_parallel_size,
                                     virtual_pipeline_model_parallel_size=self.block.virtual_pipeline_model_parallel_size)
        self.ps = ps
        self.data_rank, self.data_world = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.reporter = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
        self.micro_batch, self.seq_len = job.phases[0].micro_batch, job.phases[0].seq_len

    def setup(self, run_dir: Path, barrier: Callable[[], None]) -> None:
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.pipeline_parallel import get_forward_backward_func

        job, block = self.job, self.block
        # (the preparation's sample indices are BERT's; the windows need only its tokenizer and shards)
        self.data: JobData = prepare_data(job, run_dir, self.rank, barrier, sorted({p.seq_len for p in job.phases}),
                                          windows=True)
        self.fingerprint = self.data.fingerprint(windows=True)
        vocab = self.data.vocab_size
        if block.model.vocab_size is not None and block.model.vocab_size < vocab:
            raise ConfigError(f"{BLOCK}.model.vocab_size: {block.model.vocab_size} is below the tokenizer's {vocab} "
                              "pieces; raise it or remove the key (the tokenizer's, padded)")
        size = block.model.vocab_size or padded_vocab(vocab, block.tensor_model_parallel_size)
        self.positions = position_table(job, self.raw)[0]
        self.config, self.chunks, self.megatron_optimizer = build_gpt(
            block, self.raw["optimizer"], size, self.positions, job.seed, self.device)
        self.config.finalize_model_grads_func = finalize_model_grads
        no_sync = [c.no_sync for c in self.chunks]
        self.config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        self.config.grad_scale_func = self.megatron_optimizer.scale_loss  # each micro-batch's loss (fp16)
        self.optimizer = self.megatron_optimizer.chained_optimizers[0].optimizer
        sources = self.megatron_optimizer.vrgd_sources
        self.source = sources[0] if sources else None  # none with the GSNR off (Lamb)
        self.forward_backward = get_forward_backward_func()

    def datasets(self, seq_len: int):
        return self.data.windows(seq_len)

    collate = staticmethod(stack)  # a module-level function: DataLoader workers pickle it by name

    def set_batch(self, micro_batch: int, global_batch: int, seq_len: int) -> None:
        self.micro_batch, self.seq_len = micro_batch, seq_len

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:  # Megatron's per-group multiplier (its scheduler's rule)
            g["lr"] = lr * g.get("lr_mult", 1.0)

    def _run(self, batches: Iterator[dict[str, torch.Tensor]], count: int, forward_only: bool,
             loss_of: Callable[[dict[str, torch.Tensor], torch.Tensor], tuple[torch.Tensor, dict]],
             seeds: list[int] | None = None, with_labels: bool = True) -> list[dict]:
        """Megatron's schedule over ``count`` micro-batches; returns the last stage's loss dicts. With
        several model chunks each reads the micro-batches through an iterator of its own, and the
        dropout seed of chunk v > 0 of a micro-batch is a hash of the micro-batch's and v (chunk 0's
        is the micro-batch's, as with one chunk)."""
        seq, device = self.seq_len, self.device
        mask = _attention_mask(seq, device)
        position = torch.arange(seq, device=device).expand(self.micro_batch, seq)
        chunks, slots = self.chunks, enumerate(batches)
        if len(chunks) > 1:  # each chunk reads the same micro-batches
            items = [next(slots) for _ in range(count)]
            data: Any = [iter(items) for _ in chunks]
        else:
            data = slots

        def forward_step(data: Iterator, model: Any):
            j, b = next(data)  # the micro-batch's slot in the step, and the micro-batch
            v = chunks.index(model)
            if seeds is not None:
                seed = seeds[j] if v == 0 else hashed_seed(seeds[j], v)
                torch.manual_seed(seed)
                if device.type == "cuda":  # its tensor-parallel stream is seed + 2718 + TP rank: apart per slot
                    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

                    model_parallel_cuda_manual_seed(seed * 4096)
            tokens, labels = b["tokens"].to(device), b["labels"].to(device)
            out = model(tokens, position[:len(tokens)], mask, labels=labels if with_labels else None)
            return out, lambda output: loss_of(b, output)

        return self.forward_backward(forward_step_func=forward_step, data_iterator=data,
                                     model=chunks[0] if len(chunks) == 1 else chunks, num_microbatches=count,
                                     seq_length=seq, micro_batch_size=self.micro_batch, forward_only=forward_only)

    def train_step(self, batches: Iterator[dict[str, torch.Tensor]], gas: int, seeds: list[int],
                   cosine: Any = None) -> dict[str, Any]:
        def loss_of(batch, output):
            loss = output.float().mean()
            return loss, {"lm loss": loss.detach().clone()}  # the schedule divides the loss in place

        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.megatron_optimizer.zero_grad()
        skipped_before = self.optimizer.skipped_steps
        out = self._run(batches, gas, False, loss_of, seeds)
        ok, grad_norm, _ = self.megatron_optimizer.step()
        loss_sum = float(sum(float(o["lm loss"]) for o in out)) if out else 0.0
        metrics = {"train/loss_scale": float(self.megatron_optimizer.get_loss_scale())}
        if grad_norm is not None:
            metrics["train/grad_norm"] = float(grad_norm)
        metrics["comm/vrgd_bytes_total"] = float(self.source.counters.bytes_sent) if self.source is not None else 0.0
        return dict(loss_sum=loss_sum, tokens=gas * self.micro_batch * self.seq_len, measured=None,
                    skipped=(not ok) or self.optimizer.skipped_steps > skipped_before, metrics=metrics)

    @torch.no_grad()
    def evaluate(self, batches):
        from megatron.core import tensor_parallel

        sums = [0.0, 0.0, 0.0]

        def loss_of(batch, logits):
            labels = batch["labels"].to(self.device)
            if self.block.tensor_model_parallel_size > 1:
                logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
            logits = logits.float()[..., :self.data.vocab_size]
            sums[0] += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                               labels.reshape(-1), reduction="sum"))
            sums[1] += float((logits.argmax(-1) == labels).sum())
            sums[2] += float(labels.numel())
            return logits.new_zeros(()), {}

        for chunk in self.chunks:
            chunk.eval()
        if batches:  # the held-out set's shape (the last phase's), then the training's again
            shape, (self.micro_batch, self.seq_len) = (self.micro_batch, self.seq_len), batches[0]["tokens"].shape
            full = [b for b in batches if len(b["tokens"]) == self.micro_batch]  # the schedule's fixed shape
            if full:
                self._forward_only(full, loss_of)
            for b in batches[len(full):]:  # the last, smaller one (every data-parallel rank has it): its own pass
                self.micro_batch = len(b["tokens"])
                self._forward_only([b], loss_of)
            self.micro_batch, self.seq_len = shape
        for chunk in self.chunks:
            chunk.train()
        return tuple(sums) if self.reporter else (0.0, 0.0, 0.0)

    def _forward_only(self, items: list[dict[str, torch.Tensor]], loss_of: Callable) -> None:
        """One forward pass of the schedule over ``items``. With model chunks, Megatron's interleaved
        schedule takes micro-batches in groups of PP: the list is padded with repeats of its first
        to a multiple of PP, whose losses ``loss_of`` does not see (the last stage meets the
        micro-batches in order)."""
        pad = -len(items) % self.block.pipeline_model_parallel_size if len(self.chunks) > 1 else 0
        counted = iter([True] * len(items) + [False] * pad)

        def counted_loss(batch, output):
            return loss_of(batch, output) if next(counted) else (output.new_zeros(()), {})

        self._run(iter(items + items[:1] * pad), len(items) + pad, True, counted_loss, with_labels=False)

    # -- checkpoints ---------------------------------------------------------------------------

    def layout(self) -> dict[str, Any]:
        return {"tensor_model_parallel_size": self.block.tensor_model_parallel_size,
                "pipeline_model_parallel_size": self.block.pipeline_model_parallel_size,
                "virtual_pipeline_model_parallel_size": self.block.virtual_pipeline_model_parallel_size,
                "data_parallel_size": self.data_world, "precision": self.block.precision,
                "use_distributed_optimizer": self.block.use_distributed_optimizer,
                "share_embeddings_and_output_weights": self.block.model.share_embeddings_and_output_weights}

    def _model_keys(self) -> list[str]:
        """Each chunk's key in the checkpoint's state: ``model``, or Megatron's ``model0``, ``model1``,
        ... with several (the tensors' sharded keys are global, so either loads into the other)."""
        return ["model"] if len(self.chunks) == 1 else [f"model{v}" for v in range(len(self.chunks))]

    def _state(self, is_loading: bool, with_optimizer: bool = True) -> dict[str, Any]:
        models = {key: chunk.module.sharded_state_dict() for key, chunk in zip(self._model_keys(), self.chunks)}
        out = {**models, STATE_KEY: ""}
        if with_optimizer:
            out["optimizer"] = self.megatron_optimizer.sharded_state_dict(models, is_loading)
        return out

    def _check_model_tensors(self, path: Path) -> None:
        """The model's tensors are the checkpoint's, by key and global shape, else an error naming
        those that differ, the same on every rank (the keys are global: each rank gathers its
        pipeline stages' and has the whole model's, as the others do): a GPT built with another
        ``megatron.model`` (num_layers, hidden_size, ffn_hidden_size, vocab_size) does not load it,
        and the job would otherwise pass over every checkpoint of the run as failing to load and
        advise moving the directory away; a tensor one side lacks would be left as built or
        dropped. A checkpoint whose metadata does not read is left to the load, which passes it over."""
        from megatron.core import dist_checkpointing
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

        try:
            saved = {k: tuple(t.global_shape) for k, t in dist_checkpointing.load_tensors_metadata(str(path)).items()
                     if not k.startswith("optimizer.")}
        except Exception:  # noqa: BLE001 (the load fails on it and says so)
            saved = None
        mine = {}
        for chunk in self.chunks:
            sd = chunk.module.sharded_state_dict()
            apply_factories(sd)  # a factory's tensors may be keyed otherwise (a SwiGLU's _w and _v halves)
            mine.update((sh.key, tuple(sh.global_shape)) for sh in nested_values(sd) if isinstance(sh, ShardedTensor))
        unread = torch.tensor([float(saved is None)], device=self.device)
        dist.all_reduce(unread, op=dist.ReduceOp.MAX)
        if unread.item():
            return
        stages = ps.get_pipeline_model_parallel_group()
        everyone: list[Any] = [None] * dist.get_world_size(stages)
        dist.all_gather_object(everyone, mine, group=stages)
        model = {k: v for shapes in everyone for k, v in shapes.items()}
        new, gone = sorted(model.keys() - saved.keys()), sorted(saved.keys() - model.keys())
        reshaped = [f"{k} {saved[k]} saved, {model[k]} built" for k in sorted(model.keys() & saved.keys())
                    if model[k] != saved[k]]
        if new or gone or reshaped:
            def some(items: list[str]) -> str:
                return ", ".join(items[:3]) + (f" and {len(items) - 3} more" if len(items) > 3 else "")

            what = [f"{len(reshaped)} tensors of other shapes ({some(reshaped)})"] if reshaped else []
            what += [f"{len(new)} of the model's tensors are not in it ({some(new)})"] if new else []
            what += [f"{len(gone)} of its tensors are not in the model ({some(gone)})"] if gone else []
            raise ConfigError(f"{path}: the GPT differs from the one saved: {'; '.join(what)}. Resume with the "
                              "megatron.model settings it was saved with, or give a new run directory")

    def plan(self, ckpt_dir: Path, tag: str, optimizer: dict[str, Any], policy: str) -> ResumePlan:
        from vrgd_ds.train import checkpoints as ckpt

        saved = ckpt.marker(ckpt_dir, tag).get("info") or {}
        changes = gpt_change(ckpt_dir / tag, saved, self.block.model.share_embeddings_and_output_weights,
                             self.block.virtual_pipeline_model_parallel_size)
        self._check_model_tensors(ckpt_dir / tag)
        plan = plan_resume(ckpt_dir, tag, optimizer, self.world, 0, policy)  # dist-checkpointing reshards
        if plan.optimizer_states and (note := wrapper_change(ckpt_dir / tag, saved, self.block.use_distributed_optimizer,
                                                             self.block.precision, policy)):
            # a fresh state: nothing of the saved one carries over (plan_resume's only note here is a switch's)
            plan.optimizer_states, plan.switched, plan.notes = False, False, [note]
        keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size")
        was, now = [saved.get(k) for k in keys], [self.layout()[k] for k in keys]
        if None not in was and was != now:
            plan.notes.append(f"{ckpt_dir / tag} was saved on TP {was[0]} × PP {was[1]} × DP {was[2]}; resuming on TP "
                              f"{now[0]} × PP {now[1]} × DP {now[2]} (dist-checkpointing reshards every tensor)")
        plan.notes += changes
        if plan.optimizer_states and saved.get("precision") not in (None, self.block.precision):
            plan.notes.append(f"{ckpt_dir / tag} was saved in {saved['precision']}; resuming in "
                              f"{self.block.precision} (the fp32 main weights carry over)")
        return plan

    def save(self, ckpt_dir: Path, tag: str, state: dict[str, Any]) -> None:
        from megatron.core import dist_checkpointing

        sd = self._state(False)
        sd[STATE_KEY] = json.dumps(state)
        path = ckpt_dir / tag
        if self.rank == 0:  # dist-checkpointing writes into an existing, empty directory (Job.save cleared it)
            path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(sd, str(path))

    def load(self, ckpt_dir: Path, tag: str, plan: ResumePlan) -> dict[str, Any] | None:
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.validation import StrictHandling

        from vrgd_ds.train import checkpoints as ckpt

        # LOG_UNEXPECTED: keys the request has and the checkpoint lacks (a base optimizer's without the GSNR
        # momentum, another precision's without fp32 main weights) are left out of the load, and the state
        # keeps them as built, as the plan says (ASSUME_OK_UNEXPECTED raised on them)
        loaded = dist_checkpointing.load(self._state(True, plan.optimizer_states), str(ckpt_dir / tag),
                                         strict=StrictHandling.LOG_UNEXPECTED)
        for key, chunk in zip(self._model_keys(), self.chunks):
            chunk.module.load_state_dict(loaded[key], strict=False)
        # the fp32 main weights follow the model where the checkpoint has none (a fresh optimizer state, an
        # fp32 save, a marker without its precision); else the load wrote the saved ones into them already
        # (bf16 <-> fp16 too), and copying the half-precision model over them would round them
        half, saved = ("bf16", "fp16"), (ckpt.marker(ckpt_dir, tag).get("info") or {}).get("precision")
        if not (plan.optimizer_states and saved in half and self.block.precision in half):
            for mopt in self.megatron_optimizer.chained_optimizers:
                if hasattr(mopt, "reload_model_params"):
                    mopt.reload_model_params()
        if plan.optimizer_states:
            self.megatron_optimizer.load_state_dict(loaded["optimizer"])
        text = loaded.get(STATE_KEY)
        return json.loads(text) if text else None

    def checkpoint_bytes(self) -> int:
        """This rank's optimizer state and fp32 main weights (its shard with the distributed
        optimizer; else the first data-parallel rank's, whose copies the others hold), and its
        model shard on the first data-parallel rank. fp32 without the distributed optimizer has no
        main weights apart from the model's. The distributed optimizer's checkpoint
        (``vrgd_model_space``) holds every key of the optimizer for every tensor, NaN where a
        tensor's state lacks it (a GSNR key of a tensor in a twin group), and its fp32 weights. The
        last stage's copy of an embedding tied across stages (``shared``) is saved as a replica of
        the first stage's: neither it nor its state is written."""
        from vrgd_ds.megatron.stats import pairs

        if self.data_rank and not self.block.use_distributed_optimizer:
            return 0
        opt = self.optimizer
        copies = {id(t) for mopt in self.megatron_optimizer.chained_optimizers for p, t in pairs(mopt)
                  if getattr(p, "shared", False)}
        local = 0 if self.data_rank else sum(p.numel() * p.element_size() for chunk in self.chunks
                                             for p in chunk.module.parameters() if not getattr(p, "shared", False))
        if self.block.use_distributed_optimizer:
            per_element = 4 * (1 + len({k for g in opt.param_groups for k in opt.element_state_keys(g)}))
            return local + sum(p.numel() * per_element for g in opt.param_groups for p in g["params"]
                               if id(p) not in copies)
        local += sum(t.numel() * t.element_size() for p, st in opt.state.items() if id(p) not in copies
                     for t in st.values() if torch.is_tensor(t))
        if self.block.precision != "fp32":
            local += sum(p.numel() * 4 for g in opt.param_groups for p in g["params"] if id(p) not in copies)
        return local

    def close(self) -> None:
        if self.ps.model_parallel_is_initialized():
            self.ps.destroy_model_parallel()


ENGINE = MegatronEngine
