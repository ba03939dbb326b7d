#!/bin/sh
# A worker under a Redis lease (SET NX PX, its token an INCR counter): docs/leases.md,
# "Tokens issued elsewhere", the Redis functions and then the shell loop, exactly as the page has
# them (tests/python/test_lease_recipes.py checks that they agree, and runs them).
#
#   RESOURCE=job:invoices TTL_MS=10000 sh redis-lease.sh write:invoices.txt=invoices.txt sleep:5000

redis() { timeout 2 redis-cli "$@"; }
grant() {
  redis EVAL "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
                return redis.call('INCR', KEYS[2]) end
              return false" 2 "lease:$RESOURCE" "fence:$RESOURCE" "$HOLDER" "$TTL_MS"
}
renew() {
  redis EVAL "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
              return 0" 1 "lease:$RESOURCE" "$HOLDER" "$TTL_MS"
}
release() {
  redis EVAL "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
              return 0" 1 "lease:$RESOURCE" "$HOLDER" >/dev/null
}
behind() {  # Redis lost the counter: move it up to the fence, so the next grant is above it
  redis EVAL "if tonumber(redis.call('GET', KEYS[1]) or '0') < tonumber(ARGV[1]) then
                redis.call('SET', KEYS[1], ARGV[1]) end
              return 1" 1 "fence:$RESOURCE" "$1" >/dev/null
}

S3=http://127.0.0.1:9000
RESOURCE=${RESOURCE:-job:invoices} HOLDER=${HOLDER:-worker-$$} TTL_MS=${TTL_MS:-10000}
WAIT_MS=${WAIT_MS:-0} BUCKET=${BUCKET:-reports}
KEYS="${AWS_ACCESS_KEY_ID:-fencegate-dev}:${AWS_SECRET_ACCESS_KEY:-fencegate-dev-secret}"
STATE=$(mktemp -d) HEARTBEAT=
trap '[ -z "$HEARTBEAT" ] || kill "$HEARTBEAT" 2>/dev/null; rm -rf "$STATE"' EXIT
now_ms() { date +%s%3N; }
lost() { [ -e "$STATE/lost" ] || [ "$(now_ms)" -ge "$(cat "$STATE/deadline")" ]; }
stop() { echo "lease_lost reason=$(cat "$STATE/lost" 2>/dev/null || echo deadline)"; exit 5; }

# 1. Take the lease (waiting up to WAIT_MS) and register its token: from that answer on,
#    fencegate refuses every older token on RESOURCE. The local deadline is TTL after the
#    sending of the grant, so the holder gives up before the issuer frees the lease.
give_up=$(($(now_ms) + WAIT_MS)) refused=0
while :; do
  sent=$(now_ms)
  TOKEN=$(grant) || TOKEN=
  if [ -n "$TOKEN" ]; then
    body="{\"token\": $TOKEN}"   # signed with its hash: the issuer key's registration route
    status=$(curl -sS -o "$STATE/fence" -w '%{http_code}' --aws-sigv4 aws:amz:us-east-1:s3 --user "$KEYS" \
      -X PUT -H "x-amz-content-sha256: $(printf %s "$body" | sha256sum | cut -d' ' -f1)" -d "$body" \
      "$S3/_fencegate/v1/fences/$(printf %s "$RESOURCE" | jq -sRr @uri)") || status=000
    if [ "$status" = 200 ]; then
      echo $((sent + TTL_MS)) > "$STATE/deadline"
      echo "lease_acquired token=$TOKEN holder=$HOLDER"
      break
    fi
    release
    [ "$status" = 409 ] || { echo "registration failed status=$status"; exit 1; }
    fence=$(jq -r .token "$STATE/fence") refused=$((refused + 1))
    echo "registration refused token=$TOKEN fence=$fence"   # the issuer went back
    if [ "$refused" -ge 3 ] || ! behind "$fence"; then exit 6; fi
    continue
  fi
  [ "$(now_ms)" -lt "$give_up" ] || { echo "lease_held resource=$RESOURCE"; exit 3; }
  sleep 0.2
done

# 2. Heartbeat every TTL/3 in the background (counted from the previous one's sending). The lease
#    is lost when a renewal is refused, or when TTL has passed since the sending of the last
#    renewal that succeeded.
heartbeat() {
  next=$(now_ms)
  while :; do
    next=$((next + TTL_MS / 3)) sent=$(now_ms)
    if [ "$next" -gt "$sent" ]; then sleep "$((next - sent))e-3"; else next=$sent; fi
    sent=$(now_ms)
    answer=$(renew) || answer=unknown
    if [ "$answer" = 1 ]; then
      echo $((sent + TTL_MS)) > "$STATE/next" && mv "$STATE/next" "$STATE/deadline"
      echo "heartbeat_latency ms=$(($(now_ms) - sent))"
    elif [ "$answer" != unknown ] || [ "$(now_ms)" -ge "$(cat "$STATE/deadline")" ]; then
      if [ "$answer" = unknown ]; then reason=deadline; else reason=refused; fi
      echo "$reason" > "$STATE/lost"; echo "lease_lost reason=$reason"; return
    fi
  done
}
heartbeat & HEARTBEAT=$!

# 3. The work. Every write carries the token and the resource, signed; none starts once the
#    lease is lost. A write that was already on its way when the lease went is fencegate's.
for step in "$@"; do
  case $step in
    write:*=*)
      key=${step#write:} file=${step#*=}; key=${key%%=*}
      if lost; then stop; fi
      status=$(curl -sS -o "$STATE/answer" -w '%{http_code}' --aws-sigv4 aws:amz:us-east-1:s3 --user "$KEYS" \
        -H "Fencing-Token: $TOKEN" -H "Fencing-Resource: $RESOURCE" -H "x-amz-content-sha256: UNSIGNED-PAYLOAD" \
        -T "$file" "$S3/$BUCKET/$key") || status=000
      case $status in
        200) echo "wrote key=$key token=$TOKEN" ;;
        409) echo "write refused key=$key status=409 code=$(sed -n 's:.*<Code>\(.*\)</Code>.*:\1:p' "$STATE/answer")"
             echo "lease_lost reason=fenced"; exit 4 ;;
        *) echo "write failed key=$key status=$status"; exit 1 ;;
      esac ;;
    sleep:*)
      end=$(($(now_ms) + ${step#sleep:}))
      while [ "$(now_ms)" -lt "$end" ]; do
        if lost; then stop; fi
        sleep "$((TTL_MS / 10))e-3"
      done ;;
    *) echo "unknown step: $step" >&2; exit 2 ;;
  esac
done

# 4. Done: stop the heartbeat, then release (compare-and-delete).
kill "$HEARTBEAT"; HEARTBEAT=
if lost; then stop; fi
release; echo released
