#!/bin/sh
# A PostgreSQL lease row whose fencing token comes from a sequence, registered with fencegate
# at grant time. The grant is one statement: it takes the row only if the lease expired, and the
# token is nextval() of a sequence, which never goes back (not even on rollback).
#
#   PGURL=postgres://localhost/app FENCEGATE_ADMIN=http://127.0.0.1:9001 sh postgres-lease.sh
set -eu

PSQL="psql -X -q -At -v ON_ERROR_STOP=1 ${PGURL:-postgres://localhost/postgres}"
ADMIN=${FENCEGATE_ADMIN:-http://127.0.0.1:9001}
RESOURCE=${RESOURCE:-job:invoices}
HOLDER=${HOLDER:-worker-$$}
ENCODED=$(python3 -c 'import sys, urllib.parse; print(urllib.parse.quote(sys.argv[1], safe=""))' "$RESOURCE")

$PSQL <<'SQL'
SET client_min_messages = warning;
CREATE SEQUENCE IF NOT EXISTS fencing_tokens;   -- NO CYCLE (the default): it never wraps
CREATE TABLE IF NOT EXISTS leases (
  name       text PRIMARY KEY,
  holder     text NOT NULL,
  token      bigint NOT NULL,
  expires_at timestamptz NOT NULL
);
SQL

# Grant: insert, or take over an expired row; nothing comes back if someone holds it.
TOKEN=$($PSQL -v name="$RESOURCE" -v holder="$HOLDER" <<'SQL'
INSERT INTO leases AS l (name, holder, token, expires_at)
VALUES (:'name', :'holder', nextval('fencing_tokens'), clock_timestamp() + interval '10 seconds')
ON CONFLICT (name) DO UPDATE
  SET holder = EXCLUDED.holder, token = EXCLUDED.token, expires_at = EXCLUDED.expires_at
  WHERE l.expires_at < clock_timestamp()
RETURNING token;
SQL
)
[ -n "$TOKEN" ] || { echo "held"; exit 1; }

curl -fsS -X PUT -d "{\"token\": $TOKEN}" "$ADMIN/v1/fences/$ENCODED" >/dev/null
echo "acquired token=$TOKEN"

# Renew (every TTL/3): compare-and-set on holder and token.
RENEWED=$($PSQL -v name="$RESOURCE" -v holder="$HOLDER" -v token="$TOKEN" <<'SQL'
UPDATE leases SET expires_at = clock_timestamp() + interval '10 seconds'
WHERE name = :'name' AND holder = :'holder' AND token = :token AND expires_at > clock_timestamp()
RETURNING 1;
SQL
)
[ "$RENEWED" = 1 ] && echo "renewed" || { echo "lease lost: stop writing"; exit 1; }

# Release: compare-and-delete.
$PSQL -v name="$RESOURCE" -v token="$TOKEN" <<'SQL'
DELETE FROM leases WHERE name = :'name' AND token = :token;
SQL
echo "released"
