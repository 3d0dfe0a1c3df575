# Warren: multi-stage build, small non-root runtime image.
#   docker build -t warren .
#   docker run -p 5672:5672 -p 15672:15672 -p 15692:15692 -v warren-data:/var/lib/warren warren
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin warren

FROM debian:bookworm-slim
RUN useradd --system --uid 999 --home-dir /var/lib/warren --shell /usr/sbin/nologin warren \
    && mkdir -p /var/lib/warren && chown warren:warren /var/lib/warren
COPY --from=build /src/target/release/warren /usr/local/bin/warren
USER warren
VOLUME ["/var/lib/warren"]
# AMQP, AMQPS (when a certificate is configured), management API, Prometheus.
EXPOSE 5672 5671 15672 15692
# The admin socket answers as soon as the broker serves clients.
HEALTHCHECK --interval=30s --timeout=10s --start-period=20s \
    CMD ["warren", "ctl", "--data-dir", "/var/lib/warren", "alarms"]
ENTRYPOINT ["warren", "server", "--data-dir", "/var/lib/warren"]
