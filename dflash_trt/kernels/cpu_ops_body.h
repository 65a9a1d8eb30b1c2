/* One dtype's kernels; cpu_ops.c includes this once per dtype with T, LOAD, STORE and SFX defined.
 * Every kernel accumulates in fp32 and rounds where the torch reference rounds, so a bf16 result differs
 * from the reference only by the order of a sum (tests/kernels/test_cpu_ops.py). */

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

/* out = weight * rms_norm(x) over rows of d; with residual: x + residual is rounded, written to sum_out and
 * normalised (the pre-norm residual add of a decoder layer in one pass). */
void CAT(rms_norm_, SFX)(const T *x, const T *residual, T *sum_out, const T *weight, T *out,
                         int64_t n, int64_t d, float eps) {
    for (int64_t i = 0; i < n; i++) {
        const T *xi = x + i * d;
        T *oi = out + i * d;
        float ss = 0.0f;
        if (residual) {
            const T *ri = residual + i * d;
            T *si = sum_out + i * d;
            for (int64_t j = 0; j < d; j++) si[j] = STORE(LOAD(xi[j]) + LOAD(ri[j]));
            xi = si;
        }
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < d; j++) {
            float v = LOAD(xi[j]);
            ss += v * v;
        }
        float r = 1.0f / sqrtf(ss / (float)d + eps);
        for (int64_t j = 0; j < d; j++) oi[j] = STORE(LOAD(weight[j]) * LOAD(STORE(LOAD(xi[j]) * r)));
    }
}

/* One query per row against that row's cached keys [0, lens[b]) (the last `window` of them when window > 0).
 * q: [B, H, D]; k_cache, v_cache: one layer, [cache rows, KVH, max_len, D]; out: [B, H, D]. Query heads of one
 * KV head share each key and value as it is loaded; (row, KV head) pairs are spread over the OpenMP threads. */
void CAT(decode_attention_, SFX)(const T *q, const T *k_cache, const T *v_cache, const int64_t *rows,
                                 const int64_t *lens, T *out, int64_t B, int64_t H, int64_t KVH, int64_t max_len,
                                 int64_t D, float scale, int64_t window) {
    const int64_t G = H / KVH;
    int64_t work = 0;
    for (int64_t b = 0; b < B; b++) work += lens[b];
#pragma omp parallel for collapse(2) schedule(static) if (work * KVH * G * D >= 65536)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t kh = 0; kh < KVH; kh++) {
            const int64_t len = lens[b];
            const int64_t start = (window > 0 && len > window) ? len - window : 0;
            const int64_t n = len - start;
            const int64_t base = ((rows[b] * KVH + kh) * max_len + start) * D;
            const T *K = k_cache + base, *V = v_cache + base;
            const T *qb = q + (b * H + kh * G) * D;
            float *acc = malloc(sizeof(float) * (size_t)(G * D + G * n));
            float *s = acc + G * D; /* [G, n] */
            CAT(scores_, SFX)(qb, K, n, G, D, scale, s);
            for (int64_t g = 0; g < G; g++) {
                float *sg = s + g * n;
                float m = -INFINITY, sum = 0.0f;
                for (int64_t t = 0; t < n; t++) m = sg[t] > m ? sg[t] : m;
#pragma omp simd reduction(+ : sum)
                for (int64_t t = 0; t < n; t++) {
                    sg[t] = exp_nonpositive(sg[t] - m);
                    sum += sg[t];
                }
                float inv = 1.0f / sum;
                for (int64_t t = 0; t < n; t++) sg[t] *= inv;
            }
            for (int64_t j = 0; j < G * D; j++) acc[j] = 0.0f;
            for (int64_t t = 0; t < n; t++) {
                const T *vt = V + t * D;
                for (int64_t g = 0; g < G; g++) {
                    const float p = s[g * n + t];
                    float *ag = acc + g * D;
#pragma omp simd
                    for (int64_t j = 0; j < D; j++) ag[j] += p * LOAD(vt[j]);
                }
            }
            T *ob = out + (b * H + kh * G) * D;
            for (int64_t j = 0; j < G * D; j++) ob[j] = STORE(acc[j]);
            free(acc);
        }
    }
}

#undef CAT
#undef CAT_
