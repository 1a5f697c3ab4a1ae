//! Checks of charges: exact under concurrency, all or nothing, nothing
//! written when refused or abandoned, never past a limit.

use std::future::Future;
use std::time::Duration;

use super::hooks::{ConformanceHooks, Planted, StoredDeadline, Verdict};
use super::support::{calendar_line, charge, first_use, peek, settle_id, stored, Keys, Timeline};
use crate::store::{ChargeAnswer, ChargeLine, ChargeRequest, Debt, Lifetime};

/// Many tasks charging one subject at once: exactly the limit is admitted.
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn exactly_the_limit_under_concurrency<S: ConformanceHooks>(store: &S) -> Verdict {
    const LIMIT: u64 = 50;
    const TASKS: usize = 64;
    const EACH: usize = 4;
    let time = Timeline::new(store.expiry());
    let period = time.period() * 10;
    let keys = Keys::new();
    let key = keys.key("concurrent");
    let calendar = keys.key("concurrent-calendar");
    let start = time.now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..TASKS {
        let store = store.clone();
        let key = key.clone();
        let calendar = calendar.clone();
        tasks.spawn(async move {
            let mut admitted = 0u64;
            for i in 0..EACH {
                let request = ChargeRequest {
                    charged_at: None,
                    now: start,
                    lines: smallvec::smallvec![
                        first_use(&key, LIMIT, 1, start + period),
                        calendar_line(&calendar, LIMIT * 2, 1, start, start + period),
                    ],
                };
                // Half the charges as the layer makes them, at once when
                // the store can.
                let outcome = if i % 2 == 0 {
                    store.charge(request).await
                } else {
                    match store.charge_at_once(&request) {
                        ChargeAnswer::Now(answer) => answer,
                        ChargeAnswer::Later(future) => future.await,
                    }
                };
                let outcome =
                    outcome.unwrap_or_else(|e| panic!("the store failed under concurrency: {e}"));
                if outcome.admitted {
                    admitted += 1;
                }
            }
            admitted
        });
    }
    let mut admitted = 0;
    while let Some(result) = tasks.join_next().await {
        admitted += result.expect("a charging task panicked");
    }
    assert_eq!(
        admitted, LIMIT,
        "exactly the limit must be admitted under concurrency"
    );
    let usage = peek(
        store,
        start,
        vec![
            first_use(&key, LIMIT, 0, start + period),
            calendar_line(&calendar, LIMIT * 2, 0, start, start + period),
        ],
    )
    .await;
    assert_eq!(
        usage[0].used, LIMIT,
        "the counter holds exactly the admitted charges"
    );
    assert_eq!(
        usage[1].used, LIMIT,
        "a quota with room is charged only with the requests admitted on all quotas"
    );
    Verdict::Passed
}

/// A request refused on one quota is charged on none.
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn all_or_nothing_across_quotas<S: ConformanceHooks>(store: &S) -> Verdict {
    let time = Timeline::new(store.expiry());
    let period = time.period() * 10;
    let now = time.now();
    let keys = Keys::new();
    let roomy = keys.key("roomy");
    let tight = keys.key("tight");
    let daily = keys.key("calendar");
    let lines = |cost| {
        vec![
            first_use(&roomy, 10, cost, now + period),
            calendar_line(&daily, 10, cost, now, now + period),
            first_use(&tight, 1, cost, now + period),
        ]
    };
    let first = charge(store, now, lines(1)).await;
    assert!(
        first.0,
        "a request with room on every quota must be admitted"
    );
    assert_eq!(
        first.1.iter().map(|u| u.used).collect::<Vec<_>>(),
        [1, 1, 1],
        "an admitted request is charged on every quota"
    );
    let second = charge(store, now, lines(1)).await;
    assert!(!second.0, "a request over one quota must be refused");
    assert_eq!(
        second.1.iter().map(|u| u.used).collect::<Vec<_>>(),
        [1, 1, 1],
        "a refused request must be charged on no quota"
    );
    let peeked = peek(store, now, lines(0)).await;
    assert_eq!(
        peeked.iter().map(|u| u.used).collect::<Vec<_>>(),
        [1, 1, 1],
        "a refused request must leave every counter as it was"
    );
    let fresh = keys.key("never-created");
    let refused_fresh = charge(
        store,
        now,
        vec![
            first_use(&fresh, 10, 1, now + period),
            first_use(&tight, 1, 1, now + period),
        ],
    )
    .await;
    assert!(!refused_fresh.0, "a request over one quota must be refused");
    assert_eq!(
        peek(store, now, vec![first_use(&fresh, 10, 0, now + period)]).await[0].used,
        0,
        "a refused request must not create the counters of its other quotas"
    );
    assert!(
        matches!(
            stored(store, &fresh).await,
            StoredDeadline::NoCounter | StoredDeadline::Unknown
        ),
        "a refused request must not create the counters of its other quotas"
    );
    Verdict::Passed
}

/// A refused charge counts nothing: every counter of the request keeps its
/// count, its first call and its deadline, and the request creates no
/// counter. A counter without a deadline may get one, as
/// [`undated_counter_is_healed`](super::undated_counter_is_healed) says
/// (its first call plus one period), or stay without. Peeks write nothing.
///
/// The request names a first-use counter and a calendar counter with room, a
/// key never charged, an undated counter (when the store can hold one, see
/// [`ConformanceHooks::plant_undated`]) and, last, a counter at its limit.
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn a_refused_charge_writes_nothing<S: ConformanceHooks>(store: &S) -> Verdict {
    let time = Timeline::new(store.expiry());
    let period = time.period() * 10;
    let now = time.now();
    let keys = Keys::new();
    let roomy = keys.key("roomy");
    let daily = keys.key("calendar");
    let fresh = keys.key("never-created");
    let undated = keys.key("undated");
    let tight = keys.key("tight");
    let set_up = charge(
        store,
        now,
        vec![
            first_use(&roomy, 10, 2, now + period),
            calendar_line(&daily, 10, 1, now, now + period),
            first_use(&tight, 1, 1, now + period),
        ],
    )
    .await;
    assert!(
        set_up.0,
        "a request with room on every quota must be admitted"
    );
    let planted = store
        .plant_undated(undated.clone(), 3, Some(now - period / 2))
        .await
        .unwrap_or_else(|e| panic!("the store failed to plant an undated counter: {e}"));

    let mut lines = vec![
        first_use(&roomy, 10, 1, now + period),
        calendar_line(&daily, 10, 1, now, now + period),
        first_use(&fresh, 10, 1, now + period),
    ];
    if planted == Planted::Planted {
        lines.push(first_use(&undated, 10, 1, now + period));
    }
    lines.push(first_use(&tight, 1, 1, now + period));
    let costless: Vec<ChargeLine> = lines
        .iter()
        .map(|l| ChargeLine {
            cost: 0,
            ..l.clone()
        })
        .collect();

    let before = peek(store, now, costless.clone()).await;
    let mut deadlines = Vec::with_capacity(lines.len());
    for line in &lines {
        deadlines.push(stored(store, &line.key).await);
    }
    let refused = charge(store, now, lines.clone()).await;
    assert!(!refused.0, "a request over one quota must be refused");
    let after = peek(store, now, costless).await;
    for (i, line) in lines.iter().enumerate() {
        let key = line.key.as_str();
        for (usage, what) in [(&refused.1[i], "reported"), (&after[i], "peeked")] {
            assert_eq!(
                usage.used, before[i].used,
                "a refused charge must write nothing: the count of {key} changed ({what})"
            );
            assert_eq!(
                usage.first_call, before[i].first_call,
                "a refused charge must write nothing: the first call of {key} changed ({what})"
            );
            // An undated counter's reset is the one it is healed to (its
            // first call plus one period), which a peek before may not tell.
            let reset = if deadlines[i] == StoredDeadline::Undated {
                now - period / 2 + period
            } else {
                before[i].resets_at
            };
            time.assert_near(
                usage.resets_at,
                reset,
                &format!("a refused charge must write nothing: the reset of {key} moved ({what})"),
            );
        }
        match (deadlines[i], stored(store, &line.key).await) {
            // Healed: dated to its first call plus one period.
            (StoredDeadline::Undated, StoredDeadline::At(is)) => time.assert_near(
                is,
                now - period / 2 + period,
                &format!("a refused charge may only heal the deadline of undated {key}"),
            ),
            (StoredDeadline::At(was), StoredDeadline::At(is)) => time.assert_near(
                is,
                was,
                &format!("a refused charge must write nothing: the deadline of {key} moved"),
            ),
            (was, is) => assert_eq!(
                is, was,
                "a refused charge must write nothing: the deadline of {key} changed"
            ),
        }
    }
    Verdict::Passed
}

/// A charge whose caller stopped waiting spends nothing: a charge future
/// dropped before its first poll, or after a first poll that left it
/// pending (sent, not yet answered), or the future that
/// [`Store::charge_at_once`](crate::store::Store::charge_at_once) gave instead of an answer, ends either not
/// applied, or applied and given back. The count comes back to what the answered charges made it,
/// and stays there. (A store whose charges answer on their first poll is
/// only checked on the first case.)
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn an_abandoned_charge_spends_nothing<S: ConformanceHooks>(store: &S) -> Verdict {
    use std::task::{Context, Poll, Waker};

    let time = Timeline::new(store.expiry());
    let period = time.period() * 10;
    let now = time.now();
    let keys = Keys::new();
    let key = keys.key("abandoned");
    let line = || first_use(&key, 1_000, 1, now + period);
    let (admitted, _) = charge(store, now, vec![line()]).await;
    assert!(admitted, "a charge with room must be admitted");
    let mut answered = 1;

    // Dropped before it was ever polled.
    drop(store.charge(ChargeRequest {
        charged_at: None,
        now,
        lines: smallvec::smallvec![line()],
    }));
    // Made as the layer makes it, and dropped unless it answered at once.
    let mut pending = 0;
    for _ in 0..20 {
        match store.charge_at_once(&ChargeRequest {
            charged_at: None,
            now,
            lines: smallvec::smallvec![line()],
        }) {
            ChargeAnswer::Now(Ok(outcome)) => {
                assert!(outcome.admitted, "a charge with room must be admitted");
                answered += 1;
            }
            ChargeAnswer::Now(Err(_)) | ChargeAnswer::Later(_) => pending += 1,
        }
    }
    // Polled once, then dropped unless it answered at once.
    for _ in 0..20 {
        let mut future = std::pin::pin!(store.charge(ChargeRequest {
            charged_at: None,
            now,
            lines: smallvec::smallvec![line()],
        }));
        match future
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
        {
            Poll::Ready(Ok(outcome)) => {
                assert!(outcome.admitted, "a charge with room must be admitted");
                answered += 1;
            }
            // A store that sheds load while earlier charges are given back
            // may refuse at once: that charge was never applied.
            Poll::Ready(Err(_)) | Poll::Pending => pending += 1,
        }
    }

    // Given back in time: the count comes back to the answered charges and
    // stays there a while.
    let costless = || vec![ChargeLine { cost: 0, ..line() }];
    // However the store's deadlines pass, it may give back in a task of its
    // own: a few seconds to settle, then a steady second.
    let settle = Duration::from_secs(10);
    let started = std::time::Instant::now();
    let mut steady = 0;
    loop {
        let used = peek(store, now, costless()).await[0].used;
        if used == answered {
            steady += 1;
            if steady == 10 {
                break;
            }
        } else {
            steady = 0;
            assert!(
                started.elapsed() < settle,
                "an abandoned charge must spend nothing: {used} units spent after {answered} \
                 answered charges ({pending} charges dropped while pending)"
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Verdict::Passed
}

/// Counts at the top of what a store counts never wrap: with a limit of
/// `u64::MAX`, a charge of one less than the most the store counts exactly
/// ([`Store::max_count`](crate::store::Store::max_count): `u64::MAX` for
/// the memory store) is admitted, and one more of 5 is refused, alone or
/// with another line, and leaves the count as it was; an add of
/// `u64::MAX` either fails (a store that counts less far, see
/// [`Store::add`](crate::store::Store::add)) or leaves a count no smaller
/// than before, and so does a settle of a debt of `u64::MAX`.
///
/// (A store that counts less far than `u64` treats a limit beyond its
/// range as unlimited: the check reads the count the store reports after
/// the first charge.)
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn counts_never_pass_the_limit_nor_wrap<S: ConformanceHooks>(store: &S) -> Verdict {
    let time = Timeline::new(store.expiry());
    let period = time.period() * 10;
    let now = time.now();
    let keys = Keys::new();
    let top = keys.key("top");
    let other = keys.key("other");
    let line = |cost| first_use(&top, u64::MAX, cost, now + period);

    let most = store.max_count();
    let first = charge(store, now, vec![line(most - 1)]).await;
    assert!(
        first.0,
        "a charge within a limit of u64::MAX, of less than the most the store counts, must be admitted"
    );
    let used = first.1[0].used;
    assert!(used > 0, "an admitted charge must count");

    let over = charge(store, now, vec![line(5)]).await;
    assert!(
        !over.0,
        "a charge past the limit must be refused, however large the count"
    );
    assert_eq!(
        over.1[0].used, used,
        "a charge past the limit must leave the count as it was, never wrapped"
    );
    let over = charge(
        store,
        now,
        vec![line(5), first_use(&other, 10, 1, now + period)],
    )
    .await;
    assert!(
        !over.0,
        "a charge past the limit must be refused, however large the count (two lines)"
    );
    assert_eq!(
        (over.1[0].used, over.1[1].used),
        (used, 0),
        "a charge past the limit must leave every count as it was, never wrapped (two lines)"
    );

    if let Ok(Some(after)) = store.add(now, top.clone(), u64::MAX).await {
        assert!(
            after >= used,
            "an add must never leave a smaller count (from {used} to {after}): it saturates"
        );
    }
    let before = peek(store, now, vec![line(0)]).await[0].used;
    let debt = Debt {
        key: top.clone(),
        amount: u64::MAX,
        lifetime: Lifetime::FirstUse {
            deadline: now + period,
        },
        since: now,
        id: settle_id(),
    };
    if let Ok(Some(after)) = store.settle_debt(now, debt).await {
        assert!(
            after >= before,
            "a settle must never leave a smaller count (from {before} to {after}): it saturates, or fails"
        );
    }
    let peeked = peek(store, now, vec![line(0)]).await;
    assert!(
        peeked[0].used >= used,
        "a count must never wrap (from {used} to {})",
        peeked[0].used
    );
    assert!(
        !charge(store, now, vec![line(5)]).await.0,
        "a charge past the limit must be refused, however large the count"
    );
    Verdict::Passed
}

/// A charge with a line whose lifetime is over at its instant (a calendar
/// window that ends at it, or before; a first-use deadline that is not after
/// it) names no counter the request could count on: the store answers an
/// error, by [`Store::charge`](crate::store::Store::charge) and by
/// [`Store::charge_at_once`](crate::store::Store::charge_at_once), and
/// charges nothing on any of its lines, however often it is sent.
///
/// # Panics
///
/// When the store breaks the rule.
pub async fn a_charge_past_its_period_is_an_error<S: ConformanceHooks>(store: &S) -> Verdict {
    let time = Timeline::new(store.expiry());
    let period = time.period() * 10;
    let now = time.now();
    let keys = Keys::new();
    let live = keys.key("live");
    let ended = keys.key("ended");
    let past = keys.key("past");
    // A first-use key charged often: a store that keeps part of a
    // subject's allowance at hand (a leased block) holds some of it now,
    // and a first-use key names every period of its subject.
    let busy = keys.key("busy");
    let roomy = 1_000_000;
    for _ in 0..2_000 {
        charge(store, now, vec![first_use(&busy, roomy, 1, now + period)]).await;
    }
    let busy_before = peek(store, now, vec![first_use(&busy, roomy, 0, now + period)]).await;
    let lines = vec![
        vec![
            calendar_line(&live, 10, 1, now, now + period),
            calendar_line(&ended, 10, 1, now - period, now),
        ],
        vec![calendar_line(&past, 10, 1, now - period * 2, now - period)],
        vec![first_use(&ended, 10, 1, now)],
        vec![first_use(&busy, roomy, 1, now)],
    ];
    for round in 0..3 {
        for lines in &lines {
            let request = ChargeRequest {
                charged_at: None,
                now,
                lines: lines.clone().into(),
            };
            let answer = match store.charge_at_once(&request) {
                ChargeAnswer::Now(answer) => answer,
                ChargeAnswer::Later(future) => future.await,
            };
            assert!(
                answer
                    .as_ref()
                    .is_err_and(|e| e.kind() == crate::store::StoreErrorKind::Other),
                "a charge past its period must be an error of kind Other (charge_at_once, round {round})"
            );
            assert!(
                store
                    .charge(request)
                    .await
                    .is_err_and(|e| e.kind() == crate::store::StoreErrorKind::Other),
                "a charge past its period must be an error of kind Other (charge, round {round})"
            );
        }
    }
    let peeked = peek(
        store,
        now,
        vec![
            calendar_line(&live, 10, 0, now, now + period),
            first_use(&ended, 10, 0, now + period),
        ],
    )
    .await;
    assert_eq!(
        (peeked[0].used, peeked[1].used),
        (0, 0),
        "a charge past its period must charge nothing, on none of its lines"
    );
    let busy_after = peek(store, now, vec![first_use(&busy, roomy, 0, now + period)]).await;
    assert_eq!(
        busy_after[0].used, busy_before[0].used,
        "a charge past its period must charge nothing, on a key charged often too"
    );
    Verdict::Passed
}

/// The small rules of each call, as [`Store`](crate::Store) documents
/// them: a charge over its limit creates no counter, a charge of nothing
/// creates none (a first-use period opens with the first charge that
/// spends); `reset` tells whether there was a counter; a refund never
/// takes a count below zero; `add_made_by`, `refund_made_by` and
/// `refund_made_at` never create a counter; a
/// plain refund (support's) marks a first-use counter it lowers, so that
/// no give-back closes its period afterwards; a peek ignores costs.
pub async fn each_call_answers_as_documented<S: ConformanceHooks>(store: &S) -> Verdict {
    let time = Timeline::new(store.expiry());
    let period = time.period() * 10;
    let now = time.now();
    let keys = Keys::new();

    let over = keys.key("over-its-limit");
    let refused = charge(store, now, vec![first_use(&over, 3, 5, now + period)]).await;
    assert!(
        !refused.0,
        "a charge over its limit on a new key must be refused"
    );
    let left = peek(store, now, vec![first_use(&over, 3, 0, now + period)]).await;
    assert!(
        left[0].used == 0 && left[0].first_call.is_none(),
        "a charge over its limit must create no counter"
    );

    let nothing = keys.key("charged-nothing");
    let free = charge(store, now, vec![first_use(&nothing, 10, 0, now + period)]).await;
    assert!(free.0, "a charge of nothing must be admitted");
    let left = peek(store, now, vec![first_use(&nothing, 10, 0, now + period)]).await;
    assert!(
        left[0].first_call.is_none(),
        "a charge of nothing must create no counter: the period opens with the first charge that spends"
    );

    let reset = keys.key("reset");
    assert!(
        charge(store, now, vec![first_use(&reset, 10, 1, now + period)])
            .await
            .0
    );
    assert!(
        super::support::answered(store.reset(reset.clone()).await, "reset"),
        "a reset of a live counter must answer that there was one"
    );
    assert!(
        !super::support::answered(store.reset(reset.clone()).await, "reset"),
        "a reset of no counter must answer that there was none"
    );

    let below = keys.key("refund-below-zero");
    assert!(
        charge(store, now, vec![first_use(&below, 10, 1, now + period)])
            .await
            .0
    );
    let refunded = super::support::refund(store, now, &below, 5).await;
    assert_eq!(
        refunded,
        Some(0),
        "a refund of more than a counter holds must leave it at zero, never below"
    );
    let after = charge(store, now, vec![first_use(&below, 10, 1, now + period)]).await;
    assert!(
        after.0 && after.1[0].used == 1,
        "a refund of more than a counter holds must leave it at zero, never below"
    );

    let never = keys.key("add-made-by-never-charged");
    let added = super::support::answered(
        store.add_made_by(now, never.clone(), 5, now).await,
        "add_made_by",
    );
    assert_eq!(
        added, None,
        "add_made_by on a key never charged must find no counter"
    );
    assert!(
        matches!(
            stored(store, &never).await,
            StoredDeadline::NoCounter | StoredDeadline::Unknown
        ),
        "add_made_by must never create a counter"
    );

    let never = keys.key("guarded-refund-never-charged");
    let guarded = [
        (
            super::support::answered(
                store.refund_made_by(now, never.clone(), 1, now).await,
                "refund_made_by",
            ),
            "refund_made_by",
        ),
        (
            super::support::answered(
                store.refund_made_at(now, never.clone(), 1, now).await,
                "refund_made_at",
            ),
            "refund_made_at",
        ),
    ];
    for (answer, what) in guarded {
        assert_eq!(
            answer, None,
            "{what} on a key never charged must find no counter"
        );
    }
    assert!(
        matches!(
            stored(store, &never).await,
            StoredDeadline::NoCounter | StoredDeadline::Unknown
        ),
        "refund_made_by and refund_made_at must never create a counter"
    );
    let left = peek(store, now, vec![first_use(&never, 10, 0, now + period)]).await;
    assert!(
        left[0].used == 0 && left[0].first_call.is_none(),
        "refund_made_by and refund_made_at must never create a counter"
    );

    let marked = keys.key("refunded-by-support");
    let first = charge(store, now, vec![first_use(&marked, 10, 1, now + period)]).await;
    let second = charge(store, now, vec![first_use(&marked, 10, 1, now + period)]).await;
    assert!(
        first.0 && second.0,
        "two charges with room must be admitted"
    );
    if let Some(first_call) = first.1[0].first_call {
        // Support refunds one unit; then the first request's charge is
        // given back: the second request's unit was served, and its
        // period stays open.
        super::support::refund(store, now, &marked, 1).await;
        super::support::answered(
            store
                .refund_made_at(now, marked.clone(), 1, first_call)
                .await,
            "refund_made_at",
        );
        let left = peek(store, now, vec![first_use(&marked, 10, 0, now + period)]).await;
        assert!(
            left[0].first_call.is_some(),
            "a give-back after a plain refund (support's) lowered a first-use counter must leave its period open"
        );
    }

    let costly = keys.key("peeked-with-a-cost");
    assert!(
        charge(store, now, vec![first_use(&costly, 10, 1, now + period)])
            .await
            .0
    );
    let peeked = peek(store, now, vec![first_use(&costly, 10, 3, now + period)]).await;
    assert_eq!(
        peeked[0].used, 1,
        "a peek must ignore the costs it is given"
    );
    Verdict::Passed
}

/// A settle whose caller stopped waiting counts once when it is sent again:
/// a [`Store::settle_debt`](crate::store::Store::settle_debt) future
/// dropped after a first poll that left it pending (a settle that timed
/// out) is sent again by the ledger under its [`Debt::id`] until it
/// answers. Whether the store gave the first back (applied late) or let it
/// stand and added nothing for the second (its id seen), each debt counts
/// once: the count comes to what the charge and the debts make, and stays
/// there. (A store whose settles answer on their first poll passes at
/// once.)
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn an_abandoned_settle_sent_again_counts_once<S: ConformanceHooks>(store: &S) -> Verdict {
    use std::task::{Context, Poll, Waker};

    let time = Timeline::new(store.expiry());
    let period = time.period() * 10;
    let now = time.now();
    let keys = Keys::new();
    let key = keys.key("abandoned-settle");
    let line = || first_use(&key, 1_000, 1, now + period);
    let (admitted, _) = charge(store, now, vec![line()]).await;
    assert!(admitted, "a charge with room must be admitted");
    let debt = |id: u64| Debt {
        key: key.clone(),
        amount: 1,
        lifetime: Lifetime::FirstUse {
            deadline: now + period,
        },
        since: now,
        id,
    };
    // Polled once, as the ledger polls a settle, then dropped unless it
    // answered; a dropped one is sent again until it answers.
    let (debts, mut pending) = (20, 0);
    for _ in 0..debts {
        let id = settle_id();
        let answered = {
            // Dropped at the end of the block.
            let mut future = std::pin::pin!(store.settle_debt(now, debt(id)));
            match future
                .as_mut()
                .poll(&mut Context::from_waker(Waker::noop()))
            {
                Poll::Ready(Ok(Some(_))) => true,
                Poll::Ready(Ok(None)) => {
                    panic!("a settle of a debt of a live counter's period must add to it")
                }
                Poll::Ready(Err(_)) | Poll::Pending => false,
            }
        };
        if answered {
            continue;
        }
        pending += 1;
        let mut tries = 0;
        while !matches!(store.settle_debt(now, debt(id)).await, Ok(Some(_))) {
            tries += 1;
            assert!(tries < 100, "a settle sent again must answer");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let counted = 1 + debts;
    let costless = || vec![ChargeLine { cost: 0, ..line() }];
    let settle = Duration::from_secs(10);
    let started = std::time::Instant::now();
    let mut steady = 0;
    loop {
        let used = peek(store, now, costless()).await[0].used;
        if used == counted {
            steady += 1;
            if steady == 10 {
                break;
            }
        } else {
            steady = 0;
            assert!(
                started.elapsed() < settle,
                "a settle sent again under its id must count once: {used} units counted for \
                 one charge and {debts} debts of 1 ({pending} settles dropped while pending, \
                 then sent again)"
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Verdict::Passed
}

/// A store's identity ([`Store::identity`](crate::store::Store::identity))
/// is one its clones share, wherever they are, and no other live store
/// has: policies on one store check their quotas against each other by
/// it, and a layer takes a line another policy's layer already charged on
/// the same identity and key as counted. A handle's own identity (its
/// address, say) leaves two policies on one store unchecked, each charging
/// its line; an identity shared with another store leaves a request
/// uncounted on one of them. The second store comes from
/// [`ConformanceHooks::another_store`]; without one, only the clones are
/// checked.
///
/// # Panics
///
/// When the store breaks the rule.
pub async fn clones_share_an_identity_no_other_store_has<S: ConformanceHooks>(
    store: &S,
) -> Verdict {
    let Some(id) = store.identity() else {
        return Verdict::NotApplicable(
            "the store tells no identity: policies on it are not checked against each other",
        );
    };
    let clone = store.clone();
    assert_eq!(
        clone.identity(),
        Some(id),
        "the clones of a store must share its identity"
    );
    let clone_of_clone = clone.clone();
    drop(clone);
    assert_eq!(
        clone_of_clone.identity(),
        Some(id),
        "the clones of a store must share its identity (a clone of a clone)"
    );
    let moved = store.clone();
    let theirs = tokio::spawn(async move { moved.identity() })
        .await
        .expect("a task that tells an identity panicked");
    assert_eq!(
        theirs,
        Some(id),
        "the clones of a store must share its identity (a clone moved into a task)"
    );
    if let Some(other) = store.another_store() {
        let time = Timeline::new(store.expiry());
        let now = time.now();
        let period = time.period() * 10;
        let key = Keys::new().key("another-store");
        let line = |cost| vec![first_use(&key, 10, cost, now + period)];
        assert!(
            charge(&other, now, line(1)).await.0,
            "a charge with room must be admitted"
        );
        assert_eq!(
            peek(store, now, line(0)).await[0].used,
            0,
            "ConformanceHooks::another_store must give a store with counters of its own"
        );
        assert_ne!(
            other.identity(),
            Some(id),
            "a store with counters of its own must not share another live store's identity"
        );
        assert_eq!(
            other.clone().identity(),
            other.identity(),
            "the clones of a store must share its identity"
        );
    }
    Verdict::Passed
}

/// [`Store::charge_taking`](crate::store::Store::charge_taking): a request
/// with extra units is admitted exactly when it fits alone, takes no more
/// than it asked for and never past a line's limit, and what it says it
/// took is counted beside its cost (nothing at all when refused). Extra
/// units on a key the request lists twice are never taken. Run
/// concurrently, exactly the limit is spent.
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn extra_units_take_only_the_room_left<S: ConformanceHooks>(store: &S) -> Verdict {
    let time = Timeline::new(store.expiry());
    let period = time.period() * 10;
    let keys = Keys::new();
    let (a, b) = (keys.key("extra-a"), keys.key("extra-b"));
    let start = time.now();
    let line = |key, limit, cost| calendar_line(key, limit, cost, start, start + period);
    let taking = |lines: Vec<ChargeLine>, extra: &[u64]| {
        let request = ChargeRequest {
            charged_at: None,
            now: start,
            lines: lines.into(),
        };
        let extra = extra.iter().copied().collect();
        async move {
            match store.charge_taking(request, extra).await {
                Ok((outcome, taken)) => (outcome, taken.into_vec()),
                Err(error) => panic!("the store failed a charge with extra units: {error}"),
            }
        }
    };
    // Spent before each request, and what each asks: cost 2 with 5 more
    // on `a` (limit 10), cost 1 with 5 more on `b` (limit 3).
    let mut spent = (0, 0);
    for _ in 0..6 {
        let (outcome, taken) = taking(vec![line(&a, 10, 2), line(&b, 3, 1)], &[5, 5]).await;
        let fits = spent.0 + 2 <= 10 && spent.1 < 3;
        assert_eq!(
            outcome.admitted, fits,
            "a request with extra units is admitted exactly when it fits alone \
             (spent {spent:?}, taken {taken:?})"
        );
        assert_eq!(taken.len(), 2, "one figure per line");
        if !fits {
            assert_eq!(taken, [0, 0], "a refused request takes nothing");
            assert_eq!(
                (outcome.usage[0].used, outcome.usage[1].used),
                spent,
                "a refused request charges nothing"
            );
            continue;
        }
        assert!(
            taken[0] <= 5 && taken[1] <= 5,
            "no more than asked: {taken:?}"
        );
        spent = (spent.0 + 2 + taken[0], spent.1 + 1 + taken[1]);
        assert_eq!(
            (outcome.usage[0].used, outcome.usage[1].used),
            spent,
            "the units taken are counted beside the cost"
        );
        assert!(
            spent.0 <= 10 && spent.1 <= 3,
            "extra units never pass a limit: {spent:?}"
        );
    }
    let usage = peek(store, start, vec![line(&a, 10, 0), line(&b, 3, 0)]).await;
    assert_eq!(
        (usage[0].used, usage[1].used),
        spent,
        "the counters hold what the answers told"
    );

    // One line alone (a store's path for one-line charges may be its own):
    // cost 2 with 4 more under a limit of 9, until the cost no longer
    // fits; the second takes the 1 left beside its cost.
    let one = keys.key("extra-one");
    let mut used = 0;
    for _ in 0..3 {
        let (outcome, taken) = taking(vec![line(&one, 9, 2)], &[4]).await;
        let fits = used + 2 <= 9;
        assert_eq!(
            outcome.admitted, fits,
            "a request with extra units is admitted exactly when it fits alone \
             (spent {used}, taken {taken:?})"
        );
        assert_eq!(taken.len(), 1, "one figure per line");
        if fits {
            assert!(taken[0] <= 4, "no more than asked: {taken:?}");
            used += 2 + taken[0];
        } else {
            assert_eq!(taken, [0], "a refused request takes nothing");
        }
        assert_eq!(
            outcome.usage[0].used, used,
            "the units taken are counted beside the cost, nothing when refused"
        );
        assert!(used <= 9, "extra units never pass a limit: {used}");
    }

    // A key listed twice takes no extra units, on either line.
    let twice = keys.key("extra-twice");
    let (outcome, taken) = taking(vec![line(&twice, 10, 1), line(&twice, 10, 1)], &[4, 4]).await;
    assert!(outcome.admitted, "a charge with room must be admitted");
    assert_eq!(taken, [0, 0], "a key listed twice takes no extra units");
    assert_eq!(outcome.usage[1].used, 2);

    // Concurrently: the limit exactly, whatever each took.
    const LIMIT: u64 = 40;
    let shared = keys.key("extra-concurrent");
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..16 {
        let (store, shared) = (store.clone(), shared.clone());
        let line = calendar_line(&shared, LIMIT, 1, start, start + period);
        tasks.spawn(async move {
            let mut spent = 0;
            for _ in 0..4 {
                let request = ChargeRequest {
                    charged_at: None,
                    now: start,
                    lines: smallvec::smallvec![line.clone()],
                };
                let (outcome, taken) = store
                    .charge_taking(request, smallvec::smallvec![3])
                    .await
                    .unwrap_or_else(|e| panic!("the store failed under concurrency: {e}"));
                if outcome.admitted {
                    spent += 1 + taken[0];
                }
            }
            spent
        });
    }
    let mut total = 0;
    while let Some(result) = tasks.join_next().await {
        total += result.expect("a charging task panicked");
    }
    let usage = peek(
        store,
        start,
        vec![calendar_line(&shared, LIMIT, 0, start, start + period)],
    )
    .await;
    assert_eq!(
        (total, usage[0].used),
        (LIMIT, LIMIT),
        "concurrent requests with extra units spend exactly the limit, and the counter \
         holds what they were told they took"
    );
    Verdict::Passed
}
