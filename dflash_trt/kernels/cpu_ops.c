/* CPU kernels for the decode step of this project's runtime: the small per-layer operations that cost more in
 * torch's per-op dispatch than in arithmetic at decode sizes (benchmarks/bench_cpu_ops.py). Built on first use by
 * dflash_trt/kernels/cpu_ops.py with the machine's C compiler; torch ops stand in when there is none. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
#define HAVE_AVX2_LINEAR 1 /* widened-fp32 linears (AVX-512F: Skylake, Cascade Lake, 16 lanes; else 8), attention */
#endif
#if defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#endif

/* Longest run of queries that share a cache row and therefore their keys and values in decode_attention (a verify
 * block, a drafter block, a prompt chunk); without a window each sees a prefix of the same keys. */
#define MAX_QUERY_RUN 16
/* Row-wise kernels (norms, rotary, residual adds) split their rows over the threads from this many rows on: below,
 * the fork and join cost more than the rows (a decode or verify step's). */
#define PARALLEL_MIN_ROWS 16

typedef union {
    uint32_t u;
    float f;
} bits32;

/* An off switch in the environment: 0, false, no or off, in any case (as kernels/cpu_ops.py reads its own). */
static int switched_off(const char *name) {
    const char *v = getenv(name);
    return v && (!strcmp(v, "0") || !strcasecmp(v, "false") || !strcasecmp(v, "no") || !strcasecmp(v, "off"));
}

static inline float bf16_to_f32(uint16_t h) {
    bits32 b = {.u = (uint32_t)h << 16};
    return b.f;
}

/* Round to nearest even, as torch's float -> bfloat16 conversion does (NaN kept quiet). */
static inline uint16_t f32_to_bf16(float f) {
    const uint32_t u = ((bits32){.f = f}).u;
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    /* a select, not a branch: loops that store bf16 stay vectorisable */
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

/* exp for x <= 0 (softmax after subtracting the max) in a form the compiler vectorises: Cephes' expf polynomial,
 * ~1 ulp; below -87 it returns 0 like expf's underflow. */
static inline float exp_nonpositive(float x) {
    const float lo = -87.33654475f;
    float under = x < lo ? 0.0f : 1.0f;
    x = x < lo ? lo : x;
    /* k = round(x / ln 2) by the 1.5 * 2^23 trick: floorf would keep the loop scalar */
    float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    const float two_k = ((bits32){.u = (uint32_t)((int32_t)k + 127) << 23}).f;
    return y * two_k * under;
}

#if defined(__AVX512BF16__)
/* Sixteen horizontal sums at once: lane t of the result is _mm512_reduce_add_ps(v[t]) bit for bit (the same pairs
 * added in the same order: lane i + i+8, then i + i+4, i + i+2, i + i+1), for about a third of the shuffles of
 * sixteen separate reductions, which dominated the scores at decode sizes. */
static inline __m512 reduce_add_x16(const __m512 v[16]) {
    __m512 u[8], w[4], x[2];
    for (int i = 0; i < 8; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0xEE));
    const __m512 y = _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], 0x88), _mm512_shuffle_ps(x[0], x[1], 0xDD));
    /* y holds the sum of v[m + 4 c] in lane 4 m + c */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), y);
}

/* Sixteen bf16 values widened to fp32 (exact). */
static inline __m512 bf16x16_to_f32(const uint16_t *src) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16));
}
#endif

#if defined(HAVE_AVX2_LINEAR)
/* Attention without AVX512-BF16 (AVX2 laptops, Skylake): bf16 keys and values widened to fp32 (exact) and
 * multiplied in fused multiply-adds, eight lanes at a time. */

/* Eight bf16 values widened to fp32, in order. */
static inline __m256 bf16x8_to_f32(const uint16_t *src) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src)), 16));
}

/* The sum of the eight lanes: lane i + i+4, then i + i+2, then i + i+1. */
static inline float hsum_x8(__m256 v) {
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

/* The largest of the eight lanes (finite values: max is exact in any order). */
static inline float hmax_x8(__m256 v) {
    const __m128 four = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 two = _mm_max_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_max_ss(two, _mm_movehdup_ps(two)));
}

/* Eight horizontal sums at once: lane t of the result is hsum_x8(v[t]) bit for bit (the same pairs added in the
 * same order), so a key's score is the same whether it falls in a block of eight or in the tail. */
static inline __m256 reduce_add_x8(const __m256 v[8]) {
    __m256 u[4], w[2];
    for (int i = 0; i < 4; i++) /* low half: v[2i]'s lanes j + j+4; high half: v[2i+1]'s */
        u[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++) /* per half: lanes 0 + 2 and 1 + 3 of two of those */
        w[i] = _mm256_add_ps(_mm256_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                             _mm256_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
    /* x holds v[0], v[2], v[4], v[6]'s sums in the low half, v[1], v[3], v[5], v[7]'s in the high */
    const __m256 x = _mm256_add_ps(_mm256_shuffle_ps(w[0], w[1], 0x88), _mm256_shuffle_ps(w[0], w[1], 0xDD));
    return _mm256_permutevar8x32_ps(x, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#endif

/* The attention scores s[t] = scale * q . K[t] with AVX512-BF16 dot products (bf16 products summed in fp32, as
 * torch's bf16 matmul computes them) where the CPU has them and the head size is a multiple of 32; returns 0 where
 * it does not, and the body's portable loop runs. Keys go sixteen at a time through one transposed reduction; each
 * dot is the same instruction sequence wherever its key falls, so a score does not depend on n. */
static int scores_fast_bf16(const uint16_t *q, const uint16_t *K, int64_t n, int64_t D, float scale, float *s) {
#if defined(__AVX512BF16__)
    if (D % 32 == 0) {
        const __m512 vscale = _mm512_set1_ps(scale);
        int64_t t = 0;
        for (; t + 16 <= n; t += 16) {
            __m512 acc[16];
            for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
            for (int64_t j = 0; j < D; j += 32) {
                const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + j);
                for (int i = 0; i < 16; i++)
                    acc[i] = _mm512_dpbf16_ps(acc[i], qv, (__m512bh)_mm512_loadu_si512(K + (t + i) * D + j));
            }
            _mm512_storeu_ps(s + t, _mm512_mul_ps(reduce_add_x16(acc), vscale));
        }
        for (; t < n; t++) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t j = 0; j < D; j += 32)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + j),
                                       (__m512bh)_mm512_loadu_si512(K + t * D + j));
            s[t] = _mm512_reduce_add_ps(acc) * scale;
        }
        return 1;
    }
#elif defined(HAVE_AVX2_LINEAR)
    if (D % 8 == 0 && D <= 512) { /* eight keys at a time through one transposed reduction, as above */
        float qf[512];
        for (int64_t j = 0; j < D; j++) qf[j] = bf16_to_f32(q[j]);
        const __m256 vscale = _mm256_set1_ps(scale);
        int64_t t = 0;
        for (; t + 8 <= n; t += 8) {
            __m256 acc[8];
            for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
            for (int64_t j = 0; j < D; j += 8) {
                const __m256 qv = _mm256_loadu_ps(qf + j);
                for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(qv, bf16x8_to_f32(K + (t + i) * D + j), acc[i]);
            }
            _mm256_storeu_ps(s + t, _mm256_mul_ps(reduce_add_x8(acc), vscale));
        }
        for (; t < n; t++) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t j = 0; j < D; j += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(qf + j), bf16x8_to_f32(K + t * D + j), acc);
            s[t] = hsum_x8(acc) * scale;
        }
        return 1;
    }
#endif
    (void)q, (void)K, (void)n, (void)D, (void)scale, (void)s;
    return 0;
}

#if defined(HAVE_AMX)
static int scores_run_amx(const uint16_t *q, int64_t q_stride, int64_t R, const uint16_t *K, const int64_t *n,
                          int64_t D, float scale, float *const *s, int *configured);
#endif

/* A run's scores at once where this CPU can (scores_run_amx), else 0 and the body scores query by query. */
static int scores_run_bf16(const uint16_t *q, int64_t q_stride, int64_t R, const uint16_t *K, const int64_t *n,
                           int64_t D, float scale, float *const *s, int *configured) {
#if defined(HAVE_AMX)
    return scores_run_amx(q, q_stride, R, K, n, D, scale, s, configured);
#else
    (void)q, (void)q_stride, (void)R, (void)K, (void)n, (void)D, (void)scale, (void)s, (void)configured;
    return 0;
#endif
}

static int scores_run_f32(const float *q, int64_t q_stride, int64_t R, const float *K, const int64_t *n, int64_t D,
                          float scale, float *const *s, int *configured) {
    (void)q, (void)q_stride, (void)R, (void)K, (void)n, (void)D, (void)scale, (void)s, (void)configured;
    return 0;
}

/* The tiles a thread's scores_run configured, given back (their 8 KB state is saved at every context switch). */
static inline void release_tiles(int configured) {
#if defined(HAVE_AMX)
    if (configured) _tile_release();
#else
    (void)configured;
#endif
}

static int scores_fast_f32(const float *q, const float *K, int64_t n, int64_t D, float scale, float *s) {
    (void)q, (void)K, (void)n, (void)D, (void)scale, (void)s;
    return 0;
}

/* Vectors for values_fast_bf16: AVX512-BF16 CPUs widen 16 bf16 values at a time and keep 4 x 4 accumulators, the
 * others (AVX2, or AVX-512F without BF16) 8 and 4 x 2 in their 16 registers. */
#if defined(__AVX512BF16__)
#define VALUES_LANES 16
#define VALUES_WIDTH 4
typedef __m512 values_vec;
#define values_zero _mm512_setzero_ps
#define values_set1 _mm512_set1_ps
#define values_fma _mm512_fmadd_ps
#define values_store _mm512_storeu_ps
#define values_widen bf16x16_to_f32
#elif defined(HAVE_AVX2_LINEAR)
#define VALUES_LANES 8
#define VALUES_WIDTH 2
typedef __m256 values_vec;
#define values_zero _mm256_setzero_ps
#define values_set1 _mm256_set1_ps
#define values_fma _mm256_fmadd_ps
#define values_store _mm256_storeu_ps
#define values_widen bf16x8_to_f32
#endif

#if defined(VALUES_LANES)
/* One pass of values_fast_bf16: columns [c, c + VALUES_LANES W) of the sums of queries 0..rr-1 (rr <= 4; nr[r] = 0
 * from rr on); inlined with W = VALUES_WIDTH or half of it, so the loops unroll and the accumulators stay in
 * registers. */
static inline __attribute__((always_inline)) void values_pass(const float *const *p, const int64_t *nr, int rr,
                                                              int64_t longest, const uint16_t *V, int64_t D,
                                                              int64_t c, const int W, float *acc) {
    values_vec a[4][VALUES_WIDTH], v[VALUES_WIDTH];
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < W; i++) a[r][i] = values_zero();
    for (int64_t t = 0; t < longest; t++) {
        for (int i = 0; i < W; i++) v[i] = values_widen(V + t * D + c + VALUES_LANES * i);
        for (int r = 0; r < 4; r++)
            if (t < nr[r]) {
                const values_vec pt = values_set1(p[r][t]);
                for (int i = 0; i < W; i++) a[r][i] = values_fma(pt, v[i], a[r][i]);
            }
    }
    for (int r = 0; r < rr; r++)
        for (int i = 0; i < W; i++) values_store(acc + r * D + c + VALUES_LANES * i, a[r][i]);
}
#endif

/* acc[r, j] = sum over t < n[r] of p[r][t] * V[t, j] for R queries over one head's values, each query's terms in key
 * order (one fused multiply-add each, as the portable loop adds them), so a query's output does not depend on the
 * others. Up to four queries at a time share each value row as it is loaded and widened to fp32; 64 or 32 columns
 * per pass stay in registers (16 or 8 without AVX512-BF16). Returns 0 where there is neither AVX512-BF16 nor AVX2,
 * or D is not a multiple of 32 (8). */
static int values_fast_bf16(const float *const *p, const int64_t *n, int64_t R, const uint16_t *V, int64_t D,
                            float *acc) {
#if defined(VALUES_LANES)
    const int64_t full = VALUES_LANES * VALUES_WIDTH, half = full / 2;
    if (D % half != 0) return 0;
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
        const int rr = R - r0 < 4 ? (int)(R - r0) : 4;
        int64_t nr[4] = {0, 0, 0, 0}, longest = 0;
        for (int r = 0; r < rr; r++) nr[r] = n[r0 + r], longest = nr[r] > longest ? nr[r] : longest;
        int64_t c = 0;
        for (; c + full <= D; c += full) values_pass(p + r0, nr, rr, longest, V, D, c, VALUES_WIDTH, acc + r0 * D);
        for (; c < D; c += half) values_pass(p + r0, nr, rr, longest, V, D, c, VALUES_WIDTH / 2, acc + r0 * D);
    }
    return 1;
#else
    (void)p, (void)n, (void)R, (void)V, (void)D, (void)acc;
    return 0;
#endif
}

static int values_fast_f32(const float *const *p, const int64_t *n, int64_t R, const float *V, int64_t D,
                           float *acc) {
    (void)p, (void)n, (void)R, (void)V, (void)D, (void)acc;
    return 0;
}

#if defined(__AVX512BF16__)
/* R input rows x J output features per pass over K (K % 32 == 0), then the next J rows of w are prefetched while
 * this pass computes: without it the loads outrun the hardware prefetcher and the GEMV falls well short of the
 * memory bandwidth at 4+ rows. The prefetch goes to L2 (T1), not L1: into L1 it stalls on the line fill buffers,
 * which the pass's own loads need, and a 3-row verify step took 1.4x a 1-row decode on a Xeon with AMX (1.25x
 * into L2; SmolLM2-135M's 30 layers, 13.0 against 10.9 ms). Every (row, feature) dot runs the same instruction
 * sequence whatever R, J and the number of rows in the call, so a row's output does not depend on the batch it
 * came in. */
#define LINEAR_TILE(R, J)                                                                                        \
    static inline void linear_tile_##R##x##J(const uint16_t *x, const uint16_t *w, const uint16_t *bias,         \
                                             uint16_t *y, int64_t N, int64_t K, int64_t n0) {                    \
        __m512 acc[R][J];                                                                                        \
        for (int r = 0; r < R; r++)                                                                              \
            for (int j = 0; j < J; j++) acc[r][j] = _mm512_setzero_ps();                                         \
        const char *next = (const char *)(w + (n0 + J) * K);                                                     \
        for (int64_t k = 0; k < K; k += 32) {                                                                    \
            for (int j = 0; j < J; j++) _mm_prefetch(next + (k * J + j * 32) * 2, _MM_HINT_T1);                  \
            __m512bh wv[J];                                                                                      \
            for (int j = 0; j < J; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + (n0 + j) * K + k);             \
            for (int r = 0; r < R; r++) {                                                                        \
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * K + k);                                \
                for (int j = 0; j < J; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], xv);                  \
            }                                                                                                    \
        }                                                                                                        \
        for (int r = 0; r < R; r++)                                                                              \
            for (int j = 0; j < J; j++) {                                                                        \
                float sum = _mm512_reduce_add_ps(acc[r][j]);                                                     \
                if (bias) sum += bf16_to_f32(bias[n0 + j]);                                                      \
                y[r * N + n0 + j] = f32_to_bf16(sum);                                                            \
            }                                                                                                    \
    }
LINEAR_TILE(4, 4)
LINEAR_TILE(3, 4)
LINEAR_TILE(2, 4)
LINEAR_TILE(1, 4)
LINEAR_TILE(4, 1)
LINEAR_TILE(3, 1)
LINEAR_TILE(2, 1)
LINEAR_TILE(1, 1)

typedef void (*linear_tile)(const uint16_t *, const uint16_t *, const uint16_t *, uint16_t *, int64_t, int64_t,
                            int64_t);

/* The rows left after whole 4-row tiles go through one tile of their own height: a 3-row verify step reads each
 * weight once for its three dots, where three 1-row passes would compute them one after another (the weights
 * are cached by then, but the instruction count triples). */
static void linear_features(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M,
                            int64_t N, int64_t K, int64_t n0, int wide) {
    static const linear_tile tail4[4] = {NULL, linear_tile_1x4, linear_tile_2x4, linear_tile_3x4};
    static const linear_tile tail1[4] = {NULL, linear_tile_1x1, linear_tile_2x1, linear_tile_3x1};
    int64_t m = 0;
    for (; m + 4 <= M; m += 4)
        (wide ? linear_tile_4x4 : linear_tile_4x1)(x + m * K, w, bias, y + m * N, N, K, n0);
    if (m < M) (wide ? tail4 : tail1)[M - m](x + m * K, w, bias, y + m * N, N, K, n0);
}
#endif

#if defined(HAVE_AVX2_LINEAR)
/* AVX2 + FMA, for CPUs without AVX-512 BF16 (most laptops and desktops; Skylake and Cascade Lake servers with
 * AVX-512F's 16 lanes): the weight's bf16 widened to fp32 (exact) and multiplied by the input, widened once per call,
 * in fused multiply-adds, LANES lanes per feature, R input rows x J features per pass over K (K % 32 == 0), the next
 * J weight rows prefetched into L2 as LINEAR_TILE does. 2 LANES weights widen in two instructions: a shift gives the
 * even-indexed ones, a mask the odd (widening 16 bits to 32 took two per LANES), so the input is stored with each
 * block's even-indexed values first (widened_input). The lanes are summed in one fixed order, and every (row,
 * feature) dot runs the same instruction sequence whatever R, J and the rows in the call, so a row's output does not
 * depend on its batch. */
#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec_f32;
static inline void bf16_pairs_to_f32(const uint16_t *src, vec_f32 *even, vec_f32 *odd) {
    const __m512i v = _mm512_loadu_si512(src);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}
#define vec_zero _mm512_setzero_ps
#define vec_load _mm512_loadu_ps
#define vec_fma _mm512_fmadd_ps
#define vec_sum _mm512_reduce_add_ps
#else
#define LANES 8
typedef __m256 vec_f32;
static inline void bf16_pairs_to_f32(const uint16_t *src, vec_f32 *even, vec_f32 *odd) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)src);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}
#define vec_zero _mm256_setzero_ps
#define vec_load _mm256_loadu_ps
#define vec_fma _mm256_fmadd_ps
#define vec_sum hsum_x8
#endif

#define WIDENED_TILE(R, J)                                                                                       \
    static inline void widened_tile_##R##x##J(const float *x, const uint16_t *w, const uint16_t *bias,           \
                                              uint16_t *y, int64_t N, int64_t K, int64_t n0) {                   \
        vec_f32 acc[R][J];                                                                                       \
        for (int r = 0; r < R; r++)                                                                              \
            for (int j = 0; j < J; j++) acc[r][j] = vec_zero();                                                  \
        const char *next = (const char *)(w + (n0 + J) * K);                                                     \
        for (int64_t k = 0; k < K; k += 2 * LANES) {                                                             \
            if (k % 32 == 0)                                                                                     \
                for (int j = 0; j < J; j++) _mm_prefetch(next + (j * K + k) * 2, _MM_HINT_T1);                   \
            vec_f32 we[J], wo[J];                                                                                \
            for (int j = 0; j < J; j++) bf16_pairs_to_f32(w + (n0 + j) * K + k, &we[j], &wo[j]);                 \
            for (int r = 0; r < R; r++) {                                                                        \
                const vec_f32 xe = vec_load(x + r * K + k), xo = vec_load(x + r * K + k + LANES);                \
                for (int j = 0; j < J; j++) acc[r][j] = vec_fma(xo, wo[j], vec_fma(xe, we[j], acc[r][j]));      \
            }                                                                                                    \
        }                                                                                                        \
        for (int r = 0; r < R; r++)                                                                              \
            for (int j = 0; j < J; j++) {                                                                        \
                float sum = vec_sum(acc[r][j]);                                                                  \
                if (bias) sum += bf16_to_f32(bias[n0 + j]);                                                      \
                y[r * N + n0 + j] = f32_to_bf16(sum);                                                            \
            }                                                                                                    \
    }
WIDENED_TILE(4, 2)
WIDENED_TILE(3, 2)
WIDENED_TILE(2, 2)
WIDENED_TILE(1, 2)
WIDENED_TILE(4, 1)
WIDENED_TILE(3, 1)
WIDENED_TILE(2, 1)
WIDENED_TILE(1, 1)

typedef void (*widened_tile)(const float *, const uint16_t *, const uint16_t *, uint16_t *, int64_t, int64_t, int64_t);

static void widened_features(const float *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M,
                             int64_t N, int64_t K, int64_t n0, int pair) {
    static const widened_tile tail2[4] = {NULL, widened_tile_1x2, widened_tile_2x2, widened_tile_3x2};
    static const widened_tile tail1[4] = {NULL, widened_tile_1x1, widened_tile_2x1, widened_tile_3x1};
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) (pair ? widened_tile_4x2 : widened_tile_4x1)(x + m * K, w, bias, y + m * N, N, K, n0);
    if (m < M) (pair ? tail2 : tail1)[M - m](x + m * K, w, bias, y + m * N, N, K, n0);
}

/* x [M, K] bf16 widened to fp32, each block of 2 LANES values stored even-indexed first, as the tiles read it. */
static void widened_input(const uint16_t *x, int64_t M, int64_t K, float *out) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < K; b += 2 * LANES)
            for (int64_t i = 0; i < LANES; i++) {
                out[r * K + b + i] = bf16_to_f32(x[r * K + b + 2 * i]);
                out[r * K + b + LANES + i] = bf16_to_f32(x[r * K + b + 2 * i + 1]);
            }
}
#endif

#if defined(HAVE_AVX2_LINEAR) && !defined(__AVX512F__)
#define HAVE_PANELS 1
/* AVX2 panels, for weights with N % 16 == 0: the dot products above load the input afresh for every weight vector
 * (4 rows x 2 features: 16 multiply-adds for 10 loads and 4 widenings, and a horizontal sum per output), which held
 * a 2-core Zen 3 to ~80 GFLOP/s from 8 rows on (benchmarks/README.md, "AVX2 panels"). Here a weight is stored in
 * panels of 16 output features ("panels" layout, a [N, K] tensor of the same shape): per panel, per input k, the 16
 * features' bf16 weights, w'[g][k][s] = w[16 g + PANEL_ORDER[s]][k], ordered so that the two unpacks that widen
 * them to fp32 give features 0-7 and 8-15. A tile of R input rows x 16 features keeps 2 R accumulators in
 * registers and, per k, widens one 32-byte load and broadcasts each row's input: 2 R multiply-adds for R + 1 loads.
 * Every output is one fp32 sum over k in order, whatever R and the rows in the call, so a row's result does not
 * depend on its batch. */
#define PANEL_ROWS 6
#define PANEL_AHEAD 64 /* inputs: 2 KB ahead of the loads */
static int panels_state = -1; /* -1 unknown; DFLASH_TRT_PANELS=0 keeps the dot products (an A/B switch) */

static int panels_on(void) {
    if (panels_state < 0) panels_state = !switched_off("DFLASH_TRT_PANELS");
    return panels_state;
}

static inline void panel_weights(const uint16_t *p, __m256 *lo, __m256 *hi) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p), z = _mm256_setzero_si256();
    *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v)); /* bf16 in the high half: the fp32 value, exactly */
    *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
}

static inline void panel_store(__m256 lo, __m256 hi, const uint16_t *bias, uint16_t *y, int64_t n0) {
    float out[16];
    _mm256_storeu_ps(out, lo);
    _mm256_storeu_ps(out + 8, hi);
    for (int j = 0; j < 16; j++) y[n0 + j] = f32_to_bf16(bias ? out[j] + bf16_to_f32(bias[n0 + j]) : out[j]);
}

/* Named accumulators, not arrays: GCC kept an array's vectors in memory and stored each one every iteration. */
#define PANEL_FMA(R, i)                                                                                          \
    if (R > i) {                                                                                                 \
        const __m256 xr = _mm256_broadcast_ss(x + i * K + k);                                                    \
        l##i = _mm256_fmadd_ps(xr, wl, l##i);                                                                    \
        h##i = _mm256_fmadd_ps(xr, wh, h##i);                                                                    \
    }
#define PANEL_STORE(R, i)                                                                                        \
    if (R > i) panel_store(l##i, h##i, bias, y + i * N, n0);
#define PANEL_TILE(R, NAME, STREAM)                                                                              \
    static inline void NAME(const float *x, const uint16_t *p, const uint16_t *bias, uint16_t *y, int64_t N,     \
                            int64_t K, int64_t n0) {                                                             \
        __m256 l0 = _mm256_setzero_ps(), l1 = l0, l2 = l0, l3 = l0, l4 = l0, l5 = l0;                            \
        __m256 h0 = l0, h1 = l0, h2 = l0, h3 = l0, h4 = l0, h5 = l0;                                             \
        for (int64_t k = 0; k < K; k++) {                                                                        \
            if (STREAM && !(k & 1)) _mm_prefetch((const char *)(p + (k + PANEL_AHEAD) * 16), _MM_HINT_T0);       \
            __m256 wl, wh;                                                                                       \
            panel_weights(p + k * 16, &wl, &wh);                                                                 \
            PANEL_FMA(R, 0) PANEL_FMA(R, 1) PANEL_FMA(R, 2) PANEL_FMA(R, 3) PANEL_FMA(R, 4) PANEL_FMA(R, 5)      \
        }                                                                                                        \
        PANEL_STORE(R, 0) PANEL_STORE(R, 1) PANEL_STORE(R, 2) PANEL_STORE(R, 3) PANEL_STORE(R, 4)               \
        PANEL_STORE(R, 5)                                                                                        \
    }
/* The first tile of rows streams the panel from memory: it prefetches ahead (one 64-byte line every 2 inputs); the
 * others find the panel cached. */
#define PANEL_TILES(R) PANEL_TILE(R, panel_tile_##R, 0) PANEL_TILE(R, panel_stream_##R, 1)
PANEL_TILES(6)
PANEL_TILES(5)
PANEL_TILES(4)
PANEL_TILES(3)
PANEL_TILES(2)
PANEL_TILES(1)

typedef void (*panel_tile)(const float *, const uint16_t *, const uint16_t *, uint16_t *, int64_t, int64_t, int64_t);

static void panel_features(const float *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M,
                           int64_t N, int64_t K, int64_t g) {
    static const panel_tile tile[PANEL_ROWS + 1] = {NULL, panel_tile_1, panel_tile_2, panel_tile_3, panel_tile_4,
                                                    panel_tile_5, panel_tile_6};
    static const panel_tile stream[PANEL_ROWS + 1] = {NULL, panel_stream_1, panel_stream_2, panel_stream_3,
                                                      panel_stream_4, panel_stream_5, panel_stream_6};
    const uint16_t *p = w + g * 16 * K;
    /* Rows spread evenly over the fewest tiles (8 rows: 4 + 4, not 6 + 2, whose 2-row pass pays a whole pass's
     * loads and widenings for 4 multiply-adds per input). */
    const int64_t tiles = (M + PANEL_ROWS - 1) / PANEL_ROWS;
    for (int64_t t = 0, m = 0; t < tiles; t++) {
        const int64_t rows = (M - m + tiles - t - 1) / (tiles - t);
        (t == 0 ? stream : tile)[rows](x + m * K, p, bias, y + m * N, N, K, 16 * g);
        m += rows;
    }
}
#endif

#if defined(HAVE_AMX)
/* AMX: one TDPBF16PS multiplies up to 16 input rows by a 32 x 16 block of w^T, so a 4-row verify step costs what a
 * 1-row decode does where the AVX-512 tiles above take ~1.25x (their dot products grow with the rows while the weight
 * bytes stay). The weight is stored in tile order ("tiles" layout, a [N, K] tensor of the same shape): per group of
 * 64 output features, per 32-wide slice of K, the four 16-feature blocks as TDPBF16PS reads them,
 * w'[g][kc][j][k2][n][p] = w[64 g + 16 j + n][32 kc + 2 k2 + p], so a group streams from one contiguous range.
 * Each output is one fp32 accumulation whatever the number of rows, so rows stay independent of their batch. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static int amx_state = -1; /* -1 unknown, 0 unusable, 1 granted */

static int amx_ready(void) {
    if (amx_state < 0) {
        /* Linux hands out the 8 KB tile state only on request (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA). */
        amx_state = switched_off("DFLASH_TRT_AMX") ? 0 : syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    }
    return amx_state;
}

static void configure_tiles(int64_t rows) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 5; t++) c.rows[t] = (uint8_t)rows, c.colsb[t] = 64; /* C0..C3 [rows x 16 fp32], A [rows x 32] */
    for (int t = 5; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;            /* B: 16 pairs of K x 16 features */
    /* GCC 12 does not see _tile_loadconfig read the struct and may drop the stores above (then LDTILECFG faults on
     * garbage): a compiler barrier keeps them. */
    __asm__ __volatile__("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}

/* The scores of a run of R <= 16 queries that share their keys (a verify block, a draft tree, a drafter block):
 * s[r][t] = scale * q_r . K[t] for t < n[r], keys [0, max n) through TDPBF16PS, the keys as tile rows straight from
 * the cache and the queries as tile columns. The VDPBF16PS path reads every key once per query and reduces each of its
 * dot products across lanes; here a block of 16 keys costs one multiply per 32 dimensions whatever R is. Each score
 * is one tile element, summed in an order that depends neither on the other queries nor on the other keys, so a
 * query's scores are the ones it gets alone (R = 1, a decode): a verify and a decode stay bit-identical. Returns 0
 * where AMX is not granted or D is not a multiple of 32 up to 128 (then the per-query path runs). `*configured`: the
 * R this thread's tiles are configured for (0: none; the caller releases them). */
static int scores_run_amx(const uint16_t *q, int64_t q_stride, int64_t R, const uint16_t *K, const int64_t *n,
                          int64_t D, float scale, float *const *s, int *configured) {
    enum { MAX_CHUNKS = 4 }; /* B tiles 2..5; C 0 and 6 and A 1 and 7 take two blocks of keys at a time */
    if (R < 1 || R > 16 || D % 32 || D > 32 * MAX_CHUNKS || !amx_ready()) return 0;
    const int64_t chunks = D / 32;
    int64_t keys = 0;
    for (int64_t r = 0; r < R; r++) keys = n[r] > keys ? n[r] : keys;
    if (*configured != R) { /* a call's runs are mostly of one length: a decode's 1, a verify's K + 1 */
        tile_config c;
        memset(&c, 0, sizeof c);
        c.palette = 1;
        for (int t = 0; t < 8; t++) /* A (1, 7): 16 keys x 32 dimensions; C and B: R queries wide */
            c.rows[t] = 16, c.colsb[t] = (uint16_t)(t == 1 || t == 7 ? 64 : 4 * R);
        __asm__ __volatile__("" : : "r"(&c) : "memory"); /* see configure_tiles */
        _tile_loadconfig(&c);
        *configured = (int)R;
    }
    /* B: per 32 dimensions, row i holds dimensions 2i and 2i + 1 of each of the R queries */
    uint16_t qt[MAX_CHUNKS][16][32];
    for (int64_t r = 0; r < R; r++)
        for (int64_t j = 0; j < D; j++) qt[j / 32][(j % 32) / 2][2 * r + j % 2] = q[r * q_stride + j];
    _tile_loadd(2, qt[0], 64); /* tile numbers are immediates: a line per 32 dimensions */
    if (chunks > 1) _tile_loadd(3, qt[1], 64);
    if (chunks > 2) _tile_loadd(4, qt[2], 64);
    if (chunks > 3) _tile_loadd(5, qt[3], 64);
    float dots[32][16];
    uint16_t tail[16 * 32 * MAX_CHUNKS];
    /* Two blocks of 16 keys at a time in two accumulators: one block's chain of multiplies waits on each one's
     * latency. */
    for (int64_t t0 = 0; t0 < keys; t0 += 32) {
        const int64_t m = keys - t0 < 32 ? keys - t0 : 32;
        const int two = m > 16;
        const uint16_t *a = K + t0 * D, *b = a + 16 * D;
        if (m < 32) { /* the last keys, zero-padded: no read past the run's keys */
            memset(tail, 0, sizeof(uint16_t) * 16 * (size_t)D);
            memcpy(tail, two ? b : a, sizeof(uint16_t) * (size_t)((two ? m - 16 : m) * D));
            if (two) b = tail; else a = tail;
        }
        _tile_zero(0);
        _tile_loadd(1, a, D * 2);
        _tile_dpbf16ps(0, 1, 2);
        if (two) { _tile_zero(6); _tile_loadd(7, b, D * 2); _tile_dpbf16ps(6, 7, 2); }
        if (chunks > 1) { _tile_loadd(1, a + 32, D * 2); _tile_dpbf16ps(0, 1, 3); }
        if (chunks > 1 && two) { _tile_loadd(7, b + 32, D * 2); _tile_dpbf16ps(6, 7, 3); }
        if (chunks > 2) { _tile_loadd(1, a + 64, D * 2); _tile_dpbf16ps(0, 1, 4); }
        if (chunks > 2 && two) { _tile_loadd(7, b + 64, D * 2); _tile_dpbf16ps(6, 7, 4); }
        if (chunks > 3) { _tile_loadd(1, a + 96, D * 2); _tile_dpbf16ps(0, 1, 5); }
        if (chunks > 3 && two) { _tile_loadd(7, b + 96, D * 2); _tile_dpbf16ps(6, 7, 5); }
        _tile_stored(0, dots, 64);
        if (two) _tile_stored(6, dots[16], 64);
        for (int64_t r = 0; r < R; r++)
            for (int64_t i = 0; i < m && t0 + i < n[r]; i++) s[r][t0 + i] = dots[i][r] * scale;
    }
    return 1;
}

/* f32_to_bf16(acc[i] + bias[i]) for 16 outputs at once, bit for bit the scalar rounding. */
static inline void store_bf16x16(const float *acc, const uint16_t *bias, uint16_t *dst) {
    __m512 v = _mm512_loadu_ps(acc);
    if (bias) v = _mm512_add_ps(v, bf16x16_to_f32(bias));
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    _mm256_storeu_si256((__m256i *)dst, _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet)));
}

static void linear_tiles(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M,
                         int64_t N, int64_t K) {
    if (M <= 0) return; /* no tile configuration holds 0 rows */
    const int64_t groups = N / 64, slices = K / 32, group_elems = slices * 4 * 512;
    /* Above 16 rows (a prompt chunk) every group's weights serve all the 16-row chunks while they are in cache:
     * chunk by chunk, each chunk streamed the whole weight again (a 32-row chunk cost 2.5x a 16-row one). The rows
     * are padded to whole tiles there; a tile row's outputs depend on that row alone, so every row's result is the
     * one it gets alone. */
    const int64_t tile_rows = M < 16 ? M : 16, chunks = (M + 15) / 16;
    uint16_t *padded = NULL;
    if (M > 16 && M % 16) {
        padded = calloc((size_t)(chunks * 16 * K), sizeof(uint16_t));
        if (!padded) abort();
        memcpy(padded, x, sizeof(uint16_t) * (size_t)(M * K));
        x = padded;
    }
#pragma omp parallel
    {
        configure_tiles(tile_rows);
        float acc[16 * 64];
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *b = w + g * group_elems;
            for (int64_t c = 0; c < chunks; c++) {
                const int64_t m0 = c * 16, rows = M - m0 < 16 ? M - m0 : 16;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t kc = 0; kc < slices; kc++) {
                    /* two slices (8 KB) ahead, into L2 (see LINEAR_TILE); past a group's end the next group's
                     * first slices, which follow it in memory (a prefetch past the weight's end does not fault).
                     * Later chunks find them cached; skipping their prefetches behind a branch cost a decode step's
                     * linears 3.5%. */
                    const char *ahead = (const char *)(b + (kc + 2) * 2048);
                    for (int i = 0; i < 64; i++) _mm_prefetch(ahead + i * 64, _MM_HINT_T1);
                    _tile_loadd(4, x + m0 * K + kc * 32, K * 2);
                    _tile_loadd(5, b + (kc * 4 + 0) * 512, 64);
                    _tile_dpbf16ps(0, 4, 5);
                    _tile_loadd(6, b + (kc * 4 + 1) * 512, 64);
                    _tile_dpbf16ps(1, 4, 6);
                    _tile_loadd(7, b + (kc * 4 + 2) * 512, 64);
                    _tile_dpbf16ps(2, 4, 7);
                    _tile_loadd(5, b + (kc * 4 + 3) * 512, 64);
                    _tile_dpbf16ps(3, 4, 5);
                }
                _tile_stored(0, acc, 256);
                _tile_stored(1, acc + 16, 256);
                _tile_stored(2, acc + 32, 256);
                _tile_stored(3, acc + 48, 256);
                for (int64_t r = 0; r < rows; r++)
                    for (int64_t n = 0; n < 64; n += 16)
                        store_bf16x16(acc + r * 64 + n, bias ? bias + g * 64 + n : NULL, y + (m0 + r) * N + g * 64 + n);
            }
        }
        _tile_release();
    }
    free(padded);
}
#endif

/* The weight layout linear_bf16 reads for an [N, K] weight on this CPU: 3 panels (AVX2), 2 tiles (AMX), 1 rows (w as
 * torch holds it), 0 none (the caller runs torch's linear). A function of the shape and the CPU only, so a weight
 * always takes the same kernel. DFLASH_TRT_AMX=0 turns the tiles off, DFLASH_TRT_PANELS=0 the panels. */
int linear_layout_bf16(int64_t N, int64_t K) {
    (void)N; /* read only where AMX is built in */
    if (K % 32 != 0) return 0;
#if defined(HAVE_AMX)
    if (N % 64 == 0 && amx_ready()) return 2;
#endif
#if defined(HAVE_PANELS)
    if (N % 16 == 0 && panels_on()) return 3;
#endif
#if defined(__AVX512BF16__) || defined(HAVE_AVX2_LINEAR)
    return 1;
#else
    return 0;
#endif
}

/* y [M, N] = x [M, K] @ w[N, K]^T (+ bias), bf16 in and out, fp32 sums, w in linear_layout_bf16(N, K)'s layout;
 * returns 0 where this build or shape has no kernel (the caller runs torch's linear). */
int linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M, int64_t N,
                int64_t K) {
    const int layout = linear_layout_bf16(N, K);
    (void)layout; /* read only where a kernel is built in */
#if defined(HAVE_AMX)
    if (layout == 2) {
        linear_tiles(x, w, bias, y, M, N, K);
        return 1;
    }
#endif
#if defined(__AVX512BF16__)
    if (layout != 1) return 0;
    const int64_t wide = N / 4;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < wide + N % 4; t++) {
        if (t < wide)
            linear_features(x, w, bias, y, M, N, K, 4 * t, 1);
        else
            linear_features(x, w, bias, y, M, N, K, 4 * wide + (t - wide), 0);
    }
    return 1;
#elif defined(HAVE_AVX2_LINEAR)
    if (layout != 1 && layout != 3) return 0;
    float *x32 = malloc(sizeof(float) * (size_t)(M > 0 ? M * K : 1));
    if (!x32) abort();
#if defined(HAVE_PANELS)
    if (layout == 3) { /* the input widened in its own order: panels broadcast it value by value */
        for (int64_t i = 0; i < M * K; i++) x32[i] = bf16_to_f32(x[i]);
#pragma omp parallel for schedule(static)
        for (int64_t g = 0; g < N / 16; g++) panel_features(x32, w, bias, y, M, N, K, g);
        free(x32);
        return 1;
    }
#endif
    widened_input(x, M, K, x32);
    const int64_t pairs = N / 2;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < pairs + N % 2; t++) {
        if (t < pairs)
            widened_features(x32, w, bias, y, M, N, K, 2 * t, 1);
        else
            widened_features(x32, w, bias, y, M, N, K, N - 1, 0);
    }
    free(x32);
    return 1;
#else
    (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K;
    return 0;
#endif
}

/* torch.argmax over each row of n values (n >= 1): the first index of the maximum, where a NaN counts as the
 * maximum (the first NaN wins). torch reduces a long row on one thread, and slowly for bf16 (a verify block's
 * 3 x 49,152 logits took ~0.2-0.4 ms inside the decode loop); this is one vectorised pass. Each of 16 lanes keeps
 * its own first maximum (only a strictly greater value replaces it), so the row's first maximum is the lowest index
 * among the lanes holding the largest value; the tail after the last full vector comes later in the row and wins
 * only when strictly greater. A row holding a NaN is rescanned for its first one. */
static inline float argmax_load1(const void *x, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

static int64_t first_nan(const void *x, int64_t n, int bf16) {
    for (int64_t i = 0; i < n; i++) {
        const float v = argmax_load1(x, i, bf16);
        if (v != v) return i;
    }
    return 0;
}

static inline int64_t argmax_row(const void *x, int64_t n, int bf16) {
    int64_t i = 1, best_i = 0;
    float best = argmax_load1(x, 0, bf16);
#if defined(__AVX512BF16__)
    if (n >= 16) {
        const uint16_t *xb = x;
        const float *xf = x;
        __m512 lane_max = bf16 ? bf16x16_to_f32(xb) : _mm512_loadu_ps(xf);
        __m512i lane_i = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), idx = lane_i;
        __mmask16 unordered = _mm512_cmp_ps_mask(lane_max, lane_max, _CMP_UNORD_Q);
        for (i = 16; i + 16 <= n; i += 16) {
            const __m512 v = bf16 ? bf16x16_to_f32(xb + i) : _mm512_loadu_ps(xf + i);
            idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
            const __mmask16 greater = _mm512_cmp_ps_mask(v, lane_max, _CMP_GT_OQ);
            unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            lane_max = _mm512_mask_mov_ps(lane_max, greater, v);
            lane_i = _mm512_mask_mov_epi32(lane_i, greater, idx);
        }
        if (unordered) return first_nan(x, n, bf16);
        best = _mm512_reduce_max_ps(lane_max);
        best_i = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(lane_max, _mm512_set1_ps(best), _CMP_EQ_OQ), lane_i);
    }
#endif
    for (; i < n; i++) {
        const float v = argmax_load1(x, i, bf16);
        if (v != v) return first_nan(x, n, bf16);
        if (v > best) best = v, best_i = i;
    }
    return best_i;
}

void argmax_rows_bf16(const uint16_t *x, int64_t rows, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * n, n, 1);
}

void argmax_rows_f32(const float *x, int64_t rows, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * n, n, 0);
}

/* With the weights streaming from memory (between two forwards) the screen beats the full head up to 8 rows: 2.1
 * against 2.7 ms for SmolLM2's at 8 rows, 1.4 against 2.5 at one (with warm caches 8 rows are a tie). */
#define SCREEN_MAX_ROWS 8
#define SCREEN_GROUP 64
/* The widest input the int8 kernels take: VNNI's int32 accumulators sum up to 255 x 127 x K, under 2^31 to K = 66,311
 * (an 8B target's drafter reads 5 x 4,096 fc inputs and 14,336 down_proj ones; the cap was 8,192 and refused them). */
#define Q8_MAX_K 65536
/* "VNNI" below is AVX512-VNNI with AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4); CPUs with VNNI but no BF16
 * (Cascade Lake, Ice Lake) take the AVX2 screen, as AVX2 laptops do. */
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define SCREEN_VNNI 1 /* the input in two int8 levels, VPDPBUSD */
#elif defined(HAVE_AVX2_LINEAR)
#define SCREEN_AVX2 1 /* the input in one int16 level, VPMADDWD (exact int32 sums; int8 VPMADDUBSW saturates) */
#endif
/* Blocks of 16 features ahead that screen_block prefetches into L2: with the hardware prefetcher alone the int8
 * stream ran at 16 GB/s against the bf16 kernel's 21 (1.8 against 1.4 ms at one row). */
#define SCREEN_AHEAD 4

#if defined(SCREEN_VNNI)
/* 16 features' screened dots for R rows: xq holds each row's two levels (2 x K bytes, +128 each: unsigned for
 * VPDPBUSD, taken off again through qsum), xs their scales. */
static inline __attribute__((always_inline)) void screen_block(const uint8_t *xq, const float *xs, int R,
                                                               const int8_t *qb, int64_t K, const int32_t *qsum,
                                                               const float *scale, float *dst, int64_t N) {
    __m512i acc[2 * SCREEN_MAX_ROWS];
    for (int i = 0; i < 2 * R; i++) acc[i] = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 4) {
        _mm_prefetch((const char *)(qb + SCREEN_AHEAD * K * 16 + k * 16), _MM_HINT_T1);
        const __m512i w = _mm512_loadu_si512(qb + k * 16);
        for (int i = 0; i < 2 * R; i++) {
            int32_t four;
            memcpy(&four, xq + i * K + k, 4);
            acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_set1_epi32(four), w);
        }
    }
    const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(qsum), 7);
    const __m512 s = _mm512_loadu_ps(scale);
    for (int r = 0; r < R; r++) {
        const __m512 d1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[2 * r], offset));
        const __m512 d2 = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[2 * r + 1], offset));
        const __m512 dot =
            _mm512_fmadd_ps(d1, _mm512_set1_ps(xs[2 * r]), _mm512_mul_ps(d2, _mm512_set1_ps(xs[2 * r + 1])));
        _mm512_storeu_ps(dst + r * N, _mm512_mul_ps(dot, s));
    }
}

#elif defined(SCREEN_AVX2)
/* Inputs per int32 accumulation in the AVX2 screen: a lane adds SCREEN_SPAN / 2 products of an int16 and an int8,
 * at most 512 / 2 x 32767 x 127 < 2^31, before its sum moves to fp32. */
#define SCREEN_SPAN 512

/* 16 features' screened dots for R rows: xq holds each row's int16 level (K values, 2 x K bytes), xs[2 r] its scale.
 * q's 64 bytes per 4 inputs hold 4 features' 16 weights each quarter; a quarter sign-extended to int16 and multiplied
 * by the 4 inputs (VPMADDWD) gives each of its features two int32 pair sums. A pass takes as many quarters as its
 * accumulators (quarters x R) leave registers for: all four in one pass that streams the block up to 3 rows, two
 * quarters a pass up to 6, one beyond (the later passes read the block, 9 KB for K = 576, from L1). */
static inline __attribute__((always_inline)) void screen_block(const uint8_t *xq, const float *xs, int R,
                                                               const int8_t *qb, int64_t K, const int32_t *qsum,
                                                               const float *scale, float *dst, int64_t N) {
    (void)qsum;
    const int per = R <= 3 ? 4 : R <= 6 ? 2 : 1;
    float sum[SCREEN_MAX_ROWS][16];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < 16; j++) sum[i][j] = 0.0f;
    for (int first = 0; first < 4; first += per)
        for (int64_t k0 = 0; k0 < K; k0 += SCREEN_SPAN) {
            const int64_t k1 = k0 + SCREEN_SPAN < K ? k0 + SCREEN_SPAN : K;
            __m256i acc[4][SCREEN_MAX_ROWS];
            for (int u = 0; u < per; u++)
                for (int i = 0; i < R; i++) acc[u][i] = _mm256_setzero_si256();
            for (int64_t k = k0; k < k1; k += 4) {
                if (!first) _mm_prefetch((const char *)(qb + SCREEN_AHEAD * K * 16 + k * 16), _MM_HINT_T1);
                __m256i w[4];
                for (int u = 0; u < per; u++)
                    w[u] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qb + k * 16 + (first + u) * 16)));
                for (int i = 0; i < R; i++) {
                    long long four;
                    memcpy(&four, xq + 2 * (i * K + k), 8);
                    const __m256i x4 = _mm256_set1_epi64x(four);
                    for (int u = 0; u < per; u++) acc[u][i] = _mm256_add_epi32(acc[u][i], _mm256_madd_epi16(x4, w[u]));
                }
            }
            for (int u = 0; u < per; u++)
                for (int i = 0; i < R; i++) {
                    int32_t pairs[8];
                    _mm256_storeu_si256((__m256i *)pairs, acc[u][i]);
                    for (int f = 0; f < 4; f++)
                        sum[i][4 * (first + u) + f] += (float)((int64_t)pairs[2 * f] + pairs[2 * f + 1]);
                }
        }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 16; j++) dst[r * N + j] = sum[r][j] * xs[2 * r] * scale[j];
}
#endif

#if defined(SCREEN_VNNI) || defined(SCREEN_AVX2)
/* Quantizes row x [K] into xq and xs as screen_block reads them (two int8 levels of K bytes with VNNI, one int16
 * level without), with head_argmax_bf16's a and b (below). 0 if the row is not finite. */
static int screen_row(const uint16_t *x, int64_t K, uint8_t *xq, float *xs, float *a, float *b, double *rest) {
    double xx = 0;
    for (int64_t k = 0; k < K; k++) {
        rest[k] = bf16_to_f32(x[k]);
        if (!isfinite(rest[k])) return 0;
        xx += rest[k] * rest[k];
    }
#if defined(SCREEN_VNNI)
    const int levels = 2; /* int8, +128 each */
    const double top = 127;
#else
    const int levels = 1; /* int16 */
    const double top = 32767;
    xs[1] = 0.0f;
#endif
    for (int level = 0; level < levels; level++) {
        double amax = 0;
        for (int64_t k = 0; k < K; k++) amax = fmax(amax, fabs(rest[k]));
        const float sx = amax > 0 ? (float)(amax / top) : 1.0f;
        for (int64_t k = 0; k < K; k++) {
            double qv = nearbyint(rest[k] / sx);
            qv = qv > top ? top : qv < -top ? -top : qv;
#if defined(SCREEN_VNNI)
            xq[level * K + k] = (uint8_t)(int)(qv + 128);
#else
            const int16_t q16 = (int16_t)qv;
            memcpy(xq + 2 * k, &q16, 2);
#endif
            rest[k] -= (double)sx * qv; /* exact in double: both terms on one grid of under 53 bits */
        }
        xs[level] = sx;
    }
    double ee = 0, kept = 0;
    for (int64_t k = 0; k < K; k++) {
        const double v = bf16_to_f32(x[k]);
        ee += rest[k] * rest[k];
        kept += (v - rest[k]) * (v - rest[k]);
    }
    *a = (float)(sqrt(kept) * (1 + 1e-6));
    *b = (float)((sqrt(ee) + 1e-3 * sqrt(xx)) * (1 + 1e-6));
    return 1;
}

/* screen_block for a row count known only at run time (1..SCREEN_MAX_ROWS): each case compiles with its accumulators
 * in registers. */
static void screen_block_rows(const uint8_t *xq, const float *xs, int R, const int8_t *qb, int64_t K,
                              const int32_t *qsum, const float *scale, float *dst, int64_t N) {
    switch (R) {
#define SCREEN_CASE(RR) \
    case RR: screen_block(xq, xs, RR, qb, K, qsum, scale, dst, N); break;
        SCREEN_CASE(1) SCREEN_CASE(2) SCREEN_CASE(3) SCREEN_CASE(4)
        SCREEN_CASE(5) SCREEN_CASE(6) SCREEN_CASE(7) SCREEN_CASE(8)
#undef SCREEN_CASE
    }
}

/* approx [M, N]: every feature's screened value s_j (sx1 qx1 . q_j + sx2 qx2 . q_j; with AVX2 s_j sx qx . q_j) for
 * M <= SCREEN_MAX_ROWS quantized rows. */
static void screened_values(const uint8_t *xq, const float *xs, int64_t M, const int8_t *q, int64_t K,
                            const int32_t *qsum, const float *scale, float *approx, int64_t N) {
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < N / 16; b++)
        screen_block_rows(xq, xs, (int)M, q + b * K * 16, K, qsum + b * 16, scale + b * 16, approx + b * 16, N);
}
#define HAVE_SCREEN 1
#endif

/* The rows head_argmax_bf16 screens on this CPU: SCREEN_MAX_ROWS with VNNI, 4 with AVX2 (with either linear_q8
 * runs), else 0 (it may still decline a head linear_bf16 has no kernel for). An AMX-INT8 version (TDPBUSD, 16 rows)
 * measured 2.3 against the full head's 2.5 ms at 12 rows and lost to this one below 9, about 1% of a 4-row step: not
 * kept. */
int64_t head_screen_rows(void) {
#if defined(SCREEN_VNNI)
    return SCREEN_MAX_ROWS;
#elif defined(SCREEN_AVX2)
    return 4; /* from 5 rows its VPMADDWDs bound it: 3.3-3.4 against the full head's 2.6-3.6 ms (SmolLM2, AVX2 EPYC) */
#else
    return 0;
#endif
}

/* Which int8 dot product linear_q8 and head_argmax_bf16 take here: 2 VPDPBUSD (AVX512-VNNI, 64 products an
 * instruction: linear_q8 beats linear_bf16 at a drafter's 8-row block), 1 VPMADDWD (AVX2: 16, against an int16 input;
 * at 8 rows it ties with linear_bf16, 1.09-1.36 against 1.12-1.14 ms for a SmolLM2 drafter layer's projections on an
 * AVX2 EPYC), 0 none. */
int64_t int8_dot_kind(void) {
#if defined(SCREEN_VNNI)
    return 2;
#elif defined(SCREEN_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* The screened values head_argmax_bf16 bounds, for bf16 x [M, K] into approx [M, N] (tests check them against
 * x @ (s q)^T); 0 where the screen declines (as head_argmax_bf16 does). */
int head_screen_values(const uint16_t *x, int64_t M, int64_t K, const int8_t *q, const int32_t *qsum,
                       const float *scale, int64_t N, float *approx) {
#if defined(HAVE_SCREEN)
    if (M < 1 || M > head_screen_rows() || N % SCREEN_GROUP || K > Q8_MAX_K) return 0;
    float xs[2 * SCREEN_MAX_ROWS], a, c;
    uint8_t *xq = malloc((size_t)(2 * M * K));
    double *rest = malloc((size_t)K * sizeof(double));
    int ok = xq && rest;
    for (int64_t r = 0; ok && r < M; r++) ok = screen_row(x + r * K, K, xq + 2 * r * K, xs + 2 * r, &a, &c, rest);
    if (ok) screened_values(xq, xs, M, q, K, qsum, scale, approx, N);
    free(xq), free(rest);
    return ok;
#else
    (void)x, (void)M, (void)K, (void)q, (void)qsum, (void)scale, (void)N, (void)approx;
    return 0;
#endif
}

#if defined(SCREEN_VNNI)
/* The vectors head_argmax_bf16's bound pass runs in: 16 lanes with AVX-512, 8 with AVX2. */
typedef __m512 bound_vec;
#define BOUND_LANES 16
#define bound_set1 _mm512_set1_ps
#define bound_load _mm512_loadu_ps
#define bound_store _mm512_storeu_ps
#define bound_fmadd _mm512_fmadd_ps
#define bound_mul _mm512_mul_ps
#define bound_add _mm512_add_ps
#define bound_sub _mm512_sub_ps
#define bound_max _mm512_max_ps
#define bound_reduce_max _mm512_reduce_max_ps
static inline int bound_any_ge(bound_vec a, bound_vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ) != 0; }
#elif defined(SCREEN_AVX2)
typedef __m256 bound_vec;
#define BOUND_LANES 8
#define bound_set1 _mm256_set1_ps
#define bound_load _mm256_loadu_ps
#define bound_store _mm256_storeu_ps
#define bound_fmadd _mm256_fmadd_ps
#define bound_mul _mm256_mul_ps
#define bound_add _mm256_add_ps
#define bound_sub _mm256_sub_ps
#define bound_max _mm256_max_ps
#define bound_reduce_max hmax_x8
static inline int bound_any_ge(bound_vec a, bound_vec b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GE_OQ)); }
#endif

/* The greedy token of a bf16 output head, argmax(x @ w^T) per row, exactly as linear_bf16 then argmax_rows_bf16
 * choose it, reading about half the head's bytes. An int8 copy of the head screens every feature: w_j = s_j q_j + e_j
 * (q stored per 16 features and 4 inputs as VPDPBUSD reads it, q[N / 16][K / 4][16][4]; qsum_j = sum_k q_jk), and
 * x = sx1 qx1 + sx2 qx2 + ex, two int8 levels (the second quantizes the first's remainder: one level alone leaves
 * SmolLM2's outlier dimensions an error that keeps hundreds of features in; on AVX2, x = sx qx + ex, one int16
 * level, as fine as the two), so
 *   x . w_j = s_j (sx1 qx1 . q_j + sx2 qx2 . q_j) + (x - ex) . e_j + ex . w_j,
 * the integer dots exact and the rest at most a |e_j| + b |w_j| (Cauchy-Schwarz; a = |x - ex|, b = |ex| plus 1e-3 |x|
 * for every fp32 rounding on the way, this one's and linear_bf16's). With lo the largest lower bound and hi the
 * largest upper bound of any feature's dot, a feature whose upper bound is below lo - 2^-6 max(|lo|, |hi|) falls
 * below the maximum by more than bf16's rounding can close (at most 2^-8 of a value either side), so its rounded
 * logit is strictly smaller than the maximum's: neither the argmax nor a tie before it. The 64-feature groups of the
 * others are computed by linear_bf16 itself, whose every output is the same whatever features share its call, and
 * scanned in index order, so ties resolve to the first index as torch's do. scratch holds 3 M N / 2 floats. Returns 0
 * (nothing done) without VNNI or AVX2 or a bf16 linear kernel for the head, for more than head_screen_rows() rows
 * or Q8_MAX_K inputs, for a row that is not finite, and where the bounds pass fp32's range (the caller's full path
 * then decides, NaNs included). */
int head_argmax_bf16(const uint16_t *x, int64_t M, int64_t K, const int8_t *q, const int32_t *qsum,
                     const float *scale, const float *err, const float *wnorm, const uint16_t *w, int64_t N,
                     float *scratch, int64_t *out) {
#if defined(HAVE_SCREEN)
    if (M < 1 || M > head_screen_rows() || N % SCREEN_GROUP || K % 32 || K > Q8_MAX_K ||
        linear_layout_bf16(N, K) == 0)
        return 0;
    float xs[2 * SCREEN_MAX_ROWS], a[SCREEN_MAX_ROWS], c[SCREEN_MAX_ROWS];
    uint8_t *xq = malloc((size_t)(2 * M * K)), *wanted = calloc((size_t)(N / SCREEN_GROUP), 1);
    double *rest = malloc((size_t)K * sizeof(double));
    int ok = xq && wanted && rest;
    for (int64_t r = 0; ok && r < M; r++)
        ok = screen_row(x + r * K, K, xq + 2 * r * K, xs + 2 * r, a + r, c + r, rest);
    free(rest);
    if (!ok) {
        free(xq), free(wanted);
        return 0;
    }
    float *approx = scratch;
    uint16_t *exact = (uint16_t *)(scratch + M * N);
    screened_values(xq, xs, M, q, K, qsum, scale, approx, N);
    for (int64_t r = 0; r < M; r++) {
        float *d = approx + r * N; /* screened values in, upper bounds out */
        const bound_vec av = bound_set1(a[r]), cv = bound_set1(c[r]);
        bound_vec lo = bound_set1(-INFINITY), hi = lo;
        for (int64_t j = 0; j < N; j += BOUND_LANES) {
            const bound_vec v = bound_load(d + j);
            const bound_vec e = bound_fmadd(av, bound_load(err + j), bound_mul(cv, bound_load(wnorm + j)));
            const bound_vec upper = bound_add(v, e);
            lo = bound_max(lo, bound_sub(v, e));
            hi = bound_max(hi, upper);
            bound_store(d + j, upper);
        }
        const float l = bound_reduce_max(lo), h = bound_reduce_max(hi);
        if (!isfinite(l) || !isfinite(h)) { /* dots past fp32's range: no group would pass a NaN floor (token -1) */
            free(xq), free(wanted);
            return 0;
        }
        const bound_vec floor_ = bound_set1(l - 0x1p-6f * fmaxf(fabsf(l), fabsf(h)));
        for (int64_t j = 0; j < N; j += BOUND_LANES)
            if (bound_any_ge(bound_load(d + j), floor_)) wanted[j / SCREEN_GROUP] = 1;
    }
    float best[SCREEN_MAX_ROWS];
    for (int64_t r = 0; r < M; r++) best[r] = -INFINITY, out[r] = -1;
    for (int64_t g = 0, end; g < N / SCREEN_GROUP; g = end) {
        if (!wanted[g]) {
            end = g + 1;
            continue;
        }
        for (end = g + 1; end < N / SCREEN_GROUP && wanted[end];) end++; /* a run of groups: one call */
        const int64_t n = (end - g) * SCREEN_GROUP;
        linear_bf16(x, w + g * SCREEN_GROUP * K, NULL, exact, M, n, K);
        for (int64_t r = 0; r < M; r++)
            for (int64_t j = 0; j < n; j++) {
                const float v = bf16_to_f32(exact[r * n + j]);
                if (v > best[r] || out[r] < 0) best[r] = v, out[r] = g * SCREEN_GROUP + j;
            }
    }
    free(xq), free(wanted);
    return 1;
#else
    (void)x, (void)M, (void)K, (void)q, (void)qsum, (void)scale, (void)err, (void)wnorm, (void)w, (void)N,
        (void)scratch, (void)out;
    return 0;
#endif
}

#if defined(SCREEN_VNNI)
/* screen_row's two int8 levels of a bf16 row without its bounds, vectorised in fp32 (the remainder after the first
 * level rounds, which only linear_q8's approximation sees): the scalar float64 version took ~0.07 ms for a drafter's
 * 2 x 2,880 fc inputs, a sixth of what the int8 weights save. rest: K floats of scratch. 0 if the row is not finite. */
static int quantize_row_fast(const uint16_t *x, int64_t K, uint8_t *xq, float *xs, float *rest) {
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) _mm512_storeu_ps(rest + k, bf16x16_to_f32(x + k));
    for (; k < K; k++) rest[k] = bf16_to_f32(x[k]);
    for (int level = 0; level < 2; level++) {
        __m512 amax = _mm512_setzero_ps();
        for (k = 0; k < K; k += 16) {
            const __mmask16 m = K - k >= 16 ? 0xffff : (__mmask16)((1u << (K - k)) - 1);
            amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(m, rest + k)));
        }
        const float top = _mm512_reduce_max_ps(amax);
        if (!isfinite(top)) return 0; /* a NaN compares false in the max: caught below, at the first level */
        const float sx = top > 0 ? top / 127 : 1.0f;
        const int tiny = !isfinite(1.0f / sx); /* a row near FLT_MIN: 1 / sx overflows, so divide by sx */
        const __m512 inv = _mm512_set1_ps(1.0f / sx), scale = _mm512_set1_ps(sx);
        for (k = 0; k < K; k += 16) {
            const __mmask16 m = K - k >= 16 ? 0xffff : (__mmask16)((1u << (K - k)) - 1);
            const __m512 v = _mm512_maskz_loadu_ps(m, rest + k);
            if (!level && _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q)) return 0;
            __m512i q = _mm512_cvtps_epi32(tiny ? _mm512_div_ps(v, scale) : _mm512_mul_ps(v, inv)); /* to even */
            q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
            _mm512_mask_storeu_ps(rest + k, m, _mm512_fnmadd_ps(_mm512_cvtepi32_ps(q), scale, v));
            _mm_mask_storeu_epi8(xq + level * K + k, m,
                                 _mm512_cvtepi32_epi8(_mm512_add_epi32(q, _mm512_set1_epi32(128))));
        }
        xs[level] = sx;
    }
    return 1;
}
#elif defined(SCREEN_AVX2)
/* screen_row's int16 level of a bf16 row without its bounds, vectorised in fp32. v: K floats of scratch. 0 if the row
 * is not finite. */
static int quantize_row_fast(const uint16_t *x, int64_t K, uint8_t *xq, float *xs, float *v) {
    int64_t k = 0, tail = K - K % 8;
    for (; k < tail; k += 8) _mm256_storeu_ps(v + k, bf16x8_to_f32(x + k));
    for (; k < K; k++) v[k] = bf16_to_f32(x[k]);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 amax = _mm256_setzero_ps();
    for (k = 0; k < tail; k += 8) {
        const __m256 u = _mm256_loadu_ps(v + k);
        if (_mm256_movemask_ps(_mm256_cmp_ps(u, u, _CMP_UNORD_Q))) return 0;
        amax = _mm256_max_ps(amax, _mm256_and_ps(u, magnitude));
    }
    float top = hmax_x8(amax);
    for (k = tail; k < K; k++) {
        if (isnan(v[k])) return 0;
        top = fmaxf(top, fabsf(v[k]));
    }
    if (!isfinite(top)) return 0;
    const float sx = top > 0 ? top / 32767 : 1.0f, inv = 1.0f / sx;
    const int tiny = !isfinite(inv); /* a row below ~1e-34: 1 / sx overflows, so divide by sx */
    const __m256 vinv = _mm256_set1_ps(inv), vsx = _mm256_set1_ps(sx);
    const __m256i most = _mm256_set1_epi32(32767), least = _mm256_set1_epi32(-32767);
    for (k = 0; k < tail; k += 8) {
        const __m256 u = _mm256_loadu_ps(v + k);
        __m256i q = _mm256_cvtps_epi32(tiny ? _mm256_div_ps(u, vsx) : _mm256_mul_ps(u, vinv)); /* to nearest even */
        q = _mm256_max_epi32(_mm256_min_epi32(q, most), least);
        /* packs works within 128-bit halves: lanes 0 and 2 of the 64-bit view hold the 8 values in order */
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(q, q), 0x08);
        _mm_storeu_si128((__m128i *)(xq + 2 * k), _mm256_castsi256_si128(packed));
    }
    for (; k < K; k++) {
        float qv = nearbyintf(tiny ? v[k] / sx : v[k] * inv);
        qv = qv > 32767 ? 32767 : qv < -32767 ? -32767 : qv;
        const int16_t q16 = (int16_t)qv;
        memcpy(xq + 2 * k, &q16, 2);
    }
    xs[0] = sx, xs[1] = 0.0f;
    return 1;
}
#endif

/* An int8 weight for linear_q8: q and qsum as head_argmax_bf16 reads them, one scale per output feature. */
typedef struct {
    const int8_t *q;
    const int32_t *qsum;
    const float *scale;
} q8_weight;

/* y [M, N] = x [M, K] @ (s q)^T (+ bias), bf16 in and out, from an int8 weight: half the bytes of linear_bf16's,
 * for a DFlash drafter, whose drafts the target verifies (an approximation there costs acceptance, never
 * correctness). x is quantized per row as in head_argmax_bf16 (two int8 levels with VNNI, one int16 level with AVX2;
 * the integer dots exact, an error near 2^-16 of the row's largest value), so each row's result is the same
 * whatever rows share the call; a row that is not finite gives NaNs. Returns 0 where this build has neither. */
int linear_q8(const uint16_t *x, const q8_weight *w, const uint16_t *bias, uint16_t *y, int64_t M, int64_t N,
              int64_t K) {
#if defined(HAVE_SCREEN)
    if (N % 16 || K % 4 || K > Q8_MAX_K) return 0;
    uint8_t *xq = malloc((size_t)(2 * SCREEN_MAX_ROWS * K));
    float *rest = malloc((size_t)K * sizeof(float));
    if (!xq || !rest) {
        free(xq), free(rest);
        return 0;
    }
    for (int64_t m0 = 0; m0 < M; m0 += SCREEN_MAX_ROWS) {
        const int R = (int)(M - m0 < SCREEN_MAX_ROWS ? M - m0 : SCREEN_MAX_ROWS);
        float xs[2 * SCREEN_MAX_ROWS];
        int finite[SCREEN_MAX_ROWS];
        for (int r = 0; r < R; r++)
            finite[r] = quantize_row_fast(x + (m0 + r) * K, K, xq + 2 * r * K, xs + 2 * r, rest);
#pragma omp parallel for schedule(static)
        for (int64_t b = 0; b < N / 16; b++) {
            float out[SCREEN_MAX_ROWS * 16];
            screen_block_rows(xq, xs, R, w->q + b * K * 16, K, w->qsum + b * 16, w->scale + b * 16, out, 16);
            for (int r = 0; r < R; r++)
                for (int j = 0; j < 16; j++) {
                    const float v = out[r * 16 + j] + (bias ? bf16_to_f32(bias[b * 16 + j]) : 0.0f);
                    y[(m0 + r) * N + b * 16 + j] = finite[r] ? f32_to_bf16(v) : 0x7fc0;
                }
        }
    }
    free(xq), free(rest);
    return 1;
#else
    (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K;
    return 0;
#endif
}

/* A table's projection, bf16 (linear_bf16's layout) or int8 (a q8_weight), as the table was built. */
static inline void linear_table(int q8, const uint16_t *x, const void *w, const uint16_t *bias, uint16_t *y,
                                int64_t M, int64_t N, int64_t K) {
    if (q8)
        linear_q8(x, (const q8_weight *)w, bias, y, M, N, K);
    else
        linear_bf16(x, (const uint16_t *)w, bias, y, M, N, K);
}

#define T uint16_t
#define LOAD bf16_to_f32
#define STORE f32_to_bf16
#define SFX bf16
#include "cpu_ops_body.h"
#undef T
#undef LOAD
#undef STORE
#undef SFX

static inline float f32_id(float x) { return x; }
#define T float
#define LOAD f32_id
#define STORE f32_id
#define SFX f32
#include "cpu_ops_body.h"
#undef T
#undef LOAD
#undef STORE
#undef SFX

/* x += y over n rows of d, each sum rounded to bf16; a prompt chunk's rows split over the threads. */
static inline void add_bf16(uint16_t *x, const uint16_t *y, int64_t n, int64_t d) {
    if (n >= PARALLEL_MIN_ROWS) {
#pragma omp parallel for schedule(static)
        for (int64_t j = 0; j < n * d; j++) x[j] = f32_to_bf16(bf16_to_f32(x[j]) + bf16_to_f32(y[j]));
    } else {
        for (int64_t j = 0; j < n * d; j++) x[j] = f32_to_bf16(bf16_to_f32(x[j]) + bf16_to_f32(y[j]));
    }
}

/* Pointers per layer in llama_layers_bf16's weight table, in this order (bias and q/k norm entries may be NULL). */
enum { W_IN_NORM, W_QKV, W_QKV_BIAS, W_O, W_O_BIAS, W_POST_NORM, W_GATE_UP, W_GATE_UP_BIAS, W_DOWN, W_DOWN_BIAS,
       W_Q_NORM, W_K_NORM, W_PER_LAYER };

/* Every decoder layer of a Llama-family model for N tokens (decode, verify, prompt chunks), in one call: for steps
 * the layers' CPU path runs on these kernels too (up to 16 queries a row) the same kernels in the same order, so the
 * results are bit-identical to it; what goes is Python's and torch's per-op overhead between them.
 * x [N, hidden] is the residual stream in and the last
 * layer's output out; layer l's output is also copied to features[:, slot * hidden] where capture_slot[l] >= 0
 * (capture_slot NULL: nothing is captured); tree: a draft tree's visibility, as decode_attention's; windows: each
 * layer's sliding window, 0 for none (NULL: no layer slides), as decode_attention's window. q8: the
 * table's projections are q8_weight (linear_q8: a DFlash drafter's int8 tables), else bf16 kernel weights.
 * Returns 0 (nothing done) where this build has no bf16 linear kernel (or no int8 one, with q8) or a projection's
 * width is not a multiple of 32. */
int llama_layers_bf16(uint16_t *x, const uint16_t *const *w, int64_t n_layers, uint16_t *k_cache,
                      uint16_t *v_cache, int64_t layer_stride, const uint16_t *cos, const uint16_t *sin, int64_t rot,
                      const int64_t *rows, const int64_t *positions, const int64_t *lens, int64_t N, int64_t hidden,
                      int64_t H, int64_t KVH, int64_t D, int64_t inter, int64_t max_len, float eps, float qk_eps,
                      float scale, const int64_t *capture_slot, uint16_t *features, int64_t n_capture, int64_t q8,
                      const int64_t *tree, const int64_t *windows) {
#if defined(__AVX512BF16__) || defined(HAVE_AVX2_LINEAR)
    if (hidden % 32 || (H * D) % 32 || inter % 32) return 0;
#if !defined(HAVE_SCREEN)
    if (q8) return 0;
#endif
    const int64_t qkv_width = (H + 2 * KVH) * D;
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)N * (size_t)(2 * hidden + qkv_width + 2 * H * D + 3 * inter));
    if (!h) return 0;
    uint16_t *tmp = h + N * hidden, *qkv = tmp + N * hidden, *q = qkv + N * qkv_width, *attn = q + N * H * D;
    uint16_t *gate_up = attn + N * H * D, *act = gate_up + N * 2 * inter;
    for (int64_t l = 0; l < n_layers; l++) {
        const uint16_t *const *lw = w + l * W_PER_LAYER;
        uint16_t *kc = k_cache + l * layer_stride, *vc = v_cache + l * layer_stride;
        rms_norm_bf16(x, NULL, NULL, lw[W_IN_NORM], h, N, hidden, eps);
        linear_table(q8, h, lw[W_QKV], lw[W_QKV_BIAS], qkv, N, qkv_width, hidden);
        qkv_rotary_write_bf16(qkv, cos, sin, lw[W_Q_NORM], lw[W_K_NORM], qk_eps, rows, positions, q, kc, vc, N, H,
                              KVH, D, rot, max_len);
        decode_attention_bf16(q, kc, vc, rows, lens, attn, N, H, KVH, max_len, D, scale, windows ? windows[l] : 0,
                              tree, NULL);
        linear_table(q8, attn, lw[W_O], lw[W_O_BIAS], tmp, N, hidden, H * D);
        rms_norm_bf16(tmp, x, x, lw[W_POST_NORM], h, N, hidden, eps); /* x += attention; h = norm(x) */
        linear_table(q8, h, lw[W_GATE_UP], lw[W_GATE_UP_BIAS], gate_up, N, 2 * inter, hidden);
        silu_mul_bf16(gate_up, act, N, inter);
        linear_table(q8, act, lw[W_DOWN], lw[W_DOWN_BIAS], tmp, N, hidden, inter);
        add_bf16(x, tmp, N, hidden);
        if (capture_slot && capture_slot[l] >= 0)
            for (int64_t i = 0; i < N; i++)
                memcpy(features + (i * n_capture + capture_slot[l]) * hidden, x + i * hidden,
                       sizeof(uint16_t) * (size_t)hidden);
    }
    free(h);
    return 1;
#else
    (void)x, (void)w, (void)n_layers, (void)k_cache, (void)v_cache, (void)layer_stride, (void)cos, (void)sin;
    (void)rot, (void)rows, (void)positions, (void)lens, (void)N, (void)hidden, (void)H, (void)KVH, (void)D;
    (void)inter, (void)max_len, (void)eps, (void)qk_eps, (void)scale, (void)capture_slot, (void)features;
    (void)n_capture, (void)q8, (void)tree, (void)windows;
    return 0;
#endif
}

/* Pointers in dflash_step_bf16's context table: the drafter's fc, hidden norm and final norm, then per layer its
 * k/v projection (kernel layout), k/v bias (or NULL) and k norm (or NULL). */
enum { C_FC, C_HIDDEN_NORM, C_FINAL_NORM, C_FIXED };
enum { C_KV, C_KV_BIAS, C_K_NORM, C_PER_LAYER };

/* A DFlash drafter's whole step in one call. The target features of n_ctx newly committed tokens
 * ([n_ctx, feature_width]) go through fc and the hidden norm and, in every layer, through the k/v projection, k norm
 * and rotary into the cache at (ctx_rows[i], ctx_positions[i]) (DFlashDrafter.project_context); then the block's N
 * queries run every layer (llama_layers_bf16, arguments as there) and the final norm into out [N, hidden]
 * (forward_block). The same kernels in the same order as those calls, so the results are bit-identical; what goes
 * is the Python and torch dispatch between them (q8: every projection int8, as in llama_layers_bf16). Returns 0
 * where a linear has no kernel (before anything is written) or llama_layers_bf16 declines (the caller's fallback
 * then writes the same context K/V again). */
int dflash_step_bf16(const uint16_t *features, int64_t n_ctx, int64_t feature_width, const uint16_t *const *ctx_w,
                     float hidden_eps, const uint16_t *ctx_cos, const uint16_t *ctx_sin, const int64_t *ctx_rows,
                     const int64_t *ctx_positions, uint16_t *x, const uint16_t *const *w, int64_t n_layers,
                     uint16_t *k_cache, uint16_t *v_cache, int64_t layer_stride, const uint16_t *cos,
                     const uint16_t *sin, int64_t rot, const int64_t *rows, const int64_t *positions,
                     const int64_t *lens, int64_t N, int64_t hidden, int64_t H, int64_t KVH, int64_t D, int64_t inter,
                     int64_t max_len, float eps, float qk_eps, float scale, uint16_t *out, int64_t q8) {
    const int64_t kv_width = 2 * KVH * D;
    if (hidden % 32 || (H * D) % 32 || inter % 32 ||
        (!q8 && (!linear_layout_bf16(hidden, feature_width) || !linear_layout_bf16(kv_width, hidden))))
        return 0;
#if !defined(HAVE_SCREEN)
    if (q8) return 0;
#endif
    uint16_t *ctx = malloc(sizeof(uint16_t) * (size_t)(n_ctx > 0 ? n_ctx : 1) * (size_t)(2 * hidden + kv_width));
    if (!ctx) return 0;
    uint16_t *normed = ctx + n_ctx * hidden, *kv = normed + n_ctx * hidden;
    if (n_ctx > 0) {
        linear_table(q8, features, ctx_w[C_FC], NULL, ctx, n_ctx, hidden, feature_width);
        rms_norm_bf16(ctx, NULL, NULL, ctx_w[C_HIDDEN_NORM], normed, n_ctx, hidden, hidden_eps);
        for (int64_t l = 0; l < n_layers; l++) {
            const uint16_t *const *lw = ctx_w + C_FIXED + l * C_PER_LAYER;
            linear_table(q8, normed, lw[C_KV], lw[C_KV_BIAS], kv, n_ctx, kv_width, hidden);
            qkv_rotary_write_bf16(kv, ctx_cos, ctx_sin, NULL, lw[C_K_NORM], qk_eps, ctx_rows, ctx_positions, NULL,
                                  k_cache + l * layer_stride, v_cache + l * layer_stride, n_ctx, 0, KVH, D, rot,
                                  max_len);
        }
    }
    free(ctx);
    const int done = llama_layers_bf16(x, w, n_layers, k_cache, v_cache, layer_stride, cos, sin, rot, rows, positions,
                                       lens, N, hidden, H, KVH, D, inter, max_len, eps, qk_eps, scale, NULL, NULL, 0,
                                       q8, NULL, NULL);
    if (done) rms_norm_bf16(x, NULL, NULL, ctx_w[C_FINAL_NORM], out, N, hidden, eps);
    return done;
}
