local cur = redis.call('HGET', KEYS[1], 'record')
if cur then return cur end
if records_memory_full(ARGV[4], ARGV[5]) then return '\nfull' end
redis.call('HSET', KEYS[1], 'claim', ARGV[1], 'record', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return false
