#!/usr/bin/env bash
# The README's two commands on a fresh Debian 12 machine: a container of a minbase made by
# debootstrap (the image test's base, localhost/cflue-base:bookworm, made by
# tests/image/test_image.sh when absent), holding a copy of the committed tree (git archive
# HEAD) and nothing else, runs `scripts/run` and then `scripts/test` as root, the way a new user
# would. Not part of CI (scripts/test alone takes CI's plain stage's time); run it on demand:
#
#   tests/image/fresh_machine.sh [run|test|both]   (default both)
#
# The container gets the host's network (Debian's mirror and the npm registry), an
# unconfined seccomp profile and an unmasked /proc so that bubblewrap can make its sandboxes
# there as on a machine (the escape suite then runs instead of skipping), and the host's
# open-file limit; the host's own certificate authorities in /usr/local/share/ca-certificates
# are trusted inside too. Its output is kept in $CFLUE_FRESH_LOG (default /tmp/cflue-fresh-<what>.log).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
what="${1:-both}"
base=localhost/cflue-base:bookworm
log="${CFLUE_FRESH_LOG:-/tmp/cflue-fresh-$what.log}"
command -v podman >/dev/null || { echo "fresh_machine: podman is not installed" >&2; exit 2; }
podman image exists "$base" || {
  echo "fresh_machine: no $base yet: run tests/image/test_image.sh once to make it" >&2
  exit 2
}
case "$what" in
  run) steps='scripts/run' ;;
  test) steps='scripts/test' ;;
  both) steps='scripts/run && scripts/test' ;;
  *) echo "usage: tests/image/fresh_machine.sh [run|test|both]" >&2; exit 2 ;;
esac
# the limits podman's defaults ask for cannot be given where root lacks CAP_SYS_RESOURCE
ulimits=(--ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit nproc=8192:8192)
work="$(mktemp -d /tmp/cflue-fresh.XXXXXX)"
trap 'rm -rf "$work"' EXIT
# shellcheck source=tests/image/podman_runtime.sh
. "$root/tests/image/podman_runtime.sh"
podman_runtime "$base" "$work" || {
  echo "fresh_machine: podman cannot start a container here: $(tail -1 "$work/probe.log")" >&2
  exit 2
}
[ -z "$podman_runtime_note" ] || echo "== $podman_runtime_note"
# a site's own certificate authorities (a proxy's, say) are trusted inside as on the host: the
# container's ca-certificates picks them up when scripts/setup installs it
local_ca=()
compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null &&
  local_ca=(-v /usr/local/share/ca-certificates:/usr/local/share/ca-certificates:ro)
name="cflue-fresh-$$"
echo "== a fresh Debian 12 container ($base) runs: $steps   (log: $log)"
git -C "$root" archive --format=tar --prefix=cflue/ HEAD |
  podman run --rm -i --name "$name" --network host "${ulimits[@]}" \
    --security-opt seccomp=unconfined --security-opt systempaths=unconfined \
    ${local_ca[@]+"${local_ca[@]}"} -e DEBIAN_FRONTEND=noninteractive "$base" \
    bash -c "tar -C /root -x && cd /root/cflue && ($steps)" 2>&1 | tee "$log" | tail -60 &&
  rc=0 || rc=${PIPESTATUS[1]}
echo "== fresh machine: $steps exited $rc"
exit "$rc"
