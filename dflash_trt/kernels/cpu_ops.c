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

/* s[g, t] = scale * q[g] . K[t] for G query heads and n keys. */
static void scores_f32(const float *q, const float *K, int64_t n, int64_t G, int64_t D, float scale, float *s) {
    for (int64_t t = 0; t < n; t++) {
        const float *kt = K + t * D;
        for (int64_t g = 0; g < G; g++) {
            const float *qg = q + g * D;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t j = 0; j < D; j++) dot += qg[j] * kt[j];
            s[g * n + t] = dot * scale;
        }
    }
}

/* bf16 products summed in fp32, as torch's bf16 matmul computes them (AVX512-BF16 dot products where the CPU
 * has them and the head size is a multiple of 32). */
static void scores_bf16(const uint16_t *q, const uint16_t *K, int64_t n, int64_t G, int64_t D, float scale, float *s) {
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
        return;
    }
#endif
    for (int64_t t = 0; t < n; t++) {
        const uint16_t *kt = K + t * D;
        for (int64_t g = 0; g < G; g++) {
            const uint16_t *qg = q + g * D;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t j = 0; j < D; j++) dot += bf16_to_f32(qg[j]) * bf16_to_f32(kt[j]);
            s[g * n + t] = dot * scale;
        }
    }
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
