// profile.cu: a profiling aid (`--profile`).

// Profiling aid: keep the stream busy for `ns` nanoseconds so that the host queues the next
// kernel and its events before the GPU reaches them (the events then time the kernel alone,
// not the host's launch latency). grid: 1; block: 1.
ST_KERNEL void dq_spin(long long ns) {
    const unsigned long long t0 = st_globaltimer_ns();
    while ((long long)(st_globaltimer_ns() - t0) < ns) {
    }
}
