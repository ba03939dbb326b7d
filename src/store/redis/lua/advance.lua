local g = epoch_gate(KEYS[2], KEYS[3], ARGV[4], ARGV[5], ARGV[6], true)
if g then return {g[1] == 'epoch' and -1 or -2, g[2], g[3]} end
local cur = redis.call('GET', KEYS[1])
if cur and not lt(cur, ARGV[1]) then return {0, cur, 0} end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('PUBLISH', ARGV[2], ARGV[1] .. ' ' .. ARGV[3])
return {1, cur or '', 0}
