//! Closed world after start-up: with a counting global allocator, prefill chunks and decode
//! steps of a plan-bound engine (split over two devices, a small expert cache with misses,
//! KV spilled to host chunks) allocate nothing once warm.

mod common;

use common::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use strata_exec::engine::Engine;
use strata_schemas::serve::ExpertCache;

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator; the counter has no effect on the allocation.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as ours.
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as ours.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as ours.
        unsafe { System.realloc(p, l, n) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn warm_prefill_and_decode_allocate_nothing() {
    let p = plan(
        "base",
        &Ask {
            devices: 2,
            split: Some(vec![1]),
            batch: 2,
            resident: Some(6),
            cache: ExpertCache::Slots(4),
            ..Ask::default()
        },
    );
    let mut e = engine("base", &p);
    assert_eq!(e.allocations(), 2 + p.host.pinned_chunks.len() as u64);
    // Warm-up: one chunk and one step (starts rayon's pool, grows its deques).
    rayon::scope(|_| {
        e.prefill(0, &[1, 2, 3, 4, 5, 6, 7, 8], true).unwrap();
        e.prefill(1, &[9, 10, 11], true).unwrap();
        e.decode(&[(0, 5), (1, 6)]).unwrap();
    });
    let misses_before = e.stats().expert_misses;

    // Driven from a rayon worker, as the CLI does: from a foreign thread, rayon's injector
    // queue itself allocates a block every 63 parallel ops (not ours to remove).
    rayon::scope(|_| {
        COUNTING.store(true, Ordering::SeqCst);
        let mut next = [7u32, 8];
        for _ in 0..20 {
            let rows = e.decode(&[(0, next[0]), (1, next[1])]).unwrap();
            next = [argmax(&rows[..256]), argmax(&rows[256..])];
        }
        e.prefill(1, &[3, 1, 4, 1, 5, 9, 2, 6], true).unwrap();
        COUNTING.store(false, Ordering::SeqCst);
    });
    let n = ALLOCS.load(Ordering::SeqCst);
    assert_eq!(
        n, 0,
        "{n} allocations in 20 decode steps and a prefill chunk"
    );
    // The steps did work: misses were served (copies into cache slots) and cells filled
    // past the 6-cell resident window into the spill chunks.
    assert!(e.stats().expert_misses > misses_before);
    assert_eq!(e.slot_len(0), 8 + 1 + 20);
    assert_eq!(e.slot_len(1), 3 + 1 + 20 + 8);
}
