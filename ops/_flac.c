/* A FLAC decoder for gpuio.ops.audio.decode_audio, written from the format's
 * specification (RFC 9639): every file of a batch in one call, the GIL released, from
 * the bytes the storage core read, into the rows decode_audio allocated.
 *
 * Python parses the metadata blocks (STREAMINFO: channels, bits per sample, total
 * samples) and hands over where the first frame starts; this file decodes the frames:
 * header (CRC-8 checked), one subframe per channel (CONSTANT, VERBATIM, FIXED 0-4, LPC
 * 1-32, wasted bits, Rice / Rice2 partitioned residuals with escapes), the stereo
 * decorrelation, the CRC-16 footer, and writes samples [first, first + count) as
 * libsndfile converts them (same integer shifts and float scaling, bit for bit).
 * Samples live in int32; predictions accumulate in int64. What it does not take (a
 * frame whose channels or bits differ from STREAMINFO, a 32-bit stream's 33-bit side
 * channel) comes back as UNSUPPORTED, and Python decodes that file with soundfile.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { OK = 0, CORRUPT = 1, UNSUPPORTED = 2 };

/* The hot functions are inlined into decode_file, which x86-64 builds compile twice
 * (target_clones, as ops/_resample.h): for any x86-64, and for x86-64-v3 (BMI2's
 * shifts by a register and LZCNT: the Rice loop is a chain of them), picked at load. */
#define HOT static inline __attribute__((always_inline))
#if defined(__x86_64__)
#define CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define CLONES
#endif
enum { F32 = 0, F64 = 1, I16 = 2, I32 = 3 };
#define MAX_BLOCK 65536
#define MAX_CHANNELS 8

static uint8_t crc8_table[256];
static uint16_t crc16_table[8][256]; /* [k][b]: byte b followed by k zero bytes */

static void make_tables(void) {
    for (int b = 0; b < 256; ++b) {
        unsigned c8 = (unsigned)b, c16 = (unsigned)b << 8;
        for (int i = 0; i < 8; ++i) {
            c8 = (c8 & 0x80) ? ((c8 << 1) ^ 0x07) : (c8 << 1);
            c16 = (c16 & 0x8000) ? ((c16 << 1) ^ 0x8005) : (c16 << 1);
        }
        crc8_table[b] = (uint8_t)c8;
        crc16_table[0][b] = (uint16_t)c16;
    }
    for (int k = 1; k < 8; ++k)
        for (int b = 0; b < 256; ++b) {
            const unsigned prev = crc16_table[k - 1][b];
            crc16_table[k][b] = (uint16_t)((prev << 8) ^ crc16_table[0][prev >> 8]);
        }
}

static unsigned crc8(const uint8_t *p, size_t n) {
    unsigned c = 0;
    while (n--) c = crc8_table[c ^ *p++];
    return c;
}

/* CRC-16 (x^16 + x^15 + x^2 + 1, initial 0, not reflected), eight bytes per step. */
HOT unsigned crc16(const uint8_t *p, size_t n) {
    unsigned c = 0;
    for (; n >= 8; n -= 8, p += 8) {
        const unsigned b0 = p[0] ^ (c >> 8), b1 = p[1] ^ (c & 0xFF);
        c = crc16_table[7][b0] ^ crc16_table[6][b1] ^ crc16_table[5][p[2]] ^ crc16_table[4][p[3]] ^
            crc16_table[3][p[4]] ^ crc16_table[2][p[5]] ^ crc16_table[1][p[6]] ^ crc16_table[0][p[7]];
    }
    while (n--) c = ((c << 8) ^ crc16_table[0][(c >> 8) ^ *p++]) & 0xFFFF;
    return c;
}

/* A big-endian bit reader. `cache` holds the next bits, the first at the top; its top
 * `bits` bits are valid and the bits below them are zero or the stream's next bits.
 * Past the end of the data it reads zero bytes, counted in `over`. */
typedef struct {
    const uint8_t *start, *p, *end;
    uint64_t cache;
    int bits;
    int64_t over;
} Bits;

static inline void refill(Bits *b) {
    if (b->end - b->p >= 8) {
        uint64_t w;
        memcpy(&w, b->p, 8);
        b->cache |= __builtin_bswap64(w) >> b->bits;
        const int take = (63 - b->bits) >> 3;
        b->p += take;
        b->bits += take * 8;
    } else {
        while (b->bits <= 48) { /* leaves 49..56 bits: shifts by `bits` stay below 64 */
            uint64_t byte = 0;
            if (b->p < b->end) byte = *b->p++;
            else ++b->over;
            b->cache |= byte << (56 - b->bits);
            b->bits += 8;
        }
    }
}

/* The bit position reached, from the data's start. */
static inline int64_t bit_pos(const Bits *b) { return (int64_t)(b->p - b->start + b->over) * 8 - b->bits; }

static inline uint64_t get_bits(Bits *b, int n) { /* n in 1..48 */
    if (b->bits < n) refill(b);
    const uint64_t v = b->cache >> (64 - n);
    b->cache <<= n;
    b->bits -= n;
    return v;
}

static inline int64_t get_signed(Bits *b, int n) { /* n in 0..33 */
    if (n == 0) return 0;
    const uint64_t v = get_bits(b, n);
    return (int64_t)(v << (64 - n)) >> (64 - n);
}

/* The number of 0 bits before the next 1 bit (the 1 is consumed); -1 past the data. */
static int64_t get_unary(Bits *b) {
    int64_t q = 0;
    for (;;) {
        if (b->bits == 0) refill(b);
        const int lz = b->cache ? __builtin_clzll(b->cache) : 64;
        if (lz < b->bits) {
            b->cache <<= lz;
            b->cache <<= 1;
            b->bits -= lz + 1;
            return q + lz;
        }
        q += b->bits;
        b->cache <<= b->bits;
        b->bits = 0;
        if (b->over > 8) return -1;
    }
}

/* `n` Rice-coded residuals with parameter k (0..30) into out; -1 past the data. The
 * reader's state lives in locals here (the hot loop); a code whose unary part and
 * remainder are not all in the cache takes get_unary. */
HOT int rice(Bits *b, int32_t *out, int n, int k) {
    uint64_t cache = b->cache;
    int bits = b->bits;
    const uint8_t *p = b->p;
    const uint8_t *const fast_end = b->end - 8;
    for (int i = 0; i < n; ++i) {
        if (bits < 40 && p <= fast_end) {
            uint64_t w;
            memcpy(&w, p, 8);
            cache |= __builtin_bswap64(w) >> bits;
            const int take = (63 - bits) >> 3;
            p += take;
            bits += take * 8;
        }
        const int lz = __builtin_clzll(cache | 1);
        const int total = lz + 1 + k;
        uint64_t u;
        if (__builtin_expect(total <= bits, 1)) {
            /* the stop bit and the remainder: (1 << k) | r, so u = ((lz - 1) << k) + that */
            u = ((uint64_t)(lz - 1) << k) + ((cache << lz) >> (63 - k));
            cache <<= total;
            bits -= total;
        } else {
            b->cache = cache;
            b->bits = bits;
            b->p = p;
            const int64_t q = get_unary(b);
            if (q < 0) return -1;
            u = ((uint64_t)q << k) | (k ? get_bits(b, k) : 0);
            cache = b->cache;
            bits = b->bits;
            p = b->p;
        }
        out[i] = (int32_t)((u >> 1) ^ (~(u & 1) + 1));
    }
    b->cache = cache;
    b->bits = bits;
    b->p = p;
    return 0;
}

typedef struct {
    const char *error; /* a CORRUPT status's reason */
    int status;
} Outcome;

#define FAIL(o, st, msg) \
    do {                 \
        (o)->status = (st); \
        (o)->error = (msg); \
        return -1;       \
    } while (0)

/* The residual of a subframe with predictor `order` into s[order..n). */
HOT int residual(Bits *b, int32_t *s, int n, int order, Outcome *o) {
    const unsigned method = (unsigned)get_bits(b, 2);
    if (method > 1) FAIL(o, CORRUPT, "reserved residual coding method");
    const int pbits = method ? 5 : 4, escape = method ? 31 : 15;
    const int porder = (int)get_bits(b, 4);
    const int per = n >> porder;
    if ((per << porder) != n || per < order) FAIL(o, CORRUPT, "bad residual partition order");
    int32_t *out = s + order;
    for (int p = 0; p < (1 << porder); ++p) {
        const int cnt = per - (p ? 0 : order);
        const int k = (int)get_bits(b, pbits);
        if (k == escape) {
            const int width = (int)get_bits(b, 5);
            for (int i = 0; i < cnt; ++i) out[i] = (int32_t)get_signed(b, width);
        } else if (rice(b, out, cnt, k) < 0) {
            FAIL(o, CORRUPT, "residual runs past the end of the data");
        }
        out += cnt;
    }
    return 0;
}

/* The fixed predictors of orders 1-4 (order 0: the residual is the signal), the
 * previous samples kept in registers (see lpc_order). */
HOT void restore_fixed(int32_t *s, int n, int order) {
    if (order == 0) return;
    int64_t a = s[order - 1], b = order > 1 ? s[order - 2] : 0, c = order > 2 ? s[order - 3] : 0,
            d = order > 3 ? s[order - 4] : 0;
    for (int i = order; i < n; ++i) {
        const int64_t v = order == 1 ? s[i] + a
                          : order == 2 ? s[i] + 2 * a - b
                          : order == 3 ? s[i] + 3 * (a - b) + c
                                       : s[i] + 4 * (a + c) - 6 * b - d;
        d = c;
        c = b;
        b = a;
        a = (int32_t)v;
        s[i] = (int32_t)v;
    }
}

/* s[i] += (sum_j c[j] * s[i-1-j]) >> shift; `order` a constant where inlined, so the
 * inner sum is unrolled for each order. The newest sample stays in a register: read
 * back from memory right after its store, it would put a store-to-load forwarding on
 * every sample's dependency chain. */
HOT void lpc_order(int32_t *s, int n, const int32_t *c, int order, int shift) {
    int64_t coef[32], prev = s[order - 1];
    for (int j = 0; j < order; ++j) coef[j] = c[j];
    for (int i = order; i < n; ++i) {
        int64_t sum = 0;
        for (int j = 1; j < order; ++j) sum += coef[j] * s[i - 1 - j];
        prev = (int32_t)(s[i] + ((sum + coef[0] * prev) >> shift));
        s[i] = (int32_t)prev;
    }
}

HOT void restore_lpc(int32_t *s, int n, const int32_t *c, int order, int shift) {
    switch (order) {
#define CASE(k) \
    case k:     \
        lpc_order(s, n, c, k, shift); \
        break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12)
        CASE(13) CASE(14) CASE(15) CASE(16)
#undef CASE
    default:
        lpc_order(s, n, c, order, shift);
    }
}

/* One subframe of n samples at `bps` bits into s. */
HOT int subframe(Bits *b, int32_t *s, int n, int bps, Outcome *o) {
    const unsigned head = (unsigned)get_bits(b, 8);
    if (head & 0x80) FAIL(o, CORRUPT, "subframe padding bit set");
    const unsigned type = (head >> 1) & 0x3F;
    int wasted = 0;
    if (head & 1) {
        const int64_t z = get_unary(b);
        if (z < 0 || z + 1 >= bps) FAIL(o, CORRUPT, "bad wasted-bits count");
        wasted = (int)z + 1;
        bps -= wasted;
    }
    if (type == 0) {
        const int32_t v = (int32_t)get_signed(b, bps);
        for (int i = 0; i < n; ++i) s[i] = v;
    } else if (type == 1) {
        for (int i = 0; i < n; ++i) s[i] = (int32_t)get_signed(b, bps);
    } else if (type >= 8 && type <= 12) {
        const int order = (int)type - 8;
        if (order >= n) FAIL(o, CORRUPT, "predictor order not below the block size");
        for (int i = 0; i < order; ++i) s[i] = (int32_t)get_signed(b, bps);
        if (residual(b, s, n, order, o) < 0) return -1;
        restore_fixed(s, n, order);
    } else if (type >= 32) {
        const int order = (int)type - 31;
        if (order >= n) FAIL(o, CORRUPT, "predictor order not below the block size");
        for (int i = 0; i < order; ++i) s[i] = (int32_t)get_signed(b, bps);
        const int precision = (int)get_bits(b, 4) + 1;
        if (precision == 16) FAIL(o, CORRUPT, "bad LPC coefficient precision");
        const int shift = (int)get_signed(b, 5);
        if (shift < 0) FAIL(o, CORRUPT, "negative LPC shift");
        int32_t c[32];
        for (int j = 0; j < order; ++j) c[j] = (int32_t)get_signed(b, precision);
        if (residual(b, s, n, order, o) < 0) return -1;
        restore_lpc(s, n, c, order, shift);
    } else {
        FAIL(o, CORRUPT, "reserved subframe type");
    }
    if (wasted)
        for (int i = 0; i < n; ++i) s[i] = (int32_t)((uint32_t)s[i] << wasted);
    return 0;
}

/* A sample as libsndfile gives it in each output type (flac.c's buffer copy). */
static inline float as_f32(int32_t x, float norm) { return (float)x * norm; }
static inline double as_f64(int32_t x, double norm) { return (double)x * norm; }
static inline int16_t as_i16(int32_t x, int bps) {
    return bps > 16 ? (int16_t)(x >> (bps - 16)) : (int16_t)(uint16_t)((uint32_t)x << (16 - bps));
}
static inline int32_t as_i32(int32_t x, int bps) { return (int32_t)((uint32_t)x << (32 - bps)); }

/* x[lo..hi) converted into out[at], out[at + stride], ... */
HOT void convert(const int32_t *x, int lo, int hi, void *out, int64_t at, int stride, int dtype, int bps) {
    const float nf = (float)(1.0 / (double)(1u << (bps - 1)));
    const double nd = 1.0 / (double)(1u << (bps - 1));
    switch (dtype) {
    case F32: {
        float *y = (float *)out + at;
        for (int i = lo; i < hi; ++i, y += stride) *y = as_f32(x[i], nf);
        break;
    }
    case F64: {
        double *y = (double *)out + at;
        for (int i = lo; i < hi; ++i, y += stride) *y = as_f64(x[i], nd);
        break;
    }
    case I16: {
        int16_t *y = (int16_t *)out + at;
        for (int i = lo; i < hi; ++i, y += stride) *y = as_i16(x[i], bps);
        break;
    }
    default: {
        int32_t *y = (int32_t *)out + at;
        for (int i = lo; i < hi; ++i, y += stride) *y = as_i32(x[i], bps);
    }
    }
}

/* Samples [lo, hi) of a frame's channels into out rows from `row`; `width` 1 with
 * several channels: their mean (float64 sum in channel order, as NumPy's mean). */
HOT void emit(int32_t *const *ch, int channels, int lo, int hi, void *out, int64_t row, int width, int dtype,
              int bps) {
    if (channels == 1) { /* contiguous: the compiler vectorizes this one */
        convert(ch[0], lo, hi, out, row, 1, dtype, bps);
        return;
    }
    if (width == channels) {
        for (int c = 0; c < channels; ++c) convert(ch[c], lo, hi, out, row * width + c, width, dtype, bps);
        return;
    }
    const float nf = (float)(1.0 / (double)(1u << (bps - 1)));
    const double nd = 1.0 / (double)(1u << (bps - 1));
    for (int i = lo; i < hi; ++i, ++row) {
        double sum = 0.0;
        for (int c = 0; c < channels; ++c) {
            const int32_t x = ch[c][i];
            sum += dtype == F32 ? (double)as_f32(x, nf)
                   : dtype == F64 ? as_f64(x, nd)
                   : dtype == I16 ? (double)as_i16(x, bps) : (double)as_i32(x, bps);
        }
        const double mean = sum / channels;
        switch (dtype) {
        case F32: ((float *)out)[row] = (float)mean; break;
        case F64: ((double *)out)[row] = mean; break;
        case I16: ((int16_t *)out)[row] = (int16_t)rint(mean); break;
        default: ((int32_t *)out)[row] = (int32_t)rint(mean);
        }
    }
}

typedef struct {
    const uint8_t *data;
    int64_t len, start, first, count; /* bytes; first frame's byte; samples wanted */
    int channels, bps;
    void *out;
    /* results */
    Outcome outcome;
    int64_t done;   /* samples written */
    int64_t at;     /* byte offset of the frame at fault */
} Job;

static const int rate_extra[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 2, -1};
static const int bits_code[8] = {0, 8, 12, -1, 16, 20, 24, 32};

/* The frame header at `pos`: block size, channel assignment, and the byte after it. */
static int frame_header(const Job *job, int64_t pos, int *block, int *assign, int64_t *next, Outcome *o) {
    const uint8_t *h = job->data + pos;
    const int64_t avail = job->len - pos;
    if (avail < 6) FAIL(o, CORRUPT, "the data ends inside a frame header");
    if (h[0] != 0xFF || (h[1] & 0xFE) != 0xF8) FAIL(o, CORRUPT, "no frame sync code");
    const int bs_code = h[2] >> 4, sr_code = h[2] & 15, ch_code = h[3] >> 4, b_code = (h[3] >> 1) & 7;
    if (bs_code == 0 || rate_extra[sr_code] < 0 || ch_code > 10 || bits_code[b_code] < 0 || (h[3] & 1))
        FAIL(o, CORRUPT, "reserved value in the frame header");
    const int bps = b_code ? bits_code[b_code] : job->bps;
    const int channels = ch_code < 8 ? ch_code + 1 : 2;
    int64_t i = 4;
    const unsigned lead = h[i++];
    int more = lead < 0x80 ? 0 : lead < 0xC0 ? -1 : lead < 0xE0 ? 1 : lead < 0xF0 ? 2 : lead < 0xF8 ? 3
             : lead < 0xFC ? 4 : lead < 0xFE ? 5 : lead == 0xFE ? 6 : -1;
    if (more < 0) FAIL(o, CORRUPT, "bad coded frame number");
    const int extra = more + (bs_code == 6 ? 1 : bs_code == 7 ? 2 : 0) + rate_extra[sr_code] + 1;
    if (avail < i + extra) FAIL(o, CORRUPT, "the data ends inside a frame header");
    for (; more > 0; --more)
        if ((h[i++] & 0xC0) != 0x80) FAIL(o, CORRUPT, "bad coded frame number");
    if (bs_code == 1) *block = 192;
    else if (bs_code <= 5) *block = 576 << (bs_code - 2);
    else if (bs_code == 6) *block = h[i++] + 1;
    else if (bs_code == 7) {
        *block = ((h[i] << 8) | h[i + 1]) + 1;
        i += 2;
    } else *block = 256 << (bs_code - 8);
    i += rate_extra[sr_code];
    if (crc8(h, (size_t)i) != h[i]) FAIL(o, CORRUPT, "frame header CRC-8 mismatch");
    if (channels != job->channels || bps != job->bps) FAIL(o, UNSUPPORTED, "frame format differs from STREAMINFO");
    if (bps == 32 && ch_code >= 8) FAIL(o, UNSUPPORTED, "33-bit side channel");
    *assign = ch_code;
    *next = pos + i + 1;
    return 0;
}

/* Decode the frames of one file until `first + count` samples; ch: MAX_CHANNELS
 * buffers of MAX_BLOCK samples. */
HOT void decode_frames(Job *job, int32_t *const *ch, int width, int dtype) {
    Outcome *o = &job->outcome;
    int64_t pos = job->start, sample = 0;
    const int64_t end = job->first + job->count;
    while (sample < end) {
        job->at = pos;
        if (pos >= job->len) {
            o->status = CORRUPT;
            o->error = "the data ends before the last frame STREAMINFO declares";
            return;
        }
        int block, assign;
        int64_t body;
        if (frame_header(job, pos, &block, &assign, &body, o) < 0) return;
        Bits b = {job->data, job->data + body, job->data + job->len, 0, 0, 0};
        for (int c = 0; c < job->channels; ++c) {
            const int side = (assign == 8 && c == 1) || (assign == 9 && c == 0) || (assign == 10 && c == 1);
            if (subframe(&b, ch[c], block, job->bps + side, o) < 0) return;
        }
        const int64_t footer = (bit_pos(&b) + 7) / 8; /* subframes end, zero-padded to a byte */
        if (footer + 2 > job->len) {
            o->status = CORRUPT;
            o->error = "the data ends inside a frame";
            return;
        }
        const uint8_t *f = job->data + footer;
        if (crc16(job->data + pos, (size_t)(footer - pos)) != (unsigned)((f[0] << 8) | f[1])) {
            o->status = CORRUPT;
            o->error = "frame CRC-16 mismatch";
            return;
        }
        int32_t *l = ch[0], *r = ch[1];
        /* in int64: a corrupt (CRC-valid) stream's sums can leave int32 */
        if (assign == 8) /* left, side = left - right */
            for (int i = 0; i < block; ++i) r[i] = (int32_t)((int64_t)l[i] - r[i]);
        else if (assign == 9) /* side, right */
            for (int i = 0; i < block; ++i) l[i] = (int32_t)((int64_t)l[i] + r[i]);
        else if (assign == 10) /* mid, side */
            for (int i = 0; i < block; ++i) {
                const int64_t mid = (int64_t)l[i] * 2 + (r[i] & 1), side = r[i];
                l[i] = (int32_t)((mid + side) >> 1);
                r[i] = (int32_t)((mid - side) >> 1);
            }
        const int64_t lo = job->first > sample ? job->first - sample : 0;
        const int64_t hi = end - sample < block ? end - sample : block;
        if (lo < hi) emit(ch, job->channels, (int)lo, (int)hi, job->out, sample + lo - job->first, width, dtype,
                          job->bps);
        sample += block;
        job->done = (sample < end ? sample : end) - job->first;
        if (job->done < 0) job->done = 0;
        pos = footer + 2;
    }
}

CLONES static void decode_file(Job *job, int32_t *const *ch, int width, int dtype) {
    decode_frames(job, ch, width, dtype);
}

static const int itemsize[4] = {4, 8, 2, 4};

static PyObject *decode(PyObject *self, PyObject *args) {
    PyObject *o_jobs;
    int dtype, downmix;
    if (!PyArg_ParseTuple(args, "O!ip", &PyList_Type, &o_jobs, &dtype, &downmix)) return NULL;
    if (dtype < 0 || dtype > 3) return PyErr_Format(PyExc_ValueError, "dtype code %d", dtype);
    const Py_ssize_t n = PyList_GET_SIZE(o_jobs);
    Job *jobs = calloc((size_t)(n ? n : 1), sizeof(Job));
    Py_buffer *views = calloc((size_t)(n ? 2 * n : 1), sizeof(Py_buffer));
    int32_t *store = malloc(sizeof(int32_t) * MAX_BLOCK * MAX_CHANNELS);
    Py_ssize_t held = 0; /* views[0..held) are held */
    PyObject *result = NULL;
    if (!jobs || !views || !store) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; ++k) {
        Job *j = &jobs[k];
        PyObject *o_data, *o_out;
        long long start, first, count;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(o_jobs, k), "OLLLiiO", &o_data, &start, &first, &count, &j->channels,
                              &j->bps, &o_out))
            goto done;
        if (PyObject_GetBuffer(o_data, &views[held], PyBUF_C_CONTIGUOUS) < 0) goto done;
        ++held;
        if (PyObject_GetBuffer(o_out, &views[held], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
        ++held;
        const int width = downmix ? 1 : j->channels;
        if (j->channels < 1 || j->channels > MAX_CHANNELS || j->bps < 4 || j->bps > 32 || start < 0 || first < 0 ||
            count < 0 || views[held - 1].len != count * width * itemsize[dtype]) {
            PyErr_Format(PyExc_ValueError, "job %zd: bad channels, bits, range or output size", k);
            goto done;
        }
        j->data = views[held - 2].buf;
        j->len = views[held - 2].len;
        j->out = views[held - 1].buf;
        j->start = start;
        j->first = first;
        j->count = count;
    }
    Py_BEGIN_ALLOW_THREADS
    int32_t *ch[MAX_CHANNELS];
    for (int c = 0; c < MAX_CHANNELS; ++c) ch[c] = store + (size_t)c * MAX_BLOCK;
    for (Py_ssize_t k = 0; k < n; ++k) decode_file(&jobs[k], ch, downmix ? 1 : jobs[k].channels, dtype);
    Py_END_ALLOW_THREADS
    result = PyList_New(n);
    for (Py_ssize_t k = 0; result && k < n; ++k) {
        const Job *j = &jobs[k];
        PyObject *item = Py_BuildValue("iLLs", j->outcome.status, (long long)j->done, (long long)j->at,
                                       j->outcome.error);
        if (!item) Py_CLEAR(result);
        else PyList_SET_ITEM(result, k, item);
    }
done:
    for (Py_ssize_t k = 0; k < held; ++k) PyBuffer_Release(&views[k]);
    free(store);
    free(views);
    free(jobs);
    return result;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS,
     "decode(jobs, dtype, downmix) -> [(status, samples, byte, error)]: decode FLAC files; each job is "
     "(data, first frame's byte, first sample, samples, channels, bits, out), out C-contiguous [samples, width] "
     "of dtype 0 float32, 1 float64, 2 int16, 3 int32 (width 1 with downmix: the channels' mean); status 0 ok, "
     "1 corrupt (byte: the frame's offset), 2 unsupported (decode the file another way)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpuio.ops._flac", NULL, -1, methods};

PyMODINIT_FUNC PyInit__flac(void) {
    make_tables();
    return PyModule_Create(&module);
}
