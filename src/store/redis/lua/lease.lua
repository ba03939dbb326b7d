local function incr(s)
  if s == '18446744073709551615' then return nil end
  local digits, carry = {}, 1
  for i = #s, 1, -1 do
    local d = tonumber(string.sub(s, i, i)) + carry
    if d == 10 then d, carry = 0, 1 else carry = 0 end
    digits[i] = tostring(d)
  end
  local out = table.concat(digits)
  if carry == 1 then out = '1' .. out end
  return out
end
local now = now_ms()
local l = redis.call('HMGET', KEYS[2], 'holder', 'lease_id', 'token', 'ttl_ms', 'expires_at_ms')
local live = l[1] and tonumber(l[5]) > now
local op = ARGV[1]
if op == 'withdraw' then
  redis.call('HSET', KEYS[5], ARGV[2], '1')
  redis.call('PEXPIRE', KEYS[5], ARGV[4])
  if l[2] ~= ARGV[2] then return {'gone', '', '', '', '', ''} end
  redis.call('DEL', KEYS[2])
  return {'released', '', '', '', '', ''}
end
if op == 'acquire' then
  if redis.call('HEXISTS', KEYS[5], ARGV[2]) == 1 then return {'gone', '', '', '', '', ''} end
  local g = epoch_gate(KEYS[3], KEYS[4], ARGV[8], ARGV[9], ARGV[10], true)
  if g then return {g[1], g[2], '', '', '', tostring(g[3])} end
  if live then return {'held', l[1], '', '', '', tostring(tonumber(l[5]) - now)} end
  local cur = redis.call('GET', KEYS[1])
  local had, repaired = cur or '', '0'
  if ARGV[7] ~= '' and (not cur or lt(cur, ARGV[7])) then cur, repaired = ARGV[7], '1' end
  local token = '1'
  if cur then token = incr(cur) end
  if not token then return {'exhausted', '', '', '', '', ''} end
  local expires = tostring(now + tonumber(ARGV[4]))
  redis.call('SET', KEYS[1], token)
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[2], 'holder', ARGV[3], 'lease_id', ARGV[2], 'token', token, 'ttl_ms', ARGV[4], 'expires_at_ms', expires)
  redis.call('PUBLISH', ARGV[5], token .. ' ' .. ARGV[6])
  return {'granted', ARGV[3], ARGV[2], token, ARGV[4], expires, had, repaired}
end
if not live or l[2] ~= ARGV[2] then return {'gone', '', '', '', '', ''} end
local cur = redis.call('GET', KEYS[1])
if cur and lt(l[3], cur) then
  -- superseded: a newer token was registered or written since the grant (renew or release)
  redis.call('DEL', KEYS[2])
  return {'gone', '', '', '', '', ''}
end
if op == 'renew' then
  local expires = tostring(now + tonumber(l[4]))
  redis.call('HSET', KEYS[2], 'expires_at_ms', expires)
  return {'renewed', l[1], l[2], l[3], l[4], expires}
end
redis.call('DEL', KEYS[2])
return {'released', '', '', '', '', ''}
