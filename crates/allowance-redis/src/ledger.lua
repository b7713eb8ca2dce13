#!lua name=LIBRARY_NAME
-- allowance: the ledger's rules as one Redis function library (SEMANTICS.md).
--
-- Loaded once per server (FUNCTION LOAD; the Rust side names the library and
-- its function after a hash of this text, so versions never collide), then
-- one FCALL, one round trip, per operation: args[1] is a MessagePack map
-- built by the Rust store (src/wire.rs), the reply a MessagePack map. Every
-- operation checks everything first and writes only once nothing can fail;
-- a refusal writes nothing but the expiries it observed (which any
-- operation would have written).
--
-- Arithmetic: Lua numbers are doubles, exact for integers up to 2^53, the
-- engine's largest amount. Amounts and window states are kept inside
-- MessagePack blobs (exact integers), never formatted by tostring (14
-- digits). A bucket's deficit is kept as (u, f): u·period + f with
-- 0 ≤ f < period, so refills and retry times stay exact integers.
--
-- Keys (B = prefix .. "{t<tenant tag, 2 hex>}", SB = B, or
-- prefix .. "{s<tag of the scope's name, 2 hex>}" for a shared scope; every
-- group, tenant or shared, also has G:cv and G:u below):
--   B:r:<id>      a reservation record (MessagePack)
--   B:x           zset: HELD reservations by expiry
--   B:d           zset: ended reservations by the instant they are forgotten
--   B:i:<tenant>\n<key>  an idempotency key -> reservation id
--   B:n           hash: expired (reservations expired, ever; HELD ones are ZCARD B:x)
--   SB:s:<scope>  a scope: {at, hc, h = held per dimension, l = windows}
--   SB:h:<scope>  zset: the scope's HELD reservations by expiry
--   G:cv          the catalog version this group has been told of
--   G:u           stream: the group's part of the usage log (a cluster;
--                 a single node keeps one stream, prefix{u}:u)
--   prefix{c}:cat list: the catalog's admin changes (its length: the version)

-- The call in progress (functions run one at a time): its request, key
-- prefix and instant, set by `handle` below.
local req, P, now

local function I(n) return string.format('%d', n) end
-- The libraries (cmsgpack, math) are reachable only when a function runs,
-- not while the library loads: bound by `handle`.
local pack, unpack
local floor, max, min

local function reply(t) return pack(t) end

-- A stored blob, or a script error before any write: cmsgpack reads
-- garbage as a number rather than failing, so the type is checked.
local function decode(raw, key)
  local ok, v = pcall(unpack, raw)
  if not ok or type(v) ~= 'table' then
    error('allowance: unreadable value at ' .. key)
  end
  return v
end

-- a·b = q·m + r (0 ≤ r < m), exact while q < 2^53 (larger q only saturate).
local TWO53 = 9007199254740992
local function divmod(p, m)
  local q = floor(p / m)
  local r = p - q * m
  if r < 0 then q = q - 1; r = r + m elseif r >= m then q = q + 1; r = r - m end
  return q, r
end
local function mulmod_small(a, b, m)
  -- a, b < m < 2^52: shift-and-add keeps every value below 2m.
  local bits = {}
  while b > 0 do
    local bit = b % 2
    bits[#bits + 1] = bit
    b = (b - bit) / 2
  end
  local q, r = 0, 0
  for i = #bits, 1, -1 do
    q = q * 2; r = r * 2
    if r >= m then r = r - m; q = q + 1 end
    if bits[i] == 1 then
      r = r + a
      if r >= m then r = r - m; q = q + 1 end
    end
  end
  return q, r
end
local function muldivmod(a, b, m)
  if a == 0 or b == 0 then return 0, 0 end
  local p = a * b
  if p < TWO53 then return divmod(p, m) end
  local a1, a0 = divmod(a, m)
  local b1, b0 = divmod(b, m)
  local q0, r0
  if a0 * b0 < TWO53 then q0, r0 = divmod(a0 * b0, m) else q0, r0 = mulmod_small(a0, b0, m) end
  return a1 * b1 * m + a1 * b0 + a0 * b1 + q0, r0
end
-- ⌈(a·b + c) / m⌉ with c < m·2^20.
local function ceil_muladd_div(a, b, c, m)
  local q, r = muldivmod(a, b, m)
  local q2, r2 = divmod(r + c, m)
  q = q + q2
  if r2 > 0 then q = q + 1 end
  return q
end

-- Windows ------------------------------------------------------------------

local function fresh(L)
  local k = L.k
  if k == 's' then return {k = 's', w = L.w, n = L.n, t = 0, s = {}}
  elseif k == 'b' then return {k = 'b', P = L.P, C = L.c, u = 0, f = 0}
  elseif k == 'c' then return {k = 'c', e = L.ce, u = 0}
  elseif k == 't' then return {k = 't', u = 0}
  end
  return {k = 'n'}
end

local function advance(st, L, from, to)
  local k = st.k
  if k == 's' then
    local cur = floor(to / st.w)
    if st.lc == cur then return end
    st.lc = cur
    local oldest = cur - st.n
    for slice, v in pairs(st.s) do
      if slice <= oldest then st.s[slice] = nil; st.t = st.t - v end
    end
  elseif k == 'b' then
    -- Up to now at the capacity it was written under (a plan change takes
    -- effect at the scope's next write, as in the engine), then the plan's.
    if (st.u > 0 or st.f > 0) and to > from then
      local q, r = muldivmod(st.C, to - from, st.P)
      if q > st.u or (q == st.u and r >= st.f) then
        st.u, st.f = 0, 0
      else
        local u, f = st.u - q, st.f - r
        if f < 0 then f = f + st.P; u = u - 1 end
        st.u, st.f = u, f
      end
    end
    st.C = L.c
  elseif k == 'c' then
    if to >= st.e then st.u = 0; st.e = L.ce end
  end
end

local function used(st)
  local k = st.k
  if k == 's' then return st.t
  elseif k == 'b' then if st.f > 0 then return st.u + 1 end return st.u
  elseif k == 'c' or k == 't' then return st.u
  end
  return 0
end

local function record(st, amount)
  if amount == 0 then return end
  local k = st.k
  if k == 's' then
    local cur = floor(now / st.w)
    st.s[cur] = (st.s[cur] or 0) + amount
    st.t = st.t + amount
  elseif k == 'b' or k == 'c' or k == 't' then
    st.u = st.u + amount
  end
end

-- Records usage that happened at `at` (an import's end instant, before
-- now): a sliding window counts it in its own slice, a calendar window in
-- its own period (`L.cs` starts the current one), so what has left the
-- window since counts no more. A bucket counts it as of now: the refill
-- since `at` is not credited (too much, never too little, for a while).
local function record_at(st, L, amount, at)
  if amount == 0 or at >= now then return record(st, amount) end
  local k = st.k
  if k == 's' then
    local slice = floor(at / st.w)
    if slice <= floor(now / st.w) - st.n then return end
    st.s[slice] = (st.s[slice] or 0) + amount
    st.t = st.t + amount
  elseif k == 'c' and at < L.cs then
    return
  else
    record(st, amount)
  end
end

local function sorted_slices(st, from, to)
  local ks = {}
  for slice, v in pairs(st.s) do
    if slice >= from and slice <= to and v > 0 then ks[#ks + 1] = slice end
  end
  table.sort(ks)
  return ks
end

-- ms from now until usage alone falls to `target` (nil: never by itself).
local function ms_until(st, target)
  local k = st.k
  if k == 's' then
    local w, n = st.w, st.n
    local cur = floor(now / w)
    local left = st.t
    for _, slice in ipairs(sorted_slices(st, cur + 1 - n, cur)) do
      left = left - st.s[slice]
      if left <= target then return max((slice + n) * w - now, 0) end
    end
    return max((cur + n) * w - now, 0)
  elseif k == 'b' then
    -- deficit − target·P = (u − target)·P + f
    return ceil_muladd_div(st.u - target, st.P, st.f, st.C)
  elseif k == 'c' then
    return max(st.e - now, 0)
  end
  return nil
end

local function resets_at(st)
  local k = st.k
  if k == 's' then
    if st.t == 0 then return nil end
    local cur = floor(now / st.w)
    local ks = sorted_slices(st, cur + 1 - st.n, cur)
    if #ks == 0 then return nil end
    return (ks[1] + st.n) * st.w
  elseif k == 'b' then
    if st.u == 0 and st.f == 0 then return nil end
    return now + ceil_muladd_div(st.u, st.P, st.f, st.C)
  elseif k == 'c' then
    return st.e
  end
  return nil
end

-- When the window holds nothing if nothing new happens (false: never).
local function empty_at(st)
  local k = st.k
  if k == 's' then
    if st.t == 0 then return now end
    local cur = floor(now / st.w)
    local ks = sorted_slices(st, cur + 1 - st.n, cur)
    if #ks == 0 then return now end
    return (ks[#ks] + st.n) * st.w
  elseif k == 'b' then
    return resets_at(st) or now
  elseif k == 'c' then
    if st.u == 0 then return now end
    return st.e
  elseif k == 't' then
    if st.u == 0 then return now end
    return false
  end
  return now
end

-- Scopes -------------------------------------------------------------------

local function has_any(t)
  for _, v in pairs(t) do if v ~= 0 then return true end end
  return false
end

-- Stores a scope; one that holds nothing and whose windows are empty is
-- dropped, and an idle one expires when its windows will be empty (with
-- the server's clock only: under an injected clock keys never expire).
local function store_scope(key, S)
  if S.hc == 0 and not has_any(S.h) then
    local at = now
    for _, st in pairs(S.l) do
      local e = empty_at(st)
      if e == false then at = false; break end
      at = max(at, e)
    end
    if at ~= false and at <= now then
      redis.call('DEL', key)
      return
    end
    if at ~= false and not req.now then
      redis.call('SET', key, pack(S), 'PX', I(at - now + 1000))
      return
    end
  end
  redis.call('SET', key, pack(S))
end

local function empty_scope()
  return {at = now, hc = 0, h = {}, l = {}}
end

-- A scope's state with its windows for `lims` (the current plan's limits,
-- from the Rust side), advanced to now. Windows of limits no longer in the
-- plan are dropped when it is stored; those whose dimension and window stay
-- keep their history (the limit's id names both).
-- A sliding limit whose slices alone changed (same dimension and period)
-- keeps its history, cut into the new slices as the engine does
-- (window::reslice): each old slice's usage goes to the new slice holding
-- its last instant (at most now; never before the new window's oldest), so
-- none leaves the window earlier than it would have. The finest old window
-- of that dimension and period is the one carried.
local function resliced(S, L, from)
  local best
  for id, o in pairs(S.l) do
    if o.k == 's' and o.w * o.n == L.w * L.n and string.sub(id, 1, #L.d + 1) == L.d .. '|'
      and (best == nil or o.n > best.n) then
      best = o
    end
  end
  if best == nil then return nil end
  advance(best, L, from, now)
  local st = fresh(L)
  local oldest = floor(now / L.w) - L.n + 1
  for slice, v in pairs(best.s) do
    local k = floor(min((slice + 1) * best.w - 1, now) / L.w)
    if k < oldest then k = oldest end
    st.s[k] = (st.s[k] or 0) + v
    st.t = st.t + v
  end
  return st
end

local function load_scope(sc)
  local key = sc.b .. ':s:' .. sc.n
  local raw = redis.call('GET', key)
  local S
  if raw then S = decode(raw, key) else S = empty_scope() end
  local states = {}
  local from = S.at
  for i, L in ipairs(sc.lims) do
    local st = S.l[L.id]
    if st == nil and L.k == 's' then st = resliced(S, L, from) end
    if st == nil then st = fresh(L) end
    advance(st, L, from, now)
    states[i] = st
  end
  if now > S.at then S.at = now end
  return {S = S, states = states, key = key, hkey = sc.b .. ':h:' .. sc.n, lims = sc.lims, b = sc.b}
end

-- A scope's state as stored, its windows not advanced (nil if absent): for
-- an operation that changes only holds (a release, an undone raise), which
-- leaves the scope on the plan it was last written under, as the engine does.
local function load_raw(sc)
  local key = sc.b .. ':s:' .. sc.n
  local raw = redis.call('GET', key)
  local S
  if raw then S = decode(raw, key) end
  return {S = S, key = key, hkey = sc.b .. ':h:' .. sc.n}
end

local function save_scope(x)
  local l = {}
  for i, L in ipairs(x.lims) do
    if L.k ~= 'n' then l[L.id] = x.states[i] end
  end
  x.S.l = l
  store_scope(x.key, x.S)
end

local function held_of(S, L)
  if L.im then return S.hc end
  return S.h[L.d] or 0
end

local function earliest(hkey)
  local e = redis.call('ZRANGE', hkey, 0, 0, 'WITHSCORES')
  if e[2] then return tonumber(e[2]) end
  return nil
end

local function add_map(a, b, sign)
  for d, v in pairs(b) do
    local n = (a[d] or 0) + sign * v
    if n == 0 then a[d] = nil else a[d] = n end
  end
end

-- Records and expiry ---------------------------------------------------------

local function base_of(id)
  return P .. '{t' .. string.sub(id, -2) .. '}'
end

-- The usage stream an event of a group goes to: on a single node one
-- stream for all (commit order exactly); on a cluster the group's own.
local function usage_key(group_base)
  if req.cl then return group_base .. ':u' end
  return P .. '{u}:u'
end

-- Tells the servers sharing this Redis that room may have freed (their
-- admission queues look again); once per script.
local told
local function room_freed()
  if not told then
    told = true
    redis.call('PUBLISH', P .. 'freed', '')
  end
end

-- Appends to a usage stream. A cursor holds 13 bits of an entry id's
-- sequence (`UsagePos` in lib.rs): `*` counts past that when the stream's
-- last id is ahead of the server's clock (a clock stepped back, a failover
-- to a host behind) and 8,192 entries fall in its millisecond. Such an
-- entry is moved to the next millisecond, so every entry stays readable
-- (one past the bound made every read of the log fail).
local function usage_add(key, ...)
  local id = redis.call('XADD', key, 'MAXLEN', '~', I(req.um), '*', ...)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  if seq and tonumber(seq) >= 8192 then
    redis.call('XDEL', key, id)
    redis.call('XADD', key, 'MAXLEN', '~', I(req.um), string.format('%.0f-0', tonumber(ms) + 1), ...)
  end
end

local function usage_event(kind, at, rec)
  room_freed()
  usage_add(usage_key(base_of(rec.id)), 'k', kind, 'at', I(at), 'r', pack(rec))
end

-- Queues an ended reservation to be forgotten after its retention.
local function schedule_drop(base, rec, from)
  local keep = req.re
  if rec.ik then keep = max(req.re, req.ri) end
  rec.da = from + keep
  redis.call('ZADD', base .. ':d', I(rec.da), rec.id)
end

-- Takes one hold (amounts `h` of reservation `id`) off each of `scopes`
-- ({b, n} each), on the state as stored: the windows are not read, so the
-- scopes stay on the plan they were last written under, as in the engine.
-- Every scope is read before the first write: a corrupted one fails the
-- script with nothing changed.
local function drop_hold(scopes, h, id)
  local loaded = {}
  for i, sc in ipairs(scopes) do loaded[i] = load_raw(sc) end
  for _, x in ipairs(loaded) do
    if x.S then
      x.S.hc = x.S.hc - 1
      add_map(x.S.h, h, -1)
      store_scope(x.key, x.S)
    end
    redis.call('ZREM', x.hkey, id)
  end
end

-- Records each scope's charges (`L.a` of every limit, set by `req`) and,
-- when the reservation still `held`, takes its hold (amounts `h`, id `id`)
-- off: the settle of `scopes` ({b, n, ...} each). Every scope is read before
-- the first write: a corrupted one fails the script with nothing changed.
local function record_charges(scopes, h, id, held, at)
  local loaded = {}
  for i, sc in ipairs(scopes) do loaded[i] = load_scope(sc) end
  for _, s in ipairs(loaded) do
    for li, L in ipairs(s.lims) do
      if at then record_at(s.states[li], L, L.a or 0, at) else record(s.states[li], L.a or 0) end
    end
    if held then
      s.S.hc = s.S.hc - 1
      add_map(s.S.h, h, -1)
      redis.call('ZREM', s.hkey, id)
    end
    save_scope(s)
  end
end

-- Releases a HELD reservation's hold on every scope (its windows
-- untouched).
local function release(rec, home)
  -- On a cluster a script reaches only its own group: a reservation's
  -- holds on shared scopes are released by their groups (ops.fend).
  local scopes = {}
  for i, name in ipairs(rec.sc) do
    if not req.cl or rec.sb[i] == home then scopes[#scopes + 1] = {b = rec.sb[i], n = name} end
  end
  drop_hold(scopes, rec.h, rec.id)
end

local function expire(rec, base)
  release(rec, base)
  if rec.sh then
    -- A shadow hold (ops.shadow) only ever held room: it ends without a
    -- trace, its reservation is recorded by its import.
    redis.call('DEL', base .. ':r:' .. rec.id)
    redis.call('ZREM', base .. ':x', rec.id)
    return
  end
  rec.st = 'expired'
  rec.e = rec.x
  -- Retention counts from the expiry itself, as in the engine.
  schedule_drop(base, rec, rec.x)
  redis.call('SET', base .. ':r:' .. rec.id, pack(rec))
  redis.call('ZREM', base .. ':x', rec.id)
  redis.call('HINCRBY', base .. ':n', 'expired', 1)
  usage_event('expired', rec.x, rec)
end

local function expire_id(id)
  local base = base_of(id)
  local rkey = base .. ':r:' .. id
  local raw = redis.call('GET', rkey)
  if not raw then
    redis.call('ZREM', base .. ':x', id)
    return
  end
  local rec = decode(raw, rkey)
  if rec.st == 'held' and rec.x <= now then expire(rec, base) end
end

-- Expires what is due in one tenant group, and forgets what is past its
-- retention (at most `limit` of each: the sweeper takes the rest).
local function observe_tag(base, limit)
  local due = redis.call('ZRANGEBYSCORE', base .. ':x', '-inf', I(now), 'LIMIT', 0, limit)
  for _, id in ipairs(due) do expire_id(id) end
  return #due
end

-- Forgets a group's ended reservations past their retention (the sweeper's
-- work: every read also treats one past its retention as gone).
local function forget_due(base, limit)
  local gone = redis.call('ZRANGEBYSCORE', base .. ':d', '-inf', I(now), 'LIMIT', 0, limit)
  for _, id in ipairs(gone) do
    local rkey = base .. ':r:' .. id
    local raw = redis.call('GET', rkey)
    if raw then
      local rec = decode(raw, rkey)
      if rec.st ~= 'held' then
        redis.call('DEL', rkey)
        if rec.ik then
          local ikey = base .. ':i:' .. rec.tn .. '\n' .. rec.ik
          if redis.call('GET', ikey) == id then redis.call('DEL', ikey) end
        end
      end
    end
    redis.call('ZREM', base .. ':d', id)
  end
end

-- A foreign hold (a cluster's hold on a shared scope, kept in the scope's
-- group as G:f:<id>) that is due expires in its group, by itself.
local function expire_foreign(g, id)
  local fkey = g .. ':f:' .. id
  local raw = redis.call('GET', fkey)
  if not raw then
    redis.call('ZREM', g .. ':fx', id)
    return
  end
  local f = decode(raw, fkey)
  if f.st == 'held' and f.x <= now then
    release(f, g)
    room_freed()
    f.st = 'expired'
    redis.call('SET', fkey, pack(f))
    redis.call('ZREM', g .. ':fx', id)
    redis.call('ZADD', g .. ':fd', I(f.x + req.re), id)
  end
end

local function is_shared_base(b)
  return string.find(b, '{s', 1, true) ~= nil
end

-- Whether a reservation has holds in shared groups (a cluster's).
local function has_foreign(rec)
  if not req.cl then return false end
  for _, b in ipairs(rec.sb) do
    if is_shared_base(b) then return true end
  end
  return false
end

-- Every hold on a scope that is due expires before the scope is read.
local function observe_scope(sc)
  local due = redis.call('ZRANGEBYSCORE', sc.b .. ':h:' .. sc.n, '-inf', I(now))
  local foreign = req.cl and is_shared_base(sc.b)
  for _, id in ipairs(due) do
    if foreign then expire_foreign(sc.b, id) else expire_id(id) end
  end
end

-- The scopes' due holds, before they are read. A tenant-namespaced scope's
-- holds all belong to reservations of its tenant group: when the group's
-- expiries were all just observed (`seen_all`), it has none due left.
local function observe_scopes(scopes, base, seen_all)
  for _, sc in ipairs(scopes) do
    if not (seen_all and sc.b == base) then observe_scope(sc) end
  end
end

-- A record, its expiry observed.
-- Whether an ended record is past its retention: gone, whatever the
-- sweeper has deleted yet.
local function forgotten(rec)
  return rec.st ~= 'held' and rec.da ~= nil and now >= rec.da
end

local function load_record(base, id)
  local rkey = base .. ':r:' .. id
  local raw = redis.call('GET', rkey)
  if not raw then return nil end
  local rec = decode(raw, rkey)
  if rec.st == 'held' and rec.x <= now then expire(rec, base) end
  -- A shadow hold is not a reservation of Redis's: its reservation lives
  -- in the instance that admitted it until it ends (the second value says
  -- so: the caller answers 'elsewhere', a retry, not 'not found').
  if rec.sh then return nil, true end
  if forgotten(rec) then return nil end
  return rec
end

-- Checks -------------------------------------------------------------------

-- Most holds a denial looks at for the earliest one holding the refused
-- dimension: the engine's bound (HOLD_WALK in allowance-core's shard.rs).
local HOLD_WALK = 64

-- What hold `id` on scope `x` holds, by dimension name (nil: nothing
-- found). On a cluster a shared scope's holds are its group's foreign
-- holds; otherwise the reservation's record (a shadow hold's too).
local function hold_amounts(x, id)
  local key
  if req.cl and is_shared_base(x.b) then key = x.b .. ':f:' .. id else key = base_of(id) .. ':r:' .. id end
  local raw = redis.call('GET', key)
  if not raw then return nil end
  return decode(raw, key).h
end

-- When the earliest hold on scope `x` that holds some of L's dimension
-- expires (every hold holds the implied ones), `skip`'s aside (an
-- extend's own hold never frees room for its raise). As the engine
-- (ScopeState::earliest_holding): at most HOLD_WALK holds are looked at
-- in expiry order, `skip`'s counted; if none of them holds the dimension,
-- the expiry of the last one looked at (nil: the scope holds nothing).
local function earliest_holding(x, L, skip)
  local e = redis.call('ZRANGE', x.hkey, 0, HOLD_WALK - 1, 'WITHSCORES')
  local last
  for i = 1, #e, 2 do
    local id, at = e[i], tonumber(e[i + 1])
    last = at
    if id ~= skip then
      if L.im then return at end
      local h = hold_amounts(x, id)
      if h and (h[L.d] or 0) > 0 then return at end
    end
  end
  return last
end

local RANK = {rate = 0, budget = 1, exceeds = 2}

local function beats(c, b)
  if RANK[c.kind] ~= RANK[b.kind] then return RANK[c.kind] > RANK[b.kind] end
  return c.kind == 'rate' and (c.ra or -1) > (b.ra or -1)
end

-- The binding denial among every limit of every scope (nil: all fit).
-- With only_positive, limits asked for nothing are skipped (an extend);
-- `own` (by dimension name) is what the extended reservation `skip` holds
-- already: a raise that with it passes a whole capacity can never fit
-- (exceeds, its q the whole hold), and its hold, which cannot end while it
-- is extended, counts as usage. The rule is the engine's check_scope
-- (docs/ENGINE-CHOICES.md, "Denials"): with free = c − own − q, usage
-- above free that never leaves (a total) is a hard stop (budget); a
-- request that fits beside the holds once usage leaves waits for that;
-- otherwise holds block: the earliest other hold holding the dimension,
-- and no earlier than usage falls to free. A hold-based retry gives the
-- denial its hold's expiry as `rs` where the window has none.
local function check(scopes, only_positive, own, skip)
  local best
  for si, x in ipairs(scopes) do
    for li, L in ipairs(x.lims) do
      local q = L.q or 0
      if not (only_positive and q == 0) then
        local held = held_of(x.S, L)
        local st = x.states[li]
        local u = used(st)
        local room = L.c - u - held
        if q > room then
          local kind, ra, due
          local o = 0
          if own then o = own[L.d] or 0 end
          if q > L.c then
            kind = 'exceeds'
          elseif q + o > L.c then
            kind = 'exceeds'
            q = q + o
          else
            local free = L.c - o - q
            local um = 0
            if u > free then um = ms_until(st, free) end
            local beside
            if held <= L.c and q <= L.c - held then beside = ms_until(st, L.c - held - q) end
            if um == nil then
              kind = 'budget'
            elseif beside then
              kind = 'rate'; ra = max(beside, 1)
            else
              due = earliest_holding(x, L, skip)
              local hm = 1
              if due then hm = max(due - now, 0) end
              kind = 'rate'; ra = max(hm, um, 1)
            end
          end
          local rs
          if L.k ~= 'n' then rs = resets_at(st) end
          if rs == nil then rs = due end
          local c = {kind = kind, ra = ra, s = si, l = li, cap = L.c, rem = room, q = q, rs = rs}
          if best == nil or beats(c, best) then best = c end
        end
      end
    end
  end
  return best
end

-- Every limit's use, hold and reset, scope by scope.
local function report(scopes)
  local out = {}
  for si, x in ipairs(scopes) do
    local e = earliest(x.hkey)
    local ls = {}
    for li, L in ipairs(x.lims) do
      local st = x.states[li]
      local rs
      if L.k == 'n' then rs = e else rs = resets_at(st) end
      ls[li] = {u = used(st), h = held_of(x.S, L), r = rs}
    end
    out[si] = ls
  end
  return out
end

-- Calendar bounds come from the Rust side (it knows the zones): they must
-- hold `now`, or it asks again with the server's instant.
local function calendars_hold(scopes)
  for _, sc in ipairs(scopes) do
    for _, L in ipairs(sc.lims) do
      if L.k == 'c' and not (L.cs <= now and now < L.ce) then return false end
    end
  end
  return true
end

-- Operations ---------------------------------------------------------------

local ops = {}

function ops.reserve()
  if not calendars_hold(req.scopes) then return reply({t = 'cal', now = now}) end
  local base = req.b
  local seen_all = observe_tag(base, 64) < 64
  local ikey
  if req.ik then
    ikey = base .. ':i:' .. req.tn .. '\n' .. req.ik
    local rid = redis.call('GET', ikey)
    if rid then
      local rec = load_record(base, rid)
      if rec and not (rec.e and now >= rec.e + req.ri) then
        if rec.fp ~= req.fp then return reply({t = 'idem'}) end
        return reply({t = 'ok', replay = true, rec = rec})
      end
    end
  end
  if redis.call('EXISTS', base .. ':r:' .. req.id) == 1 then return reply({t = 'dup'}) end
  observe_scopes(req.scopes, base, seen_all)
  local scopes = {}
  for i, sc in ipairs(req.scopes) do scopes[i] = load_scope(sc) end
  local denial = check(scopes, false)
  if denial then return reply({t = 'deny', d = denial}) end
  local x = now + req.ttl
  if req.dry then
    return reply({t = 'ok', dry = true, now = now, x = x, rem = report(scopes)})
  end
  for _, s in ipairs(scopes) do
    s.S.hc = s.S.hc + 1
    add_map(s.S.h, req.h, 1)
    redis.call('ZADD', s.hkey, I(x), req.id)
    save_scope(s)
  end
  local rec = req.rec
  rec.st = 'held'
  rec.cr = now
  rec.x = x
  rec.v = 1
  redis.call('SET', base .. ':r:' .. req.id, pack(rec))
  redis.call('ZADD', base .. ':x', I(x), req.id)
  if ikey then redis.call('SET', ikey, req.id) end
  local rem
  if req.rr then rem = report(scopes) end
  -- The caller sent the record: it learns what the script stamped on it
  -- (held, created now, version 1, expiry x), not the record again, which
  -- would cost a packing of it on every reserve.
  return reply({t = 'ok', now = now, x = x, rem = rem})
end

function ops.settle()
  local base = req.b
  if not calendars_hold(req.scopes) then return reply({t = 'cal', now = now}) end
  local seen_all = observe_tag(base, 64) < 64
  local rec, away = load_record(base, req.id)
  if away then return reply({t = 'elsewhere'}) end
  if not rec then return reply({t = 'nf'}) end
  if rec.st == 'settled' then return reply({t = 'ok', rec = rec}) end
  if rec.st == 'refunded' then return reply({t = 'conflict', st = rec.st}) end
  -- The charges were worked out from this version of the record.
  if rec.v ~= req.v then return reply({t = 'retry'}) end
  local held = rec.st == 'held'
  observe_scopes(req.scopes, base, seen_all)
  record_charges(req.scopes, rec.h, rec.id, held)
  if held then
    redis.call('ZREM', base .. ':x', rec.id)
  end
  rec.late = not held
  rec.st = 'settled'
  rec.e = now
  rec.c = req.c
  schedule_drop(base, rec, now)
  if has_foreign(rec) then redis.call('ZADD', base .. ':p', I(now), rec.id) end
  redis.call('SET', base .. ':r:' .. rec.id, pack(rec))
  usage_event('settled', now, rec)
  return reply({t = 'ok', rec = rec})
end

function ops.refund()
  local base = req.b
  observe_tag(base, 64)
  local rec, away = load_record(base, req.id)
  if away then return reply({t = 'elsewhere'}) end
  if not rec then return reply({t = 'nf'}) end
  if rec.st == 'settled' then return reply({t = 'conflict', st = rec.st}) end
  if rec.st ~= 'held' then return reply({t = 'ok', rec = rec}) end
  release(rec, base)
  redis.call('ZREM', base .. ':x', rec.id)
  rec.st = 'refunded'
  rec.e = now
  schedule_drop(base, rec, now)
  if has_foreign(rec) then redis.call('ZADD', base .. ':p', I(now), rec.id) end
  redis.call('SET', base .. ':r:' .. rec.id, pack(rec))
  usage_event('refunded', now, rec)
  return reply({t = 'ok', rec = rec})
end

function ops.extend()
  local base = req.b
  if not calendars_hold(req.scopes) then return reply({t = 'cal', now = now}) end
  local seen_all = observe_tag(base, 64) < 64
  local rec, away = load_record(base, req.id)
  if away then return reply({t = 'elsewhere'}) end
  if not rec then return reply({t = 'nf'}) end
  if rec.st ~= 'held' then return reply({t = 'notheld', st = rec.st}) end
  if rec.v ~= req.v then return reply({t = 'retry'}) end
  observe_scopes(req.scopes, base, seen_all)
  local grow = has_any(req.h)
  local x
  if req.ttl then x = now + req.ttl end
  if grow then
    local scopes = {}
    for i, sc in ipairs(req.scopes) do scopes[i] = load_scope(sc) end
    local denial = check(scopes, true, rec.h, rec.id)
    if denial then return reply({t = 'deny', d = denial}) end
    for _, s in ipairs(scopes) do
      add_map(s.S.h, req.h, 1)
      if x then redis.call('ZADD', s.hkey, I(x), rec.id) end
      save_scope(s)
    end
  elseif x then
    -- A new expiry only: the windows are not read, so the scopes stay on
    -- the plan they were written under, as in the engine.
    for _, sc in ipairs(req.scopes) do
      redis.call('ZADD', sc.b .. ':h:' .. sc.n, I(x), rec.id)
    end
  end
  add_map(rec.h, req.h, 1)
  if x then
    rec.x = x
    redis.call('ZADD', base .. ':x', I(x), rec.id)
  end
  rec.v = rec.v + 1
  redis.call('SET', base .. ':r:' .. rec.id, pack(rec))
  return reply({t = 'ok', rec = rec})
end

function ops.get()
  local base = req.b
  observe_tag(base, 64)
  local rec, away = load_record(base, req.id)
  if away then return reply({t = 'elsewhere'}) end
  if not rec then return reply({t = 'nf'}) end
  return reply({t = 'ok', rec = rec})
end

-- A reservation's record as it stands (no expiry observed): what a settle
-- or extend reads to work out its amounts.
function ops.peek()
  local rkey = req.b .. ':r:' .. req.id
  local raw = redis.call('GET', rkey)
  if not raw then return reply({t = 'nf'}) end
  local rec = decode(raw, rkey)
  if rec.sh then return reply({t = 'elsewhere'}) end
  if forgotten(rec) then return reply({t = 'nf'}) end
  return reply({t = 'ok', rec = rec, now = now})
end

function ops.status()
  if not calendars_hold(req.scopes) then return reply({t = 'cal', now = now}) end
  local sc = req.scopes[1]
  observe_scope(sc)
  local s = load_scope(sc)
  return reply({t = 'ok', hc = s.S.hc, rem = report({s})})
end

function ops.adjust()
  if not calendars_hold(req.scopes) then return reply({t = 'cal', now = now}) end
  local sc = req.scopes[1]
  observe_scope(sc)
  local s = load_scope(sc)
  for li, L in ipairs(s.lims) do
    if L.k == 't' and L.d == req.d then s.states[li].u = s.states[li].u - req.credit end
  end
  save_scope(s)
  usage_add(usage_key(sc.b), 'k', 'adjusted', 'at', I(now),
    'a', pack({s = sc.n, d = req.d, c = req.credit, w = req.reason, tn = req.tn}))
  return reply({t = 'ok', hc = s.S.hc, rem = report({s})})
end

-- Brings in a reservation that ended elsewhere (admitted and settled while
-- Redis was unreachable, under fail_open_local): its charges are recorded
-- on its scopes at its end and it joins the usage log. Idempotent by id.
function ops.import()
  if not calendars_hold(req.scopes) then return reply({t = 'cal', now = now}) end
  local base = req.b
  local rec = req.rec
  local rkey = base .. ':r:' .. rec.id
  local raw = redis.call('GET', rkey)
  local shadow
  if raw then
    -- Imported already — unless as expired, and settled late since (an
    -- import whose answer was lost, then a local late settle): the settle
    -- comes in now, once, as a late settle would. A shadow hold of it is
    -- replaced by what it became.
    local old = decode(raw, rkey)
    if old.sh then
      if old.st == 'held' then shadow = old end
    elseif not (old.st == 'expired' and rec.st == 'settled') then
      return reply({t = 'ok', dup = true})
    end
  end
  -- Its idempotency key comes along, unless a live reservation of Redis's
  -- own has it (a retry admitted here once Redis was back): that one keeps
  -- it. Looked up before the first write.
  local ikey, take_key
  if rec.ik then
    ikey = base .. ':i:' .. rec.tn .. '\n' .. rec.ik
    local cur = redis.call('GET', ikey)
    local other = cur and cur ~= rec.id and load_record(base, cur)
    take_key = not (other and not (other.e and now >= other.e + req.ri))
  end
  for _, sc in ipairs(req.scopes) do observe_scope(sc) end
  local scopes = {}
  for i, sc in ipairs(req.scopes) do scopes[i] = load_scope(sc) end
  if shadow then
    -- Read before: the scopes were all loaded above, so nothing fails
    -- from here on.
    release(shadow, base)
    redis.call('ZREM', base .. ':x', rec.id)
    for i, sc in ipairs(req.scopes) do scopes[i] = load_scope(sc) end
  end
  for _, s in ipairs(scopes) do
    for li, L in ipairs(s.lims) do record_at(s.states[li], L, L.a or 0, rec.e) end
    save_scope(s)
  end
  schedule_drop(base, rec, rec.e)
  redis.call('SET', rkey, pack(rec))
  if take_key then redis.call('SET', ikey, rec.id) end
  if rec.st ~= 'held' then usage_event(rec.st, rec.e, rec) end
  return reply({t = 'ok'})
end

-- Holds room in Redis for a reservation still HELD in an instance that
-- admitted it locally (fail_open_local) while Redis was away, so that
-- Redis counts it until it ends: its import (ops.import) then replaces the
-- shadow, and if it never comes (the instance died) the shadow expires with
-- the reservation's own expiry, without a trace. No limit is checked: the
-- reservation was admitted already. Sent again after a local extend, it
-- replaces the shadow's amounts and expiry; once the reservation is in
-- Redis for real (imported), it changes nothing.
function ops.shadow()
  if not calendars_hold(req.scopes) then return reply({t = 'cal', now = now}) end
  local base = req.b
  local rec = req.rec
  local rkey = base .. ':r:' .. rec.id
  local raw = redis.call('GET', rkey)
  local old
  if raw then
    old = decode(raw, rkey)
    if not old.sh then return reply({t = 'ok', dup = true}) end
  end
  for _, sc in ipairs(req.scopes) do observe_scope(sc) end
  local scopes = {}
  for i, sc in ipairs(req.scopes) do scopes[i] = load_scope(sc) end
  if old and old.st == 'held' then
    release(old, base)
    redis.call('DEL', rkey)
    redis.call('ZREM', base .. ':x', rec.id)
    for i, sc in ipairs(req.scopes) do scopes[i] = load_scope(sc) end
  end
  if rec.x <= now then return reply({t = 'ok'}) end
  for _, s in ipairs(scopes) do
    s.S.hc = s.S.hc + 1
    add_map(s.S.h, rec.h, 1)
    redis.call('ZADD', s.hkey, I(rec.x), rec.id)
    save_scope(s)
  end
  rec.st = 'held'
  rec.sh = true
  redis.call('SET', rkey, pack(rec))
  redis.call('ZADD', base .. ':x', I(rec.x), rec.id)
  return reply({t = 'ok'})
end

-- Cluster: a reservation's holds on shared scopes --------------------------
--
-- A shared scope lives in its own group's slot, so on a cluster a
-- reservation holds it with a script of its own, before the tenant's
-- (compensated if the tenant's refuses), and ends it after (the tenant's
-- record lists the group as pending until then, for the sweeper).

-- What an idempotency key names now, without reserving: a cross-slot
-- reserve asks first, so a retry replays rather than holds again.
function ops.idem()
  local base = req.b
  observe_tag(base, 64)
  local rid = redis.call('GET', base .. ':i:' .. req.tn .. '\n' .. req.ik)
  if rid then
    local rec = load_record(base, rid)
    if rec and not (rec.e and now >= rec.e + req.ri) then
      if rec.fp ~= req.fp then return reply({t = 'idem'}) end
      return reply({t = 'ok', replay = true, rec = rec})
    end
  end
  return reply({t = 'none'})
end

-- Checks and holds this group's shared scopes of a reservation.
function ops.fhold()
  if not calendars_hold(req.scopes) then return reply({t = 'cal', now = now}) end
  local g = req.b
  for _, sc in ipairs(req.scopes) do observe_scope(sc) end
  local scopes = {}
  for i, sc in ipairs(req.scopes) do scopes[i] = load_scope(sc) end
  local denial = check(scopes, false)
  if denial then return reply({t = 'deny', d = denial}) end
  local x = now + req.ttl
  if req.dry then return reply({t = 'ok', now = now, x = x, rem = report(scopes)}) end
  local fkey = g .. ':f:' .. req.id
  if redis.call('EXISTS', fkey) == 1 then return reply({t = 'dup'}) end
  local f = {id = req.id, st = 'held', sc = {}, sb = {}, h = req.h, x = x}
  for i, s in ipairs(scopes) do
    s.S.hc = s.S.hc + 1
    add_map(s.S.h, req.h, 1)
    redis.call('ZADD', s.hkey, I(x), req.id)
    save_scope(s)
    f.sc[i] = req.scopes[i].n
    f.sb[i] = g
  end
  redis.call('SET', fkey, pack(f))
  redis.call('ZADD', g .. ':fx', I(x), req.id)
  local rem
  if req.rr then rem = report(scopes) end
  return reply({t = 'ok', now = now, x = x, rem = rem})
end

-- Ends this group's holds of a reservation: `settle` records `a` on each
-- limit (even if the hold expired meanwhile), `release` only lets go.
-- Idempotent: an ended hold is left as it is.
function ops.fend()
  if not calendars_hold(req.scopes) then return reply({t = 'cal', now = now}) end
  local g = req.b
  local fkey = g .. ':f:' .. req.id
  local raw = redis.call('GET', fkey)
  local f
  if raw then f = decode(raw, fkey) end
  if f and f.st == 'settled' then return reply({t = 'ok'}) end
  if req.fin == 'release' then
    if not f then
      -- A tombstone: a hold whose script is still on its way (the caller
      -- timed out waiting for it) finds the id taken and holds nothing.
      redis.call('SET', fkey, pack({id = req.id, st = 'released', sc = {}, sb = {}, h = {}, x = now}))
      redis.call('ZADD', g .. ':fd', I(now + max(req.re, req.ri)), req.id)
      return reply({t = 'ok'})
    end
    if f.st ~= 'held' then return reply({t = 'ok'}) end
  end
  -- A settle records its charges whatever became of the hold (expired, or
  -- released by a compensation that raced a reservation whose outcome was
  -- unknown): the reservation exists, its usage counts here too.
  for _, sc in ipairs(req.scopes) do observe_scope(sc) end
  if f and f.st == 'held' and f.x <= now then
    expire_foreign(g, req.id)
    f = decode(redis.call('GET', fkey), fkey)
  end
  local held = f and f.st == 'held'
  if req.fin == 'release' and not held then return reply({t = 'ok'}) end
  if f and f.st == 'released' and req.fin == 'settle' then held = false end
  if req.fin == 'settle' then
    -- An import (`at`: when it was used) counts from then, as ops.import.
    record_charges(req.scopes, f and f.h, req.id, held, req.at)
  else
    drop_hold(req.scopes, f.h, req.id)
  end
  f = f or {id = req.id, sc = {}, sb = {}, h = {}, x = now}
  if req.fin == 'settle' then f.st = 'settled' else f.st = 'released' end
  if held then room_freed() end
  redis.call('SET', fkey, pack(f))
  redis.call('ZREM', g .. ':fx', req.id)
  redis.call('ZADD', g .. ':fd', I(now + max(req.re, req.ri)), req.id)
  return reply({t = 'ok'})
end

-- Raises and/or moves this group's holds of a HELD reservation; with
-- `undo`, takes back an earlier raise and restores the expiry `ox`.
function ops.fextend()
  if not calendars_hold(req.scopes) then return reply({t = 'cal', now = now}) end
  local g = req.b
  local fkey = g .. ':f:' .. req.id
  for _, sc in ipairs(req.scopes) do observe_scope(sc) end
  local raw = redis.call('GET', fkey)
  if not raw then return reply({t = 'notheld', st = 'expired'}) end
  local f = decode(raw, fkey)
  if f.st ~= 'held' then return reply({t = 'notheld', st = 'expired'}) end
  local sign = 1
  if req.undo then sign = -1 end
  local grow = has_any(req.h)
  local x
  if req.undo then x = req.ox elseif req.ttl then x = now + req.ttl end
  if grow and not req.undo then
    local scopes = {}
    for i, sc in ipairs(req.scopes) do scopes[i] = load_scope(sc) end
    local denial = check(scopes, true, f.h, req.id)
    if denial then return reply({t = 'deny', d = denial}) end
    for _, s in ipairs(scopes) do
      add_map(s.S.h, req.h, 1)
      if x then redis.call('ZADD', s.hkey, I(x), req.id) end
      save_scope(s)
    end
  else
    -- An undone raise or a new expiry only: the windows are not read.
    local loaded = {}
    for i, sc in ipairs(req.scopes) do loaded[i] = load_raw(sc) end
    for _, l in ipairs(loaded) do
      if grow and l.S then
        add_map(l.S.h, req.h, sign)
        store_scope(l.key, l.S)
      end
      if x then redis.call('ZADD', l.hkey, I(x), req.id) end
    end
  end
  local ox = f.x
  add_map(f.h, req.h, sign)
  if x then
    f.x = x
    redis.call('ZADD', g .. ':fx', I(x), req.id)
  end
  redis.call('SET', fkey, pack(f))
  return reply({t = 'ok', x = ox})
end

-- The sweeper in a shared group: due foreign holds expire, ended ones
-- past their retention are forgotten.
function ops.ftick()
  local g = req.b
  local due = redis.call('ZRANGEBYSCORE', g .. ':fx', '-inf', I(now), 'LIMIT', 0, 1000)
  for _, id in ipairs(due) do expire_foreign(g, id) end
  local gone = redis.call('ZRANGEBYSCORE', g .. ':fd', '-inf', I(now), 'LIMIT', 0, 1000)
  for _, id in ipairs(gone) do
    redis.call('DEL', g .. ':f:' .. id)
    redis.call('ZREM', g .. ':fd', id)
  end
  return reply({t = 'ok'})
end

-- A tenant's settle or refund whose shared groups have been told: no
-- longer pending. And the pending ones the sweeper should finish.
function ops.pdone()
  redis.call('ZREM', req.b .. ':p', req.id)
  return reply({t = 'ok'})
end

-- The sweeper: one tenant group's due expiries and retention.
function ops.tick()
  local n = observe_tag(req.b, 1000)
  forget_due(req.b, 1000)
  return reply({t = 'ok', n = n})
end

-- Appends an admin change to the shared catalog if the caller saw the
-- latest version (a compare-and-set: changes apply in one order everywhere).
function ops.catalog()
  local key = P .. '{c}:cat'
  local v = redis.call('LLEN', key)
  if v ~= req.cv then return reply({t = 'stale', cv = v}) end
  redis.call('RPUSH', key, req.change)
  return reply({t = 'ok', cv = v + 1})
end

-- Tells a group of a catalog version (never moves it back).
function ops.bump()
  local key = req.b .. ':cv'
  local v = tonumber(redis.call('GET', key) or '0')
  if v < req.cv then redis.call('SET', key, I(req.cv)) end
  return reply({t = 'ok'})
end

-- One group's part of the usage log after `start`, with the server's
-- instant read in the same atomic step: every entry it will ever add has a
-- later id (a plain table, not MessagePack: the entries are binary).
function ops.usage()
  local t = redis.call('TIME')
  local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local entries = redis.call('XRANGE', usage_key(req.b), req.start, '+', 'COUNT', req.n)
  return {ms, entries}
end

-- One ledger call: keys[1] routes it (its group's slot), args[1] is the
-- request.
local function handle(keys, args)
  pack, unpack = cmsgpack.pack, cmsgpack.unpack
  floor, max, min = math.floor, math.max, math.min
  req = unpack(args[1])
  P = req.p
  told = false
  if req.now then
    now = req.now
  else
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  local op = ops[req.op]
  if not op then return redis.error_reply('allowance: unknown operation ' .. tostring(req.op)) end
  if req.cv and req.op ~= 'catalog' and req.op ~= 'bump' then
    -- The catalog this instance resolved limits with must not be older
    -- than the one this group was told of.
    local v = tonumber(redis.call('GET', keys[1] .. ':cv') or '0')
    if v > req.cv then return reply({t = 'stale', cv = v}) end
  end
  return op()
end

redis.register_function('FUNCTION_NAME', handle)
