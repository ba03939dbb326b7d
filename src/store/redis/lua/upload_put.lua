-- Keeps an upload record within fencegate's bounds (src/fence/budget.rs), checked in the same
-- atomic step as the write. The counts live in the records' own hash under fields that start
-- with a newline (no bucket name does), so one key holds both, in one cluster slot.
-- KEYS[1]: the hash. ARGV: name, record JSON, then the bounds per caller, per resource, count
-- and bytes, and Redis's memory share for records (numerator, denominator).
-- Returns 'kept', or the bound that refused it: 'caller', 'resource', 'count', 'bytes',
-- 'memory'.
local name, json = ARGV[1], ARGV[2]
if not upload_name_ok(name) then return redis.error_reply('not an upload record name') end
local old = redis.call('HGET', KEYS[1], name)
local caller, resource, bytes = upload_owner(name, json)
if old then
  -- A record taken over by a newer token: never refused, it adds no record.
  local old_caller, old_resource, old_bytes = upload_owner(name, old)
  upload_count(KEYS[1], -1, old_caller, old_resource, old_bytes)
else
  local function kept(field) return tonumber(redis.call('HGET', KEYS[1], field) or '0') end
  if kept('\nc:' .. caller) >= tonumber(ARGV[3]) then return 'caller' end
  if kept('\nr:' .. resource) >= tonumber(ARGV[4]) then return 'resource' end
  if kept('\ncount') >= tonumber(ARGV[5]) then return 'count' end
  if kept('\nbytes') + bytes > tonumber(ARGV[6]) then return 'bytes' end
  if records_memory_full(ARGV[7], ARGV[8]) then return 'memory' end
end
redis.call('HSET', KEYS[1], name, json)
upload_count(KEYS[1], 1, caller, resource, bytes)
return 'kept'
