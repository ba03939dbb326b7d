-- Helpers of the scripts that keep records for callers (upload records, idempotency records).

-- Whether Redis is past the share of maxmemory records may use (numerator, denominator): the
-- last share is the fences'. With noeviction, a full Redis refuses every write, grants and
-- advances included.
local function records_memory_full(numerator, denominator)
  local info = redis.call('INFO', 'memory')
  local used = tonumber(string.match(info, 'used_memory:(%d+)') or '0')
  local max = tonumber(string.match(info, 'maxmemory:(%d+)') or '0')
  return max > 0 and used * tonumber(denominator) >= max * tonumber(numerator)
end

-- What an upload record counts against (as fencegate's UploadRecord::owner): who it is
-- counted as (its creator when not said), its resource, and its name's and JSON's bytes. A
-- value that is no record counts its bytes against nobody.
local function upload_owner(name, json)
  local ok, r = pcall(cjson.decode, json)
  if ok and type(r) == 'table' and type(r.creator) == 'string' and type(r.resource) == 'string' then
    local caller = r.creator
    if type(r.counted_as) == 'string' and r.counted_as ~= '' then caller = r.counted_as end
    return caller, r.resource, #name + #json
  end
  return '', '', #name + #json
end
-- Adds (sign 1) or takes away (sign -1) one record from the counts; a caller's or resource's
-- count that reaches 0 is removed, and no count goes below 0 (a record kept uncounted, by a
-- fencegate before counting, is removed by one that counts).
local function upload_count(hash, sign, caller, resource, bytes)
  for _, total in ipairs({{'\ncount', sign}, {'\nbytes', sign * bytes}}) do
    if redis.call('HINCRBY', hash, total[1], total[2]) < 0 then redis.call('HSET', hash, total[1], 0) end
  end
  for _, field in ipairs({'\nc:' .. caller, '\nr:' .. resource}) do
    if redis.call('HINCRBY', hash, field, sign) <= 0 then redis.call('HDEL', hash, field) end
  end
end
-- Names that start with a newline are the counts', never a record's.
local function upload_name_ok(name)
  return string.sub(name, 1, 1) ~= '\n'
end
