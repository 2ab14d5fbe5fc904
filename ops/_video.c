/* YUV 4:2:0 -> RGB24 straight into a caller's array, with the GIL released.
 *
 * The arithmetic is that of FFmpeg's unscaled yuv420p -> rgb24 converter on x86 (16-bit
 * fixed point: the samples shifted left by 3, offsets subtracted, pmulhw products, each
 * chroma sample shared by its 2x2 luma pixels, saturating adds), so that it can give
 * the same bytes as swscale does there; ops/video.py checks that it does, for every
 * (Y, U, V), before it uses it (gpuio.ops.video._direct_rgb).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <tmmintrin.h>
#define HAVE_X86 1
#endif

typedef struct {
    int16_t y_offset, y_coeff, u_offset, v_offset, u2b, u2g, v2g, v2r;
} Coeffs;

static inline int16_t sat16(int32_t x) { return (int16_t)(x < -32768 ? -32768 : x > 32767 ? 32767 : x); }
static inline int16_t mulhi(int16_t a, int16_t b) { return (int16_t)(((int32_t)a * b) >> 16); }
static inline uint8_t satu8(int16_t x) { return (uint8_t)(x < 0 ? 0 : x > 255 ? 255 : x); }

/* pixels [from, to) of one row; to - from even and from even */
static void row_scalar(const uint8_t *y, const uint8_t *u, const uint8_t *v, uint8_t *out, int from, int to,
                       const Coeffs *c) {
    for (int x = from; x < to; x += 2) {
        const int16_t cu = sat16((u[x / 2] << 3) - c->u_offset), cv = sat16((v[x / 2] << 3) - c->v_offset);
        const int16_t b = mulhi(cu, c->u2b), r = mulhi(cv, c->v2r), g = sat16(mulhi(cu, c->u2g) + mulhi(cv, c->v2g));
        for (int k = 0; k < 2; ++k) {
            const int16_t luma = mulhi((int16_t)((y[x + k] << 3) - c->y_offset), c->y_coeff);
            uint8_t *p = out + 3 * (x + k);
            p[0] = satu8(sat16(luma + r));
            p[1] = satu8(sat16(luma + g));
            p[2] = satu8(sat16(luma + b));
        }
    }
}

#ifdef HAVE_X86
static int have_ssse3;
/* byte k of output block b is channel (16b + k) % 3 of pixel (16b + k) / 3; filled once at import */
static int8_t shuffle[3][3][16];

static void init_x86(void) {
    __builtin_cpu_init();
    have_ssse3 = __builtin_cpu_supports("ssse3");
    for (int b = 0; b < 3; ++b)
        for (int ch = 0; ch < 3; ++ch)
            for (int k = 0; k < 16; ++k)
                shuffle[b][ch][k] = (16 * b + k) % 3 == ch ? (int8_t)((16 * b + k) / 3) : (int8_t)0x80;
}

/* 16 pixels at a time; returns how many pixels of the row it did */
__attribute__((target("ssse3"))) static int row_ssse3(const uint8_t *y, const uint8_t *u, const uint8_t *v,
                                                     uint8_t *out, int width, const Coeffs *c) {
    const __m128i zero = _mm_setzero_si128(), low = _mm_set1_epi16(0xff);
    const __m128i yo = _mm_set1_epi16(c->y_offset), yc = _mm_set1_epi16(c->y_coeff);
    const __m128i uo = _mm_set1_epi16(c->u_offset), vo = _mm_set1_epi16(c->v_offset);
    const __m128i ub = _mm_set1_epi16(c->u2b), ug = _mm_set1_epi16(c->u2g);
    const __m128i vg = _mm_set1_epi16(c->v2g), vr = _mm_set1_epi16(c->v2r);
    __m128i mask[3][3];
    for (int b = 0; b < 3; ++b)
        for (int ch = 0; ch < 3; ++ch) mask[b][ch] = _mm_loadu_si128((const __m128i *)shuffle[b][ch]);
    int x = 0;
    for (; x + 16 <= width; x += 16) {
        const __m128i yy = _mm_loadu_si128((const __m128i *)(y + x));
        const __m128i cu = _mm_subs_epi16(_mm_slli_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(u + x / 2)), zero), 3), uo);
        const __m128i cv = _mm_subs_epi16(_mm_slli_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(v + x / 2)), zero), 3), vo);
        const __m128i even = _mm_mulhi_epi16(_mm_sub_epi16(_mm_slli_epi16(_mm_and_si128(yy, low), 3), yo), yc);
        const __m128i odd = _mm_mulhi_epi16(_mm_sub_epi16(_mm_slli_epi16(_mm_srli_epi16(yy, 8), 3), yo), yc);
        const __m128i b = _mm_mulhi_epi16(cu, ub), r = _mm_mulhi_epi16(cv, vr);
        const __m128i g = _mm_adds_epi16(_mm_mulhi_epi16(cu, ug), _mm_mulhi_epi16(cv, vg));
        __m128i rgb[3];
        const __m128i chroma[3] = {r, g, b};
        for (int ch = 0; ch < 3; ++ch)  /* 16 bytes of one channel in pixel order */
            rgb[ch] = _mm_unpacklo_epi8(_mm_packus_epi16(_mm_adds_epi16(even, chroma[ch]), zero),
                                        _mm_packus_epi16(_mm_adds_epi16(odd, chroma[ch]), zero));
        for (int blk = 0; blk < 3; ++blk)
            _mm_storeu_si128((__m128i *)(out + 3 * x + 16 * blk),
                             _mm_or_si128(_mm_or_si128(_mm_shuffle_epi8(rgb[0], mask[blk][0]),
                                                       _mm_shuffle_epi8(rgb[1], mask[blk][1])),
                                          _mm_shuffle_epi8(rgb[2], mask[blk][2])));
    }
    return x;
}
#endif

/* yuv420_rgb24(y, y_stride, u, v, uv_stride, out, width, height, coeffs): out is a
 * writable C-contiguous buffer of height * width * 3 bytes; width and height even. */
static PyObject *yuv420_rgb24(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer yb, ub, vb, ob;
    Py_ssize_t ys, cs;
    int width, height;
    Coeffs c;
    if (!PyArg_ParseTuple(args, "y*ny*y*nw*ii(hhhhhhhh)", &yb, &ys, &ub, &vb, &cs, &ob, &width, &height,
                          &c.y_offset, &c.y_coeff, &c.u_offset, &c.v_offset, &c.u2b, &c.u2g, &c.v2g, &c.v2r))
        return NULL;
    PyObject *result = NULL;
    if (width < 2 || height < 2 || (width | height) & 1 || ys < width || cs < width / 2
            || yb.len < ys * (height - 1) + width || ub.len < cs * (height / 2 - 1) + width / 2
            || vb.len < cs * (height / 2 - 1) + width / 2 || ob.len != (Py_ssize_t)width * height * 3
            || !PyBuffer_IsContiguous(&ob, 'C')) {
        PyErr_SetString(PyExc_ValueError, "yuv420_rgb24: planes or output do not fit the size");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (int row = 0; row < height; ++row) {
        const uint8_t *y = (const uint8_t *)yb.buf + row * ys;
        const uint8_t *u = (const uint8_t *)ub.buf + row / 2 * cs, *v = (const uint8_t *)vb.buf + row / 2 * cs;
        uint8_t *out = (uint8_t *)ob.buf + (Py_ssize_t)row * width * 3;
        int done_px = 0;
#ifdef HAVE_X86
        if (have_ssse3) done_px = row_ssse3(y, u, v, out, width, &c);
#endif
        row_scalar(y, u, v, out, done_px, width, &c);
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&yb);
    PyBuffer_Release(&ub);
    PyBuffer_Release(&vb);
    PyBuffer_Release(&ob);
    return result;
}

static PyMethodDef methods[] = {
    {"yuv420_rgb24", yuv420_rgb24, METH_VARARGS, "YUV 4:2:0 planes -> RGB24 into out (see ops/_video.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpuio.ops._video", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__video(void) {
#ifdef HAVE_X86
    init_x86();
#endif
    return PyModule_Create(&module);
}
