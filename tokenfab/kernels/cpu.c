/* tokenfab's CPU kernels for the small, memory-bound parts of a decoder step (float32).
 *
 * torch runs each of these as 4-10 separate ops; at decode batch sizes the per-op overhead and the
 * copies between them (notably gathering every sequence's K/V blocks for attention) cost more than
 * the arithmetic. Built at first use by tokenfab/kernels/__init__.py with the machine's gcc and
 * called through ctypes; every kernel has a torch reference it is tested against.
 *
 * Threads: OpenMP. The shared library links libgomp.so.1, the soname torch's wheel ships, so the
 * process keeps one OpenMP runtime and one thread pool. The decode GEMMs (tf_qgemm) and the paged decode
 * attention run on tf_cols / tf_team instead (below): a pool that does not wait for a descheduled thread.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

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
 * time, twice): a descheduled worker costs at most one chunk done twice, never a time slice. (A shared claim counter
 * instead cost 25 % of a 1-row call on the 2-core EPYC: every claim moved its cache line across cores.)
 * A worker computes its chunk into its own buffer and publishes it with a compare-and-swap on the chunk's
 * state (tagged with the job's generation), so a worker that comes back after its chunk was taken over,
 * or after the job ended, throws its result away. What a late worker can still read: the job's copy it
 * made (validated by a sequence count), the caller's scratch (tf_scratch, never freed) and the weights
 * (a model freed within the few milliseconds a preempted worker is away would be read after its free).
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
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#include <sched.h>
#endif

#define TF_UP64(n) (((n) + 63) & ~(size_t)63)
#define TF_POOL_MAX 64            /* workers */
#define TF_POOL_CHUNKS 1024       /* chunks per job, at most */
#define TF_POOL_CHUNK_COLS 512    /* outputs per chunk, at most (a worker's buffer: TF_POOL_ROWS x this) */
#define TF_POOL_ROWS 8            /* rows per tf_cols job, at most */
/* The most rows (sequences) of a step whose GEMMs and decode attention run on the pool. Bigger steps run
 * in OpenMP (most of their GEMMs do anyway: qmadd, oneDNN), because OpenMP's workers spin ~1 ms after
 * each region on the core a pool worker needs: with pool jobs among them, 32 streams ran at 0.93x
 * OpenMP's speed on the 2-core EPYC. */
#define TF_POOL_MAX_ROWS 16
static __thread int tf_pool_off;      /* this thread's calls bypass the pool (a big tf_qgemm's passes) */
#define TF_POOL_SPIN_NS 200000    /* by default a worker spins this long after a job before it sleeps */

typedef void (*tf_cols_fn)(const void *job, int64_t n0, int64_t n1, float *y, int64_t ys);

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
                if (!tf_pool_claim(c, g, TF_ST_CLAIMED)) {
                    if (k) break;                                 /* its owner is at work there */
                    continue;                                     /* taken over, or the job has ended */
                }
                int64_t n0, n1;
                tf_pool_range(&j, c, &n0, &n1);
                j.fn(j.args, n0, n1, buf, n1 - n0);
                const int64_t delay = atomic_load_explicit(&tf_pool.delay_us, memory_order_relaxed);
                if (delay) {
                    struct timespec ts = {0, delay * 1000};
                    nanosleep(&ts, NULL);
                }
                uint64_t s = TF_ST(g, TF_ST_CLAIMED);      /* still ours: publish, else throw the result away */
                if (!atomic_compare_exchange_strong(&tf_pool.st[c].v, &s, TF_ST(g, TF_ST_WRITING))) {
                    atomic_fetch_add_explicit(&tf_pool.discarded, 1, memory_order_relaxed);
                    continue;
                }
                for (int64_t r = 0; r < j.M; r++)
                    memcpy(j.y + r * j.N + n0, buf + r * (n1 - n0), sizeof(float) * (size_t)(n1 - n0));
                atomic_store_explicit(&tf_pool.st[c].v, TF_ST(g, TF_ST_DONE), memory_order_release);
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

/* This thread's scratch of at least `bytes`: grown, never freed (a late pool worker may still read it). */
static void *tf_scratch(size_t bytes) {
    static __thread char *p;
    static __thread size_t have;
    if (bytes > have) {
        have = bytes > 2 * have ? bytes : 2 * have;
        p = (char *)aligned_alloc(64, TF_UP64(have));    /* the old one is left: see above */
    }
    return p;
}

/* The team size for a call from outside any OpenMP region. */
static inline int tf_pool_team(void) {
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
static __attribute__((unused)) void tf_team(void (*body)(void *), void *ctx, int nth, int pooled) {
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
static void tf_cols(tf_cols_fn fn, const void *args, size_t args_size, int64_t M, int64_t N, float *y) {
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
                if (!unclaimed) atomic_fetch_add_explicit(&tf_pool.taken_over, 1, memory_order_relaxed);
                break;
            }
            tf_relax();
        }
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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* e^x for 8 floats (x clamped to [-87.3, 88]): 2^n * e^r with n = round(x / ln 2), |r| <= ln(2) / 2, and a degree-6
 * polynomial for e^r (Cephes' coefficients); within 2 ulp of expf. glibc's vector expf is only
 * declared under -ffast-math, and a scalar expf per attention score cost more than the dot products. */
static inline __m256 tf_exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float tf_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One softmax row in place: p[j] = exp(p[j] - max) for j < L; returns 1 / sum. */
static inline float tf_softmax_row(float *pg, int64_t L) {
    float m = -INFINITY, sum;
    int64_t j = 0;
    if (L >= 8) {       /* 8 running maxima: a scalar max is a 4-cycle dependency chain per score */
        __m256 vmax = _mm256_loadu_ps(pg);
        for (j = 8; j + 8 <= L; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(pg + j));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        m = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    }
    for (; j < L; j++) m = pg[j] > m ? pg[j] : m;
    __m256 vsum = _mm256_setzero_ps();
    const __m256 vm = _mm256_set1_ps(m);
    for (j = 0; j + 8 <= L; j += 8) {
        const __m256 e = tf_exp256(_mm256_sub_ps(_mm256_loadu_ps(pg + j), vm));
        _mm256_storeu_ps(pg + j, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    sum = tf_hsum(vsum);
    for (; j < L; j++) {
        pg[j] = expf(pg[j] - m);
        sum += pg[j];
    }
    return 1.f / sum;
}
#endif

/* The row-wise kernels (norms, rope, GLUs) go parallel only in steps of more than TF_POOL_MAX_ROWS rows,
 * which run in OpenMP, and above 8k floats (a per-token q/k norm stays serial). In the smaller steps the
 * pool runs the GEMMs, and an OpenMP region's workers, spinning ~1 ms after it (GOMP_SPINCOUNT), held the
 * core the pool's worker needed: at T >= 8 rows, the old threshold, 8 streams ran at half speed. */
#define TF_PAR(T, floats) ((T) > TF_POOL_MAX_ROWS && (floats) >= (1 << 13))

/* One row of tf_rms_norm (o may be xr): shared with tf_rms_norm_bf16, so both give the same floats. */
static inline __attribute__((always_inline)) void tf_rms_norm_row(float *o, const float *xr, const float *w,
                                                                  int64_t D, float eps) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t d = 0; d < D; d++) ss += xr[d] * xr[d];
    float inv = 1.f / sqrtf(ss / (float)D + eps);
#pragma omp simd
    for (int64_t d = 0; d < D; d++) o[d] = w[d] * (xr[d] * inv);
}

/* out[t] = w * x[t] / sqrt(mean(x[t]^2) + eps), as Hugging Face's LlamaRMSNorm in float32. */
void tf_rms_norm(float *out, const float *x, const float *w, int64_t T, int64_t D, float eps) {
#pragma omp parallel for if (TF_PAR(T, T * D))
    for (int64_t t = 0; t < T; t++) tf_rms_norm_row(out + t * D, x + t * D, w, D, eps);
}

/* bfloat16 <-> float32 as torch converts them: widening is exact; narrowing rounds to nearest, ties to
 * even, and any NaN becomes the quiet NaN 0x7fc0 (c10::BFloat16's round_to_nearest_even). */
static inline float tf_from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t tf_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint16_t r = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0 : r;        /* a select, so tf_narrow_row vectorizes */
}

/* float32 rows through `row` into a per-thread scratch, then narrowed to bfloat16: the kernels below
 * write what their float32 twins followed by torch's .to(torch.bfloat16) would, in one pass over memory
 * (a prefill chunk's activations feeding oneDNN's bf16 GEMM, kernel "bf16" in tokenfab/kernels/linear.py). */
static inline void tf_narrow_row(uint16_t *o, const float *f, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) o[i] = tf_to_bf16(f[i]);
}

/* tf_rms_norm writing bfloat16 rows (x and w float32). */
void tf_rms_norm_bf16(uint16_t *out, const float *x, const float *w, int64_t T, int64_t D, float eps) {
#pragma omp parallel if (TF_PAR(T, T * D))
    {
        float *row = malloc(D * sizeof(float));
#pragma omp for
        for (int64_t t = 0; t < T; t++) {
            tf_rms_norm_row(row, x + t * D, w, D, eps);
            tf_narrow_row(out + t * D, row, D);
        }
        free(row);
    }
}

/* Rotate q and k in place inside the fused qkv rows ([T, row_stride]: H query heads, then KVH key
 * heads, then KVH value heads, D each) with non-interleaved RoPE, then store k and v at their KV
 * cache slots ([slots, KVH, D] views of the K and V pools). cos / sin_signed: [positions, D] tables,
 * sin_signed = [-sin | sin], so x' = x * cos + roll(x, D/2) * sin_signed. */
void tf_rope_write_kv(float *qkv, int64_t T, int64_t row_stride, int64_t H, int64_t KVH, int64_t D,
                      const int64_t *positions, const float *cos_t, const float *sin_t,
                      float *k_cache, float *v_cache, const int64_t *slots) {
    const int64_t half = D / 2;
#pragma omp parallel for if (TF_PAR(T, T * (H + KVH) * D))
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * row_stride;
        const float *c = cos_t + positions[t] * D, *s = sin_t + positions[t] * D;
        float tmp[512];
        for (int64_t h = 0; h < H + KVH; h++) {
            float *x = row + h * D;
            memcpy(tmp, x, D * sizeof(float));
            for (int64_t i = 0; i < half; i++) {
                float a = tmp[i] * c[i], b = tmp[i + half] * s[i];
                x[i] = a + b;
            }
            for (int64_t i = half; i < D; i++) {
                float a = tmp[i] * c[i], b = tmp[i - half] * s[i];
                x[i] = a + b;
            }
        }
        memcpy(k_cache + slots[t] * KVH * D, row + H * D, KVH * D * sizeof(float));
        memcpy(v_cache + slots[t] * KVH * D, row + (H + KVH) * D, KVH * D * sizeof(float));
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* The G query heads that share kv head kh, against one sequence's keys and values (head_dim a
 * multiple of 64). Scores 4 keys at a time for every head while those rows are in L1 (horizontal adds
 * instead of one reduction per key), the vector exp, then P V per head with the output held in
 * registers 64 dims at a time (V rows come from memory for the first head, from cache after).
 * qg: the G heads' queries, D apart; o: their outputs, D apart; p: scratch of G * L floats. */
static void tf_attend_group64(float *o, const float *qg, int64_t G, const float *k_cache, const float *v_cache,
                              const int64_t *bt, int64_t L, int64_t bs, int64_t KVH, int64_t kh, int64_t D,
                              float scale, float *p, int64_t j0) {
#define TF_ROW(cache, j) ((cache) + ((bt[((j) + j0) / bs] * bs + ((j) + j0) % bs) * KVH + kh) * D)
    int64_t j = 0;
    for (; j + 4 <= L; j += 4) {
        const float *k0 = TF_ROW(k_cache, j), *k1 = TF_ROW(k_cache, j + 1);
        const float *k2 = TF_ROW(k_cache, j + 2), *k3 = TF_ROW(k_cache, j + 3);
        for (int64_t g = 0; g < G; g++) {
            const float *qh = qg + g * D;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qh + d);
                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
            }
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
            const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            _mm_storeu_ps(p + g * L + j, _mm_mul_ps(sums, _mm_set1_ps(scale)));
        }
    }
    for (; j < L; j++) {
        const float *kr = TF_ROW(k_cache, j);
        for (int64_t g = 0; g < G; g++) {
            __m256 a = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8)
                a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + g * D + d), _mm256_loadu_ps(kr + d), a);
            p[g * L + j] = tf_hsum(a) * scale;
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *pg = p + g * L, *og = o + g * D;
        const __m256 vi = _mm256_set1_ps(tf_softmax_row(pg, L));
        for (int64_t c = 0; c < D; c += 64) {
            __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0, o4 = o0, o5 = o0, o6 = o0, o7 = o0;
            for (j = 0; j < L; j++) {
                const float *vr = TF_ROW(v_cache, j) + c;
                const __m256 pj = _mm256_set1_ps(pg[j]);
                o0 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr), o0);
                o1 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 8), o1);
                o2 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 16), o2);
                o3 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 24), o3);
                o4 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 32), o4);
                o5 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 40), o5);
                o6 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 48), o6);
                o7 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 56), o7);
            }
            _mm256_storeu_ps(og + c, _mm256_mul_ps(o0, vi));
            _mm256_storeu_ps(og + c + 8, _mm256_mul_ps(o1, vi));
            _mm256_storeu_ps(og + c + 16, _mm256_mul_ps(o2, vi));
            _mm256_storeu_ps(og + c + 24, _mm256_mul_ps(o3, vi));
            _mm256_storeu_ps(og + c + 32, _mm256_mul_ps(o4, vi));
            _mm256_storeu_ps(og + c + 40, _mm256_mul_ps(o5, vi));
            _mm256_storeu_ps(og + c + 48, _mm256_mul_ps(o6, vi));
            _mm256_storeu_ps(og + c + 56, _mm256_mul_ps(o7, vi));
        }
    }
#undef TF_ROW
}
#endif

/* Any head_dim: the plain loops. */
static void tf_attend_head(float *o, const float *qh, const float *k_cache, const float *v_cache,
                           const int64_t *bt, int64_t L, int64_t bs, int64_t KVH, int64_t kh, int64_t D,
                           float scale, float *p, int64_t j0) {
    float m = -INFINITY, sum = 0.f;
    for (int64_t j = 0; j < L; j++) {
        const float *kr = k_cache + ((bt[(j + j0) / bs] * bs + (j + j0) % bs) * KVH + kh) * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; d++) dot += qh[d] * kr[d];
        p[j] = dot * scale;
        m = p[j] > m ? p[j] : m;
    }
    for (int64_t j = 0; j < L; j++) {
        p[j] = expf(p[j] - m);
        sum += p[j];
    }
    memset(o, 0, sizeof(float) * D);
    for (int64_t j = 0; j < L; j++) {
        const float *vr = v_cache + ((bt[(j + j0) / bs] * bs + (j + j0) % bs) * KVH + kh) * D;
        const float pj = p[j] / sum;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) o[d] += pj * vr[d];
    }
}

/* Decode attention straight from the paged pools, one query token per sequence:
 * out[b, h] = softmax(scale * q[b, h] . K[b]) V[b] over the sequence's first ctx_lens[b] tokens,
 * where token j of sequence b sits in block block_tables[b, j / bs] at offset j % bs.
 * q rows are q_stride floats apart (the fused qkv rows); out is [B, H, D]; query head h reads kv
 * head h / (H / KVH), as repeat_kv does. One (sequence, kv head) pair per task.
 * window > 0 (a sliding-window layer): only the last `window` tokens of each sequence are attended. */
void tf_decode_attention_window(float *out, const float *q, int64_t q_stride, const float *k_cache,
                                const float *v_cache, const int64_t *block_tables, int64_t bt_stride,
                                const int64_t *ctx_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                                int64_t bs, float scale, int64_t window) {
    const int64_t G = H / KVH;
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = window > 0 && ctx_lens[b] > window ? window : ctx_lens[b];
        max_len = n > max_len ? n : max_len;
    }
#pragma omp parallel if (B * KVH >= 2)
    {
        float *p = (float *)malloc(sizeof(float) * (size_t)(G * max_len));
#pragma omp for schedule(dynamic, 2)
        for (int64_t task = 0; task < B * KVH; task++) {
            const int64_t b = task / KVH, kh = task % KVH;
            const int64_t *bt = block_tables + b * bt_stride;
            float *o = out + (b * H + kh * G) * D;
            const float *qg = q + b * q_stride + kh * G * D;
            const int64_t j0 = window > 0 && ctx_lens[b] > window ? ctx_lens[b] - window : 0;
            const int64_t L = ctx_lens[b] - j0;
#if defined(__AVX2__) && defined(__FMA__)
            if (D % 64 == 0) {
                tf_attend_group64(o, qg, G, k_cache, v_cache, bt, L, bs, KVH, kh, D, scale, p, j0);
                continue;
            }
#endif
            for (int64_t g = 0; g < G; g++)
                tf_attend_head(o + g * D, qg + g * D, k_cache, v_cache, bt, L, bs, KVH, kh, D, scale, p, j0);
        }
        free(p);
    }
}

/* tf_paged_decode_attention: tf_decode_attention_window's arithmetic (per query head, softmax(scale
 * q.K) V over the sequence's first ctx_lens tokens, or its last `window`), rewritten for many and long
 * sequences, where decode attention reads more bytes than the linears (64 sequences of ~135 tokens read
 * 400 MB of float32 K/V per step on SmolLM2-135M; the old kernel took ~38 ms of an 81 ms step there):
 *  - each task locates its token rows once, in an offset table built by walking the block table,
 *    instead of a division and a modulo per row and query head;
 *  - AVX-512 builds score up to 4 of the heads that share a kv head against 4 keys at once, loading
 *    (and widening) each 16 values of a key once for all of them (tf_qk512), and accumulate P V for up
 *    to 4 heads at once in registers, reading each V row once instead of once per head;
 *  - each thread claims its next task before it starts one and prefetches that task's rows into L2
 *    while it computes (tf_ahead_t). Without it a thread's DRAM reads (the first kv head's pass) and
 *    its arithmetic (the other passes, softmax, P V) took turns: float16 pools at 32 rows x 192 tokens
 *    moved ~4 GB/s on one thread against ~9.4 GB/s for a streaming read, and ~6-7 GB/s with it
 *    (benchmarks/decode_attention.py --threads 1, 2026-12-02);
 *  - rows 8 keys ahead are prefetched too (whole rows, every kv head's, when a task takes a whole
 *    sequence): they cover each thread's first task, which nothing prefetched.
 * tf_paged_decode_attention_f16 reads float16 pools (kv_cache_dtype="float16": half the bytes, values
 * widened exactly to float32 as they are loaded; the arithmetic is the same). The old function stays
 * as the reference the benchmark measures against (benchmarks/decode_attention.py). */
#if defined(__AVX2__) && defined(__FMA__)

#ifndef TF_AHEAD
#define TF_AHEAD 8          /* rows prefetched ahead */
#endif
/* The cache lines of `bytes` bytes from r. */
static inline void tf_prefetch_row(const char *r, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(r + i, _MM_HINT_T0);
}

/* The next task's rows, prefetched into L2 a few at a time while the current task computes (its K rows,
 * then its V rows): a thread's memory reads then overlap its arithmetic instead of alternating with it.
 * Paced evenly (total rows over the `calls` steps the current task makes, Bresenham-style), so the
 * prefetches do not pile up in the fill buffers ahead of the current task's own loads. */
typedef struct {
    const char *k, *v;              /* the next task's bases: whole rows, or one kv head's part */
    const int64_t *off;             /* its row offsets (elements) */
    int64_t rows, bytes, es;        /* its rows; bytes prefetched per row; bytes per element */
    int64_t total, done, acc, calls;    /* 2 * rows (0: no next task), rows issued, pacing */
} tf_ahead_t;

static inline __attribute__((always_inline)) void tf_ahead_step(tf_ahead_t *a) {
    for (a->acc += a->total; a->acc >= a->calls && a->done < a->total; a->acc -= a->calls) {
        const int64_t r = a->done++;
        const char *row = r < a->rows ? a->k + a->off[r] * a->es : a->v + a->off[r - a->rows] * a->es;
        for (int64_t i = 0; i < a->bytes; i += 64) _mm_prefetch(row + i, _MM_HINT_T1);
    }
}

/* 8 or 16 values at element i of a float32 (half = 0) or float16 (half = 1) row, as float32. */
static inline __attribute__((always_inline)) __m256 tf_ld8(const char *base, int64_t i, const int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)))
                : _mm256_loadu_ps((const float *)base + i);
}
#endif

#if defined(__AVX512F__)
static inline __attribute__((always_inline)) __m512 tf_ld16(const char *base, int64_t i, const int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i)))
                : _mm512_loadu_ps((const float *)base + i);
}

/* P V for NG (<= 4) heads, 64 dims from column c: o[g * D + c ..] = inv[g] * sum_j p[g * L + j] V[j]. */
static inline __attribute__((always_inline)) void tf_pv512(const int NG, float *o, const float *p, int64_t L,
                                                           const char *vb, const int64_t *off, int64_t c,
                                                           int64_t D, const float *inv, const char *pv,
                                                           int64_t pfb, tf_ahead_t *ah, const int half) {
    const int64_t es = half ? 2 : 4;
    __m512 acc[4][4];
    for (int g = 0; g < NG; g++)
        for (int i = 0; i < 4; i++) acc[g][i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < L; j++) {
        const char *vr = vb + off[j] * es;
        if (pfb && j + TF_AHEAD < L) tf_prefetch_row(pv + off[j + TF_AHEAD] * es, pfb);
        if ((j & 3) == 3) tf_ahead_step(ah);
        const __m512 v0 = tf_ld16(vr, c, half), v1 = tf_ld16(vr, c + 16, half);
        const __m512 v2 = tf_ld16(vr, c + 32, half), v3 = tf_ld16(vr, c + 48, half);
        for (int g = 0; g < NG; g++) {
            const __m512 pj = _mm512_set1_ps(p[g * L + j]);
            acc[g][0] = _mm512_fmadd_ps(pj, v0, acc[g][0]);
            acc[g][1] = _mm512_fmadd_ps(pj, v1, acc[g][1]);
            acc[g][2] = _mm512_fmadd_ps(pj, v2, acc[g][2]);
            acc[g][3] = _mm512_fmadd_ps(pj, v3, acc[g][3]);
        }
    }
    for (int g = 0; g < NG; g++) {
        const __m512 vi = _mm512_set1_ps(inv[g]);
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(o + g * D + c + 16 * i, _mm512_mul_ps(acc[g][i], vi));
    }
}

static inline __m256 tf_fold512(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

/* (sum of a0's 16 lanes, of a1's, a2's, a3's): two unpack levels leave each 128-bit lane holding the 4
 * partial sums, then the lanes fold (13 uops against 21 for four folds and three hadds). */
static inline __m128 tf_hsum4x512(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512d t0 = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1)));
    const __m512d t1 = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3)));
    const __m256 h = tf_fold512(_mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(t0, t1)),
                                              _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t1))));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Scores of NG (<= 4) heads (queries qh, D apart) against the 4 key rows k[0..3], into p[g * L + j ..]:
 * each 16 values of a key are loaded and widened once for all NG heads. */
static inline __attribute__((always_inline)) void tf_qk512(const int NG, float *p, const float *qh, int64_t L,
                                                           int64_t j, const char *const *k, int64_t D,
                                                           float scale, const int half) {
    __m512 acc[4][4];
    for (int g = 0; g < NG; g++)
        for (int i = 0; i < 4; i++) acc[g][i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
        const __m512 x0 = tf_ld16(k[0], d, half), x1 = tf_ld16(k[1], d, half);
        const __m512 x2 = tf_ld16(k[2], d, half), x3 = tf_ld16(k[3], d, half);
        for (int g = 0; g < NG; g++) {
            const __m512 qv = _mm512_loadu_ps(qh + g * D + d);
            acc[g][0] = _mm512_fmadd_ps(qv, x0, acc[g][0]);
            acc[g][1] = _mm512_fmadd_ps(qv, x1, acc[g][1]);
            acc[g][2] = _mm512_fmadd_ps(qv, x2, acc[g][2]);
            acc[g][3] = _mm512_fmadd_ps(qv, x3, acc[g][3]);
        }
    }
    for (int g = 0; g < NG; g++)
        _mm_storeu_ps(p + g * L + j, _mm_mul_ps(tf_hsum4x512(acc[g][0], acc[g][1], acc[g][2], acc[g][3]),
                                                _mm_set1_ps(scale)));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* The G query heads of one kv head against one sequence's rows at element offsets off[j] of kb / vb (D
 * a multiple of 64); o and qg: the G heads, D apart; p: scratch of G * L floats. pk / pv and pfb:
 * prefetch pfb bytes of each row ahead from those bases (0: none). */
static inline __attribute__((always_inline)) void tf_attend_rows64_t(
        float *o, const float *qg, int64_t G, const char *kb, const char *vb, const int64_t *off, int64_t L,
        int64_t D, float scale, float *p, const char *pk, const char *pv, int64_t pfb, tf_ahead_t *ah,
        const int half) {
    const int64_t es = half ? 2 : 4;
    int64_t j = 0;
    for (; j + 4 <= L; j += 4) {
        const char *k0 = kb + off[j] * es, *k1 = kb + off[j + 1] * es;
        const char *k2 = kb + off[j + 2] * es, *k3 = kb + off[j + 3] * es;
        if (pfb && j + TF_AHEAD + 4 <= L)
            for (int i = TF_AHEAD; i < TF_AHEAD + 4; i++) tf_prefetch_row(pk + off[j + i] * es, pfb);
        tf_ahead_step(ah);
#if defined(__AVX512F__)
        const char *k[4] = {k0, k1, k2, k3};
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
            const int64_t n = G - g0 < 4 ? G - g0 : 4;
            if (n == 4) tf_qk512(4, p + g0 * L, qg + g0 * D, L, j, k, D, scale, half);
            else if (n == 3) tf_qk512(3, p + g0 * L, qg + g0 * D, L, j, k, D, scale, half);
            else if (n == 2) tf_qk512(2, p + g0 * L, qg + g0 * D, L, j, k, D, scale, half);
            else tf_qk512(1, p + g0 * L, qg + g0 * D, L, j, k, D, scale, half);
        }
#else
        for (int64_t g = 0; g < G; g++) {
            const float *qh = qg + g * D;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qh + d);
                a0 = _mm256_fmadd_ps(qv, tf_ld8(k0, d, half), a0);
                a1 = _mm256_fmadd_ps(qv, tf_ld8(k1, d, half), a1);
                a2 = _mm256_fmadd_ps(qv, tf_ld8(k2, d, half), a2);
                a3 = _mm256_fmadd_ps(qv, tf_ld8(k3, d, half), a3);
            }
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
            const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            _mm_storeu_ps(p + g * L + j, _mm_mul_ps(sums, _mm_set1_ps(scale)));
        }
#endif
    }
    for (; j < L; j++) {
        const char *kr = kb + off[j] * es;
        for (int64_t g = 0; g < G; g++) {
            __m256 a = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8)
                a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + g * D + d), tf_ld8(kr, d, half), a);
            p[g * L + j] = tf_hsum(a) * scale;
        }
    }
    float inv[G];
    for (int64_t g = 0; g < G; g++) inv[g] = tf_softmax_row(p + g * L, L);
#if defined(__AVX512F__)
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t n = G - g0 < 4 ? G - g0 : 4;
        for (int64_t c = 0; c < D; c += 64) {
            float *og = o + g0 * D;
            const float *pg = p + g0 * L;
            const int64_t w = g0 == 0 && c == 0 ? pfb : 0;     /* each row prefetched once */
            if (n == 4) tf_pv512(4, og, pg, L, vb, off, c, D, inv + g0, pv, w, ah, half);
            else if (n == 3) tf_pv512(3, og, pg, L, vb, off, c, D, inv + g0, pv, w, ah, half);
            else if (n == 2) tf_pv512(2, og, pg, L, vb, off, c, D, inv + g0, pv, w, ah, half);
            else tf_pv512(1, og, pg, L, vb, off, c, D, inv + g0, pv, w, ah, half);
        }
    }
#else
    for (int64_t g = 0; g < G; g++) {
        const float *pg = p + g * L;
        float *og = o + g * D;
        const __m256 vi = _mm256_set1_ps(inv[g]);
        for (int64_t c = 0; c < D; c += 64) {
            __m256 acc[8];
            for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
            for (j = 0; j < L; j++) {
                const char *vr = vb + off[j] * es;
                if (g == 0 && c == 0 && pfb && j + TF_AHEAD < L) tf_prefetch_row(pv + off[j + TF_AHEAD] * es, pfb);
                if ((j & 3) == 3) tf_ahead_step(ah);
                const __m256 pj = _mm256_set1_ps(pg[j]);
                for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(pj, tf_ld8(vr, c + 8 * i, half), acc[i]);
            }
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(og + c + 8 * i, _mm256_mul_ps(acc[i], vi));
        }
    }
#endif
}

/* Task b's row offsets (elements) into off: its first ctx_lens[b] tokens, or its last `window`; returns
 * how many. */
static inline int64_t tf_row_offsets(int64_t *off, const int64_t *bt, int64_t ctx, int64_t window, int64_t bs,
                                     int64_t KVH, int64_t D) {
    const int64_t j0 = window > 0 && ctx > window ? ctx - window : 0, L = ctx - j0;
    int64_t blk = j0 / bs, t = j0 % bs;
    for (int64_t j = 0; j < L; j++) {
        off[j] = (bt[blk] * bs + t) * KVH * D;
        if (++t == bs) t = 0, blk++;
    }
    return L;
}

/* The task loop (one thread's, every thread of the team runs it), for float32 (half = 0) or float16
 * (half = 1) pools; D a multiple of 64. */
typedef struct {
    float *out;
    const float *q;
    const char *k_cache, *v_cache;
    const int64_t *block_tables, *ctx_lens;
    int64_t q_stride, bt_stride, B, H, KVH, D, bs, window, max_len, per;
    float scale;
    int64_t claimed;        /* tasks handed out; each thread claims its next task before it starts one */
} tf_attn_job;

static inline __attribute__((always_inline)) void tf_paged_attention_t(tf_attn_job *J, const int half) {
    float *out = J->out;
    const float *q = J->q;
    const char *k_cache = J->k_cache, *v_cache = J->v_cache;
    const int64_t *block_tables = J->block_tables, *ctx_lens = J->ctx_lens;
    const int64_t q_stride = J->q_stride, bt_stride = J->bt_stride, B = J->B, H = J->H, KVH = J->KVH, D = J->D;
    const int64_t bs = J->bs, window = J->window, max_len = J->max_len, per = J->per;
    const float scale = J->scale;
    const int64_t G = H / KVH, es = half ? 2 : 4;
#if defined(__AVX512F__)
    const int64_t pv_passes = (G + 3) / 4 * (D / 64);      /* tf_ahead_step calls per 4 keys of a kv head: */
#else
    const int64_t pv_passes = G * (D / 64);                /* one in QK, one per P V pass */
#endif
    {
        float *p = (float *)malloc(sizeof(float) * (size_t)(G * max_len));
        int64_t *offs = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * max_len));
        int64_t *off = offs, *off_next = offs + max_len;
        /* Tasks: whole sequences when there are enough of them (a sequence's kv heads interleave in
         * its rows, so one core reads them all while they are in its cache), else (sequence, kv head). */
        const int64_t ntasks = B * KVH / per;
        int64_t task = __atomic_fetch_add(&J->claimed, 1, __ATOMIC_RELAXED), b = task * per / KVH, L = 0;
        if (task < ntasks) L = tf_row_offsets(off, block_tables + b * bt_stride, ctx_lens[b], window, bs, KVH, D);
        while (task < ntasks) {
            const int64_t next = __atomic_fetch_add(&J->claimed, 1, __ATOMIC_RELAXED), nb = next * per / KVH;
            const int64_t kh0 = task * per % KVH;
            const int whole = per > 1;
            tf_ahead_t ah = {0};
            ah.es = es;
            ah.calls = per * (L / 4) * (1 + pv_passes);
            ah.calls = ah.calls > 0 ? ah.calls : 1;
            if (next < ntasks) {
                ah.off = off;
                ah.rows = L;
                if (nb != b) {          /* a thread's consecutive tasks often share the sequence */
                    ah.off = off_next;
                    ah.rows = tf_row_offsets(off_next, block_tables + nb * bt_stride, ctx_lens[nb], window, bs, KVH,
                                             D);
                }
                const int64_t nkh = whole ? 0 : next % KVH;
                ah.k = k_cache + nkh * D * es;
                ah.v = v_cache + nkh * D * es;
                ah.bytes = (whole ? KVH * D : D) * es;
                ah.total = 2 * ah.rows;
            }
            /* A whole sequence: its first kv head's pass prefetches whole rows (every kv head's K and
             * V), so the other heads' passes find them in cache and the memory reads are contiguous;
             * one kv head: its own D values per row. */
            for (int64_t kh = kh0; kh < kh0 + per; kh++) {
                const char *kb = k_cache + kh * D * es, *vb = v_cache + kh * D * es;
                tf_attend_rows64_t(out + (b * H + kh * G) * D, q + b * q_stride + kh * G * D, G, kb, vb, off, L, D,
                                   scale, p, whole ? k_cache : kb, whole ? v_cache : vb,
                                   (whole ? (kh == kh0 ? KVH * D : 0) : D) * es, &ah, half);
            }
            if (next < ntasks && nb != b) {
                int64_t *t = off;
                off = off_next, off_next = t;
                L = ah.rows;
            }
            task = next, b = nb;
        }
        free(p);
        free(offs);
    }
}

static void tf_paged_attention_f32(void *J) { tf_paged_attention_t((tf_attn_job *)J, 0); }
static void tf_paged_attention_f16(void *J) { tf_paged_attention_t((tf_attn_job *)J, 1); }

/* The team: whole sequences per task when there are enough of them (a sequence's kv heads interleave in its
 * rows, so one core reads them all while they are in its cache), else (sequence, kv head). */
static void tf_paged_attention(float *out, const float *q, int64_t q_stride, const char *k_cache, const char *v_cache,
                               const int64_t *block_tables, int64_t bt_stride, const int64_t *ctx_lens, int64_t B,
                               int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale, int64_t window, int half) {
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = window > 0 && ctx_lens[b] > window ? window : ctx_lens[b];
        max_len = n > max_len ? n : max_len;
    }
    const int nth = B * KVH >= 2 && !omp_in_parallel() ? tf_pool_team() : 1;
    tf_attn_job J = {out, q, k_cache, v_cache, block_tables, ctx_lens, q_stride, bt_stride, B, H, KVH, D, bs, window,
                     max_len, B >= 4 * nth ? KVH : 1, scale, 0};
    tf_team(half ? tf_paged_attention_f16 : tf_paged_attention_f32, &J, nth, B <= TF_POOL_MAX_ROWS);
}
#endif

void tf_paged_decode_attention(float *out, const float *q, int64_t q_stride, const float *k_cache,
                               const float *v_cache, const int64_t *block_tables, int64_t bt_stride,
                               const int64_t *ctx_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                               int64_t bs, float scale, int64_t window) {
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 64 == 0) {
        tf_paged_attention(out, q, q_stride, (const char *)k_cache, (const char *)v_cache, block_tables, bt_stride,
                           ctx_lens, B, H, KVH, D, bs, scale, window, 0);
        return;
    }
#endif
    tf_decode_attention_window(out, q, q_stride, k_cache, v_cache, block_tables, bt_stride, ctx_lens, B, H, KVH, D,
                               bs, scale, window);
}

/* Float16 pools: D a multiple of 64 on an AVX2 build (the Python side checks; torch's path otherwise). */
void tf_paged_decode_attention_f16(float *out, const float *q, int64_t q_stride, const uint16_t *k_cache,
                                   const uint16_t *v_cache, const int64_t *block_tables, int64_t bt_stride,
                                   const int64_t *ctx_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                                   int64_t bs, float scale, int64_t window) {
#if defined(__AVX2__) && defined(__FMA__)
    tf_paged_attention(out, q, q_stride, (const char *)k_cache, (const char *)v_cache, block_tables, bt_stride,
                       ctx_lens, B, H, KVH, D, bs, scale, window, 1);
#else
    (void)out; (void)q; (void)q_stride; (void)k_cache; (void)v_cache; (void)block_tables; (void)bt_stride;
    (void)ctx_lens; (void)B; (void)H; (void)KVH; (void)D; (void)bs; (void)scale; (void)window;
    abort();
#endif
}

/* tf_rope_write_kv for float16 pools: the same rotation in place (float32), then k and v stored rounded
 * to nearest float16 (as torch's .to(torch.float16)). */
void tf_rope_write_kv_f16(float *qkv, int64_t T, int64_t row_stride, int64_t H, int64_t KVH, int64_t D,
                          const int64_t *positions, const float *cos_t, const float *sin_t,
                          uint16_t *k_cache, uint16_t *v_cache, const int64_t *slots) {
#if defined(__AVX2__) && defined(__FMA__)      /* F16C conversions; other builds never get float16 pools */
    const int64_t half = D / 2, n = KVH * D;
#pragma omp parallel for if (TF_PAR(T, T * (H + KVH) * D))
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * row_stride;
        const float *c = cos_t + positions[t] * D, *s = sin_t + positions[t] * D;
        float tmp[512];
        for (int64_t h = 0; h < H + KVH; h++) {
            float *x = row + h * D;
            memcpy(tmp, x, D * sizeof(float));
            for (int64_t i = 0; i < half; i++) x[i] = tmp[i] * c[i] + tmp[i + half] * s[i];
            for (int64_t i = half; i < D; i++) x[i] = tmp[i] * c[i] + tmp[i - half] * s[i];
        }
        const float *src[2] = {row + H * D, row + (H + KVH) * D};
        uint16_t *dst[2] = {k_cache + slots[t] * n, v_cache + slots[t] * n};
        for (int kv = 0; kv < 2; kv++) {
            int64_t i = 0;
            for (; i + 8 <= n; i += 8)
                _mm_storeu_si128((__m128i *)(dst[kv] + i),
                                 _mm256_cvtps_ph(_mm256_loadu_ps(src[kv] + i), _MM_FROUND_TO_NEAREST_INT));
            for (; i < n; i++) dst[kv][i] = _cvtss_sh(src[kv][i], _MM_FROUND_TO_NEAREST_INT);
        }
    }
#else
    (void)qkv; (void)T; (void)row_stride; (void)H; (void)KVH; (void)D; (void)positions; (void)cos_t; (void)sin_t;
    (void)k_cache; (void)v_cache; (void)slots;
    abort();
#endif
}

void tf_decode_attention(float *out, const float *q, int64_t q_stride, const float *k_cache,
                         const float *v_cache, const int64_t *block_tables, int64_t bt_stride,
                         const int64_t *ctx_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                         int64_t bs, float scale) {
    tf_paged_decode_attention(out, q, q_stride, k_cache, v_cache, block_tables, bt_stride, ctx_lens, B, H, KVH, D,
                              bs, scale, 0);
}

/* The residual add and the next RMSNorm in one pass: sum[t] = x[t] + y[t], out[t] = rms_norm(sum[t]) (as
 * tf_rms_norm). y float32, or bfloat16 (y_bf16: a bf16 GEMM's result, widened exactly); out float32, or
 * bfloat16 (out_bf16, rounded as tf_rms_norm_bf16). The same bits as torch's x + y, then the norm kernel. */
void tf_add_rms_norm(float *sum, void *out, const float *x, const void *y, const float *w, int64_t T, int64_t D,
                     float eps, int64_t y_bf16, int64_t out_bf16) {
#pragma omp parallel if (TF_PAR(T, T * D))
    {
        float *row = out_bf16 ? malloc(D * sizeof(float)) : NULL;
#pragma omp for
        for (int64_t t = 0; t < T; t++) {
            const float *xr = x + t * D;
            float *s = sum + t * D;
            if (y_bf16) {
                const uint16_t *yr = (const uint16_t *)y + t * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) s[d] = xr[d] + tf_from_bf16(yr[d]);
            } else {
                const float *yr = (const float *)y + t * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) s[d] = xr[d] + yr[d];
            }
            if (out_bf16) {
                tf_rms_norm_row(row, s, w, D, eps);
                tf_narrow_row((uint16_t *)out + t * D, row, D);
            } else {
                tf_rms_norm_row((float *)out + t * D, s, w, D, eps);
            }
        }
        free(row);
    }
}

/* One row of tf_silu_mul: o[i] = silu(g[i]) * u[i] (shared with tf_silu_mul_bf16). */
static inline __attribute__((always_inline)) void tf_silu_mul_row(float *o, const float *g, const float *u, int64_t I) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= I; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.f), tf_exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < I; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

/* out[t] = silu(gate_up[t, :I]) * gate_up[t, I:], the SwiGLU activation of a fused gate/up row. */
void tf_silu_mul(float *out, const float *gate_up, int64_t T, int64_t I) {
#pragma omp parallel for if (TF_PAR(T, T * I))
    for (int64_t t = 0; t < T; t++) tf_silu_mul_row(out + t * I, gate_up + t * 2 * I, gate_up + t * 2 * I + I, I);
}

/* tf_silu_mul on bfloat16 rows, bfloat16 out: the gate/up GEMM's bf16 result straight into the bf16 down
 * projection. Widened exactly, computed as tf_silu_mul, rounded once (tf_to_bf16): the same bits as
 * .float(), tf_silu_mul, .to(torch.bfloat16), without the two float32 tensors. */
void tf_silu_mul_bf16(uint16_t *out, const uint16_t *gate_up, int64_t T, int64_t I) {
#pragma omp parallel if (TF_PAR(T, T * I))
    {
        float *row = malloc(3 * I * sizeof(float));     /* gate | up | result */
#pragma omp for
        for (int64_t t = 0; t < T; t++) {
            const uint16_t *gu = gate_up + t * 2 * I;
#pragma omp simd
            for (int64_t i = 0; i < 2 * I; i++) row[i] = tf_from_bf16(gu[i]);
            tf_silu_mul_row(row + 2 * I, row, row + I, I);
            tf_narrow_row(out + t * I, row + 2 * I, I);
        }
        free(row);
    }
}

/* out[r] = the index of row r's maximum, the first of tied maxima, and the first NaN where the row has one:
 * torch's max(dim=-1).indices (and argmax), for greedy sampling over the vocabulary. One pass per row: each
 * lane keeps its largest value and that value's first index (an ordered greater-than never takes a NaN, so
 * a lane's first NaN is noted apart and the scalar loop finds the row's first), then the lanes reduce to
 * the largest value at the smallest index. Rows of `stride` floats; in parallel over rows. */
static int64_t tf_argmax_row(const float *x, int64_t N) {
    int64_t i = 0, best_i = 0;
    float best = -INFINITY;
    int nan = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (N >= 8) {
        __m256 bv = _mm256_set1_ps(-INFINITY), unord = _mm256_setzero_ps();
        __m256i bi = _mm256_setzero_si256(), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i eight = _mm256_set1_epi32(8);
        for (; i + 8 <= N; i += 8) {
            const __m256 v = _mm256_loadu_ps(x + i);
            const __m256 gt = _mm256_cmp_ps(v, bv, _CMP_GT_OQ);
            unord = _mm256_or_ps(unord, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            bv = _mm256_blendv_ps(bv, v, gt);
            bi = _mm256_blendv_epi8(bi, idx, _mm256_castps_si256(gt));
            idx = _mm256_add_epi32(idx, eight);
        }
        nan = _mm256_movemask_ps(unord) != 0;
        float vals[8];
        int32_t ids[8];
        _mm256_storeu_ps(vals, bv);
        _mm256_storeu_si256((__m256i *)ids, bi);
        best_i = -1;
        for (int l = 0; l < 8; l++)           /* a lane that never saw a value above -inf keeps index 0.. */
            if (vals[l] > best || (vals[l] == best && ids[l] < best_i) || best_i < 0)
                best = vals[l], best_i = ids[l];
        if (best == -INFINITY) best_i = 0;    /* ..so an all -inf prefix answers 0, as torch does */
    }
#endif
    for (; i < N; i++) {
        if (x[i] != x[i]) { nan = 1; break; }
        if (x[i] > best) best = x[i], best_i = i;
    }
    if (nan)
        for (int64_t j = 0; j < N; j++)
            if (x[j] != x[j]) return j;
    return best_i;
}

void tf_argmax_rows(int64_t *out, const float *x, int64_t M, int64_t N, int64_t stride) {
#pragma omp parallel for if (M * N >= (1 << 16))
    for (int64_t r = 0; r < M; r++) out[r] = tf_argmax_row(x + r * stride, N);
}

/* out[t] = gelu_tanh(gate_up[t, :I]) * gate_up[t, I:], the GeGLU activation (Gemma) of a fused gate/up row.
 * gelu_tanh(g) = 0.5 g (1 + tanh(u)), u = sqrt(2 / pi) (g + 0.044715 g^3), computed as g / (1 + e^(-2u))
 * (the same value: 1 + tanh(u) = 2 / (1 + e^(-2u))), so it shares tf_silu_mul's exp and has no
 * cancellation near u = 0. Within a few ulp of torch's gelu(approximate="tanh") (Sleef's tanh), not
 * bit-equal: the cpu backend runs this kernel in the layer path and the one-call stack alike. */
void tf_gelu_tanh_mul(float *out, const float *gate_up, int64_t T, int64_t I) {
    const float k2 = 2.f * 0.7978845608028654f, kk = 0.044715f;     /* 2 sqrt(2 / pi), the cubic's factor */
#pragma omp parallel for if (TF_PAR(T, T * I))
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(gv, gv), gv);
            const __m256 inner = _mm256_mul_ps(_mm256_set1_ps(k2), _mm256_fmadd_ps(_mm256_set1_ps(kk), g3, gv));
            const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.f), tf_exp256(_mm256_sub_ps(_mm256_setzero_ps(), inner)));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i++) {
            const float inner = k2 * fmaf(kk, g[i] * g[i] * g[i], g[i]);
            o[i] = g[i] / (1.f + expf(-inner)) * u[i];
        }
    }
}

/* Quantized weights times activations for a few rows (decode): y[M, N] = x[M, K] @ W^T, 8 rows per
 * pass over W.
 * Each activation row is quantized to int16 in blocks of 32 (one float scale per block: max|x| /
 * 32767, a relative error near 2^-16, finer than bfloat16), so a block's dot product is an integer
 * one (AVX2 madd_epi16 on weights widened to 16 bits); W is read in its quantized form once for all M
 * rows. A row's result depends on that row alone (no batch effects). llama.cpp quantizes activations
 * to int8 here: that is tf_qdot below, opt-in (KL 3.5e-3 against float on the bundled model, where
 * this kernel gives 3e-7).
 *   bits 4: q [N, K/2] bytes, in blocks of 32 weights = 16 bytes where byte j holds weight j in its
 *           low nibble and weight j + 16 in its high one (GGUF's order); w = q * d[n, k / gs] + m[n, k / gs]
 *           (the m term uses the float32 sums of x).
 *   bits 8: q [N, K] int8; w = q * d[n, k / gs]   (m unused).
 * gs is a multiple of 32; K a multiple of gs. */
#define TF_MAX_ROWS 8

static void tf_quantize_blocks(const float *x, int64_t n, int16_t *xq, float *dx) {
    for (int64_t b = 0; b < n / 32; b++) {
        const float *xb = x + b * 32;
#if defined(__AVX2__) && defined(__FMA__)
        /* the same arithmetic 8 lanes at a time: the scalar loop called libm's fmaxf per element, and
         * it runs serially before every tf_qgemm call (~100k activations a decode token) */
        const __m256 nosign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 mx = _mm256_setzero_ps();         /* max(a, mx) keeps mx where a is NaN, as fmaxf */
        for (int j = 0; j < 32; j += 8) mx = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xb + j), nosign), mx);
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const float d = amax / 32767.f, id = amax > 0.f ? 32767.f / amax : 0.f;
        const __m256 vid = _mm256_set1_ps(id);
        for (int j = 0; j < 32; j += 16) {       /* round to nearest even, as lrintf */
            const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j), vid));
            const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j + 8), vid));
            _mm256_storeu_si256((__m256i *)(xq + b * 32 + j),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8));
        }
#else
        float amax = 0.f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float d = amax / 32767.f, id = amax > 0.f ? 32767.f / amax : 0.f;
        for (int j = 0; j < 32; j++) xq[b * 32 + j] = (int16_t)lrintf(xb[j] * id);
#endif
        dx[b] = d;
    }
}

#if defined(__AVX2__) && defined(__FMA__)

/* A block's 32 weights widened to int16: w[0] holds weights 0..15, w[1] weights 16..31. */
static inline __attribute__((always_inline)) void tf_load_weights(const void *q, int64_t b, int64_t bits, __m256i w[2]) {
    if (bits == 4) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)((const uint8_t *)q + b * 16));
        const __m128i mask = _mm_set1_epi8(0x0F);
        w[0] = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, mask));
        w[1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
    } else {
        const int8_t *p = (const int8_t *)q + b * 32;
        w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
        w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)));
    }
}

/* 8 partial sums of one block's integer dot product, as floats. */
static inline __attribute__((always_inline)) __m256 tf_block_dot(const __m256i w[2], const int16_t *xb) {
    const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w[0], _mm256_loadu_si256((const __m256i *)xb)),
                                       _mm256_madd_epi16(w[1], _mm256_loadu_si256((const __m256i *)(xb + 16))));
    return _mm256_cvtepi32_ps(p);
}

/* One output row for M activation rows; M is a compile-time constant at each call site, so the
 * accumulators live in registers; two per row (even / odd blocks) halve the FMA chain.
 * sb: the weight row's scale for each block of 32; dx: the activations' block scales [M, nb]. */
static inline __attribute__((always_inline)) void tf_qgemm_row(const int M, float *out, const int16_t *xq,
                                                              const float *dx, int64_t K, int64_t nb,
                                                              const void *q, const float *sb, int64_t bits) {
    __m256 acc0[TF_MAX_ROWS], acc1[TF_MAX_ROWS];
    for (int r = 0; r < M; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        __m256i w[2], v[2];
        tf_load_weights(q, b, bits, w);
        tf_load_weights(q, b + 1, bits, v);
        for (int r = 0; r < M; r++) {
            const __m256 s0 = _mm256_set1_ps(sb[b] * dx[r * nb + b]);
            const __m256 s1 = _mm256_set1_ps(sb[b + 1] * dx[r * nb + b + 1]);
            acc0[r] = _mm256_fmadd_ps(s0, tf_block_dot(w, xq + r * K + b * 32), acc0[r]);
            acc1[r] = _mm256_fmadd_ps(s1, tf_block_dot(v, xq + r * K + (b + 1) * 32), acc1[r]);
        }
    }
    if (b < nb) {
        __m256i w[2];
        tf_load_weights(q, b, bits, w);
        for (int r = 0; r < M; r++) {
            const __m256 s0 = _mm256_set1_ps(sb[b] * dx[r * nb + b]);
            acc0[r] = _mm256_fmadd_ps(s0, tf_block_dot(w, xq + r * K + b * 32), acc0[r]);
        }
    }
    for (int r = 0; r < M; r++) out[r] = tf_hsum(_mm256_add_ps(acc0[r], acc1[r]));
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define TF_QGEMM512 1
/* A block's 32 weights widened to int16 in one register, lane j = weight j. */
static inline __attribute__((always_inline)) __m512i tf_load_weights512(const void *q, int64_t b, int64_t bits) {
    if (bits == 4) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)((const uint8_t *)q + b * 16));
        const __m128i mask = _mm_set1_epi8(0x0F);
        return _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask),
                                                     _mm_and_si128(bytes, mask)));
    }
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)((const int8_t *)q + b * 32)));
}

/* tf_qgemm_row on AVX-512: three instructions per block and activation row (one 32-lane int16 dot
 * with the activation block as its memory operand, one convert, one FMA whose scale comes broadcast
 * from memory) instead of about eight, and the scales sb[b] * dx[r, b] multiplied 16 blocks at a time.
 * Per-call minima, 1 thread, the bundled model's int4 shapes streaming over 30 layers (2-core VM,
 * load ~8): the four linears of a layer 0.21 ms at 1 row (0.30 before) and 0.57 ms at 5 rows (0.83).
 * Each extra row still costs ~45 us per 3072 x 576 weight, before and after (with the weight in L2):
 * the int16 dot and the convert both issue on one port, ~2 cycles per block and row, so rows are
 * cheaper only by int8 activations (tf_qdot, lossy) or a tile unit (AMX), not by this loop.
 * Each row's arithmetic is the same whatever M is, so rows still have no batch effects. */
static inline __attribute__((always_inline)) void tf_qgemm_row512(const int M, float *out, const int16_t *xq,
                                                                 const float *dx, int64_t K, int64_t nb,
                                                                 const void *q, const float *sb, int64_t bits) {
    __m512 acc0[TF_MAX_ROWS], acc1[TF_MAX_ROWS];
    float sc[TF_MAX_ROWS][16] __attribute__((aligned(64)));
    for (int r = 0; r < M; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nb; c += 16) {
        const int n = nb - c < 16 ? (int)(nb - c) : 16;
        const __mmask16 mk = (__mmask16)((1u << n) - 1u);
        const __m512 s = _mm512_maskz_loadu_ps(mk, sb + c);
        for (int r = 0; r < M; r++) _mm512_store_ps(sc[r], _mm512_mul_ps(s, _mm512_maskz_loadu_ps(mk, dx + r * nb + c)));
        int j = 0;
        for (; j + 1 < n; j += 2) {
            const __m512i w = tf_load_weights512(q, c + j, bits), v = tf_load_weights512(q, c + j + 1, bits);
            const int16_t *xb = xq + (c + j) * 32;
            for (int r = 0; r < M; r++) {
                const __m512i p0 = _mm512_madd_epi16(w, _mm512_loadu_si512((const void *)(xb + r * K)));
                const __m512i p1 = _mm512_madd_epi16(v, _mm512_loadu_si512((const void *)(xb + r * K + 32)));
                acc0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_set1_ps(sc[r][j]), acc0[r]);
                acc1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), _mm512_set1_ps(sc[r][j + 1]), acc1[r]);
            }
        }
        if (j < n) {
            const __m512i w = tf_load_weights512(q, c + j, bits);
            for (int r = 0; r < M; r++) {
                const __m512i p0 = _mm512_madd_epi16(w, _mm512_loadu_si512((const void *)(xq + r * K + (c + j) * 32)));
                acc0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_set1_ps(sc[r][j]), acc0[r]);
            }
        }
    }
    for (int r = 0; r < M; r++) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
}
#endif
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(TF_QGEMM512)
#define TF_QGEMM4 1
/* tf_qgemm's int4 rows on AVX2 without AVX-512, two blocks per step. tf_qgemm_row widens each block's
 * nibbles with two vpmovzxbw (shuffles) and broadcasts a scale per block and row, ~14 instructions per
 * block: a 1-row decode step of the bundled model was compute-bound on the AMD EPYC (the linears took
 * 7.6 ms a token with the weights in cache, 8.4 ms streamed). Here one 32-byte load holds blocks b and
 * b + 1. Each 16-bit word j of a block holds weights 2j and 2j + 1 in its bytes' low nibbles and 2j + 16,
 * 2j + 17 in their high ones, so a mask, and a shift and a mask, give each of the four as an int16 lane
 * in place, for both blocks at once (word lanes 0-7: block b, 8-15: block b + 1). The activations are
 * laid out once per call to match (tf_qgemm4_prep: per pair of blocks, four 16-lane groups, the inputs
 * of weights 2j, 2j + 1, 2j + 16 and 2j + 17), so a pair costs 7 instructions of weight unpacking shared
 * by the rows and 4 vpmaddwd, 3 adds, a convert, a multiply and an FMA per row, none of them a
 * shuffle. The integer dot of every block is the same exact integer as tf_qgemm_row's; its float
 * partial sums are grouped by 8 products instead of 4, so results differ from that loop in the last
 * bits. Each row's arithmetic is the same whatever M is (rows go four at a time over the same weights),
 * so rows have no batch effects. */
static void tf_qgemm4_prep(const int16_t *xq, const float *dx, int64_t nb, int16_t *xp, float *dx8) {
    static const int off[4] = {0, 1, 16, 17};
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        int16_t *o = xp + b * 32;
        for (int g = 0; g < 4; g++)
            for (int h = 0; h < 2; h++)
                for (int j = 0; j < 8; j++) o[g * 16 + h * 8 + j] = xq[(b + h) * 32 + 2 * j + off[g]];
        for (int i = 0; i < 4; i++) {
            dx8[b * 4 + i] = dx[b];
            dx8[b * 4 + 4 + i] = dx[b + 1];
        }
    }
    if (b < nb) {       /* an odd last block keeps tf_qgemm_row's order and its one scale */
        memcpy(xp + b * 32, xq + b * 32, 32 * sizeof(int16_t));
        dx8[b * 4] = dx[b];
    }
}

/* Blocks b and b + 1 of an int4 row: the four int16 vectors of their weights in tf_qgemm4_prep's order. */
static inline __attribute__((always_inline)) void tf_qgemm4_unpack(const uint8_t *q, int64_t b, __m256i w[4]) {
    const __m256i lo = _mm256_set1_epi16(0x000F);
    const __m256i v = _mm256_loadu_si256((const __m256i *)(q + b * 16));
    w[0] = _mm256_and_si256(v, lo), w[1] = _mm256_and_si256(_mm256_srli_epi16(v, 8), lo);
    w[2] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo), w[3] = _mm256_srli_epi16(v, 12);
}

/* The pair's two weight scales, block b's in lanes 0-3 and block b + 1's in lanes 4-7. */
static inline __attribute__((always_inline)) __m256 tf_qgemm4_scales(const float *sb, int64_t b) {
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(sb + b)), _mm_broadcast_ss(sb + b + 1), 1);
}

/* The pair's integer dots (lanes 0-3: block b, 4-7: block b + 1) against activation vectors x[0..3]. */
static inline __attribute__((always_inline)) __m256i tf_qgemm4_dot(const __m256i w[4], const __m256i x[4]) {
    return _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(w[0], x[0]), _mm256_madd_epi16(w[1], x[1])),
                            _mm256_add_epi32(_mm256_madd_epi16(w[2], x[2]), _mm256_madd_epi16(w[3], x[3])));
}

/* Blocks b and b + 1 of one weight row against M activation rows (laid out by tf_qgemm4_prep). */
static inline __attribute__((always_inline)) void tf_qgemm4_pair(const int M, __m256 *acc, const uint8_t *q,
                                                                const float *sb, const int16_t *xp,
                                                                const float *dx8, int64_t K, int64_t nb,
                                                                int64_t b) {
    __m256i w[4];
    tf_qgemm4_unpack(q, b, w);
    const __m256 s = tf_qgemm4_scales(sb, b);
    for (int r = 0; r < M; r++) {
        const __m256i *xr = (const __m256i *)(xp + r * K + b * 32);
        const __m256i x[4] = {_mm256_loadu_si256(xr), _mm256_loadu_si256(xr + 1), _mm256_loadu_si256(xr + 2),
                              _mm256_loadu_si256(xr + 3)};
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tf_qgemm4_dot(w, x)),
                                 _mm256_mul_ps(s, _mm256_loadu_ps(dx8 + r * nb * 4 + b * 4)), acc[r]);
    }
}

/* The Q4_1 offsets' term, sum over groups of m[g] * xs[g], folded into a row's accumulator before its
 * horizontal sum (8 groups per FMA, the last few by a masked load, whose zero lanes add 0 * 0). */
static inline __attribute__((always_inline)) __m256 tf_fold_offsets(__m256 acc, const float *m, const float *xs,
                                                                   int64_t G) {
    int64_t g = 0;
    for (; g + 8 <= G; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(m + g), _mm256_loadu_ps(xs + g), acc);
    if (g < G) {
        const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(G - g)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        acc = _mm256_fmadd_ps(_mm256_maskload_ps(m + g, k), _mm256_maskload_ps(xs + g, k), acc);
    }
    return acc;
}

/* The odd last block of a row (nb odd), in tf_qgemm_row's order and with its one scale. */
static inline __attribute__((always_inline)) __m256 tf_qgemm4_last(__m256 acc, const uint8_t *q, const float *sb,
                                                                  const int16_t *xp, const float *dx8, int64_t b) {
    __m256i w[2];
    tf_load_weights(q, b, 4, w);
    return _mm256_fmadd_ps(_mm256_set1_ps(sb[b] * dx8[b * 4]), tf_block_dot(w, xp + b * 32), acc);
}

/* One int4 weight row for M <= 4 activation rows: one accumulator chain per row, over the pairs in
 * order, then the offsets' term (m: NULL for none) and one horizontal sum. tf_qgemm4_rows4 gives every
 * row these same operations in this order, so results do not depend on M or on which loop ran them. */
static inline __attribute__((always_inline)) void tf_qgemm4_row(const int M, float *out, const int16_t *xp,
                                                               const float *dx8, int64_t K, int64_t nb,
                                                               const uint8_t *q, const float *sb, const float *m,
                                                               const float *xs, int64_t G) {
    __m256 acc[4];
    for (int r = 0; r < M; r++) acc[r] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) tf_qgemm4_pair(M, acc, q, sb, xp, dx8, K, nb, b);
    for (int r = 0; r < M; r++) {
        if (b < nb) acc[r] = tf_qgemm4_last(acc[r], q, sb, xp + r * K, dx8 + r * nb * 4, b);
        if (m) acc[r] = tf_fold_offsets(acc[r], m, xs + r * G, G);
        out[r] = tf_hsum(acc[r]);
    }
}

/* Four int4 weight rows (q, sb, m: the first one's; the rest follow at row_bytes, G and G) against one
 * activation row: a decode step's linears. Per pair of blocks the four activation vectors and their
 * scales are loaded once for the four rows, and the per-row work after the loop (the offsets' term,
 * the horizontal sum) is a quarter of the loop's instead of most of it for the 18 blocks of a 576-wide
 * row. Each row's arithmetic is tf_qgemm4_row's. */
static inline __attribute__((always_inline)) void tf_qgemm4_rows4(float *out, const int16_t *xp, const float *dx8,
                                                                 int64_t nb, const uint8_t *q, int64_t row_bytes,
                                                                 const float *sb, const float *m, const float *xs,
                                                                 int64_t G) {
    __m256 acc[4];
    for (int i = 0; i < 4; i++) acc[i] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        const __m256i *xr = (const __m256i *)(xp + b * 32);
        const __m256i x[4] = {_mm256_loadu_si256(xr), _mm256_loadu_si256(xr + 1), _mm256_loadu_si256(xr + 2),
                              _mm256_loadu_si256(xr + 3)};
        const __m256 dxv = _mm256_loadu_ps(dx8 + b * 4);
        for (int i = 0; i < 4; i++) {
            __m256i w[4];
            tf_qgemm4_unpack(q + i * row_bytes, b, w);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tf_qgemm4_dot(w, x)),
                                     _mm256_mul_ps(tf_qgemm4_scales(sb + i * G, b), dxv), acc[i]);
        }
    }
    for (int i = 0; i < 4; i++) {
        if (b < nb) acc[i] = tf_qgemm4_last(acc[i], q + i * row_bytes, sb + i * G, xp, dx8, b);
        if (m) acc[i] = tf_fold_offsets(acc[i], m + i * G, xs, G);
        out[i] = tf_hsum(acc[i]);
    }
}
#endif

/* A short float dot product without one long dependency chain (the m * sum(x) term, per row). */
static inline float tf_dot_f32(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float tail = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    tail = tf_hsum(acc);
#endif
    for (; i < n; i++) tail += a[i] * b[i];
    return tail;
}

/* GGUF's K-quant blocks, read as stored: super-blocks of 256 weights along a row (layouts as in ggml
 * and the gguf package's numpy dequantizers, which the tests check every type against). `type` is
 * ggml's type id; tf_qgemm hands these to tf_kgemm when its `bits` argument is one of them, so the
 * same layer table (tf_qlin) and the one-call decode stack take K-quant layers unchanged.
 *   Q2_K (10), 84 bytes:  scales[16] (low nibble scale, high nibble min), qs[64] 2-bit, d, dmin (fp16)
 *   Q3_K (11), 110 bytes: hmask[32], qs[64] 2-bit low bits, scales[12] (16 x 6-bit signed), d
 *   Q4_K (12), 144 bytes: d, dmin, scales[12] (8 x 6-bit scale + 8 x 6-bit min), qs[128] nibbles
 *   Q5_K (13), 176 bytes: d, dmin, scales[12], qh[32] (fifth bits), qs[128]
 *   Q6_K (14), 210 bytes: ql[128] nibbles, qh[64] 2-bit highs, scales[16] int8, d
 * Activations stay float32: a super-block is expanded into 256 floats on the stack once per weight row
 * and dotted with up to 8 activation rows while it is in L1. */
enum { TF_Q2_K = 10, TF_Q3_K = 11, TF_Q4_K = 12, TF_Q5_K = 13, TF_Q6_K = 14 };

int64_t tf_kquant_block_bytes(int64_t type) {
    switch (type) {
        case TF_Q2_K: return 84;
        case TF_Q3_K: return 110;
        case TF_Q4_K: return 144;
        case TF_Q5_K: return 176;
        case TF_Q6_K: return 210;
        default: return 0;
    }
}

static inline float tf_f16(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    const uint32_t e = (h >> 10) & 0x1F, man = h & 0x3FF;
    float f;
    if (e == 0) f = ldexpf((float)man, -24);                        /* zero, subnormal */
    else if (e == 31) f = man ? NAN : INFINITY;
    else f = ldexpf((float)(man | 0x400), (int)e - 25);
    return (h & 0x8000) ? -f : f;
}

/* Q4_K / Q5_K's 8 six-bit scales and mins, packed in 12 bytes. */
static inline void tf_scale_min_k4(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
}

/* One super-block -> 256 floats. */
static void tf_kdecode(const uint8_t *b, int64_t type, float *w) {
    switch (type) {
        case TF_Q2_K: {
            const uint8_t *sc = b, *qs = b + 16;
            const float d = tf_f16(b + 80), dmin = tf_f16(b + 82);
            for (int i = 0; i < 256; i++) {
                const int h = i >> 7, s = (i >> 5) & 3, l = i & 31, sub = i >> 4;
                const int q = (qs[h * 32 + l] >> (2 * s)) & 3;
                w[i] = d * (float)(sc[sub] & 0x0F) * (float)q - dmin * (float)(sc[sub] >> 4);
            }
            break;
        }
        case TF_Q3_K: {
            const uint8_t *hm = b, *qs = b + 32, *s = b + 96;
            const float d = tf_f16(b + 108);
            float dl[16];
            for (int j = 0; j < 16; j++) {
                const int lo = (j < 8 ? s[j] : s[j - 8] >> 4) & 0x0F;
                const int hi = (s[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
                dl[j] = d * (float)((lo | (hi << 4)) - 32);
            }
            for (int i = 0; i < 256; i++) {
                const int h = i >> 7, sh = (i >> 5) & 3, l = i & 31;
                const int q = ((qs[h * 32 + l] >> (2 * sh)) & 3) - (((hm[l] >> (i >> 5)) & 1) ? 0 : 4);
                w[i] = dl[i >> 4] * (float)q;
            }
            break;
        }
        case TF_Q4_K:
        case TF_Q5_K: {
            const float d = tf_f16(b), dmin = tf_f16(b + 2);
            uint8_t sc[8], mn[8];
            tf_scale_min_k4(b + 4, sc, mn);
            const uint8_t *qh = b + 16, *qs = type == TF_Q4_K ? b + 16 : b + 48;
            for (int sub = 0; sub < 8; sub++) {
                const float a = d * (float)sc[sub], m = dmin * (float)mn[sub];
                const uint8_t *qc = qs + (sub >> 1) * 32;
                const int shift = 4 * (sub & 1);
                float *ws = w + sub * 32;
                if (type == TF_Q4_K) {
                    for (int l = 0; l < 32; l++) ws[l] = a * (float)((qc[l] >> shift) & 0x0F) - m;
                } else {
                    for (int l = 0; l < 32; l++)
                        ws[l] = a * (float)(((qc[l] >> shift) & 0x0F) | (((qh[l] >> sub) & 1) << 4)) - m;
                }
            }
            break;
        }
        case TF_Q6_K: {
            const uint8_t *ql = b, *qh = b + 128;
            const int8_t *sc = (const int8_t *)(b + 192);
            const float d = tf_f16(b + 208);
            float dl[16];
            for (int j = 0; j < 16; j++) dl[j] = d * (float)sc[j];
            /* ggml's order: per half of 128, weight s * 32 + l takes ql[l + 32 * (s & 1)]'s low (s < 2) or
             * high nibble and bits 2s..2s+1 of qh[l]; loops without div/mod so they vectorize */
            for (int h = 0; h < 2; h++) {
                const uint8_t *qlh = ql + h * 64, *qhh = qh + h * 32;
                float *wh = w + h * 128;
                const float *dh = dl + h * 8;
                for (int l = 0; l < 32; l++) {
                    const int a = qlh[l], c = qlh[l + 32], e = qhh[l], g = l >> 4;
                    wh[l] = dh[g] * (float)(((a & 15) | ((e & 3) << 4)) - 32);
                    wh[l + 32] = dh[2 + g] * (float)(((c & 15) | (((e >> 2) & 3) << 4)) - 32);
                    wh[l + 64] = dh[4 + g] * (float)(((a >> 4) | (((e >> 4) & 3) << 4)) - 32);
                    wh[l + 96] = dh[6 + g] * (float)(((c >> 4) | (((e >> 6) & 3) << 4)) - 32);
                }
            }
            break;
        }
        default:
            memset(w, 0, 256 * sizeof(float));
    }
}

/* The whole [N, K] weight as float32 (the big-batch path: expand once, then a float GEMM). */
void tf_kdequant(float *out, const uint8_t *raw, int64_t N, int64_t K, int64_t type) {
    const int64_t bb = tf_kquant_block_bytes(type), nsb = K / 256;
#pragma omp parallel for schedule(static) if (N * K >= (1 << 16))
    for (int64_t n = 0; n < N; n++)
        for (int64_t s = 0; s < nsb; s++) tf_kdecode(raw + (n * nsb + s) * bb, type, out + n * K + s * 256);
}

static inline float tf_dot256(const float *a, const float *b) {
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int i = 0; i < 256; i++) acc += a[i] * b[i];
    return acc;
}

#if defined(__AVX2__) && defined(__FMA__)
/* One output row of a K-quant weight (`row`: its super-blocks) for M activation rows (M a constant at
 * each call site): each super-block expanded to 256 floats once, then dotted with every activation row
 * into A vector accumulators per row, kept across the super-blocks, so the FMAs form M * A independent
 * chains (one chain per row and super-block, as before, was latency-bound: ~4x slower at 8 rows) and
 * each row is summed horizontally once. A = 4 / 2 / 1 for up to 2 / 4 / 8 rows keeps them in registers. */
static inline __attribute__((always_inline)) void tf_kgemm_row(const int M, float *out, const float *x, int64_t K,
                                                              const uint8_t *row, int64_t type, int64_t bb) {
    const int A = M <= 2 ? 4 : M <= 4 ? 2 : 1;
    float w[256] __attribute__((aligned(32)));
    __m256 acc[TF_MAX_ROWS][4];
    for (int r = 0; r < M; r++)
        for (int a = 0; a < A; a++) acc[r][a] = _mm256_setzero_ps();
    for (int64_t s = 0; s < K / 256; s++) {
        const float *xs = x + s * 256;
        if (type == TF_Q4_K) {
            /* Q4_K without the float row: each 8 quant bytes give 8 weights of sub-block 2p (low nibbles)
             * and 8 of 2p + 1 (high), a * q - m in registers, straight into the FMAs */
            const uint8_t *b = row + s * bb;
            const float d = tf_f16(b), dmin = tf_f16(b + 2);
            uint8_t sc[8], mn[8];
            tf_scale_min_k4(b + 4, sc, mn);
            const __m256i m4 = _mm256_set1_epi32(0x0F);
            for (int p = 0; p < 4; p++) {
                const __m256 alo = _mm256_set1_ps(d * (float)sc[2 * p]), mlo = _mm256_set1_ps(dmin * (float)mn[2 * p]);
                const __m256 ahi = _mm256_set1_ps(d * (float)sc[2 * p + 1]);
                const __m256 mhi = _mm256_set1_ps(dmin * (float)mn[2 * p + 1]);
                for (int l = 0; l < 32; l += 8) {
                    const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 16 + p * 32 + l)));
                    const __m256 wlo = _mm256_fmsub_ps(alo, _mm256_cvtepi32_ps(_mm256_and_si256(q, m4)), mlo);
                    const __m256 whi = _mm256_fmsub_ps(ahi, _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), mhi);
                    for (int r = 0; r < M; r++) {
                        const float *xr = xs + r * K + p * 64 + l;
                        acc[r][0] = _mm256_fmadd_ps(wlo, _mm256_loadu_ps(xr), acc[r][0]);
                        acc[r][A - 1] = _mm256_fmadd_ps(whi, _mm256_loadu_ps(xr + 32), acc[r][A - 1]);
                    }
                }
            }
            continue;
        }
        if (type == TF_Q6_K) {
            /* Q6_K the same way: per half of 128, 8 bytes of ql (and of ql + 32) and of qh give 8 weights in
             * each of its four runs of 32 (tf_kdecode's order and arithmetic, so the same weight values) */
            const uint8_t *b = row + s * bb;
            const int8_t *sc = (const int8_t *)(b + 192);
            const float d = tf_f16(b + 208);
            const __m256i m4 = _mm256_set1_epi32(0x0F), m3 = _mm256_set1_epi32(3), k32 = _mm256_set1_epi32(32);
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = b + h * 64, *qh = b + 128 + h * 32;
                for (int l = 0; l < 32; l += 8) {
                    const int g = h * 8 + (l >> 4);
                    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ql + l)));
                    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ql + 32 + l)));
                    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qh + l)));
                    const __m256i q[4] = {
                        _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_slli_epi32(_mm256_and_si256(e, m3), 4)),
                        _mm256_or_si256(_mm256_and_si256(c, m4),
                                        _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(e, 2), m3), 4)),
                        _mm256_or_si256(_mm256_srli_epi32(a, 4),
                                        _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(e, 4), m3), 4)),
                        _mm256_or_si256(_mm256_srli_epi32(c, 4), _mm256_slli_epi32(_mm256_srli_epi32(e, 6), 4))};
                    for (int j = 0; j < 4; j++) {
                        const __m256 wv = _mm256_mul_ps(_mm256_set1_ps(d * (float)sc[g + 2 * j]),
                                                        _mm256_cvtepi32_ps(_mm256_sub_epi32(q[j], k32)));
                        for (int r = 0; r < M; r++)
                            acc[r][j & (A - 1)] = _mm256_fmadd_ps(
                                wv, _mm256_loadu_ps(xs + r * K + h * 128 + j * 32 + l), acc[r][j & (A - 1)]);
                    }
                }
            }
            continue;
        }
        tf_kdecode(row + s * bb, type, w);
        for (int i = 0; i < 256; i += 8 * A)
            for (int a = 0; a < A; a++) {
                const __m256 wv = _mm256_load_ps(w + i + 8 * a);
                for (int r = 0; r < M; r++)
                    acc[r][a] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xs + r * K + i + 8 * a), acc[r][a]);
            }
    }
    for (int r = 0; r < M; r++) {
        __m256 t = acc[r][0];
        for (int a = 1; a < A; a++) t = _mm256_add_ps(t, acc[r][a]);
        out[r] = tf_hsum(t);
    }
}
#endif

/* y[M, N] = x[M, K] @ W^T for a K-quant W [N, K / 256 super-blocks]; 8 activation rows per pass. */
void tf_kgemm(float *y, const float *x, int64_t M, int64_t K, int64_t N, const uint8_t *raw, int64_t type) {
    if (M > TF_MAX_ROWS) {
        for (int64_t r0 = 0; r0 < M; r0 += TF_MAX_ROWS)
            tf_kgemm(y + r0 * N, x + r0 * K, M - r0 < TF_MAX_ROWS ? M - r0 : TF_MAX_ROWS, K, N, raw, type);
        return;
    }
    const int64_t bb = tf_kquant_block_bytes(type), nsb = K / 256;
#pragma omp parallel for schedule(static) if (N >= 64)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = raw + n * nsb * bb;
        float acc[TF_MAX_ROWS] = {0};
#if defined(__AVX2__) && defined(__FMA__)
        switch (M) {
            case 1: tf_kgemm_row(1, acc, x, K, row, type, bb); break;
            case 2: tf_kgemm_row(2, acc, x, K, row, type, bb); break;
            case 3: tf_kgemm_row(3, acc, x, K, row, type, bb); break;
            case 4: tf_kgemm_row(4, acc, x, K, row, type, bb); break;
            case 5: tf_kgemm_row(5, acc, x, K, row, type, bb); break;
            case 6: tf_kgemm_row(6, acc, x, K, row, type, bb); break;
            case 7: tf_kgemm_row(7, acc, x, K, row, type, bb); break;
            default: tf_kgemm_row(8, acc, x, K, row, type, bb); break;
        }
#else
        float w[256] __attribute__((aligned(32)));
        for (int64_t s = 0; s < nsb; s++) {
            tf_kdecode(row + s * bb, type, w);
            for (int64_t r = 0; r < M; r++) acc[r] += tf_dot256(w, x + r * K + s * 256);
        }
#endif
        for (int64_t r = 0; r < M; r++) y[r * N + n] = acc[r];
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * Integer dot products with int8 activations: llama.cpp's approach, a measured option (kernel "qdot").
 * Each activation row is quantized to int8 in blocks of 32 with its own scale (max|x| / 127) and every
 * block's dot product with the stored weights is one u8 x s8 instruction sequence: `vpdpbusd` where the
 * build has AVX512-VNNI (+VL) or AVX-VNNI, else AVX2's maddubs + madd (no saturation: |w| <= 128 and
 * |x| <= 127, so a pair stays below 32767). Weight formats, as stored:
 *   bits 4 (int4 / Q4_0 / Q4_1 groups): nibbles are the unsigned operand, plus m times the sums of x~
 *   bits 8 (int8 / Q8_0): signed weights; |w| is the unsigned operand and w's sign moves onto x
 *   Q4_K (12): 8 sub-blocks of 32, u8 nibbles, scale d * sc, minus dmin * mn * (sum of x~)
 *   Q6_K (14): 8 runs of 32 (two 16-weight sub-blocks each: per-lane scales), q 0..63, minus 32 * scale * sum x~
 * Other K-quants fall back to tf_kgemm. The activations' rounding (relative error ~2^-8 per block) is
 * what this costs against tf_qgemm's int16 blocks; `tokenfab quant eval --kernel qdot` measures it. */
#define TF_QDOT 256       /* tf_qgemm's `bits | TF_QDOT`: run this kernel (the one-call decode stack's layouts) */

/* What this build compiled for: 1 AVX2+FMA, 2 AVX-512 F/BW/VL, 4 AVX512-VNNI, 8 AVX-VNNI (a bit mask). */
int64_t tf_isa(void) {
    int64_t f = 0;
#if defined(__AVX2__) && defined(__FMA__)
    f |= 1;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    f |= 2;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    f |= 4;
#endif
#if defined(__AVXVNNI__)
    f |= 8;
#endif
    return f;
}

/* x [n] -> int8 blocks of 32 and their scales; xs16: sums per 16 of the rounded x (NULL: not needed).
 * Offsets (int4's m, Q4_K's mins, Q6_K's -32) then multiply the same rounded x as the integer dot does,
 * so the result is exactly W . x~ (x~ the rounded activations): float sums of x measured twice the
 * error on random int4 weights, as the large unsigned q . x~ and the offset no longer cancel. */
static void tf_quantize_i8(const float *x, int64_t n, int8_t *xq, float *dx, float *xs16) {
    for (int64_t b = 0; b < n / 32; b++) {
        const float *xb = x + b * 32;
        float amax = 0.f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float id = amax > 0.f ? 127.f / amax : 0.f;
        for (int j = 0; j < 32; j++) xq[b * 32 + j] = (int8_t)lrintf(xb[j] * id);
        dx[b] = amax / 127.f;
        if (xs16) {        /* sums of the *rounded* x, so offsets see the same x as the integer dot */
            int32_t s0 = 0, s1 = 0;
            for (int j = 0; j < 16; j++) {
                s0 += xq[b * 32 + j];
                s1 += xq[b * 32 + j + 16];
            }
            xs16[2 * b] = dx[b] * (float)s0;
            xs16[2 * b + 1] = dx[b] * (float)s1;
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* acc + the 8 lane sums of u8 x s8 products (lane i: bytes 4i..4i+3). */
static inline __attribute__((always_inline)) __m256i tf_dpbusd(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define TF_QDOT512 1
/* The 16 lane sums of u8 x s8 products over 64 bytes (two blocks of 32: lanes 0-7 the first). */
static inline __attribute__((always_inline)) __m512i tf_dpbusd512(__m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}

/* Two scales: lanes 0-7 a, 8-15 b. */
static inline __attribute__((always_inline)) __m512 tf_scale2(float a, float b) {
    return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1);
}
#endif

/* One output row of an int4 / int8 weight for M activation rows (M a constant at each call site).
 * AVX-512 builds take two blocks per instruction (one 64-byte dot product, one 16-lane FMA). */
static inline __attribute__((always_inline)) void tf_qdot_row(const int M, float *out, const int8_t *xq,
                                                             const float *dx, const float *dx16, int64_t K,
                                                             int64_t nb, const void *q, const float *sb,
                                                             int64_t bits) {
    int64_t b = 0;
    float tail[TF_MAX_ROWS] = {0};
#ifdef TF_QDOT512
    {
        __m512 acc[TF_MAX_ROWS];
        for (int r = 0; r < M; r++) acc[r] = _mm512_setzero_ps();
        const __m256i m4 = _mm256_set1_epi8(0x0F);
        for (; b + 2 <= nb; b += 2) {
            __m512i u, w = _mm512_setzero_si512();
            if (bits == 4) {      /* 32 bytes: blocks b, b+1; each block's low nibbles then high ones */
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)((const uint8_t *)q + b * 16));
                const __m256i lo = _mm256_and_si256(bytes, m4), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), m4);
                const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);   /* lo0 lo1 hi0 hi1 */
                u = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));                  /* lo0 hi0 lo1 hi1 */
            } else {
                w = _mm512_loadu_si512((const void *)((const int8_t *)q + b * 32));
                u = _mm512_abs_epi8(w);
            }
            /* int8: w's sign moves onto x (x * sign(w); x == 0 where w == 0 does not matter) */
            const __mmask64 neg = bits == 4 ? 0 : _mm512_movepi8_mask(w);
            const __m512 wsc = tf_scale2(sb[b], sb[b + 1]);
            for (int r = 0; r < M; r++) {
                __m512i xv = _mm512_loadu_si512((const void *)(xq + r * K + b * 32));
                if (bits != 4) xv = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
                const __m512 sc = _mm512_mul_ps(wsc, _mm512_loadu_ps(dx16 + (r * nb + b) * 8));
                acc[r] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(tf_dpbusd512(u, xv)), acc[r]);
            }
        }
        for (int r = 0; r < M; r++) tail[r] = _mm512_reduce_add_ps(acc[r]);
    }
#endif
    __m256 acc0[TF_MAX_ROWS], acc1[TF_MAX_ROWS];
    for (int r = 0; r < M; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
    const __m256i zero = _mm256_setzero_si256(), mask = _mm256_set1_epi8(0x0F);
    for (; b < nb; b++) {
        __m256i u, w = zero;
        if (bits == 4) {
            const __m128i bytes = _mm_loadu_si128((const __m128i *)((const uint8_t *)q + b * 16));
            u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), mask);
        } else {
            w = _mm256_loadu_si256((const __m256i *)((const int8_t *)q + b * 32));
            u = _mm256_abs_epi8(w);
        }
        for (int r = 0; r < M; r++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * K + b * 32));
            if (bits != 4) xv = _mm256_sign_epi8(xv, w);
            const __m256 s = _mm256_set1_ps(sb[b] * dx[r * nb + b]);
            const __m256 dot = _mm256_cvtepi32_ps(tf_dpbusd(zero, u, xv));
            if (b & 1) acc1[r] = _mm256_fmadd_ps(s, dot, acc1[r]);
            else acc0[r] = _mm256_fmadd_ps(s, dot, acc0[r]);
        }
    }
    for (int r = 0; r < M; r++) out[r] = tail[r] + tf_hsum(_mm256_add_ps(acc0[r], acc1[r]));
}

/* One output row of a Q4_K / Q6_K weight (`row`: its super-blocks) for M activation rows. */
static inline __attribute__((always_inline)) void tf_kqdot_row(const int M, float *out, const int8_t *xq,
                                                              const float *dx, const float *xs16, int64_t K,
                                                              const uint8_t *row, int64_t type) {
    const int64_t nsb = K / 256, nb = K / 32, bb = tf_kquant_block_bytes(type);
    __m256 acc[TF_MAX_ROWS];
    float bias[TF_MAX_ROWS];
    for (int r = 0; r < M; r++) {
        acc[r] = _mm256_setzero_ps();
        bias[r] = 0.f;
    }
#ifdef TF_QDOT512
    __m512 acc512[TF_MAX_ROWS];
    for (int r = 0; r < M; r++) acc512[r] = _mm512_setzero_ps();
#endif
    const __m256i zero = _mm256_setzero_si256(), m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *blk = row + s * bb;
        if (type == TF_Q4_K) {
            const float d = tf_f16(blk), dmin = tf_f16(blk + 2);
            uint8_t sc[8], mn[8];
            tf_scale_min_k4(blk + 4, sc, mn);
#ifdef TF_QDOT512
            /* sub-blocks 2i and 2i+1 are the low and high nibbles of the same 32 bytes: one 64-byte dot */
            for (int i = 0; i < 4; i++) {
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)(blk + 16 + i * 32));
                const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, m4)),
                                                     _mm256_and_si256(_mm256_srli_epi16(bytes, 4), m4), 1);
                const float a0 = d * (float)sc[2 * i], a1 = d * (float)sc[2 * i + 1];
                const float mm = dmin * (float)mn[2 * i], mm1 = dmin * (float)mn[2 * i + 1];
                const int64_t b = s * 8 + 2 * i;
                for (int r = 0; r < M; r++) {
                    const __m512i xv = _mm512_loadu_si512((const void *)(xq + r * K + b * 32));
                    const __m512 dot = _mm512_cvtepi32_ps(tf_dpbusd512(u, xv));
                    acc512[r] = _mm512_fmadd_ps(tf_scale2(a0 * dx[r * nb + b], a1 * dx[r * nb + b + 1]), dot, acc512[r]);
                    const float *xs = xs16 + r * (K / 16) + 2 * b;
                    bias[r] += mm * (xs[0] + xs[1]) + mm1 * (xs[2] + xs[3]);
                }
            }
            continue;
#endif
            for (int sub = 0; sub < 8; sub++) {
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)(blk + 16 + (sub >> 1) * 32));
                const __m256i u = _mm256_and_si256(sub & 1 ? _mm256_srli_epi16(bytes, 4) : bytes, m4);
                const float a = d * (float)sc[sub], mm = dmin * (float)mn[sub];
                const int64_t b = s * 8 + sub;
                for (int r = 0; r < M; r++) {
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * K + b * 32));
                    const __m256 dot = _mm256_cvtepi32_ps(tf_dpbusd(zero, u, xv));
                    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(a * dx[r * nb + b]), dot, acc[r]);
                    bias[r] += mm * (xs16[r * (K / 16) + 2 * b] + xs16[r * (K / 16) + 2 * b + 1]);
                }
            }
        } else {    /* Q6_K: weight h * 128 + j * 32 + l: ql[h * 64 + l + 32 (j & 1)] >> 4 (j >> 1), qh[h * 32 + l] >> 2j */
            const int8_t *sc = (const int8_t *)(blk + 192);
            const float d = tf_f16(blk + 208);
#ifdef TF_QDOT512
            /* runs j and j+1 of a half: 64 contiguous ql bytes (j even: low nibbles, else high), qh shifted
             * by 2j and 2j + 2; the 16 lanes take the 4 sub-block scales from sc[h * 8 + 2j] on */
            const __m512i m4z = _mm512_set1_epi8(0x0F), m2z = _mm512_set1_epi8(3);
            const __m512i quad = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
            for (int h = 0; h < 2; h++) {
                const __m256i qh256 = _mm256_loadu_si256((const __m256i *)(blk + 128 + h * 32));
                const __m512i qh = _mm512_inserti64x4(_mm512_castsi256_si512(qh256), qh256, 1);
                const __m512i ql = _mm512_loadu_si512((const void *)(blk + h * 64));
                for (int j = 0; j < 4; j += 2) {
                    const __m512i lo = _mm512_and_si512(j ? _mm512_srli_epi16(ql, 4) : ql, m4z);
                    const __m512i cnt = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * j)),
                                                           _mm256_set1_epi16((short)(2 * j + 2)), 1);
                    const __m512i hi = _mm512_and_si512(_mm512_srlv_epi16(qh, cnt), m2z);
                    const __m512i u = _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4));
                    const int8_t *sj = sc + h * 8 + 2 * j;
                    const float s0 = d * (float)sj[0], s1 = d * (float)sj[1], s2 = d * (float)sj[2], s3 = d * (float)sj[3];
                    const int64_t b = s * 8 + h * 4 + j;
                    for (int r = 0; r < M; r++) {
                        const __m512i xv = _mm512_loadu_si512((const void *)(xq + r * K + b * 32));
                        const __m512 dot = _mm512_cvtepi32_ps(tf_dpbusd512(u, xv));
                        const float e0 = dx[r * nb + b], e1 = dx[r * nb + b + 1];
                        const __m512 lane = _mm512_permutexvar_ps(
                            quad, _mm512_castps128_ps512(_mm_set_ps(s3 * e1, s2 * e1, s1 * e0, s0 * e0)));
                        acc512[r] = _mm512_fmadd_ps(lane, dot, acc512[r]);
                        const float *xs = xs16 + r * (K / 16) + 2 * b;
                        bias[r] += 32.f * (s0 * xs[0] + s1 * xs[1] + s2 * xs[2] + s3 * xs[3]);
                    }
                }
            }
            continue;
#endif
            for (int h = 0; h < 2; h++) {
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + h * 32));
                for (int j = 0; j < 4; j++) {
                    const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + h * 64 + (j & 1) * 32));
                    const __m256i lo = _mm256_and_si256(j >> 1 ? _mm256_srli_epi16(ql, 4) : ql, m4);
                    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j)), m2);
                    const __m256i u = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
                    const float sa = d * (float)sc[h * 8 + 2 * j], sb = d * (float)sc[h * 8 + 2 * j + 1];
                    const int64_t b = s * 8 + h * 4 + j;
                    for (int r = 0; r < M; r++) {
                        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * K + b * 32));
                        const __m256 dot = _mm256_cvtepi32_ps(tf_dpbusd(zero, u, xv));
                        const float e = dx[r * nb + b];
                        const __m256 lane = _mm256_set_m128(_mm_set1_ps(sb * e), _mm_set1_ps(sa * e));
                        acc[r] = _mm256_fmadd_ps(lane, dot, acc[r]);
                        bias[r] += 32.f * (sa * xs16[r * (K / 16) + 2 * b] + sb * xs16[r * (K / 16) + 2 * b + 1]);
                    }
                }
            }
        }
    }
#ifdef TF_QDOT512
    for (int r = 0; r < M; r++) out[r] = _mm512_reduce_add_ps(acc512[r]) - bias[r];
#else
    for (int r = 0; r < M; r++) out[r] = tf_hsum(acc[r]) - bias[r];
#endif
}
#endif

#define TF_ROWS_SWITCH(FN, ...)                    \
    switch (M) {                                   \
        case 1: FN(1, __VA_ARGS__); break;         \
        case 2: FN(2, __VA_ARGS__); break;         \
        case 3: FN(3, __VA_ARGS__); break;         \
        case 4: FN(4, __VA_ARGS__); break;         \
        case 5: FN(5, __VA_ARGS__); break;         \
        case 6: FN(6, __VA_ARGS__); break;         \
        case 7: FN(7, __VA_ARGS__); break;         \
        default: FN(8, __VA_ARGS__); break;        \
    }

#if !(defined(__AVX2__) && defined(__FMA__))
/* Plain C for builds without AVX2: the same arithmetic, one weight at a time. */
static float tf_qdot_scalar_w(const void *q, int64_t bits, int64_t b, int j) {
    return bits == 4 ? (float)((((const uint8_t *)q)[b * 16 + (j & 15)] >> (j < 16 ? 0 : 4)) & 0x0F)
                     : (float)((const int8_t *)q)[b * 32 + j];
}
#endif

void tf_kgemm(float *y, const float *x, int64_t M, int64_t K, int64_t N, const uint8_t *raw, int64_t type);

/* y[M, N] = x[M, K] @ W^T with int8 activation blocks (layouts as tf_qgemm's). */
void tf_qdot(float *y, const float *x, int64_t M, int64_t K, int64_t N, const void *q, const float *d,
             const float *m, int64_t gs, int64_t bits) {
    const int kq = bits == TF_Q4_K || bits == TF_Q6_K;
#if !(defined(__AVX2__) && defined(__FMA__))
    if (kq) {        /* no vector path: expand as tf_kgemm does (float activations) */
        tf_kgemm(y, x, M, K, N, (const uint8_t *)q, bits);
        return;
    }
#endif
    if (tf_kquant_block_bytes(bits) && !kq) {
        tf_kgemm(y, x, M, K, N, (const uint8_t *)q, bits);
        return;
    }
    if (M > TF_MAX_ROWS) {
        for (int64_t r0 = 0; r0 < M; r0 += TF_MAX_ROWS)
            tf_qdot(y + r0 * N, x + r0 * K, M - r0 < TF_MAX_ROWS ? M - r0 : TF_MAX_ROWS, K, N, q, d, m, gs, bits);
        return;
    }
    const int64_t nb = K / 32;
    const int64_t G = kq ? 1 : K / gs, bpg = kq ? 1 : gs / 32;
    const int64_t row_bytes = kq ? K / 256 * tf_kquant_block_bytes(bits) : bits == 4 ? K / 2 : K;
    int8_t *xq = (int8_t *)malloc((size_t)(M * K));
    float *dx = (float *)malloc(sizeof(float) * (size_t)(M * nb));
    float *xs16 = (float *)malloc(sizeof(float) * (size_t)(M * (K / 16)));
    float *xs = (float *)calloc((size_t)(M * G + 1), sizeof(float));   /* sums of x~ per group (int4's m) */
    /* each activation scale repeated over its block's 8 lanes: the AVX-512 row loads two blocks' at once */
    float *dx16 = (float *)malloc(sizeof(float) * (size_t)(M * nb * 8));
    for (int64_t r = 0; r < M; r++) {
        tf_quantize_i8(x + r * K, K, xq + r * K, dx + r * nb, xs16 + r * (K / 16));
        for (int64_t b = 0; b < nb; b++)
            for (int j = 0; j < 8; j++) dx16[(r * nb + b) * 8 + j] = dx[r * nb + b];
        if (bits == 4)
            for (int64_t g = 0; g < G; g++)
                for (int64_t k = g * gs / 16; k < (g + 1) * gs / 16; k++) xs[r * G + g] += xs16[r * (K / 16) + k];
    }
#pragma omp parallel for schedule(static) if (N >= 64)
    for (int64_t n = 0; n < N; n++) {
        const void *qn = (const uint8_t *)q + n * row_bytes;
        float out[TF_MAX_ROWS];
        if (kq) {
#if defined(__AVX2__) && defined(__FMA__)
            TF_ROWS_SWITCH(tf_kqdot_row, out, xq, dx, xs16, K, (const uint8_t *)qn, bits)
#endif
        } else {
            const float *dn = d + n * G;
            float sbuf[bpg == 1 ? 1 : nb];
            const float *sb = dn;
            if (bpg != 1) {
                for (int64_t g = 0, b = 0; g < G; g++)
                    for (int64_t i = 0; i < bpg; i++) sbuf[b++] = dn[g];
                sb = sbuf;
            }
#if defined(__AVX2__) && defined(__FMA__)
            TF_ROWS_SWITCH(tf_qdot_row, out, xq, dx, dx16, K, nb, qn, sb, bits)
#else
            for (int64_t r = 0; r < M; r++) {
                float acc = 0.f;
                for (int64_t b = 0; b < nb; b++) {
                    int32_t dot = 0;
                    for (int j = 0; j < 32; j++) dot += (int32_t)tf_qdot_scalar_w(qn, bits, b, j) * xq[r * K + b * 32 + j];
                    acc += sb[b] * dx[r * nb + b] * (float)dot;
                }
                out[r] = acc;
            }
#endif
            if (bits == 4)
                for (int64_t r = 0; r < M; r++) out[r] += tf_dot_f32(m + n * G, xs + r * G, G);
        }
        for (int64_t r = 0; r < M; r++) y[r * N + n] = out[r];
    }
    free(xq);
    free(dx);
    free(xs16);
    free(xs);
    free(dx16);
}

#define TF_QTILE 512      /* tf_qgemm's `bits | TF_QTILE`: run tf_qtile (the one-call decode stack's layouts) */
void tf_qtile(float *y, const float *x, int64_t M, int64_t K, int64_t N, const void *q, const float *d,
              const float *m, int64_t gs, int64_t bits);

/* tf_qgemm's outputs n0..n1-1 for every row, into y[r * ys + n - n0]. */
typedef struct {
    const void *q;
    const float *d, *m, *dx, *xs, *dx8;
    const int16_t *xq, *xp;
    int64_t M, K, N, G, nb, bpg, row_bytes, bits;
} tf_qgemm_job;

static void tf_qgemm_cols(const void *job, int64_t n0, int64_t n1, float *y, int64_t ys) {
    const tf_qgemm_job *J = (const tf_qgemm_job *)job;
    const void *q = J->q;
    const float *d = J->d, *m = J->m, *dx = J->dx, *xs = J->xs;
    const int16_t *xq = J->xq;
    const int64_t M = J->M, K = J->K, G = J->G, nb = J->nb, bpg = J->bpg, row_bytes = J->row_bytes, bits = J->bits;
#ifdef TF_QGEMM4
    const int16_t *xp = J->xp;
    const float *dx8 = J->dx8;
    const int folded = xp != NULL;      /* tf_qgemm4_row(s4) fold the offsets' term into each row's sum */
#else
    const int folded = 0;
#endif
    (void)xq;
    int64_t n = n0;
#ifdef TF_QGEMM4
    if (xp && M == 1 && bpg == 1)    /* one activation row: four weight rows at a time */
        for (; n + 4 <= n1; n += 4) {
            const uint8_t *qn = (const uint8_t *)q + n * row_bytes;
            for (int64_t l = 0; l < 4 * row_bytes; l += 64) __builtin_prefetch(qn + 8 * row_bytes + l, 0, 3);
            for (int64_t l = 0; l < 4 * G; l += 16) {
                __builtin_prefetch(d + (n + 8) * G + l, 0, 3);
                if (m) __builtin_prefetch(m + (n + 8) * G + l, 0, 3);
            }
            float out[4];
            tf_qgemm4_rows4(out, xp, dx8, nb, qn, row_bytes, d + n * G, m ? m + n * G : NULL, xs, G);
            for (int i = 0; i < 4; i++) y[n + i - n0] = out[i];
        }
#endif
    for (; n < n1; n++) {
        const float *dn = d + n * G;
        const void *qn = (const uint8_t *)q + n * row_bytes;
        float out[TF_MAX_ROWS];
        /* 4 rows ahead: the three streams (blocks, scales, offsets) of short rows did not keep the hardware
         * prefetchers ahead (1 row streamed at ~60 % of a streaming read's bandwidth) */
        for (int64_t l = 0; l < row_bytes; l += 64) __builtin_prefetch((const char *)qn + 4 * row_bytes + l, 0, 3);
        __builtin_prefetch(dn + 4 * G, 0, 3);
        if (m) __builtin_prefetch(m + (n + 4) * G, 0, 3);
        /* per-block weight scales without a division per block: groups of 32 use dn as is */
        float sbuf[bpg == 1 ? 1 : nb];
        const float *sb = dn;
        if (bpg != 1) {
            for (int64_t g = 0, b = 0; g < G; g++)
                for (int64_t i = 0; i < bpg; i++) sbuf[b++] = dn[g];
            sb = sbuf;
        }
#if defined(__AVX2__) && defined(__FMA__)
#ifdef TF_QGEMM512
        TF_ROWS_SWITCH(tf_qgemm_row512, out, xq, dx, K, nb, qn, sb, bits)
#else
        if (xp) {
            for (int r0 = 0; r0 < M; r0 += 4)
                switch (M - r0) {
#define TF_Q4ROW(R) tf_qgemm4_row(R, out + r0, xp + r0 * K, dx8 + r0 * nb * 4, K, nb, (const uint8_t *)qn, sb, \
                                  m ? m + n * G : NULL, xs + r0 * G, G)
                    case 1: TF_Q4ROW(1); break;
                    case 2: TF_Q4ROW(2); break;
                    case 3: TF_Q4ROW(3); break;
                    default: TF_Q4ROW(4); break;
#undef TF_Q4ROW
                }
        } else
        switch (M) {
            case 1: tf_qgemm_row(1, out, xq, dx, K, nb, qn, sb, bits); break;
            case 2: tf_qgemm_row(2, out, xq, dx, K, nb, qn, sb, bits); break;
            case 3: tf_qgemm_row(3, out, xq, dx, K, nb, qn, sb, bits); break;
            case 4: tf_qgemm_row(4, out, xq, dx, K, nb, qn, sb, bits); break;
            case 5: tf_qgemm_row(5, out, xq, dx, K, nb, qn, sb, bits); break;
            case 6: tf_qgemm_row(6, out, xq, dx, K, nb, qn, sb, bits); break;
            case 7: tf_qgemm_row(7, out, xq, dx, K, nb, qn, sb, bits); break;
            default: tf_qgemm_row(8, out, xq, dx, K, nb, qn, sb, bits); break;
        }
#endif
#else
        for (int64_t r = 0; r < M; r++) {
            float acc = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                int32_t dot = 0;
                for (int j = 0; j < 32; j++) {
                    const int wq = bits == 4 ? (((const uint8_t *)qn)[b * 16 + (j & 15)] >> (j < 16 ? 0 : 4)) & 0x0F
                                             : ((const int8_t *)qn)[b * 32 + j];
                    dot += wq * xq[r * K + b * 32 + j];
                }
                acc += sb[b] * dx[r * nb + b] * (float)dot;
            }
            out[r] = acc;
        }
#endif
        if (bits == 4 && !folded)
            for (int64_t r = 0; r < M; r++) out[r] += tf_dot_f32(m + n * G, xs + r * G, G);
        for (int64_t r = 0; r < M; r++) y[r * ys + n - n0] = out[r];
    }
}

void tf_qgemm(float *y, const float *x, int64_t M, int64_t K, int64_t N, const void *q, const float *d,
              const float *m, int64_t gs, int64_t bits) {
    if (bits & TF_QTILE) {               /* a qtile layout (below) */
        tf_qtile(y, x, M, K, N, q, d, m, gs, bits & ~TF_QTILE);
        return;
    }
    if (bits & TF_QDOT) {                /* a qdot layout (the one-call decode stack takes either kernel) */
        tf_qdot(y, x, M, K, N, q, d, m, gs, bits & ~TF_QDOT);
        return;
    }
    if (tf_kquant_block_bytes(bits)) {   /* a K-quant layout: bits is ggml's type id */
        tf_kgemm(y, x, M, K, N, (const uint8_t *)q, bits);
        return;
    }
    if (M > TF_MAX_ROWS) {   /* the register tile holds 8 rows: more rows, more passes over W */
        const int off = tf_pool_off;
        tf_pool_off = off || M > TF_POOL_MAX_ROWS;
        for (int64_t r0 = 0; r0 < M; r0 += TF_MAX_ROWS)
            tf_qgemm(y + r0 * N, x + r0 * K, M - r0 < TF_MAX_ROWS ? M - r0 : TF_MAX_ROWS, K, N, q, d, m, gs, bits);
        tf_pool_off = off;
        return;
    }
    const int64_t G = K / gs, nb = K / 32, bpg = gs / 32;
    const int64_t row_bytes = bits == 4 ? K / 2 : K;
    /* the activations' copies live in this thread's scratch, never freed (tf_cols: a late pool worker may read them) */
    const size_t nxq = (size_t)(M * K) * sizeof(int16_t), ndx = (size_t)(M * nb) * sizeof(float);
    char *buf = (char *)tf_scratch(2 * nxq + 5 * ndx + (size_t)(M * G + 1) * sizeof(float) + 4 * 64);
    int16_t *xq = (int16_t *)buf;
    float *dx = (float *)(buf + TF_UP64(nxq));
    float *xs = (float *)(buf + TF_UP64(nxq) + TF_UP64(ndx));     /* float sums of x per group */
    memset(xs, 0, (size_t)(M * G + 1) * sizeof(float));
    for (int64_t r = 0; r < M; r++) {
        tf_quantize_blocks(x + r * K, K, xq + r * K, dx + r * nb);
        if (bits == 4)
            for (int64_t g = 0; g < G; g++)
                for (int64_t k = g * gs; k < (g + 1) * gs; k++) xs[r * G + g] += x[r * K + k];
    }
#ifdef TF_QGEMM4
    int16_t *xp = NULL;      /* int4 on AVX2: the activations in tf_qgemm4_pair's order */
    float *dx8 = NULL;
    if (bits == 4) {
        xp = (int16_t *)((char *)xs + TF_UP64((size_t)(M * G + 1) * sizeof(float)));
        dx8 = (float *)((char *)xp + TF_UP64(nxq));
        for (int64_t r = 0; r < M; r++) tf_qgemm4_prep(xq + r * K, dx + r * nb, nb, xp + r * K, dx8 + r * nb * 4);
    }
#endif
    const tf_qgemm_job job = {q, d, m, dx, xs,
#ifdef TF_QGEMM4
                              dx8, xq, xp,
#else
                              NULL, xq, NULL,
#endif
                              M, K, N, G, nb, bpg, row_bytes, bits};
    tf_cols(tf_qgemm_cols, &job, sizeof job, M, N, y);
}

/* ---------------------------------------------------------------------------------------------------------
 * tf_qmadd: big batches and prefill chunks (17+ rows) on tf_qgemm's own layout, without AMX or VNNI (kernel
 * "qmadd", tokenfab/quant/kernels.py). tf_qgemm puts a block's 32 inputs in the lanes, so every row and
 * output pays a convert, a scale broadcast and an FMA per block and a horizontal sum at the end: ~3.5
 * cycles per block and row, about what a float32 FMA GEMM costs, so above 16 rows the table took the
 * 4-byte float copy. Here the lanes are outputs: each thread expands its outputs' weights, 16 at a time,
 * into int16 pairs [block][input pair][output] once per call (with their scales), and every row's block is
 * then 16 vpmaddwd + vpaddd per 8 outputs against two activations broadcast per instruction (16 MACs per
 * instruction against an FMA's 8; on Zen 3 one thread ran 40 GMAC/s against MKL's float32 35, and the
 * weights stream at their quantized size), then one convert and one FMA per 8 outputs.
 * Numerics: the activations are quantized as tf_qgemm quantizes them (int16 per block of 32, scale
 * max|x| / 32767), so every block's integer dot is the same exact integer; y[r, n] = fma over blocks b in
 * order: acc = fma((float)D, fl(s[n, b] * dx[r, b]), acc), then (int4) acc = fma(m[n, g], xs[r, g], acc)
 * over groups g in order (tf_qtile's float steps). A row's result depends on that row alone; it differs
 * from tf_qgemm's (lanes summed in another order) in the last bits. N a multiple of 16. */
#if defined(__AVX2__) && defined(__FMA__)
#define TF_QMADD_ROWS 4         /* activation rows per register tile (8 int32 sums: 16 outputs x 4 rows) */
#define TF_QMADD_BLOCK 196608   /* bytes of expanded weights a thread keeps in L2 while every row group runs them */

/* An 8 x 8 transpose of dwords: r[i] holds output i's 8 input pairs, r[p] then holds pair p of 8 outputs. */
static inline __attribute__((always_inline)) void tf_transpose8_epi32(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int p = 0; p < 4; p++) {
        r[p] = _mm256_permute2x128_si256(u[p], u[4 + p], 0x20);
        r[p + 4] = _mm256_permute2x128_si256(u[p], u[4 + p], 0x31);
    }
}

/* Outputs n0 .. n0 + 16 np - 1 expanded for tf_qmadd_tile: per 16 outputs, per block, 16 input pairs of
 * two 8-output halves (int16 [2][8][2] each: 1 KB), then per block the 16 scales, then (int4) per group the
 * 16 offsets. `stride` int16 per 16 outputs. */
static void tf_qmadd_expand(int16_t *buf, int64_t stride, const void *q, const float *d, const float *m,
                            int64_t n0, int64_t np, int64_t nb, int64_t G, int64_t bpg, int64_t bits) {
    const int64_t row_bytes = bits == 4 ? nb * 16 : nb * 32;
    for (int64_t p = 0; p < np; p++) {
        int16_t *w = buf + p * stride;
        float *sc = (float *)(w + nb * 512), *mo = sc + nb * 16;
        if (p + 1 < np)           /* the next unit's 16 weight rows, while this one expands (16 strided streams) */
            for (int64_t o = 0; o < 16; o++)
                for (int64_t l = 0; l < row_bytes; l += 64)
                    __builtin_prefetch((const uint8_t *)q + (n0 + 16 * (p + 1) + o) * row_bytes + l, 0, 3);
        for (int64_t b = 0; b < nb; b++)
            for (int h = 0; h < 2; h++) {         /* outputs 8h .. 8h + 7 of these 16 */
                __m256i lo[8], hi[8];
                for (int o = 0; o < 8; o++) {
                    __m256i v[2];
                    tf_load_weights((const uint8_t *)q + (n0 + 16 * p + 8 * h + o) * row_bytes, b, bits, v);
                    lo[o] = v[0];                 /* input pairs 0..7 */
                    hi[o] = v[1];                 /* input pairs 8..15 */
                }
                tf_transpose8_epi32(lo);
                tf_transpose8_epi32(hi);
                for (int i = 0; i < 8; i++) {     /* pair i: [pair][half][8 outputs][2] */
                    _mm256_store_si256((__m256i *)(w + b * 512 + i * 32 + h * 16), lo[i]);
                    _mm256_store_si256((__m256i *)(w + b * 512 + (8 + i) * 32 + h * 16), hi[i]);
                }
            }
        for (int64_t o = 0; o < 16; o++) {
            const float *dn = d + (n0 + 16 * p + o) * G;
            for (int64_t b = 0; b < nb; b++) sc[b * 16 + o] = dn[b / bpg];
            if (bits == 4)
                for (int64_t g = 0; g < G; g++) mo[g * 16 + o] = m[(n0 + 16 * p + o) * G + g];
        }
    }
}

/* y[r0 .. r0 + R - 1, 16 outputs] from one expanded 16-output unit w (see tf_qmadd_expand). */
static inline __attribute__((always_inline)) void tf_qmadd_tile(const int R, float *y, int64_t N,
                                                                const int16_t *w, const int16_t *xq, int64_t K,
                                                                const float *dx, const float *xs, int64_t nb,
                                                                int64_t G, int64_t bits) {
    const float *sc = (const float *)(w + nb * 512), *mo = sc + nb * 16;
    __m256 acc[TF_QMADD_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i s[TF_QMADD_ROWS][2];
        for (int r = 0; r < R; r++) s[r][0] = s[r][1] = _mm256_setzero_si256();
        const int16_t *wb = w + b * 512, *xb = xq + b * 32;
        for (int i = 0; i < 16; i++) {
            const __m256i w0 = _mm256_load_si256((const __m256i *)(wb + i * 32));
            const __m256i w1 = _mm256_load_si256((const __m256i *)(wb + i * 32 + 16));
            for (int r = 0; r < R; r++) {
                int32_t pair;
                memcpy(&pair, xb + r * K + 2 * i, 4);
                const __m256i xv = _mm256_set1_epi32(pair);
                s[r][0] = _mm256_add_epi32(s[r][0], _mm256_madd_epi16(w0, xv));
                s[r][1] = _mm256_add_epi32(s[r][1], _mm256_madd_epi16(w1, xv));
            }
        }
        const __m256 s0 = _mm256_loadu_ps(sc + b * 16), s1 = _mm256_loadu_ps(sc + b * 16 + 8);
        for (int r = 0; r < R; r++) {
            const __m256 f = _mm256_set1_ps(dx[r * nb + b]);
            acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][0]), _mm256_mul_ps(s0, f), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][1]), _mm256_mul_ps(s1, f), acc[r][1]);
        }
    }
    if (bits == 4)
        for (int64_t g = 0; g < G; g++) {
            const __m256 m0 = _mm256_loadu_ps(mo + g * 16), m1 = _mm256_loadu_ps(mo + g * 16 + 8);
            for (int r = 0; r < R; r++) {
                const __m256 f = _mm256_set1_ps(xs[r * G + g]);
                acc[r][0] = _mm256_fmadd_ps(m0, f, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(m1, f, acc[r][1]);
            }
        }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(y + r * N, acc[r][0]);
        _mm256_storeu_ps(y + r * N + 8, acc[r][1]);
    }
}
#endif

void tf_qmadd(float *y, const float *x, int64_t M, int64_t K, int64_t N, const void *q, const float *d,
              const float *m, int64_t gs, int64_t bits) {
#if defined(__AVX2__) && defined(__FMA__)
    const int64_t G = K / gs, nb = K / 32, bpg = gs / 32, units = N / 16;
    int16_t *xq = (int16_t *)malloc(sizeof(int16_t) * (size_t)(M * K));
    float *dx = (float *)malloc(sizeof(float) * (size_t)(M * nb));
    float *xs = (float *)calloc((size_t)(M * G + 1), sizeof(float));
#pragma omp parallel for schedule(static) if (M >= 8)
    for (int64_t r = 0; r < M; r++) {     /* as tf_qgemm: the same integers, the same float sums of x */
        tf_quantize_blocks(x + r * K, K, xq + r * K, dx + r * nb);
        if (bits == 4)
            for (int64_t g = 0; g < G; g++)
                for (int64_t k = g * gs; k < (g + 1) * gs; k++) xs[r * G + g] += x[r * K + k];
    }
    /* per 16 outputs: weights, scales, offsets; a multiple of 16 int16 keeps every unit 32-byte aligned */
    const int64_t stride = (nb * 512 + (nb * 16 + (bits == 4 ? G * 16 : 0)) * 2 + 15) / 16 * 16;
    int64_t per = TF_QMADD_BLOCK / (stride * 2);
    if (per < 1) per = 1;
#pragma omp parallel
    {
        const int64_t nth = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t u0 = units * me / nth, u1 = units * (me + 1) / nth;
        const int64_t most = u1 - u0 < per ? u1 - u0 : per;
        int16_t *buf = most > 0 ? (int16_t *)aligned_alloc(64, (size_t)((most * stride * 2 + 63) / 64 * 64)) : NULL;
        for (int64_t c = u0; c < u1; c += per) {
            const int64_t np = u1 - c < per ? u1 - c : per;
            tf_qmadd_expand(buf, stride, q, d, m, 16 * c, np, nb, G, bpg, bits);
            for (int64_t r0 = 0; r0 < M; r0 += TF_QMADD_ROWS) {
                const int64_t R = M - r0 < TF_QMADD_ROWS ? M - r0 : TF_QMADD_ROWS;
                const int16_t *xr = xq + r0 * K;
                const float *dr = dx + r0 * nb, *sr = xs + r0 * G;
                for (int64_t p = 0; p < np; p++) {
                    float *yo = y + r0 * N + 16 * (c + p);
                    const int16_t *w = buf + p * stride;
                    switch (R) {
                        case 1: tf_qmadd_tile(1, yo, N, w, xr, K, dr, sr, nb, G, bits); break;
                        case 2: tf_qmadd_tile(2, yo, N, w, xr, K, dr, sr, nb, G, bits); break;
                        case 3: tf_qmadd_tile(3, yo, N, w, xr, K, dr, sr, nb, G, bits); break;
                        default: tf_qmadd_tile(4, yo, N, w, xr, K, dr, sr, nb, G, bits); break;
                    }
                }
            }
        }
        free(buf);
    }
    free(xq);
    free(dx);
    free(xs);
#else
    (void)y; (void)x; (void)M; (void)K; (void)N; (void)q; (void)d; (void)m; (void)gs; (void)bits;
#endif
}

/* A whole decode step of the decoder stack, for a few tokens (one per sequence) and layers whose
 * linears all have a tf_qgemm layout (which may switch to tf_qbf16 or tf_qmadd from `big_from` rows, as
 * its plan does: decode steps of up to 64 rows): per layer
 *   h = norm(x); qkv = h Wqkv; [q/k norms per head]; RoPE + KV write; a = attention; a = a Wo;
 *   [a = norm(a)]; x += a;  h = norm(x); m = act(h Wgate_up) Wdown; [m = norm(m)]; x += m
 * with the kernels above, in one call instead of ~10 Python calls per layer. x [M, hidden] is the
 * residual stream, updated in place. The arithmetic is the Python path's, call for call. The KV pools are
 * float32 or float16 (a layer's kv_half: tf_rope_write_kv_f16 and tf_paged_decode_attention_f16, as the
 * layer path runs them for kv_cache_dtype="float16").
 * The bracketed steps run where the layer has those weights (NULL: Llama skips them); Gemma 3 has all
 * of them, `act` 1 (GeGLU) and sliding layers (window > 0) that read the step's second view: their own
 * KV pool's slots and block tables (engine/sliding_kv.py) and the local RoPE tables. */
typedef struct {
    const void *q;
    const float *d, *m;
    int64_t gs, bits;
    int64_t big_from;      /* > 0: steps of at least this many rows run the plan's big-batch kernel on this
                            * layout, as the layer's plan does there: tf_qbf16 on a qtile layout ("qbf16"),
                            * tf_qmadd on a qgemm one ("qmadd"); 0: tf_qgemm at every row count */
} tf_qlin;

void tf_qbf16(float *y, const float *x, int64_t M, int64_t K, int64_t N, const void *q, const void *d,
              const void *m, int64_t gs, int64_t bits);

/* y [M, N] = x [M, K] through one linear of the stack, with the kernel its plan runs at M rows. */
static void tf_stack_linear(float *y, const float *x, int64_t M, int64_t K, int64_t N, const tf_qlin *L) {
    if (L->big_from > 0 && M >= L->big_from) {      /* the big-batch kernel of this layout */
        if (L->bits & TF_QTILE)
            tf_qbf16(y, x, M, K, N, L->q, L->d, L->m, L->gs, L->bits & ~(int64_t)TF_QTILE);
        else
            tf_qmadd(y, x, M, K, N, L->q, L->d, L->m, L->gs, L->bits);
    } else
        tf_qgemm(y, x, M, K, N, L->q, L->d, L->m, L->gs, L->bits);
}

typedef struct {
    const float *ln1, *ln2;
    tf_qlin qkv, o, gate_up, down;
    void *k_cache, *v_cache;                   /* float32 pools, or float16 ones where kv_half */
    const float *q_norm, *k_norm;              /* per-head RMSNorm weights of q and k (Qwen3, Gemma 3), or NULL */
    const float *attn_out_norm, *mlp_out_norm; /* norms of the attention and MLP outputs (Gemma 3), or NULL */
    int64_t window;                            /* > 0: a sliding layer (view 1, its window only); 0: global */
    int64_t kv_half;                           /* 1: float16 pools (kv_cache_dtype="float16"; AVX2 builds, D % 64 == 0) */
} tf_layer;

/* What a step's layers read besides their weights: where the new K/V go, the block tables, and RoPE. */
typedef struct {
    const int64_t *positions, *slots, *block_tables, *ctx_lens;
    int64_t bt_stride;
    const float *cos_t, *sin_t;
} tf_step_view;

enum { TF_ACT_SILU = 0, TF_ACT_GELU_TANH = 1 };

void tf_decode_layers(float *x, int64_t M, int64_t hidden, int64_t n_layers, const tf_layer *layers,
                      int64_t H, int64_t KVH, int64_t D, int64_t inter, float eps, int64_t act,
                      const tf_step_view *views, int64_t bs, float scale) {
    const int64_t qkv_n = (H + 2 * KVH) * D;
    const int64_t widest = qkv_n > 2 * inter ? qkv_n : 2 * inter;
    float *h = (float *)malloc(sizeof(float) * (size_t)(M * hidden));
    float *wide = (float *)malloc(sizeof(float) * (size_t)(M * widest));
    float *mid = (float *)malloc(sizeof(float) * (size_t)(M * (H * D > inter ? H * D : inter)));
    float *y = (float *)malloc(sizeof(float) * (size_t)(M * hidden));
    for (int64_t l = 0; l < n_layers; l++) {
        const tf_layer *L = layers + l;
        const tf_step_view *v = views + (L->window > 0);
        tf_rms_norm(h, x, L->ln1, M, hidden, eps);
        tf_stack_linear(wide, h, M, hidden, qkv_n, &L->qkv);
        if (L->q_norm)      /* in place: each row's sum of squares is taken before it is written */
            for (int64_t t = 0; t < M; t++) {
                tf_rms_norm(wide + t * qkv_n, wide + t * qkv_n, L->q_norm, H, D, eps);
                tf_rms_norm(wide + t * qkv_n + H * D, wide + t * qkv_n + H * D, L->k_norm, KVH, D, eps);
            }
        if (L->kv_half) {     /* the same rotation; K/V stored rounded, widened to float32 as they are read */
            tf_rope_write_kv_f16(wide, M, qkv_n, H, KVH, D, v->positions, v->cos_t, v->sin_t,
                                 (uint16_t *)L->k_cache, (uint16_t *)L->v_cache, v->slots);
            tf_paged_decode_attention_f16(mid, wide, qkv_n, (const uint16_t *)L->k_cache, (const uint16_t *)L->v_cache,
                                          v->block_tables, v->bt_stride, v->ctx_lens, M, H, KVH, D, bs, scale,
                                          L->window);
        } else {
            tf_rope_write_kv(wide, M, qkv_n, H, KVH, D, v->positions, v->cos_t, v->sin_t, (float *)L->k_cache,
                             (float *)L->v_cache, v->slots);
            tf_paged_decode_attention(mid, wide, qkv_n, (const float *)L->k_cache, (const float *)L->v_cache,
                                      v->block_tables, v->bt_stride, v->ctx_lens, M, H, KVH, D, bs, scale, L->window);
        }
        tf_stack_linear(y, mid, M, H * D, hidden, &L->o);
        if (L->attn_out_norm) tf_rms_norm(y, y, L->attn_out_norm, M, hidden, eps);
        for (int64_t i = 0; i < M * hidden; i++) x[i] += y[i];
        tf_rms_norm(h, x, L->ln2, M, hidden, eps);
        tf_stack_linear(wide, h, M, hidden, 2 * inter, &L->gate_up);
        if (act == TF_ACT_GELU_TANH)
            tf_gelu_tanh_mul(mid, wide, M, inter);
        else
            tf_silu_mul(mid, wide, M, inter);
        tf_stack_linear(y, mid, M, inter, hidden, &L->down);
        if (L->mlp_out_norm) tf_rms_norm(y, y, L->mlp_out_norm, M, hidden, eps);
        for (int64_t i = 0; i < M * hidden; i++) x[i] += y[i];
    }
    free(h);
    free(wide);
    free(mid);
    free(y);
}

/* ---------------------------------------------------------------------------------------------------------
 * tf_qtile: a few activation rows (decode batches, speculative verify rows) times int4 / int8 blocks on
 * AMX int8 tiles (kernel "qtile", tokenfab/quant/kernels.py). tf_qgemm's per-row loop costs ~2 cycles per
 * block of 32 and activation row (an int16 dot, a convert and an FMA per row, docs/speculative.md), so a
 * 5-row verify cost 2.4x a 1-row step. Here one tile multiply (TDPBSSD / TDPBSUD, ~8 cycles whatever
 * the rows up to 8, measured on the Sapphire Rapids VM) computes one block for 16 outputs and every
 * row at once; what is left per row is one convert and one FMA per 16 outputs.
 *
 * Numerics (the same for every row count, and in the plain C reference below, bit for bit):
 *   - each activation row is quantized per block of 32 to int16 in [-32639, 32639] (scale max|x| /
 *     32639, ~2^-16 relative, as tf_qgemm) and split exactly as q = 256 hi + lo, hi and lo int8
 *     (the tile unit multiplies bytes): the tile computes both halves' dots, recombined in int32, so
 *     D[r, n, b] = sum_j w[n, 32b + j] q[r, 32b + j] is exact;
 *   - y[r, n] = fma over blocks b in order: acc = fma((float)D, fl(s[n, b] * dx[r, b]), acc), then
 *     (int4) acc = fma(m[n, g], xs[r, g], acc) over groups g in order, xs the float sums of x per group.
 *   A row's result depends on that row alone: 1-row decode and 5-row verify give the same bits.
 * Layout (built by tokenfab/quant/kernels.py, `qtile_pack`): outputs in tiles of 16 (N % 16 == 0);
 *   bits 8: q [N/16][nb][8][16][4] int8: the tile unit's B operand as is (row i: k 4i..4i+3 of 16 outputs)
 *   bits 4: q [N/16][nb][4][64] bytes: chunk c's low nibbles are B row 2c, its high nibbles B row 2c+1
 *   d and m (int4's offsets), one per output and group of gs, tiled [N/16][G][16]: a block's 16 scales are
 *   one contiguous load. Float16 where `bits | TF_QTILE_HALF` says so (GGUF's Q4_1 / Q8_0 store theirs in
 *   float16, so widening them is exact and the bytes per token drop by a third of the int4 blocks'),
 *   else float32. */
/* TF_QTILE (tf_qgemm's `bits | TF_QTILE`: run tf_qtile) is defined above tf_qgemm. */
#define TF_QTILE_ROWS 16  /* rows per pass over the weight (two tiles of 8: each row takes a hi and a lo tile row) */
#define TF_QTILE_QMAX 32639.f   /* 256 * 127 + 127: the largest q whose hi and lo both fit int8 */
#define TF_QTILE_HALF 1024      /* a qtile layout's `bits | TF_QTILE_HALF`: its scales and offsets are float16 */

/* Element i of a tiled scale array, float32 or float16. */
static inline float tf_qtile_scale(const void *s, int half, int64_t i) {
    return half ? tf_f16((const uint8_t *)s + 2 * i) : ((const float *)s)[i];
}

/* x [n] -> int16 blocks in [-32639, 32639] and their scales (relative error ~2^-16). */
static void tf_qtile_quantize(const float *x, int64_t n, int16_t *xq, float *dx) {
    for (int64_t b = 0; b < n / 32; b++) {
        const float *xb = x + b * 32;
        float amax = 0.f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float id = amax > 0.f ? TF_QTILE_QMAX / amax : 0.f;
        for (int j = 0; j < 32; j++) xq[b * 32 + j] = (int16_t)lrintf(xb[j] * id);
        dx[b] = amax / TF_QTILE_QMAX;
    }
}

/* Each row's int16 blocks (tf_qtile_quantize), their scales dx [rows, nb], the float sums of x per group
 * xs [rows, G] (int4's offsets), and the exact split q = 256 hi + lo into int8 hi [rows, K] and lo
 * [rows, K]; with `bias` 128 the halves are stored plus 128, as uint8 (VNNI's unsigned operand). */
static void tf_qtile_prep(const float *x, int64_t M, int64_t K, int64_t gs, int16_t *xq, float *dx, float *xs,
                          int8_t *hi, int8_t *lo, int bias) {
    const int64_t nb = K / 32, G = K / gs;
    for (int64_t r = 0; r < M; r++) {
        tf_qtile_quantize(x + r * K, K, xq + r * K, dx + r * nb);
        for (int64_t g = 0; g < G; g++)
            for (int64_t k = g * gs; k < (g + 1) * gs; k++) xs[r * G + g] += x[r * K + k];
        if (hi)
            for (int64_t k = 0; k < K; k++) {
                const int v = xq[r * K + k], h = (v + 128) >> 8;     /* floor: lo in [-128, 127] */
                hi[r * K + k] = (int8_t)(uint8_t)(h + bias);
                lo[r * K + k] = (int8_t)(uint8_t)(v - 256 * h + bias);
            }
    }
}

/* The weight of output n (0..15 in its tile), input k (0..31 in block b) from the packed layout. */
static inline int tf_qtile_w(const uint8_t *tile_b, int64_t bits, int n, int k) {
    const int i = k / 4, j = k % 4;        /* B row i, byte n * 4 + j */
    if (bits == 8) return ((const int8_t *)tile_b)[i * 64 + n * 4 + j];
    const uint8_t byte = tile_b[(i / 2) * 64 + n * 4 + j];
    return i & 1 ? byte >> 4 : byte & 0x0F;
}

/* The plain C reference: the same arithmetic one weight at a time (tests compare the tile path to it). */
void tf_qtile_ref(float *y, const float *x, int64_t M, int64_t K, int64_t N, const void *q, const float *d,
                  const float *m, int64_t gs, int64_t bits) {
    const int half = (bits & TF_QTILE_HALF) != 0;
    bits &= ~TF_QTILE_HALF;
    const int64_t nb = K / 32, G = K / gs, tb = bits == 8 ? 512 : 256;
    int16_t *xq = (int16_t *)malloc(sizeof(int16_t) * (size_t)(M * K));
    float *dx = (float *)malloc(sizeof(float) * (size_t)(M * nb));
    float *xs = (float *)calloc((size_t)(M * G + 1), sizeof(float));
    tf_qtile_prep(x, M, K, gs, xq, dx, xs, NULL, NULL, 0);
    for (int64_t n = 0; n < N; n++) {
        const int64_t t = n / 16;
        for (int64_t r = 0; r < M; r++) {
            float acc = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *tile_b = (const uint8_t *)q + (t * nb + b) * tb;
                int32_t dot = 0;
                for (int k = 0; k < 32; k++) dot += tf_qtile_w(tile_b, bits, (int)(n % 16), k) * xq[r * K + b * 32 + k];
                const float sc = tf_qtile_scale(d, half, (t * G + b / (gs / 32)) * 16 + n % 16) * dx[r * nb + b];
                acc = fmaf((float)dot, sc, acc);
            }
            if (bits == 4)
                for (int64_t g = 0; g < G; g++) acc = fmaf(tf_qtile_scale(m, half, (t * G + g) * 16 + n % 16), xs[r * G + g], acc);
            y[r * N + n] = acc;
        }
    }
    free(xq);
    free(dx);
    free(xs);
}

/* tf_qtile on AVX-512 VNNI, for the rows where the tile unit's fixed cost per block dominates (1-row
 * decode: one tile multiply, store and reload per block cost ~115 cycles per 16 outputs x 32 inputs with
 * the weight in L2, against ~53 here, measured on the Sapphire Rapids VM) and on CPUs without AMX. A B row of the qtile layout (16 outputs x 4
 * consecutive inputs, 64 bytes) is exactly a VNNI operand: VPDPBUSD adds the 4 products of each output
 * lane, so a block is 8 instructions per activation half and row, with the 4 activation bytes
 * broadcast. The integer dot D is the same exact integer as the tile's, and the float steps are the
 * same operations in the same order: the same bits as tf_qtile_ref.
 *   int4: the weights (nibbles 0..15) are the unsigned operand, hi and lo the signed one.
 *   int8: the weights are signed, so hi and lo go in as uint8 (plus 128) and the block's weight sums
 *         S (one more VPDPBUSD per B row, against ones) take it back out: D = 256 Dh + Dl - 32896 S. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TF_QTILE_VNNI 1
#define TF_QTILE_VNNI_ROWS 4    /* rows per pass over the weight */
/* Where AMX runs too, VNNI takes 1-row calls only: 2-core VM, 1 and 2 threads, weights streamed, per call:
 * 1 row 1.3x the tiles' speed on int4 and 1.0-1.2x on the Q8_0 LM head; 2 rows int4 0.85-1.35x, Q8_0 0.6x. */
#define TF_QTILE_VNNI_AUTO 1

static inline __attribute__((always_inline)) __m512i tf_bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* TG tiles of 16 outputs (consecutive in the layout) for M rows; M and TG constants at each call site. */
static inline __attribute__((always_inline)) void
tf_qtile_vnni_tiles(const int M, const int TG, float *y, int64_t N, const int8_t *hi, const int8_t *lo,
                    const float *dx, const float *xs, int64_t K, int64_t nb, int64_t G, const uint8_t *qt,
                    const char *dt, const char *mt, int64_t bits, int64_t bpg, const int half) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), ones = _mm512_set1_epi8(1);
    const int64_t tb = bits == 8 ? 512 : 256;
    __m512 acc[4][TF_QTILE_VNNI_ROWS];
    for (int t = 0; t < TG; t++)
        for (int r = 0; r < M; r++) acc[t][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        for (int t = 0; t < TG; t++) {
            const uint8_t *wb = qt + (t * nb + b) * tb;
            __m512i dh[TF_QTILE_VNNI_ROWS], dl[TF_QTILE_VNNI_ROWS], sw = _mm512_setzero_si512();
            for (int r = 0; r < M; r++) dh[r] = dl[r] = _mm512_setzero_si512();
            if (bits == 4) {
                for (int c = 0; c < 4; c++) {
                    const __m512i v = _mm512_loadu_si512((const void *)(wb + c * 64));
                    const __m512i w0 = _mm512_and_si512(v, m4), w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                    for (int r = 0; r < M; r++) {         /* B rows 2c, 2c + 1: inputs 8c..8c+3, 8c+4..8c+7 */
                        const int64_t o = r * K + b * 32 + 8 * c;
                        dh[r] = _mm512_dpbusd_epi32(dh[r], w0, tf_bcast4(hi + o));
                        dl[r] = _mm512_dpbusd_epi32(dl[r], w0, tf_bcast4(lo + o));
                        dh[r] = _mm512_dpbusd_epi32(dh[r], w1, tf_bcast4(hi + o + 4));
                        dl[r] = _mm512_dpbusd_epi32(dl[r], w1, tf_bcast4(lo + o + 4));
                    }
                }
            } else {
                for (int i = 0; i < 8; i++) {
                    const __m512i w = _mm512_loadu_si512((const void *)(wb + i * 64));
                    sw = _mm512_dpbusd_epi32(sw, ones, w);
                    for (int r = 0; r < M; r++) {
                        const int64_t o = r * K + b * 32 + 4 * i;
                        dh[r] = _mm512_dpbusd_epi32(dh[r], tf_bcast4(hi + o), w);
                        dl[r] = _mm512_dpbusd_epi32(dl[r], tf_bcast4(lo + o), w);
                    }
                }
                sw = _mm512_mullo_epi32(sw, _mm512_set1_epi32(32896));   /* 128 * 257 */
            }
            const __m512 s = tf_ld16(dt, (t * G + b / bpg) * 16, half);
            for (int r = 0; r < M; r++) {
                __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(dh[r], 8), dl[r]);
                if (bits == 8) dot = _mm512_sub_epi32(dot, sw);
                acc[t][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, _mm512_set1_ps(dx[r * nb + b])),
                                            acc[t][r]);
            }
        }
    }
    for (int t = 0; t < TG; t++) {
        if (bits == 4)
            for (int64_t g = 0; g < G; g++) {
                const __m512 mv = tf_ld16(mt, (t * G + g) * 16, half);
                for (int r = 0; r < M; r++) acc[t][r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * G + g]), acc[t][r]);
            }
        for (int r = 0; r < M; r++) _mm512_storeu_ps(y + r * N + t * 16, acc[t][r]);
    }
}

#define TF_QTILE_VNNI_CALL(M_, TG_)                                                                    \
    tf_qtile_vnni_tiles(M_, TG_, y + t * 16, N, hi, lo, dx, xs, K, nb, G, (const uint8_t *)q + t * nb * tb, \
                        (const char *)d + t * 16 * G * es, bits == 4 ? (const char *)m + t * 16 * G * es : NULL, \
                        bits, gs / 32, half)

/* y[M, N] from a qtile layout on VNNI, TF_QTILE_VNNI_ROWS rows per pass (the rows' results as tf_qtile_ref's). */
static void tf_qtile_vnni_run(float *y, const float *x, int64_t M, int64_t K, int64_t N, const void *q,
                              const float *d, const float *m, int64_t gs, int64_t bits) {
    if (M > TF_QTILE_VNNI_ROWS) {
        for (int64_t r0 = 0; r0 < M; r0 += TF_QTILE_VNNI_ROWS)
            tf_qtile_vnni_run(y + r0 * N, x + r0 * K, M - r0 < TF_QTILE_VNNI_ROWS ? M - r0 : TF_QTILE_VNNI_ROWS,
                              K, N, q, d, m, gs, bits);
        return;
    }
    const int half = (bits & TF_QTILE_HALF) != 0;
    bits &= ~TF_QTILE_HALF;
    const int64_t nb = K / 32, G = K / gs, ntiles = N / 16, tb = bits == 8 ? 512 : 256, es = half ? 2 : 4;
    int16_t *xq = (int16_t *)malloc(sizeof(int16_t) * (size_t)(M * K));
    float *dx = (float *)malloc(sizeof(float) * (size_t)(M * nb));
    float *xs = (float *)calloc((size_t)(M * G + 1), sizeof(float));
    int8_t *hi = (int8_t *)malloc((size_t)(M * K)), *lo = (int8_t *)malloc((size_t)(M * K));
    tf_qtile_prep(x, M, K, gs, xq, dx, xs, hi, lo, bits == 8 ? 128 : 0);
    /* one row: four tiles at a time (eight independent dot chains); more rows: fewer tiles, as many chains */
    const int64_t tg = M == 1 ? 4 : M == 2 ? 2 : 1, ngroups = ntiles / tg;
#pragma omp parallel for schedule(static) if (ntiles >= 8)
    for (int64_t gi = 0; gi < ngroups; gi++) {
        const int64_t t = gi * tg;
        switch (M) {
            case 1: TF_QTILE_VNNI_CALL(1, 4); break;
            case 2: TF_QTILE_VNNI_CALL(2, 2); break;
            case 3: TF_QTILE_VNNI_CALL(3, 1); break;
            default: TF_QTILE_VNNI_CALL(4, 1); break;
        }
    }
    for (int64_t t = ngroups * tg; t < ntiles; t++) {       /* the tiles left over by the groups */
        if (M == 1) TF_QTILE_VNNI_CALL(1, 1);        /* only 1 and 2 rows take groups */
        else TF_QTILE_VNNI_CALL(2, 1);
    }
    free(xq);
    free(dx);
    free(xs);
    free(hi);
    free(lo);
}
#endif

/* tf_qtile's VNNI path called directly (tests, benchmarks): 1 when this build has it and ran it, else 0. */
int64_t tf_qtile_vnni(float *y, const float *x, int64_t M, int64_t K, int64_t N, const void *q, const float *d,
                      const float *m, int64_t gs, int64_t bits) {
#ifdef TF_QTILE_VNNI
    if (M > 0) tf_qtile_vnni_run(y, x, M, K, N, q, d, m, gs, bits);
    return 1;
#else
    (void)y, (void)x, (void)M, (void)K, (void)N, (void)q, (void)d, (void)m, (void)gs, (void)bits;
    return 0;
#endif
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && defined(__AVX512F__) && defined(__AVX512BW__)
#define TF_QTILE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

static int tf_amx_state = -1;     /* -1 not asked yet, 0 no, 1 granted */

/* 1 when this process may use AMX tiles: the CPU has them (CPUID 7.0: EDX bits 24 tile, 25 int8), the
 * environment does not say TOKENFAB_NO_AMX=1, and Linux granted the XTILEDATA permission (arch_prctl ARCH_REQ_XCOMP_PERM; without it the first tile
 * instruction kills the process). Asked once; the grant covers every thread of the process. */
int64_t tf_amx_available(void) {
    if (tf_amx_state < 0) {
        unsigned a, b, c, dd;
        __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(dd) : "a"(7), "c"(0));
        const char *off = getenv("TOKENFAB_NO_AMX");      /* "1": run as on a CPU without AMX (tests, benchmarks) */
        const int has = (dd >> 24 & 1) && (dd >> 25 & 1) && !(off && off[0] == '1');
        tf_amx_state = has && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    }
    return tf_amx_state;
}

/* GCC's tile intrinsics are asm statements without a memory clobber: the compiler does not know that a
 * tile load reads the B buffer just written, or that a tile store writes the dots read next, and may drop
 * or reorder those accesses (it did: 9-16 rows read stale dots). A barrier after each write fixes the order. */
#define TF_MEMBAR() __asm__ volatile("" ::: "memory")

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tf_tilecfg;

/* Tile configurations. Up to 8 rows ("pairs"): two blocks in flight, so one block's multiply never
 * waits for the previous block's result to be stored (tiles are not renamed; one block at a time ran
 * 1-row steps 25 % slower than tf_qgemm): tiles 0, 1 the activations of blocks b, b + 1 (each row's hi
 * bytes, then its lo bytes: 2M rows of 32 bytes = one block), 2, 3 their weights (the B operand: 8 rows
 * of 16 outputs x 4 bytes), 4, 5 their int32 dots. 9-16 rows ("groups"): one block at a time, tiles 0, 1
 * the activations of rows 0-7 and 8-15, 2 the weights, 3, 4 the dots. */
__attribute__((target("amx-tile,amx-int8"))) static void tf_qtile_config(int64_t M) {
    tf_tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    if (M <= 8) {
        for (int t = 0; t < 2; t++) {
            c.rows[t] = (uint8_t)(2 * M), c.colsb[t] = 32;
            c.rows[2 + t] = 8, c.colsb[2 + t] = 64;
            c.rows[4 + t] = (uint8_t)(2 * M), c.colsb[4 + t] = 64;
        }
    } else {
        c.rows[0] = 16, c.colsb[0] = 32;
        c.rows[1] = (uint8_t)(2 * (M - 8)), c.colsb[1] = 32;
        c.rows[2] = 8, c.colsb[2] = 64;
        c.rows[3] = 16, c.colsb[3] = 64;
        c.rows[4] = (uint8_t)(2 * (M - 8)), c.colsb[4] = 64;
    }
    _tile_loadconfig(&c);
}

/* A block's B operand: int8 weights are stored as it (no copy); int4 nibbles are split into `buf`. */
__attribute__((target("amx-tile,amx-int8"), always_inline)) static inline const void *
tf_qtile_b(const uint8_t *qt, int64_t b, int64_t bits, uint8_t (*buf)[64]) {
    if (bits == 8) {
        _mm_prefetch((const char *)(qt + (b + 4) * 512), _MM_HINT_T0);   /* tile loads from memory don't */
        _mm_prefetch((const char *)(qt + (b + 4) * 512 + 64), _MM_HINT_T0);   /* wake the streamers */
        _mm_prefetch((const char *)(qt + (b + 4) * 512 + 128), _MM_HINT_T0);
        _mm_prefetch((const char *)(qt + (b + 4) * 512 + 192), _MM_HINT_T0);
        _mm_prefetch((const char *)(qt + (b + 4) * 512 + 256), _MM_HINT_T0);
        _mm_prefetch((const char *)(qt + (b + 4) * 512 + 320), _MM_HINT_T0);
        _mm_prefetch((const char *)(qt + (b + 4) * 512 + 384), _MM_HINT_T0);
        _mm_prefetch((const char *)(qt + (b + 4) * 512 + 448), _MM_HINT_T0);
        return qt + b * 512;
    }
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const uint8_t *src = qt + b * 256;
    for (int c = 0; c < 4; c++) _mm_prefetch((const char *)(src + 4 * 256 + c * 64), _MM_HINT_T0);
    for (int c = 0; c < 4; c++) {
        const __m512i v = _mm512_loadu_si512((const void *)(src + c * 64));
        _mm512_store_si512((void *)buf[2 * c], _mm512_and_si512(v, m4));
        _mm512_store_si512((void *)buf[2 * c + 1], _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
    }
    TF_MEMBAR();
    return buf;
}

/* acc[r] = fma(D[r], s * dx[r, b], acc[r]) for one block's dots (cbuf rows: hi of row r at hi0 + r, lo at lo0 + r). */
__attribute__((always_inline)) static inline void tf_qtile_acc(const int M, __m512 *acc, int32_t (*cbuf)[16], int hi0,
                                                               int lo0, int nrows, int rbase, __m512 s,
                                                               const float *dx, int64_t nb, int64_t b) {
    for (int i = 0; i < nrows; i++) {
        const int r = rbase + i;
        const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512((const void *)cbuf[hi0 + i]), 8),
                                             _mm512_load_si512((const void *)cbuf[lo0 + i]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, _mm512_set1_ps(dx[r * nb + b])), acc[r]);
    }
    (void)M;
}

/* One tile of 16 outputs for M rows (M a constant at each call site: the accumulators stay in
 * registers). a: the activation tiles [nb][2 * M][32]; dx [M, nb]; xs [M, G]. */
__attribute__((target("amx-tile,amx-int8"), always_inline)) static inline void
tf_qtile_tile(const int M, float *y, int64_t N, const int8_t *a, const float *dx, const float *xs, int64_t nb,
              int64_t G, const uint8_t *qt, const char *dt, const char *mt, int64_t bits, int64_t bpg, const int half) {
    /* dt, mt: the tile's scales / offsets ([G][16]) */
#define TF_SB(blk) tf_ld16(dt, (blk) / bpg * 16, half)
    __m512 acc[TF_QTILE_ROWS];
    int32_t c0[2 * TF_QTILE_ROWS][16] __attribute__((aligned(64)));
    int32_t c1[2 * TF_QTILE_ROWS][16] __attribute__((aligned(64)));
    uint8_t b0[8][64] __attribute__((aligned(64))), b1[8][64] __attribute__((aligned(64)));
    for (int r = 0; r < M; r++) acc[r] = _mm512_setzero_ps();
    int64_t b = 0;
    if (M <= 8) {
        for (; b + 1 < nb; b += 2) {
            _tile_loadd(2, tf_qtile_b(qt, b, bits, b0), 64);
            _tile_loadd(3, tf_qtile_b(qt, b + 1, bits, b1), 64);
            _tile_loadd(0, a + b * 2 * M * 32, 32);
            _tile_loadd(1, a + (b + 1) * 2 * M * 32, 32);
            _tile_zero(4);
            _tile_zero(5);
            if (bits == 8) {
                _tile_dpbssd(4, 0, 2);
                _tile_dpbssd(5, 1, 3);
            } else {
                _tile_dpbsud(4, 0, 2);
                _tile_dpbsud(5, 1, 3);
            }
            _tile_stored(4, c0, 64);
            _tile_stored(5, c1, 64);
            TF_MEMBAR();
            tf_qtile_acc(M, acc, c0, 0, M, M, 0, TF_SB(b), dx, nb, b);
            tf_qtile_acc(M, acc, c1, 0, M, M, 0, TF_SB(b + 1), dx, nb, b + 1);
        }
        if (b < nb) {
            _tile_loadd(2, tf_qtile_b(qt, b, bits, b0), 64);
            _tile_loadd(0, a + b * 2 * M * 32, 32);
            _tile_zero(4);
            if (bits == 8) _tile_dpbssd(4, 0, 2);
            else _tile_dpbsud(4, 0, 2);
            _tile_stored(4, c0, 64);
            TF_MEMBAR();
            tf_qtile_acc(M, acc, c0, 0, M, M, 0, TF_SB(b), dx, nb, b);
        }
    } else {
        for (; b < nb; b++) {
            const int8_t *ab = a + b * 2 * M * 32;
            _tile_loadd(2, tf_qtile_b(qt, b, bits, b0), 64);
            _tile_loadd(0, ab, 32);
            _tile_loadd(1, ab + 16 * 32, 32);
            _tile_zero(3);
            _tile_zero(4);
            if (bits == 8) {
                _tile_dpbssd(3, 0, 2);
                _tile_dpbssd(4, 1, 2);
            } else {
                _tile_dpbsud(3, 0, 2);
                _tile_dpbsud(4, 1, 2);
            }
            _tile_stored(3, c0, 64);
            _tile_stored(4, c1, 64);
            TF_MEMBAR();
            tf_qtile_acc(M, acc, c0, 0, 8, 8, 0, TF_SB(b), dx, nb, b);
            tf_qtile_acc(M, acc, c1, 0, M - 8, M - 8, 8, TF_SB(b), dx, nb, b);
        }
    }
    if (bits == 4)
        for (int64_t g = 0; g < G; g++) {
            const __m512 mv = tf_ld16(mt, g * 16, half);
            for (int r = 0; r < M; r++) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * G + g]), acc[r]);
        }
    for (int r = 0; r < M; r++) _mm512_storeu_ps(y + r * N, acc[r]);
#undef TF_SB
}

#define TF_QTILE_SWITCH(...)                                                          \
    switch (M) {                                                                      \
        case 1: tf_qtile_tile(1, __VA_ARGS__); break;                                 \
        case 2: tf_qtile_tile(2, __VA_ARGS__); break;                                 \
        case 3: tf_qtile_tile(3, __VA_ARGS__); break;                                 \
        case 4: tf_qtile_tile(4, __VA_ARGS__); break;                                 \
        case 5: tf_qtile_tile(5, __VA_ARGS__); break;                                 \
        case 6: tf_qtile_tile(6, __VA_ARGS__); break;                                 \
        case 7: tf_qtile_tile(7, __VA_ARGS__); break;                                 \
        case 8: tf_qtile_tile(8, __VA_ARGS__); break;                                 \
        case 9: case 10: case 11: case 12: tf_qtile_tile(12, __VA_ARGS__); break;     \
        default: tf_qtile_tile(16, __VA_ARGS__); break;                               \
    }

/* ---------------------------------------------------------------------------------------------------------
 * tf_qbf16: many activation rows (decode batches above 16 rows, prefill chunks) times a qtile layout on AMX
 * bf16 tiles (kernel "qbf16", tokenfab/quant/kernels.py). Above 16 rows tf_qtile pays its per-block
 * scaling once per row and block (its int32 dots need the block's scales before they can be summed), and
 * the bf16 float copy (kernel "bf16", oneDNN) reads 2 bytes per weight from memory. Here each tile of 16
 * outputs is expanded once per call into bf16 B tiles in a per-thread buffer (w = q d + m in float32,
 * rounded to bf16 as the float copy is: the same weights), then every group of 32 rows runs one TDPBF16PS
 * per block and keeps its float32 sums in tiles across all blocks, stored once. The weights stream as
 * their quantized bytes, and no float copy is kept. Activations are rounded to bf16 as the bf16 kernel
 * rounds them (x: bf16 [rows rounded up to 16, K], the padding rows zero). */
int64_t tf_amx_bf16_available(void) {
    static int state = -1;      /* asked once: cpuid traps to the hypervisor in a VM */
    if (state < 0) {
        unsigned a, b, c, dd, a1, b1, c1, d1;
        __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(dd) : "a"(7), "c"(0));
        __asm__ volatile("cpuid" : "=a"(a1), "=b"(b1), "=c"(c1), "=d"(d1) : "a"(7), "c"(1));
        /* CPUID 7.0 EDX bit 22: amx_bf16; 7.1 EAX bit 5: avx512_bf16 (the expansion's conversions) */
        state = (dd >> 22 & 1) && (a1 >> 5 & 1) && tf_amx_available();
    }
    return state;
}

__attribute__((target("amx-tile,amx-bf16"))) static void tf_qbf16_config(void) {
    tf_tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;    /* C 0-3, A 4 5, B 6 7: 16 rows of 64 bytes */
    _tile_loadconfig(&c);
}

/* One block of a tile as 16 bf16 B rows (row j: inputs 2j, 2j + 1 of each of the 16 outputs, 64 bytes), from
 * its qtile bytes (8 rows of 16 outputs x 4 inputs; int4: chunk c's low / high nibbles are rows 2c / 2c + 1).
 * s, mo: the block's 16 scales and (int4) offsets. */
__attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline)) static inline void
tf_qbf16_block(uint16_t *B, const uint8_t *wb, int64_t bits, __m512 s, __m512 mo) {
    __m512 sq[4], mq[4];
    for (int k = 0; k < 4; k++) {          /* lanes of quarter k: outputs 4k + l / 4 (4 inputs each) */
        const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(4 * k),
                                             _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2));
        sq[k] = _mm512_permutexvar_ps(idx, s);
        mq[k] = _mm512_permutexvar_ps(idx, mo);
    }
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    const __m512i m4 = _mm512_set1_epi32(0x0F);
    for (int i = 0; i < 8; i++) {
        __m512 w[4];
        for (int k = 0; k < 4; k++) {       /* quarter k: bytes 16k.. = outputs 4k..4k+3, 4 inputs each */
            __m512i v;
            if (bits == 8) v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wb + i * 64 + 16 * k)));
            else {                           /* int4: row i is chunk i / 2's low (even i) or high nibbles */
                v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wb + (i / 2) * 64 + 16 * k)));
                v = _mm512_and_si512(i & 1 ? _mm512_srli_epi32(v, 4) : v, m4);
            }
            const __m512 f = _mm512_cvtepi32_ps(v);
            w[k] = bits == 8 ? _mm512_mul_ps(f, sq[k]) : _mm512_fmadd_ps(f, sq[k], mq[k]);
        }
        /* bf16 words 4n + j (n = output, j = input 4i + j) of outputs 0-7, then 8-15: dword 2n holds inputs
         * 4i, 4i + 1 of output n, dword 2n + 1 inputs 4i + 2, 4i + 3 */
        const __m512i p01 = (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]), p23 = (__m512i)_mm512_cvtne2ps_pbh(w[3], w[2]);
        _mm512_store_si512((void *)(B + (2 * i) * 32), _mm512_permutex2var_epi32(p01, even, p23));
        _mm512_store_si512((void *)(B + (2 * i + 1) * 32), _mm512_permutex2var_epi32(p01, odd, p23));
    }
}

__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))
void tf_qbf16(float *y, const float *x, int64_t M, int64_t K, int64_t N, const void *q, const void *d,
              const void *m, int64_t gs, int64_t bits) {
    if (M <= 0) return;
    const int half = (bits & TF_QTILE_HALF) != 0;
    bits &= ~TF_QTILE_HALF;
    const int64_t nb = K / 32, G = K / gs, bpg = gs / 32, ntiles = N / 16, tb = bits == 8 ? 512 : 256;
    const int64_t es = half ? 2 : 4, Mp = (M + 15) / 16 * 16;
    /* x rounded to bf16 as torch's .to(torch.bfloat16) (tf_narrow_row), whole tiles of 16 rows, padding zero */
    uint16_t *xb = (uint16_t *)aligned_alloc(64, (size_t)(Mp * K * 2 + 63) / 64 * 64);
    const int64_t npairs = (ntiles + 1) / 2, pair_elems = 2 * nb * 512;
    /* Each thread takes a run of tile pairs and expands them, up to ~1 MB of bf16 B tiles at a time (L2),
     * once per call. Then every group of 32 rows runs all those pairs: its A rows (32 x K x 2 bytes) stay
     * in L1 and its results land in 32 rows of y, close together. The first version looped pairs outside
     * rows: each pair re-read every row from L3 once they outgrew L2, and its stores strode the whole of y
     * (2048 x 3072 floats: a third of the time went to stores). */
    const int64_t per_mb = ((int64_t)1 << 20) / (pair_elems * 2), cb = per_mb > 0 ? per_mb : 1;   /* pairs per block */
#pragma omp parallel if (ntiles >= 8)
    {
        const int64_t nth = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t r_lo = M * me / nth, r_hi = M * (me + 1) / nth;
        tf_narrow_row(xb + r_lo * K, x + r_lo * K, (r_hi - r_lo) * K);
        if (me == nth - 1) memset(xb + M * K, 0, (size_t)((Mp - M) * K * 2));
        tf_qbf16_config();
        const int64_t p_lo = npairs * me / nth, p_hi = npairs * (me + 1) / nth;
        const int64_t mine = p_hi - p_lo < cb ? p_hi - p_lo : cb;
        uint16_t *B = (uint16_t *)aligned_alloc(64, (size_t)((mine > 0 ? mine : 1) * pair_elems * 2));
        float ct[16][16] __attribute__((aligned(64)));
#pragma omp barrier
        for (int64_t c0 = p_lo; c0 < p_hi; c0 += cb) {
            const int64_t c1 = c0 + cb < p_hi ? c0 + cb : p_hi;
            for (int64_t pi = c0; pi < c1; pi++) {
                uint16_t *Bp = B + (pi - c0) * pair_elems;
                for (int64_t t = 2 * pi; t < 2 * pi + 2 && t < ntiles; t++) {
                    const uint8_t *qt = (const uint8_t *)q + t * nb * tb;
                    const char *dt = (const char *)d + t * 16 * G * es, *mt = bits == 4 ? (const char *)m + t * 16 * G * es : NULL;
                    for (int64_t b = 0; b < nb; b++) {
                        /* the weights stream from memory and the expansion stalled on them (perf: a fifth of
                         * the kernel's samples on the first byte load of a block): fetch 4 blocks ahead */
                        for (int64_t l = 0; l < tb; l += 64) _mm_prefetch((const char *)(qt + (b + 4) * tb + l), _MM_HINT_T0);
                        tf_qbf16_block(Bp + ((t - 2 * pi) * nb + b) * 512, qt + b * tb, bits, tf_ld16(dt, b / bpg * 16, half),
                                       mt ? tf_ld16(mt, b / bpg * 16, half) : _mm512_setzero_ps());
                    }
                }
            }
            TF_MEMBAR();
            for (int64_t r0 = 0; r0 < Mp; r0 += 32) {
                const int two = r0 + 16 < Mp;
                for (int64_t pi = c0; pi < c1; pi++) {
                    /* tiles t0 and t0 + 1 (one where N / 16 is odd): each A tile loaded serves both.
                     * C[2 h + u]: rows r0 + 16 h.., tile t0 + u; A tiles 4, 5 (rows), B tiles 6, 7 */
                    const int64_t t0 = 2 * pi, nt = t0 + 1 < ntiles ? 2 : 1;
                    const uint16_t *B0 = B + (pi - c0) * pair_elems, *B1 = B0 + nb * 512;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int64_t b = 0; b < nb; b++) {
                        _tile_loadd(6, B0 + b * 512, 64);
                        _tile_loadd(4, xb + r0 * K + b * 32, K * 2);
                        _tile_dpbf16ps(0, 4, 6);
                        if (nt == 2) {
                            _tile_loadd(7, B1 + b * 512, 64);
                            _tile_dpbf16ps(1, 4, 7);
                        }
                        if (two) {
                            _tile_loadd(5, xb + (r0 + 16) * K + b * 32, K * 2);
                            _tile_dpbf16ps(2, 5, 6);
                            if (nt == 2) _tile_dpbf16ps(3, 5, 7);
                        }
                    }
                    for (int h = 0; h < 1 + two; h++)
                        for (int64_t u = 0; u < nt; u++) {
                            const int64_t rb = r0 + 16 * h;
                            float *yt = y + rb * N + (t0 + u) * 16;
                            if (rb + 16 <= M) {
                                switch (2 * h + u) {
                                    case 0: _tile_stored(0, yt, N * 4); break;
                                    case 1: _tile_stored(1, yt, N * 4); break;
                                    case 2: _tile_stored(2, yt, N * 4); break;
                                    default: _tile_stored(3, yt, N * 4); break;
                                }
                            } else if (rb < M) {            /* the last rows: through a buffer, padding dropped */
                                switch (2 * h + u) {
                                    case 0: _tile_stored(0, ct, 64); break;
                                    case 1: _tile_stored(1, ct, 64); break;
                                    case 2: _tile_stored(2, ct, 64); break;
                                    default: _tile_stored(3, ct, 64); break;
                                }
                                TF_MEMBAR();
                                for (int64_t r = rb; r < M; r++) memcpy(yt + (r - rb) * N, ct[r - rb], 64);
                            }
                        }
                    TF_MEMBAR();
                }
            }
        }
        free(B);
        _tile_release();
    }
    free(xb);
}
#else
int64_t tf_amx_available(void) { return 0; }
int64_t tf_amx_bf16_available(void) { return 0; }
void tf_qbf16(float *y, const float *x, int64_t M, int64_t K, int64_t N, const void *q, const void *d,
              const void *m, int64_t gs, int64_t bits) {
    (void)y, (void)x, (void)M, (void)K, (void)N, (void)q, (void)d, (void)m, (void)gs, (void)bits;
}
#endif

/* y[M, N] = x[M, K] @ W^T from a qtile layout: AMX where the process may use it, else the reference. */
#ifdef TF_QTILE_AMX
__attribute__((target("amx-tile,amx-int8")))
#endif
void tf_qtile(float *y, const float *x, int64_t M, int64_t K, int64_t N, const void *q, const float *d,
              const float *m, int64_t gs, int64_t bits) {
    if (M <= 0) return;       /* a step that samples no row (a prefill chunk mid-prompt): a 0-row tile is a #GP */
#ifdef TF_QTILE_VNNI
    if (M <= TF_QTILE_VNNI_AUTO || !tf_amx_available()) {
        tf_qtile_vnni_run(y, x, M, K, N, q, d, m, gs, bits);
        return;
    }
#endif
#ifdef TF_QTILE_AMX
    if (!tf_amx_available()) {
        tf_qtile_ref(y, x, M, K, N, q, d, m, gs, bits);
        return;
    }
    if (M > TF_QTILE_ROWS) {
        for (int64_t r0 = 0; r0 < M; r0 += TF_QTILE_ROWS)
            tf_qtile(y + r0 * N, x + r0 * K, M - r0 < TF_QTILE_ROWS ? M - r0 : TF_QTILE_ROWS, K, N, q, d, m, gs, bits);
        return;
    }
    const int half = (bits & TF_QTILE_HALF) != 0;
    bits &= ~TF_QTILE_HALF;
    /* 9-16 rows run the kernel compiled for 12 or 16: pad with zero rows (their output is dropped) */
    const int64_t Mk = M <= 8 ? M : M <= 12 ? 12 : 16;
    const int64_t nb = K / 32, G = K / gs, r0 = Mk < 8 ? Mk : 8;
    int16_t *xq = (int16_t *)calloc((size_t)(Mk * K), sizeof(int16_t));
    float *dx = (float *)calloc((size_t)(Mk * nb), sizeof(float));
    float *xs = (float *)calloc((size_t)(Mk * G + 1), sizeof(float));
    int8_t *a = (int8_t *)aligned_alloc(64, (size_t)((nb * 2 * Mk * 32 + 63) / 64 * 64));
    float *yk = Mk == M ? y : (float *)malloc(sizeof(float) * (size_t)(Mk * N));
    tf_qtile_prep(x, M, K, gs, xq, dx, xs, NULL, NULL, 0);
    /* activation tiles per block: rows 0..r0-1's hi bytes, their lo bytes, then the same for rows r0.. */
    for (int64_t b = 0; b < nb; b++)
        for (int64_t r = 0; r < Mk; r++) {
            const int64_t first = r < r0 ? 0 : 2 * r0, nr = r < r0 ? r0 : Mk - r0, i = r < r0 ? r : r - r0;
            int8_t *hi = a + (b * 2 * Mk + first + i) * 32, *lo = a + (b * 2 * Mk + first + nr + i) * 32;
            for (int j = 0; j < 32; j++) {
                const int v = xq[r * K + b * 32 + j], h = (v + 128) >> 8;     /* floor: lo in [-128, 127] */
                hi[j] = (int8_t)h;
                lo[j] = (int8_t)(v - 256 * h);
            }
        }
    const int64_t ntiles = N / 16, tb = bits == 8 ? 512 : 256, es = half ? 2 : 4;
#pragma omp parallel if (ntiles >= 8)
    {
        tf_qtile_config(Mk);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < ntiles; t++) {
            const uint8_t *qt = (const uint8_t *)q + t * nb * tb;
            const char *dt = (const char *)d + t * 16 * G * es, *mt = bits == 4 ? (const char *)m + t * 16 * G * es : NULL;
            TF_QTILE_SWITCH(yk + t * 16, N, a, dx, xs, nb, G, qt, dt, mt, bits, gs / 32, half)
        }
        _tile_release();
    }
    if (yk != y) {
        memcpy(y, yk, sizeof(float) * (size_t)(M * N));
        free(yk);
    }
    free(xq);
    free(dx);
    free(xs);
    free(a);
#else
    tf_qtile_ref(y, x, M, K, N, q, d, m, gs, bits);
#endif
}
