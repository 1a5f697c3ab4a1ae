use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use jiff::{SignedDuration, Timestamp};

use super::*;
use crate::key::Namespace;
use crate::subject::Subject;

fn now_of<F: Future>(future: F) -> F::Output {
    match pin!(future).poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(output) => output,
        Poll::Pending => panic!("the memory store answers at once"),
    }
}

fn at(s: &str) -> Timestamp {
    s.parse().unwrap()
}

fn key(id: &str, allowance: &str, period: &str) -> PeriodKey {
    Namespace::default().key(&Subject::account(id), allowance, period)
}

fn first_use(key: PeriodKey, limit: u64, cost: u64, deadline: Timestamp) -> ChargeLine {
    ChargeLine {
        key,
        limit,
        cost,
        lifetime: Lifetime::FirstUse { deadline },
        shadow_limit: None,
    }
}

fn calendar(key: PeriodKey, limit: u64, cost: u64, start: &str, end: &str) -> ChargeLine {
    ChargeLine {
        key,
        limit,
        cost,
        lifetime: Lifetime::Calendar {
            start: at(start),
            end: at(end),
        },
        shadow_limit: None,
    }
}

fn charge(store: &MemoryStore, now: Timestamp, lines: Vec<ChargeLine>) -> ChargeOutcome {
    now_of(store.charge(ChargeRequest {
        charged_at: None,
        now,
        lines: lines.into(),
    }))
    .unwrap()
}

#[test]
fn hits_never_move_a_first_use_deadline() {
    let store = MemoryStore::new();
    let t0 = at("2026-12-02T10:00:00Z");
    let deadline = at("2026-12-02T11:00:00Z");
    let k = key("acme", "read", "PT1H");
    let mut now = t0;
    for i in 0..100 {
        // Each request proposes a later deadline; the counter keeps its own.
        let proposed = now.checked_add(SignedDuration::from_hours(1)).unwrap();
        let outcome = charge(&store, now, vec![first_use(k.clone(), 1_000, 1, proposed)]);
        assert!(outcome.admitted);
        assert_eq!(outcome.usage[0].resets_at, deadline, "hit {i}");
        assert_eq!(outcome.usage[0].first_call, Some(t0));
        now = now.checked_add(SignedDuration::from_secs(30)).unwrap();
    }
}

#[test]
fn an_expired_first_use_counter_starts_a_new_period() {
    let store = MemoryStore::new();
    let k = key("acme", "read", "PT1H");
    let t0 = at("2026-12-02T10:00:00Z");
    let end = at("2026-12-02T11:00:00Z");
    assert!(charge(&store, t0, vec![first_use(k.clone(), 1, 1, end)]).admitted);
    assert!(
        !charge(
            &store,
            at("2026-12-02T10:59:59.999Z"),
            vec![first_use(k.clone(), 1, 1, end)]
        )
        .admitted
    );
    let next_end = at("2026-12-02T12:00:00Z");
    let outcome = charge(&store, end, vec![first_use(k, 1, 1, next_end)]);
    assert!(outcome.admitted);
    assert_eq!(outcome.usage[0].resets_at, next_end);
    assert_eq!(outcome.usage[0].first_call, Some(end));
}

#[test]
fn refunds_never_create_or_resurrect_and_keep_the_deadline() {
    let store = MemoryStore::new();
    let k = key("acme", "read", "PT1H");
    let t0 = at("2026-12-02T10:00:00Z");
    let end = at("2026-12-02T11:00:00Z");
    assert_eq!(now_of(store.refund(t0, k.clone(), 1)).unwrap(), None);
    assert!(store.is_empty(), "a refund created a counter");

    charge(&store, t0, vec![first_use(k.clone(), 5, 3, end)]);
    assert_eq!(now_of(store.refund(t0, k.clone(), 1)).unwrap(), Some(2));
    assert_eq!(
        now_of(store.refund(t0, k.clone(), 10)).unwrap(),
        Some(0),
        "never below zero"
    );
    let usage = now_of(store.peek(ChargeRequest {
        charged_at: None,
        now: t0,
        lines: smallvec::smallvec![first_use(k.clone(), 5, 0, at("2026-12-09T00:00:00Z"))],
    }))
    .unwrap();
    assert_eq!(usage[0].resets_at, end);

    assert_eq!(
        now_of(store.refund(end, k.clone(), 1)).unwrap(),
        None,
        "expired counters stay expired"
    );
    let after = charge(
        &store,
        end,
        vec![first_use(k, 5, 1, at("2026-12-02T12:00:00Z"))],
    );
    assert_eq!(after.usage[0].used, 1);
}

#[test]
fn adds_never_create_or_resurrect_and_keep_the_deadline() {
    let store = MemoryStore::new();
    let k = key("acme", "read", "PT1H");
    let t0 = at("2026-12-02T10:00:00Z");
    let t1 = at("2026-12-02T10:30:00Z");
    let end = at("2026-12-02T11:00:00Z");
    assert_eq!(now_of(store.add(t0, k.clone(), 5)).unwrap(), None);
    assert!(store.is_empty(), "an add created a counter");

    charge(&store, t0, vec![first_use(k.clone(), 5, 3, end)]);
    assert_eq!(
        now_of(store.add(t1, k.clone(), 4)).unwrap(),
        Some(7),
        "an add checks no limit"
    );
    assert_eq!(now_of(store.add(t1, k.clone(), 0)).unwrap(), Some(7));
    let later = at("2026-12-02T11:30:00Z");
    let usage = now_of(store.peek(ChargeRequest {
        charged_at: None,
        now: t1,
        lines: smallvec::smallvec![first_use(k.clone(), 5, 0, later)],
    }))
    .unwrap();
    assert_eq!(usage[0].used, 7);
    assert_eq!(usage[0].resets_at, end, "an add moved the deadline");
    assert_eq!(usage[0].first_call, Some(t0));
    let refused = charge(&store, t1, vec![first_use(k.clone(), 5, 1, later)]);
    assert!(
        !refused.admitted,
        "a counter over its limit refuses charges"
    );
    assert_eq!(refused.usage[0].resets_at, end);
    assert_eq!(
        now_of(store.add(t1, k.clone(), u64::MAX)).unwrap(),
        Some(u64::MAX),
        "the count saturates"
    );

    assert_eq!(
        now_of(store.add(end, k.clone(), 1)).unwrap(),
        None,
        "expired counters stay expired"
    );
    let next_end = at("2026-12-02T12:00:00Z");
    let after = charge(&store, end, vec![first_use(k, 5, 1, next_end)]);
    assert_eq!(after.usage[0].used, 1, "the next charge opens a new period");
    assert_eq!(after.usage[0].resets_at, next_end);
    assert_eq!(after.usage[0].first_call, Some(end));

    let window = key("acme", "read", "2026-12-02");
    let day = || {
        calendar(
            window.clone(),
            5,
            1,
            "2026-12-02T00:00:00Z",
            "2026-12-03T00:00:00Z",
        )
    };
    charge(&store, t0, vec![day()]);
    assert_eq!(now_of(store.add(t1, window.clone(), 2)).unwrap(), Some(3));
    assert_eq!(
        now_of(store.add(at("2026-12-03T00:00:00Z"), window.clone(), 2)).unwrap(),
        None,
        "a calendar counter ends with its window"
    );
}

/// A count at the top of `u64` never wraps: a charge that would take it past
/// its limit is refused, on the short path of one line and on the path of
/// several, and an add saturates.
#[test]
fn counts_near_u64_max_never_wrap() {
    let store = MemoryStore::new();
    let t0 = at("2026-12-02T10:00:00Z");
    let end = at("2026-12-03T00:00:00Z");
    let k = key("acme", "read", "PT24H");
    let line = |cost| first_use(k.clone(), u64::MAX, cost, end);
    assert!(charge(&store, t0, vec![line(u64::MAX - 1)]).admitted);
    let over = charge(&store, t0, vec![line(5)]);
    assert!(!over.admitted, "a charge past the limit was admitted");
    assert_eq!(over.usage[0].used, u64::MAX - 1);

    // The same over two lines: the sum passes the limit on the first.
    let other = key("acme", "write", "PT24H");
    let two = |cost| vec![line(cost), first_use(other.clone(), 10, 1, end)];
    let over = charge(&store, t0, two(5));
    assert!(
        !over.admitted,
        "a charge of two lines past the limit was admitted"
    );
    assert_eq!(over.usage[0].used, u64::MAX - 1);
    assert_eq!(over.usage[1].used, 0);
    // A key listed twice, whose costs together pass the limit.
    let twice = vec![line(1), line(u64::MAX)];
    let over = charge(&store, t0, twice);
    assert!(!over.admitted);
    assert_eq!(over.usage[0].used, u64::MAX - 1);
    // Exactly the limit still fits.
    let full = charge(&store, t0, two(1));
    assert!(full.admitted);
    assert_eq!(full.usage[0].used, u64::MAX);
    assert!(!charge(&store, t0, vec![line(1)]).admitted);

    // An add saturates.
    let k2 = key("acme", "late", "PT24H");
    charge(&store, t0, vec![first_use(k2.clone(), 10, 1, end)]);
    assert_eq!(
        now_of(store.add(t0, k2.clone(), u64::MAX - 1)).unwrap(),
        Some(u64::MAX)
    );
    assert_eq!(now_of(store.add(t0, k2, 5)).unwrap(), Some(u64::MAX));
}

#[test]
fn a_refused_charge_spends_nothing_on_any_line() {
    let store = MemoryStore::new();
    let t0 = at("2026-12-02T10:00:00Z");
    let minute = || {
        calendar(
            key("acme", "read", "2026-12-02T10:00"),
            2,
            1,
            "2026-12-02T10:00:00Z",
            "2026-12-02T10:01:00Z",
        )
    };
    let day = || {
        calendar(
            key("acme", "read", "2026-12-02"),
            100,
            1,
            "2026-12-02T00:00:00Z",
            "2026-12-03T00:00:00Z",
        )
    };
    assert!(charge(&store, t0, vec![minute(), day()]).admitted);
    assert!(charge(&store, t0, vec![minute(), day()]).admitted);
    let refused = charge(&store, t0, vec![minute(), day()]);
    assert!(!refused.admitted);
    assert_eq!(refused.usage[0].used, 2);
    assert_eq!(refused.usage[1].used, 2);
}

#[test]
fn lines_of_different_subjects_are_all_or_nothing_across_shards() {
    let store = MemoryStore::with_shards(8);
    let t0 = at("2026-12-02T10:00:00Z");
    let end = at("2026-12-03T00:00:00Z");
    let lines = |limit_b| {
        (0..20)
            .map(|i| {
                let limit = if i == 7 { limit_b } else { 10 };
                first_use(key(&format!("subject-{i}"), "read", "PT24H"), limit, 1, end)
            })
            .collect::<Vec<_>>()
    };
    assert!(!charge(&store, t0, lines(0)).admitted);
    assert!(store.is_empty());
    assert!(charge(&store, t0, lines(1)).admitted);
    assert_eq!(store.len(), 20);
}

#[test]
fn a_key_listed_twice_is_charged_twice() {
    let store = MemoryStore::new();
    let t0 = at("2026-12-02T10:00:00Z");
    let end = at("2026-12-03T00:00:00Z");
    let k = key("acme", "read", "PT24H");
    let outcome = charge(
        &store,
        t0,
        vec![
            first_use(k.clone(), 3, 2, end),
            first_use(k.clone(), 3, 2, end),
        ],
    );
    assert!(!outcome.admitted);
    let outcome = charge(
        &store,
        t0,
        vec![first_use(k.clone(), 4, 2, end), first_use(k, 4, 2, end)],
    );
    assert!(outcome.admitted);
    assert_eq!(outcome.usage[1].used, 4);
}

#[test]
fn a_free_request_opens_no_period() {
    let store = MemoryStore::new();
    let t0 = at("2026-12-02T10:00:00Z");
    let outcome = charge(
        &store,
        t0,
        vec![first_use(
            key("acme", "read", "PT1H"),
            3,
            0,
            at("2026-12-02T11:00:00Z"),
        )],
    );
    assert!(outcome.admitted);
    assert_eq!(outcome.usage[0].first_call, None);
    assert!(store.is_empty());
}

#[test]
fn expired_counters_are_reclaimed_without_traffic_to_them() {
    let store = MemoryStore::with_shards(16);
    let t0 = at("2026-12-02T10:00:00Z");
    for i in 0..2_000 {
        let line = calendar(
            key(&format!("s{i}"), "read", "2026-12-02"),
            10,
            1,
            "2026-12-02T00:00:00Z",
            "2026-12-03T00:00:00Z",
        );
        charge(&store, t0, vec![line]);
    }
    assert_eq!(store.len(), 2_000);
    // The next day only one subject calls, yet the old counters go: every
    // eighth charge reclaims up to 32 expired counters of another shard.
    let t1 = at("2026-12-03T08:00:00Z");
    for _ in 0..1_000 {
        let line = calendar(
            key("busy", "read", "2026-12-03"),
            1_000,
            1,
            "2026-12-03T00:00:00Z",
            "2026-12-04T00:00:00Z",
        );
        charge(&store, t1, vec![line]);
    }
    assert_eq!(store.len(), 1);
}

/// A request reads the clock, then charges: another that read it later can
/// charge first. A sweep on the later one's instant must not take the
/// earlier one's window from it: a counter lives past its deadline by the
/// grace, so the late charge finds the full counter, never a fresh one.
#[test]
fn a_charge_stamped_before_a_deadline_finds_its_counter_after_a_later_sweep() {
    let end = at("2026-12-03T00:00:00Z");
    let just_before = end - SignedDuration::from_nanos(1);
    let just_after = end + SignedDuration::from_nanos(1);
    let day = |id: &str| {
        calendar(
            key(id, "read", "2026-12-02"),
            1,
            1,
            "2026-12-02T00:00:00Z",
            "2026-12-03T00:00:00Z",
        )
    };
    let store = MemoryStore::with_shards(1);
    assert!(charge(&store, just_before, vec![day("acme")]).admitted);
    assert!(!charge(&store, just_before, vec![day("acme")]).admitted);
    // Another subject's charge of the next day sweeps the shard.
    let next = calendar(
        key("other", "read", "2026-12-03"),
        1,
        1,
        "2026-12-03T00:00:00Z",
        "2026-12-04T00:00:00Z",
    );
    assert!(charge(&store, just_after, vec![next]).admitted);
    store.purge_expired(just_after);
    let late = charge(&store, just_before, vec![day("acme")]);
    assert!(!late.admitted, "the day's allowance was spent");
    assert_eq!(late.usage[0].used, 1);
    // A full store makes room the same way.
    let full = MemoryStore::with_shards(1).max_counters(1);
    assert!(charge(&full, just_before, vec![day("acme")]).admitted);
    let other_day = calendar(
        key("other", "read", "2026-12-03"),
        1,
        1,
        "2026-12-03T00:00:00Z",
        "2026-12-04T00:00:00Z",
    );
    assert!(try_charge(&full, just_after, vec![other_day]).is_err());
    assert!(!charge(&full, just_before, vec![day("acme")]).admitted);
    // Past the grace, the counter goes.
    store.purge_expired(end + memory::RECLAIM_GRACE);
    assert_eq!(store.len(), 1, "only the next day's counter is left");
}

/// A layer further in charges a request at the instant its policy's
/// outermost layer stamped it: behind a queue, that can reach the store
/// many seconds after the window ended and after later charges swept the
/// shard. The counter is still there, spent: the late charge is refused,
/// not admitted on a fresh counter of a window that ended.
#[test]
fn a_charge_that_waited_seconds_between_layers_finds_its_spent_counter() {
    let end = at("2026-12-02T10:01:00Z");
    let stamped = end - SignedDuration::from_millis(200);
    let minute = |id: &str| {
        calendar(
            key(id, "burst", "2026-12-02T10:00"),
            1,
            1,
            "2026-12-02T10:00:00Z",
            "2026-12-02T10:01:00Z",
        )
    };
    let store = MemoryStore::with_shards(1);
    assert!(charge(&store, stamped, vec![minute("acme")]).admitted);
    // Other subjects' charges of the next minutes sweep the shard, up to
    // half a minute on.
    for (i, seconds) in [1, 2, 5, 10, 30].into_iter().enumerate() {
        let next = calendar(
            key(&format!("other-{i}"), "burst", "2026-12-02T10:01"),
            1,
            1,
            "2026-12-02T10:01:00Z",
            "2026-12-02T10:02:00Z",
        );
        let later = end + SignedDuration::from_secs(seconds);
        assert!(charge(&store, later, vec![next]).admitted);
    }
    store.purge_expired(end + SignedDuration::from_secs(30));
    let late = charge(&store, stamped, vec![minute("acme")]);
    assert!(!late.admitted, "the minute's allowance was spent");
    assert_eq!(late.usage[0].used, 1);
    store.purge_expired(end + memory::RECLAIM_GRACE);
    assert_eq!(store.len(), 5, "the ended minute's counter went at last");
}

/// A counter reset and made again, over and over, within its period (a
/// support tool's resets) leaves the deadlines filed for its sweeps bounded
/// by the counters held, not growing with every reset until the month ends.
#[test]
fn resets_and_charges_over_and_over_keep_the_deadlines_filed_bounded() {
    let now = at("2026-12-02T10:00:00Z");
    let k = key("acme", "read", "2026-12");
    let month = || {
        calendar(
            k.clone(),
            10,
            1,
            "2026-12-01T00:00:00Z",
            "2027-01-01T00:00:00Z",
        )
    };
    // Counts of resets around the one whose last creation files anew.
    for resets in [10_000, 63, 64, 65, 66] {
        let store = MemoryStore::with_shards(1);
        for _ in 0..resets {
            assert!(charge(&store, now, vec![month()]).admitted);
            assert!(now_of(store.reset(k.clone())).unwrap());
        }
        assert!(charge(&store, now, vec![month()]).admitted);
        assert_eq!(store.len(), 1);
        assert!(store.filed_deadlines() <= 66, "{}", store.filed_deadlines());
        // The counter's own deadline is still filed: it goes once it ended.
        store.purge_expired(at("2027-01-01T00:00:00Z") + memory::RECLAIM_GRACE);
        assert_eq!(store.len(), 0, "after {resets} resets");
    }
}

#[test]
fn purge_reclaims_everything_expired() {
    // One shard, and more counters than a purge reclaims under one lock.
    let store = MemoryStore::with_shards(1);
    let t0 = at("2026-12-02T10:00:00Z");
    for i in 0..1_500 {
        charge(
            &store,
            t0,
            vec![first_use(
                key(&format!("s{i}"), "w", "PT1M"),
                5,
                1,
                at("2026-12-02T10:01:00Z"),
            )],
        );
    }
    store.purge_expired(at("2026-12-02T10:00:59Z"));
    assert_eq!(store.len(), 1_500);
    // A counter outlives its deadline by the grace.
    store.purge_expired(at("2026-12-02T10:01:00Z"));
    assert_eq!(store.len(), 1_500);
    store.purge_expired(at("2026-12-02T10:01:00Z") + memory::RECLAIM_GRACE);
    assert!(store.is_empty());
}

#[test]
fn reset_gives_a_fresh_allowance() {
    let store = MemoryStore::new();
    let t0 = at("2026-12-02T10:00:00Z");
    let k = key("acme", "read", "PT1H");
    charge(
        &store,
        t0,
        vec![first_use(k.clone(), 1, 1, at("2026-12-02T11:00:00Z"))],
    );
    assert!(now_of(store.reset(k.clone())).unwrap());
    assert!(!now_of(store.reset(k.clone())).unwrap());
    let t1 = at("2026-12-02T10:30:00Z");
    let outcome = charge(
        &store,
        t1,
        vec![first_use(k, 1, 1, at("2026-12-02T11:30:00Z"))],
    );
    assert!(outcome.admitted);
    assert_eq!(outcome.usage[0].resets_at, at("2026-12-02T11:30:00Z"));
    // The old deadline, still in the heap, must not reclaim the new counter.
    store.purge_expired(at("2026-12-02T11:00:00Z") + memory::RECLAIM_GRACE);
    assert_eq!(store.len(), 1);
}

/// Keys of every length around the longest a shard's map keeps in its slot
/// are counted apart, refunded, reclaimed and reset alike; two keys that
/// share their first bytes never share a counter.
#[test]
fn keys_short_and_long_are_counted_alike() {
    let store = MemoryStore::with_shards(1);
    let t0 = at("2026-12-02T10:00:00Z");
    let end = at("2026-12-02T11:00:00Z");
    let base = key("", "read", "PT1H").as_str().len();
    let keys: Vec<PeriodKey> = (50..80)
        .map(|len| key(&"a".repeat(len - base), "read", "PT1H"))
        .collect();
    assert!(keys.iter().any(|k| k.as_str().len() < 62));
    assert!(keys.iter().any(|k| k.as_str().len() > 62));
    for (i, k) in keys.iter().enumerate() {
        let cost = i as u64 + 1;
        let outcome = charge(&store, t0, vec![first_use(k.clone(), 1_000, cost, end)]);
        assert_eq!(outcome.usage[0].used, cost, "{}", k.as_str().len());
    }
    for (i, k) in keys.iter().enumerate() {
        let cost = i as u64 + 1;
        let outcome = charge(&store, t0, vec![first_use(k.clone(), 1_000, 1, end)]);
        assert_eq!(outcome.usage[0].used, cost + 1, "{}", k.as_str().len());
        assert_eq!(now_of(store.refund(t0, k.clone(), 1)).unwrap(), Some(cost));
    }
    assert_eq!(store.len(), keys.len());
    assert!(now_of(store.reset(keys[20].clone())).unwrap());
    assert_eq!(store.len(), keys.len() - 1);
    store.purge_expired(end + memory::RECLAIM_GRACE);
    assert!(store.is_empty());
}

/// A calendar counter reset and made again in its period ends when the
/// period does: its deadline, filed twice, reclaims it once, and the
/// store's count of counters stays right for the bound.
#[test]
fn a_counter_made_again_after_a_reset_is_reclaimed_once_and_counted_once() {
    let store = MemoryStore::with_shards(1).max_counters(1);
    let t0 = at("2026-12-02T10:00:00Z");
    let day = |id: &str| {
        calendar(
            key(id, "read", "2026-12-02"),
            10,
            1,
            "2026-12-02T00:00:00Z",
            "2026-12-03T00:00:00Z",
        )
    };
    assert!(charge(&store, t0, vec![day("acme")]).admitted);
    assert!(now_of(store.reset(key("acme", "read", "2026-12-02"))).unwrap());
    assert!(store.is_empty());
    let outcome = charge(&store, t0, vec![day("acme")]);
    assert!(outcome.admitted);
    assert_eq!(outcome.usage[0].used, 1, "a fresh allowance");
    // The bound counts the counter once: another subject finds no room.
    assert!(try_charge(&store, t0, vec![day("other")]).is_err());
    store.purge_expired(at("2026-12-02T23:59:59Z"));
    assert_eq!(store.len(), 1, "reclaimed before its end");
    store.purge_expired(at("2026-12-03T00:00:00Z") + memory::RECLAIM_GRACE);
    assert!(store.is_empty());
    let t1 = at("2026-12-03T00:00:00Z");
    let next = calendar(
        key("other", "read", "2026-12-03"),
        10,
        1,
        "2026-12-03T00:00:00Z",
        "2026-12-04T00:00:00Z",
    );
    assert!(
        try_charge(&store, t1, vec![next]).is_ok(),
        "room once reclaimed"
    );
}

#[test]
fn exact_under_threads() {
    let store = MemoryStore::new();
    let t0 = at("2026-12-02T10:00:00Z");
    let admitted = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|scope| {
        for _ in 0..8 {
            scope.spawn(|| {
                for _ in 0..500 {
                    let line = calendar(
                        key("acme", "read", "2026-12-02"),
                        1_234,
                        1,
                        "2026-12-02T00:00:00Z",
                        "2026-12-03T00:00:00Z",
                    );
                    if charge(&store, t0, vec![line]).admitted {
                        admitted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            });
        }
    });
    assert_eq!(admitted.into_inner(), 1_234);
}

#[test]
fn exact_under_threads_with_two_quotas() {
    let store = MemoryStore::with_shards(4);
    let t0 = at("2026-12-02T10:00:00Z");
    let admitted = std::sync::atomic::AtomicU64::new(0);
    let minute = || {
        calendar(
            key("acme", "read", "2026-12-02T10:00"),
            700,
            1,
            "2026-12-02T10:00:00Z",
            "2026-12-02T10:01:00Z",
        )
    };
    let day = || {
        calendar(
            key("acme", "read", "2026-12-02"),
            500,
            1,
            "2026-12-02T00:00:00Z",
            "2026-12-03T00:00:00Z",
        )
    };
    std::thread::scope(|scope| {
        for _ in 0..8 {
            scope.spawn(|| {
                for _ in 0..200 {
                    if charge(&store, t0, vec![minute(), day()]).admitted {
                        admitted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            });
        }
    });
    assert_eq!(admitted.into_inner(), 500);
    let usage = now_of(store.peek(ChargeRequest {
        charged_at: None,
        now: t0,
        lines: smallvec::smallvec![minute(), day()],
    }))
    .unwrap();
    assert_eq!(
        usage[0].used, 500,
        "the minute was charged exactly for the admitted requests"
    );
    assert_eq!(usage[1].used, 500);
}

mod model {
    //! The memory store against a plain model of the contract, on random
    //! sequences of charges, refunds, adds, resets and clock moves.

    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    #[derive(Clone, Debug)]
    enum Op {
        Advance(i64),
        Charge {
            subject: u8,
            quotas: Vec<usize>,
            cost: u64,
        },
        Refund {
            subject: u8,
            quota: usize,
            amount: u64,
        },
        Add {
            subject: u8,
            quota: usize,
            amount: u64,
        },
        Reset {
            subject: u8,
            quota: usize,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0i64..90_000).prop_map(Op::Advance),
            (0u8..3, proptest::collection::vec(0usize..3, 1..4), 0u64..4).prop_map(
                |(subject, quotas, cost)| Op::Charge {
                    subject,
                    quotas,
                    cost
                }
            ),
            (0u8..3, 0usize..3, 0u64..3).prop_map(|(subject, quota, amount)| Op::Refund {
                subject,
                quota,
                amount
            }),
            (0u8..3, 0usize..3, 0u64..5).prop_map(|(subject, quota, amount)| Op::Add {
                subject,
                quota,
                amount
            }),
            (0u8..3, 0usize..3).prop_map(|(subject, quota)| Op::Reset { subject, quota }),
        ]
    }

    /// Quota 0: 5 per rolling 60 s; 1: 3 per 10 s window; 2: 7 per rolling 30 s.
    fn line(quota: usize, subject: u8, now: Timestamp, cost: u64) -> ChargeLine {
        let id = format!("s{subject}");
        let secs = now.as_second();
        match quota {
            0 | 2 => {
                let (len, limit) = if quota == 0 { (60, 5) } else { (30, 7) };
                first_use(
                    key(&id, "a", &format!("PT{len}S")),
                    limit,
                    cost,
                    now.checked_add(SignedDuration::from_secs(len)).unwrap(),
                )
            }
            _ => {
                let start = secs.div_euclid(10) * 10;
                ChargeLine {
                    key: key(&id, "a", &format!("w{start}")),
                    limit: 3,
                    cost,
                    lifetime: Lifetime::Calendar {
                        start: Timestamp::from_second(start).unwrap(),
                        end: Timestamp::from_second(start + 10).unwrap(),
                    },
                    shadow_limit: None,
                }
            }
        }
    }

    #[derive(Clone, Copy, Debug)]
    struct Entry {
        used: u64,
        deadline: Timestamp,
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        #[test]
        fn memory_store_follows_the_contract(ops in proptest::collection::vec(op(), 1..120)) {
            let store = MemoryStore::with_shards(4);
            let mut model: HashMap<PeriodKey, Entry> = HashMap::new();
            let mut now = at("2026-12-02T10:00:00Z");
            for op in ops {
                model.retain(|_, e| e.deadline > now);
                match op {
                    Op::Advance(ms) => now = now.checked_add(SignedDuration::from_millis(ms)).unwrap(),
                    Op::Charge { subject, quotas, cost } => {
                        let mut seen = Vec::new();
                        let lines: Vec<ChargeLine> = quotas
                            .into_iter()
                            .filter(|q| { let new = !seen.contains(q); seen.push(*q); new })
                            .map(|q| line(q, subject, now, cost))
                            .collect();
                        let fits = lines.iter().all(|l| {
                            model.get(&l.key).map_or(0, |e| e.used) + l.cost <= l.limit
                        });
                        let outcome = charge(&store, now, lines.clone());
                        prop_assert_eq!(outcome.admitted, fits);
                        for (l, usage) in lines.iter().zip(&outcome.usage) {
                            if fits && cost > 0 {
                                let deadline = match l.lifetime {
                                    Lifetime::Calendar { end, .. } => end,
                                    Lifetime::FirstUse { deadline } => deadline,
                                };
                                let entry = model.entry(l.key.clone()).or_insert(Entry { used: 0, deadline });
                                entry.used += cost;
                            }
                            let expected = model.get(&l.key).map_or(0, |e| e.used);
                            prop_assert_eq!(usage.used, expected);
                            if let (Lifetime::FirstUse { .. }, Some(e)) = (l.lifetime, model.get(&l.key)) {
                                prop_assert_eq!(usage.resets_at, e.deadline, "a hit moved a deadline");
                            }
                            prop_assert!(usage.resets_at > now);
                        }
                    }
                    Op::Refund { subject, quota, amount } => {
                        let k = line(quota, subject, now, 0).key;
                        let got = now_of(store.refund(now, k.clone(), amount)).unwrap();
                        let expected = model.get_mut(&k).map(|e| { e.used = e.used.saturating_sub(amount); e.used });
                        prop_assert_eq!(got, expected);
                    }
                    Op::Add { subject, quota, amount } => {
                        let k = line(quota, subject, now, 0).key;
                        let got = now_of(store.add(now, k.clone(), amount)).unwrap();
                        let expected = model.get_mut(&k).map(|e| { e.used += amount; e.used });
                        prop_assert_eq!(got, expected);
                    }
                    Op::Reset { subject, quota } => {
                        let k = line(quota, subject, now, 0).key;
                        let removed = now_of(store.reset(k.clone())).unwrap();
                        // The store may still hold an expired, unreclaimed counter.
                        if model.remove(&k).is_some() {
                            prop_assert!(removed);
                        }
                    }
                }
            }
        }
    }
}

fn try_charge(
    store: &MemoryStore,
    now: Timestamp,
    lines: Vec<ChargeLine>,
) -> Result<ChargeOutcome, StoreError> {
    now_of(store.charge(ChargeRequest {
        charged_at: None,
        now,
        lines: lines.into(),
    }))
}

fn minute(id: &str) -> ChargeLine {
    calendar(
        key(id, "read", "2026-12-02T10:00"),
        10,
        1,
        "2026-12-02T10:00:00Z",
        "2026-12-02T10:01:00Z",
    )
}

#[test]
fn a_full_store_refuses_new_subjects_and_keeps_charging_known_ones() {
    let store = MemoryStore::with_shards(4).max_counters(3);
    let t0 = at("2026-12-02T10:00:10Z");
    for id in ["a", "b", "c"] {
        assert!(charge(&store, t0, vec![minute(id)]).admitted);
    }
    let full = try_charge(&store, t0, vec![minute("d")]).unwrap_err();
    assert_eq!(full.kind(), StoreErrorKind::Full);
    assert!(full.to_string().contains("maximum of 3 counters"), "{full}");
    assert_eq!(store.len(), 3, "nothing created");
    // Known subjects are charged as before.
    assert_eq!(charge(&store, t0, vec![minute("a")]).usage[0].used, 2);
}

/// A subject whose first-use counters just ended is charged on them anew,
/// where they are, in a full store: in their grace they take no more room.
#[test]
fn a_full_store_starts_a_known_subjects_ended_counters_again() {
    let store = MemoryStore::with_shards(1).max_counters(2);
    let t0 = at("2026-12-02T10:00:00Z");
    let end = at("2026-12-02T11:00:00Z");
    let lines = |deadline| {
        vec![
            first_use(key("acme", "read", "PT1H"), 10, 1, deadline),
            first_use(key("acme", "write", "PT1H"), 10, 1, deadline),
        ]
    };
    assert!(charge(&store, t0, lines(end)).admitted);
    let later = end + SignedDuration::from_millis(500);
    let again = try_charge(&store, later, lines(later + SignedDuration::from_hours(1)));
    let again = again.expect("no new room needed");
    assert!(again.admitted);
    assert_eq!(again.usage[0].used, 1, "a new period");
    assert_eq!(again.usage[1].used, 1, "a new period");
    assert_eq!(store.len(), 2);
}

#[test]
fn a_full_store_reclaims_expired_counters_first() {
    let store = MemoryStore::with_shards(1).max_counters(2);
    let t0 = at("2026-12-02T10:00:10Z");
    charge(&store, t0, vec![minute("a")]);
    charge(&store, t0, vec![minute("b")]);
    // The window is over: both counters are expired but not yet reclaimed.
    let later = at("2026-12-02T10:05:00Z");
    let next = calendar(
        key("c", "read", "2026-12-02T10:05"),
        10,
        1,
        "2026-12-02T10:05:00Z",
        "2026-12-02T10:06:00Z",
    );
    assert!(try_charge(&store, later, vec![next]).unwrap().admitted);
    assert_eq!(store.len(), 1);
}

#[test]
fn a_full_store_creates_nothing_for_a_charge_of_several_lines() {
    let store = MemoryStore::with_shards(2).max_counters(3);
    let t0 = at("2026-12-02T10:00:10Z");
    charge(&store, t0, vec![minute("a"), minute("b")]);
    let day = calendar(
        key("c", "write", "2026-12-02"),
        10,
        1,
        "2026-12-02T00:00:00Z",
        "2026-12-03T00:00:00Z",
    );
    let error = try_charge(&store, t0, vec![minute("c"), day]).unwrap_err();
    assert_eq!(error.kind(), StoreErrorKind::Full);
    assert_eq!(store.len(), 2, "neither line was created");
    // One more fits.
    assert!(charge(&store, t0, vec![minute("c")]).admitted);
    // A refused charge (over its limit) needs no room at all.
    let over = calendar(
        key("d", "read", "x"),
        1,
        5,
        "2026-12-02T10:00:00Z",
        "2026-12-02T10:01:00Z",
    );
    assert!(!charge(&store, t0, vec![over]).admitted);
}

#[test]
fn a_full_store_reclaims_expired_counters_of_other_shards_too() {
    let store = MemoryStore::with_shards(8).max_counters(4);
    let t0 = at("2026-12-02T10:00:10Z");
    for id in ["a", "b", "c", "d"] {
        assert!(charge(&store, t0, vec![minute(id)]).admitted);
    }
    // Every counter is expired, wherever it lives; the new subjects' shards
    // need not be theirs.
    let later = at("2026-12-02T10:05:00Z");
    for id in ["e", "f", "g", "h"] {
        let next = calendar(
            key(id, "read", "2026-12-02T10:05"),
            10,
            1,
            "2026-12-02T10:05:00Z",
            "2026-12-02T10:06:00Z",
        );
        let outcome = try_charge(&store, later, vec![next]);
        assert!(outcome.unwrap().admitted, "{id}");
    }
    assert_eq!(store.len(), 4);
}

/// A full store refuses a new subject when no counter is past its room
/// grace, and, a moment later, reclaims what is past it since (within the
/// longer grace of a store with room), in any shard.
#[test]
fn a_full_store_that_found_no_room_reclaims_what_expired_since() {
    let store = MemoryStore::with_shards(16).max_counters(4);
    let t0 = at("2026-12-02T10:00:00Z");
    // Reclaimable to make room a millisecond after t0.
    let soon = at("2026-12-02T10:00:00.001Z") - memory::ROOM_GRACE;
    for id in ["a", "b", "c", "d"] {
        let line = first_use(key(id, "read", "PT1S"), 10, 1, soon);
        assert!(charge(&store, soon - SignedDuration::from_secs(1), vec![line]).admitted);
    }
    let new = |id: &str| first_use(key(id, "read", "PT1H"), 10, 1, at("2026-12-02T11:00:00Z"));
    let full = try_charge(&store, t0, vec![new("e")]).unwrap_err();
    assert_eq!(full.kind(), StoreErrorKind::Full);
    // Every counter's room grace ended a millisecond later.
    let later = t0 + SignedDuration::from_millis(20);
    for id in ["f", "g", "h", "i"] {
        assert!(
            try_charge(&store, later, vec![new(id)]).unwrap().admitted,
            "{id}"
        );
    }
    assert_eq!(store.len(), 4);
}

#[test]
fn concurrent_new_subjects_never_take_the_store_beyond_its_bound() {
    const MAX: usize = 50;
    let store = MemoryStore::with_shards(64).max_counters(MAX);
    let t0 = at("2026-12-02T10:00:10Z");
    let start = std::sync::Barrier::new(8);
    let created: usize = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..8)
            .map(|thread| {
                let (store, start) = (&store, &start);
                scope.spawn(move || {
                    start.wait();
                    (0..100)
                        .filter(|i| {
                            match try_charge(store, t0, vec![minute(&format!("{thread}-{i}"))]) {
                                Ok(outcome) => outcome.admitted,
                                Err(error) => {
                                    assert_eq!(error.kind(), StoreErrorKind::Full);
                                    false
                                }
                            }
                        })
                        .count()
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).sum()
    });
    assert_eq!(created, MAX);
    assert_eq!(store.len(), MAX);
    // What the store counts is what it holds: once everything is reclaimed,
    // exactly the bound fits again.
    let later = at("2026-12-02T11:00:00Z");
    store.purge_expired(later);
    assert_eq!(store.len(), 0);
    let hour = |id: String| {
        calendar(
            key(&id, "read", "2026-12-02T11"),
            10,
            1,
            "2026-12-02T11:00:00Z",
            "2026-12-02T12:00:00Z",
        )
    };
    for i in 0..MAX {
        assert!(try_charge(&store, later, vec![hour(format!("n{i}"))]).is_ok());
    }
    let full = try_charge(&store, later, vec![hour("one-more".into())]).unwrap_err();
    assert_eq!(full.kind(), StoreErrorKind::Full);
}

/// A charge that replaces an expired counter where it is, while the store is
/// full: making room may reclaim that very counter, and the store still
/// counts exactly what it holds.
#[test]
fn a_full_store_counts_a_counter_it_reclaimed_and_created_again() {
    let store = MemoryStore::with_shards(1).max_counters(2);
    let t0 = at("2026-12-02T10:00:00Z");
    // Deadlines filed before A's and no longer backed by a counter: the
    // sweep that opens each charge spends its budget on them and stops
    // short of A.
    for i in 0..super::memory::SWEEP_BUDGET {
        let stale = key(&format!("stale-{i}"), "read", "PT1S");
        charge(
            &store,
            t0,
            vec![first_use(stale.clone(), 10, 1, at("2026-12-02T10:00:01Z"))],
        );
        assert!(now_of(store.reset(stale)).unwrap());
    }
    let a = key("s", "read", "PT1M");
    let b = key("other", "read", "PT1H");
    charge(
        &store,
        t0,
        vec![first_use(a.clone(), 10, 1, at("2026-12-02T10:00:02Z"))],
    );
    charge(
        &store,
        t0,
        vec![first_use(b, 10, 1, at("2026-12-02T11:00:00Z"))],
    );
    assert_eq!(store.len(), 2);

    // A is over; S charges it again with a new calendar counter: two
    // counters to create where one place is free once A is reclaimed.
    let t1 = at("2026-12-02T10:00:30Z");
    let lines = vec![
        first_use(a.clone(), 10, 1, at("2026-12-02T10:01:30Z")),
        calendar(
            key("s", "write", "2026-12-02"),
            10,
            1,
            "2026-12-02T00:00:00Z",
            "2026-12-03T00:00:00Z",
        ),
    ];
    let full = try_charge(&store, t1, lines).unwrap_err();
    assert_eq!(full.kind(), StoreErrorKind::Full);
    assert!(store.len() <= 2, "{} counters", store.len());
    // A alone fits again.
    let again = try_charge(
        &store,
        t1,
        vec![first_use(a, 10, 1, at("2026-12-02T10:01:30Z"))],
    );
    assert!(again.unwrap().admitted);
    assert_eq!(store.len(), 2);

    // The count is right: once everything is reclaimed, exactly two fit.
    let later = at("2026-12-02T12:00:00Z");
    store.purge_expired(later);
    assert_eq!(store.len(), 0);
    let fitted = (0..4)
        .filter(|i| {
            let line = first_use(
                key(&format!("n{i}"), "read", "PT1H"),
                10,
                1,
                at("2026-12-02T13:00:00Z"),
            );
            try_charge(&store, later, vec![line]).is_ok()
        })
        .count();
    assert_eq!(fitted, 2);
    assert_eq!(store.len(), 2);
}

/// A full store whose expired counters lie behind many stale deadlines (of
/// counters reset since): one charge of a new subject reclaims no more than
/// its budget, however many counters have expired, and still finds room.
#[test]
fn a_full_store_reclaims_at_most_a_budget_per_charge() {
    use super::memory::{ROOM_BUDGET, SWEEP_BUDGET};
    const MAX: usize = 2_000;
    let store = MemoryStore::with_shards(1).max_counters(MAX);
    let t0 = at("2026-12-02T10:00:00Z");
    for i in 0..2 * SWEEP_BUDGET {
        let stale = key(&format!("stale-{i}"), "read", "PT1S");
        charge(
            &store,
            t0,
            vec![first_use(stale.clone(), 10, 1, at("2026-12-02T10:00:01Z"))],
        );
        assert!(now_of(store.reset(stale)).unwrap());
    }
    for i in 0..MAX {
        let line = first_use(
            key(&format!("s{i}"), "read", "PT2S"),
            10,
            1,
            at("2026-12-02T10:00:02Z"),
        );
        assert!(charge(&store, t0, vec![line]).admitted);
    }
    assert_eq!(store.len(), MAX);

    // Every counter has expired: the first new subject reclaims a budget's
    // worth (with the sweep that opens each try), not the whole store.
    let later = at("2026-12-02T10:00:10Z");
    let new = |id: &str| first_use(key(id, "read", "PT1H"), 10, 1, at("2026-12-02T11:00:00Z"));
    assert!(try_charge(&store, later, vec![new("n0")]).unwrap().admitted);
    let reclaimed = MAX + 1 - store.len();
    assert!(
        (1..=ROOM_BUDGET + 2 * SWEEP_BUDGET).contains(&reclaimed),
        "one charge reclaimed {reclaimed} counters"
    );
    // So does a charge of several lines, and the next subjects find room.
    let before = store.len();
    let lines = vec![
        new("n1"),
        calendar(
            key("n1", "write", "2026-12-02"),
            10,
            1,
            "2026-12-02T00:00:00Z",
            "2026-12-03T00:00:00Z",
        ),
    ];
    assert!(try_charge(&store, later, lines).unwrap().admitted);
    let reclaimed = before + 2 - store.len();
    assert!(
        reclaimed <= ROOM_BUDGET + 2 * SWEEP_BUDGET,
        "one charge of two lines reclaimed {reclaimed} counters"
    );
    for i in 2..50 {
        assert!(
            try_charge(&store, later, vec![new(&format!("n{i}"))])
                .unwrap()
                .admitted
        );
    }
    assert!(store.len() <= MAX);
}

#[test]
fn resets_and_reclaiming_give_room_back() {
    let store = MemoryStore::with_shards(2).max_counters(1);
    let t0 = at("2026-12-02T10:00:10Z");
    charge(&store, t0, vec![minute("a")]);
    assert!(try_charge(&store, t0, vec![minute("b")]).is_err());
    assert!(now_of(store.reset(minute("a").key)).unwrap());
    assert!(charge(&store, t0, vec![minute("b")]).admitted);
    store.purge_expired(at("2026-12-02T11:00:00Z"));
    let eleven = calendar(
        key("c", "read", "2026-12-02T11:00"),
        10,
        1,
        "2026-12-02T11:00:00Z",
        "2026-12-02T11:01:00Z",
    );
    assert!(charge(&store, at("2026-12-02T11:00:00Z"), vec![eleven]).admitted);
}

/// A give-back goes by the instant the store counted the charge: a leased
/// block's, when earlier than the request's, whatever counter the answer
/// tells of; otherwise the counter's first call when told, or the
/// request's.
#[test]
fn a_give_back_goes_by_the_instant_the_charge_was_counted() {
    let at = |s: &str| s.parse::<Timestamp>().unwrap();
    let usage = |first_call: Option<&str>, counted_at: Option<&str>| Usage {
        limit: 10,
        used: 1,
        resets_at: at("2026-12-05T00:00:00Z"),
        first_call: first_call.map(at),
        held_elsewhere_until: None,
        counted_at: counted_at.map(at),
    };
    let charged_at = at("2026-12-04T10:00:05Z");
    assert_eq!(usage(None, None).made_by(charged_at), charged_at);
    let later = "2026-12-04T10:00:06Z";
    assert_eq!(usage(Some(later), None).made_by(charged_at), at(later));
    // A counter made before the request: by its first call, so that a
    // counter made anew after a reset at the request's instant is kept out.
    let first = "2026-12-04T10:00:00Z";
    assert_eq!(usage(Some(first), None).made_by(charged_at), at(first));
    let block = "2026-12-04T10:00:01Z";
    assert_eq!(
        usage(Some(first), Some(block)).made_by(charged_at),
        at(first)
    );
    // A block taken from a counter made after the request's instant (an
    // instance whose clock is behind): the counter's first call, which
    // the block's take went by.
    let block_at_first = "2026-12-04T10:00:06Z";
    assert_eq!(
        usage(Some(block_at_first), Some(block_at_first)).made_by(charged_at),
        at(block_at_first)
    );
    // The answer tells of a counter made since the block was taken (reset
    // elsewhere): the block's instant all the same.
    assert_eq!(
        usage(Some(later), Some(block)).made_by(charged_at),
        at(block)
    );
    // A counted instant after the request's (clocks apart) moves nothing.
    assert_eq!(
        usage(None, Some("2026-12-04T10:00:09Z")).made_by(charged_at),
        charged_at
    );

    // The counter a give-back goes to: the one whose first call was told,
    // exactly; by an instant when none was told, or when the counter told
    // of was made after the block was taken (reset elsewhere since).
    assert_eq!(
        usage(Some(first), None).charged_counter(charged_at),
        Made::At(at(first))
    );
    assert_eq!(
        usage(Some(first), Some(block)).charged_counter(charged_at),
        Made::At(at(first))
    );
    assert_eq!(
        usage(Some(block_at_first), Some(block_at_first)).charged_counter(charged_at),
        Made::At(at(block_at_first))
    );
    assert_eq!(
        usage(Some(later), Some(block)).charged_counter(charged_at),
        Made::By(at(block))
    );
    assert_eq!(
        usage(None, None).charged_counter(charged_at),
        Made::By(charged_at)
    );
}

/// A full store replaces a subject's ended counters where they are for a
/// charge of several lines, as it does for a charge of one: room is made
/// only for counters the charge adds, so deadlines left filed by counters
/// started again in place (which use up a sweep's budget) cannot refuse it.
#[test]
fn a_full_store_charges_a_known_subjects_lines_on_its_ended_counters() {
    let t0 = at("2026-12-02T10:00:00Z");
    let secs = |s: i64| t0 + SignedDuration::from_secs(s);
    let fillers = 260;
    let store = MemoryStore::with_shards(1).max_counters(fillers + 2);
    // Fillers end at t0+1s and are started again in place at t0+2s: each
    // leaves its first deadline filed.
    for i in 0..fillers {
        let k = key(&format!("f{i}"), "read", "PT1S");
        assert!(charge(&store, t0, vec![first_use(k, 10, 1, secs(1))]).admitted);
    }
    let acme = |now| {
        vec![
            first_use(
                key("acme", "read", "PT5S"),
                10,
                1,
                now + SignedDuration::from_secs(5),
            ),
            first_use(
                key("acme", "write", "PT5S"),
                10,
                1,
                now + SignedDuration::from_secs(5),
            ),
        ]
    };
    assert!(charge(&store, t0, acme(t0)).admitted);
    for i in 0..fillers {
        let k = key(&format!("f{i}"), "read", "PT1S");
        assert!(charge(&store, secs(2), vec![first_use(k, 10, 1, secs(3_602))]).admitted);
    }
    assert_eq!(store.len(), fillers + 2);
    // acme's counters ended at t0+5s: at t0+7s its two lines are charged
    // on them, as each line alone would be.
    let now = secs(7);
    let both = try_charge(&store, now, acme(now));
    assert!(
        both.as_ref().is_ok_and(|o| o.admitted),
        "acme's two-line charge: {both:?}"
    );
    assert_eq!(store.len(), fillers + 2);
    // A new subject still finds no room.
    let beta = try_charge(
        &store,
        now,
        vec![first_use(
            key("beta", "read", "PT5S"),
            10,
            1,
            now + SignedDuration::from_secs(5),
        )],
    );
    assert!(beta.is_err(), "{beta:?}");
}

/// The memory store takes a charge's extra units as many as fit, in the
/// same step as the charge: a counter nearly full gives what is left, and
/// one whose cost does not fit takes nothing and charges nothing.
#[test]
fn extra_units_take_what_is_left_in_one_step() {
    let store = MemoryStore::new();
    let now = at("2026-12-04T10:00:00Z");
    let deadline = at("2026-12-04T11:00:00Z");
    let (a, b) = (key("acme", "read", "PT1H"), key("acme", "write", "PT1H"));
    let taking = |cost, extra: [u64; 2]| {
        let request = ChargeRequest {
            charged_at: None,
            now,
            lines: smallvec::smallvec![
                first_use(a.clone(), 10, cost, deadline),
                first_use(b.clone(), 100, cost, deadline),
            ],
        };
        now_of(store.charge_taking(request, extra.into_iter().collect())).unwrap()
    };
    let (outcome, taken) = taking(2, [5, 5]);
    assert!(outcome.admitted);
    assert_eq!(taken.as_slice(), [5, 5]);
    assert_eq!((outcome.usage[0].used, outcome.usage[1].used), (7, 7));
    // Room for the cost and one more on `a`; all five on `b`.
    let (outcome, taken) = taking(2, [5, 5]);
    assert!(outcome.admitted);
    assert_eq!(taken.as_slice(), [1, 5]);
    assert_eq!((outcome.usage[0].used, outcome.usage[1].used), (10, 14));
    let (outcome, taken) = taking(1, [5, 5]);
    assert!(!outcome.admitted);
    assert_eq!(taken.as_slice(), [0, 0]);
    assert_eq!((outcome.usage[0].used, outcome.usage[1].used), (10, 14));
}
