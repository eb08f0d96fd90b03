#!/usr/bin/env bash
# Make this machine ready to run swarmpipe in Docker, offline-friendly and idempotent:
#   1. Docker engine + Compose (Debian packages docker.io, docker-compose, debootstrap) when missing;
#   2. dockerd started in the background when none answers (log: $SWARMPIPE_DOCKERD_LOG);
#   3. a local base image (debootstrap bookworm minbase + python3, venv, iproute2, iptables),
#      so no registry is needed (skipped when it exists, or when SWARMPIPE_BASE is given);
#   4. a wheelhouse in deploy/wheels (`pip wheel` of pyproject.toml's dependencies on this host);
#   5. the image swarmpipe:local built from the source tree (Docker's layer cache makes reruns fast).
#
# Usage: deploy/setup-docker.sh [--engine-only] [--no-build]
# Environment:
#   SWARMPIPE_IMAGE        image to build (swarmpipe:local)
#   SWARMPIPE_BASE         base image to build on; default: build swarmpipe-base:bookworm locally.
#                          e.g. SWARMPIPE_BASE=python:3.11-slim where a registry is reachable
#   SWARMPIPE_DEBIAN_MIRROR  debootstrap mirror (http://deb.debian.org/debian)
#   PYTHON                 python used for `pip wheel` (python3); must match the image's X.Y
#   SWARMPIPE_WHEELHOUSE   auto | off (off: the image installs from the indexes instead)
#   TORCH_INDEX_URL        where the torch wheel comes from when pip's own configuration has no
#                          local copy (https://download.pytorch.org/whl/cpu)
# Prints the compose command to use on its last line: "compose: docker compose" or "compose: docker-compose".
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
IMAGE=${SWARMPIPE_IMAGE:-swarmpipe:local}
LOCAL_BASE=swarmpipe-base:bookworm
BASE=${SWARMPIPE_BASE:-}
SUITE=bookworm
MIRROR=${SWARMPIPE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
PYTHON=${PYTHON:-python3}
WHEELS=$ROOT/deploy/wheels
WHEELHOUSE=${SWARMPIPE_WHEELHOUSE:-auto}
TORCH_INDEX_URL=${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}
DOCKERD_LOG=${SWARMPIPE_DOCKERD_LOG:-/var/log/swarmpipe-dockerd.log}
ENGINE_ONLY=0
BUILD=1
for arg in "$@"; do
    case "$arg" in
        --engine-only) ENGINE_ONLY=1 ;;
        --no-build) BUILD=0 ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "setup-docker: unknown argument $arg" >&2; exit 2 ;;
    esac
done

step() { echo "setup-docker: $*"; }
fail() { echo "setup-docker: FAILED: $*" >&2; exit 1; }
is_root() { [ "$(id -u)" = 0 ]; }
SUDO=""
if ! is_root && command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; fi

apt_install() {
    if ! is_root && [ -z "$SUDO" ]; then
        fail "need root (or passwordless sudo) to install $*; install them yourself and rerun"
    fi
    command -v apt-get >/dev/null 2>&1 || fail "no apt-get here: install $* with your package manager and rerun"
    step "installing $* (apt-get)"
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null || fail "apt-get update failed"
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >/dev/null \
        || fail "apt-get install $* failed"
}

# ------------------------------------------------------------------ 1. engine and compose
docker_ok() { docker info >/dev/null 2>&1; }

if ! docker_ok && { ! command -v docker >/dev/null 2>&1 || ! command -v dockerd >/dev/null 2>&1; }; then
    apt_install docker.io
else
    step "docker: $(command -v docker) ($(docker --version 2>/dev/null | head -n 1))"
fi

if docker_ok; then
    step "dockerd: already answering"
else
    command -v dockerd >/dev/null 2>&1 || fail "docker does not answer and there is no dockerd to start"
    if ! is_root && [ -z "$SUDO" ]; then
        fail "docker does not answer and starting dockerd needs root (or add yourself to the docker group)"
    fi
    step "dockerd: starting in the background (log $DOCKERD_LOG)"
    $SUDO mkdir -p "$(dirname "$DOCKERD_LOG")"
    # setsid: the daemon outlives this script and its caller's process group.
    $SUDO setsid nohup dockerd >>"$DOCKERD_LOG" 2>&1 </dev/null &
    for _ in $(seq 1 60); do
        docker_ok && break
        sleep 1
    done
    docker_ok || fail "dockerd did not answer within 60 s; last log lines:
$(tail -n 20 "$DOCKERD_LOG" 2>/dev/null)"
    step "dockerd: up ($(docker info --format '{{.ServerVersion}}' 2>/dev/null))"
fi

COMPOSE=""
if docker compose version >/dev/null 2>&1; then
    COMPOSE="docker compose"
elif command -v docker-compose >/dev/null 2>&1; then
    COMPOSE="docker-compose"
else
    apt_install docker-compose
    command -v docker-compose >/dev/null 2>&1 && COMPOSE="docker-compose" || fail "no Compose (docker compose v2 or docker-compose v1)"
fi
step "compose: $COMPOSE ($($COMPOSE version 2>/dev/null | head -n 1))"

if [ "$ENGINE_ONLY" = 1 ]; then
    echo "compose: $COMPOSE"
    exit 0
fi

# ------------------------------------------------------------------ 2. base image
if [ -n "$BASE" ]; then
    step "base image: $BASE (given)"
elif docker image inspect "$LOCAL_BASE" >/dev/null 2>&1; then
    BASE=$LOCAL_BASE
    step "base image: $BASE (cached)"
else
    BASE=$LOCAL_BASE
    command -v debootstrap >/dev/null 2>&1 || apt_install debootstrap
    is_root || [ -n "$SUDO" ] || fail "debootstrap needs root"
    rootfs=$(mktemp -d /var/tmp/swarmpipe-rootfs.XXXXXX)
    trap '$SUDO rm -rf "$rootfs"' EXIT
    step "base image: debootstrap $SUITE minbase into $rootfs (about a minute)"
    $SUDO debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,iproute2,iptables,ca-certificates \
        "$SUITE" "$rootfs" "$MIRROR" >"$rootfs.log" 2>&1 || fail "debootstrap failed; see $rootfs.log"
    # Trim what a container never needs: package caches and lists, docs, man pages, locales.
    $SUDO rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
        "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/*
    step "base image: importing as $BASE"
    $SUDO tar -C "$rootfs" -c . | docker import -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        -c 'CMD ["/bin/bash"]' - "$BASE" >/dev/null || fail "docker import failed"
    $SUDO rm -rf "$rootfs" "$rootfs.log"
    trap - EXIT
fi

# ------------------------------------------------------------------ 3. wheelhouse
if [ "$WHEELHOUSE" = off ]; then
    step "wheelhouse: off (the image installs from the indexes)"
else
    command -v "$PYTHON" >/dev/null 2>&1 || fail "no $PYTHON for pip wheel (set PYTHON=...)"
    host_py=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    image_py=$(docker run --rm --entrypoint python3 "$BASE" -c 'import sys; print("%d.%d" % sys.version_info[:2])') \
        || fail "cannot run python3 in $BASE"
    [ "$host_py" = "$image_py" ] || fail "host $PYTHON is $host_py but $BASE has python $image_py: set PYTHON=python$image_py, or SWARMPIPE_WHEELHOUSE=off to install online"
    requirements=$("$PYTHON" -c 'import sys, tomllib; print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' \
        "$ROOT/pyproject.toml")
    # setuptools: pyproject's build backend, needed to build the project offline in the image.
    wanted=$(printf '%s\n%s\n' "$requirements" 'setuptools>=68')
    mkdir -p "$WHEELS"
    if [ -f "$WHEELS/.requirements" ] && [ "$(cat "$WHEELS/.requirements")" = "$wanted" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        step "wheelhouse: $WHEELS up to date ($(ls "$WHEELS"/*.whl | wc -l) wheels)"
    else
        step "wheelhouse: pip wheel into $WHEELS (python $host_py)"
        printf '%s\n' "$wanted" >"$WHEELS/.requirements.txt"
        torch_req=$(printf '%s\n' "$requirements" | grep -E '^torch([=<>!~ ;]|$)' | head -n 1)
        if [ -n "$torch_req" ]; then
            # torch first: a local copy pip already knows (find-links), else the CPU index, so that
            # the resolver below takes the CPU wheel rather than PyPI's CUDA build.
            if "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --no-index -d "$WHEELS" "$torch_req" >/dev/null 2>&1; then
                step "wheelhouse: $torch_req from pip's local find-links"
            elif [ -n "$TORCH_INDEX_URL" ]; then
                step "wheelhouse: $torch_req from $TORCH_INDEX_URL"
                "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --index-url "$TORCH_INDEX_URL" -d "$WHEELS" "$torch_req" \
                    || fail "could not download $torch_req from $TORCH_INDEX_URL"
            fi
        fi
        "$PYTHON" -m pip wheel --quiet --find-links "$WHEELS" --wheel-dir "$WHEELS" -r "$WHEELS/.requirements.txt" 2>&1 \
            | grep -v "is ignored: it is neither a file nor a directory" || true
        # pip wheel's exit status is lost in the pipe: check the result instead.
        "$PYTHON" - "$WHEELS" <<'EOF' || fail "the wheelhouse is incomplete (see pip's output above)"
import sys, pathlib
names = {p.name.split("-")[0].lower().replace("_", "-") for p in pathlib.Path(sys.argv[1]).glob("*.whl")}
missing = [n for n in ("torch", "hivemind", "grpcio", "protobuf", "pydantic", "setuptools") if n not in names]
if missing:
    print("setup-docker: missing wheels:", ", ".join(missing), file=sys.stderr)
    sys.exit(1)
EOF
        printf '%s' "$wanted" >"$WHEELS/.requirements"
        rm -f "$WHEELS/.requirements.txt"
        step "wheelhouse: $(ls "$WHEELS"/*.whl | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1)"
    fi
fi

# ------------------------------------------------------------------ 4. the image
if [ "$BUILD" = 1 ]; then
    # Without the buildx plugin, newer docker CLIs refuse BuildKit builds: use the classic builder.
    if ! docker buildx version >/dev/null 2>&1; then export DOCKER_BUILDKIT=0; fi
    step "image: building $IMAGE on $BASE"
    started=$(date +%s)
    log=$(mktemp /tmp/swarmpipe-build.XXXXXX.log)
    if ! docker build --build-arg BASE="$BASE" --build-arg WHEELHOUSE="$WHEELHOUSE" -t "$IMAGE" -f "$ROOT/Dockerfile" "$ROOT" >"$log" 2>&1; then
        tail -n 40 "$log" >&2
        fail "docker build failed (full log $log)"
    fi
    rm -f "$log"
    step "image: $IMAGE built in $(( $(date +%s) - started )) s, $(docker image inspect "$IMAGE" --format '{{.Size}}' | awk '{printf "%.0f MB", $1/1e6}')"
fi
echo "compose: $COMPOSE"
