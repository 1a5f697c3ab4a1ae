//! The conformance suite against every store of the crate.

#![cfg(feature = "testing")]

#[cfg(feature = "redis")]
mod redis_support;

use tower_quota::testing::{self, Verdict};
use tower_quota::MemoryStore;

#[tokio::test]
async fn memory_store_conforms() {
    let verdicts = testing::run_all(&MemoryStore::new()).await;
    for (name, verdict) in verdicts {
        if name == "undated_counter_is_healed" {
            // The memory store dates every counter it creates and has no
            // other writer, so it cannot hold an undated counter.
            assert!(
                matches!(verdict, Verdict::NotApplicable(_)),
                "{name}: {verdict:?}"
            );
        } else {
            assert_eq!(verdict, Verdict::Passed, "{name}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store_conforms_with_one_shard() {
    let verdicts = testing::run_all(&MemoryStore::with_shards(1)).await;
    assert_eq!(
        verdicts
            .iter()
            .filter(|(_, v)| *v == Verdict::Passed)
            .count(),
        5
    );
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
            .response_timeout(Duration::from_secs(2))
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
        exactly_the_limit_under_concurrency,
        all_or_nothing_across_quotas,
        undated_counter_is_healed,
        calendar_counters_are_distinct_per_period_and_dated,
    );
}
