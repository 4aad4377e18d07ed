#!/usr/bin/env bash
# PID 1 of one two-host "machine" (started by run.sh inside its network namespace,
# under `unshare --pid --mount --uts`): own hostname, private /tmp (so /tmp/ray is
# per host), a tmpfs home that keeps only ~/.pyenv, then sshd. Everything started
# over SSH lives in this PID namespace and dies with it. A virtualenv of the launcher that
# lives under /tmp (tmp_keep) is carried over into the private /tmp.
set -euo pipefail
name=$1   # ss-target | ss-draft
dir=$2    # /var/tmp/specserve-twohost/<name>

hostname "$name"
# Paths under /tmp that must survive (the launcher's virtualenv): held on /run (a tmpfs) while
# /tmp is replaced, then moved back to where they were.
tmp_keep=()
i=0
while read -r path; do
  [ -n "$path" ] || continue
  mkdir -p "/run/specserve-keep/$i"
  mount --rbind "$path" "/run/specserve-keep/$i"
  tmp_keep+=("$path")
  i=$((i + 1))
done < <(cat "$dir/tmp_keep" 2>/dev/null || true)
mount -t tmpfs -o size=2g,mode=1777 "$name-tmp" /tmp
i=0
for path in "${tmp_keep[@]}"; do
  mkdir -p "$path"
  mount --move "/run/specserve-keep/$i" "$path"
  i=$((i + 1))
done

# Private home: a tmpfs over root's home, with the entries of it that hold the launcher's Python (and Ray) moved in.
# No mount point is ever made on disk, so removing the state directory is always safe.
keep=()
while read -r sub; do
  [ -n "$sub" ] || continue
  mkdir -p "/tmp/.keep/$sub"
  mount --rbind "/root/$sub" "/tmp/.keep/$sub"
  keep+=("$sub")
done < "$dir/home_keep"
mount -t tmpfs -o size=1g,mode=0700 "$name-home" /root
for sub in "${keep[@]}"; do
  mkdir -p "/root/$sub"
  mount --move "/tmp/.keep/$sub" "/root/$sub"
done
cp "$dir/bashrc" /root/.bashrc
cp "$dir/bashrc" /root/.profile

/usr/sbin/sshd -D -e -f "$dir/sshd_config" 2>>"$dir/sshd.log" &
wait
