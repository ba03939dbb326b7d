# Builds the fencegate binary and runs it on its embedded defaults.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin fencegate

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --home /var/lib/fencegate fencegate \
 && mkdir -p /var/lib/fencegate /etc/fencegate \
 && chown fencegate /var/lib/fencegate
COPY --from=build /src/target/release/fencegate /usr/local/bin/fencegate
COPY config/fencegate.toml /etc/fencegate/fencegate.toml
USER fencegate
WORKDIR /var/lib/fencegate
# The admin API listens on all interfaces here, so fencegate refuses to start until it is given
# a token: docker run -e FENCEGATE_SERVER__ADMIN_TOKEN=... (health checks need none).
ENV FENCEGATE_SERVER__LISTEN=0.0.0.0:9000 \
    FENCEGATE_SERVER__ADMIN_LISTEN=0.0.0.0:9001
VOLUME /var/lib/fencegate
EXPOSE 9000 9001
ENTRYPOINT ["fencegate"]
CMD ["serve", "--config", "/etc/fencegate/fencegate.toml"]
