#!/usr/bin/env bash
# BERT pretraining under torchrun (one node, or several with a rendezvous endpoint).
#
#   launch/torchrun.sh [--set KEY=VALUE ...]                        # one node, NPROC ranks
#   CONFIG=configs/bert_large_64k_32k_lamb.json RUN_DIR=runs/lamb64k launch/torchrun.sh
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 launch/torchrun.sh       # on node0, NODE_RANK=1 on node1
#
# Environment (defaults): CONFIG (configs/bert_large_64k_32k_vr_lamb.json), RUN_DIR
# (runs/<config name>), NPROC (GPUs visible, else 2), NNODES (1), NODE_RANK (0 on one node;
# needed with NNODES > 1), MASTER_ADDR (127.0.0.1 on one node; needed with NNODES > 1), MASTER_PORT (29500), PYTHON (python on PATH;
# torchrun is run as its module), BACKEND (empty: nccl on GPUs, gloo on CPU). Further arguments
# go to the job ("$@").
set -euo pipefail
# Paths given in the environment are the caller's (relative to the directory it runs in); the
# defaults are the repository's, where the ranks start: a relative path among the job's arguments
# ("--set job.data.path=data") resolves there, so give those absolute.
for name in CONFIG RUN_DIR; do
    if [[ -n "${!name:-}" ]]; then printf -v "$name" '%s' "$(realpath -ms -- "${!name}")"; fi
done
if [[ "${PYTHON:-}" == */* ]]; then PYTHON=$(realpath -ms -- "$PYTHON"); fi  # a path, not a command name
cd "$(dirname "$0")/.."

CONFIG=${CONFIG:-configs/bert_large_64k_32k_vr_lamb.json}
RUN_DIR=${RUN_DIR:-runs/$(basename "$CONFIG" .json)}
PYTHON=${PYTHON:-python}
if [[ -z "${NPROC:-}" ]]; then
    NPROC=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 2)')
fi
NNODES=${NNODES:-1}
for name in NNODES NPROC ${NODE_RANK:+NODE_RANK}; do  # bash arithmetic reads "two" as 0: the checks below would pass
    if [[ ! ${!name} =~ ^[0-9]+$ ]]; then
        echo "error: $name=${!name} is not a whole number" >&2
        exit 2
    fi
done
if (( NNODES > 1 )) && [[ -z "${MASTER_ADDR:-}" ]]; then  # each node would wait at its own loopback
    echo "error: NNODES=$NNODES needs MASTER_ADDR, node 0's address that every node reaches" >&2
    exit 2
fi
if (( NNODES > 1 )) && [[ -z "${NODE_RANK:-}" ]]; then  # every node would claim node rank 0: a hang
    echo "error: NNODES=$NNODES needs NODE_RANK, this node's rank (0 on the MASTER_ADDR node, 1 to $((NNODES - 1)) on the others)" >&2
    exit 2
fi
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
BACKEND_ARGS=()
[[ -n "${BACKEND:-}" ]] && BACKEND_ARGS=(--backend "$BACKEND")

# SIGUSR1 (Slurm's --signal, a pre-emption warning) is the ranks' to answer (checkpoint, exit 75):
# torchrun neither handles nor forwards it, and would end at once, its ranks left running. Held
# blocked (launch/hold_usr1.py), torchrun never takes it, and its ranks inherit the mask: one
# that reaches a rank before its job is ready waits for it.
set -x
exec "$PYTHON" launch/hold_usr1.py "$PYTHON" -m torch.distributed.run \
    --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    -m vrgd_ds.train --config "$CONFIG" --run-dir "$RUN_DIR" ${BACKEND_ARGS[@]+"${BACKEND_ARGS[@]}"} "$@"
