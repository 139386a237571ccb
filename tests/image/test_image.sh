#!/usr/bin/env bash
# The container image, built and run the way an operator would: a Debian 12 base made offline
# (debootstrap --variant=minbase bookworm, slimmed of documentation and locales, podman
# import), the repository's Dockerfile built on it with podman, then the three daemons started
# as three containers from that image (toold with the bwrap driver where the host allows it)
# and the README's example run through them with the offline model: the coder agent fixes
# examples/project, whose tests fail before and pass after. Also checks that the image is
# under 150 MB and runs as a non-root user, and that each daemon stops cleanly (exit 0) on
# SIGTERM through tini.
#
# Exit 77 (CTest: skipped) where podman or debootstrap cannot run here, saying why; with
# CFLUE_REQUIRE_PODMAN=1 (CI on a machine that runs containers) that is a failure instead.
# Environment: CFLUE_IMAGE_BASE (an existing Debian 12 image to build on, instead of making
# one), CFLUE_DEBIAN_MIRROR (default http://deb.debian.org/debian), CFLUE_IMAGE_KEEP=1 (keep
# the images afterwards; the base is kept anyway and reused while less than a day old).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
max_bytes=$((150 * 1000 * 1000))
image=localhost/cflue-test:$$
base="${CFLUE_IMAGE_BASE:-}"
mirror="${CFLUE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"

skip() {
  if [ "${CFLUE_REQUIRE_PODMAN:-0}" = 1 ]; then
    echo "FAIL: $* (CFLUE_REQUIRE_PODMAN=1: this machine is expected to run containers)" >&2
    exit 1
  fi
  echo "SKIPPED: $*" >&2
  exit 77
}
say() { echo "== $(date +%T) $*"; }

command -v podman >/dev/null || skip "podman is not installed (scripts/setup installs it)"
[ "$(id -u)" = 0 ] || skip "the image test runs rootful podman: run it as root"
podman info >/dev/null 2>&1 || skip "podman cannot run here: $(podman info 2>&1 | tail -1)"

work="$(mktemp -d /tmp/cflue-image.XXXXXX)"
containers=()
cleanup() {
  rc=$?
  for c in "${containers[@]}"; do
    if [ "$rc" != 0 ]; then
      echo "---- logs of $c" >&2
      podman logs "$c" 2>&1 | tail -40 >&2 || true
    fi
    podman rm -f -t 2 "$c" >/dev/null 2>&1 || true
  done
  [ -z "${model_pid:-}" ] || kill "$model_pid" 2>/dev/null || true
  if [ "$rc" != 0 ] && [ -f "$work/model.log" ]; then
    echo "---- offline model log" >&2
    tail -20 "$work/model.log" >&2
  fi
  [ "${CFLUE_IMAGE_KEEP:-0}" = 1 ] || podman rmi -f "$image" >/dev/null 2>&1 || true
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT

# 1. The base: Debian 12 minbase, made with debootstrap and imported (no registry needed).
if [ -z "$base" ]; then
  base=localhost/cflue-base:bookworm
  created="$(podman image inspect --format '{{.Created.Unix}}' "$base" 2>/dev/null || echo 0)"
  if [ $(($(date +%s) - created)) -gt 86400 ]; then
    command -v debootstrap >/dev/null || skip "debootstrap is not installed (scripts/setup installs it)"
    say "debootstrap --variant=minbase bookworm ($mirror)"
    rootfs="$work/rootfs"
    debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 || {
      tail -5 "$work/debootstrap.log" >&2
      skip "debootstrap could not make a base from $mirror"
    }
    # As Debian's -slim images: no documentation, man pages or translations, now or later;
    # the package lists and downloaded packages are not part of the base either.
    printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-include /usr/share/doc/*/copyright' \
      'path-exclude /usr/share/man/*' 'path-exclude /usr/share/info/*' \
      'path-exclude /usr/share/locale/*' 'path-exclude /usr/share/lintian/*' \
      >"$rootfs/etc/dpkg/dpkg.cfg.d/slim"
    find "$rootfs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
    rm -rf "$rootfs"/usr/share/{man,info,locale,lintian}/* "$rootfs"/var/lib/apt/lists/* \
      "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/log/*.log
    # the point releases and security updates, as the official images have them
    cat >"$rootfs/etc/apt/sources.list" <<SOURCES
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb ${mirror%/debian}/debian-security bookworm-security main
SOURCES
    tar -C "$rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$base" >/dev/null
    rm -rf "$rootfs"
  fi
  say "base $base: $(podman image inspect --format '{{.Size}}' "$base") bytes"
fi

# podman's defaults cannot start containers on every host: podman_runtime finds a runtime that can.
# shellcheck source=tests/image/podman_runtime.sh
. "$root/tests/image/podman_runtime.sh"
podman_runtime "$base" "$work" || skip "podman cannot start a container here: $(tail -1 "$work/probe.log")"
[ -z "$podman_runtime_note" ] || say "$podman_runtime_note"

# 2. The image, from the repository's Dockerfile.
say "podman build -t $image (BASE=$base)"
podman build --network host --build-arg BASE="$base" -t "$image" -f "$root/Dockerfile" "$root" \
  >"$work/build.log" 2>&1 || { tail -40 "$work/build.log" >&2; echo "FAIL: the image did not build" >&2; exit 1; }
grep 'runtime packages:' "$work/build.log" | tail -1
size="$(podman image inspect --format '{{.Size}}' "$image")"
user="$(podman image inspect --format '{{.Config.User}}' "$image")"
say "image size $size bytes ($((size / 1000000)) MB, limit $((max_bytes / 1000000)) MB), user $user"
[ "$size" -lt "$max_bytes" ] || { echo "FAIL: the image is $size bytes, over $max_bytes" >&2; exit 1; }
uid="$(podman run --rm "$image" id -u)"
[ "$uid" != 0 ] || { echo "FAIL: the image runs as root" >&2; exit 1; }
for b in storaged toold agentd cflue; do
  podman run --rm "$image" "$b" --help >/dev/null 2>&1 ||
    { echo "FAIL: $b --help does not run in the image" >&2; podman run --rm "$image" "$b" --help >&2; exit 1; }
done
say "every binary runs in the image as uid $uid"

# 3. The README example through three containers (host network, loopback ports).
ports=($(/usr/bin/python3 - <<'PY'
import socket
socks = [socket.socket() for _ in range(5)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
))
agentd_addr=127.0.0.1:${ports[0]} storaged_addr=127.0.0.1:${ports[1]} toold_addr=127.0.0.1:${ports[2]}
metrics_addr=127.0.0.1:${ports[4]}
mkdir -p "$work/store" "$work/workspaces" "$work/agents"
cp -r "$root/examples/project" "$work/workspaces/example"
cp "$root"/examples/agents/*.md "$work/agents/"
sed -i "s|127.0.0.1:7102|$toold_addr|" "$work/agents/coder.md"
chown -R "$uid:$uid" "$work/store" "$work/workspaces"
if (cd "$work/workspaces/example" && /usr/bin/python3 -B -m unittest >/dev/null 2>&1); then
  echo "FAIL: the example project's tests pass before the agent ran" >&2
  exit 1
fi
/usr/bin/python3 "$root/tests/fake_model/fake_model.py" --port "${ports[3]}" >"$work/model.log" 2>&1 &
model_pid=$!

run() { # NAME ARGS...: a daemon as a detached container
  local name="cflue-test-$1-$$"
  shift
  containers+=("$name") # cleaned up (and its logs shown) even if it never starts
  podman run -d --name "$name" --network host --stop-timeout 20 "$@" >/dev/null
}
run storaged -v "$work/store:/var/lib/cflue/store" "$image" \
  storaged --listen "$storaged_addr" --db /var/lib/cflue/store/store.db --metrics-listen "$metrics_addr"
# toold with the bwrap driver where this host lets bubblewrap make user namespaces, under the
# exception docs/security.md gives its container: a seccomp profile that allows them
# (unconfined here) and an unmasked /proc (a masked one forbids the sandbox's own /proc mount).
if command -v bwrap >/dev/null && bwrap --unshare-all --unshare-user --ro-bind / / true 2>/dev/null; then
  toold_opts=(--security-opt seccomp=unconfined --security-opt systempaths=unconfined)
  driver=bwrap
else
  toold_opts=()
  driver=local
  say "bubblewrap cannot make user namespaces on this host: toold runs with the local driver"
fi
run toold "${toold_opts[@]}" -v "$work/workspaces:/var/lib/cflue/workspaces" "$image" \
  toold --listen "$toold_addr" --root /var/lib/cflue/workspaces --driver "$driver"
run agentd -v "$work/agents:/etc/cflue/agents:ro" \
  -e ANTHROPIC_BASE_URL="http://127.0.0.1:${ports[3]}" -e ANTHROPIC_API_KEY=offline-demo "$image" \
  agentd --listen "$agentd_addr" --store "$storaged_addr" --agents /etc/cflue/agents
agentd_c="cflue-test-agentd-$$"
for addr in "$storaged_addr" "$toold_addr" "$agentd_addr"; do
  for i in $(seq 150); do
    podman exec "$agentd_c" cflue health "$addr" readiness >/dev/null 2>&1 && break
    [ "$i" = 150 ] && { echo "FAIL: $addr never became ready" >&2; exit 1; }
    sleep 0.2
  done
done
# /metrics: the image holds the libmicrohttpd the daemons load for it (dlopened-libraries)
/usr/bin/python3 - "$metrics_addr" <<'PY' || { echo "FAIL: storaged does not serve /metrics in the image" >&2; exit 1; }
import sys, urllib.request
text = urllib.request.urlopen("http://%s/metrics" % sys.argv[1], timeout=10).read().decode()
assert "# TYPE cflue_" in text, text[:500]
PY
say "three daemons ready in containers (toold's driver: $driver), storaged serves /metrics; cflue submit --agent coder"
podman exec "$agentd_c" cflue submit --agentd "$agentd_addr" --agent coder \
  "The tests of this project fail. Find the bug, fix it, and show that the tests pass." \
  | tee "$work/submit.log" | tail -15
(cd "$work/workspaces/example" && /usr/bin/python3 -B -m unittest) >"$work/after.log" 2>&1 ||
  { cat "$work/after.log" >&2; echo "FAIL: the example's tests still fail after the agent" >&2; exit 1; }
say "the example project's tests pass after the agent: $(tail -1 "$work/after.log")"

# 4. SIGTERM through tini: each daemon stops on its own, with exit 0 (agentd first).
for ((i = ${#containers[@]} - 1; i >= 0; i--)); do
  c="${containers[i]}"
  podman stop "$c" >/dev/null
  code="$(podman inspect --format '{{.State.ExitCode}}' "$c")"
  [ "$code" = 0 ] || { echo "FAIL: $c exited $code on SIGTERM" >&2; exit 1; }
done
say "every daemon stopped on SIGTERM with exit 0"
echo "PASS"
