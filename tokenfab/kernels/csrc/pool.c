/* ---------------------------------------------------------------------------------------------------------
 * tf_cols: the decode GEMMs' threads, on a pool that never waits for a descheduled thread.
 *
 * An OpenMP region ends in a barrier: when another process takes a core and the OS deschedules one of
 * the engine's threads, every one of a step's ~150 regions waits for it to come back (issue 12: with two
 * busy loops beside a 2-core engine, 2 threads kept 0.36 of the quiet speed, below what 1 thread gets).
 * Here a job's outputs are cut into chunks, ~4 per thread, and each thread starts on a contiguous run of
 * them (OpenMP's static split, so in quiet a thread touches no line another writes until the end). Every
 * chunk is claimed with a compare-and-swap on its own state line. A thread done with its run claims what
 * the others have not, from the ends of their runs, so a descheduled thread's work goes to whoever runs
 * (when only the caller took from the workers, 3 threads beside two busy loops on the 2-core EPYC kept
 * 0.47 of the quiet speed; stealing both ways, 0.49, and 4 threads 0.52-0.59). The caller, last, also
 * takes over any chunk a worker claimed but has not finished after a short wait (the caller's own chunk
 * time, twice), so the outputs are ready without it. (A shared claim counter instead cost 25 % of a 1-row
 * call on the 2-core EPYC: every claim moved its cache line across cores.)
 * A worker computes its chunk into its own buffer and publishes it with a compare-and-swap on the chunk's
 * state (tagged with the job's generation), so a worker that comes back after its chunk was taken over
 * throws its result away. It is still reading the call's inputs (activations, weights) until then, and
 * the caller's caller may free them as soon as the call returns (a freed, unmapped tensor read late was a
 * segmentation fault under heavy contention), so a caller that took a chunk over waits, yielding its core,
 * until no worker is inside a claim (`running`, a flag per worker) before it returns.
 * Outputs are bit-identical whoever computes a chunk (the same function on the same inputs).
 * Workers are pthreads, started on first use, one fewer than the team: omp_get_max_threads() (torch's
 * count), or tf_pool_threads' (the thread controller's, above the cores under contention). They spin
 * ~0.2 ms after a job, then sleep on a futex (at once, above the cores); those outside the team sleep. A call
 * made while another thread holds the pool, from inside an OpenMP region, or with one thread, runs the
 * chunks in the calling thread's OpenMP team as before.
 * tf_team runs the decode attention's task loop the same way, minus the takeover: each thread of the team
 * runs the loop, which claims tasks until none is left; a worker joins only while the job is open, and
 * the caller waits only for workers that joined (a worker descheduled before it joined costs nothing).
 * Both keep a step's threads off OpenMP, whose workers spin ~1 ms after every region (GOMP_SPINCOUNT) on
 * the cores the pool's workers need: with attention left in OpenMP, 2 threads ran 1 stream at 0.55x the
 * OpenMP-only speed on the 2-core EPYC. */
#include "common.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define TF_POOL_MAX 64            /* workers */
#define TF_POOL_CHUNKS 1024       /* chunks per job, at most */
#define TF_POOL_CHUNK_COLS 512    /* outputs per chunk, at most (a worker's buffer: TF_POOL_ROWS x this) */
#define TF_POOL_ROWS 8            /* rows per tf_cols job, at most */
__thread int tf_pool_off;         /* this thread's calls bypass the pool (a big tf_qgemm's passes) */
#define TF_POOL_SPIN_NS 200000    /* by default a worker spins this long after a job before it sleeps */

typedef struct {
    tf_cols_fn fn;
    void (*team)(void *ctx);          /* a tf_team job: every thread runs team(ctx) */
    void *ctx;
    float *y;
    int64_t M, N, cols, nchunks, nthreads;
    uint32_t gen;
    unsigned char args[160];
} tf_pool_job;

static struct {
    pthread_mutex_t lock;             /* one job at a time */
    _Atomic uint32_t gen;             /* the futex word: bumped when a job is posted */
    _Atomic uint32_t seq;             /* odd while `job` is being written */
    _Atomic uint64_t team;            /* tf_team: gen << 32 | threads in it << 1 | closed */
    _Atomic int sleepers;
    _Atomic uint32_t size;            /* the last job's team size: workers beyond it sleep on this word */
    int nworkers;
    tf_pool_job job;
    struct {                          /* per chunk, a cache line each: gen << 2 | state (TF_ST_*) */
        _Atomic uint64_t v;
        char pad[56];
    } st[TF_POOL_CHUNKS] __attribute__((aligned(64)));
    _Atomic int64_t worker_chunks __attribute__((aligned(64))), taken_over, discarded;
    struct {                          /* per worker, a cache line each (claims stay core-local): 1 while it is */
        _Atomic int v;                /* inside a claim, from before claiming a chunk until it has left it */
        char pad[60];
    } running[TF_POOL_MAX + 1] __attribute__((aligned(64)));
    _Atomic int64_t delay_us;         /* tests: a worker sleeps this long inside every chunk */
    _Atomic int64_t spin_ns;          /* how long a worker spins after a job before it sleeps */
    int threads;                      /* > 0: the team size (tf_pool_threads), else omp_get_max_threads() */
    int disabled;
} tf_pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .spin_ns = TF_POOL_SPIN_NS};

enum { TF_ST_CLAIMED = 0, TF_ST_WRITING = 1, TF_ST_DONE = 2, TF_ST_TAKEN = 3 };
#define TF_ST(g, state) (((uint64_t)(g) << 2) | (state))

static inline void tf_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#else
    __asm__ __volatile__("" ::: "memory");
#endif
}

static inline int64_t tf_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void tf_futex_wait(_Atomic uint32_t *w, uint32_t v) {
#ifdef __linux__
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT_PRIVATE, v, NULL, NULL, 0);
#else
    (void)w, (void)v;
    sched_yield();
#endif
}

static void tf_futex_wake(_Atomic uint32_t *w) {
#ifdef __linux__
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE_PRIVATE, 1 << 30, NULL, NULL, 0);
#else
    (void)w;
#endif
}

/* Chunk c of job g, if its state is from an earlier job: claim it (state -> `to`). */
static inline int tf_pool_claim(int64_t c, uint32_t g, int to) {
    uint64_t s = atomic_load_explicit(&tf_pool.st[c].v, memory_order_acquire);
    return (int32_t)((uint32_t)(s >> 2) - g) < 0 &&      /* tags wrap: a late worker's job is older */
           atomic_compare_exchange_strong(&tf_pool.st[c].v, &s, TF_ST(g, to));
}

static inline void tf_pool_range(const tf_pool_job *j, int64_t c, int64_t *n0, int64_t *n1) {
    *n0 = c * j->cols;
    *n1 = *n0 + j->cols < j->N ? *n0 + j->cols : j->N;
}

/* Thread t's run of chunks: [first, last). */
static inline void tf_pool_run(const tf_pool_job *j, int64_t t, int64_t *first, int64_t *last) {
    *first = j->nchunks * t / j->nthreads;
    *last = j->nchunks * (t + 1) / j->nthreads;
}

static void *tf_pool_worker(void *arg) {
    const int id = (int)(intptr_t)arg;          /* 1..nworkers: thread `id` of the job's team */
    float buf[TF_POOL_ROWS * TF_POOL_CHUNK_COLS];
    uint32_t seen = atomic_load(&tf_pool.gen);
    for (;;) {
        for (uint32_t n; id >= (int)(n = atomic_load_explicit(&tf_pool.size, memory_order_acquire));)
            tf_futex_wait(&tf_pool.size, n);          /* not in the team: no spinning beside it */
        uint32_t g;
        int64_t t0 = tf_now_ns();
        for (int i = 0; (g = atomic_load_explicit(&tf_pool.gen, memory_order_acquire)) == seen; i++) {
            tf_relax();
            if ((i & 63) == 63 && tf_now_ns() - t0 > atomic_load_explicit(&tf_pool.spin_ns, memory_order_relaxed)) {
                atomic_fetch_add(&tf_pool.sleepers, 1);
                tf_futex_wait(&tf_pool.gen, seen);
                atomic_fetch_sub(&tf_pool.sleepers, 1);
                t0 = tf_now_ns();
            }
        }
        seen = g;
        tf_pool_job j;                                /* a copy, taken under the sequence count */
        const uint32_t s1 = atomic_load_explicit(&tf_pool.seq, memory_order_acquire);
        if (s1 & 1) continue;
        memcpy(&j, (const void *)&tf_pool.job, sizeof j);
        atomic_thread_fence(memory_order_acquire);
        if (atomic_load_explicit(&tf_pool.seq, memory_order_relaxed) != s1 || j.gen != g || id >= j.nthreads)
            continue;
        if (j.team) {                                 /* join while the job is open, run, leave */
            uint64_t t = atomic_load_explicit(&tf_pool.team, memory_order_acquire);
            while ((uint32_t)(t >> 32) == g && !(t & 1) &&
                   !atomic_compare_exchange_weak_explicit(&tf_pool.team, &t, t + 2, memory_order_acq_rel,
                                                          memory_order_acquire))
                ;
            if ((uint32_t)(t >> 32) != g || (t & 1)) continue;
            j.team(j.ctx);
            atomic_fetch_sub_explicit(&tf_pool.team, 2, memory_order_release);
            continue;
        }
        int64_t done = 0;
        /* its own run from the start, then the others' runs from their ends (the caller's included), each
         * until a chunk someone else has claimed: a descheduled thread's work goes to whoever runs */
        for (int64_t k = 0; k < j.nthreads; k++) {
            const int64_t t = (id + k) % j.nthreads;
            int64_t first, last;
            tf_pool_run(&j, t, &first, &last);
            for (int64_t i = 0; i < last - first; i++) {
                const int64_t c = k ? last - 1 - i : first + i;
                atomic_store(&tf_pool.running[id].v, 1);        /* before the claim: a caller that took */
                if (!tf_pool_claim(c, g, TF_ST_CLAIMED)) {     /* this chunk over then waits for it */
                    atomic_store(&tf_pool.running[id].v, 0);
                    if (k) break;                                 /* its owner is at work there */
                    continue;                                     /* taken over, or the job has ended */
                }
                int64_t n0, n1;
                tf_pool_range(&j, c, &n0, &n1);
                const int64_t delay = atomic_load_explicit(&tf_pool.delay_us, memory_order_relaxed);
                if (delay) {                              /* tests: descheduled after the claim, before the inputs */
                    struct timespec ts = {delay / 1000000, (delay % 1000000) * 1000};
                    nanosleep(&ts, NULL);
                }
                j.fn(j.args, n0, n1, buf, n1 - n0);
                uint64_t s = TF_ST(g, TF_ST_CLAIMED);      /* still ours: publish, else throw the result away */
                if (!atomic_compare_exchange_strong(&tf_pool.st[c].v, &s, TF_ST(g, TF_ST_WRITING))) {
                    atomic_fetch_add_explicit(&tf_pool.discarded, 1, memory_order_relaxed);
                    atomic_store(&tf_pool.running[id].v, 0);
                    continue;
                }
                for (int64_t r = 0; r < j.M; r++)
                    memcpy(j.y + r * j.N + n0, buf + r * (n1 - n0), sizeof(float) * (size_t)(n1 - n0));
                atomic_store_explicit(&tf_pool.st[c].v, TF_ST(g, TF_ST_DONE), memory_order_release);
                atomic_store(&tf_pool.running[id].v, 0);
                done++;
            }
        }
        if (done) atomic_fetch_add_explicit(&tf_pool.worker_chunks, done, memory_order_relaxed);
    }
    return NULL;
}

static void tf_pool_atfork_child(void) {     /* the workers do not survive a fork */
    pthread_mutex_init(&tf_pool.lock, NULL);
    tf_pool.nworkers = 0;
    atomic_store(&tf_pool.sleepers, 0);
}

static void tf_pool_start(int want) {
    static int atfork;
    if (!atfork) atfork = !pthread_atfork(NULL, NULL, tf_pool_atfork_child);
    for (; tf_pool.nworkers < want && tf_pool.nworkers < TF_POOL_MAX; tf_pool.nworkers++) {
        pthread_t t;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        const int ok = !pthread_create(&t, &a, tf_pool_worker, (void *)(intptr_t)(tf_pool.nworkers + 1));
        pthread_attr_destroy(&a);
        if (!ok) break;
    }
}

/* This thread's scratch of at least `bytes`, grown as needed; valid until this thread's next call. (No pool
 * worker reads a call's inputs after tf_cols returns, so the old buffer can go.) */
void *tf_scratch(size_t bytes) {
    static __thread char *p;
    static __thread size_t have;
    if (bytes > have) {
        have = bytes > 2 * have ? bytes : 2 * have;
        free(p);
        p = (char *)aligned_alloc(64, TF_UP64(have));
    }
    return p;
}

/* The team size for a call from outside any OpenMP region. */
int tf_pool_team(void) {
    return tf_pool.threads > 0 ? tf_pool.threads : omp_get_max_threads();
}

/* Post a job (the caller holds the lock): write it under the sequence count, open its claims, wake the
 * workers. Returns its generation. */
static uint32_t tf_pool_post(int nth, tf_cols_fn fn, const void *args, size_t args_size, int64_t M, int64_t N,
                             int64_t cols, int64_t nchunks, float *y, void (*team)(void *), void *ctx) {
    tf_pool_start(nth - 1);
    tf_pool_job *j = &tf_pool.job;
    const uint32_t g = atomic_load_explicit(&tf_pool.gen, memory_order_relaxed) + 1;
    atomic_fetch_add_explicit(&tf_pool.seq, 1, memory_order_acq_rel);        /* odd: being written */
    atomic_thread_fence(memory_order_release);
    j->fn = fn, j->team = team, j->ctx = ctx, j->y = y, j->M = M, j->N = N, j->cols = cols, j->nchunks = nchunks;
    j->nthreads = nth, j->gen = g;
    if (args_size) memcpy(j->args, args, args_size);
    atomic_fetch_add_explicit(&tf_pool.seq, 1, memory_order_release);        /* even: valid */
    atomic_store_explicit(&tf_pool.team, (uint64_t)g << 32, memory_order_release);
    atomic_store_explicit(&tf_pool.gen, g, memory_order_release);
    if (atomic_load_explicit(&tf_pool.size, memory_order_relaxed) != (uint32_t)nth) {
        atomic_store_explicit(&tf_pool.size, (uint32_t)nth, memory_order_release);
        tf_futex_wake(&tf_pool.size);
    }
    if (atomic_load(&tf_pool.sleepers)) tf_futex_wake(&tf_pool.gen);
    return g;
}

/* Every thread of a team of `nth` (the caller and up to nth - 1 workers) runs body(ctx); body claims its
 * own work, so threads that never join change nothing. Returns when every thread that joined has left.
 * Not `pooled` (a step above TF_POOL_MAX_ROWS), or the pool unavailable: an OpenMP team instead. */
void tf_team(void (*body)(void *), void *ctx, int nth, int pooled) {
    if (nth < 2 || !pooled || tf_pool.disabled || omp_in_parallel() || pthread_mutex_trylock(&tf_pool.lock)) {
#pragma omp parallel num_threads(nth) if (nth >= 2)
        body(ctx);
        return;
    }
    tf_pool_post(nth, NULL, NULL, 0, 0, 0, 0, 0, NULL, body, ctx);
    body(ctx);
    uint64_t t = atomic_load_explicit(&tf_pool.team, memory_order_acquire);
    while (!atomic_compare_exchange_weak_explicit(&tf_pool.team, &t, t | 1, memory_order_acq_rel,
                                                  memory_order_acquire))
        ;                                                       /* closed: no one joins any more */
    while ((atomic_load_explicit(&tf_pool.team, memory_order_acquire) & 0xfffffffeu) != 0) tf_relax();
    pthread_mutex_unlock(&tf_pool.lock);
}

/* y[r * N + n] for r < M, n < N, from fn over column ranges (see above). */
void tf_cols(tf_cols_fn fn, const void *args, size_t args_size, int64_t M, int64_t N, float *y) {
    const int nth = omp_in_parallel() ? 1 : tf_pool_team();
    int64_t cols = (N + 4 * nth - 1) / (4 * nth);              /* ~4 chunks per thread */
    cols = cols < 16 ? 16 : cols > TF_POOL_CHUNK_COLS ? TF_POOL_CHUNK_COLS : (cols + 15) & ~(int64_t)15;
    if (cols * TF_POOL_CHUNKS < N) cols = (N + TF_POOL_CHUNKS - 1) / TF_POOL_CHUNKS;
    const int64_t nchunks = (N + cols - 1) / cols;
    if (nth < 2 || N < 64 || cols > TF_POOL_CHUNK_COLS || args_size > sizeof tf_pool.job.args || tf_pool.disabled ||
        M > TF_POOL_ROWS || tf_pool_off || pthread_mutex_trylock(&tf_pool.lock)) {
#pragma omp parallel for schedule(static) if (N >= 64)
        for (int64_t c = 0; c < nchunks; c++) {
            const int64_t n0 = c * cols, n1 = n0 + cols < N ? n0 + cols : N;
            fn(args, n0, n1, y + n0, N);
        }
        return;
    }
    tf_pool_job *j = &tf_pool.job;
    const uint32_t g = tf_pool_post(nth, fn, args, args_size, M, N, cols, nchunks, y, NULL, NULL);
    int64_t first, last, chunk_ns = 20000;                     /* until one of its own chunks is timed */
    int took_over = 0;
    tf_pool_run(j, 0, &first, &last);
    for (int64_t c = first; c < last; c++) {                  /* its own run, but for what a worker took */
        if (!tf_pool_claim(c, g, TF_ST_TAKEN)) continue;
        int64_t n0, n1;
        tf_pool_range(j, c, &n0, &n1);
        const int64_t t0 = tf_now_ns();
        fn(args, n0, n1, y + n0, N);
        chunk_ns = tf_now_ns() - t0;
    }
    for (int64_t c = nchunks - 1; c >= 0; c--) {              /* the rest, from the workers' ends */
        const int64_t t0 = tf_now_ns();
        for (int i = 0;; i++) {
            uint64_t s = atomic_load_explicit(&tf_pool.st[c].v, memory_order_acquire);
            if (s == TF_ST(g, TF_ST_DONE) || s == TF_ST(g, TF_ST_TAKEN)) break;    /* a worker's, or its own */
            /* not claimed yet: take it; claimed: wait for it a while, then take it over */
            const int unclaimed = (uint32_t)(s >> 2) != g;
            if ((unclaimed || (s == TF_ST(g, TF_ST_CLAIMED) && (i & 15) == 15 &&
                               tf_now_ns() - t0 > 2 * chunk_ns + 2000)) &&
                atomic_compare_exchange_strong(&tf_pool.st[c].v, &s, TF_ST(g, TF_ST_TAKEN))) {
                int64_t n0, n1;
                tf_pool_range(j, c, &n0, &n1);
                fn(args, n0, n1, y + n0, N);
                if (!unclaimed) {
                    atomic_fetch_add_explicit(&tf_pool.taken_over, 1, memory_order_relaxed);
                    took_over = 1;
                }
                break;
            }
            tf_relax();
        }
    }
    /* A worker whose chunk was taken over may still be reading this call's inputs (the activations, the
     * weights), which the caller's caller may free as soon as this returns: wait until it has left its
     * chunk. Its result is thrown away; yielding lets a descheduled worker run on this core. (Returning at
     * once let a late worker read a freed, unmapped tensor: a segmentation fault under heavy contention.) */
    for (int w = 1; took_over && w <= tf_pool.nworkers; w++)
        for (int i = 0; atomic_load(&tf_pool.running[w].v); i++) {
            if ((i & 63) == 63) sched_yield();
            tf_relax();
        }
    pthread_mutex_unlock(&tf_pool.lock);
}

/* Tests and benchmarks: the pool's counters (chunks workers published, chunks the caller took over, results
 * workers threw away), its switch (off: OpenMP's static schedule), and a delay inside every worker chunk. */
void tf_pool_stats(int64_t *out) {
    out[0] = atomic_load(&tf_pool.worker_chunks);
    out[1] = atomic_load(&tf_pool.taken_over);
    out[2] = atomic_load(&tf_pool.discarded);
    out[3] = tf_pool.nworkers;
}

/* The pool's team size, more threads than cores included (the engine's thread controller under contention:
 * engine/threads.py); 0: omp_get_max_threads(). Above the cores its workers sleep as soon as a job ends. */
void tf_pool_threads(int64_t n) {
    tf_pool.threads = n > 0 ? (int)(n < TF_POOL_MAX + 1 ? n : TF_POOL_MAX + 1) : 0;
    atomic_store(&tf_pool.spin_ns, n > 0 ? 0 : TF_POOL_SPIN_NS);
}

void tf_pool_config(int64_t enabled, int64_t delay_us, int64_t spin_ns) {
    tf_pool.disabled = !enabled;
    atomic_store(&tf_pool.delay_us, delay_us);
    if (spin_ns >= 0) atomic_store(&tf_pool.spin_ns, spin_ns);
}
