//! The conformance suite against every store of the crate.

#![cfg(feature = "testing")]

#[cfg(feature = "redis")]
mod redis_support;

use tower_quota::testing::{self, Verdict};
use tower_quota::MemoryStore;

/// Every rule passes, but for undated counters, which a store over memory
/// cannot hold: it dates every counter it creates and has no other writer.
fn conforms_over_memory(verdicts: Vec<(&'static str, Verdict)>) {
    for (name, verdict) in verdicts {
        if name == "undated_counter_is_healed" {
            assert!(
                matches!(verdict, Verdict::NotApplicable(_)),
                "{name}: {verdict:?}"
            );
        } else {
            assert_eq!(verdict, Verdict::Passed, "{name}");
        }
    }
}

#[tokio::test]
async fn memory_store_conforms() {
    conforms_over_memory(testing::run_all(&MemoryStore::new()).await);
}

/// Leased counting keeps the contract: what it answers from a block is what
/// the store would have answered, and what it takes is charged there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_memory_store_conforms() {
    let leased = tower_quota::LeasedStore::new(MemoryStore::new());
    conforms_over_memory(testing::run_all(&leased).await);
}

/// Either store keeps the contract of the store it holds, either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn either_store_conforms_with_either_store() {
    use tower_quota::store::EitherStore;
    type Either = EitherStore<MemoryStore, tower_quota::LeasedStore<MemoryStore>>;
    let stores: [Either; 2] = [
        EitherStore::Left(MemoryStore::new()),
        EitherStore::Right(tower_quota::LeasedStore::new(MemoryStore::new())),
    ];
    for store in stores {
        conforms_over_memory(testing::run_all(&store).await);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store_conforms_with_one_shard() {
    conforms_over_memory(testing::run_all(&MemoryStore::with_shards(1)).await);
}

#[cfg(feature = "redis")]
mod redis {
    use std::time::Duration;

    use tower_quota::store::RedisStore;
    use tower_quota::testing::{self, Verdict};

    use crate::redis_server_or_skip;

    fn store(url: String) -> RedisStore {
        // Generous timeouts: the suite checks rules, not speed, and CI
        // machines are busy.
        RedisStore::builder(url)
            .wait_timeout(Duration::from_secs(2))
            .connect_timeout(Duration::from_secs(2))
            .timeout(Duration::from_secs(2))
            .build()
            .expect("a Redis store")
    }

    macro_rules! conformance {
        ($($case:ident),* $(,)?) => {$(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let server = redis_server_or_skip!();
                let verdict = testing::$case(&store(server.url())).await;
                assert_eq!(verdict, Verdict::Passed);
            }
        )*};
    }

    conformance!(
        hits_never_extend_a_first_use_deadline,
        refund_after_expiry_does_not_resurrect,
        add_never_creates_nor_moves_a_deadline,
        settle_debt_keeps_to_the_debts_period,
        exactly_the_limit_under_concurrency,
        extra_units_take_only_the_room_left,
        all_or_nothing_across_quotas,
        a_refused_charge_writes_nothing,
        an_abandoned_charge_spends_nothing,
        undated_counter_is_healed,
        calendar_counters_are_distinct_per_period_and_dated,
        counts_never_pass_the_limit_nor_wrap,
        a_charge_past_its_period_is_an_error,
        changes_by_the_reported_first_call_land,
        changes_made_before_a_counter_do_not_land,
        changes_made_at_a_first_call_land_on_that_counter_only,
        give_backs_that_empty_a_first_use_counter_close_its_period,
        each_call_answers_as_documented,
        changes_to_an_ended_counter_do_not_land,
        a_late_charge_finds_its_spent_counter,
        an_abandoned_settle_sent_again_counts_once,
        clones_share_an_identity_no_other_store_has,
    );

    /// Leased counting over Redis keeps the contract too: every rule but
    /// the deadline's very instant (on Redis's clock, as below).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn leased_redis_store_conforms() {
        let server = redis_server_or_skip!();
        let leased = tower_quota::LeasedStore::new(store(server.url()));
        for (name, verdict) in testing::run_all(&leased).await {
            if name == "a_first_use_counter_ends_at_its_deadline" {
                assert!(
                    matches!(verdict, Verdict::NotApplicable(_)),
                    "{name}: {verdict:?}"
                );
            } else {
                assert_eq!(verdict, Verdict::Passed, "{name}");
            }
        }
    }

    /// The Redis store's deadlines pass on its own clock: the suite cannot
    /// call it at a deadline's very instant.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_first_use_counter_ends_at_its_deadline() {
        let server = redis_server_or_skip!();
        let verdict = testing::a_first_use_counter_ends_at_its_deadline(&store(server.url())).await;
        assert!(matches!(verdict, Verdict::NotApplicable(_)), "{verdict:?}");
    }
}

/// Stores with one planted bug each: the suite must catch every one.
mod broken {
    use std::collections::HashMap;
    use std::future::Future;
    use std::pin::Pin;
    use std::sync::{Arc, Mutex};

    use tower_quota::jiff::Timestamp;
    use tower_quota::store::{
        ChargeOutcome, ChargeRequest, Debt, Lifetime, Store, StoreError, StoreErrorKind, Usage,
    };
    use tower_quota::testing::{self, ConformanceHooks, Planted, StoredDeadline, Verdict};
    use tower_quota::PeriodKey;

    #[derive(Clone, Copy, Default)]
    struct Bugs {
        redates_on_hit: bool,
        refund_creates: bool,
        add_creates: bool,
        add_redates: bool,
        add_ignores_deadline: bool,
        charges_lines_separately: bool,
        checks_then_yields: bool,
        calendar_without_deadline: bool,
        leaves_undated: bool,
        heals_only_when_admitted: bool,
        keeps_abandoned: bool,
        // Broken on purpose for `each_call_answers_as_documented`.
        admits_creating: bool,
        zero_cost_creates: bool,
        reset_says_false: bool,
        refund_wraps: bool,
        add_made_by_creates: bool,
        plain_refund_unmarked: bool,
        peek_counts_cost: bool,
        past_period_unavailable: bool,
        wraps: bool,
        settle_redates: bool,
        settle_opens_ended: bool,
        settle_by_charge: bool,
        charges_past_the_period: bool,
        /// Reports first calls, and refunds or adds whatever counter lives
        /// at the key: the trait's defaults of `refund_made_by` and
        /// `add_made_by`.
        ignores_made_by: bool,
        /// Refunds a block's units to whatever counter was made by its
        /// first call: the trait's default of `refund_made_at`.
        refunds_at_as_by: bool,
        /// Adds a deferred cost to whatever counter was made by the first
        /// call its charge reported: the trait's default of `add_made_at`.
        adds_at_as_by: bool,
        /// Keeps a first-use counter that a give-back at its first call
        /// emptied: the trait's default of `refund_made_at`.
        keeps_emptied: bool,
        /// Marks no counter a support refund lowered: a give-back of all
        /// it holds then closes a period holding a served request's units.
        forgets_support_refunds: bool,
        /// Reopens a first-use key whose counter ended with the ended
        /// counter's first call (a counter replaced where it is, its
        /// first call left as it was): a give-back of the ended period's
        /// request lands on the period opened since.
        reuses_ended_first_call: bool,
        /// Refuses a give-back at a first call only on a counter made
        /// since with an earlier first call, and takes one on a counter
        /// made since with a later one (after a reset).
        refund_at_guards_earlier_only: bool,
        /// Holds a counter live at its very deadline (`>=` for `>`).
        live_at_deadline: bool,
        /// The calls guarded by a first call (`refund_made_by`,
        /// `refund_made_at`, `add_made_by`) find a counter live at its very
        /// deadline.
        made_calls_live_at_deadline: bool,
        /// Settles a debt at its very deadline (`<` for `<=`).
        settles_at_its_deadline: bool,
        /// Adds a settle's debt, then answers a poll later: dropped in
        /// between (a settle timed out, which the ledger sends again), it
        /// stays added.
        keeps_abandoned_settles: bool,
        /// No bug: adds the debt of one settle id once, as the Redis store
        /// does (with `keeps_abandoned_settles`, the contract's other way).
        knows_settle_ids: bool,
        /// An identity of the handle, not of the counters it shares with
        /// its clones.
        identity_per_handle: bool,
        /// One identity for every store of the type.
        identity_shared: bool,
        /// A settle whose sum is beyond `u64` wraps.
        settle_wraps: bool,
        /// `refund_made_by` and `refund_made_at` write a zero counter,
        /// undated, where there is no live one (as a script that guards on
        /// the first call, then `HSET`s).
        guarded_refund_creates: bool,
        /// A settle of a calendar window makes its counter anew, over the
        /// one its charges made.
        calendar_settle_overwrites: bool,
        /// Drops every counter whose deadline is not after a charge's
        /// instant (a sweep, or a time-to-live at the deadline): a charge
        /// stamped before a deadline that comes late finds a fresh one.
        sweeps_at_deadline: bool,
        /// A charge of one line takes extra units up to its limit as its
        /// count stood before its cost (a one-line fast path that forgets
        /// the cost): past the limit by up to the cost.
        one_line_takes_ignoring_cost: bool,
    }

    #[derive(Clone, Copy, Default)]
    struct Counter {
        used: u64,
        deadline: Option<Timestamp>,
        first_call: Option<Timestamp>,
        first_use: bool,
        /// Lowered by a refund of another kind than a give-back at its
        /// first call: no give-back closes its period.
        kept: bool,
    }

    #[derive(Clone, Default)]
    struct Buggy {
        bugs: Bugs,
        counters: Arc<Mutex<HashMap<PeriodKey, Counter>>>,
        /// The settle ids added (with `knows_settle_ids`).
        settled: Arc<Mutex<std::collections::HashSet<u64>>>,
    }

    impl Buggy {
        fn with(bugs: Bugs) -> Self {
            Self {
                bugs,
                ..Self::default()
            }
        }

        fn live(&self, key: &PeriodKey, now: Timestamp) -> Option<Counter> {
            let counters = self.counters.lock().unwrap();
            counters.get(key).copied().filter(|c| {
                c.deadline
                    .is_none_or(|d| d > now || (self.bugs.live_at_deadline && d == now))
            })
        }

        /// The live counter at `key` for a call guarded by a first call.
        fn live_made(&self, key: &PeriodKey, now: Timestamp) -> Option<Counter> {
            if !self.bugs.made_calls_live_at_deadline {
                return self.live(key, now);
            }
            let counters = self.counters.lock().unwrap();
            counters
                .get(key)
                .copied()
                .filter(|c| c.deadline.is_none_or(|d| d >= now))
        }

        /// The planted `guarded_refund_creates`: an undated zero counter
        /// where there is no live one.
        fn plant_guarded(&self, key: &PeriodKey, now: Timestamp) {
            if self.bugs.guarded_refund_creates && self.live(key, now).is_none() {
                let counter = Counter {
                    used: 0,
                    ..Counter::default()
                };
                self.counters.lock().unwrap().insert(key.clone(), counter);
            }
        }

        fn usage(&self, request: &ChargeRequest) -> Vec<Usage> {
            request
                .lines
                .iter()
                .map(|line| {
                    let counter = self.live(&line.key, request.now);
                    let (resets_at, first_call) = match line.lifetime {
                        Lifetime::Calendar { end, .. } => (end, None),
                        Lifetime::FirstUse { deadline } => (
                            counter.and_then(|c| c.deadline).unwrap_or(deadline),
                            counter.and_then(|c| c.first_call),
                        ),
                    };
                    Usage {
                        held_elsewhere_until: None,
                        counted_at: None,
                        limit: line.limit,
                        used: counter.map_or(0, |c| c.used),
                        resets_at,
                        first_call,
                    }
                })
                .collect()
        }

        /// Whether the live counter at `key` was made after `made_by` (a
        /// guarded change must then leave it), unless the planted bug
        /// ignores it.
        fn made_after(&self, key: &PeriodKey, now: Timestamp, made_by: Timestamp) -> bool {
            !self.bugs.ignores_made_by
                && self
                    .live_made(key, now)
                    .and_then(|c| c.first_call)
                    .is_some_and(|first| first > made_by)
        }

        /// A refund of `amount` to `found`, the counter at `key` if live.
        fn refund_found(
            &self,
            found: Option<Counter>,
            now: Timestamp,
            key: PeriodKey,
            amount: u64,
        ) -> Option<u64> {
            match found {
                Some(mut c) => {
                    c.kept |= c.first_use
                        && c.used > 0
                        && amount > 0
                        && !self.bugs.forgets_support_refunds
                        && !self.bugs.plain_refund_unmarked;
                    c.used = if self.bugs.refund_wraps {
                        c.used.wrapping_sub(amount)
                    } else {
                        c.used.saturating_sub(amount)
                    };
                    self.counters.lock().unwrap().insert(key, c);
                    Some(c.used)
                }
                None if self.bugs.refund_creates => {
                    let counter = Counter {
                        used: 0,
                        deadline: None,
                        first_call: Some(now),
                        ..Counter::default()
                    };
                    self.counters.lock().unwrap().insert(key, counter);
                    Some(0)
                }
                None => None,
            }
        }

        /// An add of `amount` to `found`, the counter at `key` if live.
        fn add_found(
            &self,
            found: Option<Counter>,
            now: Timestamp,
            key: PeriodKey,
            amount: u64,
        ) -> Option<u64> {
            match found {
                Some(mut c) => {
                    c.used = c.used.saturating_add(amount);
                    if self.bugs.add_redates {
                        // As `INCRBY` then `EXPIRE key period` would.
                        if let (Some(deadline), Some(first)) = (c.deadline, c.first_call) {
                            c.deadline = Some(now + deadline.duration_since(first));
                        }
                    }
                    self.counters.lock().unwrap().insert(key, c);
                    Some(c.used)
                }
                None if self.bugs.add_creates => {
                    // As a bare `INCRBY` would: a counter with no deadline.
                    let counter = Counter {
                        used: amount,
                        deadline: None,
                        first_call: None,
                        ..Counter::default()
                    };
                    self.counters.lock().unwrap().insert(key, counter);
                    Some(amount)
                }
                None => None,
            }
        }

        fn heal(&self, request: &ChargeRequest) {
            heal(&mut self.counters.lock().unwrap(), request);
        }

        async fn charge_now(self, request: ChargeRequest) -> Result<ChargeOutcome, StoreError> {
            let now = request.now;
            if self.bugs.sweeps_at_deadline {
                let mut counters = self.counters.lock().unwrap();
                counters.retain(|_, c| c.deadline.is_none_or(|d| d > now));
            }
            if !self.bugs.charges_past_the_period
                && request.lines.iter().any(|line| line.lifetime.end() <= now)
            {
                return Err(StoreError::new(
                    if self.bugs.past_period_unavailable {
                        StoreErrorKind::Unavailable
                    } else {
                        StoreErrorKind::Other
                    },
                    "a line past its period",
                ));
            }
            let wraps = self.bugs.wraps;
            // A sum beyond u64 is beyond any limit; the bug saturates it,
            // so that a count at the top passes a limit of u64::MAX.
            let within = |used: u64, cost: u64, limit: u64| {
                if wraps {
                    used.saturating_add(cost) <= limit
                } else {
                    used.checked_add(cost).is_some_and(|sum| sum <= limit)
                }
            };
            let fits = |line: &tower_quota::store::ChargeLine| {
                within(
                    self.live(&line.key, now).map_or(0, |c| c.used),
                    line.cost,
                    line.limit,
                )
            };
            // Decided on the counters as healing leaves them; healed for
            // real by any charge, admitted or refused (a peek heals none).
            let mut healed = self.counters.lock().unwrap().clone();
            if !self.bugs.leaves_undated {
                heal(&mut healed, &request);
            }
            let admitted = request.lines.iter().all(|line| {
                let used = healed
                    .get(&line.key)
                    .filter(|c| {
                        c.deadline
                            .is_none_or(|d| d > now || (self.bugs.live_at_deadline && d == now))
                    })
                    .map_or(0, |c| c.used);
                within(used, line.cost, line.limit)
                    || (self.bugs.admits_creating && self.live(&line.key, now).is_none())
            });
            if self.bugs.checks_then_yields {
                tokio::task::yield_now().await;
            }
            if !self.bugs.leaves_undated && (admitted || !self.bugs.heals_only_when_admitted) {
                self.heal(&request);
            }
            for line in &request.lines {
                let commit = if self.bugs.charges_lines_separately {
                    fits(line)
                } else {
                    admitted
                };
                if !commit
                    || (line.cost == 0
                        && !(self.bugs.zero_cost_creates && self.live(&line.key, now).is_none()))
                {
                    continue;
                }
                let live = self.live(&line.key, now);
                let mut counters = self.counters.lock().unwrap();
                let deadline = match line.lifetime {
                    Lifetime::FirstUse { deadline } => Some(deadline),
                    Lifetime::Calendar { .. } if self.bugs.calendar_without_deadline => None,
                    Lifetime::Calendar { end, .. } => Some(end),
                };
                let counter = match live {
                    Some(mut c) => {
                        c.used = c.used.wrapping_add(line.cost);
                        if self.bugs.redates_on_hit {
                            c.deadline = deadline;
                        }
                        c
                    }
                    None => Counter {
                        used: line.cost,
                        deadline,
                        first_call: if self.bugs.reuses_ended_first_call {
                            counters
                                .get(&line.key)
                                .and_then(|c| c.first_call)
                                .or(Some(now))
                        } else {
                            Some(now)
                        },
                        first_use: matches!(line.lifetime, Lifetime::FirstUse { .. }),
                        kept: false,
                    },
                };
                counters.insert(line.key.clone(), counter);
            }
            Ok(ChargeOutcome {
                admitted,
                usage: self.usage(&request).into(),
            })
        }
    }

    /// Dates the undated counters of `request`'s lines as a charge heals them.
    fn heal(counters: &mut HashMap<PeriodKey, Counter>, request: &ChargeRequest) {
        for line in &request.lines {
            let Some(counter) = counters.get_mut(&line.key) else {
                continue;
            };
            if counter.deadline.is_some() {
                continue;
            }
            counter.deadline = Some(match (line.lifetime, counter.first_call) {
                (Lifetime::Calendar { end, .. }, _) => end,
                (Lifetime::FirstUse { deadline }, Some(first)) => {
                    first + deadline.duration_since(request.now)
                }
                (Lifetime::FirstUse { deadline }, None) => deadline,
            });
        }
    }

    impl Store for Buggy {
        type ChargeFuture = Pin<Box<dyn Future<Output = Result<ChargeOutcome, StoreError>> + Send>>;

        fn charge(&self, request: ChargeRequest) -> Self::ChargeFuture {
            let store = self.clone();
            Box::pin(async move {
                let keeps_abandoned = store.bugs.keeps_abandoned;
                let outcome = store.charge_now(request).await;
                if keeps_abandoned {
                    // Answers a poll later, the charge applied: dropped in
                    // between, it stays charged.
                    tokio::task::yield_now().await;
                }
                outcome
            })
        }

        /// In one step: each line's extra units, as many as fit, once
        /// the request is charged.
        fn charge_taking(
            &self,
            request: ChargeRequest,
            extra: smallvec::SmallVec<[u64; 2]>,
        ) -> impl Future<Output = Result<(ChargeOutcome, smallvec::SmallVec<[u64; 2]>), StoreError>> + Send
        {
            let store = self.clone();
            async move {
                let n = request.lines.len();
                let mut outcome = store.clone().charge_now(request.clone()).await?;
                let mut taken: smallvec::SmallVec<[u64; 2]> = smallvec::smallvec![0; n];
                if !outcome.admitted {
                    return Ok((outcome, taken));
                }
                let mut counters = store.counters.lock().unwrap();
                for (i, line) in request.lines.iter().enumerate() {
                    let want = extra.get(i).copied().unwrap_or(0);
                    let twice = request.lines.iter().filter(|l| l.key == line.key).count() > 1;
                    let Some(counter) = counters.get_mut(&line.key).filter(|_| want > 0 && !twice)
                    else {
                        continue;
                    };
                    let mut room = line.limit.saturating_sub(counter.used);
                    if store.bugs.one_line_takes_ignoring_cost && n == 1 {
                        room += line.cost;
                    }
                    taken[i] = room.min(want);
                    counter.used += taken[i];
                    outcome.usage[i].used = counter.used;
                }
                Ok((outcome, taken))
            }
        }

        fn peek(
            &self,
            request: ChargeRequest,
        ) -> impl Future<Output = Result<Vec<Usage>, StoreError>> + Send {
            let mut usage = self.usage(&request);
            if self.bugs.peek_counts_cost {
                for (u, line) in usage.iter_mut().zip(&request.lines) {
                    u.used += line.cost;
                }
            }
            std::future::ready(Ok(usage))
        }

        fn refund(
            &self,
            now: Timestamp,
            key: PeriodKey,
            amount: u64,
        ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
            std::future::ready(Ok(self.refund_found(
                self.live(&key, now),
                now,
                key,
                amount,
            )))
        }

        fn refund_made_by(
            &self,
            now: Timestamp,
            key: PeriodKey,
            amount: u64,
            made_by: Timestamp,
        ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
            self.plant_guarded(&key, now);
            let left = if self.made_after(&key, now, made_by) {
                None
            } else {
                let refunded =
                    self.refund_found(self.live_made(&key, now), now, key.clone(), amount);
                if self.bugs.plain_refund_unmarked && amount > 0 {
                    // Only the made_by path marks.
                    if let Some(c) = self.counters.lock().unwrap().get_mut(&key) {
                        c.kept |= c.first_use;
                    }
                }
                refunded
            };
            std::future::ready(Ok(left))
        }

        fn refund_made_at(
            &self,
            now: Timestamp,
            key: PeriodKey,
            amount: u64,
            first_call: Timestamp,
        ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
            self.plant_guarded(&key, now);
            let live = self.live_made(&key, now);
            let another = if self.bugs.refunds_at_as_by {
                self.made_after(&key, now, first_call)
            } else if self.bugs.refund_at_guards_earlier_only {
                live.and_then(|c| c.first_call)
                    .is_some_and(|first| first < first_call)
            } else {
                live.and_then(|c| c.first_call)
                    .is_some_and(|first| first != first_call)
            };
            let left = match live {
                _ if another => None,
                None => None,
                Some(c)
                    if c.first_use
                        && !c.kept
                        && amount > 0
                        && c.used == amount
                        && !self.bugs.keeps_emptied =>
                {
                    self.counters.lock().unwrap().remove(&key);
                    Some(0)
                }
                Some(mut c) => {
                    c.used = c.used.saturating_sub(amount);
                    self.counters.lock().unwrap().insert(key, c);
                    Some(c.used)
                }
            };
            std::future::ready(Ok(left))
        }

        fn add_made_by(
            &self,
            now: Timestamp,
            key: PeriodKey,
            amount: u64,
            made_by: Timestamp,
        ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
            if self.bugs.add_made_by_creates && self.live(&key, now).is_none() {
                // As a script that guards on the first call, then HINCRBY.
                let counter = Counter {
                    used: 0,
                    ..Counter::default()
                };
                self.counters.lock().unwrap().insert(key.clone(), counter);
            }
            let added = if self.made_after(&key, now, made_by) {
                None
            } else {
                self.add_found(self.live_made(&key, now), now, key, amount)
            };
            std::future::ready(Ok(added))
        }

        fn add_made_at(
            &self,
            now: Timestamp,
            key: PeriodKey,
            amount: u64,
            first_call: Timestamp,
        ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
            let live = self.live_made(&key, now);
            let another = if self.bugs.adds_at_as_by {
                self.made_after(&key, now, first_call)
            } else {
                live.and_then(|c| c.first_call)
                    .is_some_and(|first| first != first_call)
            };
            let added = if another {
                None
            } else {
                self.add_found(live, now, key, amount)
            };
            std::future::ready(Ok(added))
        }

        fn add(
            &self,
            now: Timestamp,
            key: PeriodKey,
            amount: u64,
        ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
            let found = if self.bugs.add_ignores_deadline {
                self.counters.lock().unwrap().get(&key).copied()
            } else {
                self.live(&key, now)
            };
            std::future::ready(Ok(self.add_found(found, now, key, amount)))
        }

        fn reset(&self, key: PeriodKey) -> impl Future<Output = Result<bool, StoreError>> + Send {
            let was = self.counters.lock().unwrap().remove(&key).is_some();
            std::future::ready(Ok(was && !self.bugs.reset_says_false))
        }

        fn settle_debt(
            &self,
            now: Timestamp,
            debt: Debt,
        ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
            let store = self.clone();
            async move {
                let keeps = store.bugs.keeps_abandoned_settles;
                let answer = store.settle_now(now, debt).await;
                if keeps {
                    // Answers a poll later, the debt added: dropped in
                    // between, it stays added.
                    tokio::task::yield_now().await;
                }
                answer
            }
        }

        fn identity(&self) -> Option<usize> {
            if self.bugs.identity_shared {
                return Some(1);
            }
            if self.bugs.identity_per_handle {
                return Some(std::ptr::from_ref(self) as usize);
            }
            Some(Arc::as_ptr(&self.counters) as *const () as usize)
        }
    }

    impl Buggy {
        async fn settle_now(self, now: Timestamp, debt: Debt) -> Result<Option<u64>, StoreError> {
            let store = self;
            if store.bugs.settle_by_charge {
                // As the trait's default does: a charge at the settle's
                // instant, which records that instant as the first call.
                let request = ChargeRequest {
                    charged_at: None,
                    now,
                    lines: smallvec::smallvec![tower_quota::store::ChargeLine {
                        key: debt.key,
                        limit: u64::MAX,
                        cost: debt.amount,
                        lifetime: debt.lifetime,
                        shadow_limit: None,
                    }],
                };
                let outcome = store.charge(request).await?;
                return Ok(Some(outcome.usage[0].used));
            }
            let ended = if store.bugs.settles_at_its_deadline {
                debt.lifetime.end() < now
            } else {
                debt.lifetime.end() <= now
            };
            if ended && !store.bugs.settle_opens_ended {
                return Ok(None);
            }
            let live = store.live(&debt.key, now);
            let opened_after = |c: &Counter| {
                matches!(debt.lifetime, Lifetime::FirstUse { .. })
                    && c.first_call
                        .is_some_and(|first| first >= debt.lifetime.end())
            };
            if live.as_ref().is_some_and(opened_after) {
                // A period opened at or past the debt's deadline.
                return Ok(None);
            }
            let seen =
                store.bugs.knows_settle_ids && !store.settled.lock().unwrap().insert(debt.id);
            if debt.amount == 0 || seen {
                // Nothing to add: the count, and nothing written.
                return Ok(Some(live.map_or(0, |c| c.used)));
            }
            let mut counters = store.counters.lock().unwrap();
            let counter = match live {
                Some(mut c)
                    if !(store.bugs.calendar_settle_overwrites
                        && matches!(debt.lifetime, Lifetime::Calendar { .. })) =>
                {
                    c.used = if store.bugs.settle_wraps {
                        c.used.wrapping_add(debt.amount)
                    } else {
                        c.used.saturating_add(debt.amount)
                    };
                    c
                }
                _ => Counter {
                    used: debt.amount,
                    deadline: Some(if store.bugs.settle_redates {
                        // One period counted from the settle.
                        now + debt.lifetime.end().duration_since(debt.since)
                    } else {
                        debt.lifetime.end()
                    }),
                    first_call: Some(match debt.lifetime {
                        Lifetime::Calendar { .. } => now,
                        Lifetime::FirstUse { .. } => debt.since,
                    }),
                    first_use: matches!(debt.lifetime, Lifetime::FirstUse { .. }),
                    kept: false,
                },
            };
            counters.insert(debt.key, counter);
            Ok(Some(counter.used))
        }
    }

    impl ConformanceHooks for Buggy {
        fn another_store(&self) -> Option<Self> {
            Some(Buggy::with(self.bugs))
        }

        fn plant_undated(
            &self,
            key: PeriodKey,
            used: u64,
            first_call: Option<Timestamp>,
        ) -> impl Future<Output = Result<Planted, StoreError>> + Send {
            let counter = Counter {
                used,
                deadline: None,
                first_call,
                ..Counter::default()
            };
            self.counters.lock().unwrap().insert(key, counter);
            std::future::ready(Ok(Planted::Planted))
        }

        fn stored_deadline(
            &self,
            key: PeriodKey,
        ) -> impl Future<Output = Result<StoredDeadline, StoreError>> + Send {
            let found = match self.counters.lock().unwrap().get(&key) {
                None => StoredDeadline::NoCounter,
                Some(Counter { deadline: None, .. }) => StoredDeadline::Undated,
                Some(Counter {
                    deadline: Some(at), ..
                }) => StoredDeadline::At(*at),
            };
            std::future::ready(Ok(found))
        }
    }

    #[tokio::test]
    async fn a_correct_store_passes() {
        for (name, verdict) in testing::run_all(&Buggy::default()).await {
            assert_eq!(verdict, Verdict::Passed, "{name}");
        }
    }

    /// A one-line charge that takes extra units past its limit (by its
    /// cost) is caught, whatever limit the concurrent part happens to use.
    #[tokio::test]
    #[should_panic(expected = "extra units never pass a limit")]
    async fn a_one_line_charge_taking_past_its_limit_is_caught() {
        let store = Buggy::with(Bugs {
            one_line_takes_ignoring_cost: true,
            ..Bugs::default()
        });
        testing::extra_units_take_only_the_room_left(&store).await;
    }

    #[tokio::test]
    #[should_panic(expected = "an undated counter is dated to its first call plus one period")]
    async fn leaving_a_counter_undated_is_caught() {
        let store = Buggy::with(Bugs {
            leaves_undated: true,
            ..Bugs::default()
        });
        testing::undated_counter_is_healed(&store).await;
    }

    /// The trap of a counter that lost its deadline: healed only by an
    /// admitted charge, one at its limit is never healed.
    #[tokio::test]
    #[should_panic(expected = "an undated counter at its limit, after a refused charge")]
    async fn healing_only_when_admitted_is_caught() {
        let store = Buggy::with(Bugs {
            heals_only_when_admitted: true,
            ..Bugs::default()
        });
        testing::undated_counter_is_healed(&store).await;
    }

    #[tokio::test]
    #[should_panic(expected = "a later hit must not move the first-use deadline")]
    async fn re_dating_on_every_hit_is_caught() {
        let store = Buggy::with(Bugs {
            redates_on_hit: true,
            ..Bugs::default()
        });
        testing::hits_never_extend_a_first_use_deadline(&store).await;
    }

    #[tokio::test]
    #[should_panic(expected = "a refund after the deadline must find no counter")]
    async fn a_refund_that_creates_is_caught() {
        let store = Buggy::with(Bugs {
            refund_creates: true,
            ..Bugs::default()
        });
        testing::refund_after_expiry_does_not_resurrect(&store).await;
    }

    #[tokio::test]
    #[should_panic(expected = "an add on a key never charged must find no counter")]
    async fn an_add_that_creates_is_caught() {
        let store = Buggy::with(Bugs {
            add_creates: true,
            ..Bugs::default()
        });
        testing::add_never_creates_nor_moves_a_deadline(&store).await;
    }

    #[tokio::test]
    #[should_panic(expected = "the stored deadline must not move after an add")]
    async fn an_add_that_moves_the_deadline_is_caught() {
        let store = Buggy::with(Bugs {
            add_redates: true,
            ..Bugs::default()
        });
        testing::add_never_creates_nor_moves_a_deadline(&store).await;
    }

    #[tokio::test]
    #[should_panic(expected = "an add after the deadline must find no counter")]
    async fn an_add_to_an_expired_counter_is_caught() {
        let store = Buggy::with(Bugs {
            add_ignores_deadline: true,
            ..Bugs::default()
        });
        testing::add_never_creates_nor_moves_a_deadline(&store).await;
    }

    #[tokio::test]
    #[should_panic(expected = "a refused request must be charged on no quota")]
    async fn charging_lines_separately_is_caught() {
        let store = Buggy::with(Bugs {
            charges_lines_separately: true,
            ..Bugs::default()
        });
        testing::all_or_nothing_across_quotas(&store).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[should_panic(expected = "exactly the limit must be admitted under concurrency")]
    async fn check_then_commit_without_a_lock_is_caught() {
        let store = Buggy::with(Bugs {
            checks_then_yields: true,
            ..Bugs::default()
        });
        testing::exactly_the_limit_under_concurrency(&store).await;
    }

    #[tokio::test]
    #[should_panic(expected = "a calendar counter must carry a deadline")]
    async fn a_calendar_counter_without_deadline_is_caught() {
        let store = Buggy::with(Bugs {
            calendar_without_deadline: true,
            leaves_undated: true,
            ..Bugs::default()
        });
        testing::calendar_counters_are_distinct_per_period_and_dated(&store).await;
    }

    #[tokio::test]
    #[should_panic(expected = "a charge past its period must be an error")]
    async fn charging_a_line_past_its_period_is_caught() {
        let store = Buggy::with(Bugs {
            charges_past_the_period: true,
            ..Bugs::default()
        });
        testing::a_charge_past_its_period_is_an_error(&store).await;
    }

    #[tokio::test]
    #[should_panic(expected = "a charge past the limit must be refused")]
    async fn a_count_that_wraps_is_caught() {
        let store = Buggy::with(Bugs {
            wraps: true,
            ..Bugs::default()
        });
        testing::counts_never_pass_the_limit_nor_wrap(&store).await;
    }

    #[tokio::test]
    #[should_panic(expected = "a counter a settle creates ends at the debt's deadline")]
    async fn a_settle_that_dates_from_itself_is_caught() {
        let store = Buggy::with(Bugs {
            settle_redates: true,
            ..Bugs::default()
        });
        testing::settle_debt_keeps_to_the_debts_period(&store).await;
    }

    #[tokio::test]
    #[should_panic(expected = "a debt of a calendar window that is over must not be settled")]
    async fn a_settle_of_a_period_that_is_over_is_caught() {
        let store = Buggy::with(Bugs {
            settle_opens_ended: true,
            ..Bugs::default()
        });
        testing::settle_debt_keeps_to_the_debts_period(&store).await;
    }

    /// The trait's default settle, a charge at the settle's instant, counts
    /// right but records that instant as a new counter's first call: the
    /// suite tells a store of its own to do better.
    #[tokio::test]
    #[should_panic(expected = "a counter a settle creates records the debt's first call")]
    async fn a_settle_made_a_charge_is_caught() {
        let store = Buggy::with(Bugs {
            settle_by_charge: true,
            ..Bugs::default()
        });
        testing::settle_debt_keeps_to_the_debts_period(&store).await;
    }

    /// A store that reports when its counters were made, and refunds
    /// whatever counter lives at a key, takes a give-back of a request
    /// charged before a reset off the counter made since.
    #[tokio::test]
    #[should_panic(expected = "a refund made by an instant before the counter was made")]
    async fn a_change_that_ignores_the_counters_making_is_caught() {
        let store = Buggy::with(Bugs {
            ignores_made_by: true,
            ..Bugs::default()
        });
        testing::changes_made_before_a_counter_do_not_land(&store).await;
    }

    /// A store that gives a block's units back to whatever counter was
    /// made by its first call takes them off a counter made since by an
    /// earlier charge.
    #[tokio::test]
    #[should_panic(expected = "a refund made at another counter's first call")]
    async fn a_give_back_to_a_counter_made_earlier_since_is_caught() {
        let store = Buggy::with(Bugs {
            refunds_at_as_by: true,
            ..Bugs::default()
        });
        testing::changes_made_at_a_first_call_land_on_that_counter_only(&store).await;
    }

    /// A store that adds a deferred cost to whatever counter was made by
    /// the first call its charge reported charges a counter made since by
    /// an earlier charge, after a reset, for a request it never admitted.
    #[tokio::test]
    #[should_panic(expected = "an add made at another counter's first call")]
    async fn a_deferred_cost_on_a_counter_made_earlier_since_is_caught() {
        let store = Buggy::with(Bugs {
            adds_at_as_by: true,
            ..Bugs::default()
        });
        testing::changes_made_at_a_first_call_land_on_that_counter_only(&store).await;
    }

    /// A store that keeps a first-use counter that a give-back emptied
    /// keeps the period a request not served opened.
    #[tokio::test]
    #[should_panic(expected = "leaves no period open")]
    async fn a_period_kept_open_by_an_emptied_counter_is_caught() {
        let store = Buggy::with(Bugs {
            keeps_emptied: true,
            ..Bugs::default()
        });
        testing::give_backs_that_empty_a_first_use_counter_close_its_period(&store).await;
    }

    /// A store that forgets a support refund lowered a counter closes a
    /// period a served request's units are in, when a give-back of another
    /// request's charge equals what is left.
    #[tokio::test]
    #[should_panic(expected = "after a support refund lowered it leaves its period open")]
    async fn a_period_closed_after_a_support_refund_is_caught() {
        let store = Buggy::with(Bugs {
            forgets_support_refunds: true,
            ..Bugs::default()
        });
        testing::give_backs_that_empty_a_first_use_counter_close_its_period(&store).await;
    }

    #[tokio::test]
    #[should_panic(expected = "an abandoned charge must spend nothing")]
    async fn a_charge_kept_for_a_caller_gone_is_caught() {
        let store = Buggy::with(Bugs {
            keeps_abandoned: true,
            ..Bugs::default()
        });
        testing::an_abandoned_charge_spends_nothing(&store).await;
    }

    /// Each small rule of `each_call_answers_as_documented`, broken on
    /// purpose, is caught.
    #[tokio::test]
    #[should_panic(expected = "a charge over its limit on a new key must be refused")]
    async fn a_new_counter_charged_past_its_limit_is_caught() {
        let store = Buggy::with(Bugs {
            admits_creating: true,
            ..Bugs::default()
        });
        testing::each_call_answers_as_documented(&store).await;
    }

    #[tokio::test]
    #[should_panic(expected = "a charge of nothing must create no counter")]
    async fn a_counter_made_by_a_charge_of_nothing_is_caught() {
        let store = Buggy::with(Bugs {
            zero_cost_creates: true,
            ..Bugs::default()
        });
        testing::each_call_answers_as_documented(&store).await;
    }

    #[tokio::test]
    #[should_panic(expected = "a reset of a live counter must answer that there was one")]
    async fn a_reset_that_misreports_is_caught() {
        let store = Buggy::with(Bugs {
            reset_says_false: true,
            ..Bugs::default()
        });
        testing::each_call_answers_as_documented(&store).await;
    }

    #[tokio::test]
    #[should_panic(expected = "never below")]
    async fn a_refund_that_wraps_below_zero_is_caught() {
        let store = Buggy::with(Bugs {
            refund_wraps: true,
            ..Bugs::default()
        });
        testing::each_call_answers_as_documented(&store).await;
    }

    #[tokio::test]
    #[should_panic(expected = "add_made_by on a key never charged must find no counter")]
    async fn a_counter_made_by_add_made_by_is_caught() {
        let store = Buggy::with(Bugs {
            add_made_by_creates: true,
            ..Bugs::default()
        });
        testing::each_call_answers_as_documented(&store).await;
    }

    #[tokio::test]
    #[should_panic(expected = "after a plain refund (support's) lowered a first-use counter")]
    async fn a_plain_refund_that_marks_nothing_is_caught() {
        let store = Buggy::with(Bugs {
            plain_refund_unmarked: true,
            ..Bugs::default()
        });
        testing::each_call_answers_as_documented(&store).await;
    }

    #[tokio::test]
    #[should_panic(expected = "a peek must ignore the costs it is given")]
    async fn a_peek_that_counts_costs_is_caught() {
        let store = Buggy::with(Bugs {
            peek_counts_cost: true,
            ..Bugs::default()
        });
        testing::each_call_answers_as_documented(&store).await;
    }

    #[tokio::test]
    #[should_panic(expected = "a charge past its period must be an error of kind Other")]
    async fn a_charge_past_its_period_of_another_kind_is_caught() {
        let store = Buggy::with(Bugs {
            past_period_unavailable: true,
            ..Bugs::default()
        });
        testing::a_charge_past_its_period_is_an_error(&store).await;
    }

    /// A store that lets a settle whose caller stopped waiting stand, and
    /// adds the debt of one settle id once (as `Debt::id` documents: the
    /// ledger never gives two settles one id, whatever their keys), keeps
    /// the contract: it passes the whole suite, whose every debt has an id
    /// of its own.
    #[tokio::test]
    async fn a_store_that_knows_settle_ids_passes_the_whole_suite() {
        let store = Buggy::with(Bugs {
            keeps_abandoned_settles: true,
            knows_settle_ids: true,
            ..Bugs::default()
        });
        for (name, verdict) in testing::run_all(&store).await {
            assert_eq!(verdict, Verdict::Passed, "{name}");
        }
    }

    /// Each planted bug below, which the suite as it stood let pass, is
    /// caught by `run_all`.
    macro_rules! caught {
        ($($case:ident: $bug:ident => $expected:literal),* $(,)?) => {$(
            #[tokio::test]
            #[should_panic(expected = $expected)]
            async fn $case() {
                let store = Buggy::with(Bugs { $bug: true, ..Bugs::default() });
                testing::run_all(&store).await;
            }
        )*};
    }

    caught!(
        a_reopened_counter_with_the_ended_ones_first_call_is_caught: reuses_ended_first_call
            => "a counter opened after its key's period ended must report its own first call",
        a_give_back_to_a_counter_made_later_since_is_caught: refund_at_guards_earlier_only
            => "a give-back at an ended counter's first call must not land on the counter opened since",
        a_counter_live_at_its_deadline_is_caught: live_at_deadline
            => "a first-use counter ends at its deadline: a peek at that instant",
        guarded_changes_at_the_deadline_are_caught: made_calls_live_at_deadline
            => "a first-use counter ends at its deadline: a refund made by its first call at that instant",
        a_settle_at_its_deadline_is_caught: settles_at_its_deadline
            => "a first-use counter ends at its deadline: a settle of a debt of its period",
        a_settle_kept_for_a_caller_gone_is_caught: keeps_abandoned_settles
            => "a settle sent again under its id must count once",
        an_identity_of_the_handle_is_caught: identity_per_handle
            => "the clones of a store must share its identity",
        an_identity_shared_with_another_store_is_caught: identity_shared
            => "must not share another live store's identity",
        a_settle_that_wraps_is_caught: settle_wraps
            => "a settle must never leave a smaller count",
        a_counter_made_by_a_guarded_refund_is_caught: guarded_refund_creates
            => "refund_made_by on a key never charged must find no counter",
        a_calendar_counter_made_anew_by_a_settle_is_caught: calendar_settle_overwrites
            => "a settle adds to a live calendar counter, never makes it anew",
        a_counter_dropped_at_its_deadline_is_caught: sweeps_at_deadline
            => "must find the window's counter spent, never a fresh one",
    );
}
