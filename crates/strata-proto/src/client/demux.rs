//! The connection under an [`AgentClient`]: one reader task, one writer
//! task, and the table that routes incoming frames to their request.
//!
//! Contract (see `PROTOCOL.md`, *Frames*):
//!
//! - Every request the client starts registers a [`Call`] under a fresh id
//!   (non-zero, [`TUNNEL_ID_BIT`] clear); every frame the agent sends with that
//!   id, control message or data, reaches that call in order. Dropping the
//!   call unregisters the id; later frames for it are dropped.
//! - Id 0 is connection-level: a `hello_ok` there is a repeated handshake
//!   answer (ignored), an `error` is a protocol error and closes the
//!   connection.
//! - Ids with [`TUNNEL_ID_BIT`] set belong to tunnels the agent opens; they go
//!   to the [`TunnelRouter`] given at [`spawn`] (`super::tunnel`, which sits
//!   on top of this module: this one knows nothing of tunnels but their ids
//!   and their table).
//! - A malformed frame or an undecodable control message closes the
//!   connection; so does a failed read or write. Closing fails every
//!   in-flight call with [`AgentError::Closed`] and stops every tunnel.
//! - Memory is bounded (see `PROTOCOL.md`, *Flow control*): the reader never
//!   waits for a consumer, so each call's queue counts what it holds.
//!   Consecutive data frames of one kind are merged; every queued item costs
//!   its payload plus [`ITEM_OVERHEAD`]. A call whose agent sends beyond the
//!   window the call was opened with ([`Limits::window`], minus the credit
//!   its consumer granted), or whose queue passes [`CALL_BUFFER_CAP`], or
//!   that gets an empty data frame, is aborted: its queue is emptied, its
//!   consumer gets [`AgentError::FlowControl`], its process group is killed
//!   ([`Limits::kill_on_abort`]) and later frames for its id are dropped; the
//!   connection and the other calls go on. When all queues of the connection
//!   together hold more than [`CONNECTION_BUFFER_CAP`] the connection is
//!   closed (the session is killed; the runtime reconnects).
//!
//! [`AgentClient`]: super::AgentClient

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use strata_core::text::Escaped;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::AgentError;
use crate::frame::{Decoded, Frame, FrameDecoder, FrameKind};
use crate::msg::{Request, Response};
use crate::tunnel::{is_tunnel_id, TunnelHandle, TUNNEL_ID_BIT};

/// Bytes one queued item costs besides its payload (the queue's own memory).
pub const ITEM_OVERHEAD: usize = 64;
/// Most bytes (payload plus [`ITEM_OVERHEAD`] per item) one call may hold
/// unread before it is aborted.
pub const CALL_BUFFER_CAP: usize = 16 * 1024 * 1024;
/// Most bytes all calls of one connection may hold unread before the
/// connection is closed.
pub const CONNECTION_BUFFER_CAP: usize = 64 * 1024 * 1024;
/// Data items shorter than this take the next data frame of the same kind
/// into themselves instead of queueing a new item.
const MERGE_BELOW: usize = 64 * 1024;

/// One frame for a request, as its [`Call`] receives it.
pub(super) enum Incoming {
    /// A control message.
    Msg(Response),
    /// A data frame of this kind.
    Data(FrameKind, Bytes),
}

/// Flow-control rules of one call, fixed when it is opened.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Limits {
    /// Data payload bytes the agent may have sent beyond the credit the
    /// consumer granted ([`Call::grant`]); `None`: the agent does not window
    /// this call, only [`CALL_BUFFER_CAP`] bounds it.
    pub(super) window: Option<u64>,
    /// On abort, send `signal {SIGKILL}` on the call's id (a command: the
    /// agent kills its process group).
    pub(super) kill_on_abort: bool,
}

/// One queued item: a message, or data that may still grow by merging.
enum Item {
    Msg(Response, usize),
    Data(FrameKind, Chunk),
}

enum Chunk {
    Frozen(Bytes),
    Growing(BytesMut),
}

impl Chunk {
    fn len(&self) -> usize {
        match self {
            Self::Frozen(b) => b.len(),
            Self::Growing(b) => b.len(),
        }
    }
}

impl Item {
    fn charge(&self) -> usize {
        match self {
            Self::Msg(_, c) => *c,
            Self::Data(_, c) => c.len() + ITEM_OVERHEAD,
        }
    }

    fn into_incoming(self) -> Incoming {
        match self {
            Self::Msg(m, _) => Incoming::Msg(m),
            Self::Data(k, Chunk::Frozen(b)) => Incoming::Data(k, b),
            Self::Data(k, Chunk::Growing(b)) => Incoming::Data(k, b.freeze()),
        }
    }
}

#[derive(Default)]
struct QueueState {
    items: VecDeque<Item>,
    /// Bytes charged for `items` (also counted in the connection's total).
    charged: usize,
    /// Data payload bytes received.
    received: u64,
    /// Credit the consumer granted: cumulative data bytes it consumed and
    /// told the agent about.
    credit: u64,
    /// The connection is gone: after the queued items, `Closed`.
    closed: bool,
    /// The call was aborted; its consumer gets this.
    failed: Option<String>,
}

/// The queue of one call: filled by the reader (never waiting), emptied by
/// the call's consumer.
struct Queue {
    state: Mutex<QueueState>,
    notify: Notify,
    limits: Limits,
}

/// What [`Queue::push`] decided.
enum Pushed {
    Kept,
    /// The agent broke the call's rules: abort it with this reason.
    Abort(String),
}

impl Queue {
    fn lock(&self) -> MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues one frame's content; `frame_len` is its payload size.
    fn push(&self, inc: Incoming, frame_len: usize, conn: &AtomicUsize) -> Pushed {
        let mut st = self.lock();
        if st.failed.is_some() || st.closed {
            return Pushed::Kept;
        }
        let added = match inc {
            Incoming::Data(kind, b) => {
                if b.is_empty() {
                    return Pushed::Abort("empty data frame".into());
                }
                st.received += b.len() as u64;
                if let Some(w) = self.limits.window {
                    if st.received.saturating_sub(st.credit) > w {
                        return Pushed::Abort(format!(
                            "sent {} bytes beyond the last credit, window is {w}",
                            st.received - st.credit
                        ));
                    }
                }
                let mergeable = matches!(
                    st.items.back(),
                    Some(Item::Data(k, c)) if *k == kind && c.len() < MERGE_BELOW
                );
                let charge = b.len() + if mergeable { 0 } else { ITEM_OVERHEAD };
                if st.charged + charge > CALL_BUFFER_CAP {
                    return Pushed::Abort(format!(
                        "more than {CALL_BUFFER_CAP} bytes buffered and not read"
                    ));
                }
                match st.items.back_mut() {
                    Some(Item::Data(_, c)) if mergeable => {
                        if let Chunk::Frozen(f) = c {
                            let mut m =
                                BytesMut::with_capacity((f.len() + b.len()).max(MERGE_BELOW));
                            m.extend_from_slice(f);
                            *c = Chunk::Growing(m);
                        }
                        if let Chunk::Growing(m) = c {
                            m.extend_from_slice(&b);
                        }
                    }
                    _ => st.items.push_back(Item::Data(kind, Chunk::Frozen(b))),
                }
                charge
            }
            Incoming::Msg(m) => {
                let charge = frame_len + ITEM_OVERHEAD;
                if st.charged + charge > CALL_BUFFER_CAP {
                    return Pushed::Abort(format!(
                        "more than {CALL_BUFFER_CAP} bytes buffered and not read"
                    ));
                }
                st.items.push_back(Item::Msg(m, charge));
                charge
            }
        };
        st.charged += added;
        conn.fetch_add(added, Ordering::SeqCst);
        drop(st);
        self.notify.notify_one();
        Pushed::Kept
    }

    /// Aborts the call: drops what it holds, its consumer gets `why`.
    fn fail(&self, why: String, conn: &AtomicUsize) {
        let mut st = self.lock();
        st.items.clear();
        conn.fetch_sub(std::mem::take(&mut st.charged), Ordering::SeqCst);
        st.failed = Some(why);
        drop(st);
        self.notify.notify_one();
    }

    fn close(&self) {
        self.lock().closed = true;
        self.notify.notify_one();
    }
}

/// State shared by the client handles, the reader and the writer.
pub(super) struct Shared {
    routes: Mutex<HashMap<u32, Arc<Queue>>>,
    tunnels: Mutex<HashMap<u32, TunnelHandle>>,
    closed: AtomicBool,
    next_id: AtomicU32,
    /// Bytes held by all call queues.
    buffered: AtomicUsize,
    /// Cancelled when the connection closes: the reader and writer tasks
    /// end, so the socket itself closes (a QEMU chardev takes one client;
    /// a reconnect needs the old one gone).
    stop: CancellationToken,
    /// When the connection started; `last_rx_ms` counts from it.
    born: Instant,
    /// Milliseconds after `born` at which the agent last sent a byte.
    last_rx_ms: AtomicU64,
    /// The liveness watchdog's ping in flight (0 or 1): a route of the
    /// connection's own, not a call (see [`Shared::open_calls`]).
    probes: AtomicUsize,
}

impl Shared {
    /// The state of a new connection: no calls, no tunnels, ids from 1.
    fn new() -> Arc<Self> {
        Arc::new(Shared {
            routes: Mutex::new(HashMap::new()),
            tunnels: Mutex::new(HashMap::new()),
            closed: AtomicBool::new(false),
            next_id: AtomicU32::new(1),
            buffered: AtomicUsize::new(0),
            stop: CancellationToken::new(),
            born: Instant::now(),
            last_rx_ms: AtomicU64::new(0),
            probes: AtomicUsize::new(0),
        })
    }

    fn routes(&self) -> MutexGuard<'_, HashMap<u32, Arc<Queue>>> {
        // A poisoned lock only means another task panicked mid-insert; the map is still usable.
        self.routes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The open tunnels, by id.
    pub(super) fn tunnels(&self) -> MutexGuard<'_, HashMap<u32, TunnelHandle>> {
        self.tunnels.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the connection is gone.
    pub(super) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Records that the agent just sent something (or that silence so far
    /// does not count, e.g. after the guest was paused).
    pub(super) fn touch(&self) {
        let ms = u64::try_from(self.born.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_rx_ms.store(ms, Ordering::Relaxed);
    }

    /// How long the agent has sent nothing.
    fn quiet_for(&self) -> Duration {
        let last = Duration::from_millis(self.last_rx_ms.load(Ordering::Relaxed));
        self.born.elapsed().saturating_sub(last)
    }

    /// Calls and tunnels open on this connection. The liveness watchdog's
    /// own ping does not count: it is the connection checking itself, not
    /// a use of the guest (it used to, and an idle sandbox then looked busy
    /// for about a second of every three: pressure hibernation and
    /// admission passed it over, and a create was refused while it idled).
    pub(super) fn open_calls(&self) -> usize {
        let routes = self
            .routes()
            .len()
            .saturating_sub(self.probes.load(Ordering::SeqCst));
        routes + self.tunnels().len()
    }

    /// Bytes the calls of this connection hold unread.
    pub(super) fn buffered(&self) -> usize {
        self.buffered.load(Ordering::SeqCst)
    }

    /// Marks the connection gone: in-flight calls fail, tunnels stop.
    pub(super) fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.stop.cancel();
        let routes = std::mem::take(&mut *self.routes());
        routes.values().for_each(|q| q.close());
        // Dropping the handles stops their pumps (sockets closed).
        let tunnels = std::mem::take(&mut *self.tunnels());
        drop(tunnels);
    }

    /// Registers a new request id with no flow-control window.
    pub(super) fn open(self: &Arc<Self>) -> Result<Call, AgentError> {
        self.open_with(Limits::default())
    }

    /// Registers a new request id with `limits`.
    pub(super) fn open_with(self: &Arc<Self>, limits: Limits) -> Result<Call, AgentError> {
        let queue = Arc::new(Queue {
            state: Mutex::new(QueueState::default()),
            notify: Notify::new(),
            limits,
        });
        let mut routes = self.routes();
        if self.is_closed() {
            return Err(AgentError::Closed);
        }
        let id = loop {
            // Host ids keep the high bit clear: those ids belong to the agent's tunnels.
            let id = self.next_id.fetch_add(1, Ordering::Relaxed) & !TUNNEL_ID_BIT;
            if id != 0 && !routes.contains_key(&id) {
                break id;
            }
        };
        routes.insert(id, queue.clone());
        Ok(Call {
            id,
            queue,
            shared: self.clone(),
        })
    }
}

/// A registered request id; unregisters on drop.
pub(super) struct Call {
    /// The request id.
    pub(super) id: u32,
    queue: Arc<Queue>,
    shared: Arc<Shared>,
}

impl Drop for Call {
    fn drop(&mut self) {
        let mut routes = self.shared.routes();
        if routes
            .get(&self.id)
            .is_some_and(|q| Arc::ptr_eq(q, &self.queue))
        {
            routes.remove(&self.id);
        }
        drop(routes);
        let mut st = self.queue.lock();
        st.items.clear();
        let charged = std::mem::take(&mut st.charged);
        self.shared.buffered.fetch_sub(charged, Ordering::SeqCst);
    }
}

impl Call {
    /// Takes the first queued item, or the reason there is none.
    fn pop(&self) -> Option<Result<Incoming, AgentError>> {
        let mut st = self.queue.lock();
        if let Some(why) = &st.failed {
            return Some(Err(AgentError::FlowControl(why.clone())));
        }
        match st.items.pop_front() {
            Some(item) => {
                let c = item.charge();
                st.charged -= c;
                self.shared.buffered.fetch_sub(c, Ordering::SeqCst);
                Some(Ok(item.into_incoming()))
            }
            None if st.closed => Some(Err(AgentError::Closed)),
            None => None,
        }
    }

    /// Next frame; `Closed` once the connection is gone (after the queued
    /// frames), `FlowControl` once the call was aborted.
    pub(super) async fn recv(&mut self) -> Result<Incoming, AgentError> {
        loop {
            if let Some(r) = self.pop() {
                return r;
            }
            self.queue.notify.notified().await;
        }
    }

    /// Next frame if one is queued (`Ok(None)`: none yet).
    pub(super) fn try_recv(&mut self) -> Result<Option<Incoming>, AgentError> {
        self.pop().transpose()
    }

    /// Next control message, ignoring data frames.
    pub(super) async fn recv_msg(&mut self) -> Result<Response, AgentError> {
        loop {
            if let Incoming::Msg(m) = self.recv().await? {
                return Ok(m);
            }
        }
    }

    /// Waits until a queued message matches `take` (removed and returned,
    /// whatever is queued before it) or `stop` (left queued: `Ok(None)`).
    pub(super) async fn take_msg(
        &mut self,
        take: impl Fn(&Response) -> bool,
        stop: impl Fn(&Response) -> bool,
    ) -> Result<Option<Response>, AgentError> {
        loop {
            {
                let mut st = self.queue.lock();
                if let Some(why) = &st.failed {
                    return Err(AgentError::FlowControl(why.clone()));
                }
                let mut found = None;
                for (i, item) in st.items.iter().enumerate() {
                    if let Item::Msg(m, _) = item {
                        if take(m) {
                            found = Some(i);
                            break;
                        }
                        if stop(m) {
                            return Ok(None);
                        }
                    }
                }
                if let Some(item) = found.and_then(|i| st.items.remove(i)) {
                    let c = item.charge();
                    st.charged -= c;
                    self.shared.buffered.fetch_sub(c, Ordering::SeqCst);
                    if let Item::Msg(m, _) = item {
                        return Ok(Some(m));
                    }
                }
                if st.closed {
                    return Err(AgentError::Closed);
                }
            }
            self.queue.notify.notified().await;
        }
    }

    /// Whether a message matching `pred` is queued.
    pub(super) fn has_msg(&self, pred: impl Fn(&Response) -> bool) -> bool {
        self.queue
            .lock()
            .items
            .iter()
            .any(|i| matches!(i, Item::Msg(m, _) if pred(m)))
    }

    /// Grants the agent credit: the consumer has taken `consumed` data bytes
    /// in all (cumulative) and is about to tell the agent so.
    pub(super) fn grant(&self, consumed: u64) {
        let mut st = self.queue.lock();
        st.credit = st.credit.max(consumed);
    }
}

/// Where the reader hands a frame of a tunnel id; `false` if the connection
/// must close.
pub(super) type TunnelRouter =
    Box<dyn Fn(&Arc<Shared>, &mpsc::Sender<Bytes>, Frame) -> bool + Send + Sync>;

/// The running connection: what [`spawn`] hands back.
pub(super) struct Connection {
    /// State shared with the tasks.
    pub(super) shared: Arc<Shared>,
    /// Encoded frames for the writer task.
    pub(super) out: mpsc::Sender<Bytes>,
    /// The reader task (aborted when the last client handle goes).
    pub(super) reader: JoinHandle<()>,
}

/// How a connection notices an agent that stopped answering: when the
/// agent has sent nothing for `interval`, the client pings it; when it has
/// sent nothing for `silent_after`, the connection is closed (every call in
/// flight fails with [`AgentError::Closed`], [`super::AgentClient::is_closed`]
/// turns true and the owner reconnects). A guest whose vCPUs are stopped
/// cannot answer: while `active` reads `false` (the owner paused the VM)
/// silence does not count.
#[derive(Debug, Clone)]
pub struct Liveness {
    /// Quiet time after which the client sends a ping.
    pub interval: Duration,
    /// Quiet time after which the agent counts as gone.
    pub silent_after: Duration,
    /// Whether the guest can answer now (its vCPUs run); `None`: always.
    pub active: Option<Arc<AtomicBool>>,
    /// A counter that moves when the agent's end is known gone (QEMU
    /// reports the guest closed its port: the agent exited). The
    /// connection closes then, not after `silent_after` of quiet.
    pub gone: Option<tokio::sync::watch::Receiver<u64>>,
}

impl Liveness {
    /// Ping after 2 s of quiet, give up after 5 s.
    ///
    /// An idle guest is pinged every 3 s (the watchdog looks every
    /// `interval / 2`). Each ping wakes the guest and its agent: under TCG
    /// one costs ~2.7 ms of host CPU, so the 1 s interval of before (a ping
    /// every 1.5 s) was ~0.18 % of a core per idle sandbox, this is ~0.09 %
    /// (docs/bench/idle-cost.md). A silent agent is still noticed within
    /// 5–6 s, with 3 s left for a ping's reply.
    pub fn new(active: Option<Arc<AtomicBool>>) -> Self {
        Self {
            interval: Duration::from_secs(2),
            silent_after: Duration::from_secs(5),
            active,
            gone: None,
        }
    }

    /// Also closes the connection as soon as `gone` moves (see
    /// [`Liveness::gone`]).
    pub fn with_gone(mut self, gone: Option<tokio::sync::watch::Receiver<u64>>) -> Self {
        self.gone = gone;
        self
    }
}

/// Starts the reader and writer tasks on a connection whose handshake is
/// done; `dec` holds what was read past the hello reply. With `liveness`,
/// a watchdog closes the connection when the agent falls silent.
pub(super) fn spawn(
    stream: UnixStream,
    dec: FrameDecoder,
    tunnels: TunnelRouter,
    liveness: Option<Liveness>,
) -> Connection {
    let (rd, wr) = stream.into_split();
    let shared = Shared::new();
    let (out, out_rx) = mpsc::channel::<Bytes>(64);
    tokio::spawn(writer_task(wr, out_rx, shared.clone()));
    if let Some(l) = liveness {
        tokio::spawn(watchdog(Arc::downgrade(&shared), out.downgrade(), l));
    }
    let reader = tokio::spawn(reader_task(rd, dec, shared.clone(), out.clone(), tunnels));
    Connection {
        shared,
        out,
        reader,
    }
}

async fn writer_task(
    mut wr: tokio::net::unix::OwnedWriteHalf,
    mut rx: mpsc::Receiver<Bytes>,
    shared: Arc<Shared>,
) {
    loop {
        let b = tokio::select! {
            b = rx.recv() => b,
            () = shared.stop.cancelled() => return,
        };
        let Some(b) = b else { break };
        let written = tokio::select! {
            r = wr.write_all(&b) => r,
            () = shared.stop.cancelled() => return,
        };
        if let Err(e) = written {
            tracing::debug!(error = %e, "agent connection write failed");
            shared.close();
            return;
        }
    }
    let _ = wr.shutdown().await;
}

/// The watchdog's ping in flight: its route, counted in
/// [`Shared::probes`] while it lives so that [`Shared::open_calls`]
/// leaves it out.
struct Probe {
    call: Call,
}

impl Probe {
    fn new(shared: &Shared, call: Call) -> Self {
        shared.probes.fetch_add(1, Ordering::SeqCst);
        Probe { call }
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        // Uncounted here, its route removed just after (when `call`
        // drops): in between `open_calls` reads the probe as a call, never
        // fewer calls than there are (that would let a busy guest pass for
        // idle).
        self.call.shared.probes.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Pings a quiet agent and closes the connection of a silent one (see
/// [`Liveness`]). Holds the connection only weakly: it ends with it.
async fn watchdog(shared: Weak<Shared>, out: mpsc::WeakSender<Bytes>, mut live: Liveness) {
    let tick_every = (live.interval / 2).max(Duration::from_millis(50));
    let mut tick = tokio::time::interval(tick_every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The ping in flight: its reply lands here and is dropped with it.
    let mut probe: Option<Probe> = None;
    // Only moves from now on count: the value at connect is the past.
    if let Some(g) = live.gone.as_mut() {
        g.borrow_and_update();
    }
    loop {
        let gone = async {
            match live.gone.as_mut() {
                Some(g) => g.changed().await.is_ok(),
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = tick.tick() => {}
            moved = gone => {
                if !moved {
                    // The sender went with the VM handle: plain timing on.
                    live.gone = None;
                    continue;
                }
                if let Some(shared) = shared.upgrade() {
                    tracing::warn!("the guest closed the agent's port (the agent exited); closing the connection");
                    shared.close();
                }
                return;
            }
        }
        let Some(shared) = shared.upgrade() else {
            return;
        };
        if shared.is_closed() {
            return;
        }
        let running = live
            .active
            .as_ref()
            .is_none_or(|a| a.load(Ordering::SeqCst));
        if !running {
            // A stopped guest cannot answer; its silence starts on resume.
            shared.touch();
            probe = None;
            continue;
        }
        let quiet = shared.quiet_for();
        if quiet >= live.silent_after {
            tracing::warn!(
                quiet_ms = quiet.as_millis() as u64,
                "agent sent nothing, not even a ping reply; closing the connection"
            );
            shared.close();
            return;
        }
        if quiet >= live.interval && probe.is_none() {
            let Some(out) = out.upgrade() else { return };
            if let Ok(call) = shared.open() {
                // Counted as a probe before it is sent: never seen as a call.
                probe = Some(Probe::new(&shared, call));
                if let Some(p) = &probe {
                    send_detached(&out, p.call.id, &Request::Ping {});
                }
            }
        } else if quiet < live.interval {
            probe = None;
        }
    }
}

async fn reader_task(
    mut rd: tokio::net::unix::OwnedReadHalf,
    mut dec: FrameDecoder,
    shared: Arc<Shared>,
    out: mpsc::Sender<Bytes>,
    tunnels: TunnelRouter,
) {
    let mut buf = vec![0u8; 256 * 1024];
    'outer: loop {
        loop {
            match dec.next_item() {
                Ok(None) => break,
                Ok(Some(Decoded::Sync)) => {}
                Ok(Some(Decoded::Frame(f))) => {
                    if !route(&shared, &out, &tunnels, f) {
                        break 'outer;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "malformed frame from agent; closing connection");
                    break 'outer;
                }
            }
        }
        let read = tokio::select! {
            r = rd.read(&mut buf) => r,
            () = shared.stop.cancelled() => break,
        };
        match read {
            Ok(0) => break,
            Ok(n) => {
                shared.touch();
                dec.extend(&buf[..n]);
            }
            Err(e) => {
                tracing::debug!(error = %e, "agent connection read failed");
                break;
            }
        }
    }
    shared.close();
}

/// Routes one frame; `false` if the connection must close.
fn route(
    shared: &Arc<Shared>,
    out: &mpsc::Sender<Bytes>,
    tunnels: &TunnelRouter,
    f: Frame,
) -> bool {
    if is_tunnel_id(f.id) {
        return tunnels(shared, out, f);
    }
    let frame_len = f.payload.len();
    let inc = if f.kind == FrameKind::Control {
        match f.parse::<Response>() {
            Ok(r) => Incoming::Msg(r),
            Err(e) => {
                tracing::warn!(error = %e, "undecodable control message from agent");
                return false;
            }
        }
    } else {
        Incoming::Data(f.kind, f.payload)
    };
    if f.id == 0 {
        return match inc {
            Incoming::Msg(Response::HelloOk { .. }) => true,
            Incoming::Msg(Response::Error { kind, message }) => {
                tracing::warn!(%kind, message = %Escaped(&message), "agent reported a connection-level error");
                false
            }
            _ => true,
        };
    }
    let Some(queue) = shared.routes().get(&f.id).cloned() else {
        return true; // late frame of a finished call
    };
    if let Pushed::Abort(why) = queue.push(inc, frame_len, &shared.buffered) {
        tracing::warn!(id = f.id, %why, "agent broke flow control; aborting the request");
        {
            let mut routes = shared.routes();
            if routes.get(&f.id).is_some_and(|q| Arc::ptr_eq(q, &queue)) {
                routes.remove(&f.id);
            }
        }
        queue.fail(why, &shared.buffered);
        if queue.limits.kill_on_abort {
            send_detached(out, f.id, &Request::Signal { signal: 9 });
        }
        return true;
    }
    let buffered = shared.buffered();
    if buffered > CONNECTION_BUFFER_CAP {
        tracing::warn!(
            buffered,
            cap = CONNECTION_BUFFER_CAP,
            "agent output buffered past the connection's cap; closing the connection"
        );
        return false;
    }
    true
}

/// Sends `req` on `id` without waiting for room in the writer's queue.
pub(super) fn send_detached(out: &mpsc::Sender<Bytes>, id: u32, req: &Request) {
    let bytes = match Frame::control(id, req).and_then(|f| f.encode()) {
        Ok(b) => b,
        Err(e) => {
            tracing::error!(error = %e, "cannot encode a request");
            return;
        }
    };
    match out.try_send(bytes) {
        Ok(()) | Err(mpsc::error::TrySendError::Closed(_)) => {}
        Err(mpsc::error::TrySendError::Full(b)) => {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                let out = out.clone();
                rt.spawn(async move { out.send(b).await });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;
    use crate::msg::RemoteErrorKind;

    /// A log sink for one test's subscriber.
    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);

    impl Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_guest_error_message_reaches_the_log_escaped() {
        let shared = Shared::new();
        let (out, _rx) = mpsc::channel::<Bytes>(4);
        let tunnels: TunnelRouter = Box::new(|_, _, _| true);
        // What a hostile agent sends on id 0: a fake log line and a
        // terminal escape.
        let forged = "oops\n2026-12-05T00:00:00Z  INFO strata: admin logged in \u{1b}[2J";
        let frame = Frame::control(
            0,
            &Response::Error {
                kind: RemoteErrorKind::Other,
                message: forged.into(),
            },
        )
        .unwrap();
        let sink = Sink::default();
        let w = sink.clone();
        let sub = tracing_subscriber::fmt()
            .with_writer(move || w.clone())
            .with_ansi(false)
            .finish();
        let keep = tracing::subscriber::with_default(sub, || route(&shared, &out, &tunnels, frame));
        assert!(!keep, "a connection-level error closes the connection");
        let log = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
        assert_eq!(log.lines().count(), 1, "one log line: {log:?}");
        assert!(
            log.contains("agent reported a connection-level error"),
            "{log}"
        );
        assert!(
            log.contains("oops\\n2026-12-05T00:00:00Z  INFO strata: admin logged in \\u{1b}[2J"),
            "{log}"
        );
        assert!(!log.contains('\u{1b}'), "{log:?}");
    }

    /// An idle connection's liveness ping is not a call: a guest with
    /// nothing but the watchdog's ping in flight has no open calls (what
    /// pressure hibernation and admission ask before they hibernate it);
    /// a real call still counts, and so does one opened while the ping is
    /// out.
    #[tokio::test]
    async fn the_liveness_ping_is_not_an_open_call() {
        let (host, mut guest) = UnixStream::pair().expect("socket pair");
        let tunnels: TunnelRouter = Box::new(|_, _, _| true);
        let conn = spawn(
            host,
            FrameDecoder::new(),
            tunnels,
            Some(Liveness {
                gone: None,
                interval: Duration::from_millis(100),
                silent_after: Duration::from_secs(30),
                active: None,
            }),
        );
        // The guest never answers: the ping stays in flight.
        let mut got = vec![0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(5), guest.read(&mut got))
            .await
            .expect("a ping within 5 s")
            .expect("read");
        assert!(n > 0, "the watchdog sent its ping");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(conn.shared.routes().len(), 1, "the ping's route is open");
        assert_eq!(conn.shared.open_calls(), 0, "but it is not a call");
        let call = conn.shared.open().expect("open a call");
        assert_eq!(conn.shared.open_calls(), 1, "a real call counts");
        drop(call);
        assert_eq!(conn.shared.open_calls(), 0);
        drop(guest);
    }

    /// The guest closing the agent's port (`Liveness::gone` moves) closes
    /// the connection at once, long before `silent_after`; moves before the
    /// connection was made do not count.
    #[tokio::test]
    async fn a_closed_port_closes_the_connection_at_once() {
        let (host, _guest) = UnixStream::pair().expect("socket pair");
        let tunnels: TunnelRouter = Box::new(|_, _, _| true);
        let (tx, rx) = tokio::sync::watch::channel(0u64);
        tx.send_modify(|n| *n += 1);
        let conn = spawn(
            host,
            FrameDecoder::new(),
            tunnels,
            Some(Liveness {
                gone: Some(rx),
                interval: Duration::from_secs(20),
                silent_after: Duration::from_secs(30),
                active: None,
            }),
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!conn.shared.is_closed(), "an earlier closing is the past");
        let t = std::time::Instant::now();
        tx.send_modify(|n| *n += 1);
        while !conn.shared.is_closed() {
            assert!(t.elapsed() < Duration::from_secs(2), "not closed in 2 s");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
