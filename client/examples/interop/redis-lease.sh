#!/bin/sh
# A Redis lease (SET NX PX) whose fencing token comes from an INCR counter, registered with
# fencegate at grant time (PUT /v1/fences/{resource}), then one fenced write, a renewal and a
# release. Needs redis-cli, curl (7.75+ for --aws-sigv4) and python3 (for URL-encoding).
#
#   FENCEGATE_S3=http://127.0.0.1:9000 FENCEGATE_ADMIN=http://127.0.0.1:9001 sh redis-lease.sh
set -eu

S3=${FENCEGATE_S3:-http://127.0.0.1:9000}
ADMIN=${FENCEGATE_ADMIN:-http://127.0.0.1:9001}
REDIS=${REDIS_CLI:-redis-cli}
RESOURCE=${RESOURCE:-job:invoices}
HOLDER=${HOLDER:-worker-$$}
TTL_MS=${TTL_MS:-10000}
BUCKET=${BUCKET:-reports}
SIGV4="--aws-sigv4 aws:amz:us-east-1:s3 --user fencegate-dev:fencegate-dev-secret"
ENCODED=$(python3 -c 'import sys, urllib.parse; print(urllib.parse.quote(sys.argv[1], safe=""))' "$RESOURCE")

# 1. Grant: the lease key and the next token in one atomic script, so that a token is only
#    ever handed out together with the lease.
TOKEN=$($REDIS EVAL "
  if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
    return redis.call('INCR', KEYS[2])
  end
  return false" 2 "lease:$RESOURCE" "fence:$RESOURCE" "$HOLDER" "$TTL_MS")
if [ -z "$TOKEN" ]; then
  echo "held by $($REDIS GET "lease:$RESOURCE")"; exit 1
fi

# 2. Register the token before the first write: from now on every older token is refused.
#    409 means the counter is behind fencegate's fence (Redis lost data without AOF): move it
#    past the fence, drop this lease and start again.
STATUS=$(curl -sS -o /tmp/fence.$$ -w '%{http_code}' -X PUT -d "{\"token\": $TOKEN}" "$ADMIN/v1/fences/$ENCODED")
if [ "$STATUS" = 409 ]; then
  CURRENT=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["token"])' /tmp/fence.$$)
  $REDIS SET "fence:$RESOURCE" "$CURRENT" >/dev/null
  $REDIS DEL "lease:$RESOURCE" >/dev/null
  echo "counter was behind the fence ($TOKEN < $CURRENT); moved it, try again"; exit 1
fi
[ "$STATUS" = 200 ] || { echo "registration failed: $STATUS $(cat /tmp/fence.$$)"; exit 1; }
echo "acquired token=$TOKEN"

# 3. Write with the token (the bucket must exist: aws s3 mb, or any S3 client).
echo "invoice run by $HOLDER" > /tmp/body.$$
curl -fsS $SIGV4 -H "Fencing-Token: $TOKEN" -H "Fencing-Resource: $RESOURCE" \
     -H "x-amz-content-sha256: UNSIGNED-PAYLOAD" -T /tmp/body.$$ "$S3/$BUCKET/invoices.txt"
echo "wrote key=invoices.txt token=$TOKEN"

# 4. Renew (every TTL/3): only while the lease is still ours.
RENEWED=$($REDIS EVAL "
  if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
  return 0" 1 "lease:$RESOURCE" "$HOLDER" "$TTL_MS")
[ "$RENEWED" = 1 ] && echo "renewed" || { echo "lease lost: stop writing"; exit 1; }

# 5. Release: compare-and-delete.
$REDIS EVAL "
  if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
  return 0" 1 "lease:$RESOURCE" "$HOLDER" >/dev/null
echo "released"
rm -f /tmp/fence.$$ /tmp/body.$$
