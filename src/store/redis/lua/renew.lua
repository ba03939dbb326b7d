local g = epoch_gate(KEYS[3], KEYS[4], ARGV[3], ARGV[4], ARGV[2], false)
if g then return {2, g[2]} end
local now = now_ms()
local score = redis.call('ZSCORE', KEYS[2], ARGV[1])
local cur = redis.call('GET', KEYS[1]) or ''
if not score or tonumber(score) <= now then return {0, cur} end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[1])
return {1, cur}
