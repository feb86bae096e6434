/* Block quantization for ZeRO++ on CPU: the format and arithmetic of zeropp/quant.py
 * (which documents them), one pass per element instead of the torch path's dozen.
 *
 * Built by zeropp/quant_cpu.py with -O3 -ffp-contract=off (no fused multiply-add: every
 * product and sum rounds as torch's separate ops do) and called through ctypes, one thread
 * per call (a rank is one thread of a multi-rank CPU job). Each block is first read into an
 * fp32 buffer, so the loops that do the arithmetic see plain fp32 arrays and vectorize.
 *
 * Bit for bit the torch path's results:
 *   scale = max|x| / div (qmax, but 2 for INT2; NaN if any x is NaN), y = x / safe_scale, clamped to +-qmax,
 *   rounded half to even with (y + 1.5 * 2^23) - 1.5 * 2^23 (|y| <= 127 < 2^22);
 *   non-finite scale: data 0; dequantized = q * scale in fp32, then one rounding to the
 *   output dtype; sums of parts in part order, each product rounded before the add.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { F32 = 0, BF16 = 1, F16 = 2 };
#define MAX_BLOCK 4096
static const float MAGIC = 12582912.0f;

static void load_block(const void *src, int dtype, int64_t first, int64_t count, int64_t bs, float *buf) {
    if (dtype == F32) {
        memcpy(buf, (const float *)src + first, (size_t)count * sizeof(float));
    } else if (dtype == BF16) {
        const uint16_t *s = (const uint16_t *)src + first;
        uint32_t *b = (uint32_t *)buf;
        for (int64_t i = 0; i < count; i++) b[i] = (uint32_t)s[i] << 16;
    } else {
        const _Float16 *s = (const _Float16 *)src + first;
        for (int64_t i = 0; i < count; i++) buf[i] = (float)s[i];
    }
    for (int64_t i = count; i < bs; i++) buf[i] = 0.0f;   /* zero padding to a whole block */
}

static inline uint16_t to_bf16(float f) {   /* round to nearest even, as c10::BFloat16 */
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static void store_values(const float *buf, int dtype, int64_t count, void *dst, int64_t first) {
    if (dtype == F32) {
        memcpy((float *)dst + first, buf, (size_t)count * sizeof(float));
    } else if (dtype == BF16) {
        uint16_t *d = (uint16_t *)dst + first;
        for (int64_t i = 0; i < count; i++) d[i] = to_bf16(buf[i]);
    } else {
        _Float16 *d = (_Float16 *)dst + first;
        for (int64_t i = 0; i < count; i++) d[i] = (_Float16)buf[i];
    }
}

/* Quantize one fp32 block of bs elements into data (int8 [bs], packed uint8 [bs/2] or [bs/4]).
 * x is scratch: it is overwritten with the rounded values. */
static void quantize_block(float *x, int64_t bs, int bits, void *data, float *scale_out) {
    const float qmax = bits == 8 ? 127.0f : bits == 4 ? 7.0f : 1.0f;
    const float div = bits == 2 ? 2.0f : qmax;   /* format.py SCALE_DIV */
    /* max|x| on the bit patterns: for non-NaN floats the order of |x|'s bits is the order of
     * |x|, and any NaN's bits exceed +inf's (an integer max vectorizes; a float one may not) */
    const uint32_t *u = (const uint32_t *)x;
    uint32_t top = 0;
    for (int64_t i = 0; i < bs; i++) {
        uint32_t a = u[i] & 0x7FFFFFFFu;
        top = a > top ? a : top;
    }
    float amax;
    memcpy(&amax, &top, 4);
    float scale = top > 0x7F800000u ? NAN : amax / div;
    *scale_out = scale;
    int8_t q[MAX_BLOCK];
    if (!isfinite(scale)) {             /* inf or NaN in the block: data 0, the scale says why */
        memset(q, 0, (size_t)bs);
    } else {
        const float safe = scale == 0.0f ? 1.0f : scale;
        for (int64_t i = 0; i < bs; i++) {
            float y = x[i] / safe;
            y = y < -qmax ? -qmax : y;
            y = y > qmax ? qmax : y;
            x[i] = (y + MAGIC) - MAGIC;
        }
        for (int64_t i = 0; i < bs; i++) q[i] = (int8_t)x[i];
    }
    if (bits == 8) {
        memcpy(data, q, (size_t)bs);
    } else if (bits == 2) {             /* four values a byte, element 4i + k in bits 2k, 2k + 1 */
        uint8_t *d = (uint8_t *)data;
        for (int64_t i = 0; i < bs / 4; i++)
            d[i] = (uint8_t)(((uint8_t)q[4 * i] & 3) | (((uint8_t)q[4 * i + 1] & 3) << 2)
                             | (((uint8_t)q[4 * i + 2] & 3) << 4) | (((uint8_t)q[4 * i + 3] & 3) << 6));
    } else {
        uint8_t *d = (uint8_t *)data;
        for (int64_t i = 0; i < bs / 2; i++)
            d[i] = (uint8_t)(((uint8_t)q[2 * i] & 0x0F) | (((uint8_t)q[2 * i + 1] & 0x0F) << 4));
    }
}

/* Block b of a quantized row as fp32 values times its scale, written into acc (first) or
 * added to it. No contraction (-ffp-contract=off): the product rounds before the add, the
 * order of the torch path. */
static void dequant_block(const uint8_t *data, const float *scales, int bits, int64_t bs, int64_t b,
                          float *acc, int first) {
    const float s = scales[b];
    if (bits == 8) {
        const int8_t *q = (const int8_t *)data + b * bs;
        if (first) for (int64_t i = 0; i < bs; i++) acc[i] = (float)q[i] * s;
        else for (int64_t i = 0; i < bs; i++) acc[i] += (float)q[i] * s;
        return;
    }
    int8_t v[MAX_BLOCK];
    if (bits == 2) {
        const uint8_t *q = data + b * bs / 4;
        for (int64_t i = 0; i < bs / 4; i++)   /* (v ^ 2) - 2 sign-extends 2 bits */
            for (int k = 0; k < 4; k++) v[4 * i + k] = (int8_t)((((q[i] >> (2 * k)) & 3) ^ 2) - 2);
    } else {
        const uint8_t *q = data + b * bs / 2;
        for (int64_t i = 0; i < bs / 2; i++) {   /* arithmetic shifts sign-extend each nibble */
            v[2 * i] = (int8_t)((int8_t)(uint8_t)(q[i] << 4) >> 4);
            v[2 * i + 1] = (int8_t)((int8_t)q[i] >> 4);
        }
    }
    if (first) for (int64_t i = 0; i < bs; i++) acc[i] = (float)v[i] * s;
    else for (int64_t i = 0; i < bs; i++) acc[i] += (float)v[i] * s;
}

int zq_max_block(void) { return MAX_BLOCK; }

/* x: numel elements of dtype -> data, scales (num_blocks of bs; the last one zero-padded). */
void zq_quantize(const void *x, int dtype, int64_t numel, int bits, int64_t bs, void *data, float *scales) {
    float buf[MAX_BLOCK];
    int64_t nb = numel > 0 ? (numel + bs - 1) / bs : 1;
    int64_t per_block = bs * bits / 8;
    for (int64_t b = 0; b < nb; b++) {
        int64_t first = b * bs, count = numel - first < bs ? numel - first : bs;
        load_block(x, dtype, first, count > 0 ? count : 0, bs, buf);
        quantize_block(buf, bs, bits, (uint8_t *)data + b * per_block, scales + b);
    }
}

/* k stacked parts (part p's data at data + p * data_stride bytes, its scales at
 * scales + p * scale_stride floats), numel elements each: part p dequantized, or, with
 * reduce, the sum over the parts times factor (skipped when factor is 1), into out
 * (dtype; row r at out + r * out_stride elements). accumulate: each row is added to what
 * out holds (read as fp32, the sum rounded once). requant_bits > 0: the sum is quantized
 * again instead, into qdata / qscales (same block size). */
void zq_dequantize(const uint8_t *data, int64_t data_stride, const float *scales, int64_t scale_stride,
                   int64_t k, int64_t numel, int bits, int64_t bs, int reduce, float factor,
                   void *out, int dtype, int64_t out_stride, int accumulate,
                   int requant_bits, void *qdata, float *qscales) {
    float acc[MAX_BLOCK];
    int64_t nb = numel > 0 ? (numel + bs - 1) / bs : 1;
    int64_t rows = reduce ? 1 : k, parts = reduce ? k : 1;
    int64_t per_block = bs * requant_bits / 8;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t b = 0; b < nb; b++) {
            int64_t first = b * bs, count = numel - first < bs ? numel - first : bs;
            if (accumulate) load_block(out, dtype, r * out_stride + first, count > 0 ? count : 0, bs, acc);
            for (int64_t p = 0; p < parts; p++) {
                int64_t row = r + p;
                dequant_block(data + row * data_stride, scales + row * scale_stride, bits, bs, b, acc,
                              p == 0 && !accumulate);
            }
            if (requant_bits) {
                quantize_block(acc, bs, requant_bits, (uint8_t *)qdata + b * per_block, qscales + b);
                continue;
            }
            if (factor != 1.0f)
                for (int64_t i = 0; i < bs; i++) acc[i] *= factor;
            if (count > 0) store_values(acc, dtype, count, out, r * out_stride + first);
        }
    }
}
