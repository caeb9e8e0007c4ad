#!/usr/bin/env bash
# Every GPU measurement the open work asks for, in one run of under 9 minutes on one H100/H200.
# By default: cells of the BERT study past the unigram plateau (studies/bert_batch.py
# --noise-multiple: LAMB against VR-LAMB at 1x-64x the noise scale, 2 seeds, a bracketed LR grid, at
# least 128 steps a run), whose record grows with each lease (--reuse docs/studies/bert_plateau_steps128
# and docs/studies/bert_plateau: the B_simple probe measured there, the 1x cells, and the cells run
# before), with the whole call: a 16x run takes about 410 s on one H200, 8 side by side (4,000
# samples/s each over the whole run, 2026-11-28), so a call that keeps time for another part first
# finishes none. The performance check still unmeasured since the bucket packing (zero2_seq128: the
# whole ZeRO-2 BERT-large bf16 step at seq 128, VRLamb against Lamb and FusedLamb, with a profile;
# over 140 s on a fresh H200, FusedLamb's build included) needs a call of its own, the lease's first
# (below): a second call after 540 s has too little left. When the study runs after other parts, they keep its last
# PLATEAU_S seconds (default 300) for it. Further parts run when PARTS names them: the
# Triton kernels on CUDA tensors, pack_bucket included (triton_cuda: 25 of 25 passed on one H200,
# 2026-11-28), the same 50-step BERT job, seeds and data as a CPU's record (seed_check, against
# docs/studies/bert_seed_check: the same losses to 1.4e-7 nats on that H200,
# docs/studies/bert_seed_check_h200), and the performance parts measured on 2026-11-26 and
# 2026-11-27 (docs/benchmarks.md): FusedLamb's build (fusedlamb_build), the optimizer step against
# torch's fused AdamW and DeepSpeed's FusedLamb (opt_step_flat, opt_step, opt_step_adam), the
# ZeRO-2 step at seq 512 and without the profile (zero2_seq512, zero2_seq128_noprofile), and
# megatron-core (megatron).
#
#   bash benchmarks/gpu_suite.sh [OUTDIR]          (default: $OUT, else ./gpu_out)
#   PARTS="fusedlamb_build zero2_seq128 megatron zero2_seq512 opt_step_flat opt_step" \
#       bash benchmarks/gpu_suite.sh     (the performance checks, run in this order, unmeasured first:
#       their limits add up to 790 s, so the later ones are cut to the time left or not started)
#   PARTS="triton_cuda seed_check plateau" bash benchmarks/gpu_suite.sh   (the checks, then the study)
#   (the parts named run in this script's order: FusedLamb's build, the performance parts, the
#   checks, the study)
#   PARTS="fusedlamb_build zero2_seq128" bash benchmarks/gpu_suite.sh   (a lease's first call where it is
#       to measure that step: up to 360 s; after a first call of 540 s a second has 100-220 s, too little)
#   PARTS=plateau BUDGET_S=<budget_left_s - 60> bash benchmarks/gpu_suite.sh    (a second call for the study instead: it
#       goes on from the record the first call wrote, kept in GPU_SUITE_WORK.prev, and resumes the runs
#       whose checkpoints the first call's time limit left in /tmp/bert_plateau)
#
# OUTDIR receives two files, summary.log and gpu_suite.tgz (every part's log and study record, the
# study's run logs: packed before the first part, after each part and every minute of the study,
# written aside and renamed, so a call stopped at any point still returns what was there): a lent
# machine returns at most 8 files from its output folder.
#
# The study reads WikiText-2 (valid.txt and test.txt) from $WIKITEXT, else ../shared/data/wikitext-2
# beside the checkout, else .data/wikitext-2 in it (git-ignored: a link to the folder holding it, or
# a copy, carried to a machine that has neither).
#
# Python packages the GPU image lacks (DeepSpeed 0.19.8, megatron-core 0.16.1, pydantic, hjson) or
# holds at another release (sentencepiece, whose release decides the tokenizer the studies train:
# pyproject.toml pins it) are installed from wheels in WHEELS (default .whl) when that folder exists
# (benchmarks/gpu_wheels.sh fills it). Each part has its own time limit and log; a part that fails
# or runs out of time does not stop the others. The study parts do not start with another
# sentencepiece than the pinned one: they would read other data than the records they compare with.
set -uo pipefail
cd "$(dirname "$0")/.."
KNOWN_PARTS="fusedlamb_build triton_cuda seed_check zero2_seq128 megatron zero2_seq512 opt_step_flat opt_step
zero2_seq128_noprofile opt_step_adam plateau"
for name in ${PARTS:-plateau}; do  # a misspelt part would run nothing and still say "done"
    if [[ " ${KNOWN_PARTS//$'\n'/ } " != *" $name "* ]]; then
        echo "gpu_suite: unknown part '$name' in PARTS; the parts: ${KNOWN_PARTS//$'\n'/ }" >&2
        exit 2
    fi
done
OUTDIR=$(mkdir -p "${1:-${OUT:-gpu_out}}" && cd "${1:-${OUT:-gpu_out}}" && pwd)
WORK=${GPU_SUITE_WORK:-/tmp/gpu_suite}  # the parts' logs and records, packed into OUTDIR
WHEELS=${WHEELS:-.whl}
# an earlier call's parts on this machine (a second call while it is still warm): kept beside, so
# the study goes on from the record that call wrote
rm -rf "$WORK.prev" && { [[ -d $WORK ]] && mv "$WORK" "$WORK.prev"; mkdir -p "$WORK"; }
STUDY_WORK=/tmp/bert_plateau  # the study's runs (checkpoints, logs): kept on the machine between calls
touch "$WORK/summary.log"
pack() {  # WORK into OUTDIR, the study's run logs with it; written aside and renamed: a kill mid-way
    # leaves the last complete archive
    if [[ -d $STUDY_WORK/runs ]]; then
        (cd "$STUDY_WORK" && find runs -name log.txt -exec cp --parents {} "$WORK/" \; 2>/dev/null)
    fi
    local part=$OUTDIR/gpu_suite.tgz.$BASHPID  # one per process: the minutely packer runs beside
    tar czf "$part" -C "$WORK" . 2>/dev/null && mv -f "$part" "$OUTDIR/gpu_suite.tgz" || rm -f "$part"
    cp "$WORK/summary.log" "$OUTDIR/summary.log"
}
if [[ -d $WHEELS ]] && compgen -G "$WHEELS/*.whl" >/dev/null; then
    # a second call on the warm machine: /tmp/site already holds these wheels (their names and sizes)
    stamp=$(ls -l "$WHEELS"/*.whl | awk '{print $5, $NF}')
    if [[ -f /tmp/site/.gpu_suite_wheels && $(cat /tmp/site/.gpu_suite_wheels) == "$stamp" ]]; then
        echo "wheels: /tmp/site holds them already" >"$WORK/wheels.log"
    elif ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl >"$WORK/wheels.log" 2>&1; then
        { echo "== the wheels in $WHEELS did not install: nothing ran"; tail -n 40 "$WORK/wheels.log"; } \
            | tee -a "$WORK/summary.log"
        pack
        exit 1
    else
        printf '%s\n' "$stamp" >/tmp/site/.gpu_suite_wheels
    fi
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
# the checkout as the installed package (vrgd_ds.data_pipeline included), then the checkout itself
export PYTHONPATH=$(bash benchmarks/source_tree.sh):$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 \
    PYTHONWARNINGS=ignore::FutureWarning
# DeepSpeed 0.19.8 cannot parse "9.0a" (deepspeedai/DeepSpeed#8619)
cc=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
export TORCH_CUDA_ARCH_LIST=$cc

PARTS=${PARTS:-plateau}
BUDGET_S=${BUDGET_S:-540}  # the whole script: one call of at most 10 minutes
(( BUDGET_S > 540 )) && BUDGET_S=540  # a budget left of more than a call's 600 s still gets one call
PLATEAU_S=${PLATEAU_S:-300}  # kept for the study when it is among the parts
# The study reads WikiText-2 with the pinned sentencepiece; without either it cannot start, and
# keeps no time from the other parts
wikitext=${WIKITEXT:-}
for candidate in ../shared/data/wikitext-2 .data/wikitext-2; do
    [[ -z $wikitext && -f $candidate/valid.txt ]] && wikitext=$candidate
done
no_wikitext="WikiText-2 not found (set WIKITEXT, or link .data to the folder holding wikitext-2 and carry .data/wikitext-2)"
if ! trainer=$(python3 benchmarks/pinned_release.py 2>&1); then
    wikitext="" no_wikitext=$(tail -n 1 <<<"$trainer")
fi
reserve=0
[[ " $PARTS " == *" plateau "* && -n $wikitext ]] && reserve=$PLATEAU_S
part() {  # name, seconds, command... (capped by the time left before the study's reserve)
    local name=$1 limit=$2; shift 2
    if [[ " $PARTS " != *" $name "* ]]; then return; fi
    local room=$((BUDGET_S - reserve - SECONDS))
    if (( room < 20 )); then
        echo "== $name: not started, ${room}s left before the study's ${reserve}s" | tee -a "$WORK/summary.log"
        return
    fi
    (( limit > room )) && limit=$room
    local t0=$SECONDS
    echo "== $name (limit ${limit}s)" | tee -a "$WORK/summary.log"
    # SIGTERM at the limit (a study stops its runs on it), SIGKILL 15 s later if still there
    timeout -k 15 "$limit" "$@" >"$WORK/$name.log" 2>&1
    local rc=$?
    echo "   rc=$rc in $((SECONDS - t0))s" | tee -a "$WORK/summary.log"
    tail -n 40 "$WORK/$name.log" >>"$WORK/summary.log"
    # a build killed at its limit leaves torch's extension lock, and every later load of the op
    # would wait on it until its own limit: the parts run one at a time, so none is building now
    rm -f "${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}"/*/*/lock
    pack
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  df -h /dev/shm | tail -n 1; } >>"$WORK/summary.log" 2>&1
pack  # something comes back even if the first part is cut short
part fusedlamb_build 120 python3 -c "from deepspeed.ops.op_builder import FusedLambBuilder as B; B().load()"
one_rank=(env RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29631)
zero2() {  # part name, seq, extra options
    local name=$1 seq=$2; shift 2
    part "$name" 240 "${one_rank[@]}" python3 benchmarks/zero2_step.py --worker --ranks 1 --gas 4 \
        --micro-batch 32 --seq "$seq" --model large --dtype bf16 --anchors --hooks --warmup 2 "$@"
}
# the parts not measured since the bucket packing first, then those measured before
zero2 zero2_seq128 128 --profile --repeats 4
part megatron 90 python3 -m torch.distributed.run --nproc_per_node 1 --master_port 29641 \
    benchmarks/megatron_step.py --accumulation 2 16 --steps 10
zero2 zero2_seq512 512 --profile --repeats 4
part opt_step_flat 40 python3 benchmarks/gpu_optimizer_step.py --model large --flat --kernels --iters 10
part opt_step 60 python3 benchmarks/gpu_optimizer_step.py --model large --kernels --iters 10
zero2 zero2_seq128_noprofile 128 --repeats 6
part opt_step_adam 40 python3 benchmarks/gpu_optimizer_step.py --model large --iters 10 \
    --only "AdamW(fused)" VRAdam Lamb VRLamb "DS FusedLamb"
# the CUDA kernels' tests and the seed check: after the performance parts, before the study
part triton_cuda 180 python3 -m pytest -q -p no:cacheprovider tests/unit/test_triton.py -k "pack_bucket or cuda"
# The same job, seed and data as on the CPU: 50 steps of LAMB and VR-LAMB at batch 64, fp32, dropout off
# (a GPU's dropout stream is not a CPU's: with it on the two would differ by as much as the tolerance),
# set beside the runs of docs/studies/bert_seed_check (a CPU's), loss by loss, with the data fingerprints.
if [[ -n $wikitext ]]; then
    part seed_check 120 python3 studies/bert_batch.py --model tiny --corpus "wikitext=$wikitext" --batch 64 \
        --samples 3200 --min-steps 50 --groups 8 --heldout-fraction 0.1 --eval-points 5 --optimizer LAMB \
        --optimizer "VR-LAMB first_moment" --lr-factor 1 --seed 1 --seed 2 --dropout 0 --parallel 4 \
        --work /tmp/bert_seed_check --out "$WORK/bert_seed_check" --compare docs/studies/bert_seed_check
elif [[ " $PARTS " == *" seed_check "* ]]; then
    echo "== seed_check: not started, $no_wikitext" | tee -a "$WORK/summary.log"
fi
# The study past the plateau: tiny BERT on WikiText-2 (a file corpus: the same data on every machine,
# checked by each run's data fingerprint), 102,400 samples per run (at least 128 steps, the 1x cells'
# own count: at 50 steps every 4x run ended at the unigram level), 8 GSNR groups
# per step whatever the batch, 10% of the documents held out, batches at 1x, 4x, 16x and 64x the
# B_simple that the probe in docs/studies/bert_plateau measured at batch 64 (VR-LAMB, 2 seeds, on a
# CPU: its record is reused here, and its settings are these), 2 seeds, LRs on the grid x1/16-x4
# around the square-root rule, of which only the part that brackets each optimum runs (--bracket 1:
# x1 first at 1x, then the grid's factors beside each optimizer's best until both ran; --bracket-carry: each
# larger batch starts at the LR the batch below settled on, since at 1x and 4x the best LR was the same,
# 0.0141, not the rule's doubling), up to 8 runs side by side on the GPU. It starts a run only while the
# time left holds it and what the runs in flight still have to train, at the GPU's rate, which they
# share (before any run finishes: PLATEAU_RATE samples/s, default 4,000, the rate of a 16x run among
# 8 on one H200, start-up included, times those 8; a 64x run, 6.5M samples, about 200 s alone, so
# that a call starts the one or two it can finish and not six it cannot), pauses the rest at the limit, and
# assembles what finished (the runs needed next are listed as not run yet). Each run's record says
# how much of its step time it waited for its DataLoader (data_wait). Each run has PLATEAU_WORKERS
# DataLoader workers (default 7, the same samples as 1): on one H200 (2026-12-04) two 64x runs side
# by side with 4 workers each made about 16,000 samples/s each (400 and 421 s, start-up included)
# and waited for data 78-79% of their step time, the GPU idle in 28 of 71 five-second samples and
# about 8 of the host's 16 cores busy: the workers bound them (one run alone, 4 workers: 21,455 samples/s, 79.5%).
# 7 workers each keep two runs and their 14 workers on the 16 cores; the rate they reach is not
# measured yet. Among 8 smaller runs idle workers wait on their full queues.
# Beside it, benchmarks/load_sampler.py
# samples the GPU's utilisation and the host's busy cores (plateau_load.csv, its summary in summary.log).
if [[ " $PARTS " == *" plateau "* ]]; then
    left=$((BUDGET_S - SECONDS))
    if [[ -z $wikitext ]]; then
        echo "== plateau: not started, $no_wikitext" | tee -a "$WORK/summary.log"
    elif (( left > 60 )); then
        reuse=()
        for record in docs/studies/bert_plateau docs/studies/bert_plateau_steps128; do
            [[ -f $record/meta.json ]] && reuse+=(--reuse "$record")
        done
        [[ -f $WORK.prev/bert_plateau/meta.json ]] && reuse+=(--reuse "$WORK.prev/bert_plateau")
        reserve=0  # the study's own time: nothing runs after it
        # beside the runs, every 5 s: the GPU's utilisation and the host's busy cores (what bounds them,
        # with each run's data_wait); the summary line goes to summary.log
        python3 benchmarks/load_sampler.py --out "$WORK/plateau_load.csv" >"$WORK/plateau_load.log" 2>&1 &
        sampler=$!
        # the runs' logs and the summary every minute: a call cut short returns what was there
        while sleep 60; do pack; done >/dev/null 2>&1 &
        packer=$!
        part plateau "$left" python3 studies/bert_batch.py --model tiny --corpus "wikitext=$wikitext" \
            --seed 1 --seed 2 --noise-multiple 1 --noise-multiple 4 --noise-multiple 16 --noise-multiple 64 \
            --noise-scale auto --optimizer LAMB --optimizer "VR-LAMB first_moment" --optimizer "VR-LAMB update" \
            --lr-factor 0.0625 --lr-factor 0.125 --lr-factor 0.25 --lr-factor 0.5 --lr-factor 1 --lr-factor 2 --lr-factor 4 \
            --bracket 1 --bracket-carry --samples 102400 --min-steps 128 --groups 8 \
            --heldout-fraction 0.1 --eval-points 16 --parallel "${PLATEAU_PARALLEL:-8}" \
            --time-limit $((left - 30)) --expect-rate "${PLATEAU_RATE:-4000}" --expect-share 8 \
            --workers "${PLATEAU_WORKERS:-7}" \
            "${reuse[@]}" --work "$STUDY_WORK" --out "$WORK/bert_plateau"
        pkill -P "$packer"; kill "$packer" "$sampler" 2>/dev/null; wait "$packer" "$sampler" 2>/dev/null
        tee -a "$WORK/summary.log" <"$WORK/plateau_load.log"
        pack
    else
        echo "== plateau: ${left}s left of ${BUDGET_S}s, not started" | tee -a "$WORK/summary.log"
    fi
fi
echo "== done in ${SECONDS}s" | tee -a "$WORK/summary.log"
pack
