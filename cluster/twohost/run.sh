#!/usr/bin/env bash
# Real two-host bring-up of cluster/local-twohost.yaml on one Linux machine (root only).
#
# Two network namespaces joined by a veth pair play the two machines, each with its
# own sshd, PID namespace, /tmp and home:
#   ss-target 10.77.0.1 (Ray head, specserve.io/role=target)
#   ss-draft  10.77.0.2 (Ray worker, specserve.io/role=draft)
# plus a veth from the root namespace (10.77.1.254) to ss-target (which routes on to
# ss-draft), so the launcher reaches both hosts over SSH like on a LAN.
# Then: ray up -> check_cluster.py on the head (phase 1 placement, phase 2 Serve if the
# app exists) -> ray down -> assert no Ray process is left -> remove everything (trap).
#
# Usage: cluster/twohost/run.sh [all|hosts-up|hosts-down]   (default: all)
# Env:
#   SPECSERVE_CHANNEL_DELAY_MS      added link delay in ms, exported to every Ray process
#                                   on both nodes (default 0; netem is not available)
#   SPECSERVE_TWOHOST_PHASE         1, 2 or auto (default: 2 when specserve.serve imports
#                                   and a serve config exists)
#   SPECSERVE_TWOHOST_SERVE_CONFIG  serve config for phase 2, relative to the repo
#                                   (default: deployments/two_node.yaml)
#   SPECSERVE_TWOHOST_MODELS        tiny (default): a tiny random target/draft pair from
#                                   make_tiny_models.py replaces the config's models;
#                                   config: keep the config's models (e.g. the demo pair).
#                                   Either way each side asks for 0.5 CPU (nodes have 1).
#   SPECSERVE_TWOHOST_KEEP=1        leave cluster and hosts up after the checks
#                                   (remove with hosts-down)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE=$REPO/cluster/twohost
CONFIG=cluster/local-twohost.yaml
STATE=/var/tmp/specserve-twohost     # also named in $CONFIG (key, token, node.env)
CLUSTER_NAME=specserve-twohost
HOSTS=(ss-target ss-draft)
declare -A IP=([ss-target]=10.77.0.1 [ss-draft]=10.77.0.2)
ROOT_IP=10.77.1.254
TARGET_UPLINK_IP=10.77.1.1
DELAY_MS=${SPECSERVE_CHANNEL_DELAY_MS:-0}
KEY=$STATE/id_ed25519
SSH_OPTS=(-i "$KEY" -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null
          -o LogLevel=ERROR -o BatchMode=yes -o ConnectTimeout=3)
export RAY_USAGE_STATS_ENABLED=0

log() { echo "[twohost $(date +%T)] $*" >&2; }
die() { log "FAILED: $*"; exit 1; }

need_tools() {
  [ "$(id -u)" = 0 ] || die "needs root (network namespaces, sshd)"
  local missing=()
  command -v ip >/dev/null || missing+=(iproute2)
  command -v unshare >/dev/null || missing+=(util-linux)
  [ -x /usr/sbin/sshd ] || missing+=(openssh-server)
  command -v ssh >/dev/null || missing+=(openssh-client)
  command -v rsync >/dev/null || missing+=(rsync)
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
  command -v ray >/dev/null || die "ray CLI not on PATH"
}

# Project-made state only: throwaway keys, token, per-host sshd config and shell rc.
make_state() {
  rm -rf "$STATE"
  mkdir -p "$STATE" /run/sshd
  chmod 700 "$STATE"
  ssh-keygen -q -t ed25519 -N '' -C specserve-twohost -f "$KEY"
  cp "$KEY.pub" "$STATE/authorized_keys"
  python3 -c 'import secrets; print(secrets.token_hex(32), end="")' > "$STATE/auth_token"
  chmod 600 "$STATE/auth_token"
  printf 'SPECSERVE_CHANNEL_DELAY_MS=%s\n' "$DELAY_MS" > "$STATE/node.env"
  local py_bin keep keep_tmp
  py_bin=$(dirname "$(python3 -c 'import sys; print(sys.executable)')")
  # Top-level entries of /root that the interpreter lives in must stay visible.
  keep=$(python3 - <<'EOF'
import os, sys
paths = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.executable)}
print("\n".join(sorted({p.split("/")[2] for p in paths if p.startswith("/root/")})))
EOF
)
  # A virtualenv under /tmp (e.g. inside a fresh clone there) stays visible at the same path
  # inside each host, whose own /tmp is private.
  keep_tmp=$(python3 - <<'EOF'
import os, sys
paths = {os.path.realpath(p) for p in (sys.prefix, os.path.dirname(os.path.realpath(sys.executable)))}
print("\n".join(sorted(p for p in paths if p.startswith("/tmp/") and os.path.isdir(p))))
EOF
)
  for h in "${HOSTS[@]}"; do
    local d=$STATE/$h
    mkdir -p "$d"
    ssh-keygen -q -t ed25519 -N '' -f "$d/ssh_host_ed25519_key"
    printf '%s\n' "$keep" > "$d/home_keep"
    printf '%s\n' "$keep_tmp" > "$d/tmp_keep"
    printf '%s\n' "export PATH=\"$py_bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\"" \
      > "$d/bashrc"
    cat > "$d/sshd_config" <<EOF
ListenAddress ${IP[$h]}
Port 22
HostKey $d/ssh_host_ed25519_key
PidFile none
AuthorizedKeysFile $STATE/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
MaxStartups 100:30:200
MaxSessions 100
Subsystem sftp internal-sftp
EOF
  done
}

net_up() {
  for h in "${HOSTS[@]}"; do ip netns add "$h"; ip -n "$h" link set lo up; done
  # The link between the two machines.
  ip link add ss-t0 netns ss-target type veth peer name ss-d0 netns ss-draft
  ip -n ss-target addr add 10.77.0.1/24 dev ss-t0
  ip -n ss-draft addr add 10.77.0.2/24 dev ss-d0
  ip -n ss-target link set ss-t0 up
  ip -n ss-draft link set ss-d0 up
  # The launcher's way in: root namespace -> ss-target, routed on to ss-draft.
  ip link add ss-root type veth peer name ss-t1 netns ss-target
  ip addr add "$ROOT_IP/24" dev ss-root
  ip link set ss-root up
  ip -n ss-target addr add "$TARGET_UPLINK_IP/24" dev ss-t1
  ip -n ss-target link set ss-t1 up
  ip route add 10.77.0.0/24 via "$TARGET_UPLINK_IP" dev ss-root
  ip netns exec ss-target sysctl -qw net.ipv4.ip_forward=1   # launcher -> draft, as on a LAN
  # Default routes only so that address auto-detection finds the namespace IPs.
  ip -n ss-target route add default via "$ROOT_IP"
  ip -n ss-draft route add default via 10.77.0.1
}

hosts_start() {
  for h in "${HOSTS[@]}"; do
    ip netns exec "$h" unshare --pid --fork --kill-child=SIGKILL --mount --propagation private \
      --mount-proc --uts bash "$HERE/host_init.sh" "$h" "$STATE/$h" \
      >>"$STATE/$h/init.log" 2>&1 &
    echo $! > "$STATE/$h/unshare.pid"
    disown $!   # its end (SIGKILL at teardown) is expected: no job-control notice
  done
  local deadline=$((SECONDS + 30))
  until ssh "${SSH_OPTS[@]}" root@10.77.0.1 true 2>/dev/null; do
    [ $SECONDS -lt $deadline ] || die "sshd on ss-target not reachable (see $STATE/ss-target/*.log)"
    sleep 0.5
  done
  until ip netns exec ss-target ssh "${SSH_OPTS[@]}" root@10.77.0.2 true 2>/dev/null; do
    [ $SECONDS -lt $deadline ] || die "sshd on ss-draft not reachable from ss-target"
    sleep 0.5
  done
  log "hosts up: ss-target $(ssh "${SSH_OPTS[@]}" root@10.77.0.1 hostname), ss-draft reachable from it"
}

# PIDs (root-namespace view) of Ray processes still running in a host.
ray_pids() {
  local pid
  for pid in $(ip netns pids "$1" 2>/dev/null); do
    if tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null \
        | grep -Eq 'raylet|gcs_server|ray::|/ray/|default_worker'; then
      echo "$pid"
    fi
  done
}

hosts_down() {
  local h pid
  for h in "${HOSTS[@]}"; do
    if [ -f "$STATE/$h/unshare.pid" ]; then
      kill "$(cat "$STATE/$h/unshare.pid")" 2>/dev/null || true
    fi
  done
  sleep 0.5
  for h in "${HOSTS[@]}"; do
    for pid in $(ip netns pids "$h" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$h" 2>/dev/null || true
  done
  ip link del ss-root 2>/dev/null || true
  rm -f "/tmp/ray/cluster-$CLUSTER_NAME.state" "/tmp/ray/cluster-$CLUSTER_NAME.lock"
  # `ray down` caches the resolved config in /tmp/ray-config-<hash>; drop ours.
  grep -l "\"$CLUSTER_NAME\"" /tmp/ray-config-* 2>/dev/null | xargs -r rm -f || true
  # No mount point is ever made under $STATE (host_init.sh uses tmpfs), but check anyway.
  if grep -q " $STATE" /proc/self/mountinfo; then
    log "not removing $STATE: something is mounted under it"
  else
    rm -rf "$STATE"
  fi
}

CLUSTER_STARTED=0
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ "${SPECSERVE_TWOHOST_KEEP:-0}" = 1 ]; then
    log "SPECSERVE_TWOHOST_KEEP=1: leaving hosts up; remove with: $0 hosts-down"
    exit $rc
  fi
  if [ $CLUSTER_STARTED = 1 ]; then
    log "cleanup: ray down"
    (cd "$REPO" && timeout 180 ray down -y "$CONFIG" >"$STATE/ray-down-cleanup.log" 2>&1) || true
  fi
  hosts_down
  log "hosts removed"
  exit $rc
}

pick_phase() {
  local want=${SPECSERVE_TWOHOST_PHASE:-auto} cfg=${SPECSERVE_TWOHOST_SERVE_CONFIG:-}
  if [ -z "$cfg" ]; then
    [ -f "$REPO/deployments/two_node.yaml" ] && cfg=deployments/two_node.yaml
  fi
  SERVE_CONFIG=$cfg
  if [ "$want" = 1 ]; then PHASE=1; return; fi
  if (cd "$REPO" && python3 -c "import specserve.serve" 2>/dev/null) && [ -n "$cfg" ]; then
    PHASE=2
  else
    [ "$want" = 2 ] && die "phase 2 asked for, but specserve.serve or a serve config is missing"
    PHASE=1
  fi
}

# Phase 2: the serve config as the head will read it (/var/tmp is shared by both hosts,
# like an NFS mount). Each side asks for 0.5 CPU, as the nodes have 1 and the router
# needs a little; with the tiny pair, the models are replaced too.
prepare_serve_config() {
  local models=""
  if [ "${SPECSERVE_TWOHOST_MODELS:-tiny}" = tiny ]; then
    python3 "$HERE/make_tiny_models.py" "$STATE/models" >"$STATE/models.log" 2>&1 \
      || { cat "$STATE/models.log" >&2; die "make_tiny_models.py"; }
    models=$STATE/models
  fi
  SERVE_PATH=$STATE/serve.yaml
  python3 - "$REPO/$SERVE_CONFIG" "$SERVE_PATH" "$models" <<'EOF'
import sys, yaml
src, dst, models = sys.argv[1:]
config = yaml.safe_load(open(src))
for app in config["applications"]:
    args = app.setdefault("args", {})
    # Fixed k: the check asserts the remote draft drafted, which adaptive k may rightly decline
    # for a tiny random pair (a draft step costs about what a target step does).
    args["speculation"] = {**(args.get("speculation") or {}), "adaptive": False}
    for side in ("target", "draft"):
        args[side] = {**(args.get(side) or {}), "num_cpus": 0.5}
        if models:
            args[side]["model"] = f"{models}/{side}"
yaml.safe_dump(config, open(dst, "w"), sort_keys=False)
EOF
  log "serve config: $SERVE_CONFIG -> $SERVE_PATH (models: ${SPECSERVE_TWOHOST_MODELS:-tiny})"
}

run_all() {
  need_tools
  hosts_down            # leftovers of an interrupted run
  trap cleanup EXIT INT TERM
  make_state
  net_up
  hosts_start
  pick_phase
  log "phase $PHASE, SPECSERVE_CHANNEL_DELAY_MS=$DELAY_MS"
  [ "$PHASE" = 2 ] && prepare_serve_config

  cd "$REPO"
  local t0=$SECONDS
  CLUSTER_STARTED=1
  log "ray up -y $CONFIG"
  timeout 600 ray up -y --no-config-cache --disable-usage-stats "$CONFIG" \
    >"$STATE/ray-up.log" 2>&1 || { tail -n 40 "$STATE/ray-up.log" >&2; die "ray up"; }
  log "ray up done in $((SECONDS - t0)) s"

  local check="python3 ~/specserve/cluster/twohost/check_cluster.py"
  check+=" --target-ip 10.77.0.1 --draft-ip 10.77.0.2 --expect-env SPECSERVE_CHANNEL_DELAY_MS=$DELAY_MS"
  [ "$PHASE" = 2 ] && check+=" --serve $SERVE_PATH --timeout 300"
  t0=$SECONDS
  local check_rc=0
  timeout 900 ray exec --no-config-cache "$CONFIG" "$check" >"$STATE/check.log" 2>&1 || check_rc=$?
  local result
  # ray exec runs under `ssh -tt`: strip CRs and colour codes before the marker.
  result=$(tr -d '\r' < "$STATE/check.log" | grep -ao 'TWOHOST_RESULT .*' | tail -n 1 || true)
  if [ $check_rc != 0 ] || [ -z "$result" ]; then
    tail -n 60 "$STATE/check.log" >&2
    ray exec "$CONFIG" 'tail -n 40 /tmp/ray/session_latest/logs/monitor.*' 2>/dev/null >&2 || true
    die "cluster checks (rc=$check_rc)"
  fi
  echo "$result"
  log "checks passed in $((SECONDS - t0)) s"
  if [ "${SPECSERVE_TWOHOST_KEEP:-0}" = 1 ]; then
    log "cluster left up: ray exec $CONFIG '...'; then $0 hosts-down"
    return
  fi

  t0=$SECONDS
  log "ray down -y $CONFIG"
  timeout 300 ray down -y "$CONFIG" >"$STATE/ray-down.log" 2>&1 \
    || { tail -n 40 "$STATE/ray-down.log" >&2; die "ray down"; }
  CLUSTER_STARTED=0
  [ -z "$(ray_pids ss-target)" ] || die "Ray processes left on the head after ray down"
  # With the local provider `ray down` runs `ray stop` on the head only: the worker's
  # raylet exits once its GCS is gone (~60 s), its log_monitor never does. So, as
  # cluster/README.md tells users, stop Ray on the worker too.
  log "after ray down, Ray processes on ss-draft: $(ray_pids ss-draft | wc -l); ray stop there"
  ssh "${SSH_OPTS[@]}" root@10.77.0.2 'bash -lc "ray stop"' >"$STATE/ray-stop-draft.log" 2>&1 \
    || { cat "$STATE/ray-stop-draft.log" >&2; die "ray stop on ss-draft"; }
  local deadline=$((SECONDS + 30)) left
  while :; do
    left=""
    for h in "${HOSTS[@]}"; do
      [ -n "$(ray_pids "$h")" ] && left+=" $h"
    done
    [ -z "$left" ] && break
    if [ $SECONDS -ge $deadline ]; then
      for h in $left; do
        for pid in $(ray_pids "$h"); do log "$h still runs: $(tr '\0' ' ' < /proc/$pid/cmdline | cut -c1-120)"; done
      done
      die "Ray processes left after teardown on:$left"
    fi
    sleep 1
  done
  log "teardown done, no Ray process left on either host after $((SECONDS - t0)) s"
  echo "TWOHOST_OK phase=$PHASE"
}

case "${1:-all}" in
  all) run_all ;;
  hosts-up)
    need_tools; hosts_down; make_state; net_up; hosts_start
    log "hosts up; ray up -y $CONFIG from $REPO; remove with: $0 hosts-down" ;;
  hosts-down) hosts_down ;;
  *) echo "usage: $0 [all|hosts-up|hosts-down]" >&2; exit 2 ;;
esac
