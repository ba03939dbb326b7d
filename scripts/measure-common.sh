# What the measuring scripts (cpu-per-request, instructions-per-request,
# memory-per-connection) share; sourced by them, not run. It makes the scratch directory
# `$work`, kills the processes listed in `pids` and removes `$work` on exit, and gives:
#   ready_line FILE PATTERN [SECONDS]   the first line of FILE matching PATTERN, waited for
#   start_upstream                      the bench's in-memory upstream; sets `upstream`
#   store_table [REDIS_URL]             sets `store` to fencegate's [store] table: embedded
#                                       in $work, or the Redis at REDIS_URL (the upstream's
#                                       bucket made first)
#   fencegate_config STORE [SERVER]     fencegate's config for the measurements, in
#                                       $work/fencegate.toml: STORE is the [store] table,
#                                       SERVER extra lines of [server]; a Redis store is
#                                       marked new with `$bin init-store`
# Everything listens on 127.0.0.1 ports of its own choosing. Needs `bench` set.

work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

ready_line() {
  local tries=$((${3:-10} * 10))
  for _ in $(seq "$tries"); do
    if line=$(grep -m1 "$2" "$1" 2>/dev/null); then
      echo "$line"
      return 0
    fi
    sleep 0.1
  done
  echo "no line matching '$2' in $1 within ${3:-10} s:" >&2
  cat "$1" >&2
  return 1
}

start_upstream() {
  "$bench" upstream --listen 127.0.0.1:0 >"$work/upstream.log" 2>&1 &
  pids+=($!)
  upstream=$(ready_line "$work/upstream.log" "listening on" | awk '{print $NF}')
}

store_table() {
  if [[ -n ${1:-} ]]; then
    # A shared store starts only once its start-up probe found the upstream's bucket.
    curl -fsS -X PUT "http://$upstream/bench" >/dev/null
    store=$(printf '[store]\nkind = "redis"\nurl = "%s"\n' "$1")
  else
    store=$(printf '[store]\nkind = "embedded"\npath = "%s"\n' "$work/fences")
  fi
}

# The credential is an issuer: the accepted-lease scenario grants a lease first, and its
# objects (prefix lease-) belong to the lease's resource.
fencegate_config() {
  cat >"$work/fencegate.toml" <<EOF
[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
${2:-}

$1

[upstream]
kind = "s3"
endpoint = "http://$upstream"
region = "us-east-1"
access_key_id = "bench-upstream"
secret_access_key = "bench-upstream-secret"
probe_bucket = "bench"

[[credentials]]
access_key_id = "fencegate-dev"
secret_access_key = "fencegate-dev-secret"
role = "issuer"

[[fencing.rules]]
bucket = "bench"
prefix = "lease-"
resource = "bench:lease"

[log]
level = "warn"
EOF
  # A shared store is marked new, as an operator does once when making it.
  "${bin:-target/release/fencegate}" init-store --config "$work/fencegate.toml" >/dev/null
}
