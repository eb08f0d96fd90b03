# One image for every swarmpipe role: coordinator, peer, trainer (and status, healthcheck).
#
#   docker build -t swarmpipe:local .                      # torch CPU wheel from the PyTorch CPU index
#   docker run --rm swarmpipe:local peer --help
#
# Build arguments:
#   BASE             base image with python3 (>= 3.10) and python3 -m venv; Debian-like when
#                    iproute2 / iptables must be installed (default python:3.11-slim;
#                    deploy/setup-docker.sh passes a local debootstrap image instead)
#   TORCH_INDEX_URL  where torch comes from: the CPU index by default (https://download.pytorch.org/whl/cpu),
#                    "" for PyPI. Any other index (a CUDA build, e.g. https://download.pytorch.org/whl/cu128;
#                    it must carry pyproject's torch==2.13.0) is always used for torch, with or without
#                    a wheelhouse: torch and its CUDA libraries come from that index (online), everything
#                    else from deploy/wheels as usual. The default leaves the build exactly as before:
#                    the wheelhouse's CPU wheel offline, or the CPU index online.
#   WHEELHOUSE       auto (default): install offline (--no-index) from deploy/wheels when it holds
#                    wheels, else online; "off": always online
#   PIP_INDEX_URL    passed to pip for the online path (a mirror)
#
# Offline builds: deploy/setup-docker.sh fills deploy/wheels with `pip wheel` on the host.
#
# GPU peers (the host needs the NVIDIA driver and the NVIDIA Container Toolkit; the CUDA runtime
# libraries come with torch's wheels, so the base image stays the same):
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t swarmpipe:cuda .
#   docker run --rm --gpus all swarmpipe:cuda peer --device cuda ...
#   (Compose: deploy/docker-compose.gpu.yml over deploy/docker-compose.yml; see deploy/README.md)
ARG BASE=python:3.11-slim

# ---------------------------------------------------------------- build: the dependencies in /opt/venv
FROM ${BASE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG WHEELHOUSE=auto
ARG PIP_INDEX_URL=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore
RUN python3 -m venv /opt/venv
COPY deploy/wheels/ /wheels/
COPY pyproject.toml /src/
# Dependencies first (a layer that survives source edits), torch from its own index.
# A TORCH_INDEX_URL other than the CPU default (a CUDA index) installs torch from there first, even
# with a wheelhouse; the wheelhouse then supplies the rest, and its CPU torch is not used (the CUDA
# build, 2.13.0+cuXXX, already satisfies torch==2.13.0).
RUN set -eu; [ -n "${PIP_INDEX_URL:-}" ] || unset PIP_INDEX_URL; \
    cpu_index=https://download.pytorch.org/whl/cpu; \
    /opt/venv/bin/python -c "import tomllib; deps = tomllib.load(open('/src/pyproject.toml', 'rb'))['project']['dependencies']; \
open('/src/torch.txt', 'w').write(''.join(d + '\n' for d in deps if d.replace(' ', '').startswith('torch'))); \
open('/src/requirements.txt', 'w').write(''.join(d + '\n' for d in deps))"; \
    if [ "$WHEELHOUSE" != "off" ] && ls /wheels/*.whl >/dev/null 2>&1; then \
        if [ -n "$TORCH_INDEX_URL" ] && [ "$TORCH_INDEX_URL" != "$cpu_index" ]; then \
            echo "installing torch online from $TORCH_INDEX_URL, the rest from the wheelhouse"; \
            /opt/venv/bin/pip install --index-url "$TORCH_INDEX_URL" -r /src/torch.txt; \
        fi; \
        echo "installing dependencies offline from the wheelhouse ($(ls /wheels/*.whl | wc -l) wheels)"; \
        /opt/venv/bin/pip install --no-index --find-links /wheels -r /src/requirements.txt; \
    else \
        echo "installing dependencies online (torch from ${TORCH_INDEX_URL:-PyPI})"; \
        if [ -n "$TORCH_INDEX_URL" ]; then \
            /opt/venv/bin/pip install --index-url "$TORCH_INDEX_URL" -r /src/torch.txt; \
        fi; \
        /opt/venv/bin/pip install -r /src/requirements.txt; \
    fi; \
    # C++ headers and test binaries are for building extensions and testing torch: not needed here.
    rm -rf /opt/venv/lib/python3*/site-packages/torch/include /opt/venv/lib/python3*/site-packages/torch/test
# ---------------------------------------------------------------- project: a wheel from the source tree
FROM build AS project
ARG WHEELHOUSE=auto
ARG PIP_INDEX_URL=
COPY pyproject.toml README.m[d] /src/
COPY peer /src/peer
COPY coordinator /src/coordinator
COPY protos /src/protos
COPY swarmpipe /src/swarmpipe
RUN set -eu; [ -n "${PIP_INDEX_URL:-}" ] || unset PIP_INDEX_URL; \
    if [ "$WHEELHOUSE" != "off" ] && ls /wheels/*.whl >/dev/null 2>&1; then \
        /opt/venv/bin/pip wheel --no-deps --no-index --find-links /wheels --wheel-dir /dist /src; \
    else \
        /opt/venv/bin/pip wheel --no-deps --wheel-dir /dist /src; \
    fi

# ---------------------------------------------------------------- runtime
FROM ${BASE}
# iproute2 (tc) and iptables for fault injection (swarmpipe-netem); no compilers.
RUN set -eu; missing=""; \
    command -v tc >/dev/null 2>&1 || missing="$missing iproute2"; \
    command -v iptables >/dev/null 2>&1 || missing="$missing iptables"; \
    if [ -n "$missing" ]; then \
        apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing \
            && rm -rf /var/lib/apt/lists/*; \
    fi; \
    useradd --uid 10001 --user-group --create-home --home-dir /home/swarm --shell /usr/sbin/nologin swarm; \
    mkdir -p /data /bootstrap /reports /usr/local/lib/swarmpipe /opt/swarmpipe; \
    chown swarm:swarm /data /bootstrap /reports
# The dependencies' venv (a layer that survives source edits), then the project's wheel into it.
COPY --from=build /opt/venv /opt/venv
COPY --from=project /dist/ /tmp/dist/
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps --no-index /tmp/dist/*.whl \
    && rm -rf /tmp/dist \
    && /opt/venv/bin/swarmpipe --help >/dev/null
COPY deploy/entrypoint.sh /usr/local/bin/swarmpipe-entrypoint
COPY deploy/healthcheck.sh /usr/local/bin/swarmpipe-healthcheck
COPY deploy/netem.sh /usr/local/bin/swarmpipe-netem
COPY deploy/nfq_delay.py /usr/local/lib/swarmpipe/nfq_delay.py
COPY deploy/specs /opt/swarmpipe/specs
RUN chmod 0755 /usr/local/bin/swarmpipe-entrypoint /usr/local/bin/swarmpipe-healthcheck /usr/local/bin/swarmpipe-netem

# Container defaults; every one is a swarmpipe flag (SWARMPIPE_<FLAG>) and can be overridden.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    OMP_NUM_THREADS=1 \
    SWARMPIPE_HOST=0.0.0.0 \
    SWARMPIPE_PORT=7000 \
    SWARMPIPE_DHT_PORT=31337 \
    SWARMPIPE_HTTP_PORT=8080 \
    SWARMPIPE_READY_FILE=/tmp/swarmpipe-ready.json \
    SWARMPIPE_PROGRESS=0
EXPOSE 7000 8080 31337
USER swarm
WORKDIR /home/swarm
HEALTHCHECK --interval=30s --timeout=10s --start-period=120s --retries=3 CMD ["swarmpipe-healthcheck"]
# `docker run IMAGE peer ...` runs `swarmpipe peer ...`; the wrapper only fills in the
# announce address and waits for the coordinator's peers file (see deploy/entrypoint.sh).
ENTRYPOINT ["swarmpipe-entrypoint"]
CMD ["--help"]
