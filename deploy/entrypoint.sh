#!/bin/sh
# Container entry point: container-friendly defaults, then `exec swarmpipe "$@"`.
#
#   docker run swarmpipe:local peer --stage 0      ==  swarmpipe peer --stage 0  (inside the container)
#
# 1. Announce an address other containers can dial: when SWARMPIPE_HOST is 0.0.0.0
#    and SWARMPIPE_ANNOUNCE_HOST is unset, announce this container's IPv4 address.
# 2. Find the swarm: for peer / train / status / monitor without SWARMPIPE_INITIAL_PEERS (or
#    --initial-peers), wait for the coordinator's peers file SWARMPIPE_PEERS_FILE
#    (a volume shared with the coordinator, which writes it) and join the
#    multiaddrs listed there. SWARMPIPE_PEERS_FILE_WAIT bounds the wait (seconds, default 300).
set -eu

log() { echo "swarmpipe-entrypoint: $*" >&2; }

container_ip() {
    # First global IPv4 address; `hostname -i` as a fallback.
    ip=""
    if command -v ip >/dev/null 2>&1; then
        ip=$(ip -4 -o addr show scope global 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}')
    fi
    if [ -z "$ip" ]; then
        ip=$(hostname -i 2>/dev/null | tr ' ' '\n' | grep -E '^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$' | grep -v '^127\.' | head -n 1 || true)
    fi
    echo "$ip"
}

has_flag() {  # has_flag --name "$@": the command line names this flag
    want=$1; shift
    for arg in "$@"; do
        case "$arg" in "$want"|"$want"=*) return 0 ;; esac
    done
    return 1
}

role=${1:-}

if [ -z "${SWARMPIPE_ANNOUNCE_HOST:-}" ] && [ "${SWARMPIPE_HOST:-}" = "0.0.0.0" ] && ! has_flag --announce-host "$@"; then
    ip=$(container_ip)
    if [ -n "$ip" ]; then
        export SWARMPIPE_ANNOUNCE_HOST="$ip"
        log "announcing $ip (set SWARMPIPE_ANNOUNCE_HOST to override)"
    else
        log "warning: no IPv4 address found to announce; set SWARMPIPE_ANNOUNCE_HOST"
    fi
fi

case "$role" in
    peer|train|status|monitor)
        if [ -z "${SWARMPIPE_INITIAL_PEERS:-}" ] && [ -n "${SWARMPIPE_PEERS_FILE:-}" ] && ! has_flag --initial-peers "$@"; then
            file=$SWARMPIPE_PEERS_FILE
            wait_s=${SWARMPIPE_PEERS_FILE_WAIT:-300}
            waited=0
            while [ ! -s "$file" ]; do
                if [ "$waited" -eq 0 ]; then log "waiting up to ${wait_s}s for the coordinator's peers file $file"; fi
                if [ "$waited" -ge "$wait_s" ]; then
                    log "error: $file did not appear within ${wait_s}s: is the coordinator up, and is the volume shared?"
                    exit 2
                fi
                sleep 1
                waited=$((waited + 1))
            done
            SWARMPIPE_INITIAL_PEERS=$(tr '\n' ' ' < "$file")
            export SWARMPIPE_INITIAL_PEERS
            log "joining via $SWARMPIPE_INITIAL_PEERS"
        fi
        ;;
esac

exec swarmpipe "$@"
