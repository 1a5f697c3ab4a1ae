-- tower-quota counters. One script for every operation so that one SHA is
-- loaded; ARGV[1] names the operation:
--
--   c  charge: check every line, then commit all of them or none
--   p  peek: read every line, write nothing
--   r  refund KEYS[1] by ARGV[2], never creating it, never touching its TTL
--   a  add ARGV[2] to KEYS[1] without a limit check (a cost known only after
--      the response), never creating it, never touching its TTL; a count
--      that would go beyond 2^53 is an error reply, and nothing is written
--   t  the server's TIME (KEYS[1] only routes the call on a cluster)
--
-- A counter is a hash: n = units spent, t = the first call (ms since the
-- epoch). HINCRBY keeps the key's TTL, so the deadline set when the counter
-- is created is never moved. A plain string counter (written by another
-- tool) is read with GET and changed with INCRBY/DECRBY, which keep the TTL
-- too.
--
-- Charge and peek: ARGV[2] = now (ms); then four arguments per key:
--   limit, cost, anchor ('f' first use, 'c' calendar), ttl (ms)
-- where ttl is the deadline of a counter created now: the period's length
-- for first use, the window's end plus grace and jitter for calendar.
-- The reply is { admitted, then per key: used, remaining, pttl, first call,
-- heal } with pttl (the counter's remaining life, ms) -2 when there is no
-- counter, first call -1 when unknown, and heal:
--   0 nothing to heal
--   1 undated first-use counter dated to first call + period
--   2 undated counter dated to now + period (first call unknown)
--   3 undated first-use counter whose period was over: ended
--   4 undated calendar counter given its housekeeping deadline

local op = ARGV[1]

if op == 't' then
  return redis.call('TIME')
end

-- A whole, non-negative number of units, or nil.
local function whole(v)
  local n = tonumber(v)
  if n == nil or n < 0 or n ~= math.floor(n) then
    return nil
  end
  return n
end

-- Reads a counter: units spent, first call, whether it is (or will be
-- created as) a hash, and
-- whether the key is usable at all. A missing key is usable (nothing spent).
-- A key of another type, a hash without a whole `n`, or a string that is not
-- a whole number is no counter: the script refuses it before writing
-- anything, rather than overwrite it (and its deadline) or charge some lines
-- of a request and fail on the next.
local function read(key)
  local kind = redis.call('TYPE', key)['ok']
  if kind == 'none' then
    -- Counters this script creates are hashes.
    return nil, nil, true, true
  end
  if kind == 'hash' then
    local r = redis.call('HMGET', key, 'n', 't')
    local used = whole(r[1])
    return used, tonumber(r[2]), true, used ~= nil
  end
  if kind == 'string' then
    local used = whole(redis.call('GET', key))
    return used, nil, false, used ~= nil
  end
  return nil, nil, false, false
end

local function not_a_counter(key)
  return redis.error_reply('ERR tower-quota: ' .. key .. ' holds a value that is not a counter')
end

-- The most a count may reach: Lua numbers are doubles, exact up to 2^53.
local EXACT = 2 ^ 53

if op == 'r' then
  local key = KEYS[1]
  local used, _, hash, ok = read(key)
  if not ok then
    return not_a_counter(key)
  end
  if used == nil then
    return -1
  end
  local give = math.max(0, math.min(used, tonumber(ARGV[2])))
  if give == 0 then
    return used
  end
  if hash then
    return redis.call('HINCRBY', key, 'n', -give)
  end
  return redis.call('DECRBY', key, give)
end

if op == 'a' then
  local key = KEYS[1]
  local used, _, hash, ok = read(key)
  if not ok then
    return not_a_counter(key)
  end
  if used == nil then
    -- Nothing to add to: the counter expired or never was. INCRBY would
    -- create it without a deadline.
    return -1
  end
  local amount = whole(ARGV[2])
  if amount == nil then
    return redis.error_reply('ERR tower-quota: the amount to add is not a whole number')
  end
  -- Checked before writing, without forming used + amount (a double may
  -- round it back to 2^53). An amount of 2^53 or more is refused whatever
  -- the count: a double cannot tell 2^53 + 1 from 2^53.
  if amount > EXACT - used or amount >= EXACT then
    return redis.error_reply('ERR tower-quota: adding ' .. ARGV[2] .. ' to ' .. key
      .. ' goes beyond 2^53, the most the counters script counts exactly')
  end
  if amount == 0 then
    return used
  end
  -- HINCRBY and INCRBY keep the key's TTL.
  if hash then
    return redis.call('HINCRBY', key, 'n', ARGV[2])
  end
  return redis.call('INCRBY', key, ARGV[2])
end

local charging = op == 'c'
local now = tonumber(ARGV[2])
local lines = {}
local admitted = true

-- Every key is read and checked before anything is written.
local reads = {}
for i = 1, #KEYS do
  local used, first, hash, ok = read(KEYS[i])
  if not ok then
    return not_a_counter(KEYS[i])
  end
  reads[i] = { used = used, first = first, hash = hash }
end

for i = 1, #KEYS do
  local key = KEYS[i]
  local a = 3 + (i - 1) * 4
  local line = {
    key = key,
    limit = tonumber(ARGV[a]),
    cost = tonumber(ARGV[a + 1]),
    first_use = ARGV[a + 2] == 'f',
    ttl = tonumber(ARGV[a + 3]),
    pttl = -2,
    heal = 0,
  }
  local used, first, hash = reads[i].used, reads[i].first, reads[i].hash
  line.hash = hash
  if used ~= nil then
    line.pttl = redis.call('PTTL', key)
    if line.pttl == -1 then
      if not line.first_use then
        line.pttl = line.ttl
        line.heal = 4
      elseif first == nil then
        line.pttl = line.ttl
        line.heal = 2
      elseif first + line.ttl > now then
        -- `ttl` is the length of a period opened now; for months it can
        -- differ from the one opened at `first` by a few days.
        line.pttl = first + line.ttl - now
        line.heal = 1
      else
        line.heal = 3
      end
      if charging then
        if line.heal == 3 then
          -- The period ended long ago: the counter is as good as expired.
          redis.call('DEL', key)
        else
          redis.call('PEXPIRE', key, line.pttl)
        end
      end
      if line.heal == 3 then
        used = nil
        first = nil
        line.pttl = -2
      end
    end
  end
  line.exists = used ~= nil
  line.used = used or 0
  line.first = first
  -- A key listed twice is charged twice.
  local earlier = 0
  for j = 1, i - 1 do
    if lines[j].key == key then
      earlier = earlier + lines[j].cost
    end
  end
  if line.used + earlier + line.cost > line.limit then
    admitted = false
  end
  lines[i] = line
end

local reply = { admitted and 1 or 0 }
local created = {}
for i = 1, #KEYS do
  local l = lines[i]
  local a = 3 + (i - 1) * 4
  if charging and admitted and l.cost > 0 then
    local made = created[l.key]
    if l.exists or made then
      if l.hash then
        l.used = redis.call('HINCRBY', l.key, 'n', ARGV[a + 1])
      else
        l.used = redis.call('INCRBY', l.key, ARGV[a + 1])
      end
      if made then
        l.pttl = made.pttl
        l.first = made.first
      end
    else
      redis.call('HSET', l.key, 'n', ARGV[a + 1], 't', ARGV[2])
      redis.call('PEXPIRE', l.key, ARGV[a + 3])
      l.used = l.cost
      l.pttl = l.ttl
      l.first = now
      l.hash = true
      created[l.key] = l
    end
  end
  reply[#reply + 1] = l.used
  reply[#reply + 1] = math.max(0, l.limit - l.used)
  reply[#reply + 1] = l.pttl
  reply[#reply + 1] = l.first or -1
  reply[#reply + 1] = l.heal
end
return reply
