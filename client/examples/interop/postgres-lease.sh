#!/bin/sh
# A worker under a PostgreSQL lease row (its token nextval() of a sequence): docs/leases.md,
# "Tokens issued elsewhere", the PostgreSQL functions and then the shell loop, exactly as the page
# has them (tests/python/test_lease_recipes.py checks that they agree, and runs them).
#
#   PGURL=postgres://localhost/app RESOURCE=job:invoices sh postgres-lease.sh write:invoices.txt=invoices.txt

PSQL="timeout 2 psql -X -q -At -v ON_ERROR_STOP=1 ${PGURL:-postgres://localhost/app}"
$PSQL <<'SQL'
SET client_min_messages = warning;
CREATE SEQUENCE IF NOT EXISTS fencing_tokens;
CREATE TABLE IF NOT EXISTS leases (name text PRIMARY KEY, holder text NOT NULL,
                                   token bigint NOT NULL, expires_at timestamptz NOT NULL);
SQL
grant() {
  $PSQL -v name="$RESOURCE" -v holder="$HOLDER" -v ttl_ms="$TTL_MS" <<'SQL'
INSERT INTO leases AS l (name, holder, token, expires_at)
VALUES (:'name', :'holder', nextval('fencing_tokens'), clock_timestamp() + :ttl_ms * interval '1 millisecond')
ON CONFLICT (name) DO UPDATE
  SET holder = EXCLUDED.holder, token = EXCLUDED.token, expires_at = EXCLUDED.expires_at
  WHERE l.expires_at < clock_timestamp()
RETURNING token;
SQL
}
renew() {
  $PSQL -v name="$RESOURCE" -v token="$TOKEN" -v ttl_ms="$TTL_MS" <<'SQL'
WITH renewed AS (
  UPDATE leases SET expires_at = clock_timestamp() + :ttl_ms * interval '1 millisecond'
  WHERE name = :'name' AND token = :token AND expires_at > clock_timestamp() RETURNING 1)
SELECT count(*) FROM renewed;
SQL
}
release() {
  $PSQL -v name="$RESOURCE" -v token="$TOKEN" <<'SQL' >/dev/null
DELETE FROM leases WHERE name = :'name' AND token = :token;
SQL
}
behind() {  # a restored backup or a lagging replica: move the sequence past the fence
  $PSQL -v fence="$1" <<'SQL' >/dev/null
SELECT setval('fencing_tokens', greatest(:fence, last_value)) FROM fencing_tokens;
SQL
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
