# One image with the three daemons and the cflue command (Debian 12, as CI builds them).
# The k8s/ manifests run it as cflue:latest. (Not built in this project's CI, which has no
# container engine; the build steps are the same as scripts/build.)
FROM debian:12 AS build
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      build-essential cmake pkg-config libgrpc-dev protobuf-c-compiler libprotobuf-c-dev \
      protobuf-compiler grpc-proto libprotobuf-dev golang-github-gogo-googleapis-dev \
      libsqlite3-dev libjansson-dev libcurl4-openssl-dev \
      libpcre2-dev libyaml-dev libseccomp-dev libssl-dev libmicrohttpd-dev python3 && rm -rf /var/lib/apt/lists/*
COPY . /src
RUN cmake -S /src -B /build -DCMAKE_BUILD_TYPE=RelWithDebInfo \
 && cmake --build /build -j"$(nproc)" --target storaged toold toold-runner agentd cflue

FROM debian:12
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      libgrpc29 libprotobuf-c1 libsqlite3-0 libjansson4 libcurl4 libpcre2-8-0 libyaml-0-2 libseccomp2 libssl3 libmicrohttpd12 \
      ca-certificates bash bubblewrap ripgrep python3 tini && rm -rf /var/lib/apt/lists/*
COPY --from=build /build/storaged/storaged /build/toold/toold /build/toold/toold-runner \
                  /build/agentd/agentd /build/cli/cflue /usr/local/bin/
# toold finds toold-runner beside itself; each command's runner is a subreaper that kills
# what the command leaves behind. tini still reaps anything else when toold runs as PID 1.
ENTRYPOINT ["/usr/bin/tini", "--"]
