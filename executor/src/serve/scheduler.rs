//! The scheduler: one thread that owns the `Engine` and maps requests onto its planned
//! slots with continuous batching. Each turn it admits queued requests into free slots,
//! drops requests whose client went away, then runs one step: a prompt chunk of the oldest
//! prefilling request and one decode token of every decoding slot together, in one engine
//! pass (`Engine::step_mixed`: chunked prefill, the chunk at most `ubatch` and what the pass
//! holds beside the decode rows), or whichever of the two is pending. Engines that speculate
//! (MTP) run the chunk, then the decode step with its speculative steps.
//! A request with `n` choices is `n` jobs (one slot each) sharing one event channel, queued
//! as one entry and admitted together: the first prefills the prompt, the others wait as its
//! followers and, when its last prompt chunk ran, get its context copied into their slots
//! (`Engine::copy_slot`: KV and recurrent state) and draw their first token from its logits,
//! so the prompt is prefilled once (an engine that cannot copy prefills each).
//! Prefix cache (llama-server's `cache_prompt`, by slot affinity): a slot keeps its context
//! when its request ends, with the token ids it holds; a new job goes to the free slot whose
//! held tokens share the longest prefix with its prompt (ties: least recently used), which is
//! cut back to that prefix so only the rest of the prompt is prefilled.
//! Invariant: a slot's remembered tokens are exactly the tokens its engine context holds
//! (cleared whenever the slot is reset or a pass on it fails), and only a free slot is ever
//! cut back; a slot is held only by a sequence whose event channel is open and that its
//! handler has not ended (both checked every turn, so a disconnected client or a matched stop
//! string frees the slot within one step, during prefill too); no
//! request is fed past `prompt + max_tokens <= max_context`, which the HTTP side checks
//! before queueing; the queue is bounded and never blocks the HTTP side.

use super::logit_proc::{self, History, LogitProc};
use super::metrics::{Ready, Shared, SlotView};
pub use super::prefix::{common_prefix, pick_slot, reusable, reusable_to, FreeSlot, PrefixCache};
use super::structured::Constraint;
use crate::engine::{DecodePick, Engine, EngineError, MixedPrefill, PrefixReuse};
use crate::pick::RowProc;
use crate::sampler::{Draw, Sampler, SamplingParams};
use crate::tokenizer::Tokenizer;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{self, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

/// The log-probabilities of one generated token: log-softmax of the model's raw logits
/// (before penalties, `logit_bias`, `min_p` and temperature, as vLLM returns them), and the
/// `top` most likely ids with theirs, highest first.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// What the scheduler tells a request's handler.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// One generated token (never an end-of-sequence token), with its log-probabilities when
    /// the request asked for them.
    Token(u32, Option<Box<TokenLogprobs>>),
    /// Generation ended: `eos` true for an end-of-sequence token, false for `max_tokens`.
    Done { eos: bool },
    /// The engine failed on this request.
    Error(String),
}

/// One sequence of a request ready to run (a request with `n` choices queues `n` jobs with
/// the same `id`, `index` 0..n, sharing one event channel).
pub struct Job {
    pub id: u64,
    /// Which choice of the request this is; every event is sent tagged with it.
    pub index: usize,
    pub prompt: Vec<u32>,
    /// At least 1; `prompt.len() + max_tokens <= max_context`.
    pub max_tokens: u64,
    pub sampling: SamplingParams,
    /// Logit processing, applied where the engine picks ([`Engine::decode_proc`]: on the
    /// device where it samples there; `typical_p` on the host).
    pub proc: LogitProc,
    /// `Some(k)`: send each token's log-probability and the `k` most likely alternatives
    /// (this request's rows are then read back and picked on the host).
    pub logprobs: Option<usize>,
    pub eos: Arc<[u32]>,
    pub events: UnboundedSender<(usize, Event)>,
    pub arrived: Instant,
    /// Set by the handler when it ended this sequence itself (a stop string matched): the
    /// scheduler frees its slot within a step and counts it as finished, not cancelled.
    pub ended_by_stop: Arc<AtomicBool>,
    /// Whether this job may reuse a slot's cached prefix (the request's `cache_prompt`).
    pub cache_prompt: bool,
    /// `response_format`'s grammar: every row is masked to what it allows (the mask is
    /// computed on the CPU and applied where the engine picks, like `proc`).
    pub constraint: Option<Box<Constraint>>,
}

/// Whether `b` may take `a`'s prompt context instead of prefilling (the same request and
/// prompt).
fn same_prompt(a: &Job, b: &Job) -> bool {
    a.id == b.id && a.prompt == b.prompt
}

/// Why a job was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubmitError {
    QueueFull,
    ShuttingDown,
}

/// Builds the engine (and tokenizer) on the scheduler thread, so `/health` answers 503
/// while it runs.
pub type Loader =
    Box<dyn FnOnce() -> Result<(Box<dyn Engine>, Option<Tokenizer>), String> + Send + 'static>;

/// Called once on the scheduler thread when the model is loaded (e.g. to print a banner).
pub type ReadyHook = Box<dyn FnOnce(&Ready) + Send + 'static>;

/// The HTTP side's handle on the scheduler.
#[derive(Clone)]
pub struct SchedulerHandle {
    tx: SyncSender<Vec<Job>>,
    shared: Arc<Shared>,
    stop: Arc<Stop>,
}

#[derive(Default)]
struct Stop {
    requested: AtomicBool,
    /// Milliseconds of grace given to running requests once stop is requested.
    grace_ms: AtomicU64,
}

impl SchedulerHandle {
    /// Queue a job; refused when the queue is full or the server is stopping.
    pub fn submit(&self, job: Job) -> Result<(), SubmitError> {
        self.submit_group(vec![job])
    }

    /// Queue the jobs of one request (its `n` choices) as one entry: they are admitted
    /// together, so the first can prefill for all.
    pub fn submit_group(&self, jobs: Vec<Job>) -> Result<(), SubmitError> {
        if self.stop.requested.load(Relaxed) {
            return Err(SubmitError::ShuttingDown);
        }
        let n = jobs.len() as u64;
        self.shared.queued.fetch_add(n, Relaxed);
        match self.tx.try_send(jobs) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.shared.queued.fetch_sub(n, Relaxed);
                Err(match e {
                    TrySendError::Full(_) => SubmitError::QueueFull,
                    TrySendError::Disconnected(_) => SubmitError::ShuttingDown,
                })
            }
        }
    }

    /// Stop admitting; running requests get `grace` to finish, then are cancelled.
    pub fn shutdown(&self, grace: Duration) {
        self.stop.grace_ms.store(grace.as_millis() as u64, Relaxed);
        self.stop.requested.store(true, Relaxed);
    }
}

/// A prompt chunk to run: `slot`'s prompt tokens from its `fed` to `end`, `last` when that
/// is the prompt's end.
#[derive(Debug, Clone, Copy)]
struct Chunk {
    slot: usize,
    end: usize,
    last: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Prefill,
    Decode,
}

struct Active {
    job: Job,
    phase: Phase,
    fed: usize,
    /// Prompt tokens taken from the slot's cache (not prefilled).
    reused: usize,
    generated: u64,
    last: u32,
    sampler: Sampler,
    history: History,
    /// When this sequence's last token was sampled (inter-token latency).
    last_at: Option<Instant>,
    /// While prefilling: the slot whose prompt context this one will copy instead of
    /// prefilling (a later choice of the same request).
    follows: Option<usize>,
    /// Why the request's grammar failed, when [`row_proc`] did.
    failed: Option<String>,
}

/// Start the scheduler thread: it runs `loader`, publishes readiness into `shared`, then
/// serves jobs until shut down. `queue` is the most jobs waiting for a slot; `template`
/// bounds every chat-template render; `on_ready` runs once readiness is published.
pub fn spawn(
    loader: Loader,
    shared: Arc<Shared>,
    queue: usize,
    template: super::template::TemplateLimits,
    prefix: PrefixCache,
    on_ready: ReadyHook,
) -> std::io::Result<(SchedulerHandle, std::thread::JoinHandle<()>)> {
    let (tx, rx) = mpsc::sync_channel::<Vec<Job>>(queue);
    let stop = Arc::new(Stop::default());
    let handle = SchedulerHandle {
        tx,
        shared: shared.clone(),
        stop: stop.clone(),
    };
    let th = std::thread::Builder::new()
        .name("strata-scheduler".into())
        .spawn(move || {
            let engine = match loader() {
                Ok((engine, tok)) => match super::make_ready(engine.info(), tok, template) {
                    Ok(ready) => {
                        let _ = shared.ready.set(ready);
                        if let Some(r) = shared.ready.get() {
                            on_ready(r);
                        }
                        engine
                    }
                    Err(e) => {
                        eprintln!(
                            "strata-exec serve: {}",
                            strata_schemas::text::for_terminal(&e)
                        );
                        let _ = shared.load_error.set(e);
                        shared.load_failed.notify_one();
                        return;
                    }
                },
                Err(e) => {
                    eprintln!(
                        "strata-exec serve: loading failed: {}",
                        strata_schemas::text::for_terminal(&e)
                    );
                    let _ = shared.load_error.set(e);
                    shared.load_failed.notify_one();
                    return;
                }
            };
            let sh = shared.clone();
            let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                // Run the loop on a rayon worker (as the one-shot CLI does), so the engine's
                // parallel ops start from the worker's own queue instead of being injected
                // into the pool from outside and waited for on every op.
                rayon::scope(|_| Sched::new(engine, rx, sh, stop, prefix).run());
            }));
            if res.is_err() {
                let _ = shared
                    .load_error
                    .set("the scheduler thread panicked; restart the server".into());
            }
        })?;
    Ok((handle, th))
}

struct Sched {
    engine: Box<dyn Engine>,
    rx: mpsc::Receiver<Vec<Job>>,
    /// Jobs received (whole requests) but not yet admitted, in order.
    pending: std::collections::VecDeque<Job>,
    shared: Arc<Shared>,
    stop: Arc<Stop>,
    slots: Vec<Option<Active>>,
    batch: Vec<(usize, u32)>,
    batch_slot: Vec<usize>,
    sampled: Vec<u32>,
    /// This step's sampling draws, one per batch entry.
    draws: Vec<Draw>,
    /// This step's log-probabilities, one per batch entry (for requests that asked).
    lps: Vec<Option<Box<TokenLogprobs>>>,
    /// This step's row processing, one per batch entry (the first prompt pick uses the first).
    procs: Vec<RowProc>,
    ubatch: usize,
    max_context: u64,
    /// One row of logits, for host-side processing.
    row: Vec<f32>,
    /// The last prompt position's logits of a leader, for its followers' first tokens.
    first_row: Vec<f32>,
    /// The last prompt position's logits of the chunk that ran this turn (n_vocab).
    prompt_row: Vec<f32>,
    cand: Vec<(u32, u32)>,
    prefix: PrefixCache,
    /// What the engine can keep of a slot's context.
    reuse: PrefixReuse,
    /// Per slot: the token ids its engine context holds, in order.
    cached: Vec<Vec<u32>>,
    /// Per slot: `clock` when it was last admitted into or released.
    last_used: Vec<u64>,
    clock: u64,
    /// MTP speculation: the tokens of one slot's speculative step, and which slots took one
    /// this round (they sit out the batched step).
    spec_out: Vec<u32>,
    stepped: Vec<bool>,
}

impl Sched {
    fn new(
        engine: Box<dyn Engine>,
        rx: mpsc::Receiver<Vec<Job>>,
        shared: Arc<Shared>,
        stop: Arc<Stop>,
        prefix: PrefixCache,
    ) -> Self {
        let info = engine.info().clone();
        let reuse = if prefix.enabled {
            engine.prefix_reuse()
        } else {
            PrefixReuse::None
        };
        let n = info.n_slots;
        if let Ok(mut v) = shared.slots.lock() {
            *v = (0..n)
                .map(|id| SlotView {
                    id,
                    state: "idle",
                    n_ctx: info.max_context,
                    ..Default::default()
                })
                .collect();
        }
        Self {
            rx,
            pending: std::collections::VecDeque::new(),
            shared,
            stop,
            slots: (0..n).map(|_| None).collect(),
            batch: Vec::with_capacity(n),
            batch_slot: Vec::with_capacity(n),
            sampled: Vec::with_capacity(n),
            draws: Vec::with_capacity(n),
            lps: Vec::with_capacity(n),
            procs: (0..n.max(1)).map(|_| RowProc::default()).collect(),
            ubatch: info.ubatch.max(1),
            max_context: info.max_context,
            row: Vec::with_capacity(info.n_vocab),
            first_row: Vec::new(),
            prompt_row: vec![0.0; info.n_vocab],
            cand: Vec::new(),
            prefix,
            reuse,
            cached: (0..n).map(|_| Vec::new()).collect(),
            last_used: vec![0; n],
            clock: 0,
            spec_out: vec![0; engine.spec_tokens() + 1],
            stepped: vec![false; n],
            engine,
        }
    }

    /// Forget `slot`'s context (engine and remembered tokens).
    fn reset(&mut self, slot: usize) {
        self.engine.reset_slot(slot);
        self.cached[slot].clear();
    }

    /// A request left `slot`: keep its context for the next one when the cache is on and
    /// the request did not fail (a failed pass may have left the context half written).
    fn release(&mut self, slot: usize, failed: bool) {
        if failed || self.reuse == PrefixReuse::None {
            self.reset(slot);
        }
        self.clock += 1;
        self.last_used[slot] = self.clock;
    }

    fn n_active(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    /// Release `slot`, counting how its request ended.
    fn free(&mut self, slot: usize, how: &AtomicU64) {
        if self.slots[slot].take().is_some() {
            self.release(slot, false);
            self.shared.running.fetch_sub(1, Relaxed);
            self.show_idle(slot);
            how.fetch_add(1, Relaxed);
        }
    }

    /// End `slot`'s request with `ev`. The slot is freed and counted before the event is
    /// sent, so a client that has its answer also sees it in /metrics.
    fn finish(&mut self, slot: usize, ev: Event) {
        let failed = matches!(ev, Event::Error(_));
        let Some(a) = self.slots[slot].take() else {
            return;
        };
        self.release(slot, failed);
        self.shared.running.fetch_sub(1, Relaxed);
        self.show_idle(slot);
        let counter = if failed {
            &self.shared.requests_failed
        } else {
            observe_end(&self.shared, &a, matches!(ev, Event::Done { eos: true }));
            &self.shared.requests_finished
        };
        counter.fetch_add(1, Relaxed);
        let _ = a.job.events.send((a.job.index, ev));
    }

    /// Show `slot` idle in `/slots` now, before its request's last event goes out (the
    /// turn's `publish` comes after), so a client that has its answer sees the slot free.
    fn show_idle(&self, slot: usize) {
        if let Some(v) = self
            .shared
            .slots
            .lock()
            .ok()
            .as_mut()
            .and_then(|v| v.get_mut(slot))
        {
            v.state = "idle";
            v.request_id = None;
            v.prompt_tokens = 0;
            v.prompt_done = 0;
            v.generated = 0;
            v.kv_cells = 0;
            v.reused = 0;
            v.cached = self.cached[slot].len() as u64;
        }
    }

    /// Run `job` in the free slot that holds the longest reusable prefix of its prompt
    /// (cut back to it), or in the least recently used free slot, reset.
    fn admit(&mut self, job: Job) {
        self.shared.queued.fetch_sub(1, Relaxed);
        if job.events.is_closed() {
            self.shared.requests_cancelled.fetch_add(1, Relaxed);
            return;
        }
        // A later choice of a request whose first is still prefilling follows it: a fresh
        // slot, filled by a copy once the prompt is in.
        let follows = self.slots.iter().position(|s| {
            s.as_ref().is_some_and(|a| {
                a.phase == Phase::Prefill && a.follows.is_none() && same_prompt(&a.job, &job)
            })
        });
        let reuse = if job.cache_prompt && follows.is_none() {
            self.reuse
        } else {
            PrefixReuse::None
        };
        let engine = &self.engine;
        let free = (0..self.slots.len())
            .filter(|&i| self.slots[i].is_none())
            .map(|i| FreeSlot {
                slot: i,
                // A slot whose remembered tokens disagree with its engine holds nothing
                // reusable (never expected; checked so a mismatch cannot corrupt output).
                cached: if engine.slot_len(i) == self.cached[i].len() as u64 {
                    self.cached[i].as_slice()
                } else {
                    &[]
                },
                last_used: self.last_used[i],
                checkpoint: engine.prefix_checkpoint(i).map(|c| c as usize),
            });
        let Some((slot, keep)) = pick_slot(free, &job.prompt, reuse, self.prefix.min_tokens) else {
            // Not reached: admit runs only while a slot is free.
            let _ = job
                .events
                .send((job.index, Event::Error("no free slot".into())));
            return;
        };
        let keep = if follows.is_some() { 0 } else { keep };
        let whole = keep == self.cached[slot].len();
        let keep = if keep > 0 && self.engine.truncate_slot(slot, keep as u64) {
            self.cached[slot].truncate(keep);
            self.shared.prefix_hits.fetch_add(1, Relaxed);
            if self.reuse == PrefixReuse::Whole && !whole {
                self.shared.prefix_checkpoint_hits.fetch_add(1, Relaxed);
            }
            self.shared
                .prefix_reused_tokens
                .fetch_add(keep as u64, Relaxed);
            keep
        } else {
            self.reset(slot);
            0
        };
        self.shared
            .prefix_prompt_tokens
            .fetch_add(job.prompt.len() as u64, Relaxed);
        self.clock += 1;
        self.last_used[slot] = self.clock;
        self.shared.running.fetch_add(1, Relaxed);
        self.shared
            .queue_time
            .observe(job.arrived.elapsed().as_secs_f64());
        let sampler = Sampler::new(job.sampling);
        let history = History::new(&job.prompt, &job.proc);
        self.slots[slot] = Some(Active {
            history,
            job,
            phase: Phase::Prefill,
            fed: keep,
            reused: keep,
            generated: 0,
            last: 0,
            sampler,
            last_at: None,
            failed: None,
            follows,
        });
    }

    fn run(mut self) {
        let mut deadline: Option<Instant> = None;
        loop {
            if self.stop.requested.load(Relaxed) {
                let d = *deadline.get_or_insert_with(|| {
                    Instant::now() + Duration::from_millis(self.stop.grace_ms.load(Relaxed))
                });
                if self.n_active() == 0 || Instant::now() >= d {
                    self.close_all();
                    return;
                }
            } else {
                // Admit into free slots; block briefly only when there is nothing to run.
                while self.slots.iter().any(|s| s.is_none()) {
                    if let Some(job) = self.pending.pop_front() {
                        self.admit(job);
                        continue;
                    }
                    let got = if self.n_active() == 0 {
                        match self.rx.recv_timeout(Duration::from_millis(50)) {
                            Ok(j) => Some(j),
                            Err(RecvTimeoutError::Timeout) => None,
                            Err(RecvTimeoutError::Disconnected) => {
                                self.close_all();
                                return;
                            }
                        }
                    } else {
                        match self.rx.try_recv() {
                            Ok(j) => Some(j),
                            Err(TryRecvError::Empty) | Err(TryRecvError::Disconnected) => None,
                        }
                    };
                    match got {
                        Some(jobs) => self.pending.extend(jobs),
                        None => break,
                    }
                }
            }
            // Drop sequences whose client went away (or whose handler matched a stop string).
            for slot in 0..self.slots.len() {
                let Some(a) = self.slots[slot].as_ref() else {
                    continue;
                };
                let stopped = a.job.ended_by_stop.load(Relaxed);
                if stopped {
                    observe_end(&self.shared, a, false);
                }
                if stopped || a.job.events.is_closed() {
                    let shared = self.shared.clone();
                    let how = if stopped {
                        &shared.requests_finished
                    } else {
                        &shared.requests_cancelled
                    };
                    self.free(slot, how);
                }
            }
            self.step();
            self.publish();
        }
    }

    /// This turn's passes. With a prompt chunk and decoding slots both pending, one
    /// [`Engine::step_mixed`] runs them together (chunked prefill: a long prompt does not
    /// stall the other slots' tokens, and the weights are read once for both), the chunk
    /// bounded by what the engine's pass holds beside the decode rows; otherwise whichever is
    /// pending. An engine that speculates (MTP) runs the chunk, then its decode step.
    fn step(&mut self) {
        if self.engine.spec_tokens() > 0 {
            if let Some(c) = self.next_chunk(self.ubatch) {
                self.prefill_step(c);
            }
            self.decode_step();
            return;
        }
        self.stepped.fill(false);
        self.collect_batch();
        let d = self.batch.len();
        let room = if d == 0 {
            0
        } else {
            self.engine.mixed_chunk(d).min(self.ubatch)
        };
        if room > 0 {
            if let Some(c) = self.next_chunk(room) {
                self.run_batch(Some(c));
                return;
            }
        }
        if let Some(c) = self.next_chunk(self.ubatch) {
            self.prefill_step(c);
        }
        if d > 0 {
            self.run_batch(None);
        }
    }

    /// The next chunk, of at most `room` tokens, of the oldest prefilling request that
    /// prefills itself (not a follower).
    fn next_chunk(&mut self, room: usize) -> Option<Chunk> {
        self.orphan_followers();
        let slot = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                s.as_ref()
                    .filter(|a| a.phase == Phase::Prefill && a.follows.is_none())
                    .map(|a| (a.job.id, i))
            })
            .min()
            .map(|(_, i)| i)?;
        let a = self.slots[slot].as_ref()?;
        let end = (a.fed + room.max(1)).min(a.job.prompt.len());
        Some(Chunk {
            slot,
            end,
            last: end == a.job.prompt.len(),
        })
    }

    /// Run chunk `c` alone.
    fn prefill_step(&mut self, c: Chunk) {
        let Some(a) = self.slots[c.slot].as_ref() else {
            return;
        };
        let res = match self
            .engine
            .prefill(c.slot, &a.job.prompt[a.fed..c.end], c.last)
        {
            Ok(Some(l)) => {
                self.prompt_row.clear();
                self.prompt_row.extend_from_slice(l);
                Ok(true)
            }
            Ok(None) => Ok(false),
            Err(e) => Err(engine_msg(&e)),
        };
        self.after_chunk(c, res);
    }

    /// Chunk `c` ran (`Ok(true)`: its last row's logits are in `prompt_row`) or failed;
    /// after the prompt's last chunk, the request's first token, and its followers get its
    /// context and their first tokens.
    fn after_chunk(&mut self, c: Chunk, res: Result<bool, String>) {
        let slot = c.slot;
        let got = match res {
            Ok(got) => got,
            Err(msg) => {
                self.finish(slot, Event::Error(msg));
                return;
            }
        };
        let followers: Vec<usize> = (0..self.slots.len())
            .filter(|&f| {
                self.slots[f]
                    .as_ref()
                    .is_some_and(|b| b.follows == Some(slot))
            })
            .collect();
        let Some(a) = self.slots[slot].as_mut() else {
            return;
        };
        self.shared
            .prompt_tokens
            .fetch_add((c.end - a.fed) as u64, Relaxed);
        self.cached[slot].extend_from_slice(&a.job.prompt[a.fed..c.end]);
        a.fed = c.end;
        if !c.last {
            return;
        }
        if !got {
            self.finish(
                slot,
                Event::Error("the engine returned no logits for the last prompt chunk".into()),
            );
            return;
        }
        if !followers.is_empty() {
            self.first_row.clear();
            self.first_row.extend_from_slice(&self.prompt_row);
        }
        match first_pick(
            a,
            &self.prompt_row,
            &mut self.procs[0],
            &mut self.row,
            &mut self.cand,
        ) {
            Err(msg) => self.finish(slot, Event::Error(msg)),
            Ok((tok, lp)) => {
                self.save_checkpoint(slot);
                // Copies first: ending the leader may reset its slot.
                self.start_followers(slot, &followers);
                self.first_token(slot, tok, lp);
            }
        }
    }

    /// `slot` holds its whole prompt and nothing after it: save its recurrent state as the
    /// slot's prefix checkpoint (engines with [`PrefixReuse::Whole`], cache on), so a later
    /// prompt that shares this one but not the reply (a chat client re-rendering the answer,
    /// a regenerated or edited turn) rewinds the slot here instead of prefilling anew.
    fn save_checkpoint(&mut self, slot: usize) {
        if self.reuse != PrefixReuse::Whole {
            return;
        }
        if let Err(e) = self.engine.save_prefix_checkpoint(slot) {
            tracing::warn!(target: "strata_exec::serve", "saving slot {slot}'s prefix checkpoint failed (the next request prefills anew): {e}");
        }
    }

    /// `slot` drew its first token `tok`: it decodes from now on.
    fn first_token(&mut self, slot: usize, tok: u32, lp: Option<Box<TokenLogprobs>>) {
        if let Some(a) = self.slots[slot].as_mut() {
            self.shared
                .ttft
                .observe(a.job.arrived.elapsed().as_secs_f64());
            a.phase = Phase::Decode;
        }
        self.after_sample(slot, tok, lp);
    }

    /// The leader `leader` has prefilled the prompt (its last row in `first_row`): copy its
    /// context into each follower's slot and draw the follower's first token from that row.
    /// A follower whose copy the engine refuses prefills the prompt itself.
    fn start_followers(&mut self, leader: usize, followers: &[usize]) {
        let row = std::mem::take(&mut self.first_row);
        for &f in followers {
            let copied = match self.engine.copy_slot(leader, f) {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(target: "strata_exec::serve", "copying slot {leader} to {f} failed, prefilling instead: {e}");
                    false
                }
            };
            if !copied {
                self.reset(f);
                if let Some(b) = self.slots[f].as_mut() {
                    b.follows = None;
                }
                continue;
            }
            self.cached[f] = self.cached[leader].clone();
            self.save_checkpoint(f);
            let Some(b) = self.slots[f].as_mut() else {
                continue;
            };
            b.follows = None;
            b.fed = b.job.prompt.len();
            self.shared
                .prompt_tokens_copied
                .fetch_add(b.fed as u64, Relaxed);
            match first_pick(b, &row, &mut self.procs[0], &mut self.row, &mut self.cand) {
                Err(msg) => self.finish(f, Event::Error(msg)),
                Ok((tok, lp)) => self.first_token(f, tok, lp),
            }
        }
        self.first_row = row;
    }

    /// Followers whose leader is gone (failed, cancelled) or past its prompt prefill their
    /// prompt themselves.
    fn orphan_followers(&mut self) {
        for f in 0..self.slots.len() {
            let Some((l, id)) = self.slots[f]
                .as_ref()
                .and_then(|b| b.follows.map(|l| (l, b.job.id)))
            else {
                continue;
            };
            let alive = self.slots.get(l).and_then(|s| s.as_ref()).is_some_and(|a| {
                a.phase == Phase::Prefill && a.follows.is_none() && a.job.id == id
            });
            if !alive {
                if let Some(b) = self.slots[f].as_mut() {
                    b.follows = None;
                }
            }
        }
    }

    /// Deliver a sampled token; end the request on EOS, `max_tokens` or a full context.
    fn after_sample(&mut self, slot: usize, tok: u32, lp: Option<Box<TokenLogprobs>>) {
        let max_context = self.max_context;
        let Some(a) = self.slots[slot].as_mut() else {
            return;
        };
        a.generated += 1;
        a.history.push(tok);
        let now = Instant::now();
        if let Some(t) = a.last_at.replace(now) {
            self.shared
                .inter_token
                .observe(now.duration_since(t).as_secs_f64());
        }
        self.shared.generated_tokens.fetch_add(1, Relaxed);
        if a.job.eos.contains(&tok) {
            self.finish(slot, Event::Done { eos: true });
            return;
        }
        if let Some(c) = a.job.constraint.as_mut() {
            if let Err(e) = c.advance(tok) {
                self.finish(slot, Event::Error(e));
                return;
            }
        }
        a.last = tok;
        let _ = a.job.events.send((a.job.index, Event::Token(tok, lp)));
        let cells = a.job.prompt.len() as u64 + a.generated;
        if a.generated >= a.job.max_tokens || cells > max_context {
            self.finish(slot, Event::Done { eos: false });
        }
    }

    /// With an engine that speculates (MTP), one speculative step for each decoding slot
    /// whose request is picked without host-side logits: the engine drafts and verifies that
    /// slot's tokens in one pass (greedy: the tokens plain decoding gives; sampled: the
    /// speculative sampling rule), each delivered as a sampled token (the rest dropped once
    /// the request ends).
    fn spec_steps(&mut self) {
        self.stepped.fill(false);
        if self.engine.spec_tokens() == 0 {
            return;
        }
        for slot in 0..self.slots.len() {
            let Some(a) = self.slots[slot].as_ref() else {
                continue;
            };
            if a.phase != Phase::Decode || processed(a) {
                continue;
            }
            let (id, index, tok) = (a.job.id, a.job.index, a.last);
            self.stepped[slot] = true;
            let draw = match self.slots[slot].as_mut() {
                Some(a) => a.sampler.next_draw(),
                None => continue,
            };
            let t0 = Instant::now();
            let res = if draw.is_greedy() {
                self.engine
                    .decode_spec_greedy(slot, tok, None, &mut self.spec_out)
            } else {
                self.engine
                    .decode_spec_sample(slot, tok, &draw, None, &mut self.spec_out)
            };
            let got = match res {
                Ok(n) => n,
                Err(e) => {
                    self.finish(slot, Event::Error(engine_msg(&e)));
                    continue;
                }
            };
            let rate = got as f64 / t0.elapsed().as_secs_f64().max(1e-9);
            let old = self.shared.tokens_per_s();
            let new = if old == 0.0 {
                rate
            } else {
                0.9 * old + 0.1 * rate
            };
            self.shared.tokens_per_s.store(new.to_bits(), Relaxed);
            // The slot's context now holds `tok` and the accepted drafts.
            self.cached[slot].push(tok);
            let accepted = &self.spec_out[..got - 1];
            self.cached[slot].extend_from_slice(accepted);
            for i in 0..got {
                let same = self.slots[slot]
                    .as_ref()
                    .is_some_and(|a| a.job.id == id && a.job.index == index);
                if !same {
                    break;
                }
                let t = self.spec_out[i];
                self.after_sample(slot, t, None);
            }
        }
    }

    /// One decode step over every decoding slot (after the speculative steps).
    fn decode_step(&mut self) {
        self.spec_steps();
        self.collect_batch();
        if !self.batch.is_empty() {
            self.run_batch(None);
        }
    }

    /// This step's batch: every decoding slot that took no speculative step.
    fn collect_batch(&mut self) {
        self.batch.clear();
        self.batch_slot.clear();
        for (i, s) in self.slots.iter().enumerate() {
            if self.stepped[i] {
                continue;
            }
            if let Some(a) = s.as_ref().filter(|a| a.phase == Phase::Decode) {
                self.batch.push((i, a.last));
                self.batch_slot.push(i);
            }
        }
    }

    /// The decode step of `batch` (not empty), with `chunk` in the same engine step when
    /// given ([`Engine::step_mixed`]); a failed step ends every request in it.
    fn run_batch(&mut self, chunk: Option<Chunk>) {
        let t0 = Instant::now();
        // Each slot's draw and row processing for this step; the engine processes and
        // samples (on its device where it can, with a plain argmax when every request is
        // greedy and unprocessed).
        self.draws.clear();
        self.sampled.clear();
        self.sampled.resize(self.batch.len(), u32::MAX);
        let mut host = false;
        for (k, &slot) in self.batch_slot.iter().enumerate() {
            let p = &mut self.procs[k];
            let Some(a) = self.slots[slot].as_mut() else {
                self.draws.push(Draw::GREEDY);
                p.clear();
                continue;
            };
            let d = a.sampler.next_draw();
            self.draws.push(d);
            if let Err(e) = row_proc(a, &d, p) {
                // The row still runs (its slot's token is in the batch); its pick is dropped.
                a.failed = Some(e);
                p.clear();
            }
            host |= a.job.logprobs.is_some() || !p.fits_device(usize::MAX);
        }
        self.lps.clear();
        self.lps.resize(self.batch.len(), None);
        let n = self.batch.len();
        let v = self.engine.info().n_vocab;
        let res = match chunk {
            None if host => self.engine.decode(&self.batch).map(Some),
            None => self
                .engine
                .decode_proc(
                    &self.batch,
                    &self.draws,
                    &self.procs[..n],
                    &mut self.sampled,
                )
                .map(|()| None),
            Some(c) => {
                let tokens = match self.slots[c.slot].as_ref() {
                    Some(a) => &a.job.prompt[a.fed..c.end],
                    None => &[][..],
                };
                let prefill = MixedPrefill {
                    slot: c.slot,
                    tokens,
                    want_logits: c.last,
                };
                let pick = if host {
                    DecodePick::Logits
                } else {
                    DecodePick::Proc {
                        draws: &self.draws,
                        procs: &self.procs[..n],
                        out: &mut self.sampled,
                    }
                };
                self.engine
                    .step_mixed(prefill, &mut self.prompt_row, &self.batch, pick)
            }
        };
        let res = match res {
            Err(e) => Err(e),
            Ok(None) => Ok(()),
            Ok(Some(logits)) => {
                // Some row needs its raw logits (logprobs) or a host-only cut (typical_p):
                // every row came back; pick here, by the same processing.
                for (k, row) in logits.chunks_exact(v.max(1)).enumerate().take(n) {
                    let slot = self.batch_slot[k];
                    let tok =
                        self.procs[k].pick(row, &self.draws[k], &mut self.row, &mut self.cand);
                    self.sampled[k] = tok;
                    if let Some(a) = self.slots[slot].as_ref() {
                        if tok != crate::sampler::NON_FINITE {
                            self.lps[k] = token_logprobs(a, row, tok);
                        }
                    }
                }
                Ok(())
            }
        };
        for (k, &slot) in self.batch_slot.iter().enumerate() {
            if self.slots[slot]
                .as_ref()
                .is_some_and(|a| a.failed.is_some())
            {
                self.sampled[k] = GRAMMAR_FAILED;
            }
        }
        if let Err(e) = res {
            let msg = engine_msg(&e);
            for k in 0..self.batch_slot.len() {
                let slot = self.batch_slot[k];
                self.finish(slot, Event::Error(msg.clone()));
            }
            if let Some(c) = chunk {
                self.finish(c.slot, Event::Error(msg));
            }
            return;
        }
        let dt = t0.elapsed().as_secs_f64().max(1e-9);
        let rate = self.batch.len() as f64 / dt;
        let old = self.shared.tokens_per_s();
        let new = if old == 0.0 {
            rate
        } else {
            0.9 * old + 0.1 * rate
        };
        self.shared.tokens_per_s.store(new.to_bits(), Relaxed);
        // Every entry's token is now in its slot's context.
        for &(slot, tok) in &self.batch {
            self.cached[slot].push(tok);
        }
        for k in 0..self.batch_slot.len() {
            let slot = self.batch_slot[k];
            let tok = self.sampled[k];
            if tok == u32::MAX {
                self.finish(
                    slot,
                    Event::Error("the engine returned too few logits rows".into()),
                );
            } else if tok == crate::sampler::NON_FINITE {
                let at = format!(
                    "generated token {}",
                    self.slots[slot].as_ref().map_or(0, |a| a.generated + 1)
                );
                self.finish(slot, Event::Error(crate::sampler::non_finite_message(&at)));
            } else if tok == GRAMMAR_FAILED {
                let msg = self.slots[slot]
                    .as_mut()
                    .and_then(|a| a.failed.take())
                    .unwrap_or_default();
                self.finish(slot, Event::Error(msg));
            } else {
                let lp = self.lps[k].take();
                self.after_sample(slot, tok, lp);
            }
        }
        if let Some(c) = chunk {
            self.shared.mixed_steps.fetch_add(1, Relaxed);
            self.after_chunk(c, Ok(c.last));
        }
    }

    fn publish(&mut self) {
        let stats = self.engine.stats();
        self.shared.expert_hits.store(stats.expert_hits, Relaxed);
        self.shared
            .expert_misses
            .store(stats.expert_misses, Relaxed);
        self.shared
            .expert_misses_cpu
            .store(stats.expert_misses_cpu, Relaxed);
        self.shared
            .expert_bytes_streamed
            .store(stats.expert_bytes_streamed, Relaxed);
        let s = stats.speculation;
        self.shared.spec_steps.store(s.steps, Relaxed);
        self.shared.spec_drafted.store(s.drafted, Relaxed);
        self.shared.spec_accepted.store(s.accepted, Relaxed);
        let Ok(mut views) = self.shared.slots.lock() else {
            return;
        };
        for (i, v) in views.iter_mut().enumerate() {
            let len = self.engine.slot_len(i);
            match self.slots.get(i).and_then(|s| s.as_ref()) {
                None => {
                    v.state = "idle";
                    v.request_id = None;
                    v.prompt_tokens = 0;
                    v.prompt_done = 0;
                    v.generated = 0;
                    v.kv_cells = 0;
                    v.reused = 0;
                    v.cached = len;
                }
                Some(a) => {
                    v.kv_cells = len;
                    v.cached = 0;
                    v.reused = a.reused as u64;
                    v.state = match a.phase {
                        Phase::Prefill => "prefill",
                        Phase::Decode => "decode",
                    };
                    v.request_id = Some(a.job.id);
                    v.prompt_tokens = a.job.prompt.len() as u64;
                    v.prompt_done = a.fed as u64;
                    v.generated = a.generated;
                }
            }
        }
    }

    /// Cancel everything running or queued (shutdown).
    fn close_all(&mut self) {
        for slot in 0..self.slots.len() {
            if self.slots[slot].is_some() {
                self.finish(slot, Event::Error("the server is shutting down".into()));
            }
        }
        let mut queued: Vec<Job> = self.pending.drain(..).collect();
        while let Ok(jobs) = self.rx.try_recv() {
            queued.extend(jobs);
        }
        for job in queued {
            self.shared.queued.fetch_sub(1, Relaxed);
            let _ = job.events.send((
                job.index,
                Event::Error("the server is shutting down".into()),
            ));
        }
        self.publish();
    }
}

/// A sequence ended normally (`eos`: with an end-of-sequence token, which is not counted
/// as generated text): its end-to-end latency and sizes.
fn observe_end(shared: &Shared, a: &Active, eos: bool) {
    shared.e2e.observe(a.job.arrived.elapsed().as_secs_f64());
    shared.prompt_len.observe(a.job.prompt.len() as f64);
    let sent = a.generated.saturating_sub(u64::from(eos));
    shared.generation_len.observe(sent as f64);
}

/// `a`'s first token from the last prompt position's raw logits (processed by `proc`, built
/// here), with its log-probabilities when asked; the error a request ends with when the row
/// is not finite or the grammar failed.
fn first_pick(
    a: &mut Active,
    logits: &[f32],
    proc: &mut RowProc,
    row: &mut Vec<f32>,
    cand: &mut Vec<(u32, u32)>,
) -> Result<(u32, Option<Box<TokenLogprobs>>), String> {
    let d = a.sampler.next_draw();
    row_proc(a, &d, proc)?;
    let tok = proc.pick(logits, &d, row, cand);
    if tok == crate::sampler::NON_FINITE {
        return Err(crate::sampler::non_finite_message(
            "the last prompt position",
        ));
    }
    Ok((tok, token_logprobs(a, logits, tok)))
}

/// Whether `a`'s rows need more than a plain draw (processing, a grammar, logprobs): such a
/// request takes no speculative (MTP) steps.
fn processed(a: &Active) -> bool {
    !a.job.proc.is_neutral() || a.job.logprobs.is_some() || a.job.constraint.is_some()
}

/// The log-probabilities of `tok` in the raw row `logits`, when `a` asked for them.
fn token_logprobs(a: &Active, logits: &[f32], tok: u32) -> Option<Box<TokenLogprobs>> {
    let k = a.job.logprobs?;
    let (logprob, top) = logit_proc::logprobs(logits, tok, k);
    Some(Box::new(TokenLogprobs { logprob, top }))
}

/// `a`'s processing of the row its draw `d` picks from, into `out`: the grammar's mask for
/// this step (computed here, on the CPU), then its [`LogitProc`]'s edits and cuts. Fails,
/// with the reason, when the grammar cannot give a mask.
fn row_proc(a: &mut Active, d: &Draw, out: &mut RowProc) -> Result<(), String> {
    out.clear();
    a.job.proc.row_proc(&a.history, d.temperature, out);
    if let Some(c) = a.job.constraint.as_mut() {
        c.mask_words(out.mask.get_or_insert_with(Vec::new))?;
    }
    Ok(())
}

/// The pick of a row whose grammar failed this step (reason in `Active::failed`).
const GRAMMAR_FAILED: u32 = u32::MAX - 2;

fn engine_msg(e: &EngineError) -> String {
    match e {
        EngineError::Request(m) => m.clone(),
        EngineError::Internal(m) => {
            tracing::error!(target: "strata_exec::serve", "engine failure: {m}");
            format!("engine failure: {m}")
        }
    }
}
