# podman_runtime.sh - sourced by test_image.sh and fresh_machine.sh.
# shellcheck shell=bash
#
# podman_runtime IMAGE DIR: makes podman able to start a container of IMAGE on this host.
# Hosts whose root lacks CAP_SYS_RESOURCE cannot give a container podman's default limits (1M
# open files), and crun refuses a cgroup v1 host with an empty v2 hierarchy mounted: where a
# plain run fails, it writes DIR/containers.conf (runc, the host's own open-file limit, 8192
# processes) and exports CONTAINERS_CONF when a run works with it. Returns 0 when containers
# start (podman_runtime_note then says what was changed, or is empty), 1 when they cannot
# (the reason is the last line of DIR/probe.log).
podman_runtime() {
  local image="$1" dir="$2"
  podman_runtime_note=""
  podman run --rm "$image" true >"$dir/probe.log" 2>&1 && return 0
  cat >"$dir/containers.conf" <<CONF
[containers]
default_ulimits = ["nofile=$(ulimit -Hn):$(ulimit -Hn)", "nproc=8192:8192"]
[engine]
runtime = "$(command -v runc || echo runc)"
CONF
  CONTAINERS_CONF="$dir/containers.conf" podman run --rm "$image" true >>"$dir/probe.log" 2>&1 ||
    return 1
  export CONTAINERS_CONF="$dir/containers.conf"
  # shellcheck disable=SC2034 # read by the scripts that source this one
  podman_runtime_note="podman's defaults cannot start a container here ($(head -1 "$dir/probe.log")); using runc with nofile=$(ulimit -Hn), nproc=8192"
}
