//! Leased counting when callers' limits differ per request (plans):
//! two to four `LeasedStore`s over one memory store that answers after
//! random delays, sent concurrent single-line charges of several subjects,
//! each request under a limit of its own: a subject always on the free
//! plan, one always on pro, one whose plan is drawn per request, and one
//! downgraded from pro to free mid-period on one instance only; with idle
//! gaps, lease times passing and support resets. Checked:
//!
//! - every request admitted under a limit `L` is served from units the
//!   store charged under a limit of at most `L` (so the count, when they
//!   were charged, left room for them under `L`): an instance never admits
//!   a request under a low limit on units only a higher limit left room
//!   for (the `LeasedStore` docs: units taken under a plan are spent under
//!   that plan or a higher one; a request under a lower plan than the
//!   block's gives the block back first and asks the store);
//! - a subject whose requests all carry one limit: never more admitted on
//!   a counter than the limit, and, once quiet, exactly the limit admitted
//!   when asked for more;
//! - after every instance's shutdown, the store counts on each live
//!   counter exactly what was admitted on it.
//!
//! The runtime's time is paused: a run takes milliseconds.
//! `LEASE_PLANS_SEEDS=n` runs `n` seeds per test.

mod seeded;

use seeded::Rng;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use tower_quota::store::{
    ChargeAnswer, ChargeLine, ChargeOutcome, ChargeRequest, LeasedStore, Lifetime, Store,
    StoreError, Usage,
};
use tower_quota::{MemoryStore, PeriodKey};

const FREE: u64 = 10;
const PRO: u64 = 40;

/// Units each instance holds (as the store charged them), per key: the
/// limit each unit was charged under. What a request admitted from a block
/// spends comes out of it; what goes back to the store, too.
#[derive(Default)]
struct Pools {
    units: HashMap<(usize, String), Vec<u64>>,
}

impl Pools {
    fn add(&mut self, at: usize, key: &str, limit: u64, n: u64) {
        let pool = self.units.entry((at, key.to_owned())).or_default();
        pool.extend(std::iter::repeat_n(limit, n as usize));
    }

    /// Takes `n` units charged under `limit` at most (the highest such
    /// first); false when there are not so many.
    fn spend(&mut self, at: usize, key: &str, limit: u64, n: u64) -> bool {
        let pool = self.units.entry((at, key.to_owned())).or_default();
        for _ in 0..n {
            let best = pool
                .iter()
                .enumerate()
                .filter(|(_, &l)| l <= limit)
                .max_by_key(|(_, &l)| l)
                .map(|(i, _)| i);
            match best {
                Some(i) => {
                    pool.swap_remove(i);
                }
                None => return false,
            }
        }
        true
    }

    /// `n` units given back: the highest charged first (the most lenient
    /// to what stays).
    fn give_back(&mut self, at: usize, key: &str, n: u64) {
        let pool = self.units.entry((at, key.to_owned())).or_default();
        pool.sort_unstable();
        let keep = pool.len().saturating_sub(n as usize);
        pool.truncate(keep);
    }
}

/// A memory store answering after random delays, which records in `pools`
/// the units it charged and took back for its instance.
#[derive(Clone)]
struct Jitter {
    inner: MemoryStore,
    seed: Arc<AtomicU64>,
    max_ms: u64,
    instance: usize,
    pools: Arc<Mutex<Pools>>,
}

impl Jitter {
    fn delay(&self) -> Duration {
        if self.max_ms == 0 {
            return Duration::ZERO;
        }
        let x = self
            .seed
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
        let x = (x ^ (x >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        Duration::from_millis((x >> 20) % self.max_ms)
    }

    async fn used(&self, now: Timestamp, key: &PeriodKey) -> u64 {
        let request = ChargeRequest {
            charged_at: None,
            now,
            lines: smallvec::smallvec![line(key.clone(), now, 1, 0)],
        };
        self.inner.peek(request).await.unwrap()[0].used
    }

    /// A refund of some kind, with what it took off recorded (read in the
    /// same turn of the runtime: the memory store answers at once).
    async fn refunding<F: std::future::Future<Output = Result<Option<u64>, StoreError>>>(
        &self,
        now: Timestamp,
        key: &PeriodKey,
        call: F,
    ) -> Result<Option<u64>, StoreError> {
        tokio::time::sleep(self.delay()).await;
        let before = if key.as_str().contains("%held") {
            0
        } else {
            self.used(now, key).await
        };
        let answer = call.await;
        if !key.as_str().contains("%held") {
            let after = self.used(now, key).await;
            let back = before.saturating_sub(after);
            self.pools
                .lock()
                .unwrap()
                .give_back(self.instance, key.as_str(), back);
        }
        tokio::time::sleep(self.delay()).await;
        answer
    }
}

impl Store for Jitter {
    type ChargeFuture = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<ChargeOutcome, StoreError>> + Send>,
    >;

    fn charge(&self, request: ChargeRequest) -> Self::ChargeFuture {
        let this = self.clone();
        Box::pin(async move {
            tokio::time::sleep(this.delay()).await;
            let answer = this.inner.charge(request.clone()).await;
            if let Ok(outcome) = &answer {
                if outcome.admitted {
                    let mut pools = this.pools.lock().unwrap();
                    for l in &request.lines {
                        if l.cost > 0 && !l.key.as_str().contains("%held") {
                            pools.add(this.instance, l.key.as_str(), l.limit, l.cost);
                        }
                    }
                }
            }
            tokio::time::sleep(this.delay()).await;
            answer
        })
    }
    async fn peek(&self, request: ChargeRequest) -> Result<Vec<Usage>, StoreError> {
        tokio::time::sleep(self.delay()).await;
        let answer = self.inner.peek(request).await;
        tokio::time::sleep(self.delay()).await;
        answer
    }
    async fn refund(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> Result<Option<u64>, StoreError> {
        let call = self.inner.refund(now, key.clone(), amount);
        self.refunding(now, &key, call).await
    }
    async fn refund_made_by(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        made_by: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        let call = self.inner.refund_made_by(now, key.clone(), amount, made_by);
        self.refunding(now, &key, call).await
    }
    async fn refund_made_at(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        first_call: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        let call = self
            .inner
            .refund_made_at(now, key.clone(), amount, first_call);
        self.refunding(now, &key, call).await
    }
    async fn add(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> Result<Option<u64>, StoreError> {
        self.inner.add(now, key, amount).await
    }
    async fn add_made_by(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        made_by: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        self.inner.add_made_by(now, key, amount, made_by).await
    }
    async fn add_made_at(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        first_call: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        self.inner.add_made_at(now, key, amount, first_call).await
    }
    async fn reset(&self, key: PeriodKey) -> Result<bool, StoreError> {
        tokio::time::sleep(self.delay()).await;
        let answer = self.inner.reset(key).await;
        tokio::time::sleep(self.delay()).await;
        answer
    }
    fn identity(&self) -> Option<usize> {
        self.inner.identity()
    }
}

/// A calendar day's line (the run lasts minutes: one period per key, but
/// for resets).
fn line(key: PeriodKey, now: Timestamp, cost: u64, limit: u64) -> ChargeLine {
    let day = 86_400;
    let start = now.as_second().div_euclid(day) * day;
    ChargeLine {
        key,
        limit,
        cost,
        lifetime: Lifetime::Calendar {
            start: Timestamp::from_second(start).unwrap(),
            end: Timestamp::from_second(start + day).unwrap(),
        },
        shadow_limit: None,
    }
}

fn key_of(subject: u64) -> PeriodKey {
    PeriodKey::from_string(format!("quota:{{account:p{subject}}}:cal:day"))
}

/// The subjects: 0 always free, 1 always pro, 2 a plan per request, 3 pro
/// then free on instance 0 only from `downgrade` on.
const SUBJECTS: u64 = 4;

#[derive(Clone, Copy, Debug)]
struct Mix {
    instances: usize,
    jitter: u64,
    resets: bool,
}

type CounterId = (String, Option<Timestamp>);

#[derive(Default)]
struct Model {
    admitted: HashMap<CounterId, u64>,
    /// Admissions in the order they were answered, per subject: the limit
    /// each was under, and the count served then (for the report).
    served: Vec<String>,
    broken: Vec<String>,
    requests: u64,
    admissions: u64,
    /// Admissions past their limit in answer order (what the docs allow:
    /// units taken under that limit, spent while others served more).
    past_in_order: u64,
}

async fn run(seed: u64, steps: usize, mix: Mix) -> (Vec<String>, u64, u64, u64) {
    let memory = MemoryStore::new();
    let t0: Timestamp = "2026-12-04T10:00:03Z".parse().unwrap();
    let start = tokio::time::Instant::now();
    let pools = Arc::new(Mutex::new(Pools::default()));
    let stores: Vec<LeasedStore<Jitter>> = (0..mix.instances)
        .map(|instance| {
            LeasedStore::new(Jitter {
                inner: memory.clone(),
                seed: Arc::new(AtomicU64::new(seed ^ ((instance as u64) << 40))),
                max_ms: mix.jitter,
                instance,
                pools: Arc::clone(&pools),
            })
        })
        .collect();
    let model = Arc::new(Mutex::new(Model::default()));
    // Served per counter in the order admissions are answered.
    let in_order: Arc<Mutex<HashMap<CounterId, u64>>> = Arc::default();
    let mut rng = Rng(seed);
    let now_of = move || t0 + SignedDuration::try_from(start.elapsed()).unwrap();
    let downgrade = steps as u64 / 3 + rng.below(steps as u64 / 3);
    let mut tasks = tokio::task::JoinSet::new();
    for step in 0..steps {
        let now = now_of() + SignedDuration::from_nanos(step as i64 + 1);
        let roll = rng.below(100);
        if roll < 70 {
            let at = rng.below(mix.instances as u64) as usize;
            let subject = rng.below(SUBJECTS);
            let limit = match subject {
                0 => FREE,
                1 => PRO,
                2 => *rng.pick(&[FREE, PRO]),
                _ if at == 0 && step as u64 >= downgrade => FREE,
                _ => PRO,
            };
            let cost = if mix.resets { 1 } else { 1 + rng.below(3) / 2 };
            let key = key_of(subject);
            let request = ChargeRequest {
                charged_at: None,
                now,
                lines: smallvec::smallvec![line(key.clone(), now, cost, limit)],
            };
            let store = stores[at].clone();
            let model = Arc::clone(&model);
            let pools = Arc::clone(&pools);
            let in_order = Arc::clone(&in_order);
            tasks.spawn(async move {
                let answer = match store.charge_at_once(&request) {
                    ChargeAnswer::Now(answer) => answer,
                    ChargeAnswer::Later(future) => future.await,
                };
                let mut model = model.lock().unwrap();
                model.requests += 1;
                let outcome = match answer {
                    Ok(outcome) => outcome,
                    Err(error) => return model.broken.push(format!("error: {error}")),
                };
                if !outcome.admitted {
                    return;
                }
                model.admissions += 1;
                let usage = outcome.usage[0];
                let id = (key.as_str().to_owned(), usage.first_call);
                if !pools
                    .lock()
                    .unwrap()
                    .spend(at, key.as_str(), limit, cost)
                {
                    let held = pools.lock().unwrap().units[&(at, key.as_str().to_owned())].clone();
                    model.broken.push(format!(
                        "subject {subject} at {now} on instance {at}: admitted {cost} under {limit} \
                         (usage {usage:?}) with no units charged under {limit} or less there \
                         (held: {held:?})"
                    ));
                }
                *model.admitted.entry(id.clone()).or_default() += cost;
                let mut in_order = in_order.lock().unwrap();
                let served = in_order.entry(id).or_default();
                *served += cost;
                if *served > limit {
                    model.past_in_order += 1;
                }
                let s = *served;
                model
                    .served
                    .push(format!("s{subject} on {at} under {limit}: served {s}"));
            });
        } else if roll < 73 && mix.resets {
            let store = stores[rng.below(mix.instances as u64) as usize].clone();
            let key = key_of(rng.below(SUBJECTS));
            let in_order = Arc::clone(&in_order);
            tasks.spawn(async move {
                let _ = store.reset(key).await;
                let _ = in_order;
            });
        } else {
            let ms = match rng.below(20) {
                0 => 1_500 + rng.below(1_000),
                1 => 11_000,
                _ => rng.below(40),
            };
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
    }
    while tasks.join_next().await.is_some() {}
    // Quiet: idle blocks go back.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut broken = model.lock().unwrap().broken.clone();
    // Single-plan subjects: never more than the limit on a counter.
    {
        let model = model.lock().unwrap();
        for (id, &n) in &model.admitted {
            let limit = if id.0.contains("p0") {
                FREE
            } else if id.0.contains("p1") {
                PRO
            } else {
                continue;
            };
            if n > limit {
                broken.push(format!("{id:?}: admitted {n}, over the limit {limit}"));
            }
        }
    }
    // Then asked for more than the limit, one instance after the other:
    // exactly the limit admitted on the live counter.
    for (subject, limit) in [(0, FREE), (1, PRO)] {
        let key = key_of(subject);
        for (at, store) in stores.iter().enumerate() {
            for _ in 0..=limit {
                let now = now_of();
                let request = ChargeRequest {
                    charged_at: None,
                    now,
                    lines: smallvec::smallvec![line(key.clone(), now, 1, limit)],
                };
                let outcome = store.charge(request).await.unwrap();
                if !outcome.admitted {
                    break;
                }
                let id = (key.as_str().to_owned(), outcome.usage[0].first_call);
                let mut pools = pools.lock().unwrap();
                if !pools.spend(at, key.as_str(), limit, 1) {
                    broken.push(format!("sweep {subject}: admitted on {at} with no units"));
                }
                *model.lock().unwrap().admitted.entry(id).or_default() += 1;
            }
        }
        let now = now_of();
        let request = ChargeRequest {
            charged_at: None,
            now,
            lines: smallvec::smallvec![line(key.clone(), now, 0, limit)],
        };
        let usage = memory.peek(request).await.unwrap()[0];
        let id = (key.as_str().to_owned(), usage.first_call);
        let admitted = model
            .lock()
            .unwrap()
            .admitted
            .get(&id)
            .copied()
            .unwrap_or(0);
        if admitted != limit {
            broken.push(format!(
                "subject {subject}: {admitted} admitted on the live counter asked for more \
                 than its limit {limit}"
            ));
        }
    }
    for store in &stores {
        store.shutdown().await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    for (i, store) in stores.iter().enumerate() {
        if store.held() != 0 {
            broken.push(format!("instance {i} still holds {}", store.held()));
        }
    }
    // After the shutdowns: the store counts what was admitted.
    for subject in 0..SUBJECTS {
        let key = key_of(subject);
        let now = now_of();
        let request = ChargeRequest {
            charged_at: None,
            now,
            lines: smallvec::smallvec![line(key.clone(), now, 0, 0)],
        };
        let usage = memory.peek(request).await.unwrap()[0];
        if usage.first_call.is_none() {
            continue;
        }
        let id = (key.as_str().to_owned(), usage.first_call);
        let admitted = model
            .lock()
            .unwrap()
            .admitted
            .get(&id)
            .copied()
            .unwrap_or(0);
        if usage.used != admitted {
            broken.push(format!(
                "{id:?}: the store counts {} after the shutdowns, where {admitted} were admitted",
                usage.used
            ));
        }
    }
    let model = model.lock().unwrap();
    if !broken.is_empty() && std::env::var("LEASE_PLANS_TRACE").is_ok() {
        for s in &model.served {
            eprintln!("{s}");
        }
    }
    (
        broken,
        model.requests,
        model.admissions,
        model.past_in_order,
    )
}

fn runs(seeds: std::ops::Range<u64>, mix: Mix) {
    let seeds = match std::env::var("LEASE_PLANS_SEEDS") {
        Ok(n) => seeds.start..seeds.start + n.parse::<u64>().expect("a number of seeds"),
        Err(_) => seeds,
    };
    let only = std::env::var("LEASE_PLANS_ONLY")
        .ok()
        .map(|s| s.parse::<u64>().unwrap());
    let mut broke = Vec::new();
    let (mut requests, mut admissions, mut past, mut ran) = (0, 0, 0, 0);
    for seed in seeds {
        if only.is_some_and(|o| o != seed) {
            continue;
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap();
        let (broken, r, a, p) = runtime.block_on(run(seed, 400, mix));
        ran += 1;
        requests += r;
        admissions += a;
        past += p;
        if !broken.is_empty() {
            broke.push((seed, broken));
        }
    }
    eprintln!(
        "{mix:?}: {ran} runs, {requests} requests, {admissions} admitted, {past} past their \
         limit in answer order (from units taken under it)"
    );
    if !broke.is_empty() {
        eprintln!(
            "{mix:?}: seeds broken: {:?}",
            broke.iter().map(|b| b.0).collect::<Vec<_>>()
        );
    }
    broke.truncate(3);
    assert!(broke.is_empty(), "{mix:?}: {broke:#?}");
}

#[test]
fn plans_answered_at_once() {
    runs(
        0..40,
        Mix {
            instances: 2,
            jitter: 0,
            resets: false,
        },
    );
}

#[test]
fn plans_answered_late() {
    runs(
        0..40,
        Mix {
            instances: 3,
            jitter: 30,
            resets: false,
        },
    );
}

#[test]
fn plans_across_resets() {
    runs(
        0..40,
        Mix {
            instances: 4,
            jitter: 30,
            resets: true,
        },
    );
}

/// A caller on the pro plan, downgraded to free on one instance (A)
/// mid-period: A holds a block taken under the free limit when the count
/// passes it (other instances served the caller on pro meanwhile). The
/// docs allow A to spend that block under free ("at most one block"); the
/// layer's give-backs of A's earlier pro requests go into that block too,
/// and must not be spent under free: those units were charged under pro,
/// and the free limit left them no room (without leases, every free
/// request here is refused once the count passed 100).
#[tokio::test(start_paused = true)]
async fn a_give_back_of_a_higher_plans_request_is_not_spent_under_a_lower_plan() {
    const FREE: u64 = 100;
    const PRO: u64 = 400;
    let shared = MemoryStore::new();
    let a = LeasedStore::new(shared.clone());
    let b = LeasedStore::new(shared.clone());
    let key = key_of(9);
    let mut now: Timestamp = "2026-12-04T10:00:00Z".parse().unwrap();
    let request = |now: Timestamp, limit: u64| ChargeRequest {
        charged_at: None,
        now,
        lines: smallvec::smallvec![line(key.clone(), now, 1, limit)],
    };
    async fn pass(now: &mut Timestamp, ms: u64) {
        tokio::time::advance(Duration::from_millis(ms)).await;
        *now += SignedDuration::from_millis(ms as i64);
    }
    // A serves five pro requests, once in a while (each charged alone).
    let mut pro = Vec::new();
    for _ in 0..5 {
        let outcome = a.charge(request(now, PRO)).await.unwrap();
        assert!(outcome.admitted);
        pro.push(outcome.usage[0]);
        pass(&mut now, 1_500).await;
    }
    let mut served = 5;
    // Downgraded on A: free requests, busy, take a block under free.
    for _ in 0..3 {
        assert!(a.charge(request(now, FREE)).await.unwrap().admitted);
        served += 1;
        pass(&mut now, 1).await;
    }
    assert!(a.held() > 0, "A holds a block taken under the free limit");
    // B serves the caller on pro, past the free limit.
    while served <= FREE + 20 {
        assert!(b.charge(request(now, PRO)).await.unwrap().admitted);
        served += 1;
        pass(&mut now, 1).await;
    }
    let held = a.held();
    // On A, free requests; the pro requests A served earlier fail, and the
    // layer gives them back (to the counter they were charged on).
    let mut free_admitted = 0;
    let mut given_back = 0;
    for _ in 0..30 {
        if a.charge(request(now, FREE)).await.unwrap().admitted {
            free_admitted += 1;
        }
        if let Some(usage) = pro.pop() {
            let first = usage.first_call.unwrap();
            a.refund_made_at(now, key.clone(), 1, first).await.unwrap();
            given_back += 1;
        }
        pass(&mut now, 1).await;
    }
    assert!(
        free_admitted <= held,
        "A admitted {free_admitted} free requests after the count passed the free limit \
         ({served} served), holding {held} units taken under it ({given_back} pro requests \
         given back on A meanwhile)"
    );
}
