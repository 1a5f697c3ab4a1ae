//! The rules of the request path, without a runtime.

use std::time::Duration;

use http::header::RETRY_AFTER;
use http::{Request, StatusCode};
use jiff::SignedDuration;

use super::*;
use crate::policy::{QuotaPolicy, UnknownPlan};
use crate::status::{LayerQuotas, Lines};
use crate::store::StoreErrorKind;
use crate::subject::FromHeader;
use crate::{ManualClock, QuotaLayer};

fn at(s: &str) -> Timestamp {
    s.parse().unwrap()
}

const NOW: &str = "2026-12-02T10:00:30Z";

fn layer(
    quotas: &[Quota],
    f: impl FnOnce(crate::QuotaPolicyBuilder<FromHeader>) -> crate::QuotaPolicyBuilder<FromHeader>,
) -> QuotaLayer<FromHeader> {
    let builder =
        QuotaPolicy::builder(FromHeader::account("x-account-id")).clock(ManualClock::new(at(NOW)));
    let policy = f(builder).build();
    let mut layer = policy.layer(quotas[0].clone());
    for quota in &quotas[1..] {
        layer = layer.quota(quota.clone());
    }
    layer
}

fn head(headers: &[(&str, &str)]) -> Parts {
    let mut request = Request::get("/");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.body(()).unwrap().into_parts().0
}

const ACME: &[(&str, &str)] = &[("x-account-id", "acme")];

fn charge_of(layer: &QuotaLayer<FromHeader>, parts: &Parts) -> Charge {
    match plan(&layer.bound, parts) {
        Step::Charge(charge) => charge,
        _ => panic!("a charge"),
    }
}

fn usage(limit: u64, used: u64, resets_at: &str) -> Usage {
    Usage {
        held_elsewhere_until: None,
        counted_at: None,
        limit,
        used,
        resets_at: at(resets_at),
        first_call: None,
    }
}

#[test]
fn the_outermost_layer_names_the_caller_and_charges_every_quota() {
    let layer = layer(&[Quota::per_minute(10), Quota::daily(100)], |b| b);
    let charge = charge_of(&layer, &head(ACME));
    assert_eq!(charge.caller().subject, Subject::account("acme"));
    assert_eq!(charge.request.now, at(NOW));
    assert_eq!(charge.request.lines.len(), 2);
    assert!(
        charge.ticket.charges.is_empty(),
        "nothing charged further out"
    );
}

#[test]
fn quotas_the_ticket_counts_already_pass() {
    let layer = layer(&[Quota::daily(100)], |b| b);
    let mut parts = head(ACME);
    let charge = charge_of(&layer, &parts);
    let Decision::Admit(lines) = decide(
        &charge,
        &layer.bound.scope,
        &layer.bound.policy.settings,
        &mut Ok(ChargeOutcome {
            admitted: true,
            usage: smallvec::smallvec![usage(100, 1, "2026-12-03T00:00:00Z")],
        }),
    ) else {
        panic!("admitted");
    };
    let mut ticket = charge.ticket.clone();
    let own: Arc<dyn LayerQuotas> = layer.bound.clone();
    ticket
        .charges
        .push(Arc::new(Lines::new(own, charge.quotas.clone(), lines)));
    let mut status = QuotaStatus::default();
    status.put(ticket);
    parts.extensions.insert(status);
    assert!(matches!(plan(&layer.bound, &parts), Step::Pass));
}

#[test]
fn a_request_the_policy_let_through_uncounted_passes_every_layer() {
    let layer = layer(&[Quota::daily(1)], |b| b.skip_if(|p| p.uri.path() == "/"));
    let Step::PassUncounted(ticket) = plan(&layer.bound, &head(&[])) else {
        panic!("skipped");
    };
    let mut parts = head(ACME);
    let mut status = QuotaStatus::default();
    status.put(ticket);
    parts.extensions.insert(status);
    assert!(matches!(plan(&layer.bound, &parts), Step::Pass));
}

#[test]
fn a_cost_that_cannot_be_worked_out_is_a_400_before_any_charge() {
    let layer = layer(&[Quota::daily(10)], |b| b)
        .cost_fn(|_| Err(crate::InvalidRequest::new("n must be a whole number")));
    let Step::Reject(response) = plan(&layer.bound, &head(ACME)) else {
        panic!("rejected");
    };
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert!(String::from_utf8_lossy(response.body()).contains("n must be a whole number"));
}

#[test]
fn an_unknown_plan_is_echoed_short() {
    let layer = layer(&[Quota::daily(10).plan("pro", 100)], |b| {
        b.plan(|p| Some(p.headers.get("x-plan")?.to_str().ok()?.to_owned()))
            .on_unknown_plan(UnknownPlan::Reject)
    });
    let long = "p".repeat(60_000);
    let Step::Reject(response) = plan(
        &layer.bound,
        &head(&[("x-account-id", "acme"), ("x-plan", &long)]),
    ) else {
        panic!("rejected");
    };
    assert_eq!(response.status(), StatusCode::FORBIDDEN);
    assert!(response.body().len() < 1_000, "{}", response.body().len());
}

#[test]
fn a_callers_zone_moves_its_calendar_quotas_and_keys() {
    let tokyo = jiff::tz::TimeZone::get("Asia/Tokyo").unwrap();
    let layer = layer(
        &[
            Quota::daily(10),
            Quota::fixed_window(5, Duration::from_secs(10)),
        ],
        |b| b.time_zone(move |p| Ok(p.headers.contains_key("x-tokyo").then(|| tokyo.clone()))),
    );
    let utc = charge_of(&layer, &head(ACME));
    let tokyo = charge_of(&layer, &head(&[("x-account-id", "acme"), ("x-tokyo", "1")]));
    assert!(utc.request.lines[0].key.as_str().ends_with(":2026-12-02"));
    assert!(
        tokyo.request.lines[0]
            .key
            .as_str()
            .ends_with(":2026-12-02[Asia/Tokyo]"),
        "{}",
        tokyo.request.lines[0].key.as_str()
    );
    // Tokyo's day started at 15:00 UTC the day before.
    assert_eq!(
        tokyo.request.lines[0].lifetime,
        crate::store::Lifetime::Calendar {
            start: at("2026-12-01T15:00:00Z"),
            end: at("2026-12-02T15:00:00Z"),
        }
    );
    // Fixed windows do not depend on a zone.
    assert_eq!(utc.request.lines[1].key, tokyo.request.lines[1].key);
}

#[test]
fn a_refusal_names_the_quota_without_room_and_waits_for_its_reset() {
    let layer = layer(&[Quota::per_minute(10), Quota::daily(100)], |b| b);
    let charge = charge_of(&layer, &head(ACME));
    let usage = vec![
        usage(10, 3, "2026-12-02T10:01:00Z"),
        usage(100, 100, "2026-12-03T00:00:00Z"),
    ];
    let decision = decide(
        &charge,
        &layer.bound.scope,
        &layer.bound.policy.settings,
        &mut Ok(ChargeOutcome {
            admitted: false,
            usage: usage.clone().into(),
        }),
    );
    assert!(matches!(&decision, Decision::Refuse(u) if u[..] == usage[..]));
    let refusal = refusal(&charge, &layer.bound.scope, &usage, charge.ticket.now, None);
    let response = refused(
        &layer.bound.policy.settings,
        &refusal,
        &charge,
        &layer.bound.scope,
        &usage,
        charge.ticket.now,
    );
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(response.headers()[RETRY_AFTER], "50370");
    let body: serde_json::Value = serde_json::from_slice(response.body()).unwrap();
    assert_eq!(
        body["violated-policies"],
        serde_json::json!(["default-day"])
    );
    assert_eq!(
        response.headers()["ratelimit"],
        "\"default-minute\";r=7;t=30, \"default-day\";r=0;t=50370"
    );
    assert!(response.extensions().get::<Refused>().is_some());

    // Told 30 s after the charge (layers and middleware further out took
    // that long): the waits are counted from then.
    let told = charge.ticket.now + SignedDuration::from_secs(30);
    let later = super::refusal(&charge, &layer.bound.scope, &usage, told, None);
    let response = refused(
        &layer.bound.policy.settings,
        &later,
        &charge,
        &layer.bound.scope,
        &usage,
        told,
    );
    assert_eq!(response.headers()[RETRY_AFTER], "50340");
    assert_eq!(
        response.headers()["ratelimit"],
        "\"default-minute\";r=7;t=0, \"default-day\";r=0;t=50340"
    );
}

#[test]
fn a_store_error_follows_the_policy() {
    let error = || Err(StoreError::new(StoreErrorKind::Unavailable, "down"));
    let open = layer(&[Quota::daily(1)], |b| {
        b.on_store_error(OnStoreError::FailOpen)
    });
    let charge = charge_of(&open, &head(ACME));
    assert!(matches!(
        decide(
            &charge,
            &open.bound.scope,
            &open.bound.policy.settings,
            &mut error()
        ),
        Decision::PassUncounted
    ));
    let closed = layer(&[Quota::daily(1)], |b| {
        b.on_store_error(OnStoreError::FailClosed {
            retry_after: Duration::from_millis(1_500),
        })
    });
    let charge = charge_of(&closed, &head(ACME));
    let Decision::Unavailable(retry_after) = decide(
        &charge,
        &closed.bound.scope,
        &closed.bound.policy.settings,
        &mut error(),
    ) else {
        panic!("fail closed");
    };
    let refusal = Refusal::store_unavailable(retry_after, None);
    let response = refused(
        &closed.bound.policy.settings,
        &refusal,
        &charge,
        &closed.bound.scope,
        &[],
        charge.ticket.now,
    );
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(response.headers()[RETRY_AFTER], "2");
    assert!(!response.headers().contains_key("ratelimit"));

    // Shadow quotas never refuse: under fail closed too, the request
    // passes, owing its charge.
    let shadow = layer(&[Quota::daily(1).shadow()], |b| {
        b.on_store_error(OnStoreError::FailClosed {
            retry_after: Duration::from_secs(1),
        })
    });
    let charge = charge_of(&shadow, &head(ACME));
    assert!(matches!(
        decide(
            &charge,
            &shadow.bound.scope,
            &shadow.bound.policy.settings,
            &mut error()
        ),
        Decision::PassUncounted
    ));
}

#[test]
fn a_shadow_quota_is_charged_without_a_limit_and_reports_its_own() {
    let layer = layer(&[Quota::daily(1).shadow()], |b| b);
    let charge = charge_of(&layer, &head(ACME));
    assert_eq!(charge.request.lines[0].limit, u64::MAX);
    assert_eq!(charge.request.lines[0].shadow_limit, Some(1));
    let Decision::Admit(lines) = decide(
        &charge,
        &layer.bound.scope,
        &layer.bound.policy.settings,
        &mut Ok(ChargeOutcome {
            admitted: true,
            usage: smallvec::smallvec![usage(u64::MAX, 5, "2026-12-03T00:00:00Z")],
        }),
    ) else {
        panic!("a shadow quota never refuses");
    };
    assert_eq!(lines[0].usage.limit, 1);
    assert_eq!(lines[0].usage.used, 5);
}

fn admitted(layer: &QuotaLayer<FromHeader>, used: u64) -> SmallVec<[Line; 1]> {
    let charge = charge_of(layer, &head(ACME));
    let mut answer = Ok(ChargeOutcome {
        admitted: true,
        usage: smallvec::smallvec![usage(10, used, "2026-12-03T00:00:00Z")],
    });
    match decide(
        &charge,
        &layer.bound.scope,
        &layer.bound.policy.settings,
        &mut answer,
    ) {
        Decision::Admit(lines) => lines,
        _ => panic!("admitted"),
    }
}

fn response_head(
    status: StatusCode,
    f: impl FnOnce(&mut http::Extensions),
) -> http::response::Parts {
    let mut response = http::Response::new(());
    *response.status_mut() = status;
    f(response.extensions_mut());
    response.into_parts().0
}

#[test]
fn what_a_response_changes() {
    let plain = layer(&[Quota::daily(10)], |b| b);
    let settings = &plain.bound.policy.settings;
    let cost = &plain.bound.scope.cost;
    let lines = admitted(&plain, 1);
    let ok = response_head(StatusCode::OK, |_| {});
    assert_eq!(
        outcome(&lines, cost, settings, u64::MAX, false, Some(&ok)),
        Outcome::Served(vec![])
    );
    let failed = response_head(StatusCode::INTERNAL_SERVER_ERROR, |_| {});
    assert_eq!(
        outcome(&lines, cost, settings, u64::MAX, false, Some(&failed)),
        Outcome::Served(vec![]),
        "server errors are charged unless the policy refunds them"
    );
    assert_eq!(
        outcome(&lines, cost, settings, u64::MAX, false, None),
        Outcome::Served(vec![]),
        "so is an inner service that fails"
    );
    // Refused further in (by a quota, a store failure or before any
    // charge): the request was not served, and this layer gives its charge
    // back.
    let refused_inside = response_head(StatusCode::TOO_MANY_REQUESTS, |e| {
        e.insert(Refused);
    });
    assert_eq!(
        outcome(
            &lines,
            cost,
            settings,
            u64::MAX,
            false,
            Some(&refused_inside)
        ),
        Outcome::Served(vec![(0, Adjust::Refund(1))])
    );

    let refunding = layer(&[Quota::daily(10)], |b| b.refund_server_errors(true));
    let lines = admitted(&refunding, 1);
    let settings = &refunding.bound.policy.settings;
    assert_eq!(
        outcome(&lines, cost, settings, u64::MAX, false, Some(&failed)),
        Outcome::Served(vec![(0, Adjust::Refund(1))])
    );
    assert_eq!(
        outcome(&lines, cost, settings, u64::MAX, false, None),
        Outcome::Served(vec![(0, Adjust::Refund(1))]),
        "an inner service that fails is a server error"
    );
}

/// Lines a layer further in marked refused (its refusal's response may
/// have been rebuilt on the way out, its mark lost) are given back when the
/// answer is an error, HTTP or gRPC; a success (a sub-request refused
/// inside, the request served all the same) keeps them charged.
#[test]
fn lines_marked_refused_go_back_with_an_error_answer_only() {
    let plain = layer(&[Quota::daily(10)], |b| b);
    let settings = &plain.bound.policy.settings;
    let cost = &plain.bound.scope.cost;
    let lines = admitted(&plain, 1);
    let back = Outcome::Served(vec![(0, Adjust::Refund(1))]);
    for status in [
        StatusCode::TOO_MANY_REQUESTS,
        StatusCode::UNAUTHORIZED,
        StatusCode::SERVICE_UNAVAILABLE,
    ] {
        let rebuilt = response_head(status, |_| {});
        assert_eq!(
            outcome(&lines, cost, settings, u64::MAX, true, Some(&rebuilt)),
            back,
            "{status}"
        );
    }
    let mut grpc = response_head(StatusCode::OK, |_| {});
    grpc.headers
        .insert("content-type", "application/grpc".parse().unwrap());
    grpc.headers.insert("grpc-status", "8".parse().unwrap());
    assert_eq!(
        outcome(&lines, cost, settings, u64::MAX, true, Some(&grpc)),
        back
    );
    let ok = response_head(StatusCode::OK, |_| {});
    assert_eq!(
        outcome(&lines, cost, settings, u64::MAX, true, Some(&ok)),
        Outcome::Served(vec![]),
        "served all the same"
    );
    grpc.headers.insert("grpc-status", "0".parse().unwrap());
    assert_eq!(
        outcome(&lines, cost, settings, u64::MAX, true, Some(&grpc)),
        Outcome::Served(vec![])
    );
}

/// A deferred cost past what the store counts is added to each line as far
/// as its own counter has room: lines that stand at different counts get
/// different adds.
#[test]
fn a_deferred_cost_is_capped_per_line_at_what_the_store_counts() {
    let deferred =
        layer(&[Quota::daily(10), Quota::hourly(10)], |b| b).deferred_cost(2, |response| {
            response.headers["x-tokens"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap()
        });
    let settings = &deferred.bound.policy.settings;
    let charge = charge_of(&deferred, &head(ACME));
    let mut answer = Ok(ChargeOutcome {
        admitted: true,
        usage: smallvec::smallvec![
            usage(10, 2, "2026-12-03T00:00:00Z"),
            usage(10, 7, "2026-12-02T11:00:00Z"),
        ],
    });
    let Decision::Admit(lines) = decide(&charge, &deferred.bound.scope, settings, &mut answer)
    else {
        panic!("admitted");
    };
    let mut response = http::Response::new(());
    response
        .headers_mut()
        .insert("x-tokens", "20".parse().unwrap());
    let (response, ()) = response.into_parts();
    // A store that counts up to 10 exactly: room for 8 more on the day,
    // 3 on the hour.
    assert_eq!(
        outcome(
            &lines,
            &deferred.bound.scope.cost,
            settings,
            10,
            false,
            Some(&response)
        ),
        Outcome::Served(vec![(0, Adjust::Add(8)), (1, Adjust::Add(3))])
    );
}

#[test]
fn a_deferred_cost_charges_or_gives_back_the_difference() {
    let deferred = layer(&[Quota::daily(10)], |b| b).deferred_cost(2, |response| {
        response.headers["x-tokens"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap()
    });
    let settings = &deferred.bound.policy.settings;
    let cost = &deferred.bound.scope.cost;
    let lines = admitted(&deferred, 2);
    let tokens = |n: &'static str| {
        let mut response = http::Response::new(());
        response
            .headers_mut()
            .insert("x-tokens", n.parse().unwrap());
        response.into_parts().0
    };
    assert_eq!(
        outcome(&lines, cost, settings, u64::MAX, false, Some(&tokens("5"))),
        Outcome::Served(vec![(0, Adjust::Add(3))])
    );
    assert_eq!(
        outcome(&lines, cost, settings, u64::MAX, false, Some(&tokens("0"))),
        Outcome::Served(vec![(0, Adjust::Refund(2))])
    );
    assert_eq!(
        outcome(&lines, cost, settings, u64::MAX, false, Some(&tokens("2"))),
        Outcome::Served(vec![])
    );
    // Past what the store counts exactly (2^53 on Redis, which refuses a
    // count beyond it whole): the counter at its most, not the request
    // charged only its upfront cost.
    let most = 1 << 53;
    assert_eq!(
        outcome(
            &lines,
            cost,
            settings,
            most,
            false,
            Some(&tokens("18446744073709551615"))
        ),
        Outcome::Served(vec![(0, Adjust::Add(most - 2))])
    );
    // Past the store's timeout, as the changes will leave the counters
    // (those kept: not a line given back already).
    let added = expected(
        &lines,
        &[(0, Adjust::Add(3)), (0, Adjust::Refund(1))],
        &[true, false],
    );
    assert_eq!(added[0].used, 5);
    assert_eq!(
        expected(&lines, &[(0, Adjust::Refund(2))], &[true])[0].used,
        0
    );
    // The counters after: what the store answered, where it did.
    let settled = settled(&lines, &[(0, Adjust::Add(3))], &[true], &[Some(5)]);
    assert_eq!(settled[0].used, 5);
    let settled = super::settled(&lines, &[(0, Adjust::Add(3))], &[true], &[None]);
    assert_eq!(settled[0].used, 2, "no live counter: as charged");
    // A refund of this layer's that the store failed (claimed before it
    // was sent): as charged, not as refunded.
    assert!(lines[0].claim_give_back().is_some());
    let failed = super::settled(&lines, &[(0, Adjust::Refund(2))], &[true], &[None]);
    assert_eq!(failed[0].used, 2);
    // Given back by the request's handler (this layer's refund then left
    // out): less its cost, whether the store answered or not.
    let undone = super::settled(&lines, &[(0, Adjust::Refund(2))], &[false], &[None]);
    assert_eq!(undone[0].used, 0);
    assert_eq!(
        expected(&lines, &[(0, Adjust::Refund(2))], &[false])[0].used,
        0
    );
}

#[test]
fn a_request_not_served_after_all_gives_back_its_cost_and_its_changes() {
    let deferred = layer(&[Quota::daily(10)], |b| b).deferred_cost(2, |_| 2);
    let now = at("2026-12-02T10:00:00Z");
    // An add of 3 on its way: the cost goes back, and the add once the
    // store says it made it.
    let lines = admitted(&deferred, 2);
    let add = [(0, Adjust::Add(3))];
    assert!(
        lines[0].change_held(|held| held + 3),
        "the add, as the layer records it"
    );
    assert_eq!(unserved(&lines, &add, &[true], now), vec![(0, 2)]);
    assert_eq!(added(&add, &[Some(5)], 0), 3);
    assert_eq!(added(&add, &[None], 0), 0, "an add not made stays out");
    assert!(lines[0].is_given_back(), "claimed: given back once");
    assert_eq!(unserved(&lines, &[], &[], now), vec![], "not twice");
    // A refund of 1 on its way (what the request holds less it): the rest.
    let lines = admitted(&deferred, 2);
    assert!(lines[0].change_held(|held| held - 1));
    assert_eq!(
        unserved(&lines, &[(0, Adjust::Refund(1))], &[true], now),
        vec![(0, 1)]
    );
    // All of it refunded (refused further in): nothing more.
    assert_eq!(
        unserved(&lines, &[(0, Adjust::Refund(2))], &[true], now),
        vec![(0, 0)]
    );
    // A refund left out (another layer gave the line back): nothing.
    let lines = admitted(&deferred, 2);
    assert!(lines[0].claim_give_back().is_some());
    assert_eq!(
        unserved(&lines, &[(0, Adjust::Refund(2))], &[false], now),
        vec![]
    );
}

/// What a request holds on a line grows with a deferred cost's add up to
/// the most a line keeps, never wrapping into a small number past it.
#[test]
fn what_a_line_holds_stops_at_its_most() {
    let deferred = layer(&[Quota::daily(10)], |b| b).deferred_cost(2, |_| 2);
    let lines = admitted(&deferred, 2);
    let most = u64::MAX >> 1;
    assert!(lines[0].change_held(|held| held.saturating_add(most - 1)));
    assert!(lines[0].change_held(|held| held.saturating_add(5)));
    assert_eq!(lines[0].held(), most, "held at its most, not wrapped");
    assert_eq!(lines[0].claim_give_back(), Some(most));
}
