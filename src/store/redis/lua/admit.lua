local g = epoch_gate(KEYS[3], KEYS[4], ARGV[8], ARGV[9], ARGV[4], true)
if g then return {g[1], g[3], g[2], 0, ''} end
if #ARGV > 9 then redis.call('ZREM', KEYS[2], unpack(ARGV, 10)) end
local cur = redis.call('GET', KEYS[1])
local repaired, had = 0, ''
if ARGV[2] ~= '' and (not cur or lt(cur, ARGV[2])) then
  repaired, had = 1, (cur or '')
  redis.call('SET', KEYS[1], ARGV[2])
  cur = ARGV[2]
end
if cur and lt(ARGV[1], cur) then return {'stale', 0, cur, repaired, had} end
local advanced = 0
if not cur or lt(cur, ARGV[1]) then
  if ARGV[7] ~= '1' then return {'unregistered', 0, cur or '', repaired, had} end
  redis.call('SET', KEYS[1], ARGV[1])
  redis.call('PUBLISH', ARGV[5], ARGV[1] .. ' ' .. ARGV[6])
  advanced = 1
end
local now = now_ms()
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
for _, m in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  local mt = string.match(m, ':(%d+)$')
  if mt and lt(mt, ARGV[1]) then return {'wait', advanced, ARGV[1], repaired, had} end
end
if ARGV[3] ~= '' then
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[4]), ARGV[3])
end
return {'ok', advanced, ARGV[1], repaired, had}
