# Builds the fencegate binary and runs it on its embedded defaults, with no credential baked in
# (README, "Docker").
FROM rust:1.95-bookworm AS build
# The etcd store's gRPC client is generated at build time: store.kind = "etcd" works in the image.
RUN apt-get update && apt-get install -y --no-install-recommends protobuf-compiler && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# Dependencies first, in a layer of their own: a change to fencegate's sources does not rebuild
# them. The workspace members get empty targets for this step.
COPY Cargo.toml Cargo.lock ./
COPY client/Cargo.toml client/Cargo.toml
COPY bench/Cargo.toml bench/Cargo.toml
RUN mkdir -p src client/src client/examples bench/src \
 && echo 'fn main() {}' > src/main.rs && touch src/lib.rs \
 && touch client/src/lib.rs && mkdir -p client/src/bin && echo 'fn main() {}' > client/src/bin/fencegate-worker.rs \
 && echo 'fn main() {}' > client/src/bin/fencegate-lease.rs \
 && echo 'fn main() {}' > bench/src/main.rs \
 && cargo build --release --locked --features etcd --bin fencegate --bin fencegate-lease \
 && rm -rf src client bench
COPY . .
# The sources are newer than the placeholder build: only fencegate itself is compiled again.
RUN touch src/main.rs src/lib.rs client/src/lib.rs client/src/bin/fencegate-lease.rs \
 && cargo build --release --locked --features etcd --bin fencegate --bin fencegate-lease

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 fencegate \
 && useradd --system --uid 10001 --gid 10001 --home /var/lib/fencegate fencegate \
 && mkdir -p /var/lib/fencegate /etc/fencegate \
 && chown 10001:10001 /var/lib/fencegate
COPY --from=build /src/target/release/fencegate /usr/local/bin/fencegate
# The workers' tool: `docker run --entrypoint fencegate-lease ...` (README, "Docker").
COPY --from=build /src/target/release/fencegate-lease /usr/local/bin/fencegate-lease
COPY config/container.toml /etc/fencegate/fencegate.toml
# A numeric user, so that runtimes enforcing non-root can check it without /etc/passwd.
USER 10001:10001
WORKDIR /var/lib/fencegate
VOLUME /var/lib/fencegate
EXPOSE 9000 9001
HEALTHCHECK --interval=10s --timeout=6s --start-period=10s --retries=3 \
  CMD ["fencegate", "health", "--config", "/etc/fencegate/fencegate.toml"]
ENTRYPOINT ["fencegate"]
CMD ["serve", "--config", "/etc/fencegate/fencegate.toml"]
