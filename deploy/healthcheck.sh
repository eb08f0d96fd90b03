#!/bin/sh
# Docker HEALTHCHECK for every role of the swarmpipe image.
#   coordinator: its HTTP /healthz           (swarmpipe healthcheck --url)
#   peer:        its gRPC Info, not draining (swarmpipe healthcheck --address), the
#                address read from the peer's ready file, else 127.0.0.1:$SWARMPIPE_PORT
#   anything else (trainer, status): healthy while it runs
# The role is SWARMPIPE_ROLE when set, else the subcommand of PID 1.
set -u

role=${SWARMPIPE_ROLE:-}
if [ -z "$role" ] && [ -r /proc/1/cmdline ]; then
    for word in $(tr '\0' '\n' < /proc/1/cmdline); do
        case "$word" in coordinator|peer|train|demo|status) role=$word; break ;; esac
    done
fi

timeout=${SWARMPIPE_HEALTH_TIMEOUT:-5}
case "$role" in
    coordinator)
        host=${SWARMPIPE_HOST:-127.0.0.1}
        [ "$host" = "0.0.0.0" ] && host=127.0.0.1
        exec swarmpipe healthcheck --timeout "$timeout" --url "http://$host:${SWARMPIPE_HTTP_PORT:-8080}/healthz"
        ;;
    peer)
        address=""
        ready=${SWARMPIPE_READY_FILE:-}
        if [ -n "$ready" ] && [ -s "$ready" ]; then
            address=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["address"])' "$ready" 2>/dev/null || true)
        fi
        if [ -z "$address" ]; then
            port=${SWARMPIPE_PORT:-0}
            if [ "$port" = "0" ]; then
                echo "unhealthy: peer not serving yet (no ready file, no fixed SWARMPIPE_PORT)"
                exit 1
            fi
            address=127.0.0.1:$port
        fi
        exec swarmpipe healthcheck --timeout "$timeout" --address "$address"
        ;;
    *)
        echo "healthy: ${role:-unknown role} is running"
        exit 0
        ;;
esac
