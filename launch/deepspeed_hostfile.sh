#!/usr/bin/env bash
# BERT pretraining on several nodes with the DeepSpeed launcher (pdsh over ssh).
#
#   launch/deepspeed_hostfile.sh [--set KEY=VALUE ...]
#   HOSTFILE=hosts CONFIG=configs/bert_large_128k_64k_vr_lamb.json launch/deepspeed_hostfile.sh
#
# The hostfile lists one node per line as "<hostname> slots=<GPUs>"; every node needs
# passwordless ssh from this one, the same checkout and Python environment at the same path,
# and RUN_DIR and the data on a filesystem all nodes see. launch/local_cluster/setup_pdsh.sh
# builds a two-"node" version of this on one machine (loopback aliases).
#
# Environment (defaults): CONFIG (configs/bert_large_64k_32k_vr_lamb.json), RUN_DIR
# (runs/<config name>), HOSTFILE (hostfile), MASTER_ADDR (the first host of HOSTFILE; DeepSpeed's
# choice where DS_ARGS has --include/--exclude or that host is localhost), MASTER_PORT
# (29500), LAUNCHER (pdsh), DEEPSPEED (deepspeed next to PYTHON, else on PATH), PYTHON (python),
# BACKEND (empty: nccl on GPUs, gloo on CPU), DS_ARGS (extra launcher arguments, quoted as in a
# shell, e.g. '--num_gpus 1' or '--launcher_args "-x NCCL_DEBUG=INFO"'). Further arguments go to
# the job ("$@").
set -euo pipefail
# Paths given in the environment are the caller's (relative to the directory it runs in); the
# defaults are the repository's, where the ranks start: a relative path among the job's arguments
# ("--set job.data.path=data") resolves there, so give those absolute.
for name in CONFIG RUN_DIR HOSTFILE; do
    if [[ -n "${!name:-}" ]]; then printf -v "$name" '%s' "$(realpath -ms -- "${!name}")"; fi
done
for name in PYTHON DEEPSPEED; do  # a path, not a command name
    if [[ "${!name:-}" == */* ]]; then printf -v "$name" '%s' "$(realpath -ms -- "${!name}")"; fi
done
cd "$(dirname "$0")/.."

CONFIG=${CONFIG:-configs/bert_large_64k_32k_vr_lamb.json}
RUN_DIR=${RUN_DIR:-runs/$(basename "$CONFIG" .json)}
HOSTFILE=${HOSTFILE:-hostfile}
PYTHON=${PYTHON:-python}
if [[ -z "${DEEPSPEED:-}" ]]; then
    DEEPSPEED=$(dirname "$(command -v "$PYTHON")")/deepspeed
    [[ -x "$DEEPSPEED" ]] || DEEPSPEED=deepspeed
fi
[[ -f "$HOSTFILE" ]] || { echo "error: no hostfile '$HOSTFILE' (lines '<host> slots=<n>'; set HOSTFILE)" >&2; exit 2; }
source launch/args.sh  # (the repository's root is the working directory now: $0 may be relative to the caller's)
split_words DS_ARGS  # quoted as in a shell: --launcher_args "-x A=1 -x B=2" stays one argument
EXTRA=(${WORDS[@]+"${WORDS[@]}"})
# Rank 0 runs on the first host DeepSpeed uses: the hostfile's first unless --include/--exclude
# choose others, when DeepSpeed's own choice stands (as for a first host named localhost, which
# the other nodes would take for themselves).
ADDR_ARGS=()
if [[ -n "${MASTER_ADDR:-}" ]]; then
    ADDR_ARGS=(--master_addr "$MASTER_ADDR")
elif ! printf '%s\n' ${EXTRA[@]+"${EXTRA[@]}"} | grep -qE '^(-i|-e|--include|--exclude)(=|$)'; then
    FIRST=$(awk '!/^[[:space:]]*(#|$)/ {print $1; exit}' "$HOSTFILE")
    [[ "$FIRST" == localhost || "$FIRST" == 127.* ]] || ADDR_ARGS=(--master_addr "$FIRST")
fi
MASTER_PORT=${MASTER_PORT:-29500}
LAUNCHER=${LAUNCHER:-pdsh}
# the launcher DeepSpeed will use: the last --launcher given (DS_ARGS's come after LAUNCHER's), in
# lower case as DeepSpeed compares it
USED=$LAUNCHER
for i in ${EXTRA[@]+"${!EXTRA[@]}"}; do
    case "${EXTRA[i]}" in
        --launcher) USED=${EXTRA[i+1]:-} ;;
        --launcher=*) USED=${EXTRA[i]#--launcher=} ;;
    esac
done
USED=${USED,,}
BACKEND_ARGS=()
[[ -n "${BACKEND:-}" ]] && BACKEND_ARGS=(--backend "$BACKEND")

# Relative paths would resolve against each node's ssh login directory.
CONFIG=$(realpath "$CONFIG")
RUN_DIR=$(realpath -m "$RUN_DIR")

# SIGUSR1 (a pre-emption warning) is the ranks' to answer (checkpoint, exit 75); DeepSpeed's launcher
# neither handles nor forwards it and would end at once, its ranks left running. Held blocked
# (launch/hold_usr1.py), the launcher here never takes it. With one host its ranks run here and
# inherit the mask; with several, DeepSpeed starts every node's ranks over pdsh/ssh, this node's
# too, and none inherits it: send it to the ranks on every node (docs/pretraining.md).
JOB_ARGS=(--config "$CONFIG" --run-dir "$RUN_DIR" ${BACKEND_ARGS[@]+"${BACKEND_ARGS[@]}"} "$@")
# With pdsh DeepSpeed hands the job's arguments to every node's shell joined into one command, in
# double quotes where one holds a space (its '"' escaped) and as they are otherwise: a JSON value
# ("--set job.data.inputs=[\"/data/*.txt\"]") would be split, unquoted and globbed there. Each is
# quoted here for that shell (with a space: its \, $ and ` escaped inside DeepSpeed's quotes), and
# --force_multi keeps DeepSpeed on pdsh (its own local start, which takes the arguments as they
# are, only for one host: a hostfile of one line naming this machine; DeepSpeed would start the
# ranks of a one-line hostfile here whatever host it names).
this_machine() {
    [[ $1 == localhost || $1 == 127.* || $1 == "$(hostname)" || $1 == "$(hostname -s 2>/dev/null)" ||
       $1 == "$(hostname -f 2>/dev/null)" ]] || { hostname -I 2>/dev/null | tr ' ' '\n' | grep -qxF -- "$1"; }
}
HOSTS=$(awk '!/^[[:space:]]*(#|$)/ {print $1}' "$HOSTFILE")
if [[ "$USED" == pdsh ]] && { [[ $(wc -l <<< "$HOSTS") -gt 1 ]] || ! this_machine "$HOSTS"; }; then
    EXTRA+=(--force_multi)
    for i in ${JOB_ARGS[@]+"${!JOB_ARGS[@]}"}; do
        arg=${JOB_ARGS[i]}
        if [[ "$arg" == *" "* ]]; then
            arg=${arg//\\/\\\\}; arg=${arg//\$/\\\$}; arg=${arg//\`/\\\`}
        else
            printf -v arg '%q' "$arg"
        fi
        JOB_ARGS[i]=$arg
    done
fi

set -x
exec launch/hold_usr1.py "$DEEPSPEED" --hostfile "$HOSTFILE" --launcher "$LAUNCHER" \
    ${ADDR_ARGS[@]+"${ADDR_ARGS[@]}"} --master_port "$MASTER_PORT" ${EXTRA[@]+"${EXTRA[@]}"} \
    --module vrgd_ds.train ${JOB_ARGS[@]+"${JOB_ARGS[@]}"}
