-- tower-quota counters. One script for every operation so that one SHA is
-- loaded; ARGV[1] names the operation:
--
--   c  charge: check every line, then commit all of them or none
--   p  peek: read every line, write nothing
--   r  refund ARGV[2] to KEYS[1] at ARGV[3] = now (ms), never creating it,
--      never touching its TTL
--   a  add ARGV[2] to KEYS[1] at ARGV[3] = now (ms) without a limit check (a
--      cost known only after the response), never creating it, never
--      touching its TTL; a count that would go beyond 2^53 is an error
--      reply, and nothing is written
--   t  the server's TIME (KEYS[1] only routes the call on a cluster)
--
-- A counter is a hash: n = units spent, t = the first call (ms since the
-- epoch), and for calendar counters e = the window's end (ms since the
-- epoch). t and e are written once, when the script creates the counter.
-- HINCRBY keeps the key's TTL, so the deadline set when the counter is
-- created is never moved. A plain string counter (written by another tool)
-- is read with GET and changed with INCRBY/DECRBY, which keep the TTL too.
--
-- Every value is strict: n, t, e and a string counter are whole numbers
-- from 0 to 2^53 written as Redis writes integers (digits only, no sign, no
-- leading zero, no point, no exponent, no space), and a hash holds no other
-- field. Anything else (another type, `1.0`, `1e0`, ` 1`, `-1`, a count
-- beyond 2^53) is no counter: the request is an error reply naming the key,
-- and nothing is written on any key.
--
-- A counter is live at `now` while its key exists and, when it records a
-- window's end e, while now < e: a calendar counter outlives its window by a
-- grace (for instances whose clocks lag), but at an instant past its end it
-- counts nothing, takes no refund and no add. e is only compared with now;
-- it never sets nor moves a deadline.
--
-- Charge and peek: ARGV[2] = now (ms); then five arguments per key:
--   limit, cost, anchor ('f' first use, 'c' calendar), ttl (ms), end (ms)
-- where ttl is the deadline of a counter created now: the period's length
-- for first use, the window's end plus grace and jitter for calendar; and
-- end is the calendar window's end (0 for first use).
-- The reply is { admitted, then per key: used, remaining, pttl, first call,
-- heal } with pttl (the counter's remaining life, ms) -2 when there is no
-- live counter, first call -1 when unknown, and heal:
--   0 nothing to heal
--   1 undated first-use counter dated to first call + period
--   2 undated counter dated to now + period (first call unknown)
--   3 undated first-use counter whose period was over: ended
--   4 undated calendar counter given its housekeeping deadline
-- A heal is written only by an admitted charge, in its commit phase: a peek
-- and a refused charge report it and write nothing.

local op = ARGV[1]

if op == 't' then
  return redis.call('TIME')
end

-- The most a count may reach: Lua numbers are doubles, exact up to 2^53.
local EXACT = 2 ^ 53
local EXACT_DIGITS = '9007199254740992'

-- A whole number from 0 to 2^53 as Redis writes integers, or nil.
local function strict(v)
  if type(v) ~= 'string' then
    return nil
  end
  local len = #v
  if len == 0 or len > #EXACT_DIGITS then
    return nil
  end
  if v ~= '0' and string.find(v, '^[1-9]%d*$') == nil then
    return nil
  end
  -- Digit strings of one length compare as numbers.
  if len == #EXACT_DIGITS and v > EXACT_DIGITS then
    return nil
  end
  return tonumber(v)
end

-- Reads the counter at `key`, writing nothing: a table { exists, used,
-- first, ends, hash }, or nil when the key holds something that is no
-- counter. A missing key is a counter with nothing spent (created as a
-- hash).
local function read(key)
  local kind = redis.call('TYPE', key)['ok']
  if kind == 'none' then
    return { exists = false, used = 0, hash = true }
  end
  if kind == 'hash' then
    local r = redis.call('HMGET', key, 'n', 't', 'e')
    local used, first, ends = strict(r[1]), strict(r[2]), strict(r[3])
    if used == nil or (r[2] and first == nil) or (r[3] and ends == nil) then
      return nil
    end
    local fields = 1 + (r[2] and 1 or 0) + (r[3] and 1 or 0)
    if redis.call('HLEN', key) ~= fields then
      return nil
    end
    return { exists = true, used = used, first = first, ends = ends, hash = true }
  end
  if kind == 'string' then
    local used = strict(redis.call('GET', key))
    if used == nil then
      return nil
    end
    return { exists = true, used = used, hash = false }
  end
  return nil
end

local function not_a_counter(key)
  return redis.error_reply('ERR tower-quota: ' .. key
    .. ' holds a value that is not a counter (a whole number from 0 to 2^53,'
    .. ' or a hash of such numbers n, t and e)')
end

local function bad_argument(what)
  return redis.error_reply('ERR tower-quota: the counters script was called with '
    .. what .. ' that is not a whole number from 0 to 2^53')
end

-- Whether a counter read at `now` is over: its window ended (its key may
-- live on through the grace).
local function over(c, now)
  return c.ends ~= nil and c.ends <= now
end

if op == 'r' or op == 'a' then
  local key = KEYS[1]
  local now = strict(ARGV[3])
  if now == nil then
    return bad_argument('an instant')
  end
  local c = read(key)
  if c == nil then
    return not_a_counter(key)
  end
  if op == 'r' then
    local amount = strict(ARGV[2])
    if amount == nil then
      return bad_argument('an amount')
    end
    if not c.exists or over(c, now) then
      return -1
    end
    local give = math.min(c.used, amount)
    if give == 0 then
      return c.used
    end
    if c.hash then
      return redis.call('HINCRBY', key, 'n', -give)
    end
    return redis.call('DECRBY', key, give)
  end
  if string.find(ARGV[2] or '', '^%d+$') == nil then
    return redis.error_reply('ERR tower-quota: the amount to add is not a whole number')
  end
  if not c.exists or over(c, now) then
    -- Nothing live to add to: the counter expired, its window ended, or it
    -- never was. INCRBY would create it without a deadline.
    return -1
  end
  -- Checked before writing, without forming used + amount (a double may
  -- round it back to 2^53). An amount of 2^53 or more is refused whatever
  -- the count: a double cannot tell 2^53 + 1 from 2^53.
  local amount = strict(ARGV[2])
  if amount == nil or amount >= EXACT or amount > EXACT - c.used then
    return redis.error_reply('ERR tower-quota: adding ' .. ARGV[2] .. ' to ' .. key
      .. ' goes beyond 2^53, the most the counters script counts exactly')
  end
  if amount == 0 then
    return c.used
  end
  -- HINCRBY and INCRBY keep the key's TTL.
  if c.hash then
    return redis.call('HINCRBY', key, 'n', ARGV[2])
  end
  return redis.call('INCRBY', key, ARGV[2])
end

local charging = op == 'c'
local now = strict(ARGV[2])
if now == nil then
  return bad_argument('an instant')
end
local PER = 5

-- Check phase: every key is read and checked, and every line decided,
-- before anything is written. A key listed twice is read once.
local counters = {}
local order = {}
for i = 1, #KEYS do
  local key = KEYS[i]
  if counters[key] == nil then
    local c = read(key)
    if c == nil then
      return not_a_counter(key)
    end
    counters[key] = c
    order[#order + 1] = key
  end
end

local lines = {}
local admitted = true
for i = 1, #KEYS do
  local key = KEYS[i]
  local a = 3 + (i - 1) * PER
  local line = {
    key = key,
    limit = tonumber(ARGV[a]),
    cost = tonumber(ARGV[a + 1]),
    first_use = ARGV[a + 2] == 'f',
    ttl = tonumber(ARGV[a + 3]),
    ends = strict(ARGV[a + 4]),
    cost_arg = ARGV[a + 1],
    ends_arg = ARGV[a + 4],
  }
  if line.ends == nil then
    return bad_argument('a window end')
  end
  local c = counters[key]
  if c.pttl == nil then
    -- The key's first line decides what the counter is at `now`.
    c.pttl = -2
    c.heal = 0
    c.live = false
    if c.exists then
      c.pttl = redis.call('PTTL', key)
      if c.pttl == -1 then
        if not line.first_use then
          c.pttl = line.ttl
          c.heal = 4
        elseif c.first == nil then
          c.pttl = line.ttl
          c.heal = 2
        elseif c.first + line.ttl > now then
          -- `ttl` is the length of a period opened now; for months it can
          -- differ from the one opened at `first` by a few days.
          c.pttl = c.first + line.ttl - now
          c.heal = 1
        else
          -- The period ended long ago: as good as expired.
          c.heal = 3
        end
      end
      c.live = c.heal ~= 3 and not over(c, now)
        and not (not line.first_use and line.ends <= now)
    end
    if not c.live then
      c.used = 0
      c.first = nil
      c.shown_pttl = -2
    else
      c.shown_pttl = c.pttl
    end
    c.spent = 0
  end
  -- A key listed twice is charged twice.
  if c.used + c.spent + line.cost > line.limit then
    admitted = false
  end
  c.spent = c.spent + line.cost
  lines[i] = line
end

-- Commit phase: only an admitted charge writes.
if charging and admitted then
  for _, key in ipairs(order) do
    local c = counters[key]
    if c.heal == 3 then
      redis.call('DEL', key)
    elseif c.heal ~= 0 then
      redis.call('PEXPIRE', key, c.pttl)
    end
  end
end

local reply = { admitted and 1 or 0 }
for i = 1, #KEYS do
  local l = lines[i]
  local c = counters[l.key]
  if charging and admitted and l.cost > 0 then
    if c.live then
      if c.hash then
        c.used = redis.call('HINCRBY', l.key, 'n', l.cost_arg)
      else
        c.used = redis.call('INCRBY', l.key, l.cost_arg)
      end
    elseif c.exists and c.heal ~= 3 then
      -- A calendar counter whose window is over, kept through its grace:
      -- a charge at `now` counts on no live counter, and leaves it as it is.
      c.used = c.used + l.cost
    else
      -- A new counter: its first call, a calendar window's end, and its
      -- deadline, all in this call and never again.
      local fields = { 'n', l.cost_arg, 't', ARGV[2] }
      if not l.first_use then
        fields[5] = 'e'
        fields[6] = l.ends_arg
      end
      redis.call('HSET', l.key, unpack(fields))
      redis.call('PEXPIRE', l.key, l.ttl)
      c.used = l.cost
      c.first = now
      c.hash = true
      c.live = true
      c.shown_pttl = l.ttl
    end
  end
  reply[#reply + 1] = c.used
  reply[#reply + 1] = math.max(0, l.limit - c.used)
  reply[#reply + 1] = c.shown_pttl
  reply[#reply + 1] = c.first or -1
  reply[#reply + 1] = c.heal
end
return reply
