#!/bin/sh
# swarmpipe-netem: impair this container's network, for fault-injection experiments.
# Run as root inside a container that has the NET_ADMIN capability:
#
#   docker exec -u 0 CONTAINER swarmpipe-netem delay 100ms 20ms   # one-way delay with uniform jitter
#   docker exec -u 0 CONTAINER swarmpipe-netem loss 5%            # drop 5 % of outgoing packets
#   docker exec -u 0 CONTAINER swarmpipe-netem rate 50mbit        # shape outgoing traffic
#   docker exec -u 0 CONTAINER swarmpipe-netem clear              # remove every impairment
#   docker exec -u 0 CONTAINER swarmpipe-netem show
#
# Each command replaces the previous impairment. `tc qdisc ... netem` does delay and
# loss where the kernel has sch_netem; where it lacks it (minimal VM kernels), delay
# falls back to NFQUEUE + nfq_delay.py (a user-space delayer; on ingress, so held
# packets do not throttle the sender through TCP small queues) and loss to an
# iptables `statistic` rule. Rate always uses tc's tbf. Device: $NETEM_DEV, else the
# interface of the default route.
set -eu

DEV=${NETEM_DEV:-}
if [ -z "$DEV" ]; then
    # The interface of the default route, else the first one but lo: after `docker network
    # disconnect` + `connect` the container's interface may be eth1, not eth0.
    DEV=$(ip -o route show default 2>/dev/null | awk '{for (i = 1; i < NF; i++) if ($i == "dev") {print $(i + 1); exit}}')
    [ -n "$DEV" ] || DEV=$(ip -o link show 2>/dev/null | awk -F': ' '$2 != "lo" {sub(/@.*/, "", $2); print $2; exit}')
    [ -n "$DEV" ] || DEV=eth0
fi
CHAIN_IN=SWARMPIPE_NETEM_IN
CHAIN_OUT=SWARMPIPE_NETEM_OUT
QUEUE=${NETEM_QUEUE:-7}
PIDFILE=/run/swarmpipe-netem-delay.pid
DELAYER=${NETEM_DELAYER:-/usr/local/lib/swarmpipe/nfq_delay.py}

die() { echo "swarmpipe-netem: $*" >&2; exit 1; }
say() { echo "swarmpipe-netem: $*"; }

ms() {  # "100ms" / "0.1s" / "100" -> milliseconds
    case "$1" in
        *ms) echo "${1%ms}" ;;
        *us) awk "BEGIN{print ${1%us}/1000}" ;;
        *s) awk "BEGIN{print ${1%s}*1000}" ;;
        *) echo "$1" ;;
    esac
}

has_netem() {
    # Probe: install a no-op netem qdisc on the device, then remove it.
    if tc qdisc replace dev "$DEV" root netem delay 0ms 2>/dev/null; then
        tc qdisc del dev "$DEV" root 2>/dev/null || true
        return 0
    fi
    return 1
}

chains() {
    for spec in "INPUT $CHAIN_IN -i" "OUTPUT $CHAIN_OUT -o"; do
        set -- $spec
        iptables -N "$2" 2>/dev/null || true
        iptables -C "$1" "$3" "$DEV" -j "$2" 2>/dev/null || iptables -I "$1" 1 "$3" "$DEV" -j "$2"
    done
}

clear_all() {
    tc qdisc del dev "$DEV" root 2>/dev/null || true
    if command -v iptables >/dev/null 2>&1; then
        iptables -F "$CHAIN_IN" 2>/dev/null || true
        iptables -F "$CHAIN_OUT" 2>/dev/null || true
    fi
    if [ -s "$PIDFILE" ]; then
        kill "$(cat "$PIDFILE")" 2>/dev/null || true
        rm -f "$PIDFILE"
    fi
}

start_delayer() {  # start_delayer DELAY_MS JITTER_MS
    [ -r "$DELAYER" ] || die "no sch_netem in this kernel and no user-space delayer at $DELAYER"
    command -v iptables >/dev/null 2>&1 || die "no sch_netem in this kernel and no iptables for the fallback"
    rm -f "$PIDFILE"
    nohup python3 "$DELAYER" --queue "$QUEUE" --delay "$1" --jitter "$2" --ready-file "$PIDFILE" \
        >/tmp/swarmpipe-netem-delay.log 2>&1 &
    i=0
    while [ ! -s "$PIDFILE" ]; do
        i=$((i + 1))
        [ "$i" -le 50 ] || die "the delayer did not start: $(cat /tmp/swarmpipe-netem-delay.log)"
        sleep 0.1
    done
    chains
    iptables -A "$CHAIN_IN" -j NFQUEUE --queue-num "$QUEUE" --queue-bypass
}

[ "$(id -u)" = 0 ] || die "run as root (docker exec -u 0 ...)"
cmd=${1:-show}
case "$cmd" in
    delay)
        [ $# -ge 2 ] || die "usage: swarmpipe-netem delay TIME [JITTER]"
        delay=$(ms "$2"); jitter=$(ms "${3:-0ms}")
        clear_all
        if has_netem; then
            tc qdisc replace dev "$DEV" root netem delay "${delay}ms" "${jitter}ms"
            say "netem delay ${delay}ms ${jitter}ms on $DEV (egress)"
        else
            start_delayer "$delay" "$jitter"
            say "delay ${delay}ms +- ${jitter}ms on $DEV ingress via NFQUEUE $QUEUE (kernel has no sch_netem)"
        fi
        ;;
    loss)
        [ $# -ge 2 ] || die "usage: swarmpipe-netem loss PERCENT%"
        pct=${2%\%}
        clear_all
        if has_netem; then
            tc qdisc replace dev "$DEV" root netem loss "${pct}%"
            say "netem loss ${pct}% on $DEV (egress)"
        else
            chains
            prob=$(awk "BEGIN{printf \"%.4f\", $pct/100}")
            iptables -A "$CHAIN_OUT" -m statistic --mode random --probability "$prob" -j DROP
            say "loss ${pct}% on $DEV egress via iptables statistic (kernel has no sch_netem)"
        fi
        ;;
    rate)
        [ $# -ge 2 ] || die "usage: swarmpipe-netem rate RATE (e.g. 50mbit)"
        clear_all
        tc qdisc replace dev "$DEV" root tbf rate "$2" burst "${NETEM_BURST:-64kb}" latency "${NETEM_LATENCY:-200ms}"
        say "rate $2 on $DEV (egress, tbf)"
        ;;
    clear)
        clear_all
        say "cleared $DEV"
        ;;
    show)
        tc qdisc show dev "$DEV"
        if command -v iptables >/dev/null 2>&1; then
            iptables -S "$CHAIN_IN" 2>/dev/null || true
            iptables -S "$CHAIN_OUT" 2>/dev/null || true
        fi
        [ -s "$PIDFILE" ] && echo "delayer pid $(cat "$PIDFILE")" || true
        ;;
    *)
        die "unknown command $cmd: delay | loss | rate | clear | show"
        ;;
esac
