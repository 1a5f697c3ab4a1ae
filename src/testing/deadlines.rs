//! Checks of deadlines and lifetimes: what moves a deadline, what creates or
//! ends a counter.

use super::hooks::{ConformanceHooks, Expiry, Planted, StoredDeadline, Verdict};
use super::support::{
    add, answered, calendar_line, charge, expect_deadline, first_use, fresh_key, fresh_namespace,
    peek, refund, settle, settle_id, stored, Keys, Timeline,
};
use crate::key::PeriodKey;
use crate::store::{Debt, Lifetime};
use crate::subject::Subject;
use jiff::SignedDuration;

/// Hits never extend a first-use deadline, whatever the write path, and the
/// period ends at that deadline.
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn hits_never_extend_a_first_use_deadline<S: ConformanceHooks>(store: &S) -> Verdict {
    let mut time = Timeline::new(store.expiry());
    let period = time.period();
    let keys = Keys::new();
    let key = keys.key("first-use");
    let t0 = time.now();
    let deadline = t0 + period;

    let first = charge(
        store,
        time.now(),
        vec![first_use(&key, 100, 1, time.now() + period)],
    )
    .await;
    assert!(
        first.0,
        "a first charge on an empty counter must be admitted"
    );
    time.assert_near(
        first.1[0].resets_at,
        deadline,
        "the reset of a new first-use counter is its deadline",
    );
    time.assert_near_opt(
        first.1[0].first_call,
        t0,
        "a new first-use counter records its first call",
    );
    expect_deadline(store, &time, &key, deadline, "after the creating charge").await;

    time.pass(period / 3).await;
    let hit = charge(
        store,
        time.now(),
        vec![first_use(&key, 100, 1, time.now() + period)],
    )
    .await;
    assert!(hit.0, "a charge with room must be admitted");
    assert_eq!(hit.1[0].used, 2, "a later hit adds to the open period");
    time.assert_near(
        hit.1[0].resets_at,
        deadline,
        "a later hit must not move the first-use deadline",
    );
    time.assert_near_opt(hit.1[0].first_call, t0, "a later hit keeps the first call");
    expect_deadline(store, &time, &key, deadline, "after a later hit").await;

    let refused = charge(
        store,
        time.now(),
        vec![first_use(&key, 100, 1_000, time.now() + period)],
    )
    .await;
    assert!(!refused.0, "a charge over the limit must be refused");
    assert_eq!(refused.1[0].used, 2, "a refused charge spends nothing");
    time.assert_near(
        refused.1[0].resets_at,
        deadline,
        "a refused charge must not move the deadline",
    );
    expect_deadline(store, &time, &key, deadline, "after a refused charge").await;

    let free = charge(
        store,
        time.now(),
        vec![first_use(&key, 100, 0, time.now() + period)],
    )
    .await;
    assert!(
        free.0,
        "a zero-cost charge within the limit must be admitted"
    );
    time.assert_near(
        free.1[0].resets_at,
        deadline,
        "a zero-cost charge must not move the deadline",
    );

    let left = refund(store, time.now(), &key, 1).await;
    assert_eq!(left, Some(1), "a refund gives units back to a live counter");
    expect_deadline(store, &time, &key, deadline, "after a refund").await;
    let peeked = peek(
        store,
        time.now(),
        vec![first_use(&key, 100, 0, time.now() + period)],
    )
    .await;
    assert_eq!(peeked[0].used, 1, "peek sees the refund");
    time.assert_near(
        peeked[0].resets_at,
        deadline,
        "a refund must not move the deadline",
    );

    // A hit of a request with two quotas (a store's path for several lines
    // may be its own).
    let beside = keys.key("first-use-beside");
    let both = charge(
        store,
        time.now(),
        vec![
            first_use(&key, 100, 1, time.now() + period),
            first_use(&beside, 100, 1, time.now() + period),
        ],
    )
    .await;
    assert!(both.0, "a charge with room must be admitted");
    assert_eq!(both.1[0].used, 2, "a later hit adds to the open period");
    time.assert_near(
        both.1[0].resets_at,
        deadline,
        "a later hit of a request with two quotas must not move the first-use deadline",
    );
    time.assert_near_opt(
        both.1[0].first_call,
        t0,
        "a later hit of a request with two quotas keeps the first call",
    );
    expect_deadline(
        store,
        &time,
        &key,
        deadline,
        "after a later hit of a request with two quotas",
    )
    .await;

    time.pass_beyond(deadline).await;
    let after = peek(
        store,
        time.now(),
        vec![first_use(&key, 100, 0, time.now() + period)],
    )
    .await;
    assert_eq!(
        after[0].used, 0,
        "a first-use period must end at its deadline"
    );
    let reopened_at = time.now();
    let reopened = charge(
        store,
        reopened_at,
        vec![first_use(&key, 100, 1, reopened_at + period)],
    )
    .await;
    assert!(
        reopened.0,
        "the first charge of a new period must be admitted"
    );
    assert_eq!(reopened.1[0].used, 1, "a new period starts from zero");
    time.assert_near(
        reopened.1[0].resets_at,
        reopened_at + period,
        "a new period's deadline is one period from its first call",
    );
    Verdict::Passed
}

/// A refund after a counter's deadline does not bring the counter back.
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn refund_after_expiry_does_not_resurrect<S: ConformanceHooks>(store: &S) -> Verdict {
    let mut time = Timeline::new(store.expiry());
    let period = time.period();
    let key = fresh_key("refund");
    let t0 = time.now();
    let deadline = t0 + period;
    let charged = charge(store, t0, vec![first_use(&key, 10, 3, deadline)]).await;
    assert!(
        charged.0,
        "a first charge on an empty counter must be admitted"
    );

    time.pass_beyond(deadline).await;
    let left = refund(store, time.now(), &key, 1).await;
    assert_eq!(
        left, None,
        "a refund after the deadline must find no counter"
    );
    let peeked = peek(
        store,
        time.now(),
        vec![first_use(&key, 10, 0, time.now() + period)],
    )
    .await;
    assert_eq!(
        peeked[0].used, 0,
        "a refund must not bring an expired counter back"
    );
    assert_eq!(
        peeked[0].first_call, None,
        "a refund must not open a period"
    );
    match stored(store, &key).await {
        StoredDeadline::At(at) if at > time.now() => {
            panic!(
                "a refund after the deadline must not create a counter (found one, deadline {at})"
            )
        }
        StoredDeadline::Undated => {
            panic!("a refund after the deadline must not create a counter (found one, undated)")
        }
        _ => {}
    }
    let again = charge(
        store,
        time.now(),
        vec![first_use(&key, 10, 1, time.now() + period)],
    )
    .await;
    assert_eq!(again.1[0].used, 1, "the next charge opens a fresh period");

    let never = fresh_key("refund-never-charged");
    assert_eq!(
        refund(store, time.now(), &never, 5).await,
        None,
        "a refund on a key never charged must find no counter"
    );
    assert!(
        matches!(
            stored(store, &never).await,
            StoredDeadline::NoCounter | StoredDeadline::Unknown
        ),
        "a refund must never create a counter"
    );
    Verdict::Passed
}

/// An add after the fact ([`Store::add`](crate::store::Store::add)) changes only the count of a live
/// counter: it finds nothing on a key never charged and creates nothing
/// there, keeps a first-use counter's deadline and first call while it takes
/// the count past the limit, and after the deadline finds nothing and brings
/// nothing back, so the next charge opens a period of its own.
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn add_never_creates_nor_moves_a_deadline<S: ConformanceHooks>(store: &S) -> Verdict {
    let mut time = Timeline::new(store.expiry());
    let period = time.period();

    let never = fresh_key("add-never-charged");
    assert_eq!(
        add(store, time.now(), &never, 5).await,
        None,
        "an add on a key never charged must find no counter"
    );
    assert!(
        matches!(
            stored(store, &never).await,
            StoredDeadline::NoCounter | StoredDeadline::Unknown
        ),
        "an add must never create a counter"
    );
    let peeked = peek(
        store,
        time.now(),
        vec![first_use(&never, 10, 0, time.now() + period)],
    )
    .await;
    assert_eq!(peeked[0].used, 0, "an add must never create a counter");
    assert_eq!(peeked[0].first_call, None, "an add must not open a period");
    let opened_at = time.now();
    let opened = charge(
        store,
        opened_at,
        vec![first_use(&never, 10, 1, opened_at + period)],
    )
    .await;
    assert_eq!(
        opened.1[0].used, 1,
        "after an add found no counter, the first charge starts from zero"
    );
    time.assert_near(
        opened.1[0].resets_at,
        opened_at + period,
        "after an add found no counter, the first charge opens the period",
    );

    let key = fresh_key("add");
    let t0 = time.now();
    let deadline = t0 + period;
    let first = charge(store, t0, vec![first_use(&key, 10, 3, deadline)]).await;
    assert!(
        first.0,
        "a first charge on an empty counter must be admitted"
    );
    time.pass(period / 3).await;
    assert_eq!(
        add(store, time.now(), &key, 4).await,
        Some(7),
        "an add adds to a live counter"
    );
    expect_deadline(store, &time, &key, deadline, "after an add").await;
    assert_eq!(
        add(store, time.now(), &key, 20).await,
        Some(27),
        "an add is not checked against the limit"
    );
    assert_eq!(
        add(store, time.now(), &key, 0).await,
        Some(27),
        "an add of nothing reports the count"
    );
    expect_deadline(store, &time, &key, deadline, "after an add past the limit").await;
    let peeked = peek(
        store,
        time.now(),
        vec![first_use(&key, 10, 0, time.now() + period)],
    )
    .await;
    assert_eq!(peeked[0].used, 27, "peek sees what was added");
    time.assert_near(
        peeked[0].resets_at,
        deadline,
        "an add must not move the deadline",
    );
    time.assert_near_opt(peeked[0].first_call, t0, "an add keeps the first call");
    let refused = charge(
        store,
        time.now(),
        vec![first_use(&key, 10, 1, time.now() + period)],
    )
    .await;
    assert!(
        !refused.0,
        "a counter an add took past its limit refuses charges"
    );
    assert_eq!(refused.1[0].used, 27, "a refused charge spends nothing");
    time.assert_near(
        refused.1[0].resets_at,
        deadline,
        "an add must not move the deadline",
    );

    time.pass_beyond(deadline).await;
    assert_eq!(
        add(store, time.now(), &key, 1).await,
        None,
        "an add after the deadline must find no counter"
    );
    let peeked = peek(
        store,
        time.now(),
        vec![first_use(&key, 10, 0, time.now() + period)],
    )
    .await;
    assert_eq!(
        peeked[0].used, 0,
        "an add must not bring an expired counter back"
    );
    assert_eq!(peeked[0].first_call, None, "an add must not open a period");
    match stored(store, &key).await {
        StoredDeadline::At(at) if at > time.now() => {
            panic!("an add after the deadline must not create a counter (found one, deadline {at})")
        }
        StoredDeadline::Undated => {
            panic!("an add after the deadline must not create a counter (found one, undated)")
        }
        _ => {}
    }
    let reopened_at = time.now();
    let reopened = charge(
        store,
        reopened_at,
        vec![first_use(&key, 10, 1, reopened_at + period)],
    )
    .await;
    assert!(
        reopened.0,
        "the first charge of a new period must be admitted"
    );
    assert_eq!(
        reopened.1[0].used, 1,
        "the next charge opens a fresh period"
    );
    time.assert_near(
        reopened.1[0].resets_at,
        reopened_at + period,
        "a new period's deadline is one period from its first call",
    );
    Verdict::Passed
}

/// A debt settled after the fact ([`Store::settle_debt`](crate::store::Store::settle_debt))
/// goes past the limit of a live counter, keeping its deadline and first
/// call; creates a missing counter with the debt's own lifetime (never a
/// deadline counted from the settle) and, for first use, the debt's first
/// call (for a calendar window, the settle's instant: a counter made then
/// takes no give-back of a charge made before); opens the debt's period
/// where the counter before it expired; writes nothing for a debt whose
/// calendar window or first-use period is over, nor to a first-use counter
/// opened at or past the debt's deadline; and, for a debt of nothing,
/// writes nothing and answers what the counter holds (0 where there is
/// none).
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn settle_debt_keeps_to_the_debts_period<S: ConformanceHooks>(store: &S) -> Verdict {
    let mut time = Timeline::new(store.expiry());
    let period = time.period();

    // A live counter at its limit.
    let key = fresh_key("settle-live");
    let t0 = time.now();
    let deadline = t0 + period;
    let first = charge(store, t0, vec![first_use(&key, 2, 2, deadline)]).await;
    assert!(
        first.0,
        "a first charge on an empty counter must be admitted"
    );
    time.pass(period / 4).await;
    let now = time.now();
    let debt = Debt {
        key: key.clone(),
        amount: 3,
        lifetime: Lifetime::FirstUse {
            deadline: now + period,
        },
        since: now,
        id: settle_id(),
    };
    assert_eq!(
        settle(store, now, debt).await,
        Some(5),
        "a settle adds to a live counter, past its limit"
    );
    expect_deadline(store, &time, &key, deadline, "after a settle").await;
    let peeked = peek(store, now, vec![first_use(&key, 2, 0, now + period)]).await;
    assert_eq!(peeked[0].used, 5, "peek sees what was settled");
    time.assert_near(
        peeked[0].resets_at,
        deadline,
        "a settle must not move the deadline of a live counter",
    );
    time.assert_near_opt(peeked[0].first_call, t0, "a settle keeps the first call");

    // No counter: the debt's own period, not one counted from the settle.
    let fresh = fresh_key("settle-new");
    let since = time.now() - period / 4;
    let owed_deadline = since + period;
    let now = time.now();
    let debt = Debt {
        key: fresh.clone(),
        amount: 2,
        lifetime: Lifetime::FirstUse {
            deadline: owed_deadline,
        },
        since,
        id: settle_id(),
    };
    assert_eq!(
        settle(store, now, debt).await,
        Some(2),
        "a settle creates a missing counter"
    );
    let peeked = peek(store, now, vec![first_use(&fresh, 3, 0, now + period)]).await;
    assert_eq!(peeked[0].used, 2, "a created counter holds the debt");
    time.assert_near(
        peeked[0].resets_at,
        owed_deadline,
        "a counter a settle creates ends at the debt's deadline, not one period from the settle",
    );
    time.assert_near_opt(
        peeked[0].first_call,
        since,
        "a counter a settle creates records the debt's first call",
    );
    expect_deadline(
        store,
        &time,
        &fresh,
        owed_deadline,
        "after a settle created the counter",
    )
    .await;
    let hit = charge(store, now, vec![first_use(&fresh, 3, 1, now + period)]).await;
    assert!(hit.0, "a charge with room must be admitted");
    assert_eq!(hit.1[0].used, 3, "charges count on top of a settled debt");
    let over = charge(store, now, vec![first_use(&fresh, 3, 1, now + period)]).await;
    assert!(!over.0, "a settled debt counts against the limit");

    // A calendar window: created for the window, and charged on after.
    let calendar = fresh_key("settle-calendar");
    let now = time.now();
    let (start, end) = (now - period / 4, now + period);
    let debt = Debt {
        key: calendar.clone(),
        amount: 4,
        lifetime: Lifetime::Calendar { start, end },
        since: start,
        id: settle_id(),
    };
    assert_eq!(
        settle(store, now, debt).await,
        Some(4),
        "a settle creates a missing calendar counter"
    );
    assert!(
        !matches!(
            stored(store, &calendar).await,
            StoredDeadline::Undated | StoredDeadline::NoCounter
        ),
        "a calendar counter a settle creates has a deadline"
    );
    let charged = charge(
        store,
        now,
        vec![calendar_line(&calendar, 10, 1, start, end)],
    )
    .await;
    assert!(charged.0, "a charge with room must be admitted");
    assert_eq!(
        charged.1[0].used, 5,
        "the window's charges count on top of its debt"
    );
    // Made by the settle, and no earlier (for a store that dates its
    // counters): a give-back of a charge made before it (to a counter
    // support reset since) must not land on it.
    if let Some(first) = charged.1[0].first_call {
        time.assert_near(
            first,
            now,
            "a calendar counter a settle creates records the settle's instant as its first call",
        );
    }

    // A calendar counter its charges made: the debt adds to it, and the
    // counter stays the one they made.
    let charged = fresh_key("settle-calendar-charged");
    let now = time.now();
    let (start, end) = (now - period / 4, now + period);
    let made = charge(store, now, vec![calendar_line(&charged, 10, 2, start, end)]).await;
    assert!(
        made.0,
        "a first charge on an empty counter must be admitted"
    );
    let debt = Debt {
        key: charged.clone(),
        amount: 3,
        lifetime: Lifetime::Calendar { start, end },
        since: start,
        id: settle_id(),
    };
    assert_eq!(
        settle(store, now, debt).await,
        Some(5),
        "a settle adds to a live calendar counter, never makes it anew"
    );
    let peeked = peek(store, now, vec![calendar_line(&charged, 10, 0, start, end)]).await;
    assert_eq!(
        peeked[0].used, 5,
        "a settle adds to a live calendar counter, never makes it anew"
    );
    assert_eq!(
        peeked[0].first_call, made.1[0].first_call,
        "a settle keeps a live calendar counter's first call"
    );

    // Periods that are over: nothing written, no period opened.
    let now = time.now();
    let ended = fresh_key("settle-calendar-over");
    let (start, end) = (now - period * 2, now - period);
    let debt = Debt {
        key: ended.clone(),
        amount: 1,
        lifetime: Lifetime::Calendar { start, end },
        since: start,
        id: settle_id(),
    };
    assert_eq!(
        settle(store, now, debt).await,
        None,
        "a debt of a calendar window that is over must not be settled"
    );
    assert!(
        matches!(
            stored(store, &ended).await,
            StoredDeadline::NoCounter | StoredDeadline::Unknown
        ),
        "a debt of a window that is over must not create a counter"
    );
    let passed = fresh_key("settle-first-use-over");
    let debt = Debt {
        key: passed.clone(),
        amount: 1,
        lifetime: Lifetime::FirstUse {
            deadline: now - period / 4,
        },
        since: now - period - period / 4,
        id: settle_id(),
    };
    assert_eq!(
        settle(store, now, debt).await,
        None,
        "a debt of a first-use period past its deadline must not be settled"
    );
    let peeked = peek(store, now, vec![first_use(&passed, 10, 0, now + period)]).await;
    assert_eq!(
        peeked[0].used, 0,
        "a debt of a period that is over adds nothing"
    );
    assert_eq!(
        peeked[0].first_call, None,
        "a debt of a period that is over must not open a period"
    );

    // A first-use period opened at the debt's deadline (a charge with a
    // later instant than the settle's: another instance's clock ahead)
    // takes none of it.
    let later = fresh_key("settle-after-deadline");
    let owed_deadline = now + period / 8;
    let opened = charge(
        store,
        owed_deadline,
        vec![first_use(&later, 10, 1, owed_deadline + period)],
    )
    .await;
    assert!(
        opened.0,
        "a first charge on an empty counter must be admitted"
    );
    let debt = Debt {
        key: later.clone(),
        amount: 1,
        lifetime: Lifetime::FirstUse {
            deadline: owed_deadline,
        },
        since: owed_deadline - period,
        id: settle_id(),
    };
    assert_eq!(
        settle(store, now, debt).await,
        None,
        "a debt must not go to a period opened at or past its deadline"
    );
    let peeked = peek(
        store,
        owed_deadline,
        vec![first_use(&later, 10, 0, owed_deadline + period)],
    )
    .await;
    assert_eq!(
        peeked[0].used, 1,
        "a period opened past the debt's deadline holds its own charges only"
    );

    // The live counter's period ends: a debt of the next one opens its own.
    time.pass_beyond(deadline).await;
    let now = time.now();
    let debt = Debt {
        key: key.clone(),
        amount: 1,
        lifetime: Lifetime::FirstUse {
            deadline: now + period,
        },
        since: now,
        id: settle_id(),
    };
    assert_eq!(
        settle(store, now, debt).await,
        Some(1),
        "a settle after the deadline opens the debt's period, from zero"
    );
    let peeked = peek(store, now, vec![first_use(&key, 2, 0, now + period)]).await;
    time.assert_near(
        peeked[0].resets_at,
        now + period,
        "a period a settle opens ends at the debt's deadline",
    );

    // A debt of nothing: the count, and nothing written.
    let nothing = |key: &PeriodKey| Debt {
        key: key.clone(),
        amount: 0,
        lifetime: Lifetime::FirstUse {
            deadline: now + period,
        },
        since: now,
        id: settle_id(),
    };
    assert_eq!(
        settle(store, now, nothing(&key)).await,
        Some(1),
        "a settle of nothing answers what a live counter holds"
    );
    let empty = fresh_key("settle-nothing");
    assert_eq!(
        settle(store, now, nothing(&empty)).await,
        Some(0),
        "a settle of nothing where there is no counter answers 0"
    );
    let peeked = peek(store, now, vec![first_use(&empty, 2, 0, now + period)]).await;
    assert_eq!(
        peeked[0].first_call, None,
        "a settle of nothing must not open a period"
    );
    Verdict::Passed
}

/// A counter found without a deadline gets one from the next charge,
/// admitted or refused: its first call plus one period when the first call
/// is known, else one period from now; and a counter whose period is long
/// over starts afresh. One at its limit is refused, and dated all the same:
/// it never locks its subject out for ever.
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn undated_counter_is_healed<S: ConformanceHooks>(store: &S) -> Verdict {
    let time = Timeline::new(store.expiry());
    let period = time.period() * 10;
    let now = time.now();

    let known = fresh_key("undated-known");
    let first_call = now - period / 2;
    if answered(
        store
            .plant_undated(known.clone(), 3, Some(first_call))
            .await,
        "plant an undated counter",
    ) == Planted::NotApplicable
    {
        return Verdict::NotApplicable("the store cannot hold a counter without a deadline");
    }
    assert_eq!(
        stored(store, &known).await,
        StoredDeadline::Undated,
        "plant_undated must leave the counter without a deadline"
    );
    let healed = charge(store, now, vec![first_use(&known, 10, 1, now + period)]).await;
    assert!(
        healed.0,
        "a charge with room on an undated counter must be admitted"
    );
    assert_eq!(healed.1[0].used, 4, "healing keeps the count");
    time.assert_near(
        healed.1[0].resets_at,
        first_call + period,
        "an undated counter is dated to its first call plus one period",
    );
    expect_deadline(store, &time, &known, first_call + period, "after healing").await;

    let unknown = fresh_key("undated-unknown");
    answered(
        store.plant_undated(unknown.clone(), 5, None).await,
        "plant an undated counter",
    );
    let healed = charge(store, now, vec![first_use(&unknown, 10, 1, now + period)]).await;
    assert_eq!(healed.1[0].used, 6, "healing keeps the count");
    time.assert_near(
        healed.1[0].resets_at,
        now + period,
        "an undated counter without a first call is dated to one period from now",
    );
    expect_deadline(store, &time, &unknown, now + period, "after healing").await;

    let over = fresh_key("undated-over");
    answered(
        store
            .plant_undated(over.clone(), 10, Some(now - period * 2))
            .await,
        "plant an undated counter",
    );
    let fresh = charge(store, now, vec![first_use(&over, 10, 1, now + period)]).await;
    assert!(
        fresh.0,
        "an undated counter whose period is over must not lock its subject out"
    );
    assert_eq!(fresh.1[0].used, 1, "a period that is over starts afresh");
    time.assert_near(
        fresh.1[0].resets_at,
        now + period,
        "the new period ends one period from now",
    );

    let stuck = fresh_key("undated-at-limit");
    answered(
        store.plant_undated(stuck.clone(), 10, None).await,
        "plant an undated counter",
    );
    let refused = charge(store, now, vec![first_use(&stuck, 10, 1, now + period)]).await;
    assert!(!refused.0, "a charge over the limit must be refused");
    assert_eq!(refused.1[0].used, 10, "a refused charge counts nothing");
    expect_deadline(
        store,
        &time,
        &stuck,
        now + period,
        "an undated counter at its limit, after a refused charge (else it refuses for ever)",
    )
    .await;

    let calendar = fresh_key("undated-calendar");
    answered(
        store.plant_undated(calendar.clone(), 2, None).await,
        "plant an undated counter",
    );
    let end = now + period;
    let charged = charge(store, now, vec![calendar_line(&calendar, 10, 1, now, end)]).await;
    assert_eq!(charged.1[0].used, 3, "healing keeps the count");
    match stored(store, &calendar).await {
        StoredDeadline::At(at) => assert!(
            at + time.tolerance() >= end,
            "an undated calendar counter gets a deadline no earlier than its window's end"
        ),
        StoredDeadline::Unknown => {}
        other => panic!("an undated calendar counter must get a deadline (found {other:?})"),
    }
    Verdict::Passed
}

/// Calendar counters are distinct per window, report the window's end as
/// their reset, and carry a deadline no earlier than that end.
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn calendar_counters_are_distinct_per_period_and_dated<S: ConformanceHooks>(
    store: &S,
) -> Verdict {
    let mut time = Timeline::new(store.expiry());
    let length = time.period();
    let namespace = fresh_namespace();
    let subject = Subject::account("calendar");
    let start = time.now();
    let end = start + length;
    let this = namespace.key(&subject, "read", "w1");
    let next = namespace.key(&subject, "read", "w2");
    assert_ne!(this, next, "two windows must have two keys");

    let made = time.now();
    for i in 0..2 {
        let at = if i == 0 { made } else { time.now() };
        let outcome = charge(store, at, vec![calendar_line(&this, 10, 1, start, end)]).await;
        assert!(outcome.0, "a charge with room must be admitted");
        assert_eq!(
            outcome.1[0].resets_at, end,
            "a calendar counter resets at its window's end"
        );
        assert!(
            outcome.1[0]
                .first_call
                .is_none_or(|first| first.as_millisecond() == made.as_millisecond()),
            "a calendar counter's first call, if told, is the charge that made it"
        );
    }
    let later = charge(
        store,
        time.now(),
        vec![calendar_line(&next, 10, 1, end, end + length)],
    )
    .await;
    assert_eq!(later.1[0].used, 1, "the next window counts from zero");
    assert_eq!(later.1[0].resets_at, end + length);
    let both = peek(
        store,
        time.now(),
        vec![
            calendar_line(&this, 10, 0, start, end),
            calendar_line(&next, 10, 0, end, end + length),
        ],
    )
    .await;
    assert_eq!(
        (both[0].used, both[1].used),
        (2, 1),
        "each calendar window keeps its own count"
    );

    match stored(store, &this).await {
        StoredDeadline::At(at) => assert!(
            at + time.tolerance() >= end,
            "a calendar counter must live at least until its window's end (deadline {at}, end {end})"
        ),
        StoredDeadline::Unknown => {
            if time.expiry == Expiry::FollowsRequests {
                time.pass_beyond(end).await;
                let after = peek(store, time.now(), vec![calendar_line(&this, 10, 0, start, end)]).await;
                assert_eq!(after[0].used, 0, "a calendar counter must end after its window");
            }
        }
        other => panic!("a calendar counter must carry a deadline (found {other:?})"),
    }
    Verdict::Passed
}

/// A change guarded by the counter's making lands when it goes by the
/// first call the store reported for that counter: the layer gives a
/// request back at that instant
/// ([`Store::refund_made_at`](crate::store::Store::refund_made_at)), adds
/// its deferred cost by it
/// ([`Store::add_made_by`](crate::store::Store::add_made_by)), and support
/// refunds by it ([`Store::refund_made_by`](crate::store::Store::refund_made_by)). A store that
/// reports a first call rounded down from what it compares would refuse
/// them, and leave requests charged that were not served.
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn changes_by_the_reported_first_call_land<S: ConformanceHooks>(store: &S) -> Verdict {
    let mut time = Timeline::new(store.expiry());
    let period = time.period();
    let key = fresh_key("made-by");
    // A first call with a fraction of a millisecond, as a layer's clock
    // gives.
    time.pass(SignedDuration::from_micros(1_234)).await;
    let made = time.now();
    let deadline = made + period;
    let first = charge(store, made, vec![first_use(&key, 10, 1, deadline)]).await;
    assert!(
        first.0,
        "a first charge on an empty counter must be admitted"
    );
    let Some(first_call) = first.1[0].first_call else {
        return Verdict::NotApplicable("the store does not date its counters");
    };
    // Later by a few milliseconds (a store that counts in them tells the
    // two instants apart), well within the period of a store in real time.
    time.pass(SignedDuration::from_millis(20)).await;
    let later = time.now();
    let second = charge(store, later, vec![first_use(&key, 10, 1, deadline)]).await;
    assert!(second.0, "a second charge with room must be admitted");
    assert_eq!(
        second.1[0].first_call,
        Some(first_call),
        "a counter's first call must be reported alike by every charge"
    );
    let refunded = answered(
        store
            .refund_made_by(later, key.clone(), 1, first_call)
            .await,
        "refund",
    );
    assert_eq!(
        refunded,
        Some(1),
        "a refund made by the reported first call must land on that counter"
    );
    let added = answered(
        store.add_made_by(later, key.clone(), 2, first_call).await,
        "add",
    );
    assert_eq!(
        added,
        Some(3),
        "an add made by the reported first call must land on that counter"
    );
    let refunded = answered(
        store
            .refund_made_at(later, key.clone(), 1, first_call)
            .await,
        "refund",
    );
    assert_eq!(
        refunded,
        Some(2),
        "a refund made at the reported first call must land on that counter"
    );
    // A calendar counter, given back by the first call its charge reported.
    let daily = fresh_key("made-by-calendar");
    let (start, end) = (made - period, made + period);
    let charged = charge(store, made, vec![calendar_line(&daily, 10, 2, start, end)]).await;
    assert!(
        charged.0,
        "a first charge on an empty counter must be admitted"
    );
    if let Some(first_call) = charged.1[0].first_call {
        let refunded = answered(
            store
                .refund_made_at(later, daily.clone(), 1, first_call)
                .await,
            "refund",
        );
        assert_eq!(
            refunded,
            Some(1),
            "a refund made at a calendar counter's reported first call must land on it"
        );
        // All it holds given back: a calendar counter's period is its
        // window, and the counter stays, its first call as it was.
        let refunded = answered(
            store
                .refund_made_at(later, daily.clone(), 1, first_call)
                .await,
            "refund",
        );
        assert_eq!(
            refunded,
            Some(0),
            "a refund made at a calendar counter's reported first call must land on it"
        );
        let peeked = peek(store, later, vec![calendar_line(&daily, 10, 0, start, end)]).await;
        assert_eq!(
            (peeked[0].used, peeked[0].first_call),
            (0, Some(first_call)),
            "a give-back of all a calendar counter holds must leave it, its first call as it was: \
             only a first-use counter's period closes so"
        );
    }
    Verdict::Passed
}

/// A change guarded by the counter's making does not land on a counter made
/// after that instant: a request charged before a support reset, given back
/// (or its deferred cost added) after the reset and a new charge that made
/// the counter again, must leave the new counter as it is
/// ([`Store::refund_made_by`](crate::store::Store::refund_made_by),
/// [`Store::add_made_by`](crate::store::Store::add_made_by)). A store that
/// reports a first call and refunds whatever counter lives at the key would
/// uncount a request that was served.
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn changes_made_before_a_counter_do_not_land<S: ConformanceHooks>(store: &S) -> Verdict {
    let mut time = Timeline::new(store.expiry());
    let period = time.period();
    let key = fresh_key("made-before");
    let made = time.now();
    let first = charge(store, made, vec![first_use(&key, 10, 1, made + period)]).await;
    assert!(
        first.0,
        "a first charge on an empty counter must be admitted"
    );
    let Some(first_call) = first.1[0].first_call else {
        return Verdict::NotApplicable("the store does not date its counters");
    };
    answered(store.reset(key.clone()).await, "reset");
    // Later by a few milliseconds (a store that counts in them tells the
    // two counters apart).
    time.pass(SignedDuration::from_millis(20)).await;
    let later = time.now();
    let again = charge(store, later, vec![first_use(&key, 10, 1, later + period)]).await;
    assert!(again.0, "a charge after a reset must be admitted");
    assert!(
        again.1[0].first_call.is_some_and(|at| at > first_call),
        "a counter made again after a reset must report its own first call, after the old one's"
    );
    let refunded = answered(
        store
            .refund_made_by(later, key.clone(), 1, first_call)
            .await,
        "refund",
    );
    assert_eq!(
        refunded, None,
        "a refund made by an instant before the counter was made must not land on it"
    );
    let added = answered(
        store.add_made_by(later, key.clone(), 1, first_call).await,
        "add",
    );
    assert_eq!(
        added, None,
        "an add made by an instant before the counter was made must not land on it"
    );
    let now = peek(store, later, vec![first_use(&key, 10, 0, later + period)]).await;
    assert_eq!(
        now[0].used, 1,
        "the counter made after the reset must hold its own charge only"
    );
    Verdict::Passed
}

/// A refund or an add made at a counter's first call
/// ([`Store::refund_made_at`](crate::store::Store::refund_made_at),
/// [`Store::add_made_at`](crate::store::Store::add_made_at)) lands on that
/// counter, and on no other: not on one made after a support reset by a
/// charge stamped earlier (an instance whose clock is behind, a request
/// that waited), whose first call is before the old one's. A
/// [`LeasedStore`](crate::store::LeasedStore) gives the unused units of its
/// blocks back so, and the layer adds a deferred cost so; a store that
/// changes any counter made by that instant would take units off the new
/// counter, whose requests were served, or charge it for a request it
/// never admitted.
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn changes_made_at_a_first_call_land_on_that_counter_only<S: ConformanceHooks>(
    store: &S,
) -> Verdict {
    let mut time = Timeline::new(store.expiry());
    let period = time.period();
    let key = fresh_key("made-at");
    time.pass(SignedDuration::from_millis(40)).await;
    let made = time.now();
    let first = charge(store, made, vec![first_use(&key, 10, 3, made + period)]).await;
    assert!(
        first.0,
        "a first charge on an empty counter must be admitted"
    );
    let Some(first_call) = first.1[0].first_call else {
        return Verdict::NotApplicable("the store does not date its counters");
    };
    let refunded = answered(
        store.refund_made_at(made, key.clone(), 1, first_call).await,
        "refund",
    );
    assert_eq!(
        refunded,
        Some(2),
        "a refund made at the reported first call must land on that counter"
    );
    let added = answered(
        store.add_made_at(made, key.clone(), 1, first_call).await,
        "add",
    );
    assert_eq!(
        added,
        Some(3),
        "an add made at the reported first call must land on that counter"
    );
    answered(store.reset(key.clone()).await, "reset");
    // Made again by a charge stamped before the old counter's first call.
    let earlier = made - SignedDuration::from_millis(20);
    let again = charge(
        store,
        earlier,
        vec![first_use(&key, 10, 1, earlier + period)],
    )
    .await;
    assert!(again.0, "a charge after a reset must be admitted");
    assert!(
        again.1[0].first_call.is_some_and(|at| at < first_call),
        "a counter made again by an earlier charge must report its own first call"
    );
    let refunded = answered(
        store.refund_made_at(made, key.clone(), 1, first_call).await,
        "refund",
    );
    assert_eq!(
        refunded, None,
        "a refund made at another counter's first call must not land on this one"
    );
    let added = answered(
        store.add_made_at(made, key.clone(), 1, first_call).await,
        "add",
    );
    assert_eq!(
        added, None,
        "an add made at another counter's first call must not land on this one"
    );
    let now = peek(store, made, vec![first_use(&key, 10, 0, made + period)]).await;
    assert_eq!(
        now[0].used, 1,
        "the counter made again must hold its own charge only"
    );
    Verdict::Passed
}

/// A give-back at a first-use counter's first call
/// ([`Store::refund_made_at`](crate::store::Store::refund_made_at)) of all
/// it holds closes the period it opened: the next charge opens a period of
/// its own, so a rolling period runs from the first request that spends,
/// not from one refused further in or given back as a server error. A
/// refund of another kind that empties the counter (a support refund), and
/// a give-back of more than it holds, leave it live, its deadline as it
/// was; an add (a deferred cost) is no such refund: a give-back of all a
/// counter holds after one still closes its period.
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn give_backs_that_empty_a_first_use_counter_close_its_period<S: ConformanceHooks>(
    store: &S,
) -> Verdict {
    let mut time = Timeline::new(store.expiry());
    let period = time.period();
    let key = fresh_key("emptied");
    time.pass(SignedDuration::from_millis(40)).await;
    let opened = time.now();
    let first = charge(store, opened, vec![first_use(&key, 10, 2, opened + period)]).await;
    assert!(
        first.0,
        "a first charge on an empty counter must be admitted"
    );
    let Some(first_call) = first.1[0].first_call else {
        return Verdict::NotApplicable("the store does not date its counters");
    };
    let give_back = |amount| store.refund_made_at(opened, key.clone(), amount, first_call);
    let refunded = answered(give_back(1).await, "refund");
    assert_eq!(
        refunded,
        Some(1),
        "a give-back that leaves units spent keeps the counter"
    );
    let refunded = answered(give_back(1).await, "refund");
    assert_eq!(
        refunded,
        Some(0),
        "a give-back that empties the counter answers what it holds"
    );
    let now = peek(store, opened, vec![first_use(&key, 10, 0, opened + period)]).await;
    assert_eq!(
        (now[0].used, now[0].first_call),
        (0, None),
        "a first-use counter emptied by a give-back at its first call leaves no period open"
    );
    time.pass(SignedDuration::from_millis(40)).await;
    let served = time.now();
    let again = charge(store, served, vec![first_use(&key, 10, 1, served + period)]).await;
    assert!(again.0, "a charge after the give-back must be admitted");
    time.assert_near_opt(
        again.1[0].first_call,
        served,
        "the next charge opens the period",
    );
    time.assert_near(
        again.1[0].resets_at,
        served + period,
        "a period that ends one period after the charge that opened it",
    );
    let first_call = again.1[0].first_call.unwrap_or(served);
    let open = Open {
        time: &time,
        key: &key,
        first_call,
        ends: served + period,
        at: served,
    };
    let give_back = |amount| store.refund_made_at(served, key.clone(), amount, first_call);
    let charge_one = || charge(store, served, vec![first_use(&key, 10, 1, served + period)]);
    // Given back more than it holds (a request given back twice over): a
    // refund capped at zero.
    open.after(
        store,
        give_back(2).await,
        "a give-back of more than the counter holds",
    )
    .await;
    open.after(store, give_back(0).await, "a give-back of nothing")
        .await;
    // A support refund of all that was spent, then a request charged and
    // given back: the count tells no longer whose units remain.
    assert!(charge_one().await.0, "a charge with room is admitted");
    let refund = store
        .refund_made_by(served, key.clone(), 1, first_call)
        .await;
    open.after(store, refund, "a support refund that empties the counter")
        .await;
    assert!(charge_one().await.0, "a charge with room is admitted");
    open.after(
        store,
        give_back(1).await,
        "a give-back of all the counter holds, after a support refund lowered it",
    )
    .await;

    // A deferred cost added to a request's charge, then all of it given
    // back: an add lowers nothing and marks nothing, and the period closes.
    let added = fresh_key("emptied-after-an-add");
    let charged = charge(
        store,
        served,
        vec![first_use(&added, 10, 1, served + period)],
    )
    .await;
    assert!(
        charged.0,
        "a first charge on an empty counter must be admitted"
    );
    let first_call = charged.1[0].first_call.unwrap_or(served);
    let sum = answered(
        store
            .add_made_by(served, added.clone(), 2, first_call)
            .await,
        "add",
    );
    assert_eq!(
        sum,
        Some(3),
        "an add made by the reported first call must land on that counter"
    );
    let refunded = answered(
        store
            .refund_made_at(served, added.clone(), 3, first_call)
            .await,
        "refund",
    );
    assert_eq!(
        refunded,
        Some(0),
        "a give-back that empties the counter answers what it holds"
    );
    let now = peek(
        store,
        served,
        vec![first_use(&added, 10, 0, served + period)],
    )
    .await;
    assert_eq!(
        (now[0].used, now[0].first_call),
        (0, None),
        "a first-use counter emptied by a give-back at its first call leaves no period open, \
         after an add too: an add is no refund of another kind"
    );
    Verdict::Passed
}

/// A first-use period that must stay open, as a check finds it.
struct Open<'a> {
    time: &'a Timeline,
    key: &'a PeriodKey,
    first_call: jiff::Timestamp,
    ends: jiff::Timestamp,
    at: jiff::Timestamp,
}

impl Open<'_> {
    /// Checks that `refund` (what `why` names) took the counter to zero
    /// and left its period as it was.
    async fn after<S: ConformanceHooks>(
        &self,
        store: &S,
        refund: Result<Option<u64>, crate::store::StoreError>,
        why: &str,
    ) {
        let refund = answered(refund, "refund");
        assert_eq!(refund, Some(0), "{why}: lands on the counter");
        let line = first_use(self.key, 10, 0, self.ends);
        let now = peek(store, self.at, vec![line]).await;
        assert_eq!(
            now[0].first_call,
            Some(self.first_call),
            "{why} leaves its period open"
        );
        self.time
            .assert_near(now[0].resets_at, self.ends, "its deadline as it was");
    }
}

/// A counter that ended, at its deadline or by a reset, takes no change
/// guarded by its first call, and neither does the counter opened at its
/// key since: a request of the ended period given back
/// ([`Store::refund_made_at`](crate::store::Store::refund_made_at)), its
/// deferred cost added
/// ([`Store::add_made_by`](crate::store::Store::add_made_by)), or support's
/// refund of it ([`Store::refund_made_by`](crate::store::Store::refund_made_by))
/// finds no counter: nothing lands, nothing is created, no period opens. A
/// counter opened after its key's period ended reports its own first call
/// (a counter replaced where it was, its first call left as it was, would
/// take the ended period's give-backs: a give-back of all it holds would
/// even close its period).
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn changes_to_an_ended_counter_do_not_land<S: ConformanceHooks>(store: &S) -> Verdict {
    let mut time = Timeline::new(store.expiry());
    let period = time.period();

    // Ended at its deadline.
    let key = fresh_key("ended-at-its-deadline");
    let t0 = time.now();
    let deadline = t0 + period;
    let first = charge(store, t0, vec![first_use(&key, 10, 1, deadline)]).await;
    assert!(
        first.0,
        "a first charge on an empty counter must be admitted"
    );
    let Some(ended) = first.1[0].first_call else {
        return Verdict::NotApplicable("the store does not date its counters");
    };
    time.pass_beyond(deadline).await;
    let now = time.now();
    let changes = [
        (
            answered(
                store.refund_made_by(now, key.clone(), 1, ended).await,
                "refund",
            ),
            "a refund made by",
        ),
        (
            answered(
                store.refund_made_at(now, key.clone(), 1, ended).await,
                "refund",
            ),
            "a give-back at",
        ),
        (
            answered(store.add_made_by(now, key.clone(), 1, ended).await, "add"),
            "an add made by",
        ),
    ];
    for (answer, what) in changes {
        assert_eq!(
            answer, None,
            "{what} the first call of a counter past its deadline must find no counter"
        );
    }
    match stored(store, &key).await {
        StoredDeadline::At(at) if at > time.now() => panic!(
            "a change by the first call of a counter past its deadline must not create a counter (found one, deadline {at})"
        ),
        StoredDeadline::Undated => panic!(
            "a change by the first call of a counter past its deadline must not create a counter (found one, undated)"
        ),
        _ => {}
    }
    let peeked = peek(store, now, vec![first_use(&key, 10, 0, now + period)]).await;
    assert_eq!(
        (peeked[0].used, peeked[0].first_call),
        (0, None),
        "a change by the first call of a counter past its deadline must not open a period"
    );

    // The key's next period, opened since: none of the ended one's changes
    // land on it.
    time.pass(SignedDuration::from_millis(20)).await;
    let reopened_at = time.now();
    let reopened = charge(
        store,
        reopened_at,
        vec![first_use(&key, 10, 2, reopened_at + period)],
    )
    .await;
    assert!(
        reopened.0,
        "the first charge of a new period must be admitted"
    );
    let own = reopened.1[0].first_call;
    assert!(
        own.is_some_and(|own| own > ended),
        "a counter opened after its key's period ended must report its own first call, after the ended one's (ended {ended}, got {own:?})"
    );
    // All the new counter holds: a give-back that lands would close its
    // period.
    assert_eq!(
        answered(
            store
                .refund_made_at(reopened_at, key.clone(), 2, ended)
                .await,
            "refund"
        ),
        None,
        "a give-back at an ended counter's first call must not land on the counter opened since"
    );
    assert_eq!(
        answered(
            store
                .refund_made_by(reopened_at, key.clone(), 1, ended)
                .await,
            "refund"
        ),
        None,
        "a refund made by an ended counter's first call must not land on the counter opened since"
    );
    assert_eq!(
        answered(
            store.add_made_by(reopened_at, key.clone(), 1, ended).await,
            "add"
        ),
        None,
        "an add made by an ended counter's first call must not land on the counter opened since"
    );
    let now = peek(
        store,
        reopened_at,
        vec![first_use(&key, 10, 0, reopened_at + period)],
    )
    .await;
    assert_eq!(
        (now[0].used, now[0].first_call),
        (2, own),
        "the counter opened after the period ended must hold its own charge only, its period open"
    );

    // Ended by a reset, made again by a later charge.
    let reset = fresh_key("ended-by-a-reset");
    let made = time.now();
    let first = charge(store, made, vec![first_use(&reset, 10, 1, made + period)]).await;
    assert!(
        first.0,
        "a first charge on an empty counter must be admitted"
    );
    let old = first.1[0].first_call.unwrap_or(made);
    answered(store.reset(reset.clone()).await, "reset");
    time.pass(SignedDuration::from_millis(20)).await;
    let later = time.now();
    let again = charge(store, later, vec![first_use(&reset, 10, 2, later + period)]).await;
    assert!(again.0, "a charge after a reset must be admitted");
    let own = again.1[0].first_call;
    assert_eq!(
        answered(
            store.refund_made_at(later, reset.clone(), 2, old).await,
            "refund"
        ),
        None,
        "a give-back at a reset counter's first call must not land on the counter made since, with a later first call"
    );
    let now = peek(store, later, vec![first_use(&reset, 10, 0, later + period)]).await;
    assert_eq!(
        (now[0].used, now[0].first_call),
        (2, own),
        "the counter made after a reset must hold its own charge only, its period open"
    );
    Verdict::Passed
}

/// A first-use counter ends at its deadline, not an instant later: the
/// deadline *is* the reset told to the client. At that very instant a peek
/// finds no period open; a refund, an add, a give-back at its first call,
/// a refund or an add made by it, and a settle of a debt whose period
/// ends then (first use, or a calendar window) find no counter, change
/// nothing and create nothing; a settle of a debt of the next period
/// opens that period, adding nothing to the counter that ended; and a
/// charge opens a new period.
///
/// Only for a store whose deadlines follow the calls
/// ([`Expiry::FollowsRequests`]): the suite cannot call a store on its own
/// clock at a deadline's very instant.
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn a_first_use_counter_ends_at_its_deadline<S: ConformanceHooks>(store: &S) -> Verdict {
    let mut time = Timeline::new(store.expiry());
    if time.expiry != Expiry::FollowsRequests {
        return Verdict::NotApplicable(
            "deadlines pass on the store's clock: the suite cannot call at a deadline's very instant",
        );
    }
    let period = time.period();
    let key = fresh_key("at-its-deadline");
    let t0 = time.now();
    let deadline = t0 + period;
    // A key charged often: a store that keeps part of a subject's
    // allowance at hand (a leased block) holds some of it at the deadline.
    let busy = fresh_key("busy-at-its-deadline");
    let roomy = 1_000_000;
    for _ in 0..2_000 {
        charge(store, t0, vec![first_use(&busy, roomy, 1, deadline)]).await;
    }
    let first = charge(store, t0, vec![first_use(&key, 2, 2, deadline)]).await;
    assert!(
        first.0,
        "a first charge on an empty counter must be admitted"
    );
    let made = first.1[0].first_call.unwrap_or(t0);
    // A second counter of the same period, for a debt of the next one.
    let next = fresh_key("settled-at-its-deadline");
    let second = charge(store, t0, vec![first_use(&next, 2, 2, deadline)]).await;
    assert!(
        second.0,
        "a first charge on an empty counter must be admitted"
    );
    time.pass(deadline.duration_since(t0)).await;
    let at = time.now();
    assert_eq!(at, deadline);

    let peeked = peek(store, at, vec![first_use(&key, 2, 0, at + period)]).await;
    assert_eq!(
        (peeked[0].used, peeked[0].first_call),
        (0, None),
        "a first-use counter ends at its deadline: a peek at that instant must find no period open"
    );
    let debt = Debt {
        key: key.clone(),
        amount: 1,
        lifetime: Lifetime::FirstUse { deadline },
        since: t0,
        id: settle_id(),
    };
    let changes = [
        (refund(store, at, &key, 1).await, "a refund"),
        (
            answered(
                store.refund_made_by(at, key.clone(), 1, made).await,
                "refund",
            ),
            "a refund made by its first call",
        ),
        (
            answered(
                store.refund_made_at(at, key.clone(), 2, made).await,
                "refund",
            ),
            "a give-back at its first call",
        ),
        (add(store, at, &key, 1).await, "an add"),
        (
            answered(store.add_made_by(at, key.clone(), 1, made).await, "add"),
            "an add made by its first call",
        ),
        (
            settle(store, at, debt).await,
            "a settle of a debt of its period",
        ),
    ];
    for (answer, what) in changes {
        assert_eq!(
            answer, None,
            "a first-use counter ends at its deadline: {what} at that instant must find no counter"
        );
    }
    let peeked = peek(store, at, vec![first_use(&key, 2, 0, at + period)]).await;
    assert_eq!(
        (peeked[0].used, peeked[0].first_call),
        (0, None),
        "a first-use counter ends at its deadline: a call at that instant must not bring it back, nor open a period"
    );
    match stored(store, &key).await {
        StoredDeadline::At(found) if found > at => panic!(
            "a first-use counter ends at its deadline: a call at that instant must not create a counter (found one, deadline {found})"
        ),
        StoredDeadline::Undated => panic!(
            "a first-use counter ends at its deadline: a call at that instant must not create a counter (found one, undated)"
        ),
        _ => {}
    }

    // A debt of the period that opens at that instant: the counter that
    // ended takes none of it, the settle opens the debt's own period.
    let debt = Debt {
        key: next.clone(),
        amount: 1,
        lifetime: Lifetime::FirstUse {
            deadline: at + period,
        },
        since: at,
        id: settle_id(),
    };
    assert_eq!(
        settle(store, at, debt).await,
        Some(1),
        "a first-use counter ends at its deadline: a settle at that instant of a debt of the next period must open that period, from zero"
    );
    let peeked = peek(store, at, vec![first_use(&next, 2, 0, at + period)]).await;
    assert_eq!(
        (peeked[0].used, peeked[0].resets_at),
        (1, at + period),
        "a first-use counter ends at its deadline: a debt settled at that instant must land in the period it opens, never on the counter that ended"
    );

    // A calendar window's debt, settled at the window's end.
    let window = fresh_key("settled-at-its-end");
    let (start, end) = (at - period, at);
    let debt = Debt {
        key: window.clone(),
        amount: 1,
        lifetime: Lifetime::Calendar { start, end },
        since: start,
        id: settle_id(),
    };
    assert_eq!(
        settle(store, at, debt).await,
        None,
        "a debt of a calendar window settled at the window's end must not be settled"
    );
    assert!(
        matches!(
            stored(store, &window).await,
            StoredDeadline::NoCounter | StoredDeadline::Unknown
        ),
        "a debt of a calendar window settled at the window's end must not create a counter"
    );

    // The allowance is back at that instant.
    let reopened = charge(store, at, vec![first_use(&key, 2, 2, at + period)]).await;
    assert!(
        reopened.0,
        "a first-use counter ends at its deadline: a charge at that instant must open a new period, with the whole allowance"
    );
    assert_eq!(reopened.1[0].used, 2, "a new period starts from zero");
    assert_eq!(
        reopened.1[0].resets_at,
        at + period,
        "a period opened at the old deadline ends one period after it"
    );
    if let Some(first_call) = reopened.1[0].first_call {
        assert_eq!(
            first_call, at,
            "a period opened at the old deadline records that instant as its first call"
        );
    }
    // Nothing held of the ended period serves a charge at that instant.
    let next = charge(store, at, vec![first_use(&busy, roomy, 1, at + period)]).await;
    assert!(
        next.0,
        "a first-use counter ends at its deadline: a charge at that instant must open a new period"
    );
    assert_eq!(
        (next.1[0].used, next.1[0].resets_at),
        (1, at + period),
        "a first-use counter ends at its deadline: a charge at that instant must be counted in a new period, never on what was held of the ended one"
    );
    Verdict::Passed
}

/// A charge stamped in a calendar window that reaches the store after a
/// call stamped past the window's end still finds the window's counter,
/// spent, and is refused: a request is stamped once, by its policy's
/// outermost layer, and a layer further in (behind an authentication call,
/// a queue) charges it at that instant, after requests stamped since; an
/// instance whose clock is behind does the same. A store that drops a
/// counter at its end (a sweep at the latest call's instant, a time-to-live
/// at the end) admits the late charge on a fresh counter, past the
/// window's limit. (The memory store and the Redis store keep a counter a
/// minute past its window: see [`Lifetime::Calendar`].)
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn a_late_charge_finds_its_spent_counter<S: ConformanceHooks>(store: &S) -> Verdict {
    let mut time = Timeline::new(store.expiry());
    let period = time.period();
    let keys = Keys::new();
    let daily = keys.key("late-calendar");
    let start = time.now();
    let end = start + period;
    let line = |cost| vec![calendar_line(&daily, 2, cost, start, end)];
    assert!(
        charge(store, start, line(2)).await.0,
        "a charge with room must be admitted"
    );
    time.pass_beyond(end).await;
    let after = time.now();
    // A call stamped past the window's end: the next window's counter.
    let next = keys.key("late-calendar-next");
    assert!(
        charge(
            store,
            after,
            vec![calendar_line(&next, 2, 1, end, end + period)]
        )
        .await
        .0,
        "a charge with room must be admitted"
    );
    let late = end - SignedDuration::from_millis(1);
    let (admitted, usage) = charge(store, late, line(1)).await;
    assert!(
        !admitted && usage[0].used == 2,
        "a charge stamped in a calendar window that reaches the store after a call stamped \
         past its end must find the window's counter spent, never a fresh one (admitted: \
         {admitted}, used: {})",
        usage[0].used
    );
    Verdict::Passed
}
