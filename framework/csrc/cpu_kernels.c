/* speculant CPU kernels (fp32, x86-64 AVX2 + FMA), called by
 * speculant/models/cpu_kernels.py (Python bindings at the end). Built as the optional extension ``speculant._cpu_kernels``;
 * without it (no compiler, another CPU) the CPU path keeps numpy's / torch's BLAS.
 *
 * spec_gemm: y[T, out] = x[T, in] @ W^T (+ bias) for a Linear weight W [out, in] stored BLOCKED:
 * wb[nb][in][16], nb = ceil(out / 16), block b holding output columns 16b .. 16b + 15 (zero
 * padded), so each block is one sequential stream. BLAS kernels pack the weight for every call
 * with few rows (a decode step of a few sequences, a k+1 verification pass): on SmolLM2-135M
 * 2 rows took 1.6-2x, 6 rows 2.2-2.6x the time of 1 row. Here every weight element is loaded from
 * memory once and used for all rows of a tile (up to 6 rows; further tiles re-read the block from
 * L1/L2), so a pass over T <= 6 rows costs about what one row does until the FMA units saturate.
 *
 * Every output y[t, j] is the same FMA chain for every T and tiling: acc = 0; for i in 0..in-1:
 * acc = fma(x[t, i], W[j, i], acc); y = acc (+ bias[j]). A row's result therefore does not depend
 * on the other rows of the call (batch invariance): a verification pass computes the same Linear
 * outputs for its rows as one-token decode steps would.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#define BW 16 /* output columns per weight block (two 8-float vectors) */
#define TARGET __attribute__((target("avx2,fma")))

/* R rows x NB consecutive blocks; x: [R, ldx], w: first block [NB][in][16], y: [R, ldy] starting
 * at the first block's first column; ncols: valid columns from there (the rest is padding). */
#define DEFINE_TILE(R, NB)                                                                        \
    static TARGET void tile_##R##_##NB(const float *restrict x, long ldx,                         \
                                       const float *restrict w, long in,                          \
                                       const float *restrict bias, float *restrict y, long ldy,   \
                                       long ncols) {                                              \
        __m256 acc[R][NB][2];                                                                     \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                      \
            _Pragma("GCC unroll 8") for (int b = 0; b < NB; b++) {                               \
                acc[r][b][0] = _mm256_setzero_ps();                                               \
                acc[r][b][1] = _mm256_setzero_ps();                                               \
            }                                                                                     \
        const long bs = in * BW;                                                                  \
        for (long i = 0; i < in; i++) {                                                           \
            __m256 w0[NB], w1[NB];                                                                \
            if (NB <= 2) /* one or two streams: prefetch 2 KiB ahead (four need none) */       \
                _Pragma("GCC unroll 2") for (int b = 0; b < NB; b++)                             \
                    _mm_prefetch((const char *)(w + b * bs + i * BW + 512), _MM_HINT_T0);         \
            _Pragma("GCC unroll 8") for (int b = 0; b < NB; b++) {                               \
                w0[b] = _mm256_loadu_ps(w + b * bs + i * BW);                                     \
                w1[b] = _mm256_loadu_ps(w + b * bs + i * BW + 8);                                 \
            }                                                                                     \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                \
                const __m256 xv = _mm256_broadcast_ss(x + r * ldx + i);                           \
                _Pragma("GCC unroll 8") for (int b = 0; b < NB; b++) {                           \
                    acc[r][b][0] = _mm256_fmadd_ps(xv, w0[b], acc[r][b][0]);                      \
                    acc[r][b][1] = _mm256_fmadd_ps(xv, w1[b], acc[r][b][1]);                      \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        _Pragma("GCC unroll 8") for (int b = 0; b < NB; b++) {                                   \
            __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();                            \
            long c = (long)b * BW, n = ncols - c < BW ? ncols - c : BW;                           \
            if (bias && n == BW) {                                                                \
                b0 = _mm256_loadu_ps(bias + c);                                                   \
                b1 = _mm256_loadu_ps(bias + c + 8);                                               \
            }                                                                                     \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                \
                float *dst = y + r * ldy + c;                                                     \
                if (n == BW) {                                                                    \
                    _mm256_storeu_ps(dst, bias ? _mm256_add_ps(acc[r][b][0], b0) : acc[r][b][0]); \
                    _mm256_storeu_ps(dst + 8,                                                     \
                                     bias ? _mm256_add_ps(acc[r][b][1], b1) : acc[r][b][1]);      \
                } else if (n > 0) { /* the last, padded block */                                  \
                    float tmp[BW];                                                                \
                    _mm256_storeu_ps(tmp, acc[r][b][0]);                                          \
                    _mm256_storeu_ps(tmp + 8, acc[r][b][1]);                                      \
                    for (long j = 0; j < n; j++) dst[j] = bias ? tmp[j] + bias[c + j] : tmp[j];   \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }

DEFINE_TILE(1, 4)
DEFINE_TILE(1, 1)
DEFINE_TILE(2, 2)
DEFINE_TILE(2, 1)
DEFINE_TILE(3, 2)
DEFINE_TILE(3, 1)
DEFINE_TILE(4, 1)
DEFINE_TILE(5, 1)
DEFINE_TILE(6, 1)

typedef void (*tile_fn)(const float *, long, const float *, long, const float *, float *, long,
                        long);

/* The unit of work of spec_gemm: g consecutive blocks (g = units_of(T)), all T rows. Few rows
 * read several blocks at once (enough FMA chains in flight); 4+ rows one block. */
static long unit_blocks(long T) { return T == 1 ? 4 : T <= 3 ? 2 : 1; }

/* Unit u of y[T, out] = x @ W^T (+ bias): its columns 16 g u .. written to y (row stride ldy),
 * y pointing at the unit's first column. */
static TARGET void gemm_unit(const float *x, long T, long ldx, const float *wb, long in, long out,
                             const float *bias, float *y, long ldy, long u, long g) {
    static const tile_fn rows[7] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1};
    const long nb = (out + BW - 1) / BW, bs = in * BW, b0 = u * g;
    const long n = nb - b0 < g ? nb - b0 : g;
    if (n == g && g > 1) { /* a whole group of few-row blocks */
        const float *w = wb + b0 * bs, *bb = bias ? bias + b0 * BW : NULL;
        const long nc = out - b0 * BW;
        if (T == 1) tile_1_4(x, ldx, w, in, bb, y, ldy, nc);
        else if (T == 2) tile_2_2(x, ldx, w, in, bb, y, ldy, nc);
        else tile_3_2(x, ldx, w, in, bb, y, ldy, nc);
        return;
    }
    for (long b = b0; b < b0 + n; b++) /* block-major: a block is read from memory once for all row tiles */
        for (long t = 0; t < T; t += 6) {
            const long r = T - t < 6 ? T - t : 6;
            rows[r](x + t * ldx, ldx, wb + b * bs, in, bias ? bias + b * BW : NULL,
                    y + t * ldy + (b - b0) * BW, ldy, out - b * BW);
        }
}

/* ---- A second core for every product (set_threads(2)) ----
 * Measured on a 2-core EPYC VM (docs/perf.md, "CPU"): one core streams a one-row product at
 * ~18.5 GB/s, two cores at ~24.8 (a one-row pass over SmolLM2-135M's weights: 29.0 -> 21.7 ms),
 * and with 5 rows one core's FMAs and loads do not overlap (1.5-1.8x the one-row time on one
 * thread). So the caller and a helper thread share the units of every product of at least
 * MIN_SHARED multiply-adds, one row included. Design rules, so that a busy or descheduled
 * helper never costs more than the work it holds (with both cores busy elsewhere, products
 * took what they take on one thread):
 * - units are claimed one at a time from one atomic word (epoch << 32 | next unit), by the caller
 *   and by the helper; the caller never waits for the helper to start;
 * - the helper reads only memory owned here (a copy of x) and the weights, and writes its units
 *   to its own scratch; the caller alone writes y, copying a helper's unit once it is marked done
 *   for this call (done[u] == epoch);
 * - a unit the helper claimed but has not finished after about the time the caller took per
 *   unit is computed again by the caller (the same FMA chains, so the same bits); a late helper
 *   then writes only scratch of a finished call, and its next claim fails on the epoch;
 * - after a call the helper polls for the next one for HELPER_SPIN_NS (200 us), then sleeps on
 *   a futex: a forward's products follow each other within tens of microseconds, so the helper
 *   is awake at each one's start (a futex wake-up takes ~10-50 us; with 256 pauses of polling,
 *   as first built, it slept between most products and a plain decode step ran at 27-30 tok/s
 *   against 32-39 now), and between requests it takes no CPU from other processes;
 * - a late helper may still read a finished call's weights: quiesce() waits until it holds no
 *   unit, and models/cpu_kernels.py calls it before a blocked weight is freed.
 * The outputs are those of the one-thread path bit for bit (each output's FMA chain is the same
 * whoever computes it). */
#define MAX_UNITS 8192
#define XCAP (4L << 20)  /* floats of x the helper can take (T * in): 16 MiB */
#define SCAP (8L << 20)  /* floats of helper output (units * T * 16 g): 32 MiB */
#define MIN_SHARED (1L << 18) /* multiply-adds (T * in * out) below which a product runs alone:
                               * sharing its few blocks costs more than it saves */
#define HELPER_SPIN_NS 200000L /* how long the helper polls for the next call before it sleeps */

typedef struct {
    const float *wb, *bias;
    long T, in, out, nu, g;
    uint32_t e; /* the call's epoch */
} Job;
static Job job;                /* written by the caller before the epoch, under job_seq */
static _Atomic uint32_t job_seq; /* a seqlock: odd while the caller writes job */
static _Atomic uint64_t claim;                   /* epoch << 32 | next unit */
static _Atomic uint32_t epoch, done[MAX_UNITS];  /* done[u]: the epoch whose unit u is in scratch */
static _Atomic int pool_threads = 1, helper_sleeping, pool_busy;
static int helper_running;
static _Atomic long helper_units, redone_units, helper_delay_ns; /* stats; a test's delay */
static _Atomic int helper_active; /* set while the helper may read a call's weights */
static float *xbuf, *scratch;

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* one unit from the shared word, or -1 once the call's units are all taken (or the call is over) */
static long claim_unit(uint32_t e, long nu) {
    uint64_t c = atomic_load_explicit(&claim, memory_order_acquire);
    while ((uint32_t)(c >> 32) == e && (long)(c & 0xffffffffu) < nu)
        if (atomic_compare_exchange_weak_explicit(&claim, &c, c + 1, memory_order_acq_rel,
                                                  memory_order_acquire))
            return (long)(c & 0xffffffffu);
    return -1;
}

static void *helper_main(void *arg) {
    (void)arg;
    uint32_t seen = atomic_load(&epoch);
    for (;;) {
        uint32_t e;
        long t0 = -1;
        for (int n = 0; (e = atomic_load_explicit(&epoch, memory_order_acquire)) == seen; n++) {
            if (n % 32) {
                __builtin_ia32_pause();
                continue;
            }
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            const long now = ts.tv_sec * 1000000000L + ts.tv_nsec;
            if (t0 < 0) t0 = now;
            if (now - t0 < HELPER_SPIN_NS) {
                __builtin_ia32_pause();
                continue;
            }
            atomic_store(&helper_sleeping, 1); /* then the caller's epoch store is seen, or it wakes us */
            while ((e = atomic_load(&epoch)) == seen)
                syscall(SYS_futex, &epoch, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            atomic_store(&helper_sleeping, 0);
            break;
        }
        seen = e;
        atomic_store(&helper_active, 1); /* before its claims: quiesce() sees it (or no claim) */
        Job j;
        uint32_t s0;
        do { /* a consistent copy: never one torn by the next call being posted */
            s0 = atomic_load_explicit(&job_seq, memory_order_acquire);
            j = job;
            atomic_thread_fence(memory_order_acquire);
        } while ((s0 & 1) || s0 != atomic_load_explicit(&job_seq, memory_order_relaxed));
        if (j.e != e) j.nu = 0; /* a newer call's job: call e is over, claim nothing */
        const long ly = j.T * j.g * BW;
        long u;
        while ((u = claim_unit(e, j.nu)) >= 0) {
            const long d = atomic_load_explicit(&helper_delay_ns, memory_order_relaxed);
            if (d) { /* tests: a helper descheduled while it holds a unit */
                const struct timespec ts = {d / 1000000000L, d % 1000000000L};
                nanosleep(&ts, NULL);
            }
            gemm_unit(xbuf, j.T, j.in, j.wb, j.in, j.out, j.bias, scratch + u * ly,
                      j.g * BW, u, j.g);
            atomic_store_explicit(&done[u], e, memory_order_release);
            atomic_fetch_add_explicit(&helper_units, 1, memory_order_relaxed);
        }
        atomic_store(&helper_active, 0);
    }
    return NULL;
}

static void pool_after_fork(void) { /* the child has no helper thread */
    helper_running = 0;
    atomic_store(&pool_threads, 1);
    atomic_store(&pool_busy, 0);
    atomic_store(&helper_active, 0);
    atomic_store(&helper_sleeping, 0);
}

static int pool_set_threads(int n) {
    if (n >= 2 && !helper_running) {
        if (!xbuf) xbuf = malloc(XCAP * sizeof(float)); /* pages are touched on first use */
        if (!scratch) scratch = malloc(SCAP * sizeof(float));
        pthread_t t;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        if (xbuf && scratch && pthread_create(&t, &a, helper_main, NULL) == 0) {
            helper_running = 1;
            static int registered;
            if (!registered) registered = !pthread_atfork(NULL, NULL, pool_after_fork);
        }
        pthread_attr_destroy(&a);
    }
    atomic_store(&pool_threads, n >= 2 && helper_running ? 2 : 1);
    return atomic_load(&pool_threads);
}

/* x: [T, ldx] (row stride ldx >= in), wb: [nb][in][16], bias: [out] or NULL, y: [T, ldy]. */
static TARGET void spec_gemm(const float *x, long T, long ldx, const float *wb, long in, long out,
                             const float *bias, float *y, long ldy) {
    if (T <= 0) return; /* no rows: nothing to write (the tiles assume T >= 1) */
    const long g = unit_blocks(T), nb = (out + BW - 1) / BW, nu = (nb + g - 1) / g;
    const long ly = T * g * BW;
    int expected = 0;
    if (nu < 2 || T * in * out < MIN_SHARED || nu > MAX_UNITS || T * in > XCAP || nu * ly > SCAP ||
        atomic_load_explicit(&pool_threads, memory_order_relaxed) < 2 ||
        !atomic_compare_exchange_strong(&pool_busy, &expected, 1)) { /* one thread */
        for (long u = 0; u < nu; u++)
            gemm_unit(x, T, ldx, wb, in, out, bias, y + u * g * BW, ldy, u, g);
        return;
    }
    for (long t = 0; t < T; t++) memcpy(xbuf + t * in, x + t * ldx, in * sizeof(float));
    uint32_t e = atomic_load(&epoch) + 1;
    if (e == 0) { /* wrapped: no stale done[] may equal a new epoch */
        for (long i = 0; i < MAX_UNITS; i++) atomic_store(&done[i], 0);
        e = 1;
    }
    atomic_fetch_add_explicit(&job_seq, 1, memory_order_relaxed); /* odd: writing */
    atomic_thread_fence(memory_order_release);
    job = (Job){wb, bias, T, in, out, nu, g, e};
    atomic_fetch_add_explicit(&job_seq, 1, memory_order_release); /* even: written */
    atomic_store(&claim, (uint64_t)e << 32);
    atomic_store(&epoch, e);
    if (atomic_load(&helper_sleeping)) syscall(SYS_futex, &epoch, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    static unsigned char mine[MAX_UNITS];
    memset(mine, 0, nu);
    long u, own = 0;
    const long t0 = now_ns();
    while ((u = claim_unit(e, nu)) >= 0) {
        gemm_unit(x, T, ldx, wb, in, out, bias, y + u * g * BW, ldy, u, g);
        mine[u] = 1;
        own++;
    }
    /* the helper holds at most one unit by now: wait for it about as long as a unit takes */
    const long t1 = now_ns(), deadline = t1 + (own ? (t1 - t0) / own : 0) + 2000;
    for (u = 0; u < nu; u++) {
        if (mine[u]) continue;
        while (atomic_load_explicit(&done[u], memory_order_acquire) != e && now_ns() < deadline)
            __builtin_ia32_pause();
        const long c0 = u * g * BW, nc = out - c0 < g * BW ? out - c0 : g * BW;
        if (atomic_load_explicit(&done[u], memory_order_acquire) == e) {
            const float *s = scratch + u * ly;
            for (long t = 0; t < T; t++) memcpy(y + t * ldy + c0, s + t * g * BW, nc * sizeof(float));
        } else { /* the helper is late (descheduled): the same unit here, the same bits */
            gemm_unit(x, T, ldx, wb, in, out, bias, y + c0, ldy, u, g);
            atomic_fetch_add_explicit(&redone_units, 1, memory_order_relaxed);
        }
    }
    atomic_store(&pool_busy, 0);
}

/* One sequence's attention for T query rows (T new tokens at positions ctx_len - T ..
 * ctx_len - 1, their K/V already in the cache): row j attends to keys 0 .. ctx_len - T + j.
 * q, o: [T, nh * d] (row strides ldq, ldo); k, v: [ctx_len, nkv * d] (row stride ldkv), query
 * head h reading KV head h / (nh / nkv). Row j's output depends only on its own q row and its
 * own causal prefix (batch invariance: the same as a one-row call at that position). */
static inline TARGET __m256 exp256(__m256 x) { /* exp(x) for x <= 0, ~1 ulp (Cephes-style) */
    const __m256 lo = _mm256_set1_ps(-87.33654f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ); /* exp underflows (or -inf): 0 */
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

static inline TARGET float hsum256(__m256 v) { /* fixed order: (0+4, 1+5, ...) pairs, then halves */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* hsum256 of each of a[0 .. 7] as lane r of the result, with the same additions in the same
 * order (so the same bits): lo + hi halves, then lanes (0 + 2) and (1 + 3), then those two. */
static inline TARGET __m256 hsum256x8(const __m256 *a) {
    __m256 t[4];
    for (int i = 0; i < 4; i++) /* [a lo + a hi | b lo + b hi] for (a, b) = (a[2i], a[2i + 1]) */
        t[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
    const __m256 x0 = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], 0x44),  /* (s0 + s2, s1 + s3) */
                                    _mm256_shuffle_ps(t[0], t[1], 0xEE)); /* of a0 a2 | a1 a3 */
    const __m256 x1 = _mm256_add_ps(_mm256_shuffle_ps(t[2], t[3], 0x44),
                                    _mm256_shuffle_ps(t[2], t[3], 0xEE)); /* a4 a6 | a5 a7 */
    const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(x0, x1, 0x88),  /* a0 a2 a4 a6 | a1 a3 a5 a7 */
                                   _mm256_shuffle_ps(x0, x1, 0xDD));
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static inline TARGET float hmax256(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* out[0 .. 8W) = inv * sum over c < cl of p[c] * v[c * ldkv + 0 .. 8W): one FMA chain per output
 * column over c in order (W vectors of accumulators in registers), whatever W covers it. */
#define DEFINE_PV(W)                                                                              \
    static inline TARGET void pv_##W(const float *p, const float *v, long ldkv, long cl,         \
                                     __m256 iv, float *out) {                                     \
        __m256 acc[W];                                                                            \
        _Pragma("GCC unroll 8") for (int e = 0; e < W; e++) acc[e] = _mm256_setzero_ps();        \
        for (long c = 0; c < cl; c++) {                                                           \
            const __m256 pc = _mm256_broadcast_ss(p + c);                                         \
            const float *vc = v + c * ldkv;                                                       \
            _Pragma("GCC unroll 8") for (int e = 0; e < W; e++)                                  \
                acc[e] = _mm256_fmadd_ps(pc, _mm256_loadu_ps(vc + 8 * e), acc[e]);               \
        }                                                                                         \
        _Pragma("GCC unroll 8") for (int e = 0; e < W; e++)                                      \
            _mm256_storeu_ps(out + 8 * e, _mm256_mul_ps(acc[e], iv));                             \
    }

DEFINE_PV(8)
DEFINE_PV(4)
DEFINE_PV(2)
DEFINE_PV(1)

/* d % 8 == 0, d <= 512; work: [ctx_len + 8] floats */
static TARGET void attend(const float *q, long T, long ldq, const float *k, const float *v,
                          long ldkv, long ctx_len, long nh, long nkv, long d, float scale,
                          float *o, long ldo, float *work) {
    const long g = nh / nkv;
    for (long j = 0; j < T; j++) {
        const long cl = ctx_len - T + j + 1;
        for (long h = 0; h < nh; h++) {
            const float *qh = q + j * ldq + h * d;
            const long off = (h / g) * d;
            /* scores */
            __m256 mx = _mm256_set1_ps(-INFINITY);
            long c = 0;
            for (; c + 8 <= cl; c += 8) { /* 8 keys at once, their 8 sums as hsum256's in one go */
                const float *k0 = k + c * ldkv + off;
                __m256 a[8];
                _Pragma("GCC unroll 8") for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
                for (long e = 0; e < d; e += 8) {
                    const __m256 qe = _mm256_loadu_ps(qh + e);
                    _Pragma("GCC unroll 8") for (int r = 0; r < 8; r++)
                        a[r] = _mm256_fmadd_ps(qe, _mm256_loadu_ps(k0 + r * ldkv + e), a[r]);
                }
                _mm256_storeu_ps(work + c, _mm256_mul_ps(hsum256x8(a), _mm256_set1_ps(scale)));
            }
            for (; c + 4 <= cl; c += 4) { /* 4 keys at once: independent chains, same order */
                const float *k0 = k + c * ldkv + off;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (long e = 0; e < d; e += 8) {
                    const __m256 qe = _mm256_loadu_ps(qh + e);
                    a0 = _mm256_fmadd_ps(qe, _mm256_loadu_ps(k0 + e), a0);
                    a1 = _mm256_fmadd_ps(qe, _mm256_loadu_ps(k0 + ldkv + e), a1);
                    a2 = _mm256_fmadd_ps(qe, _mm256_loadu_ps(k0 + 2 * ldkv + e), a2);
                    a3 = _mm256_fmadd_ps(qe, _mm256_loadu_ps(k0 + 3 * ldkv + e), a3);
                }
                work[c] = hsum256(a0) * scale;
                work[c + 1] = hsum256(a1) * scale;
                work[c + 2] = hsum256(a2) * scale;
                work[c + 3] = hsum256(a3) * scale;
            }
            for (; c < cl; c++) {
                const float *kc = k + c * ldkv + off;
                __m256 acc = _mm256_setzero_ps();
                for (long e = 0; e < d; e += 8)
                    acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + e), _mm256_loadu_ps(kc + e), acc);
                work[c] = hsum256(acc) * scale;
            }
            for (long c = cl; c < ((cl + 7) & ~7L); c++) work[c] = -INFINITY;
            for (long c = 0; c < cl; c += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(work + c));
            const __m256 m = _mm256_set1_ps(hmax256(mx));
            __m256 sum = _mm256_setzero_ps();
            for (long c = 0; c < cl; c += 8) { /* padding lanes: exp(-inf - m) = 0 */
                __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(work + c), m));
                _mm256_storeu_ps(work + c, p);
                sum = _mm256_add_ps(sum, p);
            }
            const float inv = 1.0f / hsum256(sum);
            /* weighted sum of V, 64 / 32 / 16 / 8 output columns at a time in registers */
            const __m256 iv = _mm256_set1_ps(inv);
            const float *vh = v + off;
            float *oh = o + j * ldo + h * d;
            long e = 0;
            for (; e + 64 <= d; e += 64) pv_8(work, vh + e, ldkv, cl, iv, oh + e);
            if (e + 32 <= d) pv_4(work, vh + e, ldkv, cl, iv, oh + e), e += 32;
            if (e + 16 <= d) pv_2(work, vh + e, ldkv, cl, iv, oh + e), e += 16;
            if (e + 8 <= d) pv_1(work, vh + e, ldkv, cl, iv, oh + e);
        }
    }
}

/* y[T, n] = x * rsqrt(mean(x^2) + eps) * w, row by row (sum of squares in a fixed order) */
static TARGET void rms_norm(const float *x, long T, long ldx, long n, const float *w, float eps,
                            float *y, long ldy) {
    for (long t = 0; t < T; t++) {
        const float *xr = x + t * ldx;
        float *yr = y + t * ldy;
        __m256 acc = _mm256_setzero_ps();
        long i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256 a = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(a, a, acc);
        }
        float ss = hsum256(acc);
        for (; i < n; i++) ss += xr[i] * xr[i];
        const float r = 1.0f / sqrtf(ss / (float)n + eps);
        for (i = 0; i < n; i++) yr[i] = (xr[i] * r) * w[i];
    }
}

/* 1 if this CPU runs the kernels above (AVX2 and FMA). */
static int cpu_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* ---- Python bindings: numpy arrays through the buffer protocol, shapes checked here ---- */

static int get_f32(PyObject *obj, Py_buffer *b, int ndim, int writable, const char *name) {
    int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, b, flags) < 0) return -1;
    if (b->ndim != ndim || b->itemsize != 4 || !b->format || strcmp(b->format, "f") != 0 ||
        b->strides[ndim - 1] != 4 || (ndim > 1 && b->strides[0] % 4)) {
        PyErr_Format(PyExc_ValueError,
                     "%s must be a %d-D float32 array with unit stride along its last axis", name,
                     ndim);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

/* gemm(x [T, in], wb [nb, in, 16] C-contiguous, bias [out] or None, y [T, out]) */
static PyObject *py_gemm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) return PyErr_Format(PyExc_TypeError, "gemm(x, wb, bias, y)");
    Py_buffer x, wb, bias, y;
    int has_bias = args[2] != Py_None;
    if (get_f32(args[0], &x, 2, 0, "x") < 0) return NULL;
    if (get_f32(args[1], &wb, 3, 0, "wb") < 0) goto e1;
    if (has_bias && get_f32(args[2], &bias, 1, 0, "bias") < 0) goto e2;
    if (get_f32(args[3], &y, 2, 1, "y") < 0) goto e3;
    const long T = x.shape[0], in = x.shape[1], out = y.shape[1];
    if (wb.shape[1] != in || wb.shape[2] != BW || wb.strides[1] != BW * 4 ||
        wb.strides[0] != in * BW * 4 || wb.shape[0] != (out + BW - 1) / BW || y.shape[0] != T ||
        (has_bias && bias.shape[0] != out)) {
        PyErr_Format(PyExc_ValueError,
                     "gemm: shapes do not match: x [%ld, %ld], wb [%ld, %ld, %ld] (contiguous), "
                     "y [%ld, %ld]%s",
                     T, in, (long)wb.shape[0], (long)wb.shape[1], (long)wb.shape[2],
                     (long)y.shape[0], out, has_bias ? ", bias [out]" : "");
        goto e4;
    }
    Py_BEGIN_ALLOW_THREADS
    spec_gemm(x.buf, T, x.strides[0] / 4, wb.buf, in, out, has_bias ? bias.buf : NULL, y.buf,
              y.strides[0] / 4);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&y);
    if (has_bias) PyBuffer_Release(&bias);
    PyBuffer_Release(&wb);
    PyBuffer_Release(&x);
    Py_RETURN_NONE;
e4:
    PyBuffer_Release(&y);
e3:
    if (has_bias) PyBuffer_Release(&bias);
e2:
    PyBuffer_Release(&wb);
e1:
    PyBuffer_Release(&x);
    return NULL;
}

/* attend(q [T, nh*d], k [ctx, nkv*d], v [ctx, nkv*d], nh, nkv, scale, o [T, nh*d]) */
static PyObject *py_attend(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) return PyErr_Format(PyExc_TypeError, "attend(q, k, v, nh, nkv, scale, o)");
    const long nh = PyLong_AsLong(args[3]), nkv = PyLong_AsLong(args[4]);
    const float scale = (float)PyFloat_AsDouble(args[5]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer q, k, v, o;
    PyObject *res = NULL;
    if (get_f32(args[0], &q, 2, 0, "q") < 0) return NULL;
    if (get_f32(args[1], &k, 2, 0, "k") < 0) goto a1;
    if (get_f32(args[2], &v, 2, 0, "v") < 0) goto a2;
    if (get_f32(args[6], &o, 2, 1, "o") < 0) goto a3;
    const long T = q.shape[0], ctx = k.shape[0];
    const long d = nh > 0 ? q.shape[1] / nh : 0;
    if (nh <= 0 || nkv <= 0 || nh % nkv || q.shape[1] != nh * d || d % 8 || d > 512 ||
        k.shape[1] != nkv * d || v.shape[0] != ctx || v.shape[1] != nkv * d ||
        k.strides[0] != v.strides[0] || o.shape[0] != T || o.shape[1] != nh * d || T > ctx) {
        PyErr_Format(PyExc_ValueError,
                     "attend: shapes do not match: q [%ld, %ld], k/v [%ld, %ld] (same row stride), "
                     "o [%ld, %ld], nh %ld, nkv %ld (head_dim a multiple of 8, <= 512, T <= ctx)",
                     T, (long)q.shape[1], ctx, (long)k.shape[1], (long)o.shape[0],
                     (long)o.shape[1], nh, nkv);
        goto a4;
    }
    float *work = PyMem_RawMalloc((ctx + 8) * sizeof(float));
    if (!work) {
        PyErr_NoMemory();
        goto a4;
    }
    Py_BEGIN_ALLOW_THREADS
    attend(q.buf, T, q.strides[0] / 4, k.buf, v.buf, k.strides[0] / 4, ctx, nh, nkv, d, scale,
           o.buf, o.strides[0] / 4, work);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(work);
    res = Py_None;
    Py_INCREF(res);
a4:
    PyBuffer_Release(&o);
a3:
    PyBuffer_Release(&v);
a2:
    PyBuffer_Release(&k);
a1:
    PyBuffer_Release(&q);
    return res;
}

/* rms_norm(x [T, n], w [n], eps, y [T, n]) */
static PyObject *py_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) return PyErr_Format(PyExc_TypeError, "rms_norm(x, w, eps, y)");
    const float eps = (float)PyFloat_AsDouble(args[2]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer x, w, y;
    PyObject *res = NULL;
    if (get_f32(args[0], &x, 2, 0, "x") < 0) return NULL;
    if (get_f32(args[1], &w, 1, 0, "w") < 0) goto r1;
    if (get_f32(args[3], &y, 2, 1, "y") < 0) goto r2;
    if (w.shape[0] != x.shape[1] || y.shape[0] != x.shape[0] || y.shape[1] != x.shape[1]) {
        PyErr_Format(PyExc_ValueError, "rms_norm: x [%ld, %ld], w [%ld], y [%ld, %ld]",
                     (long)x.shape[0], (long)x.shape[1], (long)w.shape[0], (long)y.shape[0],
                     (long)y.shape[1]);
        goto r3;
    }
    rms_norm(x.buf, x.shape[0], x.strides[0] / 4, x.shape[1], w.buf, eps, y.buf, y.strides[0] / 4);
    res = Py_None;
    Py_INCREF(res);
r3:
    PyBuffer_Release(&y);
r2:
    PyBuffer_Release(&w);
r1:
    PyBuffer_Release(&x);
    return res;
}

static PyObject *py_set_threads(PyObject *self, PyObject *arg) {
    const long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1) return PyErr_Format(PyExc_ValueError, "set_threads(%ld): the count must be >= 1", n);
    return PyLong_FromLong(pool_set_threads((int)n));
}

/* quiesce(): returns once the helper holds no unit, so weights may be freed: a helper that was
 * descheduled while holding a unit of a finished call still reads that call's weights. */
static PyObject *py_quiesce(PyObject *self, PyObject *unused) {
    Py_BEGIN_ALLOW_THREADS
    while (atomic_load(&helper_active)) sched_yield();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_get_threads(PyObject *self, PyObject *unused) {
    return PyLong_FromLong(atomic_load(&pool_threads));
}

/* _helper_stats(): (units the helper computed, units the caller redid); _helper_delay(ns): the
 * helper sleeps ns after each claim (tests of a late helper) */
static PyObject *py_helper_stats(PyObject *self, PyObject *unused) {
    return Py_BuildValue("(ll)", atomic_load(&helper_units), atomic_load(&redone_units));
}

static PyObject *py_helper_delay(PyObject *self, PyObject *arg) {
    const long ns = PyLong_AsLong(arg);
    if (ns == -1 && PyErr_Occurred()) return NULL;
    atomic_store(&helper_delay_ns, ns < 0 ? 0 : ns);
    Py_RETURN_NONE;
}

static PyObject *py_supported(PyObject *self, PyObject *unused) {
    return PyBool_FromLong(cpu_supported());
}

static PyMethodDef methods[] = {
    {"gemm", (PyCFunction)(void (*)(void))py_gemm, METH_FASTCALL,
     "gemm(x, wb, bias, y): y = x @ W.T (+ bias) on the blocked weight wb"},
    {"attend", (PyCFunction)(void (*)(void))py_attend, METH_FASTCALL,
     "attend(q, k, v, nh, nkv, scale, o): causal GQA attention of one sequence's last T rows"},
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_FASTCALL,
     "rms_norm(x, w, eps, y): RMSNorm row by row"},
    {"set_threads", py_set_threads, METH_O,
     "set_threads(n): 2 lets a helper thread take half of every product, 1 stops "
     "it; returns the count in force"},
    {"quiesce", py_quiesce, METH_NOARGS,
     "quiesce(): wait until the helper thread holds no unit (before weights are freed)"},
    {"get_threads", py_get_threads, METH_NOARGS,
     "get_threads(): the count in force (1 in a child forked after set_threads(2))"},
    {"_helper_stats", py_helper_stats, METH_NOARGS,
     "_helper_stats(): (units computed by the helper, units the caller redid for a late helper)"},
    {"_helper_delay", py_helper_delay, METH_O,
     "_helper_delay(ns): the helper sleeps ns after each claim (tests of a late helper)"},
    {"supported", py_supported, METH_NOARGS, "True if this CPU has AVX2 and FMA"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_kernels",
                                    "speculant CPU kernels (fp32, AVX2 + FMA)", -1, methods};

PyMODINIT_FUNC PyInit__cpu_kernels(void) { return PyModule_Create(&module); }
