-- Forgets an upload record and its counts. KEYS[1]: the hash. ARGV: name. Returns 1 if there
-- was one.
if not upload_name_ok(ARGV[1]) then return 0 end
local old = redis.call('HGET', KEYS[1], ARGV[1])
if not old then return 0 end
local caller, resource, bytes = upload_owner(ARGV[1], old)
redis.call('HDEL', KEYS[1], ARGV[1])
upload_count(KEYS[1], -1, caller, resource, bytes)
return 1
