/* CPU kernels for the decode step of this project's runtime: the small per-layer operations that cost more in
 * torch's per-op dispatch than in arithmetic at decode sizes (benchmarks/bench_cpu_ops.py). Built on first use by
 * dflash_trt/kernels/cpu_ops.py with the machine's C compiler; torch ops stand in when there is none. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

typedef union {
    uint32_t u;
    float f;
} bits32;

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

/* The attention scores s[g, t] = scale * q[g] . K[t] with AVX512-BF16 dot products (bf16 products summed in fp32,
 * as torch's bf16 matmul computes them) where the CPU has them and the head size is a multiple of 32; returns 0
 * where it does not, and the body's portable loop runs. */
static int scores_fast_bf16(const uint16_t *q, const uint16_t *K, int64_t n, int64_t G, int64_t D, float scale,
                            float *s) {
#if defined(__AVX512BF16__)
    if (D % 32 == 0) {
        for (int64_t t = 0; t < n; t++) {
            const uint16_t *kt = K + t * D;
            for (int64_t g = 0; g < G; g++) {
                const uint16_t *qg = q + g * D;
                __m512 acc = _mm512_setzero_ps();
                for (int64_t j = 0; j < D; j += 32)
                    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qg + j),
                                           (__m512bh)_mm512_loadu_si512(kt + j));
                s[g * n + t] = _mm512_reduce_add_ps(acc) * scale;
            }
        }
        return 1;
    }
#endif
    (void)q, (void)K, (void)n, (void)G, (void)D, (void)scale, (void)s;
    return 0;
}

static int scores_fast_f32(const float *q, const float *K, int64_t n, int64_t G, int64_t D, float scale, float *s) {
    (void)q, (void)K, (void)n, (void)G, (void)D, (void)scale, (void)s;
    return 0;
}

#if defined(__AVX512BF16__)
/* R input rows x J output features per pass over K (K % 32 == 0), then the next J rows of w are prefetched while
 * this pass computes: without it the loads outrun the hardware prefetcher and the GEMV falls well short of the
 * memory bandwidth at 4+ rows. The prefetch goes to L2 (T1), not L1: into L1 it stalls on the line fill buffers,
 * which the pass's own loads need, and a 3-row verify step took 1.4x a 1-row decode on a Xeon with AMX (1.25x
 * into L2; SmolLM2-135M's 30 layers, 13.0 against 10.9 ms). Every (row, feature) dot runs the same instruction sequence whatever R, J and the
 * number of rows in the call, so a row's output does not depend on the batch it came in. */
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

/* y [M, N] = x [M, K] @ w[N, K]^T (+ bias), bf16 in and out, fp32 sums; returns 0 where this build or shape has
 * no kernel (the caller runs torch's linear). */
int linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M, int64_t N,
                int64_t K) {
#if defined(__AVX512BF16__)
    if (K % 32 != 0) return 0;
    const int64_t wide = N / 4;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < wide + N % 4; t++) {
        if (t < wide)
            linear_features(x, w, bias, y, M, N, K, 4 * t, 1);
        else
            linear_features(x, w, bias, y, M, N, K, 4 * wide + (t - wide), 0);
    }
    return 1;
#else
    (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K;
    return 0;
#endif
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

/* Pointers per layer in llama_layers_bf16's weight table, in this order (bias and q/k norm entries may be NULL). */
enum { W_IN_NORM, W_QKV, W_QKV_BIAS, W_O, W_O_BIAS, W_POST_NORM, W_GATE_UP, W_GATE_UP_BIAS, W_DOWN, W_DOWN_BIAS,
       W_Q_NORM, W_K_NORM, W_PER_LAYER };

/* Every decoder layer of a Llama-family model for N tokens (decode, verify, short chunks), in one call: the same
 * kernels in the same order as LlamaDecoderLayer's CPU path, so the results are bit-identical to it; what goes is
 * Python's and torch's per-op overhead between them. x [N, hidden] is the residual stream in and the last
 * layer's output out; layer l's output is also copied to features[:, slot * hidden] where capture_slot[l] >= 0.
 * Returns 0 (nothing done) where this build has no bf16 linear kernel or a projection's width is not a multiple
 * of 32. */
int llama_layers_bf16(uint16_t *x, const uint16_t *const *w, int64_t n_layers, uint16_t *k_cache,
                      uint16_t *v_cache, int64_t layer_stride, const uint16_t *cos, const uint16_t *sin, int64_t rot,
                      const int64_t *rows, const int64_t *positions, const int64_t *lens, int64_t N, int64_t hidden,
                      int64_t H, int64_t KVH, int64_t D, int64_t inter, int64_t max_len, float eps, float qk_eps,
                      float scale, const int64_t *capture_slot, uint16_t *features, int64_t n_capture) {
#if defined(__AVX512BF16__)
    if (hidden % 32 || (H * D) % 32 || inter % 32) return 0;
    const int64_t qkv_width = (H + 2 * KVH) * D;
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)N * (size_t)(2 * hidden + qkv_width + 2 * H * D + 3 * inter));
    if (!h) return 0;
    uint16_t *tmp = h + N * hidden, *qkv = tmp + N * hidden, *q = qkv + N * qkv_width, *attn = q + N * H * D;
    uint16_t *gate_up = attn + N * H * D, *act = gate_up + N * 2 * inter;
    for (int64_t l = 0; l < n_layers; l++) {
        const uint16_t *const *lw = w + l * W_PER_LAYER;
        uint16_t *kc = k_cache + l * layer_stride, *vc = v_cache + l * layer_stride;
        rms_norm_bf16(x, NULL, NULL, lw[W_IN_NORM], h, N, hidden, eps);
        linear_bf16(h, lw[W_QKV], lw[W_QKV_BIAS], qkv, N, qkv_width, hidden);
        qkv_rotary_write_bf16(qkv, cos, sin, lw[W_Q_NORM], lw[W_K_NORM], qk_eps, rows, positions, q, kc, vc, N, H,
                              KVH, D, rot, max_len);
        decode_attention_bf16(q, kc, vc, rows, lens, attn, N, H, KVH, max_len, D, scale, 0);
        linear_bf16(attn, lw[W_O], lw[W_O_BIAS], tmp, N, hidden, H * D);
        rms_norm_bf16(tmp, x, x, lw[W_POST_NORM], h, N, hidden, eps); /* x += attention; h = norm(x) */
        linear_bf16(h, lw[W_GATE_UP], lw[W_GATE_UP_BIAS], gate_up, N, 2 * inter, hidden);
        silu_mul_bf16(gate_up, act, N, inter);
        linear_bf16(act, lw[W_DOWN], lw[W_DOWN_BIAS], tmp, N, hidden, inter);
        for (int64_t j = 0; j < N * hidden; j++) x[j] = f32_to_bf16(bf16_to_f32(x[j]) + bf16_to_f32(tmp[j]));
        if (capture_slot[l] >= 0)
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
    (void)n_capture;
    return 0;
#endif
}
