-- Counts the upload records of a hash written before fencegate counted them (no '\ncount'
-- field while records are kept). KEYS[1]: the hash. Returns the records counted.
if redis.call('HEXISTS', KEYS[1], '\ncount') == 1 then return -1 end
local all = redis.call('HGETALL', KEYS[1])
local n = 0
for i = 1, #all, 2 do
  if string.sub(all[i], 1, 1) ~= '\n' then
    local caller, resource, bytes = upload_owner(all[i], all[i + 1])
    upload_count(KEYS[1], 1, caller, resource, bytes)
    n = n + 1
  end
end
return n
