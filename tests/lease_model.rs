//! Leased counting under random interleavings: two `LeasedStore`s over
//! one memory store that answers after random delays, sent random
//! charges (first-use and calendar lines, one or two per request, costs of
//! 0 to 2, plans of half the limit), refunds, deferred adds and support
//! resets, with pauses that let blocks go idle or outlive their lease.
//! After each run, once everything went quiet: no more admitted on any
//! counter than its limit (without resets), no block held, and what the
//! store counts on each live counter equals what was admitted, less what
//! was given back, plus what was added. The runtime's time is paused: a
//! run is the same on every machine, and takes milliseconds.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use smallvec::SmallVec;
use tower_quota::store::{
    ChargeAnswer, ChargeLine, ChargeOutcome, ChargeRequest, LeasedStore, Lifetime, Store,
    StoreError, Usage,
};
use tower_quota::{MemoryStore, PeriodKey};

/// A memory store that answers each call after random delays (before and
/// after it is made), up to `max_ms` milliseconds of the runtime's time.
#[derive(Clone)]
struct Jitter {
    inner: MemoryStore,
    seed: Arc<AtomicU64>,
    max_ms: u64,
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

    async fn late<T>(&self, call: impl std::future::Future<Output = T>) -> T {
        let (before, after) = (self.delay(), self.delay());
        tokio::time::sleep(before).await;
        let answer = call.await;
        tokio::time::sleep(after).await;
        answer
    }
}

impl Store for Jitter {
    type ChargeFuture = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<ChargeOutcome, StoreError>> + Send>,
    >;

    fn charge(&self, request: ChargeRequest) -> Self::ChargeFuture {
        let this = self.clone();
        Box::pin(async move { this.late(this.inner.charge(request)).await })
    }
    async fn peek(&self, request: ChargeRequest) -> Result<Vec<Usage>, StoreError> {
        self.late(self.inner.peek(request)).await
    }
    async fn refund(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> Result<Option<u64>, StoreError> {
        self.late(self.inner.refund(now, key, amount)).await
    }
    async fn refund_made_by(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        made_by: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        self.late(self.inner.refund_made_by(now, key, amount, made_by))
            .await
    }
    async fn add(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> Result<Option<u64>, StoreError> {
        self.late(self.inner.add(now, key, amount)).await
    }
    async fn add_made_by(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        made_by: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        self.late(self.inner.add_made_by(now, key, amount, made_by))
            .await
    }
    async fn reset(&self, key: PeriodKey) -> Result<bool, StoreError> {
        self.late(self.inner.reset(key)).await
    }
    fn identity(&self) -> Option<usize> {
        self.inner.identity()
    }
}

/// splitmix64: the run's choices, from its seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) % n
    }
}

const FIRST_USE_LIMIT: u64 = 20;
const FIRST_USE_SECONDS: i64 = 30;
const CALENDAR_LIMIT: u64 = 30;
const CALENDAR_SECONDS: i64 = 10;

fn first_use_line(subject: u64, now: Timestamp, cost: u64) -> ChargeLine {
    ChargeLine {
        key: PeriodKey::from_string(format!("quota:{{account:s{subject}}}:fu:PT30S")),
        limit: FIRST_USE_LIMIT,
        cost,
        lifetime: Lifetime::FirstUse {
            deadline: now + SignedDuration::from_secs(FIRST_USE_SECONDS),
        },
        shadow_limit: None,
    }
}

fn calendar_line(subject: u64, now: Timestamp, cost: u64) -> ChargeLine {
    let start = now.as_second().div_euclid(CALENDAR_SECONDS) * CALENDAR_SECONDS;
    ChargeLine {
        key: PeriodKey::from_string(format!("quota:{{account:s{subject}}}:cal:w{start}")),
        limit: CALENDAR_LIMIT,
        cost,
        lifetime: Lifetime::Calendar {
            start: Timestamp::from_second(start).unwrap(),
            end: Timestamp::from_second(start + CALENDAR_SECONDS).unwrap(),
        },
        shadow_limit: None,
    }
}

/// What a run sends besides charges.
#[derive(Clone, Copy, Debug)]
struct Mix {
    /// The most a call waits for the store, each way, in milliseconds.
    jitter: u64,
    refunds: bool,
    adds: bool,
    resets: bool,
}

/// A counter: its key, and for a first-use one its period's reset (a
/// counter made anew after the period has another).
type CounterId = (String, Option<Timestamp>);

fn counter_of(line: &ChargeLine, usage: &Usage) -> CounterId {
    let first_use = line.key.as_str().contains(":fu:");
    (
        line.key.as_str().to_owned(),
        first_use.then_some(usage.resets_at),
    )
}

/// The counter `id` names among those known: a first-use reset is read
/// from a counter's remaining life, which moves by a moment here and there.
fn known(counters: &HashMap<CounterId, Count>, id: CounterId) -> CounterId {
    let Some(at) = id.1 else {
        return id;
    };
    counters
        .keys()
        .find(|(key, reset)| {
            *key == id.0
                && reset.is_some_and(|r| r.duration_since(at).abs() <= SignedDuration::from_secs(1))
        })
        .cloned()
        .unwrap_or(id)
}

/// The instant a give-back of a request charged at `charged_at` goes by,
/// as the layer reckons it (see `Usage::counted_at`).
fn made_by(usage: &Usage, charged_at: Timestamp) -> Timestamp {
    let made = usage.first_call.unwrap_or(charged_at);
    usage.counted_at.map_or(made, |counted| counted.min(made))
}

/// Gives `line`'s cost back as the layer does (see
/// `Usage::charged_counter`): to the counter at the first call `usage`
/// tells, exactly, unless that counter was made after the store counted
/// the charge; then to a counter made `by` then.
async fn give_back<St: Store>(
    store: &St,
    now: Timestamp,
    line: &ChargeLine,
    usage: &Usage,
    by: Timestamp,
) -> Result<Option<u64>, StoreError> {
    let key = line.key.clone();
    match usage.first_call {
        Some(first) if usage.counted_at.is_none_or(|counted| first <= counted) => {
            store.refund_made_at(now, key, line.cost, first).await
        }
        _ => store.refund_made_by(now, key, line.cost, by).await,
    }
}

#[derive(Clone, Default)]
struct Count {
    admitted: u64,
    refunded: u64,
    added: u64,
    limit: u64,
}

/// A request admitted: its instance, instant, lines with their usage, and
/// whether it was given back or added to already.
type Served = (usize, Timestamp, Vec<(ChargeLine, Usage)>, bool);

#[derive(Default)]
struct Model {
    counters: HashMap<CounterId, Count>,
    served: Vec<Served>,
    broken: Vec<String>,
}

async fn run(seed: u64, steps: usize, mix: Mix) -> Vec<String> {
    let memory = MemoryStore::new();
    let jitter = Jitter {
        inner: memory.clone(),
        seed: Arc::new(AtomicU64::new(seed)),
        max_ms: mix.jitter,
    };
    let stores = [LeasedStore::new(jitter.clone()), LeasedStore::new(jitter)];
    let model = Arc::new(Mutex::new(Model::default()));
    let mut rng = Rng(seed);
    let t0: Timestamp = "2026-12-04T10:00:03Z".parse().unwrap();
    let start = tokio::time::Instant::now();
    let now_of = move || t0 + SignedDuration::try_from(start.elapsed()).unwrap();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..steps {
        let now = now_of();
        let roll = rng.below(100);
        if roll < 60 {
            let at = rng.below(2) as usize;
            let subject = rng.below(2);
            let cost = 1 + rng.below(2);
            let which = rng.below(3);
            let mut lines = SmallVec::<[ChargeLine; 2]>::new();
            if which != 1 {
                let mut line = first_use_line(subject, now, cost);
                // A caller on a plan of half the limit, now and then; a
                // request of nothing, now and then.
                if rng.below(3) == 0 {
                    line.limit /= 2;
                }
                if rng.below(5) == 0 {
                    line.cost = 0;
                }
                lines.push(line);
            }
            if which != 0 {
                lines.push(calendar_line(subject, now, cost));
            }
            let request = ChargeRequest { now, lines };
            let store = stores[at].clone();
            let model = Arc::clone(&model);
            tasks.spawn(async move {
                let answer = match store.charge_at_once(&request) {
                    ChargeAnswer::Now(answer) => answer,
                    ChargeAnswer::Later(future) => future.await,
                };
                let mut model = model.lock().unwrap();
                let outcome = match answer {
                    Ok(outcome) => outcome,
                    Err(error) => return model.broken.push(format!("error: {error}")),
                };
                if !outcome.admitted {
                    return;
                }
                let mut served = Vec::new();
                for (line, usage) in request.lines.iter().zip(&outcome.usage) {
                    if usage.resets_at <= request.now {
                        model.broken.push(format!(
                            "admitted at {} on {} whose period reset at {}",
                            request.now, line.key, usage.resets_at
                        ));
                    }
                    let id = known(&model.counters, counter_of(line, usage));
                    let count = model.counters.entry(id).or_default();
                    count.admitted += line.cost;
                    count.limit = count.limit.max(line.limit);
                    served.push((line.clone(), *usage));
                }
                model.served.push((at, request.now, served, false));
            });
        } else if roll < 75 && mix.refunds {
            let picked = {
                let mut model = model.lock().unwrap();
                let n = model.served.len() as u64;
                let i = if n == 0 {
                    None
                } else {
                    Some(rng.below(n) as usize)
                };
                i.filter(|&i| !model.served[i].3).map(|i| {
                    model.served[i].3 = true;
                    let (at, charged_at, lines, _) = &model.served[i];
                    (*at, *charged_at, lines.clone())
                })
            };
            let Some((at, charged_at, lines)) = picked else {
                continue;
            };
            let store = stores[at].clone();
            let model = Arc::clone(&model);
            let add = mix.adds && rng.below(2) == 0;
            tasks.spawn(async move {
                for (line, usage) in lines {
                    if usage.resets_at <= now {
                        continue;
                    }
                    let by = made_by(&usage, charged_at);
                    let id = known(&model.lock().unwrap().counters, counter_of(&line, &usage));
                    if add {
                        if let Ok(Some(_)) = store.add_made_by(now, line.key.clone(), 1, by).await {
                            model.lock().unwrap().counters.get_mut(&id).unwrap().added += 1;
                        }
                    } else if let Ok(Some(_)) = give_back(&store, now, &line, &usage, by).await {
                        model
                            .lock()
                            .unwrap()
                            .counters
                            .get_mut(&id)
                            .unwrap()
                            .refunded += line.cost;
                    }
                }
            });
        } else if roll < 78 && mix.resets {
            let store = stores[rng.below(2) as usize].clone();
            let subject = rng.below(2);
            let key = if rng.below(2) == 0 {
                first_use_line(subject, now, 0).key
            } else {
                calendar_line(subject, now, 0).key
            };
            tasks.spawn(async move {
                let _ = store.reset(key).await;
            });
        } else {
            // Now and then long enough for blocks to go idle, or to outlive
            // their lease; mostly a moment.
            let ms = match rng.below(20) {
                0 => 1_500 + rng.below(1_000),
                1 => 11_000,
                _ => rng.below(60),
            };
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
    }
    while tasks.join_next().await.is_some() {}
    // Everything quiet: idle blocks go back.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (mut broken, counters) = {
        let model = model.lock().unwrap();
        (model.broken.clone(), model.counters.clone())
    };
    for (i, store) in stores.iter().enumerate() {
        if store.held() != 0 {
            broken.push(format!("instance {i} still holds {}", store.held()));
        }
    }
    let now = now_of();
    for (id, count) in &counters {
        // A reset lets instances admit from blocks taken before it, within
        // the lease bound: past the limit, and on counters made anew.
        if mix.resets {
            continue;
        }
        if count.admitted.saturating_sub(count.refunded) > count.limit {
            broken.push(format!(
                "{id:?}: admitted {}, given back {}, over the limit {}",
                count.admitted, count.refunded, count.limit
            ));
        }
        let key = PeriodKey::from_string(id.0.clone());
        let line = if id.1.is_some() {
            ChargeLine {
                key,
                ..first_use_line(0, now, 0)
            }
        } else {
            let start: i64 = id.0.rsplit(":w").next().unwrap().parse().unwrap();
            ChargeLine {
                key,
                ..calendar_line(0, Timestamp::from_second(start).unwrap(), 0)
            }
        };
        let request = ChargeRequest {
            now,
            lines: smallvec::smallvec![line],
        };
        let usage = memory.peek(request).await.unwrap()[0];
        let same = id.1.is_none_or(|reset| {
            usage.first_call.is_some()
                && reset.duration_since(usage.resets_at).abs() <= SignedDuration::from_secs(1)
        });
        let expected = count.admitted - count.refunded + count.added;
        if same && usage.resets_at > now && usage.used != expected {
            broken.push(format!(
                "{id:?}: the store counts {}, where {} were admitted, {} given back, {} added",
                usage.used, count.admitted, count.refunded, count.added
            ));
        }
    }
    broken
}

/// Runs `seeds` runs of `mix` and reports the first few that broke.
fn runs(seeds: std::ops::Range<u64>, mix: Mix) {
    let mut broke = Vec::new();
    for seed in seeds {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap();
        let broken = runtime.block_on(run(seed, 400, mix));
        if !broken.is_empty() {
            broke.push((seed, broken));
        }
    }
    broke.truncate(3);
    assert!(broke.is_empty(), "{mix:?}: {broke:#?}");
}

#[test]
fn charges_at_once() {
    let mix = Mix {
        jitter: 0,
        refunds: false,
        adds: false,
        resets: false,
    };
    runs(0..60, mix);
}

#[test]
fn charges_answered_late() {
    let mix = Mix {
        jitter: 30,
        refunds: false,
        adds: false,
        resets: false,
    };
    runs(0..60, mix);
}

#[test]
fn charges_given_back_and_added_to() {
    let mix = Mix {
        jitter: 30,
        refunds: true,
        adds: true,
        resets: false,
    };
    runs(0..60, mix);
}

#[test]
fn charges_given_back_at_once() {
    let mix = Mix {
        jitter: 0,
        refunds: true,
        adds: false,
        resets: false,
    };
    runs(0..60, mix);
}

/// With support resets: no limit is checked (an instance admits from a
/// block taken before a reset, within the lease bound), but nothing is
/// held once quiet, nothing panics or fails, and no request is admitted on
/// a period already over.
#[test]
fn charges_across_resets() {
    let mix = Mix {
        jitter: 30,
        refunds: true,
        adds: true,
        resets: true,
    };
    runs(0..60, mix);
}
