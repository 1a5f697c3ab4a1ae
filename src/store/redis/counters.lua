-- tower-quota counters. One script for every operation so that one SHA is
-- loaded; ARGV[1] names the operation:
--
--   c  charge: check every line, then commit all of them or none
--   p  peek: read every line, write nothing
--   x  charge as `c`, each line taking up to so many units more as fit
--      (ARGV[3 + 5 * n + i] for line i, after the lines' arguments) once
--      every line's cost fits: admitted exactly when `c` would admit the
--      charge. A line whose key the charge lists twice takes none. The
--      reply is `c`'s, then the units each line took (all 0 when refused)
--   b  a batch of charges, each one as `c` on its own lines, one after the
--      other in this one call; the reply is one flat array: each charge's
--      reply (below), after the one before
--   r  refund ARGV[2] to KEYS[1] at ARGV[3] = now (ms), never creating it,
--      never lengthening its TTL; with ARGV[4] (ms), only to a counter whose
--      first call t is no later (one made since is left as it is, and the
--      answer is -1), and with ARGV[5] = 'exact' only to the one whose t is
--      ARGV[4]; a string counter, which records no t, takes it. An exact
--      refund of all a first-use counter (no e) holds, no more, deletes it
--      and answers 0: nothing else is spent in the period it opened; but
--      not once a refund of another kind (not exact) marked it (k = 1),
--      since the count then no longer tells what requests charged hold.
--      With ARGV[6] (ms, exact only: the give-back of a charge that made
--      the counter, which Redis ran late), a first-use counter it leaves
--      lives that long at most: its TTL, reckoned when the charge was sent,
--      ran from when Redis ran it, and would end the period that much late
--   a  add ARGV[2] to KEYS[1] at ARGV[3] = now (ms) without a limit check (a
--      cost known only after the response), never creating it, never
--      touching its TTL; with ARGV[4] (ms), only to a counter whose first
--      call t is no later, as `r`; a count that would go beyond 2^53 is an
--      error reply, and nothing is written
--   s  settle a debt: add ARGV[2] to KEYS[1] at ARGV[3] = now (ms) without
--      a limit check, creating the counter when there is none live: what
--      requests admitted while the store failed owe. ARGV[4] is the
--      anchor ('f' first use, 'c' calendar), ARGV[5] the ttl (ms) of a
--      counter created now, ARGV[6] the calendar window's end or the
--      first-use deadline (ms), ARGV[7] the debt's first request (ms), the
--      first call a created first-use counter records (its period runs
--      from it); a created calendar counter records now (it was made now:
--      a give-back of a charge made before, to a counter since deleted,
--      never lands there).
--      A live counter keeps its TTL and its first call (a first-use one
--      found without a TTL is healed first, as a charge heals it: dated
--      again, or deleted when its period is long over; one whose first
--      call is the debt's first request ends by the debt's deadline, its
--      TTL shortened to it, also when the settle finds its mark: the call
--      that made it may have run late). A debt of nothing
--      writes nothing, and answers what the counter holds. Answers {count,
--      t}: the count afterwards and the counter's first call (-1 when it
--      records none), which a give-back of a settle applied after its
--      caller stopped waiting goes by. A debt whose window is over at now,
--      or a key whose counter records a window over at now (kept through
--      its grace), writes nothing and answers {-1, -1}; so does a
--      first-use debt whose counter found live was made at or past its
--      deadline (and one the caller found past it, which it never sends).
--      A count that would go beyond 2^53 is an error reply, and nothing is
--      written. KEYS[2], when given, is the settle's mark: a settle that
--      adds leaves it (for a minute longer than a counter it created would
--      live), and one that finds it adds nothing and answers what the
--      counter holds, as a debt of nothing: the caller sends a settle again
--      under its mark when the answer to the first was lost, and it counts
--      once.
--   t  the server's TIME (KEYS[1] only routes the call on a cluster)
--   d  delete KEYS[1] (a support reset); answers how many keys went (as
--      DEL), through the script so that a cluster's redirects are followed
--
-- A counter is a hash: n = units spent, t = the first call (ms since the
-- epoch), and for calendar counters e = the window's end (ms since the
-- epoch). t and e are written once, when the script creates the counter.
-- A first-use counter that took a refund of another kind than an exact
-- give-back (support's) holds k = 1 too, from then on.
-- HINCRBY keeps the key's TTL, so the deadline set when the counter is
-- created is never moved. A plain string counter (written by another tool)
-- is read with GET and changed with INCRBY/DECRBY, which keep the TTL too.
--
-- Every value is strict: n, t, e, k and a string counter are whole numbers
-- from 0 to 2^53 written as Redis writes integers (digits only, no sign, no
-- leading zero, no point, no exponent, no space), t and e are no later than
-- 9999-12-30T22:00:00Z, k is 1, and a hash holds no other field. Anything else
-- (another type, `1.0`, `1e0`, ` 1`, `-1`, a count
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
-- end is the calendar window's end (0 for first use). The store writes
-- these from integers; the instant and a calendar line's end are checked
-- (a charge with a malformed one, or one past 9999-12-30T22:00:00Z, is an
-- error reply), the other line arguments are taken as they come.
-- The reply is { admitted, then per key: used, remaining, pttl, first call,
-- heal } with pttl the counter's remaining life (ms), -2 when there is no
-- live counter, -3 when it was not read (below); first call -1 when unknown;
-- and heal:
--   0 nothing to heal
--   1 undated first-use counter dated to first call + period
--   2 undated counter dated to now + period (first call unknown)
--   3 undated first-use counter whose period was over: ended
--   4 undated calendar counter given its housekeeping deadline
-- A heal is written by a charge, admitted or refused (it changes no count:
-- an undated counter at its limit would otherwise refuse every charge, and
-- never end); a peek reports it and writes nothing. A calendar counter that
-- records its window's end (e) got its deadline from the call that wrote e:
-- its deadline is not read (pttl -3), as the window's end, not the
-- deadline, decides when it counts; one left undated by another tool stays
-- until it is deleted. Counters without e are read and healed as above.
--
-- Batch: ARGV[2..] holds, charge after charge, either the number of its
-- lines n, its now (ms), then its 5 * n line arguments as above; or `=`,
-- its now and its ttl: one line with the limit, cost, anchor and end of the
-- charge before, which had one line too (consecutive charges of one quota
-- differ in their instants and, by the jitter, in their deadlines). KEYS
-- holds the charges' keys in the same order. The batch's layout is checked
-- before the first charge runs. Charges in one batch see each other's
-- writes, as if they had come one after the other. Each charge's reply is
-- its error reply as one value; or, when it took the common path (one line
-- on a live, dated counter this script created, healing nothing), three
-- values for a calendar counter, { 2 + admitted, used, first call }, and
-- four for a first-use one, { 4 + admitted, used, pttl, first call }; or
-- else its
-- reply as `c` gives it (which starts with 0 or 1).

local op = ARGV[1]
local find = string.find
-- Locals: a global is looked up at each use. `try` answers an error reply
-- as a table with `err` instead of raising it.
local KEYS, ARGV, call, try = KEYS, ARGV, redis.call, redis.pcall

if op == 't' then
  return call('TIME')
end

-- The instant, the window's end, the limit and the cost last read, and
-- their numbers: the charges of one batch mostly share them.
local last_now, last_at, last_end, last_end_at
local last_limit, last_limit_n, last_cost, last_cost_n

-- Whether `v` is a whole number from 0 to 2^53 written as Redis writes
-- integers: digits only, no sign, no leading zero, no point, no exponent,
-- no space. (Lua numbers are doubles, exact up to 2^53.) Two such strings
-- of one length compare as their numbers do.
local function digits(v)
  if not v then
    return false
  end
  local len = #v
  if len == 0 or len > 16 then
    return false
  end
  if v ~= '0' and find(v, '^[1-9]%d*$') == nil then
    return false
  end
  return len < 16 or v <= '9007199254740992'
end

-- The latest instant (ms) the store can name: 9999-12-30T22:00:00Z.
local LAST_INSTANT = '253402207200000'

-- Whether `v` is an instant (ms since the epoch) as `digits` takes it, no
-- later than LAST_INSTANT.
local function instant(v)
  return digits(v) and (#v < 15 or (#v == 15 and v <= LAST_INSTANT))
end

-- The common charge, in short: one line on a counter this script created
-- (a hash of n and t, and e for calendar counters, in that order) that is
-- live and dated. Decides and commits it exactly as `lines` would, with
-- fewer steps (and without making the functions `lines` needs), and
-- answers its reply: as a table of its own, or, when `out` is given,
-- appended to `out` in a batch's short form. Answers nothing, having
-- written nothing, for any other case, which `lines` then takes. Reads the
-- line's limit, cost, anchor and end from ARGV[a0 + 1 ..], and its instant
-- from `now`.
local function one(k0, now, a0, out)
  local key = KEYS[k0 + 1]
  local r = try('HGETALL', key)
  -- An error reply (not a hash) is a table without these.
  if r[1] ~= 'n' or r[3] ~= 't' then
    return nil
  end
  local n, t, e = r[2], r[4], r[6]
  local pttl = -3
  if ARGV[a0 + 3] ~= 'f' then
    if #r ~= 6 or r[5] ~= 'e' then
      return nil
    end
  else
    if #r ~= 4 then
      return nil
    end
    pttl = call('PTTL', key)
    if pttl < 0 then
      return nil
    end
  end
  local at = last_at
  if at == nil or now ~= last_now then
    if not instant(now) then
      return nil
    end
    at = now + 0
    last_now, last_at = now, at
  end
  if not (digits(n) and instant(t)) then
    return nil
  end
  if e ~= nil then
    if e ~= last_end then
      if not instant(e) then
        return nil
      end
      last_end, last_end_at = e, e + 0
    end
    -- Past the window the counter records, or the one this line charges
    -- (whose end `lines` checks when it differs).
    local ends = ARGV[a0 + 5]
    if at >= last_end_at or (ends ~= e and (not instant(ends) or at >= ends + 0)) then
      return nil
    end
  end
  local ls, cost = ARGV[a0 + 1], ARGV[a0 + 2]
  if ls ~= last_limit then
    last_limit, last_limit_n = ls, ls + 0
  end
  if cost ~= last_cost then
    last_cost, last_cost_n = cost, cost + 0
  end
  local limit, used = last_limit_n, n + 0
  local admitted = used + last_cost_n <= limit
  if admitted and cost ~= '0' then
    used = call('HINCRBY', key, 'n', cost)
  end
  if out == nil then
    local left = limit - used
    return { admitted and 1 or 0, used, left > 0 and left or 0, pttl, t, 0 }
  end
  local o = #out
  if pttl == -3 then
    out[o + 1] = admitted and 3 or 2
    out[o + 2] = used
    out[o + 3] = t
  else
    out[o + 1] = admitted and 5 or 4
    out[o + 2] = used
    out[o + 3] = pttl
    out[o + 4] = t
  end
  return true
end

-- What every other case needs: the full read of a counter, `lines`, and
-- their error texts. Made at the first call that needs them only, so that
-- the common charges above do not pay for making them.
local slow
local function rest()
  if slow ~= nil then
    return slow
  end
  local NOT_A_COUNTER = ' holds a value that is not a counter (a whole number from 0 to'
    .. ' 2^53, or a hash of such numbers n, t, e and k, t and e no later than'
    .. ' 9999-12-30T22:00:00Z, k 1)'
  local NOT_A_NUMBER = ' that is not a whole number from 0 to 2^53'
  local NOT_AN_INSTANT = ' that is not an instant from 1970 to 9999-12-30T22:00:00Z'

  -- Reads the counter at `key`, writing nothing. Returns its kind (0 no key:
  -- a counter with nothing spent, created as a hash; 1 a hash; 2 a plain
  -- string counter), the units spent (a number), its first call and its
  -- window's end (digits, or nil), and whether a refund of another kind
  -- than a give-back marked it (k); or nothing when the key holds
  -- something that is no counter.
  local function read(key)
    local r = try('HGETALL', key)
    if r.err ~= nil then
      -- Not a hash.
      if call('TYPE', key)['ok'] ~= 'string' then
        return nil
      end
      local used = call('GET', key)
      if not digits(used) then
        return nil
      end
      return 2, used + 0
    end
    local size = #r
    if size == 0 then
      return 0, 0
    end
    local used, first, ends, kept
    for i = 1, size, 2 do
      local field, value = r[i], r[i + 1]
      if not digits(value) then
        return nil
      end
      if field == 'n' then
        used = value + 0
      elseif field == 't' and instant(value) then
        first = value
      elseif field == 'e' and instant(value) then
        ends = value
      elseif field == 'k' and value == '1' then
        kept = true
      else
        return nil
      end
    end
    if used == nil then
      return nil
    end
    return 1, used, first, ends, kept
  end

  -- Charges (or, `charging` false, peeks at) the lines of one request at
  -- `now` (ms): n keys from KEYS[k0 + 1], and from ARGV[a0 + 1] five
  -- arguments per line, but for a one-line charge its ttl `ttl` when given;
  -- with `x0`, line i takes up to ARGV[x0 + i] units more (see `x`).
  -- Returns its reply, or an error reply having written nothing.
  local function lines(k0, n, now, a0, charging, ttl, x0)
    if not instant(now) then
      return redis.error_reply('ERR tower-quota: an instant' .. NOT_AN_INSTANT)
    end
    local at = now + 0

    -- Check phase: every key is read and checked, and every line decided,
    -- before anything is written. A key listed twice is read once, and its
    -- first line decides what the counter is at `now`.
    local counters = {}
    local admitted = true
    for i = 1, n do
      local key = KEYS[k0 + i]
      local a = a0 + (i - 1) * 5
      local limit, cost = ARGV[a + 1] + 0, ARGV[a + 2] + 0
      local first_use = ARGV[a + 3] == 'f'
      if not first_use and not instant(ARGV[a + 5]) then
        -- A window's end no counter could record.
        return redis.error_reply('ERR tower-quota: a window end' .. NOT_AN_INSTANT)
      end
      local c = counters[key]
      if c == nil then
        local kind, used, first, ended = read(key)
        if kind == nil then
          return redis.error_reply('ERR tower-quota: ' .. key .. NOT_A_COUNTER)
        end
        local pttl, heal, live = -2, 0, false
        if kind ~= 0 then
          if ended ~= nil and not first_use then
            -- Dated when e was written; see above.
            pttl = -3
          else
            pttl = call('PTTL', key)
          end
          if pttl == -1 then
            local ttl = (ttl or ARGV[a + 4]) + 0
            if not first_use then
              pttl = ttl
              heal = 4
            elseif first == nil then
              pttl = ttl
              heal = 2
            elseif first + ttl > at then
              -- `ttl` is the length of a period opened now; for months it
              -- can differ from the one opened at `first` by a few days.
              -- Never more than one period from now: a first call ahead
              -- of `now` (an instance whose clock is ahead) must not date
              -- the counter further.
              pttl = math.min(first + ttl - at, ttl)
              heal = 1
            else
              -- The period ended long ago: as good as expired.
              heal = 3
            end
          end
          -- Live unless ended, or past the window it records, or past the
          -- calendar window this line charges.
          live = heal ~= 3 and (ended == nil or at < ended + 0)
          if live and not first_use then
            live = at < ARGV[a + 5] + 0
          end
        end
        if live then
          c = { kind = kind, used = used, first = first or -1, pttl = pttl,
                heal = heal, live = true, spent = 0, healed = false }
        else
          c = { kind = kind, used = 0, first = -1, pttl = -2,
                heal = heal, live = false, spent = 0, healed = false }
        end
        counters[key] = c
      end
      -- A key listed twice is charged twice.
      -- As `one` decides: a limit or cost that Lua reads as NaN refuses.
      if not (c.used + c.spent + cost <= limit) then
        admitted = false
      end
      c.spent = c.spent + cost
    end

    -- The units each line takes beyond its cost: what its counter has
    -- room for once every cost is counted, up to what it asks; none on a
    -- key listed twice, nor when refused.
    local taken
    if x0 ~= nil then
      taken = {}
      local listed = {}
      for i = 1, n do
        local key = KEYS[k0 + i]
        listed[key] = (listed[key] or 0) + 1
      end
      for i = 1, n do
        local want, got = ARGV[x0 + i], 0
        if not digits(want) then
          return redis.error_reply('ERR tower-quota: units to take' .. NOT_A_NUMBER)
        end
        local key = KEYS[k0 + i]
        if charging and admitted and want ~= '0' and listed[key] == 1 then
          local c = counters[key]
          local room = ARGV[a0 + (i - 1) * 5 + 1] - (c.used + c.spent)
          if room > 0 then
            got = math.min(want + 0, room)
          end
        end
        taken[i] = got
      end
    end

    -- Commit phase: only an admitted charge counts; any charge heals. A
    -- key's heal is written before its first count.
    local commit = charging and admitted
    local reply = { admitted and 1 or 0, 0, 0, 0, 0, 0 }
    local r = 1
    for i = 1, n do
      local key = KEYS[k0 + i]
      local a = a0 + (i - 1) * 5
      local c = counters[key]
      local cost = ARGV[a + 2]
      if taken ~= nil and taken[i] > 0 then
        -- Written as Redis writes integers (a sum within the limit, so
        -- within 2^53).
        cost = string.format('%.0f', cost + taken[i])
      end
      if charging and c.heal ~= 0 and not c.healed then
        c.healed = true
        if c.heal == 3 then
          call('DEL', key)
        else
          call('PEXPIRE', key, c.pttl)
        end
      end
      if commit and cost ~= '0' then
        if c.live then
          if c.kind == 2 then
            c.used = call('INCRBY', key, cost)
          else
            c.used = call('HINCRBY', key, 'n', cost)
          end
        elseif c.kind ~= 0 and c.heal ~= 3
            and ARGV[a + 3] ~= 'f' and at >= ARGV[a + 5] + 0 then
          -- The line's own window is over (the store refuses such a charge
          -- before it is sent): it counts on no live counter, and leaves
          -- the counter as it is.
          c.used = c.used + cost
        else
          if c.kind ~= 0 and c.heal ~= 3 then
            -- A counter over at `now` by the window end it records, which
            -- the line's window outlasts: instances that disagree on the
            -- window of one stamp (time zone rules of different releases).
            -- Replaced by this line's, as once its grace ends: counting on
            -- none would admit every charge until then.
            call('DEL', key)
          end
          -- A new counter: its first call, a calendar window's end, and its
          -- deadline, all in this call and never again.
          local ttl = ttl or ARGV[a + 4]
          local fields = { 'n', cost, 't', now }
          if ARGV[a + 3] ~= 'f' then
            fields[5] = 'e'
            fields[6] = ARGV[a + 5]
          end
          call('HSET', key, unpack(fields))
          call('PEXPIRE', key, ttl)
          c.kind = 1
          c.used = cost + 0
          c.first = now
          c.pttl = ttl + 0
          c.live = true
        end
      end
      local used = c.used
      local left = ARGV[a + 1] - used
      reply[r + 1] = used
      reply[r + 2] = left > 0 and left or 0
      reply[r + 3] = c.live and c.pttl or -2
      reply[r + 4] = c.first
      reply[r + 5] = c.heal
      r = r + 5
    end
    if taken ~= nil then
      for i = 1, n do
        reply[r + i] = taken[i]
      end
    end
    return reply
  end

  -- Charges as `lines` does, and appends its reply to a batch's flat
  -- reply `out`: an error reply as one value, any other value by value.
  local function batched(out, k0, n, now, a0, ttl)
    local reply = lines(k0, n, now, a0, true, ttl)
    if reply.err ~= nil then
      out[#out + 1] = reply
      return
    end
    local o = #out
    for j = 1, #reply do
      out[o + j] = reply[j]
    end
  end

  slow = {
    read = read,
    lines = lines,
    batched = batched,
    NOT_A_COUNTER = NOT_A_COUNTER,
    NOT_A_NUMBER = NOT_A_NUMBER,
  }
  return slow
end

if op == 'c' and #KEYS == 1 then
  local reply = one(0, ARGV[2], 2)
  if reply then
    return reply
  end
end

if op == 'b' then
  -- Most batches are of one-line charges only (each `1` or `=`): their
  -- layout is walked without a table, then each charge runs as `one`, or
  -- as `lines` when `one` does not take it. Any other batch, or a
  -- malformed one, is read below.
  local nkeys, nargs = #KEYS, #ARGV
  local k, a = 0, 2
  while a <= nargs do
    local n = ARGV[a]
    if n == '1' and a + 6 <= nargs then
      a = a + 7
    elseif n == '=' and k > 0 and a + 2 <= nargs then
      a = a + 3
    else
      break
    end
    k = k + 1
  end
  if a > nargs and k == nkeys then
    local out = {}
    k, a = 0, 2
    local group
    while a <= nargs do
      local now, ttl = ARGV[a + 1], nil
      if ARGV[a] == '1' then
        group = a + 1
        a = a + 7
      else
        ttl = ARGV[a + 2]
        a = a + 3
      end
      if not one(k, now, group, out) then
        rest().batched(out, k, 1, now, group, ttl)
      end
      k = k + 1
    end
    return out
  end
end

if op == 'd' then
  return redis.call('DEL', KEYS[1])
end

-- The common refund, in short (a give-back of leased units, a lease mark
-- left, a refund after a response): valid arguments and a counter this
-- script created, or none. Answers exactly as the full path below would;
-- anything else goes there.
if op == 'r' then
  local key, amount, now, made_by = KEYS[1], ARGV[2], ARGV[3], ARGV[4]
  -- 'exact': only to the counter whose first call is made_by.
  local exact = ARGV[5] == 'exact'
  if digits(now) and digits(amount) and (made_by == nil or digits(made_by))
      and ARGV[6] == nil then
    local r = try('HGETALL', key)
    if r.err == nil and #r == 0 then
      return -1
    end
    local n, t, e = r[2], r[4], r[6]
    if r[1] == 'n' and r[3] == 't' and (#r == 4 or (#r == 6 and r[5] == 'e'))
        and digits(n) and instant(t) and (e == nil or instant(e)) then
      if e ~= nil and now + 0 >= e + 0 then
        return -1
      end
      if made_by ~= nil and (t + 0 > made_by + 0 or (exact and t + 0 ~= made_by + 0)) then
        return -1
      end
      local used = n + 0
      local give = math.min(used, amount + 0)
      if e == nil and give > 0 then
        if exact and used == give and give == amount + 0 then
          -- A give-back at its first call of all a first-use counter
          -- holds, in a counter no other refund marked: nothing else is
          -- spent in the period it opened, which goes with it. (A calendar
          -- counter of an older version, without e, goes too: the next
          -- charge makes it again for its window.)
          call('DEL', key)
          return 0
        end
        if not exact then
          -- A refund of another kind (support's): the count no longer
          -- tells what the requests charged still hold, and no give-back
          -- closes this period.
          call('HSET', key, 'k', '1')
        end
      end
      if give == 0 then
        return used
      end
      return call('HINCRBY', key, 'n', -give)
    end
  end
end

local S = rest()
local read, lines, batched = S.read, S.lines, S.batched
local NOT_A_COUNTER, NOT_A_NUMBER = S.NOT_A_COUNTER, S.NOT_A_NUMBER

-- Adds amount (digits) to the counter at key of kind 1 (a hash) or 2 (a
-- string) holding used, keeping its TTL (HINCRBY and INCRBY do); for kind
-- 0 (none), nil: the caller creates the counter. Checked before writing,
-- without forming used + amount (a double may round it back to 2^53): an
-- amount of 2^53 or more is refused whatever the count, since a double
-- cannot tell 2^53 + 1 from 2^53; what names the change in the error.
-- The error reply of `what`, adding `amount` to `used` on `key`, when the
-- count would go beyond 2^53; nil when it fits.
local function beyond_exact(key, used, amount, what)
  local exact = 2 ^ 53
  if amount + 0 >= exact or amount + 0 > exact - used then
    return redis.error_reply('ERR tower-quota: ' .. what .. ' of ' .. amount .. ' on ' .. key
      .. ' goes beyond 2^53, the most the counters script counts exactly')
  end
  return nil
end

local function add_exactly(key, kind, used, amount, what)
  local beyond = beyond_exact(key, used, amount, what)
  if beyond ~= nil then
    return beyond
  end
  if amount == '0' then
    return used
  end
  if kind == 1 then
    return call('HINCRBY', key, 'n', amount)
  end
  if kind == 2 then
    return call('INCRBY', key, amount)
  end
  return nil
end

if op == 'r' or op == 'a' then
  local key, amount, now = KEYS[1], ARGV[2], ARGV[3]
  if not digits(now) then
    return redis.error_reply('ERR tower-quota: an instant' .. NOT_A_NUMBER)
  end
  local kind, used, first, ends, kept = read(key)
  if kind == nil then
    return redis.error_reply('ERR tower-quota: ' .. key .. NOT_A_COUNTER)
  end
  -- Only to the counter made by this instant, if given: not to one made
  -- since (reset, and made anew by a later charge).
  local made_by = ARGV[4]
  if made_by ~= nil and not digits(made_by) then
    return redis.error_reply('ERR tower-quota: an instant' .. NOT_A_NUMBER)
  end
  -- With 'exact', only to the counter whose first call is made_by: the one
  -- a late charge's reply named, not one made since with an earlier first
  -- call (another instance's, or a request's that waited).
  local exact = ARGV[5] == 'exact'
  local made_since = made_by ~= nil and kind == 1 and first ~= nil
    and (first + 0 > made_by + 0 or (exact and first + 0 ~= made_by + 0))
  -- Live: the key exists and its window, if it records one, is not over
  -- (its key may live on through the grace).
  local live = kind ~= 0 and (ends == nil or now + 0 < ends + 0)
  if op == 'r' then
    if not digits(amount) then
      return redis.error_reply('ERR tower-quota: an amount' .. NOT_A_NUMBER)
    end
    local life = ARGV[6]
    if life ~= nil and not (exact and digits(life) and life ~= '0') then
      return redis.error_reply('ERR tower-quota: a life left' .. NOT_A_NUMBER
        .. ' above 0, or given without exact')
    end
    if not live or made_since then
      return -1
    end
    local give = math.min(used, amount + 0)
    if kind == 1 and ends == nil and give > 0 then
      -- As above: a first-use counter given back all it holds goes, unless
      -- a refund of another kind marked it; such a refund marks it.
      if exact and first ~= nil and not kept and used == give and give == amount + 0 then
        call('DEL', key)
        return 0
      end
      if not exact and not kept and first ~= nil then
        call('HSET', key, 'k', '1')
      end
    end
    if life ~= nil and kind == 1 and ends == nil and call('PTTL', key) > life + 0 then
      -- A first-use counter the late charge made: one period from the
      -- charge at the most (see the header).
      call('PEXPIRE', key, life)
    end
    if give == 0 then
      return used
    end
    if kind == 1 then
      return call('HINCRBY', key, 'n', -give)
    end
    return call('DECRBY', key, give)
  end
  if string.find(amount or '', '^%d+$') == nil then
    return redis.error_reply('ERR tower-quota: the amount to add is not a whole number')
  end
  if not live or made_since then
    -- Nothing live to add to: the counter expired, its window ended, or it
    -- never was (INCRBY would create it without a deadline); or it was
    -- made since.
    return -1
  end
  if not digits(amount) then
    return redis.error_reply('ERR tower-quota: an add of ' .. amount .. ' on ' .. key
      .. ' goes beyond 2^53, the most the counters script counts exactly')
  end
  return add_exactly(key, kind, used, amount, 'an add')
end

if op == 's' then
  local key, amount, now = KEYS[1], ARGV[2], ARGV[3]
  local anchor, ttl, ends, first = ARGV[4], ARGV[5], ARGV[6], ARGV[7]
  if not instant(now) or not instant(first) then
    return redis.error_reply('ERR tower-quota: an instant' .. NOT_A_NUMBER)
  end
  if anchor ~= 'f' and anchor ~= 'c' then
    return redis.error_reply('ERR tower-quota: an anchor that is neither f nor c')
  end
  -- A calendar window's end, or the debt's first-use deadline.
  if not instant(ends) then
    return redis.error_reply('ERR tower-quota: a window end' .. NOT_A_NUMBER)
  end
  if not digits(ttl) or ttl == '0' then
    return redis.error_reply('ERR tower-quota: a ttl' .. NOT_A_NUMBER)
  end
  if not digits(amount) then
    return redis.error_reply('ERR tower-quota: the amount to settle' .. NOT_A_NUMBER)
  end
  -- A first-use counter whose first call is the debt's first request (made
  -- by this settle, or by that request's charge) ends at the debt's
  -- deadline, by this settle's instant: one instance's clock reckons all
  -- three, and its skew, if any, shortens nothing. The counter's time to
  -- live was reckoned when the call that made it was sent, and Redis may
  -- have run that call late (sent while it stalled, run once it resumed:
  -- the charge, or this very settle, whose answer was lost and which the
  -- ledger sends again): it would end that much later, and its subject,
  -- past its limit with the debt, be refused past the period's end. (A
  -- counter a late charge of another request made is trimmed by that
  -- charge's give-back.) Only ever shortened; left alone when the deadline
  -- is past by this instant.
  local function bound(dated)
    if anchor ~= 'f' or dated ~= first then
      return
    end
    local due = ends - now
    if due >= 1 and call('PTTL', key) > due then
      call('PEXPIRE', key, string.format('%d', due))
    end
  end
  local mark = KEYS[2]
  if mark ~= nil and call('EXISTS', mark) == 1 then
    -- Added already, by this very settle (the answer to it was lost):
    -- nothing more, and the answer is what the counter holds.
    local kind, used, dated = read(key)
    if kind == nil then
      return redis.error_reply('ERR tower-quota: ' .. key .. NOT_A_COUNTER)
    end
    if kind == 0 then
      return { 0, -1 }
    end
    bound(dated)
    return { used, dated and dated + 0 or -1 }
  end
  local at = now + 0
  -- The reply: the count afterwards (-1 when nothing was written), and
  -- the counter's first call (-1 when it has none), which a give-back of
  -- a settle Redis applied after its caller stopped waiting goes by.
  if anchor == 'c' and at >= ends + 0 then
    -- The debt's window is over: never charged to a later one.
    return { -1, -1 }
  end
  local kind, used, dated, recorded = read(key)
  if kind == nil then
    return redis.error_reply('ERR tower-quota: ' .. key .. NOT_A_COUNTER)
  end
  -- A counter over by the window end it records, which the debt's window
  -- outlasts (checked above): instances that disagree on the window of one
  -- stamp. Replaced by the debt's, as a charge replaces it; written below.
  local replace = kind ~= 0 and recorded ~= nil and at >= recorded + 0
  if replace then
    kind, used, dated = 0, 0, nil
  end
  if anchor == 'f' and kind ~= 0 and dated ~= nil and dated + 0 >= ends + 0 then
    -- A first-use period opened at or past the debt's deadline (by an
    -- instance whose clock is ahead, or a charge the settle waited
    -- behind): never charged to a period after the debt's own.
    return { -1, -1 }
  end
  -- A first-use counter without its deadline (another tool took it) is
  -- healed as a charge heals it, by its first call and the debt's period:
  -- dated again, or, its period long over, as good as expired (the debt
  -- then opens a counter of its own, below). Decided first, written once
  -- the count is known to fit.
  local heal = nil
  if anchor == 'f' and kind ~= 0 and call('PTTL', key) == -1 then
    -- The period: the debt's deadline less its first call (`ttl` is what
    -- is left of the debt's).
    local length = ends - first
    if dated == nil then
      -- First call unknown: a period from now, as a charge dates it.
      heal = length
    elseif dated + length > at then
      -- Never more than one period from now (see `lines`).
      heal = math.min(dated + length - at, length)
    else
      heal = 'gone'
      kind, used, dated = 0, 0, nil
    end
  end
  if amount == '0' then
    -- A debt of nothing writes nothing (no heal, no replacement), and
    -- answers what the counter holds.
    if kind == 0 then
      return { 0, -1 }
    end
    return { used, dated and dated + 0 or -1 }
  end
  local beyond = beyond_exact(key, used, amount, 'a settle')
  if beyond ~= nil then
    return beyond
  end
  if heal == 'gone' or replace then
    call('DEL', key)
  elseif heal ~= nil then
    call('PEXPIRE', key, heal)
  end
  local added = add_exactly(key, kind, used, amount, 'a settle')
  if type(added) == 'table' then
    -- An error reply.
    return added
  end
  if mark ~= nil then
    call('SET', mark, '1', 'PX', ttl + 60000)
  end
  if added ~= nil then
    bound(dated)
    return { added, dated and dated + 0 or -1 }
  end
  -- A new counter, as a charge creates one: its first call (the debt's
  -- for first use, now for a calendar window), a calendar window's end,
  -- and its deadline, all in this call.
  local made, fields = first, nil
  if anchor == 'c' then
    made = now
    fields = { 'n', amount, 't', made, 'e', ends }
  else
    fields = { 'n', amount, 't', made }
  end
  call('HSET', key, unpack(fields))
  call('PEXPIRE', key, ttl)
  return { amount + 0, made + 0 }
end

if op == 'c' then
  return lines(0, #KEYS, ARGV[2], 2, true)
end

if op == 'p' then
  return lines(0, #KEYS, ARGV[2], 2, false)
end

if op == 'x' then
  if #ARGV ~= 2 + 6 * #KEYS then
    return redis.error_reply('ERR tower-quota: a malformed charge taking units')
  end
  return lines(0, #KEYS, ARGV[2], 2, true, nil, 2 + 5 * #KEYS)
end

if op == 'b' then
  -- The layout first: a malformed batch runs no charge. Per charge: its
  -- number of lines, where its instant is, where its lines' arguments
  -- start (its instant's place, or the charge before's), and its ttl when
  -- it gives one of its own.
  local nkeys, nargs = #KEYS, #ARGV
  local counts, nows, lines_at, ttls = {}, {}, {}, {}
  local k, a, i = 0, 2, 0
  local group = nil
  while a <= nargs do
    local n = ARGV[a]
    i = i + 1
    if n == '=' then
      -- One line, as the charge before; its instant and ttl follow.
      if group == nil or counts[i - 1] ~= 1 or k >= nkeys or a + 2 > nargs then
        return redis.error_reply('ERR tower-quota: a malformed batch of charges')
      end
      counts[i], nows[i], lines_at[i], ttls[i] = 1, a + 1, group, ARGV[a + 2]
      k = k + 1
      a = a + 3
    else
      if n == '1' then
        n = 1
      elseif digits(n) and n ~= '0' then
        n = n + 0
      else
        n = nil
      end
      if n == nil or k + n > nkeys or a + 1 + 5 * n > nargs then
        return redis.error_reply('ERR tower-quota: a malformed batch of charges')
      end
      group = a + 1
      counts[i], nows[i], lines_at[i], ttls[i] = n, group, group, false
      k = k + n
      a = a + 2 + 5 * n
    end
  end
  if k ~= nkeys then
    return redis.error_reply('ERR tower-quota: a malformed batch of charges')
  end
  -- One flat reply: each charge's reply after the one before.
  local out = {}
  k = 0
  for c = 1, i do
    local n, now, group = counts[c], ARGV[nows[c]], lines_at[c]
    if n ~= 1 or not one(k, now, group, out) then
      batched(out, k, n, now, group, ttls[c] or nil)
    end
    k = k + n
  end
  return out
end

return redis.error_reply('ERR tower-quota: unknown operation')
