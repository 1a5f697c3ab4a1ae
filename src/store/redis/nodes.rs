//! When each node of a cluster last answered, so that a call sent to a
//! node waits for it as a call on a single server waits for the server (see
//! [`Patience`](crate::store::patience::Patience)): patiently while the
//! node answers the calls ahead of it, one budget when the node stalled.
//! One node's answers say nothing of another: a stalled node's calls must
//! fail after one budget while the others answer all along. (Before it is
//! sent, a call waits for room and a connection behind every node's calls,
//! while any node answers; once sent, its node's silence counts from its
//! send at the earliest.)
//!
//! A call names the slot of its keys (they share one, by their hash tag);
//! the slot's node is read from `CLUSTER SLOTS`, which the store asks
//! again every [`REFRESH`] while it makes calls. Until the map is read, or
//! for a slot it does not name, a call once sent waits one budget. A map
//! read before a slot moved names the slot's old node until it is read
//! again: the call then waits while that node answers, for [`PATIENCE`]
//! budgets at most, as any call.
//!
//! Per node, it also counts the calls holding room among the store's
//! calls in flight, and those given up on by their callers (followed for
//! up to 30 s): a node holds at most half the room, and one silent since
//! it was sent one of those is sent nothing (see `RedisStore::follow`).
//!
//! [`PATIENCE`]: crate::store::patience::PATIENCE

use std::collections::HashMap;
use std::sync::atomic::{AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use deadpool_redis::redis::Value;
use tokio::time::Instant;

use super::builder::MAX_TIMEOUT;
use crate::store::patience::{LastAnswer, Patience};

/// How often the map of slots to nodes is read again while the store makes
/// calls.
pub(super) const REFRESH: Duration = Duration::from_secs(2);

/// The slots of a cluster.
const SLOTS: usize = 16_384;

/// The nodes told apart: a cluster past this many masters shares their
/// answers between some of them (a wait then follows two nodes' answers).
const MAX_NODES: usize = 1_024;

/// The slot of a key, as Redis Cluster computes it: CRC16 (XMODEM) of its
/// hash tag (the text between its first `{` and the next `}`, when not
/// empty), or of the whole key, modulo 16 384.
pub(super) fn slot_of(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        let close = rest.iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &rest[..close])
    });
    let hashed = crc16::State::<crc16::XMODEM>::calculate(tagged.unwrap_or(key));
    hashed % SLOTS as u16
}

/// When each node last answered, by slot.
pub(super) struct NodeAnswers {
    /// Per slot, the index of its node in `answers`, plus one; zero: not
    /// known.
    slots: Box<[AtomicU16]>,
    answers: Box<[LastAnswer]>,
    /// Per node, its calls holding room among the calls in flight.
    rooms: Arc<[NodeRoom]>,
    /// Each node's index in `answers`, by address.
    indices: Mutex<HashMap<(String, u16), u16>>,
    /// When the map was last asked for, in milliseconds from `epoch`,
    /// plus one; zero: never.
    asked: AtomicU64,
    epoch: Instant,
}

impl NodeAnswers {
    pub(super) fn new() -> Self {
        Self {
            slots: (0..SLOTS).map(|_| AtomicU16::new(0)).collect(),
            answers: (0..MAX_NODES).map(|_| LastAnswer::new()).collect(),
            rooms: (0..MAX_NODES).map(|_| NodeRoom::default()).collect(),
            indices: Mutex::default(),
            asked: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }

    fn index(&self, slot: u16) -> Option<usize> {
        let index = self.slots.get(usize::from(slot))?.load(Ordering::Relaxed);
        Some(usize::from(index.checked_sub(1)?))
    }

    fn node(&self, slot: u16) -> Option<&LastAnswer> {
        self.answers.get(self.index(slot)?)
    }

    /// Counts a call to the node of `slot` among those holding room, until
    /// the guard is dropped (`None`: the node is not known). A node holds
    /// at most `most` calls: past that, a call waits for one of them to
    /// end, patiently while the node answers, and fails, sending nothing,
    /// once the node answered none of its calls for `budget` (see
    /// [`Patience`]). So a node that stalls takes at most `most` of the
    /// store's room, whether its calls came one by one or in a burst
    /// before any was given up on, and a busy node's calls wait, never
    /// fail. A node known silent (see `NodeAnswers::silent`) is sent
    /// nothing: its calls fail at once, within `most` or not.
    pub(super) async fn hold(
        &self,
        slot: u16,
        most: usize,
        budget: Duration,
    ) -> Result<Option<NodeHold>, NodeFull> {
        let Some(index) = self.index(slot) else {
            return Ok(None);
        };
        let room = &self.rooms[index];
        let hold = || NodeHold {
            rooms: Arc::clone(&self.rooms),
            epoch: self.epoch,
            index,
            given_up: false,
        };
        // A place taken, if one is free; otherwise given back at once.
        let take = || {
            if room.held.fetch_add(1, Ordering::SeqCst) < most {
                return true;
            }
            room.give_back_place(most);
            false
        };
        // A node known silent is sent nothing, whether or not it holds its
        // share of the room: sent on, its calls would fill its sockets'
        // buffers, the kernel would fail those connections (see
        // `TCP_USER_TIMEOUT`), and the cluster client, repairing them,
        // would send the node's next calls to another node, read the slots
        // again on the `MOVED` answered, and wait on the stalled node while
        // it does, holding up every node's calls.
        if self.silent(slot, room, budget) {
            return Err(NodeFull::Silent);
        }
        if take() {
            return Ok(Some(hold()));
        }
        let room_made = async {
            loop {
                if self.silent(slot, room, budget) {
                    return Err(NodeFull::Silent);
                }
                // Told of every call that ends from here on (see
                // `NodeRoom::release`), then looked at: no end goes unseen.
                let ended = room.ended.notified();
                let mut ended = std::pin::pin!(ended);
                ended.as_mut().enable();
                let waiting = Waiting::on(room);
                if room.held.load(Ordering::SeqCst) >= most {
                    ended.await;
                }
                drop(waiting);
                if take() {
                    return Ok(hold());
                }
            }
        };
        let patience = Patience::new(Instant::now(), budget, MAX_TIMEOUT);
        match patience.wait(|| self.last(slot), room_made).await {
            Some(Ok(hold)) => Ok(Some(hold)),
            Some(Err(full)) => Err(full),
            None => Err(NodeFull::Waited),
        }
    }

    /// Whether the node of `slot` is silent: calls given up on, and no
    /// answer for `budget` since the first of them was sent.
    fn silent(&self, slot: u16, room: &NodeRoom, budget: Duration) -> bool {
        if room.abandoned.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let micros = room.abandoned_since.load(Ordering::Relaxed);
        let since = self
            .epoch
            .checked_add(Duration::from_micros(micros))
            .unwrap_or(self.epoch);
        let quiet = self.last(slot).map_or(since, |at| at.max(since));
        Instant::now().saturating_duration_since(quiet) >= budget
    }

    /// A slot of the node that answered last, if any did, and is not known
    /// silent (see [`NodeAnswers::hold`]; `budget` the store's timeout):
    /// where the map is read again (see `RedisStore::read_nodes`), so that
    /// a read, which names no key, goes to a node that answers and holds
    /// room among its calls; sent to any node, it could go to one that
    /// stalled, and hold room among the store's calls outside that node's
    /// half for 30 s. A node that stalled is never where the map is read
    /// from: when it was the last to answer (its subjects alone had
    /// calls), the map would stay as it was, its slots with it, after a
    /// failover gave them to its replica. So past the nodes that answered,
    /// a node known that never answered will do, and `None` (any node)
    /// when every node known is silent.
    pub(super) fn answering_slot(&self, budget: Duration) -> Option<u16> {
        let mut best: Option<(Option<Instant>, u16)> = None;
        let mut previous = None;
        for slot in 0..SLOTS as u16 {
            let index = self.index(slot);
            // The slots of a node come in ranges: each range is looked at once.
            let Some(node) = index else {
                continue;
            };
            if index == previous {
                continue;
            }
            previous = index;
            if self.silent(slot, &self.rooms[node], budget) {
                continue;
            }
            let at = self.last(slot);
            if best.is_none_or(|(last, _)| at > last) {
                best = Some((at, slot));
            }
        }
        best.map(|(_, slot)| slot)
    }

    /// The node of `slot` as the map last read names it: its index, which
    /// names one address for good (see [`address_of`](Self::address_of)).
    pub(super) fn node_of(&self, slot: u16) -> Option<u16> {
        u16::try_from(self.index(slot)?).ok()
    }

    /// The address of the node at `index` (`None`: an entry nodes share
    /// past `MAX_NODES`, or a node whose endpoint the cluster does not
    /// tell: `?`, or empty, under `cluster-preferred-endpoint-type
    /// unknown-endpoint`).
    pub(super) fn address_of(&self, index: u16) -> Option<(String, u16)> {
        let indices = self.indices.lock().unwrap_or_else(|e| e.into_inner());
        let mut named = indices.iter().filter(|(_, &i)| i == index).map(|(a, _)| a);
        match (named.next(), named.next()) {
            (Some((host, _)), None) if host.is_empty() || host == "?" => None,
            (Some(address), None) => Some(address.clone()),
            _ => None,
        }
    }

    /// Notes an answer now from the node of `slot`, if known.
    pub(super) fn heard(&self, slot: u16) {
        if let Some(node) = self.node(slot) {
            node.heard();
        }
    }

    /// When the node of `slot` last answered: `None` when it never did, or
    /// is not known.
    pub(super) fn last(&self, slot: u16) -> Option<Instant> {
        self.node(slot)?.last()
    }

    /// Whether the map is to be read now: never asked for, or last asked
    /// for [`REFRESH`] ago (a read that failed is tried again then). One
    /// caller is told so, which reads it ([`NodeAnswers::read`]); a read
    /// takes the store's budget at most, far below [`REFRESH`].
    pub(super) fn due(&self) -> bool {
        let now = self.millis();
        let asked = self.asked.load(Ordering::Relaxed);
        let refresh = u64::try_from(REFRESH.as_millis()).unwrap_or(u64::MAX);
        if asked != 0 && now < asked.saturating_add(refresh) {
            return false;
        }
        self.asked
            .compare_exchange(asked, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }

    /// Whether a node that serves slots in the map serves none in a
    /// `CLUSTER SLOTS` reply (a failover: its replica took them over).
    pub(super) fn vanished(&self, reply: &Value) -> bool {
        let indices = self.indices.lock().unwrap_or_else(|e| e.into_inner());
        let mut named = [false; MAX_NODES];
        let mut any = false;
        for (_, _, master) in slot_ranges(reply) {
            any = true;
            if let Some(&index) = indices.get(&master) {
                named[usize::from(index)] = true;
            }
        }
        drop(indices);
        let mut serving = [false; MAX_NODES];
        for slot in 0..SLOTS as u16 {
            if let Some(index) = self.index(slot) {
                serving[index] = true;
            }
        }
        any && serving.iter().zip(named).any(|(&serves, is)| serves && !is)
    }

    /// Takes the slots' nodes from a `CLUSTER SLOTS` reply.
    pub(super) fn read(&self, reply: &Value) {
        let mut indices = self.indices.lock().unwrap_or_else(|e| e.into_inner());
        for (low, high, master) in slot_ranges(reply) {
            let next = indices.len();
            let index = *indices.entry(master).or_insert_with(|| {
                // Past `MAX_NODES`, nodes share an entry.
                u16::try_from(next % MAX_NODES).expect("MAX_NODES fits in a u16")
            });
            for slot in low..=high.min(SLOTS as u16 - 1) {
                self.slots[usize::from(slot)].store(index + 1, Ordering::Relaxed);
            }
        }
    }

    fn millis(&self) -> u64 {
        let since = Instant::now().saturating_duration_since(self.epoch);
        u64::try_from(since.as_millis())
            .unwrap_or(u64::MAX - 1)
            .saturating_add(1)
    }
}

/// A node's calls holding room among the calls in flight (waiting for
/// their answer, or followed after their callers gave up).
#[derive(Default)]
struct NodeRoom {
    held: AtomicUsize,
    /// Those of `held` followed after their callers gave up.
    abandoned: AtomicUsize,
    /// When the first call of the current run of calls given up on
    /// (`abandoned` above zero since) was sent, in microseconds from
    /// `NodeAnswers::epoch`: the node is silent only once it answered
    /// nothing for a budget since it had such a call to answer (an idle
    /// node whose last answer is old, sent a call its caller left at once,
    /// is not).
    abandoned_since: AtomicU64,
    /// Calls waiting for the node's room, told by `ended` when one of
    /// `held` ends.
    waiting: AtomicUsize,
    ended: tokio::sync::Notify,
}

impl NodeRoom {
    /// A call of `held` ended: the calls waiting for the node's room are
    /// told.
    fn release(&self) {
        self.held.fetch_sub(1, Ordering::SeqCst);
        if self.waiting.load(Ordering::SeqCst) > 0 {
            self.ended.notify_waiters();
        }
    }

    /// A call that counted itself in `held` found it full (past `most`)
    /// and gives its place back: the waiting calls are told only if that
    /// made room, which another call's place taken and given back hid
    /// from them; otherwise calls that find the room full would wake each
    /// other in turn.
    fn give_back_place(&self, most: usize) {
        let held = self.held.fetch_sub(1, Ordering::SeqCst) - 1;
        if held < most && self.waiting.load(Ordering::SeqCst) > 0 {
            self.ended.notify_waiters();
        }
    }
}

/// A call counted among those waiting for a node's room while it lives
/// (dropped with its call too, when its caller goes away).
struct Waiting<'a>(&'a NodeRoom);

impl<'a> Waiting<'a> {
    fn on(room: &'a NodeRoom) -> Self {
        room.waiting.fetch_add(1, Ordering::SeqCst);
        Self(room)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Why a call found no room among its node's calls (see
/// [`NodeAnswers::hold`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NodeFull {
    /// The node answered nothing for a budget since one of its calls was
    /// given up on: it is sent nothing.
    Silent,
    /// The call waited for one of them to end, and the node answered
    /// nothing for a budget meanwhile.
    Waited,
}

/// A call counted among its node's calls holding room (see
/// [`NodeAnswers::hold`]).
pub(super) struct NodeHold {
    rooms: Arc<[NodeRoom]>,
    epoch: Instant,
    index: usize,
    given_up: bool,
}

impl NodeHold {
    /// Its caller stopped waiting for the call `sent` then: the call is
    /// followed to its end.
    pub(super) fn given_up(&mut self, sent: Instant) {
        if !self.given_up {
            self.given_up = true;
            let room = &self.rooms[self.index];
            if room.abandoned.fetch_add(1, Ordering::Relaxed) == 0 {
                let micros = sent.saturating_duration_since(self.epoch).as_micros();
                room.abandoned_since
                    .store(u64::try_from(micros).unwrap_or(u64::MAX), Ordering::Relaxed);
            }
        }
    }
}

impl Drop for NodeHold {
    fn drop(&mut self) {
        let room = &self.rooms[self.index];
        if self.given_up {
            room.abandoned.fetch_sub(1, Ordering::Relaxed);
        }
        room.release();
    }
}

/// The ranges of slots of a `CLUSTER SLOTS` reply, each with its master's
/// address: each range is `[start, end, [host, port, ..], replicas..]`.
pub(super) fn slot_ranges(slots: &Value) -> impl Iterator<Item = (u16, u16, (String, u16))> + '_ {
    let ranges = match slots {
        Value::Array(ranges) => ranges.as_slice(),
        _ => &[],
    };
    ranges.iter().filter_map(|range| {
        let Value::Array(range) = range else {
            return None;
        };
        let bound = |at: usize| match range.get(at) {
            Some(Value::Int(slot)) => u16::try_from(*slot).ok(),
            _ => None,
        };
        let (low, high) = (bound(0)?, bound(1)?);
        let Some(Value::Array(master)) = range.get(2) else {
            return None;
        };
        let host = match master.first() {
            Some(Value::BulkString(host)) => String::from_utf8_lossy(host).into_owned(),
            Some(Value::SimpleString(host)) => host.clone(),
            _ => return None,
        };
        let Some(Value::Int(port)) = master.get(1) else {
            return None;
        };
        let port = u16::try_from(*port).ok()?;
        Some((low, high, (host, port)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_is_the_one_redis_computes() {
        // Values from `CLUSTER KEYSLOT`.
        assert_eq!(slot_of(b"foo"), 12_182);
        assert_eq!(slot_of(b"123456789"), 12_739);
        // The hash tag alone counts, and an empty one does not.
        assert_eq!(slot_of(b"{user1000}.following"), slot_of(b"user1000"));
        // An empty tag: the whole key is hashed (as `CLUSTER KEYSLOT` does).
        assert_eq!(slot_of(b"foo{}{bar}"), 8_363);
        assert_ne!(slot_of(b"foo{}{bar}"), slot_of(b"bar"));
        assert_eq!(slot_of(b"foo{{bar}}zap"), slot_of(b"{bar"));
        assert_eq!(
            slot_of(b"quota:{account:acme}:read"),
            slot_of(b"account:acme")
        );
    }

    fn range(low: i64, high: i64, host: &str, port: i64) -> Value {
        Value::Array(vec![
            Value::Int(low),
            Value::Int(high),
            Value::Array(vec![
                Value::BulkString(host.as_bytes().to_vec()),
                Value::Int(port),
            ]),
        ])
    }

    #[tokio::test(start_paused = true)]
    async fn each_slot_follows_the_answers_of_its_own_node() {
        let nodes = NodeAnswers::new();
        assert_eq!(nodes.last(7), None, "no map yet");
        nodes.heard(7);
        assert_eq!(
            nodes.last(7),
            None,
            "an unknown node's answer is noted nowhere"
        );
        assert!(nodes.due());
        assert!(!nodes.due(), "one read at a time");
        nodes.read(&Value::Array(vec![
            range(0, 99, "10.0.0.1", 6379),
            range(100, 16_383, "10.0.0.2", 6379),
        ]));
        nodes.heard(7);
        let heard = Instant::now();
        assert_eq!(nodes.last(99), Some(heard));
        assert_eq!(nodes.last(100), None, "another node");
        tokio::time::advance(Duration::from_millis(5)).await;
        nodes.heard(16_383);
        assert_eq!(nodes.last(100), Some(heard + Duration::from_millis(5)));
        assert_eq!(nodes.last(0), Some(heard));

        // Read again after `REFRESH`: a slot that moved follows its new node.
        assert!(!nodes.due());
        tokio::time::advance(REFRESH).await;
        assert!(nodes.due());
        nodes.read(&Value::Array(vec![
            range(0, 6, "10.0.0.1", 6379),
            range(7, 16_383, "10.0.0.2", 6379),
        ]));
        assert_eq!(nodes.last(7), nodes.last(100));
        assert_eq!(nodes.last(6), Some(heard));

        // A read that failed keeps the map, and is tried again after
        // `REFRESH`.
        tokio::time::advance(REFRESH).await;
        assert!(nodes.due());
        assert_eq!(nodes.last(6), Some(heard));
        assert!(!nodes.due());
        tokio::time::advance(REFRESH).await;
        assert!(nodes.due());
    }

    /// A node's calls hold `most` places at most: past that, a call waits
    /// while the node answers and takes the place of one that ends; it
    /// fails once the node answered nothing for a budget, and leaves no
    /// mark behind it (nor does one whose caller went away).
    #[tokio::test(start_paused = true)]
    async fn a_call_past_its_nodes_places_waits_for_one_while_the_node_answers() {
        let budget = Duration::from_millis(80);
        let nodes = Arc::new(NodeAnswers::new());
        nodes.read(&Value::Array(vec![
            range(0, 99, "10.0.0.1", 6379),
            range(100, 16_383, "10.0.0.2", 6379),
        ]));
        nodes.heard(7);
        let first = nodes.hold(7, 2, budget).await.unwrap().unwrap();
        let _second = nodes.hold(7, 2, budget).await.unwrap().unwrap();
        let _other_node = nodes.hold(100, 2, budget).await.unwrap().unwrap();

        // The node answers every 50 ms: the third call waits, and takes the
        // first one's place when it ends.
        let waiting = tokio::spawn({
            let nodes = Arc::clone(&nodes);
            async move { nodes.hold(7, 2, budget).await }
        });
        for _ in 0..4 {
            tokio::time::advance(Duration::from_millis(50)).await;
            nodes.heard(7);
        }
        assert!(!waiting.is_finished(), "no place ended yet");
        drop(first);
        let _third = waiting.await.unwrap().unwrap().expect("a place");
        assert_eq!(nodes.rooms[0].held.load(Ordering::SeqCst), 2);

        // The node answers nothing: a budget later, the call fails.
        let silent = tokio::spawn({
            let nodes = Arc::clone(&nodes);
            async move { nodes.hold(7, 2, budget).await.map(|hold| hold.is_some()) }
        });
        tokio::time::advance(budget + Duration::from_millis(1)).await;
        assert_eq!(silent.await.unwrap(), Err(NodeFull::Waited));

        // One whose caller goes away leaves no mark among those waiting.
        let gone = tokio::spawn({
            let nodes = Arc::clone(&nodes);
            async move { nodes.hold(7, 2, budget).await.map(|hold| hold.is_some()) }
        });
        tokio::task::yield_now().await;
        gone.abort();
        let _ = gone.await;
        assert_eq!(nodes.rooms[0].waiting.load(Ordering::SeqCst), 0);
        assert_eq!(nodes.rooms[0].held.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_node_is_named_by_the_endpoint_the_map_tells_if_it_tells_one() {
        let nodes = NodeAnswers::new();
        nodes.read(&Value::Array(vec![
            range(0, 99, "10.0.0.1", 6379),
            range(100, 199, "?", 6379),
            range(200, 16_383, "", 6380),
        ]));
        let address = |slot| nodes.address_of(nodes.node_of(slot)?);
        assert_eq!(address(5), Some(("10.0.0.1".into(), 6379)));
        assert_eq!(address(150), None, "unknown endpoint");
        assert_eq!(address(300), None, "unknown endpoint");
    }

    #[test]
    fn ranges_that_are_not_slots_are_left_out() {
        let reply = Value::Array(vec![
            range(0, 10, "a", 1),
            range(-1, 10, "b", 2),
            range(11, 20, "c", 70_000),
            Value::Int(3),
            range(21, 30, "a", 1),
        ]);
        let ranges: Vec<_> = slot_ranges(&reply).collect();
        assert_eq!(
            ranges,
            vec![(0, 10, ("a".into(), 1)), (21, 30, ("a".into(), 1))]
        );
    }
}
