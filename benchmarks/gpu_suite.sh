#!/usr/bin/env bash
# Every GPU measurement the open work asks for, in one run of under 8 minutes on one H100/H200:
#   the Triton kernels on CUDA tensors (pack_bucket included), the optimizer step against torch's
#   fused AdamW and DeepSpeed's FusedLamb (per tensor and one flat partition), the whole ZeRO-2
#   BERT-large bf16 step at seq 128 and 512 with the anchors and a profile, and megatron-core; then,
#   in the time left, cells of the BERT study past the unigram plateau (studies/bert_batch.py
#   --noise-multiple: LAMB against VR-LAMB at 1x-64x the noise scale, 2 seeds, a bracketed LR grid),
#   whose record grows with each lease (--reuse docs/studies/bert_plateau once committed).
#
#   bash benchmarks/gpu_suite.sh [OUTDIR]          (default: $OUT, else ./gpu_out)
#   PARTS="fusedlamb_build zero2_seq512" bash benchmarks/gpu_suite.sh    (only those parts; also the
#   shorter zero2_seq128_noprofile and opt_step_adam, which the default set leaves out)
#
# Python packages the GPU image lacks (DeepSpeed 0.19.8, megatron-core 0.16.1, pydantic, hjson)
# are installed from wheels in WHEELS (default .whl) when that folder exists. Each part has its
# own time limit and log; a part that fails or runs out of time does not stop the others.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-${OUT:-gpu_out}}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUTDIR"
if [[ -d $WHEELS ]] && compgen -G "$WHEELS/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore::FutureWarning
# DeepSpeed 0.19.8 cannot parse "9.0a" (deepspeedai/DeepSpeed#8619)
cc=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
export TORCH_CUDA_ARCH_LIST=$cc

PARTS=${PARTS:-fusedlamb_build triton_cuda opt_step opt_step_flat zero2_seq128 zero2_seq512 megatron plateau}
BUDGET_S=${BUDGET_S:-470}  # the whole script: under 8 minutes
part() {  # name, seconds, command...
    local name=$1 limit=$2; shift 2
    if [[ " $PARTS " != *" $name "* ]]; then return; fi
    local t0=$SECONDS
    echo "== $name (limit ${limit}s)" | tee -a "$OUTDIR/summary.log"
    timeout "$limit" "$@" >"$OUTDIR/$name.log" 2>&1
    local rc=$?
    echo "   rc=$rc in $((SECONDS - t0))s" | tee -a "$OUTDIR/summary.log"
    tail -n 40 "$OUTDIR/$name.log" >>"$OUTDIR/summary.log"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
    >>"$OUTDIR/summary.log" 2>&1
part fusedlamb_build 60 python3 -c "from deepspeed.ops.op_builder import FusedLambBuilder as B; B().load()"
part triton_cuda 60 python3 -m pytest -q -x -p no:cacheprovider tests/unit/test_triton.py -k "pack_bucket or cuda"
part opt_step 60 python3 benchmarks/gpu_optimizer_step.py --model large --kernels --iters 10
part opt_step_flat 40 python3 benchmarks/gpu_optimizer_step.py --model large --flat --kernels --iters 10
one_rank=(env RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29631)
for seq in 128 512; do
    part "zero2_seq$seq" 140 "${one_rank[@]}" python3 benchmarks/zero2_step.py --worker --ranks 1 --gas 4 \
        --micro-batch 32 --seq "$seq" --model large --dtype bf16 --anchors --profile --hooks --repeats 4 --warmup 2
done
part zero2_seq128_noprofile 100 "${one_rank[@]}" python3 benchmarks/zero2_step.py --worker --ranks 1 --gas 4 \
    --micro-batch 32 --seq 128 --model large --dtype bf16 --anchors --hooks --repeats 6 --warmup 2
part opt_step_adam 40 python3 benchmarks/gpu_optimizer_step.py --model large --iters 10 \
    --only "AdamW(fused)" VRAdam Lamb VRLamb "DS FusedLamb"
part megatron 45 torchrun --nproc_per_node 1 --master_port 29641 benchmarks/megatron_step.py --accumulation 2 16 \
    --steps 10
# The study past the plateau: BERT-mini on the embedded corpus (the whole study runs on the GPU, so its
# cells compare among themselves; each run records its data fingerprint), batches at 1x, 4x, 16x and
# 64x the B_simple its VR-LAMB runs measure at batch 64, LRs x0.5-x4 around the square-root rule, 2
# seeds. It starts no run after the time left less a minute, and assembles what finished.
left=$((BUDGET_S - SECONDS))
if (( left > 120 )); then
    reuse=()
    [[ -f docs/studies/bert_plateau/meta.json ]] && reuse=(--reuse docs/studies/bert_plateau)
    part plateau "$left" python3 studies/bert_batch.py --model mini --corpus embedded --seed 1 --seed 2 \
        --noise-multiple 1 --noise-multiple 4 --noise-multiple 16 --noise-multiple 64 --noise-scale auto \
        --optimizer LAMB --optimizer "VR-LAMB first_moment" --optimizer "VR-LAMB update" \
        --lr-factor 0.5 --lr-factor 1 --lr-factor 2 --lr-factor 4 --samples 262144 --min-steps 50 \
        --start-runs-for $((left - 60)) "${reuse[@]}" --work /tmp/bert_plateau --out "$OUTDIR/bert_plateau"
else
    echo "== plateau: ${left}s left of ${BUDGET_S}s, not started" | tee -a "$OUTDIR/summary.log"
fi
echo "== done in ${SECONDS}s" | tee -a "$OUTDIR/summary.log"
