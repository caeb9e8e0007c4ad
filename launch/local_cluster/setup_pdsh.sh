#!/usr/bin/env bash
# Two "nodes" on this machine for `deepspeed --hostfile` with the pdsh launcher: loopback
# aliases in /etc/hosts, an sshd listening on them, a passwordless key, accepted host keys and a
# hostfile. Run as root; safe to run again (does only what is missing).
#
#   sudo launch/local_cluster/setup_pdsh.sh
#   HOSTFILE=/etc/vrgd/loopback.hostfile launch/deepspeed_hostfile.sh ...   # then
#
# Environment (defaults): NODES ("vrgd-node1 vrgd-node2"), ADDRS ("127.0.0.2 127.0.0.3", loopback
# addresses, one per node), SLOTS (1, ranks per node), HOSTFILE (/etc/vrgd/loopback.hostfile),
# PORT (22; where a system sshd already listens on every address, port 22 is taken: PORT=2222,
# which root's ~/.ssh/config then gives the nodes).
set -euo pipefail

read -r -a NODES <<< "${NODES:-vrgd-node1 vrgd-node2}"
read -r -a ADDRS <<< "${ADDRS:-127.0.0.2 127.0.0.3}"
SLOTS=${SLOTS:-1}
PORT=${PORT:-22}
HOSTFILE=${HOSTFILE:-/etc/vrgd/loopback.hostfile}
PIDFILE=/run/sshd_vrgd_loopback.pid
SSHD_LOG=/run/sshd_vrgd_loopback.log
[[ $(id -u) -eq 0 ]] || { echo "error: run as root" >&2; exit 1; }
[[ ${#NODES[@]} -eq ${#ADDRS[@]} ]] || { echo "error: NODES and ADDRS differ in length" >&2; exit 2; }

log() { echo "setup_pdsh: $*"; }

if ! command -v pdsh >/dev/null || [[ ! -x /usr/sbin/sshd ]] || ! command -v ssh >/dev/null; then
    log "installing openssh and pdsh"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends openssh-server openssh-client pdsh >/dev/null
fi

for i in "${!NODES[@]}"; do
    if ! grep -Eq "^${ADDRS[$i]//./\\.}[[:space:]]+${NODES[$i]}([[:space:]]|$)" /etc/hosts; then
        log "adding '${ADDRS[$i]} ${NODES[$i]}' to /etc/hosts"
        printf '%s %s\n' "${ADDRS[$i]}" "${NODES[$i]}" >> /etc/hosts
    fi
done

# sshd on the loopback aliases only (a separate instance: any system sshd is left alone, but one
# listening on every address holds its port there too).
mkdir -p /run/sshd
chmod 755 /run/sshd
ssh-keygen -A >/dev/null
if ! { [[ -s $PIDFILE ]] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }; then
    log "starting sshd on ${ADDRS[*]}"
    listen=()
    for a in "${ADDRS[@]}"; do listen+=(-o "ListenAddress=$a:$PORT"); done
    rm -f "$PIDFILE"  # a stale one would pass the check below
    : > "$SSHD_LOG"
    /usr/sbin/sshd "${listen[@]}" -o PidFile="$PIDFILE" -o PermitRootLogin=prohibit-password \
        -o PasswordAuthentication=no -E "$SSHD_LOG"
    for _ in $(seq 20); do [[ -s $PIDFILE ]] && break; sleep 0.1; done
    # a daemonising sshd exits 0 even when it cannot bind: its pid file and log tell
    if ! { [[ -s $PIDFILE ]] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }; then
        echo "setup_pdsh: sshd did not start on ${ADDRS[*]} port $PORT: $(tail -n 2 "$SSHD_LOG" | tr '\n' ' ')" \
             "(a system sshd listening on every address holds the port: run again with PORT=2222)" >&2
        exit 1
    fi
fi

mkdir -p ~/.ssh
if [[ $PORT != 22 ]] && ! grep -qxF "Host ${NODES[*]}" ~/.ssh/config 2>/dev/null; then
    printf 'Host %s\n    Port %s\n' "${NODES[*]}" "$PORT" >> ~/.ssh/config
fi
chmod 700 ~/.ssh
[[ -f ~/.ssh/id_ed25519 ]] || ssh-keygen -q -t ed25519 -N "" -f ~/.ssh/id_ed25519
touch ~/.ssh/authorized_keys
chmod 600 ~/.ssh/authorized_keys
grep -qxF "$(cat ~/.ssh/id_ed25519.pub)" ~/.ssh/authorized_keys || cat ~/.ssh/id_ed25519.pub >> ~/.ssh/authorized_keys

for n in "${NODES[@]}"; do
    ok=0
    for _ in $(seq 20); do
        if ssh -o BatchMode=yes -o StrictHostKeyChecking=accept-new -o ConnectTimeout=5 "$n" true 2>/dev/null; then
            ok=1; break
        fi
        sleep 0.5
    done
    [[ $ok -eq 1 ]] || { echo "setup_pdsh: cannot ssh to $n" >&2; exit 1; }
done
PDSH_RCMD_TYPE=ssh pdsh -w "$(IFS=,; echo "${NODES[*]}")" true

mkdir -p "$(dirname "$HOSTFILE")"
{ for n in "${NODES[@]}"; do echo "$n slots=$SLOTS"; done; } > "$HOSTFILE"
log "ssh and pdsh reach ${NODES[*]}; hostfile $HOSTFILE"
