/* The fused CPU resampler of gpuio.ops, shared by ops/_resample.c (decoded images) and
 * ops/_jpeg.c (decode + resample per image in one call); runs without the GIL.
 *
 * resample_one(): crop -> resize -> flip -> normalize -> layout -> cast of one uint8
 * HWC image, the math of gpuio.ops.fused.fused_reference (the windows and weights of
 * gpuio.ops.geometry.filter_weights) for filters whose weights are not negative
 * (nearest, linear, area). With such weights the horizontal pass of the reference never
 * leaves 0-255, so the two passes commute: this runs the vertical pass first, over
 * contiguous rows (vectorizable), then the horizontal pass with the 3 or 4 channels of a
 * pixel as one 4-lane vector (with AVX2 two output pixels per 8-lane vector, and 3-channel
 * float CHW rows written as planes straight from it), and differs from the reference by
 * float rounding only. A flip reverses the window tables, so the loops have no flip branch.
 * On x86-64 the resampler is built twice (target_clones: for AVX2 + FMA and for the
 * baseline) and picks one at run time; GPUIO_PORTABLE builds only the plain C
 * (tests/test_ops_cpu.py checks it against the fast path).
 */
#ifndef GPUIO_RESAMPLE_H
#define GPUIO_RESAMPLE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { NEAREST = 0, LINEAR = 1, CUBIC = 2, AREA = 3 };

typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));

static double filter(int interp, double d, double fscale) {
    if (interp == AREA) {
        const double half = 0.5 * fscale;
        const double w = fmin(d + 0.5, half) - fmax(d - 0.5, -half);
        return w > 0.0 ? w : 0.0;
    }
    const double x = fabs(d / fscale);
    return x < 1.0 ? 1.0 - x : 0.0;
}

/* Output pixel o of a box resized to `out` pixels reads source pixels first[o] ..
 * first[o] + count[o] - 1 (counted from `lo`) with weights w[o * taps ..], zero from
 * count[o] on; `most` is the largest count; `reverse` stores the tables of a mirrored
 * output (o -> out - 1 - o). */
typedef struct {
    int *first, *count, taps, most;
    float *w;
} Windows;

static void free_windows(Windows *win) {
    free(win->first);
    free(win->count);
    free(win->w);
}

/* Windows of the box [start, start + length) read from source pixels lo..hi-1; 0 on
 * success, -1 when out of memory. */
static int windows(int interp, int antialias, double start, double length, int out, int lo, int hi, int reverse,
                   Windows *win) {
    const double scale = length / out;
    const double fscale = (antialias && scale > 1.0) ? scale : 1.0;
    const double support = interp == AREA ? 0.5 * fscale : fscale;
    const int taps = interp == NEAREST ? 1 : (int)ceil(2.0 * support) + 2;
    win->taps = taps;
    win->most = 0;
    win->first = malloc(sizeof(int) * out);
    win->count = malloc(sizeof(int) * out);
    win->w = calloc((size_t)out * taps, sizeof(float));
    double *ws = malloc(sizeof(double) * taps);
    if (!win->first || !win->count || !win->w || !ws) {
        free(ws);
        return -1;
    }
    for (int o = 0; o < out; ++o) {
        const double c = start + (o + 0.5) * scale;
        int a, b;
        if (interp == NEAREST) {
            a = (int)floor(c);
            a = a < lo ? lo : (a > hi - 1 ? hi - 1 : a);
            b = a + 1;
        } else if (interp == AREA) {
            a = (int)floor(c - 0.5 * fscale);
            b = (int)ceil(c + 0.5 * fscale);
        } else {
            a = (int)floor(c - support + 0.5);
            b = (int)floor(c + support + 0.5);
        }
        if (a < lo) a = lo;
        if (b > hi) b = hi;
        if (b - a > taps) b = a + taps;
        if (b < a) b = a;
        double sum = 0.0;
        for (int j = a; j < b; ++j) {
            ws[j - a] = interp == NEAREST ? 1.0 : filter(interp, j + 0.5 - c, fscale);
            sum += ws[j - a];
        }
        if (sum == 0.0) sum = 1.0;
        const int at = reverse ? out - 1 - o : o;
        for (int j = a; j < b; ++j) win->w[(size_t)at * taps + j - a] = (float)(ws[j - a] / sum);
        win->first[at] = a - lo;
        win->count[at] = b - a;
        if (b - a > win->most) win->most = b - a;
    }
    free(ws);
    return 0;
}

typedef struct {
    const uint8_t *src; /* pixel (0, 0) */
    ptrdiff_t rs, cs, chs; /* strides in bytes: row, column, channel */
    double box[4]; /* y0, x0, h, w in source pixels */
    int64_t clip[4], out_hw[2], offset, flip; /* clip: y0, x0, y1, x1; offset: in output items */
    int gray; /* one source channel written as the job's three (a grayscale JPEG decoded as gray) */
} Sample;

typedef struct {
    int channels, interp, antialias, chw, to_uint8;
    const float *mean, *inv_std;
    char *out;
} Job;

/* row[i] = sum_k w[k] * src[k][i] over n packed values, one tap at a time (loops the
 * compiler vectorizes, uint8 to float included). */
static inline __attribute__((always_inline)) void vertical(float *restrict row, const uint8_t *const *src,
                                                           const float *w, int taps, int n) {
    for (int i = 0; i < n; ++i) row[i] = 0.0f;
    for (int k = 0; k < taps; ++k) {
        const uint8_t *restrict q = src[k];
        const float wk = w[k];
        for (int i = 0; i < n; ++i) row[i] += wk * q[i];
    }
}

#if defined(__x86_64__) && !defined(GPUIO_PORTABLE)
#include <immintrin.h>
#define CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))

/* vertical() with AVX2: 32 values at a time, all taps summed in registers (GCC 12
 * vectorizes the plain loops one tap at a time at best); a constant `taps` unrolls the
 * sum and keeps the broadcast weights in registers. */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void
vertical_avx2_taps(float *restrict row, const uint8_t *const *src, const float *w, const int taps, int n) {
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int k = 0; k < taps; ++k) {
            const uint8_t *q = src[k] + i;
            const __m256 wk = _mm256_set1_ps(w[k]);
#define WIDEN(at) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + (at)))))
            a0 = _mm256_fmadd_ps(wk, WIDEN(0), a0);
            a1 = _mm256_fmadd_ps(wk, WIDEN(8), a1);
            a2 = _mm256_fmadd_ps(wk, WIDEN(16), a2);
            a3 = _mm256_fmadd_ps(wk, WIDEN(24), a3);
        }
        _mm256_storeu_ps(row + i, a0);
        _mm256_storeu_ps(row + i + 8, a1);
        _mm256_storeu_ps(row + i + 16, a2);
        _mm256_storeu_ps(row + i + 24, a3);
    }
    for (; i + 8 <= n; i += 8) {
        __m256 a0 = _mm256_setzero_ps();
        for (int k = 0; k < taps; ++k) {
            const uint8_t *q = src[k] + i;
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(w[k]), WIDEN(0), a0);
        }
#undef WIDEN
        _mm256_storeu_ps(row + i, a0);
    }
    for (; i < n; ++i) {
        float acc = 0.0f;
        for (int k = 0; k < taps; ++k) acc = fmaf(w[k], src[k][i], acc);
        row[i] = acc;
    }
}

__attribute__((target("avx2,fma"))) static void vertical_avx2(float *restrict row, const uint8_t *const *src,
                                                              const float *w, int taps, int n) {
    switch (taps) { /* the tap counts of scales from 1/3 up */
    case 1: vertical_avx2_taps(row, src, w, 1, n); break;
    case 2: vertical_avx2_taps(row, src, w, 2, n); break;
    case 3: vertical_avx2_taps(row, src, w, 3, n); break;
    case 4: vertical_avx2_taps(row, src, w, 4, n); break;
    case 5: vertical_avx2_taps(row, src, w, 5, n); break;
    case 6: vertical_avx2_taps(row, src, w, 6, n); break;
    case 7: vertical_avx2_taps(row, src, w, 7, n); break;
    default: vertical_avx2_taps(row, src, w, taps, n);
    }
}

/* The horizontal pass (as horizontal_taps()) of rows of 3 or 4 channels (or of 1: lane 0 of
 * each pixel's 4 is its value, the others sum its neighbours) with AVX2, output pixels in
 * blocks of 8: pixel i of a block and pixel i + 4 share one 8-lane vector, summed over
 * `taps` = x->most taps with the weights of pair_weights(). Then clipped and normalized,
 * and stored into `px` (4 floats per pixel) or, where `planes` is given (3-channel float
 * CHW), as 8 values per plane after an in-lane 4x4 transpose. The pixels after the last
 * whole block take the 4-lane loop. */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void
horizontal_avx2_taps(float *restrict px, float *const *planes, const float *restrict row, const int C, int ow,
                     const Windows *x, const float *restrict pw, v4f mean4, v4f inv_std4, const int taps) {
    const __m256 zero = _mm256_setzero_ps(), top = _mm256_set1_ps(255.0f);
    const __m128 m4 = _mm_loadu_ps((const float *)&mean4), s4 = _mm_loadu_ps((const float *)&inv_std4);
    const __m256 mean = _mm256_set_m128(m4, m4), inv_std = _mm256_set_m128(s4, s4);
    const int blocks = ow / 8;
    const float *w = pw;
    for (int b = 0; b < blocks; ++b, w += 32 * taps) {
        const int *first = x->first + 8 * b;
#define PAIR(i)                                                                                                 \
    ({                                                                                                          \
        const float *pa = row + (size_t)first[i] * C, *pb = row + (size_t)first[(i) + 4] * C;                 \
        const float *wi = w + (i) * 8 * taps;                                                                   \
        __m256 v = zero;                                                                                        \
        for (int k = 0; k < taps; ++k)                                                                          \
            v = _mm256_fmadd_ps(_mm256_loadu_ps(wi + 8 * k), _mm256_loadu2_m128(pb + k * C, pa + k * C), v);   \
        v = _mm256_min_ps(_mm256_max_ps(v, zero), top); /* as horizontal_taps(): NaN and -0 to 0 */           \
        _mm256_mul_ps(_mm256_sub_ps(v, mean), inv_std);                                                         \
    })
        const __m256 q[4] = {PAIR(0), PAIR(1), PAIR(2), PAIR(3)};
#undef PAIR
        if (planes) {
            const __m256 t0 = _mm256_unpacklo_ps(q[0], q[1]), t1 = _mm256_unpacklo_ps(q[2], q[3]);
            const __m256 t2 = _mm256_unpackhi_ps(q[0], q[1]), t3 = _mm256_unpackhi_ps(q[2], q[3]);
            _mm256_storeu_ps(planes[0] + 8 * b, _mm256_shuffle_ps(t0, t1, 0x44));
            _mm256_storeu_ps(planes[1] + 8 * b, _mm256_shuffle_ps(t0, t1, 0xEE));
            _mm256_storeu_ps(planes[2] + 8 * b, _mm256_shuffle_ps(t2, t3, 0x44));
        } else {
            for (int i = 0; i < 4; ++i) {
                _mm_storeu_ps(px + 4 * (8 * b + i), _mm256_castps256_ps128(q[i]));
                _mm_storeu_ps(px + 4 * (8 * b + i + 4), _mm256_extractf128_ps(q[i], 1));
            }
        }
    }
    const v4f zero4 = {0.0f, 0.0f, 0.0f, 0.0f}, top4 = {255.0f, 255.0f, 255.0f, 255.0f};
    for (int ox = 8 * blocks; ox < ow; ++ox) {
        const float *p = row + (size_t)x->first[ox] * C, *w = x->w + (size_t)ox * x->taps;
        v4f v = zero4;
        for (int k = 0; k < taps; ++k) {
            v4f pixel;
            memcpy(&pixel, p + k * C, sizeof pixel);
            v += w[k] * pixel;
        }
        v = (v4f)((v4i)v & (v > zero4));
        const v4i below = v < top4;
        v = (v4f)(((v4i)v & below) | ((v4i)top4 & ~below));
        v = (v - mean4) * inv_std4;
        if (planes)
            for (int c = 0; c < 3; ++c) planes[c][ox] = v[c];
        else
            memcpy(px + 4 * ox, &v, sizeof v);
    }
}

__attribute__((target("avx2,fma"))) static void horizontal_avx2(float *restrict px, float *const *planes,
                                                                 const float *restrict row, int C, int ow,
                                                                 const Windows *x, const float *restrict pw,
                                                                 v4f mean, v4f inv_std) {
    switch (x->most) {
    case 1: horizontal_avx2_taps(px, planes, row, C, ow, x, pw, mean, inv_std, 1); break;
    case 2: horizontal_avx2_taps(px, planes, row, C, ow, x, pw, mean, inv_std, 2); break;
    case 3: horizontal_avx2_taps(px, planes, row, C, ow, x, pw, mean, inv_std, 3); break;
    case 4: horizontal_avx2_taps(px, planes, row, C, ow, x, pw, mean, inv_std, 4); break;
    case 5: horizontal_avx2_taps(px, planes, row, C, ow, x, pw, mean, inv_std, 5); break;
    case 6: horizontal_avx2_taps(px, planes, row, C, ow, x, pw, mean, inv_std, 6); break;
    case 7: horizontal_avx2_taps(px, planes, row, C, ow, x, pw, mean, inv_std, 7); break;
    default: horizontal_avx2_taps(px, planes, row, C, ow, x, pw, mean, inv_std, x->most);
    }
}

/* x's weights in the order horizontal_avx2() reads them: per block of 8 output pixels,
 * pair i (pixels i and i + 4) and tap k, pixel i's weight 4 times, then pixel i + 4's;
 * NULL when out of memory. */
static float *pair_weights(const Windows *x, int ow) {
    const int taps = x->most, blocks = ow / 8;
    float *pw = malloc(sizeof(float) * ((size_t)blocks * 32 * taps + 1));
    if (!pw) return NULL;
    for (int b = 0; b < blocks; ++b)
        for (int i = 0; i < 4; ++i)
            for (int k = 0; k < taps; ++k)
                for (int h = 0; h < 2; ++h) {
                    const float w = x->w[(size_t)(8 * b + i + 4 * h) * x->taps + k];
                    float *at = pw + ((size_t)(4 * b + i) * taps + k) * 8 + 4 * h;
                    at[0] = at[1] = at[2] = at[3] = w;
                }
    return pw;
}
#define VERTICAL(row, src, w, taps, n) \
    (avx2 ? vertical_avx2(row, src, w, taps, n) : vertical(row, src, w, taps, n))
#else
#define CLONES
#define VERTICAL(row, src, w, taps, n) vertical(row, src, w, taps, n)
#endif

/* The horizontal pass of one output row from the vertical pass's `row` (C values per
 * pixel; readable and finite up to pixel width + x->most, plus one float for C = 3),
 * clipped to 0-255 and normalized, into `px` (4 floats per output pixel). Every pixel
 * sums `taps` = x->most taps (the extra weights are 0); a constant `taps` unrolls the
 * sum (3 or 4 channels: one 4-lane multiply-add per tap). */
static inline __attribute__((always_inline)) void horizontal_taps(float *restrict px, const float *restrict row,
                                                                  const int C, int ow, const Windows *x, v4f mean,
                                                                  v4f inv_std, const int taps) {
    const v4f zero = {0.0f, 0.0f, 0.0f, 0.0f}, top = {255.0f, 255.0f, 255.0f, 255.0f};
    for (int ox = 0; ox < ow; ++ox) {
        const float *p = row + (size_t)x->first[ox] * C, *w = x->w + (size_t)ox * x->taps;
        v4f v = zero;
        if (C >= 3) {
            for (int k = 0; k < taps; ++k) {
                v4f pixel;
                memcpy(&pixel, p + k * C, sizeof pixel);
                v += w[k] * pixel;
            }
        } else {
            for (int k = 0; k < taps; ++k)
                for (int c = 0; c < C; ++c) v[c] += w[k] * p[k * C + c];
        }
        v = (v4f)((v4i)v & (v > zero)); /* clip to 0-255 with masks: vector code on any target */
        const v4i below = v < top;
        v = (v4f)(((v4i)v & below) | ((v4i)top & ~below));
        v = (v - mean) * inv_std;
        memcpy(px + 4 * ox, &v, sizeof v);
    }
}

static inline __attribute__((always_inline)) void horizontal(float *restrict px, const float *restrict row,
                                                             const int C, int ow, const Windows *x, v4f mean,
                                                             v4f inv_std) {
    switch (x->most) { /* the tap counts of scales from 1/3 up */
    case 1: horizontal_taps(px, row, C, ow, x, mean, inv_std, 1); break;
    case 2: horizontal_taps(px, row, C, ow, x, mean, inv_std, 2); break;
    case 3: horizontal_taps(px, row, C, ow, x, mean, inv_std, 3); break;
    case 4: horizontal_taps(px, row, C, ow, x, mean, inv_std, 4); break;
    case 5: horizontal_taps(px, row, C, ow, x, mean, inv_std, 5); break;
    case 6: horizontal_taps(px, row, C, ow, x, mean, inv_std, 6); break;
    case 7: horizontal_taps(px, row, C, ow, x, mean, inv_std, 7); break;
    default: horizontal_taps(px, row, C, ow, x, mean, inv_std, x->most);
    }
}

/* Store output row oy from `px` in the job's layout and type. */
static inline __attribute__((always_inline)) void store(const Job *job, const Sample *s, const float *restrict px,
                                                        const int C, const int chw, const int to_uint8, int oy) {
    const int ow = (int)s->out_hw[1];
    const int64_t plane = s->out_hw[0] * s->out_hw[1];
#if defined(__x86_64__) && !defined(GPUIO_PORTABLE)
    if (C == 3 && chw && !to_uint8) { /* 4 pixels at a time: a 4x4 transpose, then one store per plane */
        float *r = (float *)job->out + s->offset + (int64_t)oy * ow, *g = r + plane, *b = g + plane;
        int ox = 0;
        for (; ox + 4 <= ow; ox += 4) {
            __m128 p0 = _mm_loadu_ps(px + 4 * ox), p1 = _mm_loadu_ps(px + 4 * ox + 4);
            __m128 p2 = _mm_loadu_ps(px + 4 * ox + 8), p3 = _mm_loadu_ps(px + 4 * ox + 12);
            _MM_TRANSPOSE4_PS(p0, p1, p2, p3);
            _mm_storeu_ps(r + ox, p0);
            _mm_storeu_ps(g + ox, p1);
            _mm_storeu_ps(b + ox, p2);
        }
        for (; ox < ow; ++ox) {
            r[ox] = px[4 * ox];
            g[ox] = px[4 * ox + 1];
            b[ox] = px[4 * ox + 2];
        }
        return;
    }
    if (C == 3 && !chw && to_uint8) { /* 4 pixels at a time: rounded, packed to bytes, 3 of each 4 kept */
        uint8_t *restrict dst = (uint8_t *)job->out + s->offset + (int64_t)oy * ow * 3;
        const __m128 lo = _mm_setzero_ps(), hi = _mm_set1_ps(255.0f), half = _mm_set1_ps(0.5f);
        int ox = 0;
        for (; ox + 4 < ow; ox += 4) { /* not the row's last pixel: each 4-byte store ends inside the row */
            __m128i q[4];
            for (int k = 0; k < 4; ++k) /* clipped (NaN to 0), + 0.5, truncated: as the loop below */
                q[k] = _mm_cvttps_epi32(_mm_add_ps(_mm_min_ps(_mm_max_ps(_mm_loadu_ps(px + 4 * (ox + k)), lo), hi), half));
            uint8_t bytes[16];
            _mm_storeu_si128((__m128i *)bytes, _mm_packus_epi16(_mm_packs_epi32(q[0], q[1]), _mm_packs_epi32(q[2], q[3])));
            for (int k = 0; k < 4; ++k) memcpy(dst + 3 * (ox + k), bytes + 4 * k, 4); /* the 4th byte: the next pixel's, rewritten next */
        }
        for (; ox < ow; ++ox)
            for (int c = 0; c < 3; ++c) {
                float v = px[4 * ox + c];
                v = v > 0.0f ? v : 0.0f;
                dst[3 * ox + c] = (uint8_t)(int)((v < 255.0f ? v : 255.0f) + 0.5f);
            }
        return;
    }
#endif
    if (to_uint8 && !chw && C >= 3) { /* HWC bytes: a pixel's channels at once, rounded half up as below */
        uint8_t *restrict dst = (uint8_t *)job->out + s->offset + (int64_t)oy * ow * C;
        const v4f zero = {0.0f, 0.0f, 0.0f, 0.0f}, top = {255.0f, 255.0f, 255.0f, 255.0f};
        const v4f half = {0.5f, 0.5f, 0.5f, 0.5f};
        for (int ox = 0; ox < ow; ++ox) {
            v4f v;
            memcpy(&v, px + 4 * ox, sizeof v);
            v = (v4f)((v4i)v & (v > zero)); /* clipped to 0-255 as in horizontal_taps() */
            const v4i below = v < top;
            v = (v4f)(((v4i)v & below) | ((v4i)top & ~below)) + half; /* >= 0.5: truncation is floor */
            const v4i q = __builtin_convertvector(v, v4i);
            for (int c = 0; c < C; ++c) dst[(int64_t)ox * C + c] = (uint8_t)q[c];
        }
        return;
    }
    for (int c = 0; c < C; ++c) {
        const int64_t base = s->offset + (chw ? c * plane + (int64_t)oy * ow : (int64_t)oy * ow * C + c);
        const int64_t step = chw ? 1 : C;
        if (to_uint8) {
            uint8_t *restrict dst = (uint8_t *)job->out + base;
            for (int ox = 0; ox < ow; ++ox) {
                float v = floorf(px[4 * ox + c] + 0.5f);
                v = v > 0.0f ? v : 0.0f;
                dst[ox * step] = (uint8_t)(v < 255.0f ? v : 255.0f);
            }
        } else {
            float *restrict dst = (float *)job->out + base;
            for (int ox = 0; ox < ow; ++ox) dst[ox * step] = px[4 * ox + c];
        }
    }
}

static inline __attribute__((always_inline)) void rows(const Job *job, const Sample *s, const Windows *y,
                                                       const Windows *x, const float *pw, float *restrict row,
                                                       float *restrict px, const int C, const int chw,
                                                       const int to_uint8, const int expand) {
    const int width = (int)(s->clip[3] - s->clip[1]);
    const int packed = s->cs == C && s->chs == 1;
#if defined(__x86_64__) && !defined(GPUIO_PORTABLE)
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const int direct = C == 3 && chw && !to_uint8; /* horizontal_avx2() writes the planes itself */
    const int64_t plane = s->out_hw[0] * s->out_hw[1];
#else
    (void)pw;
#endif
    v4f mean = {0}, inv_std = {0};
    for (int c = 0; c < job->channels && c < 4; ++c) {
        mean[c] = job->mean[c];
        inv_std[c] = job->inv_std[c];
    }
    const uint8_t *origin = s->src + s->clip[0] * s->rs + s->clip[1] * s->cs;
    for (int oy = 0; oy < (int)s->out_hw[0]; ++oy) {
        const int taps = y->count[oy];
        const uint8_t *src[taps > 0 ? taps : 1];
        for (int k = 0; k < taps; ++k) src[k] = origin + (ptrdiff_t)(y->first[oy] + k) * s->rs;
        const float *wy = y->w + (size_t)oy * y->taps;
        if (packed) {
            VERTICAL(row, src, wy, taps, width * C);
        } else {
            for (int i = 0; i < width; ++i)
                for (int c = 0; c < C; ++c) {
                    float acc = 0.0f;
                    for (int k = 0; k < taps; ++k) acc += wy[k] * src[k][i * s->cs + c * s->chs];
                    row[i * C + c] = acc;
                }
        }
        if (expand) { /* clipped, not normalized (mean 0, 1/std 1: exact), then normalized per channel */
            const v4f zero = {0.0f, 0.0f, 0.0f, 0.0f}, one = {1.0f, 1.0f, 1.0f, 1.0f};
            const int ow = (int)s->out_hw[1];
#if defined(__x86_64__) && !defined(GPUIO_PORTABLE)
            if (pw) horizontal_avx2(px, NULL, row, 1, ow, x, pw, zero, one); /* lane 0 of each pixel's 4 */
            else
#endif
                horizontal(px, row, 1, ow, x, zero, one);
            for (int ox = 0; ox < ow; ++ox) {
                const float g = px[4 * ox];
                v4f v = {g, g, g, g};
                v = (v - mean) * inv_std;
                memcpy(px + 4 * ox, &v, sizeof v);
            }
            store(job, s, px, 3, chw, to_uint8, oy);
            continue;
        }
#if defined(__x86_64__) && !defined(GPUIO_PORTABLE)
        if (pw) {
            const int ow = (int)s->out_hw[1];
            float *r = (float *)job->out + s->offset + (int64_t)oy * ow, *planes[3] = {r, r + plane, r + 2 * plane};
            horizontal_avx2(px, direct ? planes : NULL, row, C, ow, x, pw, mean, inv_std);
            if (!direct) store(job, s, px, C, chw, to_uint8, oy);
            continue;
        }
#endif
        horizontal(px, row, C, (int)s->out_hw[1], x, mean, inv_std);
        store(job, s, px, C, chw, to_uint8, oy);
    }
}

/* One sample; 0 on success, -1 when out of memory. */
CLONES static int resample_one(const Job *job, const Sample *s) {
    const int C = job->channels, oh = (int)s->out_hw[0], ow = (int)s->out_hw[1];
    const int width = (int)(s->clip[3] - s->clip[1]);
    Windows y = {0}, x = {0};
    float *row = NULL, *px = NULL, *pw = NULL;
    int ok = -1;
    if (windows(job->interp, job->antialias, s->box[0], s->box[2], oh, (int)s->clip[0], (int)s->clip[2],
                (int)(s->flip & 2), &y) < 0
            || windows(job->interp, job->antialias, s->box[1], s->box[3], ow, (int)s->clip[1], (int)s->clip[3],
                       (int)(s->flip & 1), &x) < 0)
        goto done;
    row = calloc((size_t)(width + x.most) * C + 4, sizeof(float));
    px = malloc(sizeof(float) * 4 * (size_t)ow);
    if (!row || !px) goto done;
    const int expand = s->gray && C == 3;
#if defined(__x86_64__) && !defined(GPUIO_PORTABLE)
    if (C >= 3 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && !(pw = pair_weights(&x, ow)))
        goto done;
#endif
    if (expand) rows(job, s, &y, &x, pw, row, px, 1, job->chw, job->to_uint8, 1);
    else if (C == 3 && job->chw && !job->to_uint8) rows(job, s, &y, &x, pw, row, px, 3, 1, 0, 0); /* the common case */
    else if (C == 3) rows(job, s, &y, &x, pw, row, px, 3, job->chw, job->to_uint8, 0);
    else if (C == 1) rows(job, s, &y, &x, pw, row, px, 1, job->chw, job->to_uint8, 0);
    else rows(job, s, &y, &x, pw, row, px, C, job->chw, job->to_uint8, 0);
    ok = 0;
done:
    free_windows(&y);
    free_windows(&x);
    free(row);
    free(px);
    free(pw);
    return ok;
}

/* The batch arguments both modules take: boxes (float64 [N, 4]), clips, out_hw, offsets,
 * flips (int64 [N, 4], [N, 2], [N], [N]), mean, inv_std (float32 per channel), out
 * (float32 or uint8), then interp, antialias, chw, to_uint8. */
typedef struct {
    Py_buffer views[8];
    int held;
    const double *boxes;
    const int64_t *clips, *out_hw, *offsets, *flips;
    Job job;
} BatchArgs;

static void release_args(BatchArgs *a) {
    for (int i = 0; i < a->held; ++i) PyBuffer_Release(&a->views[i]);
    a->held = 0;
}

/* 0, or -1 with an exception set (nothing held then). */
static int get_args(PyObject *const objs[8], Py_ssize_t n, int channels, BatchArgs *a) {
    const Py_ssize_t needs[8] = {32 * n, 32 * n, 16 * n, 8 * n, 8 * n, 4 * channels, 4 * channels, 0};
    static const char *names[8] = {"boxes", "clips", "out_hw", "offsets", "flips", "mean", "inv_std", "out"};
    a->held = 0;
    if (a->job.interp == CUBIC || a->job.interp < NEAREST || a->job.interp > AREA) {
        PyErr_Format(PyExc_ValueError, "interp %d: nearest, linear or area only", a->job.interp);
        return -1;
    }
    for (; a->held < 8; ++a->held) {
        Py_buffer *v = &a->views[a->held];
        if (PyObject_GetBuffer(objs[a->held], v, a->held == 7 ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) break;
        if (v->len < needs[a->held]) {
            PyErr_Format(PyExc_ValueError, "%s: %zd bytes, need %zd", names[a->held], v->len, needs[a->held]);
            PyBuffer_Release(v);
            break;
        }
    }
    if (a->held < 8) {
        release_args(a);
        return -1;
    }
    a->boxes = a->views[0].buf;
    a->clips = a->views[1].buf;
    a->out_hw = a->views[2].buf;
    a->offsets = a->views[3].buf;
    a->flips = a->views[4].buf;
    a->job.channels = channels;
    a->job.mean = a->views[5].buf;
    a->job.inv_std = a->views[6].buf;
    a->job.out = a->views[7].buf;
    return 0;
}

/* Sample i's parameters (src and strides are the caller's); 0, or -1 when its output
 * is empty or does not fit in `out`. */
static int sample_args(const BatchArgs *a, Py_ssize_t i, Sample *s) {
    const int64_t *hw = a->out_hw + 2 * i;
    const Py_ssize_t item = a->job.to_uint8 ? 1 : 4;
    if (hw[0] < 1 || hw[1] < 1 || a->offsets[i] < 0
            || (a->offsets[i] + hw[0] * hw[1] * a->job.channels) * item > a->views[7].len)
        return -1;
    memcpy(s->box, a->boxes + 4 * i, sizeof s->box);
    memcpy(s->clip, a->clips + 4 * i, sizeof s->clip);
    memcpy(s->out_hw, hw, sizeof s->out_hw);
    s->offset = a->offsets[i];
    s->flip = a->flips[i];
    s->gray = 0;
    return 0;
}

#endif
