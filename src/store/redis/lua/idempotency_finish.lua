if redis.call('HGET', KEYS[1], 'claim') ~= ARGV[1] then return 0 end
if ARGV[2] == '' then redis.call('DEL', KEYS[1]) else redis.call('HSET', KEYS[1], 'record', ARGV[2]) end
return 1
