//! Metrics, through the [`metrics`](https://docs.rs/metrics/0.24) facade
//! (the `metrics` feature).
//!
//! The layer records into whatever recorder the application installed
//! (`metrics-exporter-prometheus`, a StatsD or OpenTelemetry bridge, ...);
//! with none installed, the calls cost next to nothing. Without the
//! feature, nothing is compiled in.
//!
//! | name | type | labels |
//! |---|---|---|
//! | [`tower_quota_decisions_total`](DECISIONS) | counter | `outcome`, `allowance` |
//! | [`tower_quota_charge_duration_seconds`](CHARGE_DURATION) | histogram | `store` |
//! | [`tower_quota_counters_healed_total`](COUNTERS_HEALED) | counter | none |
//! | [`tower_quota_abandoned_charges_refunded_total`](ABANDONED_CHARGES_REFUNDED) | counter | none |
//! | [`tower_quota_changes_lost_total`](CHANGES_LOST) | counter | `change` |
//! | [`tower_quota_lease_blocks_total`](LEASE_BLOCKS) | counter | none |
//! | [`tower_quota_lease_units_returned_total`](LEASE_UNITS_RETURNED) | counter | none |
//! | [`tower_quota_lease_local_charges_total`](LEASE_LOCAL_CHARGES) | counter | none |
//! | [`tower_quota_ledger_owed_total`](LEDGER_OWED) | counter | none |
//! | [`tower_quota_ledger_settled_total`](LEDGER_SETTLED) | counter | none |
//! | [`tower_quota_ledger_dropped_total`](LEDGER_DROPPED) | counter | `reason` |
//! | [`tower_quota_ledger_counters`](LEDGER_COUNTERS) | gauge | none |
//!
//! No label ever carries a subject id, a key or anything else per caller:
//! the label values are the few listed here and the allowance tags of the
//! application's quotas.
//!
//! # `tower_quota_decisions_total`
//!
//! What the layer did with a request, by `outcome`:
//!
//! - [`admitted`](outcome::ADMITTED): charged on every quota, passed on;
//! - [`refused`](outcome::REFUSED): some quota had no room (the 429, or the
//!   gRPC `RESOURCE_EXHAUSTED`); nothing was charged. Labelled with the
//!   allowances of the quotas without room (of every enforced quota of
//!   the layer when the store's answer shows none full): a quota beside
//!   them that had room, or a shadow quota, refused nothing (see
//!   `shadow_refused`);
//! - [`store_error`](outcome::STORE_ERROR): the store failed or did not
//!   answer within `store_timeout`; the request passed, its charge owed to
//!   the policy's ledger (fail open), or got the 503 (fail closed), whichever
//!   the policy says. A layer inside one that failed open owes its own
//!   charge without asking the store, and counts it here too;
//! - [`skipped`](outcome::SKIPPED): let through uncounted, by a `skip_if`
//!   rule or by [`SubjectPolicy::Allow`](crate::SubjectPolicy::Allow) for a
//!   request without a usable subject; counted once, by the policy's
//!   outermost layer the request passes, for that layer's allowances (the
//!   layers further in pass it without a decision of their own);
//! - [`shadow_refused`](outcome::SHADOW_REFUSED): a quota in shadow mode
//!   ([`Quota::shadow`](crate::Quota::shadow)) that would have refused the
//!   request, which passed (labelled with that quota's allowance, beside
//!   the request's own `admitted`); also a shadow quota whose counter holds
//!   the most its store counts, which the request passes uncounted (the
//!   charge goes again without it, counted on its own: no `admitted` when
//!   the layer has no other quota).
//!
//! Each decision a layer takes on the store's answer counts once: a request
//! is decided once by each layer that charges quotas of its own, so a
//! search through a `read` layer and a `search` burst layer inside it is
//! counted by both (`admitted` on `read`, then `admitted` or `refused` on
//! `search`), and a `read` charge given back because the burst layer
//! refused shows in [`ABANDONED_CHARGES_REFUNDED`]. Requests answered
//! before any charge (no subject, a malformed subject, an unknown plan, an
//! invalid cost or zone), or let through by a layer of shadow quotas that
//! could not charge them, are not counted here: they never reached the
//! quotas.
//!
//! `allowance` is the allowance tag of the quotas charged. A request
//! charged on quotas of several allowances (a `read` layer with a `search`
//! burst layer inside it) is counted once per allowance, each allowance
//! once however many of its quotas applied. Each allowance is a budget of
//! its own, and this way the rate of `refused` per allowance is right
//! whatever the nesting: labelling the first allowance alone would hide the
//! inner layers' budgets (the `search` burst limit would never show). The
//! price: summing over allowances counts such a request several times; to
//! count requests, select one allowance that every route charges.
//!
//! # `tower_quota_charge_duration_seconds`
//!
//! From sending a charge to the store's answer, by `store`: `memory`
//! ([`MemoryStore`](crate::MemoryStore)), `redis` (`RedisStore`) or `other`
//! (any other type, wrappers of those two included). One observation per
//! charge, so one per layer that charges a request (two when the charge
//! goes again without a shadow quota whose counter is full). A charge cut short by
//! `store_timeout` is recorded at the time waited; one whose request was
//! dropped while it waited (a client gone, a timeout further out) is not
//! recorded: its wait was cut short by something else than the store. A Prometheus exporter
//! renders a histogram as a summary unless it is given buckets for it
//! (`metrics-exporter-prometheus`: `set_buckets_for_metric`, as the demo
//! server does); with buckets, instances aggregate.
//!
//! # `tower_quota_counters_healed_total`
//!
//! Counters the Redis store found without a deadline and dated again while
//! charging (each is also logged as a warning). Should stay at zero: any
//! increase means another writer on the quota keys, or a counter written by
//! hand.
//!
//! # `tower_quota_abandoned_charges_refunded_total`
//!
//! Charges given back after the store had made them, one per counter line
//! that the store refunded: a server error with `refund_server_errors`, an
//! unrouted answer (404, 405), the charge of a layer given back when a
//! layer further in refuses the request or the request is dropped before
//! a layer further in was answered, and the part of an up-front cost that a
//! deferred cost did not use. Refunds through [`QuotaHandle`](crate::QuotaHandle) are support
//! actions and are not counted.
//!
//! # `tower_quota_changes_lost_total`
//!
//! Units of the changes a response makes after it was charged that the
//! store never applied, by `change`: [`refund`](change::REFUND), a charge
//! to give back (a request not served, a server error with
//! `refund_server_errors`, the unused part of an up-front cost) that stays
//! charged; [`add`](change::ADD), a deferred cost beyond the up-front one
//! that goes uncounted. Each was sent again while the store answered that
//! it never sent it, within its counter's period; lost are those the store
//! failed otherwise, those still unsent at the period's end, and those past
//! the 10 000 that wait to be sent again at once. Should stay at zero
//! while the store is healthy.
//!
//! # Leases
//!
//! A [`LeasedStore`](crate::store::LeasedStore) counts the blocks it took
//! ([`tower_quota_lease_blocks_total`](LEASE_BLOCKS)), the unused units it
//! gave back ([`tower_quota_lease_units_returned_total`](LEASE_UNITS_RETURNED))
//! and the charges it answered from a block without asking its store
//! ([`tower_quota_lease_local_charges_total`](LEASE_LOCAL_CHARGES)): the
//! share of requests that took no round trip is local charges over all
//! charges.
//!
//! # The ledger
//!
//! A request that passes on a failed charge under
//! [`OnStoreError::FailOpen`](crate::OnStoreError::FailOpen) owes its
//! charge; the policy's ledger keeps what is owed per counter and adds it to
//! the store once the store answers (see
//! [`QuotaPolicyBuilder::max_owed_counters`](crate::QuotaPolicyBuilder::max_owed_counters)).
//! In units (what the requests cost, added up):
//!
//! - [`tower_quota_ledger_owed_total`](LEDGER_OWED): units the ledger took
//!   on;
//! - [`tower_quota_ledger_settled_total`](LEDGER_SETTLED): units added to
//!   the store;
//! - [`tower_quota_ledger_dropped_total`](LEDGER_DROPPED): units that will
//!   never be counted, by `reason`: [`full`](dropped::FULL), owed to a new
//!   counter while the ledger held its bound (never taken on, so not in
//!   `owed`); [`ended`](dropped::ENDED), owed to a period (a calendar
//!   window, a first-use period) that was over before the store answered;
//!   [`refused`](dropped::REFUSED), a debt the store cannot take (its key
//!   holds no counter, or the sum is beyond what it counts exactly);
//!   [`abandoned`](dropped::ABANDONED), still owed when the policy was
//!   dropped (its ledger goes with it); [`reset`](dropped::RESET), owed to
//!   a counter support reset before the store took it.
//!
//! Once everything is settled, `owed = settled + dropped{reason!="full"}`.
//! [`tower_quota_ledger_counters`](LEDGER_COUNTERS) is how many counters the
//! ledgers owe now (summed over policies): above zero while the store is
//! away, back to zero once it answers (or once the policies that owe are
//! dropped).
//!
//! # Descriptions
//!
//! [`describe`] registers a description and unit for each metric with the
//! recorder installed at the time (for `# HELP` lines in Prometheus); call
//! it once after installing the recorder.

/// Counter: what the layer did with a request. Labels `outcome` (one of
/// [`outcome`]'s values) and `allowance`.
pub const DECISIONS: &str = "tower_quota_decisions_total";

/// Histogram, in seconds: from sending a charge to the store's answer.
/// Label `store`: [`store::MEMORY`], [`store::REDIS`] or [`store::OTHER`].
pub const CHARGE_DURATION: &str = "tower_quota_charge_duration_seconds";

/// Counter: counters without a deadline that the Redis store dated again.
pub const COUNTERS_HEALED: &str = "tower_quota_counters_healed_total";

/// Counter: charges given back after the store had made them.
pub const ABANDONED_CHARGES_REFUNDED: &str = "tower_quota_abandoned_charges_refunded_total";

/// Counter: units of refunds and adds after a response that the store
/// never applied, by `change` (see [`change`]).
pub const CHANGES_LOST: &str = "tower_quota_changes_lost_total";

/// The values of the `change` label of [`CHANGES_LOST`].
pub mod change {
    /// A charge to give back, which stays charged.
    pub const REFUND: &str = "refund";
    /// A deferred cost to add, which goes uncounted.
    pub const ADD: &str = "add";
}

/// Counter: blocks of allowance a [`LeasedStore`](crate::store::LeasedStore)
/// took from its store (one given straight back as it lands included: the
/// store shut down, or the counter was reset here, while it was on its way).
pub const LEASE_BLOCKS: &str = "tower_quota_lease_blocks_total";

/// Counter: unused leased units given back to the store.
pub const LEASE_UNITS_RETURNED: &str = "tower_quota_lease_units_returned_total";

/// Counter: charges a [`LeasedStore`](crate::store::LeasedStore) answered
/// from a block, without asking its store.
pub const LEASE_LOCAL_CHARGES: &str = "tower_quota_lease_local_charges_total";

/// Counter: units a policy's ledger took on, owed by requests that passed
/// on a failed charge (fail open).
pub const LEDGER_OWED: &str = "tower_quota_ledger_owed_total";

/// Counter: units a policy's ledger added to the store.
pub const LEDGER_SETTLED: &str = "tower_quota_ledger_settled_total";

/// Counter: units owed that will never be counted. Label `reason`: one of
/// [`dropped`]'s values.
pub const LEDGER_DROPPED: &str = "tower_quota_ledger_dropped_total";

/// Gauge: counters the policies' ledgers owe now.
pub const LEDGER_COUNTERS: &str = "tower_quota_ledger_counters";

/// The values of the `reason` label of [`LEDGER_DROPPED`].
pub mod dropped {
    /// Owed to a new counter while the ledger held its bound of counters.
    pub const FULL: &str = "full";
    /// Owed to a period that was over before the store answered again.
    pub const ENDED: &str = "ended";
    /// A debt the store cannot take.
    pub const REFUSED: &str = "refused";
    /// Still owed when the policy was dropped.
    pub const ABANDONED: &str = "abandoned";
    /// Owed to a counter that support reset
    /// ([`QuotaHandle::reset`](crate::QuotaHandle::reset) and the like)
    /// before the store took it: the caller starts afresh.
    pub const RESET: &str = "reset";
}

/// The values of the `outcome` label of [`DECISIONS`].
pub mod outcome {
    /// Charged on every quota and passed on.
    pub const ADMITTED: &str = "admitted";
    /// Some quota had no room; nothing was charged.
    pub const REFUSED: &str = "refused";
    /// The store failed or timed out (fail open or fail closed).
    pub const STORE_ERROR: &str = "store_error";
    /// Let through uncounted: `skip_if`, or `SubjectPolicy::Allow`.
    pub const SKIPPED: &str = "skipped";
    /// A shadow quota that would have refused the request (reported, not
    /// enforced).
    pub const SHADOW_REFUSED: &str = "shadow_refused";
}

/// The values of the `store` label of [`CHARGE_DURATION`].
pub mod store {
    /// [`MemoryStore`](crate::MemoryStore).
    pub const MEMORY: &str = "memory";
    /// `RedisStore` (the `redis` feature).
    pub const REDIS: &str = "redis";
    /// Any other store, wrappers of the two above included.
    pub const OTHER: &str = "other";
}

pub use self::imp::describe;
// `healed` is for the Redis store alone.
#[cfg_attr(not(feature = "redis"), allow(unused_imports))]
pub(crate) use self::imp::{
    change_lost, decisions, healed, lease_block, lease_local, lease_returned, ledger_counters,
    ledger_dropped, ledger_owed, ledger_settled, refunded, ChargeTimer,
};

#[cfg(feature = "metrics")]
mod imp {
    use std::sync::Arc;
    use std::time::Instant;

    use metrics::{
        counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Unit,
    };

    use super::{ABANDONED_CHARGES_REFUNDED, CHARGE_DURATION};
    use super::{CHANGES_LOST, COUNTERS_HEALED, DECISIONS};
    use super::{LEASE_BLOCKS, LEASE_LOCAL_CHARGES, LEASE_UNITS_RETURNED};
    use super::{LEDGER_COUNTERS, LEDGER_DROPPED, LEDGER_OWED, LEDGER_SETTLED};

    /// Registers the description and unit of each metric with the recorder
    /// installed now.
    pub fn describe() {
        describe_counter!(
            DECISIONS,
            Unit::Count,
            "What the quota layer did with a request, by outcome and allowance"
        );
        describe_histogram!(
            CHARGE_DURATION,
            Unit::Seconds,
            "Time from sending a charge to the quota store's answer"
        );
        describe_counter!(
            COUNTERS_HEALED,
            Unit::Count,
            "Quota counters found without a deadline and dated again"
        );
        describe_counter!(
            ABANDONED_CHARGES_REFUNDED,
            Unit::Count,
            "Quota charges given back after the store had made them"
        );
        describe_counter!(
            CHANGES_LOST,
            Unit::Count,
            "Units of quota refunds and adds after a response that the store never applied"
        );
        describe_counter!(
            LEASE_BLOCKS,
            Unit::Count,
            "Blocks of allowance a leased quota store took from its store"
        );
        describe_counter!(
            LEASE_UNITS_RETURNED,
            Unit::Count,
            "Unused leased units given back to the quota store"
        );
        describe_counter!(
            LEASE_LOCAL_CHARGES,
            Unit::Count,
            "Charges a leased quota store answered from a block, without its store"
        );
        describe_counter!(
            LEDGER_OWED,
            Unit::Count,
            "Units owed by requests that passed on a failed quota charge (fail open)"
        );
        describe_counter!(
            LEDGER_SETTLED,
            Unit::Count,
            "Units owed by requests that passed on a failed quota charge, added to the store"
        );
        describe_counter!(
            LEDGER_DROPPED,
            Unit::Count,
            "Units owed by requests that passed on a failed quota charge that will never be counted, by reason"
        );
        describe_gauge!(
            LEDGER_COUNTERS,
            Unit::Count,
            "Quota counters owed units by requests that passed on a failed charge"
        );
    }

    /// Units a ledger took on.
    pub(crate) fn ledger_owed(units: u64) {
        counter!(LEDGER_OWED).increment(units);
    }

    /// Units a ledger added to the store.
    pub(crate) fn ledger_settled(units: u64) {
        counter!(LEDGER_SETTLED).increment(units);
    }

    /// Units owed that will never be counted, for `reason` (a value of
    /// [`dropped`](super::dropped)).
    pub(crate) fn ledger_dropped(reason: &'static str, units: u64) {
        counter!(LEDGER_DROPPED, "reason" => reason).increment(units);
    }

    /// A ledger owes `change` more (or fewer) counters.
    pub(crate) fn ledger_counters(change: i64) {
        let gauge = gauge!(LEDGER_COUNTERS);
        if change >= 0 {
            gauge.increment(change as f64);
        } else {
            gauge.decrement(change.unsigned_abs() as f64);
        }
    }

    /// One increment of `outcome` per allowance among `allowances` (each
    /// tag once).
    pub(crate) fn decisions<'a>(
        outcome: &'static str,
        allowances: impl Iterator<Item = &'a Arc<str>> + Clone,
    ) {
        for (i, tag) in allowances.clone().enumerate() {
            if allowances.clone().take(i).any(|seen| seen == tag) {
                continue;
            }
            counter!(DECISIONS, "outcome" => outcome, "allowance" => tag.clone()).increment(1);
        }
    }

    /// A counter without a deadline, dated again by a charge.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn healed() {
        counter!(COUNTERS_HEALED).increment(1);
    }

    /// A charge given back after the store had made it: a layer's refund of
    /// a request that was not served (see [`ABANDONED_CHARGES_REFUNDED`]).
    pub(crate) fn refunded() {
        counter!(ABANDONED_CHARGES_REFUNDED).increment(1);
    }

    /// `units` of a refund or an add (`change`, a value of
    /// [`change`](super::change)) that the store never applied.
    pub(crate) fn change_lost(change: &'static str, units: u64) {
        counter!(CHANGES_LOST, "change" => change).increment(units);
    }

    /// A block taken by a leased store.
    pub(crate) fn lease_block() {
        counter!(LEASE_BLOCKS).increment(1);
    }

    /// Unused leased units given back.
    pub(crate) fn lease_returned(units: u64) {
        counter!(LEASE_UNITS_RETURNED).increment(units);
    }

    /// A charge answered from a block.
    pub(crate) fn lease_local() {
        counter!(LEASE_LOCAL_CHARGES).increment(1);
    }

    /// Times one charge, from sending it to the store's answer.
    pub(crate) struct ChargeTimer(Instant);

    impl ChargeTimer {
        pub(crate) fn start() -> Self {
            Self(Instant::now())
        }

        /// Records the time since `start` for the store labelled `store`
        /// (a value of [`store`](super::store)).
        pub(crate) fn stop(&self, store: &'static str) {
            histogram!(CHARGE_DURATION, "store" => store).record(self.0.elapsed());
        }
    }
}

/// Without the feature: nothing recorded, nothing kept.
#[cfg(not(feature = "metrics"))]
mod imp {
    use std::sync::Arc;

    pub fn describe() {}

    #[inline(always)]
    pub(crate) fn decisions<'a>(_: &'static str, _: impl Iterator<Item = &'a Arc<str>> + Clone) {}

    #[inline(always)]
    pub(crate) fn healed() {}

    #[inline(always)]
    pub(crate) fn refunded() {}

    #[inline(always)]
    pub(crate) fn lease_block() {}

    #[inline(always)]
    pub(crate) fn change_lost(_: &'static str, _: u64) {}

    #[inline(always)]
    pub(crate) fn lease_returned(_: u64) {}

    #[inline(always)]
    pub(crate) fn lease_local() {}

    #[inline(always)]
    pub(crate) fn ledger_owed(_: u64) {}

    #[inline(always)]
    pub(crate) fn ledger_settled(_: u64) {}

    #[inline(always)]
    pub(crate) fn ledger_dropped(_: &'static str, _: u64) {}

    #[inline(always)]
    pub(crate) fn ledger_counters(_: i64) {}

    pub(crate) struct ChargeTimer;

    impl ChargeTimer {
        #[inline(always)]
        pub(crate) fn start() -> Self {
            Self
        }

        #[inline(always)]
        pub(crate) fn stop(&self, _: &'static str) {}
    }
}
