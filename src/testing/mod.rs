//! The conformance suite: what every [`Store`] must do, as tests you can run
//! against your own store.
//!
//! Each check drives the store through the [`Store`] trait alone and panics
//! with a sentence naming the broken rule:
//!
//! - [`hits_never_extend_a_first_use_deadline`]: every write path (admitted,
//!   refused and zero-cost charges, refunds) keeps a first-use counter's
//!   deadline, and the period ends when it says.
//! - [`refund_after_expiry_does_not_resurrect`]: a refund never creates a
//!   counter.
//! - [`add_never_creates_nor_moves_a_deadline`]: an add after the fact
//!   ([`Store::add`]) goes past the limit if it must, but never creates a
//!   counter, never brings an expired one back and never moves a deadline.
//! - [`settle_debt_keeps_to_the_debts_period`]: a settled debt
//!   ([`Store::settle_debt`]) goes past the limit of a live counter without
//!   moving its deadline (a calendar one too, never made anew), creates a
//!   missing counter with the debt's own lifetime (and first call, for first
//!   use; the settle's instant, for a calendar window), and writes nothing
//!   for a period that is over.
//! - [`exactly_the_limit_under_concurrency`]: many tasks charging one subject
//!   at once get exactly the limit admitted.
//! - [`extra_units_take_only_the_room_left`]: a charge with extra units
//!   ([`Store::charge_taking`]) is admitted exactly when it fits alone, and
//!   takes no more than asked, never past a limit, all of it counted.
//! - [`all_or_nothing_across_quotas`]: a request refused on one quota is
//!   charged on none.
//! - [`a_refused_charge_writes_nothing`]: a refused request leaves every
//!   counter it names as it was (count, first call, deadline; an undated
//!   counter undated, or healed), and creates none.
//! - [`an_abandoned_charge_spends_nothing`]: a charge whose future is
//!   dropped before it answered ends either not applied, or applied and
//!   given back.
//! - [`undated_counter_is_healed`]: a counter found without a deadline gets
//!   one from the next charge, admitted or refused.
//! - [`calendar_counters_are_distinct_per_period_and_dated`]: each calendar
//!   window has its own counter, and that counter has a deadline.
//! - [`counts_never_pass_the_limit_nor_wrap`]: at the top of `u64`, a charge
//!   that would pass its limit is refused and an add or a settle never
//!   leaves a smaller count: nothing wraps.
//! - [`changes_by_the_reported_first_call_land`]: a refund or an add made
//!   by the first call a charge reported lands on that counter (what the
//!   layer's give-backs go by).
//! - [`changes_made_before_a_counter_do_not_land`]: a refund or an add made
//!   by an instant before the counter was made (a request charged before
//!   a support reset) leaves the counter made since as it is.
//! - [`changes_made_at_a_first_call_land_on_that_counter_only`]: a refund
//!   or an add made at a counter's first call (a leased block given back,
//!   a deferred cost) lands on that counter, not on one made since with an
//!   earlier first call.
//! - [`give_backs_that_empty_a_first_use_counter_close_its_period`]: a first-use
//!   counter given back all it holds at its first call leaves no period
//!   open (a rolling period runs from the first request that spends); a
//!   support refund that empties it, a give-back of more than it holds or
//!   of nothing, and any give-back after a support refund lowered it leave
//!   its period as it was; one after an add (a deferred cost) closes it.
//! - [`each_call_answers_as_documented`]: a charge over its limit or of
//!   nothing creates no counter, `reset` tells whether there was one, a
//!   refund never goes below zero, `add_made_by`, `refund_made_by` and
//!   `refund_made_at` never create a counter, a plain refund marks the
//!   first-use counter it lowers, and a peek ignores costs.
//! - [`changes_to_an_ended_counter_do_not_land`]: a give-back, a refund or
//!   an add by the first call of a counter that ended (at its deadline, or
//!   by a reset) finds no counter, creates none, and leaves the counter
//!   opened at its key since as it is; that counter reports its own first
//!   call.
//! - [`a_first_use_counter_ends_at_its_deadline`]: at a first-use
//!   deadline's very instant the counter is over: no call finds it, no call
//!   brings it back, a settle of a debt whose period ends then writes
//!   nothing, one of the next period's debt opens that period (the ended
//!   counter takes none of it), and a charge opens a new period (for a store whose deadlines
//!   follow the calls).
//! - [`a_late_charge_finds_its_spent_counter`]: a charge stamped in a
//!   calendar window that reaches the store after a call stamped past its
//!   end (an inner layer's, an instance's whose clock is behind) finds the
//!   window's spent counter, never a fresh one.
//! - [`an_abandoned_settle_sent_again_counts_once`]: a settle whose future
//!   is dropped while pending, sent again under its id until it answers,
//!   counts once.
//! - [`clones_share_an_identity_no_other_store_has`]: a store's clones
//!   share its identity, and another store
//!   ([`ConformanceHooks::another_store`]) has another.
//!
//! A store tells the suite what it cannot be driven to do through the trait
//! through [`ConformanceHooks`]: how its deadlines pass ([`Expiry`]), how to
//! plant a counter without a deadline, how to read a stored deadline, and
//! how to make another store of its type.
//! Every hook has a default, so `impl ConformanceHooks for MyStore {}` is
//! enough to start.
//!
//! # Example
//!
//! ```
//! use tower_quota::testing::{self, Verdict};
//! use tower_quota::MemoryStore;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let verdicts = testing::run_all(&MemoryStore::new()).await;
//! assert!(verdicts.iter().any(|(_, v)| *v == Verdict::Passed));
//! # }
//! ```
//!
//! [`Store`]: crate::store::Store
//! [`Store::add`]: crate::store::Store::add
//! [`Store::settle_debt`]: crate::store::Store::settle_debt
//! [`Store::charge_taking`]: crate::store::Store::charge_taking

mod charges;
mod deadlines;
mod hooks;
mod support;

pub use self::charges::{
    a_charge_past_its_period_is_an_error, a_refused_charge_writes_nothing,
    all_or_nothing_across_quotas, an_abandoned_charge_spends_nothing,
    an_abandoned_settle_sent_again_counts_once, clones_share_an_identity_no_other_store_has,
    counts_never_pass_the_limit_nor_wrap, each_call_answers_as_documented,
    exactly_the_limit_under_concurrency, extra_units_take_only_the_room_left,
};
pub use self::deadlines::{
    a_first_use_counter_ends_at_its_deadline, a_late_charge_finds_its_spent_counter,
    add_never_creates_nor_moves_a_deadline, calendar_counters_are_distinct_per_period_and_dated,
    changes_by_the_reported_first_call_land,
    changes_made_at_a_first_call_land_on_that_counter_only,
    changes_made_before_a_counter_do_not_land, changes_to_an_ended_counter_do_not_land,
    give_backs_that_empty_a_first_use_counter_close_its_period,
    hits_never_extend_a_first_use_deadline, refund_after_expiry_does_not_resurrect,
    settle_debt_keeps_to_the_debts_period, undated_counter_is_healed,
};
pub use self::hooks::{ConformanceHooks, Expiry, Planted, StoredDeadline, Verdict};

/// Runs every check, in order, and returns each one's name and verdict.
///
/// # Panics
///
/// When the store breaks a rule, or fails to answer.
pub async fn run_all<S: ConformanceHooks>(store: &S) -> Vec<(&'static str, Verdict)> {
    vec![
        (
            "hits_never_extend_a_first_use_deadline",
            hits_never_extend_a_first_use_deadline(store).await,
        ),
        (
            "refund_after_expiry_does_not_resurrect",
            refund_after_expiry_does_not_resurrect(store).await,
        ),
        (
            "add_never_creates_nor_moves_a_deadline",
            add_never_creates_nor_moves_a_deadline(store).await,
        ),
        (
            "settle_debt_keeps_to_the_debts_period",
            settle_debt_keeps_to_the_debts_period(store).await,
        ),
        (
            "exactly_the_limit_under_concurrency",
            exactly_the_limit_under_concurrency(store).await,
        ),
        (
            "extra_units_take_only_the_room_left",
            extra_units_take_only_the_room_left(store).await,
        ),
        (
            "all_or_nothing_across_quotas",
            all_or_nothing_across_quotas(store).await,
        ),
        (
            "a_refused_charge_writes_nothing",
            a_refused_charge_writes_nothing(store).await,
        ),
        (
            "an_abandoned_charge_spends_nothing",
            an_abandoned_charge_spends_nothing(store).await,
        ),
        (
            "undated_counter_is_healed",
            undated_counter_is_healed(store).await,
        ),
        (
            "calendar_counters_are_distinct_per_period_and_dated",
            calendar_counters_are_distinct_per_period_and_dated(store).await,
        ),
        (
            "counts_never_pass_the_limit_nor_wrap",
            counts_never_pass_the_limit_nor_wrap(store).await,
        ),
        (
            "a_charge_past_its_period_is_an_error",
            a_charge_past_its_period_is_an_error(store).await,
        ),
        (
            "changes_by_the_reported_first_call_land",
            changes_by_the_reported_first_call_land(store).await,
        ),
        (
            "changes_made_before_a_counter_do_not_land",
            changes_made_before_a_counter_do_not_land(store).await,
        ),
        (
            "changes_made_at_a_first_call_land_on_that_counter_only",
            changes_made_at_a_first_call_land_on_that_counter_only(store).await,
        ),
        (
            "give_backs_that_empty_a_first_use_counter_close_its_period",
            give_backs_that_empty_a_first_use_counter_close_its_period(store).await,
        ),
        (
            "each_call_answers_as_documented",
            each_call_answers_as_documented(store).await,
        ),
        (
            "changes_to_an_ended_counter_do_not_land",
            changes_to_an_ended_counter_do_not_land(store).await,
        ),
        (
            "a_first_use_counter_ends_at_its_deadline",
            a_first_use_counter_ends_at_its_deadline(store).await,
        ),
        (
            "a_late_charge_finds_its_spent_counter",
            a_late_charge_finds_its_spent_counter(store).await,
        ),
        (
            "an_abandoned_settle_sent_again_counts_once",
            an_abandoned_settle_sent_again_counts_once(store).await,
        ),
        (
            "clones_share_an_identity_no_other_store_has",
            clones_share_an_identity_no_other_store_has(store).await,
        ),
    ]
}

/// Whether a Redis Cluster connection opened through `seed` reaches every
/// master the cluster names, within `within`: what the Redis store requires
/// of a connection that takes a failed one's place. For the crate's own
/// tests of the Redis store on a cluster.
#[doc(hidden)]
#[cfg(feature = "redis-cluster")]
pub async fn redis_cluster_is_complete(seed: String, within: std::time::Duration) -> bool {
    crate::store::redis::cluster_is_complete(seed, within).await
}
