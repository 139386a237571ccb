# One image with the three daemons, toold's runner and the cflue command.
#
#   podman build -t cflue:0.1.0 .          (or docker build)
#   podman build --build-arg BASE=localhost/debian-minbase:bookworm -t cflue:dev .
#   podman build --build-arg SANDBOX_PACKAGES="python3 nodejs git" -t cflue:node .
#
# BASE is any Debian 12 image: debian:bookworm-slim from a registry, or a base made offline
# with `debootstrap --variant=minbase bookworm` and `podman import` (tests/image/test_image.sh
# does that). Two stages: the first builds with Debian's -dev packages; the second holds only
# the runtime libraries the binaries link or load (found with ldd, the build's
# dlopened-libraries and dpkg in the first stage, so the list cannot go stale), bubblewrap and ripgrep for toold, tini, and SANDBOX_PACKAGES: what
# the agents' commands need inside a sandbox (default python3, which the example project's
# tests run with; Python's compiled caches, its own tests, IDLE, pydoc's data, ensurepip and
# lib2to3 are left out, so a command compiles the modules it imports as it runs). It runs as
# the unprivileged user cflue (uid and gid 10001). Documentation, man pages and translations
# are not installed, the way Debian's -slim images leave them out. docs/operations.md has the
# image's size and how it is tested.
ARG BASE=debian:bookworm-slim

FROM ${BASE} AS build
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      build-essential cmake pkg-config libgrpc-dev protobuf-c-compiler libprotobuf-c-dev \
      protobuf-compiler grpc-proto libprotobuf-dev golang-github-gogo-googleapis-dev \
      libsqlite3-dev libjansson-dev libcurl4-openssl-dev libpcre2-dev libyaml-dev \
      libseccomp-dev libssl-dev libmicrohttpd-dev musl-tools python3 \
 && rm -rf /var/lib/apt/lists/*
COPY . /src
RUN cmake -S /src -B /build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCFLUE_TESTS=OFF >/dev/null \
 && cmake --build /build -j"$(nproc)" --target storaged toold toold_runner agentd cflue \
 && mkdir -p /out/bin \
 && for b in storaged/storaged toold/toold toold/toold-runner agentd/agentd cli/cflue; do \
      install -s -m 0755 "/build/$b" /out/bin/; \
    done \
 && for lib in $( (ldd /out/bin/* | awk '$2 == "=>" && $3 ~ /^\// {print $3}'; \
                   cat /build/dlopened-libraries) | sort -u); do \
      dpkg -S "$lib" 2>/dev/null || dpkg -S "$(realpath "$lib")"; \
    done | cut -d: -f1 | sort -u >/out/runtime-packages \
 && for lib in $(cat /build/dlopened-libraries); do \
      dpkg -S "$(realpath "$lib")" >/dev/null || { echo "no package holds $lib" >&2; exit 1; }; \
    done \
 && echo "runtime packages: $(tr '\n' ' ' </out/runtime-packages)"

FROM ${BASE}
ARG DEBIAN_FRONTEND=noninteractive
ARG SANDBOX_PACKAGES=python3
COPY --from=build /out/runtime-packages /tmp/runtime-packages
# Keep documentation, man pages and translations out of every package installed from here on
# (copyright files stay), as Debian's -slim images do.
RUN printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-include /usr/share/doc/*/copyright' \
      'path-exclude /usr/share/man/*' 'path-exclude /usr/share/info/*' \
      'path-exclude /usr/share/locale/*' 'path-exclude /usr/share/lintian/*' \
      >/etc/dpkg/dpkg.cfg.d/cflue-slim \
 && apt-get update \
 && apt-get install -y --no-install-recommends $(cat /tmp/runtime-packages) \
      ca-certificates bubblewrap ripgrep tini ${SANDBOX_PACKAGES} \
 && find /usr/lib -name __pycache__ -prune -exec rm -rf {} + \
 && rm -rf /usr/lib/python3*/test /usr/lib/python3*/idlelib /usr/lib/python3*/pydoc_data \
      /usr/lib/python3*/ensurepip /usr/lib/python3*/lib2to3 \
 && apt-get clean \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log \
      /tmp/runtime-packages \
 && groupadd --system --gid 10001 cflue \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/cflue --shell /usr/sbin/nologin cflue \
 && install -d -o cflue -g cflue -m 0750 /var/lib/cflue /var/lib/cflue/workspaces
COPY --from=build /out/bin/ /usr/local/bin/
USER 10001:10001
WORKDIR /var/lib/cflue
# toold finds toold-runner beside itself; each command's runner is a subreaper that kills
# what the command leaves behind. tini still reaps anything else when toold runs as PID 1.
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["cflue", "--help"]
