# syntax=docker/dockerfile:1
#
# The taskbroker image: `docker build -t taskbroker .` from the repository
# root. Configured only through TASKBROKER_* environment variables
# (docs/configuration.md); docs/operations.md shows it deployed.

# --- build -------------------------------------------------------------------
# The toolchain the project is developed and tested with (rust 1.95), on the
# same Debian release as the runtime stage, so the binary links against the
# glibc it will run with.
FROM rust:1.95-bookworm AS builder

# rdkafka-sys configures and builds librdkafka from source (a shell configure
# script, make, a C and C++ compiler, and python3 for its linker script);
# libz-sys links the system zlib found through pkg-config. rusqlite bundles
# SQLite and protox compiles the .proto files in Rust, so neither SQLite nor
# protoc is needed. Package versions are not pinned: bookworm's point
# releases only bring fixes, and a pinned version disappears from the
# archive when it is superseded.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        build-essential make perl pkg-config python3 zlib1g-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src
# Only what `cargo build` reads; .dockerignore keeps target/ and .git out.
# tools/ (the load harness and benchmarks, the workspace's other member) is
# not built, but Cargo loads every member's manifest and targets to resolve
# the workspace, so it must be there.
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto proto
COPY migrations migrations
COPY src src
COPY tools tools

# Cache mounts keep the crate registry and the build directory between
# builds; the binary is copied out of the cached target/ in the same step.
# The release profile keeps line-table debug info (for backtraces in
# development); the image ships the binary without it (171 MB -> 27 MB on
# 2026-12-06), and the stage `debug-symbols` below holds the split symbols,
# linked by build id, for debugging a core dump of the shipped binary.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p taskbroker --bin taskbroker \
    && install -D -m 0755 target/release/taskbroker /out/taskbroker \
    && objcopy --only-keep-debug /out/taskbroker /out/taskbroker.debug \
    && objcopy --strip-debug --strip-unneeded \
        --add-gnu-debuglink=/out/taskbroker.debug /out/taskbroker

# --- debug symbols -----------------------------------------------------------
# Not part of the image: `docker build --target debug-symbols --output type=local,dest=symbols .`
# writes taskbroker.debug, which gdb finds next to the binary or through
# `set debug-file-directory`.
FROM scratch AS debug-symbols
COPY --from=builder /out/taskbroker.debug /taskbroker.debug

# --- runtime -----------------------------------------------------------------
FROM debian:bookworm-slim

# The binary needs glibc, libgcc_s and zlib (OpenSSL for librdkafka and
# rustls for PostgreSQL, workers and the gRPC server are built in), plus the
# system's CA bundle: Kafka, PostgreSQL and worker certificates from public
# CAs are verified against it when no CA file is configured.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates libgcc-s1 zlib1g \
    && rm -rf /var/lib/apt/lists/*

# A fixed numeric user, so Kubernetes can check runAsNonRoot and volumes can
# be prepared for it. /var/lib/taskbroker is the working directory and holds
# the embedded SQLite store when TASKBROKER_DATABASE_URL is unset: mount a
# volume there to keep it across container restarts.
RUN groupadd --system --gid 10001 taskbroker \
    && useradd --system --uid 10001 --gid taskbroker --home-dir /var/lib/taskbroker \
        --shell /usr/sbin/nologin taskbroker \
    && install -d -o taskbroker -g taskbroker -m 0750 /var/lib/taskbroker

COPY --from=builder /out/taskbroker /usr/local/bin/taskbroker

USER 10001:10001
WORKDIR /var/lib/taskbroker
ENV TASKBROKER_SQLITE_PATH=/var/lib/taskbroker/taskbroker.sqlite

# 50051: gRPC (ConsumerService, grpc.health.v1); 9090: /metrics, /health,
# /ready. Both are the TASKBROKER_GRPC_ADDR and TASKBROKER_METRICS_ADDR
# defaults.
EXPOSE 50051 9090

# `taskbroker healthcheck` asks the broker's own /health on the port of
# TASKBROKER_METRICS_ADDR, so the image needs no curl or wget.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["taskbroker", "healthcheck"]

# The broker stops cleanly on SIGTERM within TASKBROKER_SHUTDOWN_TIMEOUT_MS
# (30 s by default): give `docker stop` more than that (`--time 40`, or
# `stop_grace_period` in compose).
STOPSIGNAL SIGTERM
ENTRYPOINT ["taskbroker"]
CMD ["run"]
