//! The step agreement on the control group: what each rank contributes at a step boundary,
//! how rank 0's message reaches every rank, and the byte layout of that message.
//!
//! # Admission (one `all_reduce(MAX)` of `i64` words)
//!
//! | word | every rank contributes | after MAX |
//! | --- | --- | --- |
//! | 0 | state: go = 0, stop = 1, failed = 2 (either kind) | the worst state |
//! | 1, 2 | epoch, step | the highest |
//! | 3, 4 | -epoch, -step | minus the lowest: a mismatch is a [`Error::Desync`] |
//! | 5 | rank + 1 if failed on its own, else 0 | the failed rank, named in the peers' errors |
//! | 6 | rank + 1 if asking to stop, else 0 | a rank that asked to stop |
//! | 7 | rank 0: message length in bytes; others 0 | the length |
//! | 8.. | rank 0: the message, little-endian bytes packed in words; others `i64::MIN` | the message |
//!
//! A message of up to [`INLINE_BYTES`] rides in the admission itself (so a step costs two
//! collectives); a longer one is broadcast from rank 0 right after, and only when the state
//! is go. The confirmation (the second check, after every rank prepared the step) is the
//! first eight words alone; the different lengths make a rank that is one phase off fail
//! with a mismatch instead of pairing the wrong calls.
//!
//! # Message (rank 0's bytes)
//!
//! `kind: u8, epoch: u64, step: u64`, then by kind (all integers little-endian):
//! - 1 `Open`: a [`SessionConfig`] (`model: u32 len + utf-8`, `max_steps: u8 flag + u64`,
//!   `token_budget: u32`, `max_batch: u32`);
//! - 2 `Step`: `entries: u32`, each `seq: u64, start: u32, reserve: u32, sample: u8, n: u32,
//!   tokens: n x u32, b: u32, blocks: b x u32`; then `released: u32`, each `seq: u64`;
//! - 3 `Idle`: nothing;
//! - 4 `Close`: `decision: u8` (0 stop, 1 keep open, 2 replace) and, for replace, a
//!   [`SessionConfig`].

use crate::error::{Error, Result};
use crate::plan::{PlanEntry, SeqSampling, SessionConfig, SessionDecision, StepPlan};
use crate::sampler::SamplingParams;
use collectives::{Collective, Communicator, ReduceOp};
use text::Grammar;

/// Words of the admission header (and of the whole confirmation).
pub const HEADER_WORDS: usize = 8;
/// The longest message that rides inside the admission reduce.
pub const INLINE_BYTES: usize = 120;
const ADMISSION_WORDS: usize = HEADER_WORDS + INLINE_BYTES / 8;

/// What a rank says at a boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum State {
    /// Ready to run what rank 0 sends.
    Go = 0,
    /// Asks the session to stop at this boundary.
    Stop = 1,
    /// Failed on its own (the original failure); it will not run the step. The engine's
    /// origin does not contribute it (it poisons the control group and waits on nobody); it is
    /// what the agreement reports when only ranks that failed after a peer met.
    Failed = 2,
    /// Failed because another rank did (a data-group collective reported the peer): says
    /// failed without claiming to be the origin, so the origin is the rank peers name.
    FailedAfterPeer = 3,
}

impl State {
    fn word(self) -> i64 {
        match self {
            State::Go => 0,
            State::Stop => 1,
            State::Failed | State::FailedAfterPeer => 2,
        }
    }
}

/// One rank's contribution to a boundary.
#[derive(Debug, Clone, Copy)]
pub struct Contribution<'a> {
    /// This rank's state.
    pub state: State,
    /// The session this rank is in.
    pub epoch: u64,
    /// The steps this rank completed in the session.
    pub step: u64,
    /// Rank 0's encoded [`Message`] (ignored on other ranks).
    pub message: Option<&'a [u8]>,
}

/// What every rank learns from a boundary: identical everywhere.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Agreed {
    /// The worst state any rank contributed ([`State::Failed`] for both kinds of failure).
    pub state: State,
    /// A rank that failed on its own, if any.
    pub failed: Option<usize>,
    /// A rank that asked to stop, if any.
    pub stopped: Option<usize>,
}

/// Rank 0's message at a boundary.
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    /// A session opens with this config.
    Open(SessionConfig),
    /// Run this step.
    Step(StepPlan),
    /// Nothing to run this tick; the session stays open.
    Idle,
    /// The session's model work ended; rank 0 decided what follows.
    Close(SessionDecision),
}

/// Reusable buffers for the boundaries of one rank, so a step allocates little.
#[derive(Debug, Default)]
pub struct Agreement {
    words: Vec<i64>,
    message: Vec<u8>,
}

impl Agreement {
    /// Empty buffers.
    pub fn new() -> Self {
        Agreement::default()
    }

    /// The admission: every rank contributes its state, epoch and step; rank 0 also its
    /// message, which every rank can then read with [`Agreement::message`] (empty unless the
    /// agreed state is go).
    ///
    /// # Errors
    /// [`Error::Collective`] when the reduce or broadcast fails (deadline, dead peer...),
    /// [`Error::Desync`] when ranks are at different epochs or steps.
    pub fn admit(&mut self, comm: &mut dyn Communicator, c: Contribution<'_>) -> Result<Agreed> {
        let rank = comm.rank();
        let message = if rank == 0 { c.message.unwrap_or(&[]) } else { &[] };
        let inline = message.len() <= INLINE_BYTES;
        self.words.clear();
        self.words.extend_from_slice(&header(rank, &c, message.len()));
        self.words.resize(ADMISSION_WORDS, i64::MIN);
        if rank == 0 && inline {
            for (w, chunk) in self.words[HEADER_WORDS..].iter_mut().zip(message.chunks(8)) {
                let mut b = [0u8; 8];
                b[..chunk.len()].copy_from_slice(chunk);
                *w = i64::from_le_bytes(b);
            }
        }
        let fail = |source| Error::Collective {
            op: "admission",
            rank,
            epoch: c.epoch,
            step: c.step,
            source: Box::new(source),
        };
        comm.all_reduce(&mut self.words, ReduceOp::Max).map_err(fail)?;
        let agreed = read_header(&self.words, rank, "admission", &c)?;
        self.message.clear();
        if agreed.state != State::Go {
            return Ok(agreed);
        }
        let len = usize::try_from(self.words[7]).unwrap_or(0);
        if len <= INLINE_BYTES {
            for w in &self.words[HEADER_WORDS..] {
                self.message.extend_from_slice(&w.to_le_bytes());
            }
            self.message.truncate(len);
        } else {
            if rank == 0 {
                self.message.extend_from_slice(message);
            } else {
                self.message.resize(len, 0);
            }
            comm.broadcast(&mut self.message, 0).map_err(|source| Error::Collective {
                op: "plan broadcast",
                rank,
                epoch: c.epoch,
                step: c.step,
                source: Box::new(source),
            })?;
        }
        Ok(agreed)
    }

    /// The message of the last admission (empty unless it agreed on go).
    pub fn message(&self) -> &[u8] {
        &self.message
    }

    /// The confirmation after every rank prepared the step: state, epoch and step only.
    ///
    /// # Errors
    /// As [`Agreement::admit`].
    pub fn confirm(&mut self, comm: &mut dyn Communicator, c: Contribution<'_>) -> Result<Agreed> {
        let rank = comm.rank();
        let mut words = header(rank, &c, 0);
        comm.all_reduce(&mut words, ReduceOp::Max).map_err(|source| Error::Collective {
            op: "confirmation",
            rank,
            epoch: c.epoch,
            step: c.step,
            source: Box::new(source),
        })?;
        read_header(&words, rank, "confirmation", &c)
    }
}

fn header(rank: usize, c: &Contribution<'_>, len: usize) -> [i64; HEADER_WORDS] {
    let (epoch, step) = (c.epoch as i64, c.step as i64);
    let me = rank as i64 + 1;
    [
        c.state.word(),
        epoch,
        step,
        -epoch,
        -step,
        if c.state == State::Failed { me } else { 0 },
        if c.state == State::Stop { me } else { 0 },
        if rank == 0 { len as i64 } else { 0 },
    ]
}

fn read_header(w: &[i64], rank: usize, op: &'static str, c: &Contribution<'_>) -> Result<Agreed> {
    let (max_epoch, max_step, min_epoch, min_step) = (w[1], w[2], -w[3], -w[4]);
    if max_epoch != min_epoch || max_step != min_step {
        return Err(Error::Desync {
            op,
            rank,
            epoch: c.epoch,
            step: c.step,
            detail: format!(
                "ranks are at epochs {min_epoch}..={max_epoch} and steps {min_step}..={max_step}"
            ),
        });
    }
    let state = match w[0] {
        0 => State::Go,
        1 => State::Stop,
        _ => State::Failed,
    };
    let who = |x: i64| usize::try_from(x - 1).ok();
    Ok(Agreed { state, failed: who(w[5]), stopped: who(w[6]) })
}

/// Encodes rank 0's message for the boundary at (`epoch`, `step`) into `out` (cleared first).
pub fn encode(msg: &Message, epoch: u64, step: u64, out: &mut Vec<u8>) {
    out.clear();
    let kind = match msg {
        Message::Open(_) => 1u8,
        Message::Step(_) => 2,
        Message::Idle => 3,
        Message::Close(_) => 4,
    };
    out.push(kind);
    out.extend_from_slice(&epoch.to_le_bytes());
    out.extend_from_slice(&step.to_le_bytes());
    match msg {
        Message::Open(cfg) => put_config(cfg, out),
        Message::Step(plan) => {
            put_u32(out, plan.entries.len() as u32);
            for e in &plan.entries {
                out.extend_from_slice(&e.seq.to_le_bytes());
                put_u32(out, e.start);
                put_u32(out, e.reserve);
                out.push(u8::from(e.sample));
                put_u32(out, e.tokens.len() as u32);
                for t in &e.tokens {
                    put_u32(out, *t);
                }
                put_u32(out, e.blocks.len() as u32);
                for b in &e.blocks {
                    put_u32(out, *b);
                }
                match &e.sampling {
                    None => out.push(0),
                    Some(s) => {
                        out.push(1);
                        put_sampling(s, out);
                    }
                }
            }
            put_u32(out, plan.released.len() as u32);
            for s in &plan.released {
                out.extend_from_slice(&s.to_le_bytes());
            }
        }
        Message::Idle => {}
        Message::Close(d) => match d {
            SessionDecision::Stop => out.push(0),
            SessionDecision::KeepOpen => out.push(1),
            SessionDecision::Replace(cfg) => {
                out.push(2);
                put_config(cfg, out);
            }
        },
    }
}

/// Why a control message does not decode: the first malformed field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// A field runs past the end of the message.
    #[error("{what} at byte {at} runs past the end ({len} bytes)")]
    Truncated {
        /// The field.
        what: &'static str,
        /// Its first byte.
        at: usize,
        /// The message's length.
        len: usize,
    },
    /// A count whose bytes would overflow.
    #[error("{0} count overflows")]
    Overflow(&'static str),
    /// More plan entries than the message could hold.
    #[error("{entries} entries cannot fit in {len} bytes")]
    TooManyEntries {
        /// The count read.
        entries: usize,
        /// The message's length.
        len: usize,
    },
    /// A message kind this version does not know.
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    /// A session decision this version does not know.
    #[error("unknown decision {0}")]
    UnknownDecision(u8),
    /// The model name is not UTF-8.
    #[error("model is not utf-8")]
    ModelNotUtf8,
    /// A text field is not UTF-8.
    #[error("{0} is not utf-8")]
    NotUtf8(&'static str),
    /// A constraint kind this version does not know.
    #[error("unknown constraint kind {0}")]
    UnknownConstraint(u8),
    /// Bytes after the message's last field.
    #[error("{0} trailing bytes after the message")]
    Trailing(usize),
}

/// Decodes a message; returns its epoch, step and content (the engine decodes in place, with
/// [`decode_into`]).
///
/// # Errors
/// A description of the first malformed field.
#[cfg(any(test, feature = "bench-internals"))]
pub fn decode(bytes: &[u8]) -> std::result::Result<(u64, u64, Message), DecodeError> {
    let mut msg = Message::Idle;
    let (epoch, step) = decode_into(bytes, &mut msg)?;
    Ok((epoch, step, msg))
}

/// Decodes a message into `out`, reusing the buffers of a step plan already there (a worker
/// decodes one plan per step); returns its epoch and step. On error `out` is unspecified.
///
/// # Errors
/// A description of the first malformed field.
pub fn decode_into(
    bytes: &[u8],
    out: &mut Message,
) -> std::result::Result<(u64, u64), DecodeError> {
    let mut r = Reader { bytes, at: 0 };
    let kind = r.u8("kind")?;
    let epoch = r.u64("epoch")?;
    let step = r.u64("step")?;
    match kind {
        1 => *out = Message::Open(r.config()?),
        2 => {
            if !matches!(out, Message::Step(_)) {
                *out = Message::Step(StepPlan::default());
            }
            let Message::Step(plan) = out else { unreachable!("set just above") };
            plan.epoch = epoch;
            plan.step = step;
            let n = r.u32("entry count")? as usize;
            // Each entry takes at least 25 bytes: a count past the end is malformed.
            if n > bytes.len() / 25 {
                return Err(DecodeError::TooManyEntries { entries: n, len: bytes.len() });
            }
            plan.entries.truncate(n);
            for i in 0..n {
                let seq = r.u64("seq")?;
                let start = r.u32("start")?;
                let reserve = r.u32("reserve")?;
                let sample = r.u8("sample flag")? != 0;
                let len = r.u32("token count")? as usize;
                if i == plan.entries.len() {
                    plan.entries.push(PlanEntry {
                        seq,
                        start,
                        tokens: Vec::new(),
                        sample,
                        reserve,
                        blocks: Vec::new(),
                        sampling: None,
                    });
                }
                let e = &mut plan.entries[i];
                (e.seq, e.start, e.sample, e.reserve) = (seq, start, sample, reserve);
                r.u32s(len, "tokens", &mut e.tokens)?;
                let len = r.u32("block count")? as usize;
                r.u32s(len, "blocks", &mut e.blocks)?;
                e.sampling = match r.u8("sampling flag")? {
                    0 => None,
                    _ => Some(Box::new(r.sampling()?)),
                };
            }
            let n = r.u32("released count")? as usize;
            let raw =
                r.take(n.checked_mul(8).ok_or(DecodeError::Overflow("released"))?, "released")?;
            plan.released.clear();
            plan.released.extend(raw.chunks_exact(8).map(|b| {
                let mut a = [0u8; 8];
                a.copy_from_slice(b);
                u64::from_le_bytes(a)
            }));
        }
        3 => *out = Message::Idle,
        4 => {
            *out = Message::Close(match r.u8("decision")? {
                0 => SessionDecision::Stop,
                1 => SessionDecision::KeepOpen,
                2 => SessionDecision::Replace(r.config()?),
                d => return Err(DecodeError::UnknownDecision(d)),
            })
        }
        k => return Err(DecodeError::UnknownKind(k)),
    }
    if r.at != bytes.len() {
        return Err(DecodeError::Trailing(bytes.len() - r.at));
    }
    Ok((epoch, step))
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_config(cfg: &SessionConfig, out: &mut Vec<u8>) {
    put_u32(out, cfg.model.len() as u32);
    out.extend_from_slice(cfg.model.as_bytes());
    out.push(u8::from(cfg.max_steps.is_some()));
    out.extend_from_slice(&cfg.max_steps.unwrap_or(0).to_le_bytes());
    put_u32(out, cfg.token_budget);
    put_u32(out, cfg.max_batch);
}

fn put_f32(out: &mut Vec<u8>, v: f32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u32s(out: &mut Vec<u8>, values: &[u32]) {
    put_u32(out, values.len() as u32);
    values.iter().for_each(|v| put_u32(out, *v));
}

/// A sequence's sampling, every field of its parameters in declaration order (destructured,
/// so a new field does not compile until it is sent).
fn put_sampling(s: &SeqSampling, out: &mut Vec<u8>) {
    let SamplingParams {
        max_tokens,
        temperature,
        top_k,
        top_p,
        seed,
        stop,
        ignore_eos,
        presence_penalty,
        frequency_penalty,
        repetition_penalty,
        min_p,
        logit_bias,
        logprobs,
        prompt_logprobs,
        constraint,
    } = &s.params;
    put_u32(out, *max_tokens);
    put_f32(out, *temperature);
    out.extend_from_slice(&(*top_k as u64).to_le_bytes());
    put_f32(out, *top_p);
    out.extend_from_slice(&seed.to_le_bytes());
    put_u32s(out, stop);
    out.push(u8::from(*ignore_eos));
    put_f32(out, *presence_penalty);
    put_f32(out, *frequency_penalty);
    put_f32(out, *repetition_penalty);
    put_f32(out, *min_p);
    put_u32(out, logit_bias.len() as u32);
    for &(token, bias) in logit_bias {
        put_u32(out, token);
        put_f32(out, bias);
    }
    out.push(u8::from(logprobs.is_some()));
    out.extend_from_slice(&(logprobs.unwrap_or(0) as u64).to_le_bytes());
    out.push(u8::from(prompt_logprobs.is_some()));
    out.extend_from_slice(&(prompt_logprobs.unwrap_or(0) as u64).to_le_bytes());
    put_grammar(out, constraint.as_ref());
    put_u32(out, s.drawn);
    put_u32s(out, &s.prompt);
    put_u32s(out, &s.generated);
}

fn put_str(out: &mut Vec<u8>, text: &str) {
    put_u32(out, text.len() as u32);
    out.extend_from_slice(text.as_bytes());
}

/// A constraint: its kind (0 for none), then its text or its list of choices.
fn put_grammar(out: &mut Vec<u8>, grammar: Option<&Grammar>) {
    match grammar {
        None => out.push(0),
        Some(Grammar::JsonSchema(schema)) => {
            out.push(1);
            put_str(out, schema);
        }
        Some(Grammar::JsonObject) => out.push(2),
        Some(Grammar::Regex(rx)) => {
            out.push(3);
            put_str(out, rx);
        }
        Some(Grammar::Choice(choices)) => {
            out.push(4);
            put_u32(out, choices.len() as u32);
            choices.iter().for_each(|c| put_str(out, c));
        }
        Some(Grammar::Lark(lark)) => {
            out.push(5);
            put_str(out, lark);
        }
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize, what: &'static str) -> std::result::Result<&[u8], DecodeError> {
        let past = DecodeError::Truncated { what, at: self.at, len: self.bytes.len() };
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len()).ok_or(past)?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u8(&mut self, what: &'static str) -> std::result::Result<u8, DecodeError> {
        Ok(self.take(1, what)?[0])
    }

    fn u32(&mut self, what: &'static str) -> std::result::Result<u32, DecodeError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// `n` little-endian u32 values into `out` (cleared first).
    fn u32s(
        &mut self,
        n: usize,
        what: &'static str,
        out: &mut Vec<u32>,
    ) -> std::result::Result<(), DecodeError> {
        let raw = self.take(n.checked_mul(4).ok_or(DecodeError::Overflow(what))?, what)?;
        out.clear();
        out.extend(raw.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])));
        Ok(())
    }

    fn u64(&mut self, what: &'static str) -> std::result::Result<u64, DecodeError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8, what)?);
        Ok(u64::from_le_bytes(a))
    }

    fn f32(&mut self, what: &'static str) -> std::result::Result<f32, DecodeError> {
        Ok(f32::from_bits(self.u32(what)?))
    }

    fn usize(&mut self, what: &'static str) -> std::result::Result<usize, DecodeError> {
        usize::try_from(self.u64(what)?).map_err(|_| DecodeError::Overflow(what))
    }

    /// A count, then that many u32 values.
    fn u32_list(&mut self, what: &'static str) -> std::result::Result<Vec<u32>, DecodeError> {
        let n = self.u32(what)? as usize;
        let mut out = Vec::new();
        self.u32s(n, what, &mut out)?;
        Ok(out)
    }

    /// A length, then that many bytes of UTF-8.
    fn string(&mut self, what: &'static str) -> std::result::Result<String, DecodeError> {
        let len = self.u32(what)? as usize;
        String::from_utf8(self.take(len, what)?.to_vec()).map_err(|_| DecodeError::NotUtf8(what))
    }

    fn grammar(&mut self) -> std::result::Result<Option<Grammar>, DecodeError> {
        Ok(Some(match self.u8("constraint kind")? {
            0 => return Ok(None),
            1 => Grammar::JsonSchema(self.string("JSON schema")?),
            2 => Grammar::JsonObject,
            3 => Grammar::Regex(self.string("regex")?),
            4 => {
                let n = self.u32("choice count")? as usize;
                if n > self.bytes.len() / 4 {
                    return Err(DecodeError::Overflow("choices"));
                }
                (0..n)
                    .map(|_| self.string("choice"))
                    .collect::<Result<_, _>>()
                    .map(Grammar::Choice)?
            }
            5 => Grammar::Lark(self.string("grammar")?),
            kind => return Err(DecodeError::UnknownConstraint(kind)),
        }))
    }

    fn sampling(&mut self) -> std::result::Result<SeqSampling, DecodeError> {
        let max_tokens = self.u32("max_tokens")?;
        let temperature = self.f32("temperature")?;
        let top_k = self.usize("top_k")?;
        let top_p = self.f32("top_p")?;
        let seed = self.u64("seed")?;
        let stop = self.u32_list("stop tokens")?;
        let ignore_eos = self.u8("ignore_eos")? != 0;
        let presence_penalty = self.f32("presence_penalty")?;
        let frequency_penalty = self.f32("frequency_penalty")?;
        let repetition_penalty = self.f32("repetition_penalty")?;
        let min_p = self.f32("min_p")?;
        let n = self.u32("logit_bias count")? as usize;
        if n > self.bytes.len() / 8 {
            return Err(DecodeError::Overflow("logit_bias"));
        }
        let mut logit_bias = Vec::with_capacity(n);
        for _ in 0..n {
            logit_bias.push((self.u32("logit_bias token")?, self.f32("logit_bias value")?));
        }
        let has_logprobs = self.u8("logprobs flag")? != 0;
        let top = self.usize("logprobs")?;
        let has_prompt_logprobs = self.u8("prompt_logprobs flag")? != 0;
        let prompt_top = self.usize("prompt_logprobs")?;
        let constraint = self.grammar()?;
        let params = SamplingParams {
            max_tokens,
            temperature,
            top_k,
            top_p,
            seed,
            stop,
            ignore_eos,
            presence_penalty,
            frequency_penalty,
            repetition_penalty,
            min_p,
            logit_bias,
            logprobs: has_logprobs.then_some(top),
            prompt_logprobs: has_prompt_logprobs.then_some(prompt_top),
            constraint,
        };
        let drawn = self.u32("drawn")?;
        let prompt = self.u32_list("penalized prompt")?;
        let generated = self.u32_list("penalized output")?;
        Ok(SeqSampling { params, drawn, prompt, generated })
    }

    fn config(&mut self) -> std::result::Result<SessionConfig, DecodeError> {
        let len = self.u32("model length")? as usize;
        let model = String::from_utf8(self.take(len, "model")?.to_vec())
            .map_err(|_| DecodeError::ModelNotUtf8)?;
        let has = self.u8("max_steps flag")? != 0;
        let max = self.u64("max_steps")?;
        let token_budget = self.u32("token_budget")?;
        let max_batch = self.u32("max_batch")?;
        Ok(SessionConfig { model, max_steps: has.then_some(max), token_budget, max_batch })
    }
}

#[cfg(test)]
mod tests;
