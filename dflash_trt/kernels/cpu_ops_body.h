/* One dtype's kernels; cpu_ops.c includes this once per dtype with T, LOAD, STORE and SFX defined.
 * Every kernel accumulates in fp32 and rounds where the torch reference rounds, so a bf16 result differs
 * from the reference only by the order of a sum (tests/kernels/test_cpu_ops.py). */

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

/* weight * rms_norm(x) of one row of d into dst, rounded as the torch module rounds: the layers' norms row by row,
 * and Qwen3's per-head q/k norms. */
static void CAT(norm_row_, SFX)(const T *x, const T *weight, float eps, int64_t d, T *dst) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < d; j++) ss += LOAD(x[j]) * LOAD(x[j]);
    const float r = 1.0f / sqrtf(ss / (float)d + eps);
    for (int64_t j = 0; j < d; j++) dst[j] = STORE(LOAD(weight[j]) * LOAD(STORE(LOAD(x[j]) * r)));
}

/* Row i of rms_norm below. */
static void CAT(rms_norm_row_, SFX)(const T *x, const T *residual, T *sum_out, const T *weight, T *out, int64_t i,
                                    int64_t d, float eps) {
    const T *xi = x + i * d;
    if (residual) {
        const T *ri = residual + i * d;
        T *si = sum_out + i * d;
        for (int64_t j = 0; j < d; j++) si[j] = STORE(LOAD(xi[j]) + LOAD(ri[j]));
        xi = si;
    }
    CAT(norm_row_, SFX)(xi, weight, eps, d, out + i * d);
}

/* out = weight * rms_norm(x) over rows of d; with residual: x + residual is rounded, written to sum_out and
 * normalised (the pre-norm residual add of a decoder layer in one pass). */
void CAT(rms_norm_, SFX)(const T *x, const T *residual, T *sum_out, const T *weight, T *out,
                         int64_t n, int64_t d, float eps) {
    if (n >= PARALLEL_MIN_ROWS) {
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) CAT(rms_norm_row_, SFX)(x, residual, sum_out, weight, out, i, d, eps);
    } else {
        for (int64_t i = 0; i < n; i++) CAT(rms_norm_row_, SFX)(x, residual, sum_out, weight, out, i, d, eps);
    }
}

/* s[t] = scale * q . K[t] for n keys, where scores_fast_* declines. */
static void CAT(scores_, SFX)(const T *q, const T *K, int64_t n, int64_t D, float scale, float *s) {
    if (CAT(scores_fast_, SFX)(q, K, n, D, scale, s)) return;
    for (int64_t t = 0; t < n; t++) {
        const T *kt = K + t * D;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t j = 0; j < D; j++) dot += LOAD(q[j]) * LOAD(kt[j]);
        s[t] = dot * scale;
    }
}

/* acc[r, j] = sum over t < n[r] of p[r][t] * V[t, j] for R queries, each in key order. */
static void CAT(values_, SFX)(const float *const *p, const int64_t *n, int64_t R, const T *V, int64_t D, float *acc) {
    if (CAT(values_fast_, SFX)(p, n, R, V, D, acc)) return;
    for (int64_t r = 0; r < R; r++) {
        float *a = acc + r * D;
        for (int64_t j = 0; j < D; j++) a[j] = 0.0f;
        for (int64_t t = 0; t < n[r]; t++) {
            const T *vt = V + t * D;
            const float pt = p[r][t];
#pragma omp simd
            for (int64_t j = 0; j < D; j++) a[j] = fmaf(pt, LOAD(vt[j]), a[j]);
        }
    }
}

/* One query per row against that row's cached keys [0, lens[b]) (the last `window` of them when window > 0).
 * tree (or NULL): per query a (start, bits) pair of int64; keys t >= start are then visible only where bit t - start
 * of bits is set (a draft tree's ancestors, verify_tree in spec/draft_tree.py). A hidden key's weight is exactly 0 and
 * the softmax's sum runs over the visible keys packed together, so a node's output is bit for bit what a chain of its
 * ancestors would give: the same terms in the same order. A window counts a node's keys as that chain would: from its
 * position start + depth (depth + 1 = its bits set); one shorter than the node's path hides its shallowest ancestors
 * (its lowest bits: a parent precedes its children) and every key before the tree.
 * q: [B, H, D]; k_cache, v_cache: one layer, [cache rows, KVH, max_len, D]; out: [B, H, D]. Consecutive queries of
 * one cache row form a run that reads each key and value once per head; the (run, query head) pairs are spread over
 * the OpenMP threads (per KV head there were too few of them to share two threads evenly at decode: SmolLM2's 3 KV
 * heads left one thread two thirds of the work). Each query's scores, softmax and sum are computed as they would be
 * alone, so its output does not depend on the others. sinks (or NULL): per query head a logit that joins the softmax's
 * denominator, its term added last, and weighs no value (gpt-oss). */
void CAT(decode_attention_, SFX)(const T *q, const T *k_cache, const T *v_cache, const int64_t *rows,
                                 const int64_t *lens, T *out, int64_t B, int64_t H, int64_t KVH, int64_t max_len,
                                 int64_t D, float scale, int64_t window, const int64_t *tree, const float *sinks) {
    const int64_t G = H / KVH;
    int64_t *run_start = malloc(sizeof(int64_t) * (size_t)(B + 1)), runs = 0, work = 0;
    if (!run_start) abort();
    /* a query whose window hides keys runs alone (its keys start where its window does); the rest share runs */
#define SEEN(b) (tree ? tree[2 * (b)] + __builtin_popcountll((uint64_t)tree[2 * (b) + 1]) : lens[b])
#define HIDES(b) (window > 0 && SEEN(b) > window)
    for (int64_t b = 0; b < B; b++) {
        work += lens[b];
        if (b == 0 || HIDES(b) || HIDES(b - 1) || rows[b] != rows[b - 1] || b - run_start[runs - 1] == MAX_QUERY_RUN)
            run_start[runs++] = b;
    }
    run_start[runs] = B;
    /* Runs in the order first, last, second, second to last, ...: a prompt chunk's later runs see more keys, and
     * the threads' contiguous shares of the runs in order left one waiting; a run's heads stay together, so the query
     * heads of one KV head share its keys in cache. */
#pragma omp parallel if (work * H * D >= 65536)
    {
    int configured = 0; /* this thread's tiles, for scores_run */
#pragma omp for schedule(static)
    for (int64_t item = 0; item < runs * H; item++) {
        const int64_t at = item / H, run = at % 2 ? runs - 1 - at / 2 : at / 2;
        const int64_t first = run_start[run], R = run_start[run + 1] - first, h = item % H;
        /* a run of several hides nothing; a node whose window ends inside its path drops that many ancestors */
        int64_t start = HIDES(first) ? SEEN(first) - window : 0, dropped = 0;
        if (tree && start > tree[2 * first]) dropped = start - tree[2 * first], start = tree[2 * first];
        const int64_t base = ((rows[first] * KVH + h / G) * max_len + start) * D;
        int64_t n[MAX_QUERY_RUN], total = 0;
        const float *p[MAX_QUERY_RUN];
        for (int64_t r = 0; r < R; r++) n[r] = lens[first + r] - start, total += n[r];
        float *buf = malloc(sizeof(float) * (size_t)(R * D + total + (tree ? total : 0)));
        if (!buf) abort();
        float *acc = buf, *s = buf + R * D, *packed = s + total;
        float *run_s[MAX_QUERY_RUN];
        for (int64_t r = 0, offset = 0; r < R; offset += n[r], r++) run_s[r] = s + offset;
        const int run_scored = CAT(scores_run_, SFX)(q + (first * H + h) * D, H * D, R, k_cache + base, n, D, scale,
                                                     run_s, &configured);
        for (int64_t r = 0; r < R; r++) {
            if (!run_scored) CAT(scores_, SFX)(q + ((first + r) * H + h) * D, k_cache + base, n[r], D, scale, s);
            int64_t from = n[r]; /* keys [from, n[r]) are the tree's: visible by their bit */
            uint64_t bits = 0;
            if (tree) {
                from = tree[2 * (first + r)] - start;
                bits = (uint64_t)tree[2 * (first + r) + 1];
                for (int64_t k = 0; k < dropped; k++) bits &= bits - 1; /* its lowest set bit */
                for (int64_t t = from; t < n[r]; t++)
                    if (!((bits >> (t - from)) & 1u)) s[t] = -INFINITY;
            }
            float m = -INFINITY, sum = 0.0f;
            /* vectorised: as a scalar loop the max's dependency chain took a quarter of the kernel's time */
#pragma omp simd reduction(max : m)
            for (int64_t t = 0; t < n[r]; t++) m = s[t] > m ? s[t] : m;
            if (sinks && sinks[h] > m) m = sinks[h];
#pragma omp simd
            for (int64_t t = 0; t < n[r]; t++) s[t] = exp_nonpositive(s[t] - m);
            const float *terms = s;
            int64_t count = n[r];
            if (from < n[r]) { /* hidden keys are exact zeros: drop them so the sum's lanes see a chain's terms */
                memcpy(packed, s, sizeof(float) * (size_t)from);
                count = from;
                for (int64_t t = from; t < n[r]; t++)
                    if ((bits >> (t - from)) & 1u) packed[count++] = s[t];
                terms = packed;
            }
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < count; t++) sum += terms[t];
            if (sinks) sum += exp_nonpositive(sinks[h] - m);
            const float inv = 1.0f / sum;
            for (int64_t t = 0; t < n[r]; t++) s[t] *= inv;
            p[r] = s;
            s += n[r];
        }
        CAT(values_, SFX)(p, n, R, v_cache + base, D, acc);
        for (int64_t r = 0; r < R; r++) {
            T *o = out + ((first + r) * H + h) * D;
            for (int64_t j = 0; j < D; j++) o[j] = STORE(acc[r * D + j]);
        }
        free(buf);
    }
    release_tiles(configured);
    }
    free(run_start);
#undef HIDES
#undef SEEN
}

/* Neox rotary on the leading `rot` channels (x * cos + rotate_half(x) * sin, each product rounded, as torch's
 * elementwise ops round them); the rest pass through. */
static void CAT(rotary_, SFX)(const T *x, const T *cos, const T *sin, int64_t d, int64_t rot, T *dst) {
    const int64_t half = rot / 2;
    for (int64_t j = 0; j < half; j++)
        dst[j] = STORE(LOAD(STORE(LOAD(x[j]) * LOAD(cos[j]))) + LOAD(STORE(-LOAD(x[j + half]) * LOAD(sin[j]))));
    for (int64_t j = half; j < rot; j++)
        dst[j] = STORE(LOAD(STORE(LOAD(x[j]) * LOAD(cos[j]))) + LOAD(STORE(LOAD(x[j - half]) * LOAD(sin[j]))));
    for (int64_t j = rot; j < d; j++) dst[j] = x[j];
}

/* Token i of qkv_rotary_write below; with skip_last, a token at the cache's last position writes q alone. */
static void CAT(qkv_rotary_row_, SFX)(const T *qkv, const T *cos, const T *sin, const T *q_norm, const T *k_norm,
                                      float eps, const int64_t *rows, const int64_t *positions, T *q_out, T *k_cache,
                                      T *v_cache, int64_t i, int64_t H, int64_t KVH, int64_t D, int64_t rot,
                                      int64_t max_len, int skip_last) {
    T normed[D];
    const T *src = qkv + i * (H + 2 * KVH) * D;
    const T *c = cos + i * rot, *s = sin + i * rot;
    for (int64_t h = 0; h < H; h++) {
        const T *x = src + h * D;
        if (q_norm) {
            CAT(norm_row_, SFX)(x, q_norm, eps, D, normed);
            x = normed;
        }
        CAT(rotary_, SFX)(x, c, s, D, rot, q_out + (i * H + h) * D);
    }
    if (skip_last && positions[i] == max_len - 1) return;
    for (int64_t h = 0; h < KVH; h++) {
        const int64_t at = ((rows[i] * KVH + h) * max_len + positions[i]) * D;
        const T *x = src + (H + h) * D;
        if (k_norm) {
            CAT(norm_row_, SFX)(x, k_norm, eps, D, normed);
            x = normed;
        }
        CAT(rotary_, SFX)(x, c, s, D, rot, k_cache + at);
        memcpy(v_cache + at, src + (H + KVH + h) * D, sizeof(T) * (size_t)D);
    }
}

/* The attention block's input side for N tokens of fused q/k/v projections ([N, (H + 2 KVH) * D]): optional
 * per-head norms on q and k, rotary at each token's position (cos/sin: [N, rot]), q to q_out ([N, H, D]), and k, v
 * written into one layer of the cache ([cache rows, KVH, max_len, D]) at (rows[i], positions[i]). */
void CAT(qkv_rotary_write_, SFX)(const T *qkv, const T *cos, const T *sin, const T *q_norm, const T *k_norm,
                                 float eps, const int64_t *rows, const int64_t *positions, T *q_out, T *k_cache,
                                 T *v_cache, int64_t N, int64_t H, int64_t KVH, int64_t D, int64_t rot,
                                 int64_t max_len) {
    if (N >= PARALLEL_MIN_ROWS) {
        /* A prompt chunk's padding is written at the cache's last position (never a live one), several tokens of a
         * row at once: those writes go after the parallel pass, in token order, as the serial loop makes them. */
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < N; i++)
            CAT(qkv_rotary_row_, SFX)(qkv, cos, sin, q_norm, k_norm, eps, rows, positions, q_out, k_cache, v_cache, i,
                                      H, KVH, D, rot, max_len, 1);
        for (int64_t i = 0; i < N; i++)
            if (positions[i] == max_len - 1)
                CAT(qkv_rotary_row_, SFX)(qkv, cos, sin, q_norm, k_norm, eps, rows, positions, q_out, k_cache,
                                          v_cache, i, H, KVH, D, rot, max_len, 0);
    } else {
        for (int64_t i = 0; i < N; i++)
            CAT(qkv_rotary_row_, SFX)(qkv, cos, sin, q_norm, k_norm, eps, rows, positions, q_out, k_cache, v_cache, i,
                                      H, KVH, D, rot, max_len, 0);
    }
}

/* silu(gate) * up for [N, 2 * I] fused gate/up projections -> [N, I], rounded after the silu as torch rounds. */
void CAT(silu_mul_, SFX)(const T *gate_up, T *out, int64_t N, int64_t I) {
#pragma omp parallel for schedule(static) if (N * I >= 8192)
    for (int64_t i = 0; i < N; i++) {
        const T *g = gate_up + i * 2 * I, *u = g + I;
        T *o = out + i * I;
#pragma omp simd
        for (int64_t j = 0; j < I; j++) {
            const float x = LOAD(g[j]);
            const float e = exp_nonpositive(x > 0.0f ? -x : x); /* exp(-|x|) */
            /* the numerator selected, not the division: a division under a condition kept this loop scalar
             * without AVX-512's masks (5x slower than torch's silu on an AVX2 CPU) */
            const float xe = x * e;
            const float silu = (x > 0.0f ? x : xe) / (1.0f + e);
            o[j] = STORE(LOAD(STORE(silu)) * LOAD(u[j]));
        }
    }
}

#undef CAT
#undef CAT_
