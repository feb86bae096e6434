/* CPU kernels of zeropp/kernels/sparse.py (top-k per chunk, 2-bit values): the same results,
 * bit for bit, as its torch reference. Selection by a 64-bit key per element, unique (the
 * magnitude's bits, then the complement of the index: the lower index wins a tie), so any
 * selection algorithm keeps the same set; the kept indices come out ascending. */
#include <stdint.h>
#include <string.h>
#include <math.h>

#define ZS_MAX_CHUNK 65536

static inline uint64_t key_of(float v, int64_t i, int64_t chunk) {
    uint32_t b;
    float m = fabsf(v);
    if (isnan(m)) m = INFINITY;   /* a NaN counts as an infinity */
    memcpy(&b, &m, 4);
    /* +1: the padding's key is 0, below every real element's (torch: -1 there) */
    return ((uint64_t)b + 1) << 32 | (uint64_t)(chunk - 1 - i);
}

/* the k-th largest of a[0..n) (k >= 1), reordering a: quickselect */
static uint64_t kth_largest(uint64_t *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        uint64_t p = a[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] > p) i++;
            while (a[j] < p) j--;
            if (i <= j) { uint64_t t = a[i]; a[i] = a[j]; a[j] = t; i++; j--; }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else break;
    }
    return a[want];
}

int zs_max_chunk(void) { return ZS_MAX_CHUNK; }

/* x: fp32 [numel]; scales [nc], index int32 [nc, k], codes uint8 [nc, k] */
void zs_encode(const float *x, int64_t numel, int64_t chunk, int64_t k, float *scales, int32_t *index,
               uint8_t *codes) {
    static __thread uint64_t keys[ZS_MAX_CHUNK], work[ZS_MAX_CHUNK];
    int64_t nc = numel > 0 ? (numel + chunk - 1) / chunk : 1;
    for (int64_t c = 0; c < nc; c++) {
        const float *xc = x + c * chunk;
        int64_t real = numel - c * chunk;
        if (real > chunk) real = chunk;
        if (real < 0) real = 0;
        float amax = 0.0f;
        int nan = 0;
        for (int64_t i = 0; i < chunk; i++) {
            float v = i < real ? xc[i] : 0.0f;
            float m = fabsf(v);
            if (isnan(m)) nan = 1;
            else if (m > amax) amax = m;
            keys[i] = i < real ? key_of(v, i, chunk) : (uint64_t)(chunk - 1 - i);
        }
        if (nan) amax = NAN;   /* torch's amax propagates a NaN */
        memcpy(work, keys, chunk * sizeof(uint64_t));
        uint64_t t = kth_largest(work, chunk, k);
        /* the scale: the median of the kept nonzero magnitudes, the (nz/2 + 1)-th largest key */
        int64_t nz = 0;
        for (int64_t i = 0; i < chunk; i++) nz += keys[i] >= t && keys[i] >= (2ULL << 32);
        float median = 0.0f;
        if (nz > 0) {
            uint32_t b = (uint32_t)((kth_largest(work, chunk, nz / 2 + 1) >> 32) - 1);
            memcpy(&median, &b, 4);
        }
        float s = isfinite(amax) ? median : amax;
        float half = s * 2.0f;   /* the upper level's threshold */
        scales[c] = s;
        int32_t *ic = index + c * k;
        uint8_t *cc = codes + c * k;
        int64_t j = 0;
        for (int64_t i = 0; i < chunk && j < k; i++) {
            if (keys[i] < t) continue;
            float v = i < real ? xc[i] : 0.0f;
            ic[j] = (int32_t)i;
            cc[j] = (uint8_t)(((fabsf(v) > half) << 1) | (v < 0.0f));
            j++;
        }
    }
}

/* parts: scales [parts][nc] (row stride s_stride), index [parts][nc*k], codes likewise;
 * out fp32 [numel]: the parts' decoded values summed part 0 first, times factor if do_scale */
void zs_decode_reduce(const float *scales, int64_t s_stride, const int32_t *index, const uint8_t *codes,
                      int64_t ic_stride, int64_t parts, int64_t numel, int64_t chunk, int64_t k, int do_scale,
                      float factor, float *out) {
    int64_t nc = numel > 0 ? (numel + chunk - 1) / chunk : 1;
    memset(out, 0, numel * sizeof(float));
    for (int64_t p = 0; p < parts; p++) {
        for (int64_t c = 0; c < nc; c++) {
            float s = scales[p * s_stride + c];
            const int32_t *ic = index + p * ic_stride + c * k;
            const uint8_t *cc = codes + p * ic_stride + c * k;
            for (int64_t j = 0; j < k; j++) {
                int64_t at = c * chunk + ic[j];
                if (at >= numel) continue;   /* the last chunk's padding */
                float level = (float)(1 + 2 * (cc[j] >> 1)) * s;
                out[at] += (cc[j] & 1) ? -level : level;
            }
        }
    }
    if (do_scale)
        for (int64_t i = 0; i < numel; i++) out[i] *= factor;
}
