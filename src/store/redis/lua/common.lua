local function lt(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function epoch_gate(ekey, qkey, known, fresh, quiet_ms, quiet_applies)
  local now = now_ms()
  local mark = redis.call('GET', ekey)
  if not mark then
    mark = fresh
    redis.call('SET', ekey, mark)
    redis.call('SET', qkey, mark .. ' ' .. (now + tonumber(quiet_ms)))
  end
  local q = redis.call('GET', qkey)
  local q_mark, q_until = nil, 0
  if q then q_mark, q_until = string.match(q, '^(%S+) (%d+)$') end
  if known ~= '' and mark ~= known and q_mark ~= mark then
    q_until = now + tonumber(quiet_ms)
    redis.call('SET', qkey, mark .. ' ' .. q_until)
  end
  local quiet = tonumber(q_until or 0) - now
  if quiet < 0 then quiet = 0 end
  if mark ~= known then return {'epoch', mark, quiet} end
  if quiet_applies and quiet > 0 then return {'quiet', mark, quiet} end
  return nil
end
