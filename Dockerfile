# kvroute in a container. Two stages:
#   build:   kvroute and its run-time dependencies in a venv, then `python -m backends
#            prepare`, as `make run` does: llama-server built with cmake from the
#            llama.cpp tree vendored in the pinned llama-cpp-python sdist, patched (git
#            applies kvroute's fixes), with the libllama the tokenizer uses, and the demo
#            model;
#   runtime: the slim Python image with that venv, llama-server and the demo model,
#            running `kvroute serve` as an unprivileged user.
# The image runs on any x86-64 CPU: llama-server is the portable build (every ggml CPU
# variant, the best loaded at start), and its libllama is the one the proxy tokenizes
# with (llama-cpp-python is installed without its own).
#
#   docker build -t kvroute .                      # about 10 min on 2 cores
#   docker run --init -p 127.0.0.1:8080:8080 kvroute
#   docker compose up -d                           # docker-compose.yml: volumes, config
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential cmake git \
 && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KVROUTE_CACHE=/opt/kvroute/cache
WORKDIR /src
COPY pyproject.toml README.md config.yaml ./
COPY proxy ./proxy
COPY backends ./backends
COPY loadtest ./loadtest
# no extras: neither matplotlib nor the dev tools
RUN python -m venv /opt/kvroute/venv \
 && CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" /opt/kvroute/venv/bin/pip install .
RUN /opt/kvroute/venv/bin/python -m backends prepare --config config.yaml

FROM ${PYTHON_IMAGE} AS runtime
# libgomp: the OpenMP runtime llama-server and its libraries (the tokenizer's libllama
# among them) link against
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 libstdc++6 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --user-group --uid 10001 --home-dir /var/lib/kvroute \
      --shell /usr/sbin/nologin kvroute \
 && install -d -o kvroute -g kvroute -m 0750 /var/lib/kvroute /var/cache/kvroute
COPY --from=build /opt/kvroute/venv /opt/kvroute/venv
# on PATH, which kvroute searches before its cache: outside the cache volume, so a new
# image's llama-server is the one that runs; its CPU variants lie beside it
COPY --from=build /opt/kvroute/cache/bin-cpu /opt/kvroute/llama-server
# a fresh cache volume starts with the demo model
COPY --from=build --chown=kvroute:kvroute /opt/kvroute/cache/models /var/cache/kvroute/models
# the default; docker-compose.yml mounts deploy/config.yaml (or yours) over it
COPY deploy/config.yaml /etc/kvroute/config.yaml
ENV PATH=/opt/kvroute/venv/bin:/opt/kvroute/llama-server:$PATH \
    LLAMA_CPP_LIB_PATH=/opt/kvroute/llama-server \
    KVROUTE_CACHE=/var/cache/kvroute \
    PYTHONUNBUFFERED=1
USER kvroute
WORKDIR /var/lib/kvroute
# the cache (demo models, anything built at run time) and the state (logs, kv_disk slots)
VOLUME ["/var/cache/kvroute", "/var/lib/kvroute"]
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=5s --start-period=180s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=4)"]
ENTRYPOINT ["kvroute"]
# the container's own interface: the port is published by `docker run -p` / compose
CMD ["serve", "--config", "/etc/kvroute/config.yaml", "--host", "0.0.0.0"]
