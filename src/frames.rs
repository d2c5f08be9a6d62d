//! What a gradient checkpoint watches while its function runs, per thread: the random
//! streams the function draws and the tensors from outside it that the function reads.
//!
//! A checkpoint's forward pushes a recording frame; every random draw (dropout, `randn`,
//! `rand`, a [`crate::Generator`]'s own draws) and every operand of an op is noted in it.
//! Backward recomputes the function under a replaying frame: each draw gets the stream the
//! forward drew, in order, so the recomputation sees the same noise, and no generator moves.
//! Frames nest (a checkpoint inside a checkpointed function) and belong to one thread; a
//! thread waiting in a parallel section puts them away ([`stash`]) so that a task it picks
//! up meanwhile sees none.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::collections::{HashSet, VecDeque};

/// One draw from a random stream: its seed, first block and number of 128-bit blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Draw {
    pub seed: u64,
    pub start: u64,
    pub blocks: u64,
}

/// What a checkpoint's forward saw.
#[derive(Default)]
pub(crate) struct Recording {
    pub draws: Vec<Draw>,
    /// What [`note_read`] was given for each tensor made before the frame opened that an op
    /// read, once per tensor (the checkpoint keeps the tensor and its version; the frames
    /// stay below the tensor types).
    pub reads: Vec<Box<dyn Any>>,
    seen: HashSet<u64>,
    /// The first tensor id made after the frame opened: lower ids come from outside.
    boundary: u64,
}

/// The draws a recomputation replays, and the first way it drew differently, if any.
#[derive(Default)]
pub(crate) struct Replaying {
    pub draws: VecDeque<Draw>,
    pub diverged: Option<String>,
}

pub(crate) enum Frame {
    Record(Recording),
    Replay(Replaying),
}

impl Frame {
    /// A recording frame for tensors made from `boundary` on (their ids) as the inside.
    pub(crate) fn record(boundary: u64) -> Frame {
        Frame::Record(Recording {
            boundary,
            ..Recording::default()
        })
    }
}

thread_local! {
    static FRAMES: RefCell<Vec<Frame>> = const { RefCell::new(Vec::new()) };
    /// Whether a recording frame is open: the one load an op's dispatch pays.
    static RECORDING: Cell<bool> = const { Cell::new(false) };
}

fn set_recording(frames: &[Frame]) {
    let on = frames.iter().any(|f| matches!(f, Frame::Record(_)));
    RECORDING.with(|r| r.set(on));
}

/// Runs `f` with `frame` on top of this thread's frames; returns `f`'s result and the frame
/// as `f` left it (the frame is popped even when `f` panics).
pub(crate) fn with_frame<R>(frame: Frame, f: impl FnOnce() -> R) -> (R, Frame) {
    struct PopOnUnwind(bool);
    impl Drop for PopOnUnwind {
        fn drop(&mut self) {
            if !self.0 {
                let _ = FRAMES.try_with(|fr| {
                    let mut fr = fr.borrow_mut();
                    fr.pop();
                    set_recording(&fr);
                });
            }
        }
    }
    FRAMES.with(|fr| {
        let mut fr = fr.borrow_mut();
        fr.push(frame);
        set_recording(&fr);
    });
    let mut guard = PopOnUnwind(false);
    let r = f();
    guard.0 = true;
    let frame = FRAMES.with(|fr| {
        let mut fr = fr.borrow_mut();
        let top = fr.pop();
        set_recording(&fr);
        top
    });
    (r, frame.expect("the frame pushed above"))
}

/// The stream for a draw of `blocks` blocks from the generator with `seed`: replayed inside
/// a recomputation (no generator moves), else `fresh()`'s first block (which advances the
/// generator), recorded in every recording frame.
pub(crate) fn draw(seed: u64, blocks: u64, fresh: impl FnOnce() -> u64) -> (u64, u64) {
    let replayed = FRAMES.with(|f| {
        let mut frames = f.borrow_mut();
        let replay = frames.iter_mut().rev().find_map(|fr| match fr {
            Frame::Replay(r) => Some(r),
            Frame::Record(_) => None,
        })?;
        match replay.draws.pop_front() {
            Some(d) if d.blocks == blocks => Some(Some(d)),
            got => {
                replay.diverged.get_or_insert_with(|| match got {
                    Some(d) => format!(
                        "it drew {blocks} random blocks where the forward drew {}",
                        d.blocks
                    ),
                    None => format!("it drew {blocks} random blocks the forward did not draw"),
                });
                Some(None)
            }
        }
    });
    let d = match replayed {
        Some(Some(d)) => d,
        // Outside a recomputation, or off the forward's track (the recomputation fails).
        _ => Draw {
            seed,
            start: fresh(),
            blocks,
        },
    };
    if RECORDING.with(|r| r.get()) {
        FRAMES.with(|f| {
            for fr in f.borrow_mut().iter_mut() {
                if let Frame::Record(rec) = fr {
                    rec.draws.push(d);
                }
            }
        });
    }
    (d.seed, d.start)
}

/// Whether a recording frame is open on this thread (an op then notes what it reads).
pub(crate) fn recording() -> bool {
    RECORDING.with(|r| r.get())
}

/// Notes that an op read the tensor with id `id`: in every recording frame it was made
/// outside of (a lower id than the frame's first) and that has not seen it yet, `keep()` is
/// kept.
pub(crate) fn note_read(id: u64, mut keep: impl FnMut() -> Box<dyn Any>) {
    FRAMES.with(|f| {
        for fr in f.borrow_mut().iter_mut() {
            if let Frame::Record(rec) = fr {
                if id < rec.boundary && rec.seen.insert(id) {
                    rec.reads.push(keep());
                }
            }
        }
    });
}

/// Whether this thread is recomputing a checkpointed function for backward (a batch norm
/// then leaves its running statistics alone: the forward already counted this batch).
pub(crate) fn recomputing() -> bool {
    FRAMES.with(|f| f.borrow().iter().any(|fr| matches!(fr, Frame::Replay(_))))
}

/// This thread's frames, taken off it while it waits in a parallel section.
pub(crate) struct Stash(Vec<Frame>);

/// Takes this thread's frames off it: a task the thread runs meanwhile sees none.
pub(crate) fn stash() -> Stash {
    let frames = FRAMES.with(|f| std::mem::take(&mut *f.borrow_mut()));
    RECORDING.with(|r| r.set(false));
    Stash(frames)
}

/// Puts back what [`stash`] took.
pub(crate) fn unstash(saved: Stash) {
    let _ = FRAMES.try_with(|f| {
        let mut f = f.borrow_mut();
        *f = saved.0;
        set_recording(&f);
    });
}
