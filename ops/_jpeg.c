/* JPEG decoding for gpuio.ops on the CPU, fused with the resampler of ops/_resample.h,
 * run with the GIL released. Built where jpeglib.h and libjpeg exist; elsewhere gpuio
 * decodes whole images with simplejpeg.
 *
 * headers(): the frame facts of a batch of JPEGs (libjpeg's jpeg_read_header, the EXIF
 * orientation from APP1).
 * decode_region(): a window of one JPEG, as decode_resample decodes it.
 * decode_resample(): per image, the rows a fused chain reads of the 1/denom-scaled
 * image (rows above skipped, rows below never decoded; columns cropped to the iMCUs
 * covering them), then crop -> resize -> flip -> normalize into the batch output, one
 * call per batch; a grayscale JPEG in an RGB batch is decoded and resampled as one channel
 * and written as three. One decompressor and one scratch buffer (kept per thread) serve
 * the whole batch, so the decoded window is still in the cache when the resampler reads
 * it. libjpeg's defaults stay: the accurate integer IDCT (JDCT_ISLOW) and fancy upsampling.
 * add_restarts(): a JPEG rewritten losslessly (libjpeg's transcoding: the DCT coefficients
 * are copied, not decoded) with a restart marker every N MCUs, and where each restart
 * interval's entropy-coded data starts. Given those offsets, decode_region and
 * decode_resample decode a window from the intervals that cover it (sub_jpeg).
 */
#include "_resample.h"

#include <pthread.h>
#include <setjmp.h>
#include <stdio.h>
#include <time.h>
#include <jpeglib.h>
#include <jerror.h>

/* columns decoded beyond each side of a window: libjpeg upsamples chroma at a cropped
 * edge as at the image's edge, which would change the window's outermost pixels */
#define EDGE 4

typedef struct {
    struct jpeg_error_mgr mgr;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
} Errors;

static void on_error(j_common_ptr cinfo) {
    Errors *e = (Errors *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, e->message);
    longjmp(e->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
    if (level < 0) on_error(cinfo); /* a warning (corrupt data): strict, as simplejpeg */
}

/* 0, or -1 when libjpeg has no memory for it (it then needs no destroying). */
static int new_decompressor(struct jpeg_decompress_struct *cinfo, Errors *err) {
    cinfo->err = jpeg_std_error(&err->mgr);
    err->mgr.error_exit = on_error;
    err->mgr.emit_message = on_message;
    if (setjmp(err->jump)) return -1;
    jpeg_create_decompress(cinfo);
    return 0;
}

static unsigned read16(const uint8_t *p, int little) { return little ? p[0] | p[1] << 8 : p[0] << 8 | p[1]; }

static uint32_t read32(const uint8_t *p, int little) {
    return little ? read16(p, 1) | (uint32_t)read16(p + 2, 1) << 16 : (uint32_t)read16(p, 0) << 16 | read16(p + 2, 0);
}

/* Orientation tag (0x0112) of IFD0 in an APP1 Exif payload; 1 when absent or malformed
 * (decoders ignore bad EXIF), as gpuio.ops.decode._exif_orientation. */
static int exif_orientation(const uint8_t *p, size_t n) {
    if (n < 6 || memcmp(p, "Exif\0\0", 6) != 0) return 0; /* not Exif: no say */
    p += 6;
    n -= 6;
    if (n < 8 || !((p[0] == 'I' && p[1] == 'I') || (p[0] == 'M' && p[1] == 'M'))) return 1;
    const int little = p[0] == 'I';
    const uint32_t ifd = read32(p + 4, little);
    if ((size_t)ifd + 2 > n) return 1;
    const unsigned count = read16(p + ifd, little);
    for (unsigned k = 0; k < count; ++k) {
        const size_t e = (size_t)ifd + 2 + 12 * (size_t)k;
        if (e + 10 > n) return 1;
        if (read16(p + e, little) == 0x0112) {
            const unsigned v = read16(p + e + 8, little);
            return v >= 1 && v <= 8 ? (int)v : 1;
        }
    }
    return 1;
}

/* SUBSAMPLING: the largest factor by which a component is subsampled, across or down
 * (4:4:4 and gray 1, 4:2:0, 4:2:2 and 4:4:0 2, 4:1:1 4) */
enum { COMPONENTS, PROGRESSIVE, ORIENTATION, HEIGHT, WIDTH, COMPLETE, SUBSAMPLING, FACTS };

/* The facts of one JPEG into out[FACTS]; all 0 where libjpeg cannot read its headers. */
static void read_facts(struct jpeg_decompress_struct *cinfo, Errors *err, const uint8_t *data, size_t size,
                       int64_t *out) {
    memset(out, 0, sizeof(int64_t) * FACTS);
    if (size < 4 || data[0] != 0xFF || data[1] != 0xD8) return;
    if (setjmp(err->jump)) {
        memset(out, 0, sizeof(int64_t) * FACTS);
        jpeg_abort_decompress(cinfo);
        return;
    }
    jpeg_mem_src(cinfo, data, (unsigned long)size);
    jpeg_read_header(cinfo, TRUE);
    out[COMPONENTS] = cinfo->num_components;
    out[PROGRESSIVE] = cinfo->progressive_mode;
    out[ORIENTATION] = 1;
    for (jpeg_saved_marker_ptr m = cinfo->marker_list; m; m = m->next) {
        const int o = m->marker == JPEG_APP0 + 1 ? exif_orientation(m->data, m->data_length) : 0;
        if (o) out[ORIENTATION] = o;
    }
    out[HEIGHT] = cinfo->image_height;
    out[WIDTH] = cinfo->image_width;
    out[COMPLETE] = data[size - 2] == 0xFF && data[size - 1] == 0xD9;
    int most_h = 1, most_v = 1;
    for (int c = 0; c < cinfo->num_components; ++c) {
        if (cinfo->comp_info[c].h_samp_factor > most_h) most_h = cinfo->comp_info[c].h_samp_factor;
        if (cinfo->comp_info[c].v_samp_factor > most_v) most_v = cinfo->comp_info[c].v_samp_factor;
    }
    out[SUBSAMPLING] = 1;
    for (int c = 0; c < cinfo->num_components; ++c) {
        const jpeg_component_info *comp = &cinfo->comp_info[c];
        const int across = most_h / comp->h_samp_factor, down = most_v / comp->v_samp_factor;
        if (across > out[SUBSAMPLING]) out[SUBSAMPLING] = across;
        if (down > out[SUBSAMPLING]) out[SUBSAMPLING] = down;
    }
    jpeg_abort_decompress(cinfo);
}

/* The encoded images of a list as buffers; the count held, or -1 with an exception set
 * (none held then). */
static Py_ssize_t get_images(PyObject *list, Py_buffer **views) {
    if (!PyList_Check(list)) {
        PyErr_Format(PyExc_TypeError, "the encoded images must be a list");
        return -1;
    }
    const Py_ssize_t n = PyList_GET_SIZE(list);
    *views = calloc(n ? n : 1, sizeof(Py_buffer));
    if (!*views) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; ++i)
        if (PyObject_GetBuffer(PyList_GET_ITEM(list, i), &(*views)[i], PyBUF_SIMPLE) < 0) {
            while (i--) PyBuffer_Release(&(*views)[i]);
            free(*views);
            return -1;
        }
    return n;
}

static void release_images(Py_buffer *views, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; ++i) PyBuffer_Release(&views[i]);
    free(views);
}

static PyObject *headers(PyObject *self, PyObject *args) {
    PyObject *list;
    Py_buffer out, *views;
    if (!PyArg_ParseTuple(args, "Ow*", &list, &out)) return NULL;
    const Py_ssize_t n = get_images(list, &views);
    if (n < 0 || out.len < (Py_ssize_t)sizeof(int64_t) * FACTS * n) {
        if (n >= 0) {
            PyErr_Format(PyExc_ValueError, "out: %zd bytes, need %zd", out.len,
                         (Py_ssize_t)sizeof(int64_t) * FACTS * n);
            release_images(views, n);
        }
        PyBuffer_Release(&out);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    struct jpeg_decompress_struct cinfo;
    Errors err;
    if (new_decompressor(&cinfo, &err) < 0) {
        memset(out.buf, 0, sizeof(int64_t) * FACTS * n); /* no facts: the images take the fallback path */
    } else {
        jpeg_save_markers(&cinfo, JPEG_APP0 + 1, 0xFFFF);
        for (Py_ssize_t i = 0; i < n; ++i)
            read_facts(&cinfo, &err, views[i].buf, (size_t)views[i].len, (int64_t *)out.buf + FACTS * i);
        jpeg_destroy_decompress(&cinfo);
    }
    Py_END_ALLOW_THREADS
    release_images(views, n);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

typedef struct {
    struct jpeg_decompress_struct cinfo;
    Errors err;
    uint8_t *scratch; /* decoded windows, one at a time */
    size_t capacity;
    JSAMPROW *rows;
    size_t nrows;
    uint8_t *sub; /* the JPEG of a window's restart intervals (sub_jpeg) */
    size_t sub_capacity;
} Decoder;

/* Grow `*buf` to hold `need` items of `size` bytes; 0, or -1 when out of memory. */
static int reserve(void **buf, size_t *have, size_t need, size_t size) {
    if (need <= *have) return 0;
    void *grown = realloc(*buf, need * size);
    if (!grown) return -1;
    *buf = grown;
    *have = need;
    return 0;
}

/* Walk the markers of the JPEG `data` from SOI to its first scan: *scan becomes where the
 * scan's entropy-coded data starts. Where `out` is given, also copy the header there
 * (*copied bytes) without its metadata segments (APP1-APP13, APP15, COM: Exif, ICC, XMP;
 * APP0 (JFIF) and APP14 (Adobe) stay: they say the colour space), the frame's size set to
 * height x width. Returns where the SOF marker (its 0xFF) is in `data`; 0 where the
 * markers do not parse or hold no SOF. */
static size_t walk_header(const uint8_t *data, size_t size, size_t *scan, uint8_t *out, size_t *copied, long height,
                          long width) {
    size_t p = 2, sof = 0, n = 2;
    if (out) out[0] = 0xFF, out[1] = 0xD8;
    while (p + 4 <= size && data[p] == 0xFF) {
        const unsigned marker = data[p + 1];
        if (marker == 0xFF) { /* a fill byte */
            ++p;
            continue;
        }
        const size_t end = p + 2 + read16(data + p + 2, 0);
        if (end > size) return 0;
        /* SOF0-SOF15 but DHT (C4), JPG (C8) and DAC (CC) */
        const int is_sof = marker >= 0xC0 && marker <= 0xCF && marker != 0xC4 && marker != 0xC8 && marker != 0xCC;
        if (is_sof) sof = p;
        if (out && !((marker >= 0xE1 && marker <= 0xED) || marker == 0xEF || marker == 0xFE)) {
            memcpy(out + n, data + p, end - p);
            if (is_sof && end - p >= 9) { /* the frame's height and width */
                out[n + 5] = (uint8_t)(height >> 8), out[n + 6] = (uint8_t)height;
                out[n + 7] = (uint8_t)(width >> 8), out[n + 8] = (uint8_t)width;
            }
            n += end - p;
        }
        if (marker == 0xDA) {
            *scan = end;
            if (copied) *copied = n;
            return sof;
        }
        p = end;
    }
    return 0;
}

/* The JPEG of the restart intervals of `data` (whose header d->cinfo has read) that cover
 * the window win (rows win[0]..win[2], columns win[1]..win[3] of the 1/denom-scaled image)
 * and EDGE pixels around it on each side (the context the chroma upsampler reads) into
 * d->sub: `data`'s header (no metadata) with the frame's size changed, the intervals'
 * entropy-coded data with their restart markers numbered anew, EOI. `restarts` (`count` uint32): where each
 * interval's entropy-coded data starts in `data`. It serves where an interval is a whole
 * number of MCU rows or an even part of one, in a single sequential scan. Its size in
 * bytes, *top and *left the full-image pixel of its first; 0 where the intervals do not
 * serve this window (decode `data` itself), -1 with d->err.message where `restarts` do not
 * fit the data. `restarts` are little-endian, read bytewise (a record may sit anywhere). */
static long sub_jpeg(Decoder *d, const uint8_t *data, size_t size, const uint8_t *restarts, size_t count, int denom,
                     const int win[4], int *top, int *left) {
    const struct jpeg_decompress_struct *c = &d->cinfo;
    const size_t interval = c->restart_interval;
    if (!interval || c->progressive_mode || c->comps_in_scan != c->num_components) return 0;
    const long H = (long)c->image_height, W = (long)c->image_width;
    const long mcu_h = c->num_components == 1 ? DCTSIZE : DCTSIZE * c->max_v_samp_factor;
    const long mcu_w = c->num_components == 1 ? DCTSIZE : DCTSIZE * c->max_h_samp_factor;
    const size_t per_row = (size_t)((W + mcu_w - 1) / mcu_w), mcu_rows = (size_t)((H + mcu_h - 1) / mcu_h);
    size_t scan = 0;
    const size_t sof = walk_header(data, size, &scan, NULL, NULL, 0, 0);
    const size_t intervals = (per_row * mcu_rows + interval - 1) / interval;
    if (!sof || count != intervals || read32(restarts, 1) != scan) {
        snprintf(d->err.message, sizeof d->err.message,
                 "%zu restart offsets starting at byte %u do not fit the JPEG's %zu intervals of %zu MCUs from "
                 "byte %zu", count, count ? read32(restarts, 1) : 0, intervals, interval, scan);
        return -1;
    }
    /* the intervals as a grid: bands of `band` MCU rows, each of `across` intervals */
    size_t band, across;
    if (interval % per_row == 0) band = interval / per_row, across = 1;
    else if (per_row % interval == 0) band = 1, across = per_row / interval;
    else return 0;
    const size_t bands = (mcu_rows + band - 1) / band;
    const long y0 = (long)win[0] * denom, x0 = (long)win[1] * denom;
    const long y1 = (long)win[2] * denom < H ? (long)win[2] * denom : H;
    const long x1 = (long)win[3] * denom < W ? (long)win[3] * denom : W;
    if (y0 < 0 || x0 < 0 || y0 >= y1 || x0 >= x1) return 0; /* decode_window says what is wrong */
    /* MCU rows r0..r1 and columns m0..m1: the window's and EDGE scaled pixels around it, which
     * the chroma upsampler reads (at the decoded image's edges it reads other pixels) */
    const long margin = (long)EDGE * denom;
    const size_t r0 = y0 > margin ? (size_t)((y0 - margin) / mcu_h) : 0;
    const size_t r1 = (size_t)((y1 + margin + mcu_h - 1) / mcu_h);
    const size_t m0 = x0 > margin ? (size_t)((x0 - margin) / mcu_w) : 0;
    const size_t m1 = (size_t)((x1 + margin + mcu_w - 1) / mcu_w);
    const size_t cols = per_row / across; /* MCUs across an interval */
    const size_t b0 = r0 / band, b1 = r1 < mcu_rows ? (r1 + band - 1) / band : bands;
    const size_t j0 = m0 / cols, j1 = m1 < per_row ? (m1 + cols - 1) / cols : across;
    if (b0 == 0 && b1 == bands && j0 == 0 && j1 == across) return 0; /* all of it */
    *top = (int)(b0 * band * mcu_h);
    *left = (int)(j0 * cols * mcu_w);
    const long bottom = (long)(b1 * band) * mcu_h, right = (long)(j1 * cols) * mcu_w;
    const long h = (bottom < H ? bottom : H) - *top, w = (right < W ? right : W) - *left;
    if (reserve((void **)&d->sub, &d->sub_capacity, size + 2, 1) < 0) {
        snprintf(d->err.message, sizeof d->err.message, "out of memory");
        return -1;
    }
    uint8_t *out = d->sub;
    size_t n = 0, taken = scan; /* taken: the bytes of `data` read so far (the intervals taken are disjoint) */
    walk_header(data, size, &scan, out, &n, h, w);
    unsigned rst = 0, first = 1;
    for (size_t b = b0; b < b1; ++b)
        for (size_t j = j0; j < j1; ++j) {
            const size_t k = b * across + j, start = read32(restarts + 4 * k, 1);
            const size_t next = k + 1 < count ? read32(restarts + 4 * (k + 1), 1) : size, end = next - 2;
            const unsigned marker = k + 1 < count ? 0xD0 + k % 8 : 0xD9; /* what ends interval k */
            if (start < taken || next < start + 2 || next > size || data[end] != 0xFF || data[end + 1] != marker) {
                snprintf(d->err.message, sizeof d->err.message,
                         "restart interval %zu (bytes %zu to %zu) does not end with marker 0xFF%02X", k, start, next,
                         marker);
                return -1;
            }
            taken = next;
            if (!first) { /* RST0, RST1 ... RST7, RST0 ... between the intervals */
                out[n++] = 0xFF;
                out[n++] = (uint8_t)(0xD0 + rst);
                rst = (rst + 1) % 8;
            }
            first = 0;
            memcpy(out + n, data + start, end - start);
            n += end - start;
        }
    out[n++] = 0xFF;
    out[n++] = 0xD9;
    return (long)n;
}

/* Decode rows win[0]..win[2], columns win[1]..win[3] of the 1/denom-scaled image of
 * `data` (win[2] and win[3] are clipped to it) into d->scratch: *origin is pixel (win[0],
 * win[1]), rows `*stride` bytes apart. `*channels`: on entry 1 where a grayscale JPEG may
 * stay gray though RGB is asked (else 0), on return the channels decoded (1 or 3). 0, or
 * -1 with d->err.message saying why. */
static int decode_window(Decoder *d, const uint8_t *data, size_t size, const uint8_t *restarts, size_t count,
                         int gray, int denom, int win[4], const uint8_t **origin, size_t *stride, int *channels) {
    struct jpeg_decompress_struct *cinfo = &d->cinfo;
    if (setjmp(d->err.jump)) {
        jpeg_abort_decompress(cinfo);
        return -1;
    }
    jpeg_mem_src(cinfo, data, (unsigned long)size);
    jpeg_read_header(cinfo, TRUE);
    int top = 0, left = 0; /* where the JPEG decoded starts in the image: full-image pixels */
    if (restarts) {
        const long n = sub_jpeg(d, data, size, restarts, count, denom, win, &top, &left);
        if (n < 0) {
            jpeg_abort_decompress(cinfo);
            return -1;
        }
        if (n > 0) {
            jpeg_abort_decompress(cinfo);
            jpeg_mem_src(cinfo, d->sub, (unsigned long)n);
            jpeg_read_header(cinfo, TRUE);
            win[0] -= top / denom, win[1] -= left / denom, win[2] -= top / denom, win[3] -= left / denom;
        }
    }
    if (*channels == 1) gray = gray || cinfo->jpeg_color_space == JCS_GRAYSCALE;
    cinfo->out_color_space = gray ? JCS_GRAYSCALE : JCS_RGB;
    cinfo->scale_num = 1;
    cinfo->scale_denom = (unsigned int)denom;
    cinfo->dct_method = JDCT_ISLOW; /* DALI's and simplejpeg's choices, whatever this libjpeg's defaults */
    cinfo->do_fancy_upsampling = TRUE;
    jpeg_start_decompress(cinfo);
    const int C = *channels = gray ? 1 : 3, h = (int)cinfo->output_height, w = (int)cinfo->output_width;
    const int y0 = win[0], x0 = win[1];
    const int y1 = win[2] = win[2] < h ? win[2] : h, x1 = win[3] = win[3] < w ? win[3] : w;
    if (y0 < 0 || x0 < 0 || y0 >= y1 || x0 >= x1) {
        snprintf(d->err.message, sizeof d->err.message, "window (%d, %d, %d, %d) is outside the %dx%d image", y0, x0,
                 y1, x1, h, w);
        jpeg_abort_decompress(cinfo);
        return -1;
    }
    JDIMENSION xoff = (JDIMENSION)(x0 > EDGE ? x0 - EDGE : 0);
    JDIMENSION width = (JDIMENSION)((x1 + EDGE < w ? x1 + EDGE : w) - (int)xoff);
    if (width < cinfo->output_width) jpeg_crop_scanline(cinfo, &xoff, &width);
    const size_t nrows = (size_t)(y1 - y0);
    *stride = (size_t)width * C;
    if (reserve((void **)&d->scratch, &d->capacity, *stride * nrows, 1) < 0
            || reserve((void **)&d->rows, &d->nrows, nrows, sizeof(JSAMPROW)) < 0) {
        snprintf(d->err.message, sizeof d->err.message, "out of memory");
        jpeg_abort_decompress(cinfo);
        return -1;
    }
    for (size_t r = 0; r < nrows; ++r) d->rows[r] = d->scratch + r * *stride;
    if (y0 > 0) jpeg_skip_scanlines(cinfo, (JDIMENSION)y0);
    while (cinfo->output_scanline < (JDIMENSION)y1)
        jpeg_read_scanlines(cinfo, d->rows + (cinfo->output_scanline - y0), (JDIMENSION)y1 - cinfo->output_scanline);
    jpeg_abort_decompress(cinfo); /* rows below the window are never decoded */
    *origin = d->scratch + (size_t)(x0 - (int)xoff) * C;
    win[0] += top / denom, win[1] += left / denom, win[2] += top / denom, win[3] += left / denom;
    return 0;
}

/* Decode the pixels sample s's clip reads (full-image pixels) at 1/denom scale and point
 * s at them: the box moves to the window's coordinates, scaled. `restarts`: the JPEG's
 * restart offsets (buf NULL: none). 0 or -1 as decode_window. */
static int decode_sample(Decoder *d, const uint8_t *data, size_t size, const Py_buffer *restarts, int gray, int denom,
                         Sample *s) {
    const int64_t *c = s->clip;
    int win[4] = {(int)(c[0] / denom), (int)(c[1] / denom), (int)((c[2] + denom - 1) / denom),
                  (int)((c[3] + denom - 1) / denom)};
    const uint8_t *origin;
    size_t stride;
    int channels = 1; /* a grayscale JPEG stays gray: the resampler writes its one channel as three */
    if (decode_window(d, data, size, restarts->buf, (size_t)restarts->len / 4, gray, denom, win, &origin, &stride,
                      &channels) < 0)
        return -1;
    s->src = origin;
    s->rs = (ptrdiff_t)stride;
    s->cs = channels;
    s->chs = 1;
    s->gray = channels == 1 && !gray;
    s->box[0] = s->box[0] / denom - win[0];
    s->box[1] = s->box[1] / denom - win[1];
    s->box[2] /= denom;
    s->box[3] /= denom;
    s->clip[0] = s->clip[1] = 0;
    s->clip[2] = win[2] - win[0];
    s->clip[3] = win[3] - win[1];
    return 0;
}

static void free_decoder(Decoder *d) {
    jpeg_destroy_decompress(&d->cinfo);
    free(d->scratch);
    free(d->sub);
    free(d->rows);
    free(d);
}

/* Each thread keeps one decoder from call to call (freed when the thread ends): its
 * scratch stays at the largest window decoded so far, so that the batches after the
 * first write memory already mapped instead of page-faulting in a fresh buffer. A scratch
 * larger than KEEP_SCRATCH (a window of some 3000x3700 RGB pixels) is freed after its
 * call, so that one huge image does not pin its size in every thread. */
#define KEEP_SCRATCH ((size_t)32 << 20)
static pthread_key_t decoder_key;
static int decoder_key_made;

static void drop_decoder(void *d) { free_decoder(d); }

static void make_decoder_key(void) { decoder_key_made = pthread_key_create(&decoder_key, drop_decoder) == 0; }

/* The end of a call's use of thread_decoder()'s `d`. */
static void release_decoder(Decoder *d, int owned) {
    if (owned) {
        free_decoder(d);
    } else if (d) {
        if (d->capacity > KEEP_SCRATCH) {
            free(d->scratch);
            d->scratch = NULL;
            d->capacity = 0;
        }
        if (d->sub_capacity > KEEP_SCRATCH) {
            free(d->sub);
            d->sub = NULL;
            d->sub_capacity = 0;
        }
    }
}

/* This thread's decoder; NULL when out of memory. `*owned`: it is the caller's alone
 * (where no thread key could be made); release_decoder() ends its use either way. */
static Decoder *thread_decoder(int *owned) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, make_decoder_key);
    Decoder *d = decoder_key_made ? pthread_getspecific(decoder_key) : NULL;
    *owned = 0;
    if (d) return d;
    if (!(d = calloc(1, sizeof *d))) return NULL;
    if (new_decompressor(&d->cinfo, &d->err) < 0) {
        free(d);
        return NULL;
    }
    if (!decoder_key_made || pthread_setspecific(decoder_key, d) != 0) *owned = 1;
    return d;
}

/* The restart offsets of one image: `obj` None or empty (view->buf NULL then) or a buffer
 * of little-endian uint32; 0, or -1 with an exception set. */
static int get_restarts(PyObject *obj, Py_buffer *view) {
    memset(view, 0, sizeof *view);
    if (obj == Py_None) return 0;
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0) return -1;
    if (view->len % 4) {
        PyErr_Format(PyExc_ValueError, "restart offsets: %zd bytes, want a uint32 array", view->len);
        PyBuffer_Release(view);
        return -1;
    }
    if (view->len == 0) { /* none */
        PyBuffer_Release(view);
        memset(view, 0, sizeof *view);
    }
    return 0;
}

static void release_restarts(Py_buffer *view) {
    if (view->buf) PyBuffer_Release(view);
}

static PyObject *decode_region(PyObject *self, PyObject *args) {
    Py_buffer data, out, restarts;
    PyObject *o_restarts = Py_None;
    int gray, denom, win[4];
    if (!PyArg_ParseTuple(args, "y*piiiiiw*|O", &data, &gray, &denom, &win[0], &win[1], &win[2], &win[3], &out,
                          &o_restarts))
        return NULL;
    if (get_restarts(o_restarts, &restarts) < 0) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&out);
        return NULL;
    }
    const int C = gray ? 1 : 3, want_h = win[2] - win[0], want_w = win[3] - win[1];
    PyObject *result = NULL;
    if (denom != 1 && denom != 2 && denom != 4 && denom != 8) {
        PyErr_Format(PyExc_ValueError, "denom %d: 1, 2, 4 or 8", denom);
    } else if (want_h < 1 || want_w < 1 || out.len < (Py_ssize_t)want_h * want_w * C) {
        PyErr_Format(PyExc_ValueError, "an empty region, or one that does not fit in `out`");
    } else {
        int failed, owned;
        char message[JMSG_LENGTH_MAX] = "out of memory";
        Py_BEGIN_ALLOW_THREADS
        const uint8_t *origin;
        size_t stride;
        Decoder *d = thread_decoder(&owned);
        int channels = 0;
        failed = !d || decode_window(d, data.buf, (size_t)data.len, restarts.buf, (size_t)restarts.len / 4, gray,
                                     denom, win, &origin, &stride, &channels) < 0;
        if (failed && d) memcpy(message, d->err.message, sizeof message);
        if (!failed && (win[2] - win[0] != want_h || win[3] - win[1] != want_w)) {
            snprintf(message, sizeof message, "the region ends outside the image");
            failed = 1;
        }
        for (int r = 0; !failed && r < want_h; ++r)
            memcpy((uint8_t *)out.buf + (size_t)r * want_w * C, origin + r * stride, (size_t)want_w * C);
        release_decoder(d, owned);
        Py_END_ALLOW_THREADS
        if (failed) PyErr_Format(PyExc_ValueError, "%s", message);
        else result = Py_NewRef(Py_None);
    }
    release_restarts(&restarts);
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return result;
}

/* CPU nanoseconds decode_resample has spent decoding and resampling, all threads, counted
 * only after time_stages(True) (for bench/images.py --profile: the two stages run in one
 * call); off, the per-image clock reads (system calls on some VMs) stay out of the loop */
static int64_t stage_ns[2];
static int timing;

static int64_t thread_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static PyObject *stage_times(PyObject *self, PyObject *args) {
    return Py_BuildValue("dd", 1e-9 * __atomic_load_n(&stage_ns[0], __ATOMIC_RELAXED),
                         1e-9 * __atomic_load_n(&stage_ns[1], __ATOMIC_RELAXED));
}

static PyObject *time_stages(PyObject *self, PyObject *arg) {
    const int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    __atomic_store_n(&timing, on, __ATOMIC_RELAXED);
    Py_RETURN_NONE;
}

static PyObject *decode_resample(PyObject *self, PyObject *args) {
    PyObject *list, *objs[8], *o_restarts = Py_None;
    Py_buffer o_denoms, *views, *restarts = NULL;
    BatchArgs a;
    int gray;
    if (!PyArg_ParseTuple(args, "Oy*pOOOOOOOOiiip|O", &list, &o_denoms, &gray, &objs[0], &objs[1], &objs[2],
                          &objs[3], &objs[4], &objs[5], &objs[6], &objs[7], &a.job.interp, &a.job.antialias,
                          &a.job.chw, &a.job.to_uint8, &o_restarts))
        return NULL;
    const Py_ssize_t n = get_images(list, &views);
    if (n < 0) {
        PyBuffer_Release(&o_denoms);
        return NULL;
    }
    Py_ssize_t held = 0; /* restart offsets held: per image, or none */
    int bad = 0;
    if (!(restarts = calloc(n ? n : 1, sizeof(Py_buffer)))) {
        PyErr_NoMemory();
        bad = 1;
    } else if (o_restarts != Py_None && (!PyList_Check(o_restarts) || PyList_GET_SIZE(o_restarts) != n)) {
        PyErr_Format(PyExc_TypeError, "restarts: a list of one uint32 array or None per image");
        bad = 1;
    }
    while (!bad && o_restarts != Py_None && held < n) {
        if (get_restarts(PyList_GET_ITEM(o_restarts, held), &restarts[held]) < 0) bad = 1;
        else ++held;
    }
    if (bad) {
        for (Py_ssize_t i = 0; i < held; ++i) release_restarts(&restarts[i]);
        free(restarts);
        release_images(views, n);
        PyBuffer_Release(&o_denoms);
        return NULL;
    }
    PyObject *result = NULL;
    char(*messages)[JMSG_LENGTH_MAX] = calloc(n ? n : 1, JMSG_LENGTH_MAX);
    int *status = calloc(n ? n : 1, sizeof(int));
    const int64_t *denoms = o_denoms.buf;
    if (!messages || !status) {
        PyErr_NoMemory();
    } else if (o_denoms.len < (Py_ssize_t)sizeof(int64_t) * n) {
        PyErr_Format(PyExc_ValueError, "denoms: %zd bytes, need %zd", o_denoms.len, (Py_ssize_t)sizeof(int64_t) * n);
    } else if (get_args(objs, n, gray ? 1 : 3, &a) == 0) {
        Py_ssize_t bad = -1;
        for (Py_ssize_t i = 0; i < n && bad < 0; ++i) {
            const int64_t dn = denoms[i];
            Sample s;
            if ((dn != 1 && dn != 2 && dn != 4 && dn != 8) || sample_args(&a, i, &s) < 0) bad = i;
        }
        if (bad >= 0) {
            PyErr_Format(PyExc_ValueError, "image %zd: want a denom of 1, 2, 4 or 8 and an output inside `out`", bad);
        } else {
            Py_BEGIN_ALLOW_THREADS
            int owned;
            Decoder *d = thread_decoder(&owned);
            const int timed = __atomic_load_n(&timing, __ATOMIC_RELAXED);
            int64_t ns[2] = {0, 0}, start = timed ? thread_ns() : 0;
            for (Py_ssize_t i = 0; i < n; ++i) {
                Sample s;
                sample_args(&a, i, &s);
                const int decoded = !d ? -1 : decode_sample(d, views[i].buf, (size_t)views[i].len, &restarts[i], gray,
                                                            (int)denoms[i], &s);
                const int64_t middle = timed ? thread_ns() : 0;
                if (decoded < 0) {
                    if (d) memcpy(messages[i], d->err.message, JMSG_LENGTH_MAX);
                    else snprintf(messages[i], JMSG_LENGTH_MAX, "out of memory");
                    status[i] = 1;
                } else if (resample_one(&a.job, &s) < 0) {
                    snprintf(messages[i], JMSG_LENGTH_MAX, "out of memory");
                    status[i] = 1;
                }
                const int64_t end = timed ? thread_ns() : 0;
                ns[0] += middle - start;
                ns[1] += end - middle;
                start = end;
            }
            __atomic_fetch_add(&stage_ns[0], ns[0], __ATOMIC_RELAXED);
            __atomic_fetch_add(&stage_ns[1], ns[1], __ATOMIC_RELAXED);
            release_decoder(d, owned);
            Py_END_ALLOW_THREADS
            result = PyList_New(0);
            for (Py_ssize_t i = 0; result && i < n; ++i) {
                if (!status[i]) continue;
                PyObject *item = Py_BuildValue("(ns)", i, messages[i]);
                if (!item || PyList_Append(result, item) < 0) Py_CLEAR(result);
                Py_XDECREF(item);
            }
        }
        release_args(&a);
    }
    free(messages);
    free(status);
    for (Py_ssize_t i = 0; i < held; ++i) release_restarts(&restarts[i]);
    free(restarts);
    release_images(views, n);
    PyBuffer_Release(&o_denoms);
    return result;
}

/* A growing memory destination for libjpeg's compressor (its own jpeg_mem_dest may free
 * the buffer it last reported when it grows it, so an error half way leaves no safe one). */
typedef struct {
    struct jpeg_destination_mgr pub;
    uint8_t *buf;
    size_t capacity;
} Sink;

static void sink_start(j_compress_ptr cinfo) {
    Sink *s = (Sink *)cinfo->dest;
    s->pub.next_output_byte = s->buf;
    s->pub.free_in_buffer = s->capacity;
}

static boolean sink_grow(j_compress_ptr cinfo) {
    Sink *s = (Sink *)cinfo->dest;
    uint8_t *grown = realloc(s->buf, s->capacity * 2);
    if (!grown) ERREXIT1(cinfo, JERR_OUT_OF_MEMORY, 0);
    s->pub.next_output_byte = grown + s->capacity; /* the buffer was full */
    s->pub.free_in_buffer = s->capacity;
    s->buf = grown;
    s->capacity *= 2;
    return TRUE;
}

static void sink_end(j_compress_ptr cinfo) { (void)cinfo; }

/* The restart interval nearest `interval` MCUs that makes the intervals a grid on rows of
 * `per_row` MCUs: a whole number of rows where `interval` is a row or more, else a divisor
 * of a row between half and twice `interval`, else a row (0). */
static unsigned fit_interval(unsigned interval, unsigned per_row) {
    if (interval >= per_row) {
        const unsigned rows = (interval + per_row / 2) / per_row, most = 65535 / per_row;
        return per_row * (rows < most ? rows : most);
    }
    unsigned best = 0;
    for (unsigned n = (interval + 1) / 2; n <= 2 * interval && n <= per_row; ++n) {
        const unsigned distance = n > interval ? n - interval : interval - n;
        const unsigned best_distance = best > interval ? best - interval : interval - best;
        if (per_row % n == 0 && (!best || distance <= best_distance)) best = n; /* a tie: the longer */
    }
    return best;
}

/* The JPEG `data` rewritten into sink->buf (*used bytes) with a restart marker every
 * `interval` MCUs (0: every MCU row; `fit`: the interval fit_interval picks): its DCT
 * coefficients, quantization tables and sampling copied, Huffman tables made optimal for
 * it, one sequential scan, the APP1 (Exif, XMP) and APP2 (ICC profile) markers kept. 0, or
 * -1 with err->message saying why. */
static int transcode(const uint8_t *data, size_t size, unsigned interval, int fit, Sink *sink, size_t *used,
                     Errors *err) {
    struct jpeg_decompress_struct src;
    struct jpeg_compress_struct dst;
    volatile int made = 0; /* 1: src made, 2: dst too */
    src.err = dst.err = jpeg_std_error(&err->mgr);
    err->mgr.error_exit = on_error;
    err->mgr.emit_message = on_message;
    if (setjmp(err->jump)) {
        if (made > 1) jpeg_destroy_compress(&dst);
        if (made > 0) jpeg_destroy_decompress(&src);
        return -1;
    }
    jpeg_create_decompress(&src);
    made = 1;
    jpeg_create_compress(&dst);
    made = 2;
    jpeg_mem_src(&src, data, (unsigned long)size);
    jpeg_save_markers(&src, JPEG_APP0 + 1, 0xFFFF);
    jpeg_save_markers(&src, JPEG_APP0 + 2, 0xFFFF);
    jpeg_read_header(&src, TRUE);
    jvirt_barray_ptr *coefficients = jpeg_read_coefficients(&src);
    jpeg_copy_critical_parameters(&src, &dst);
    dst.optimize_coding = TRUE;
    if (fit && interval) { /* the MCUs across the image: one block per MCU where one component is coded */
        const unsigned mcu_w = DCTSIZE * (src.num_components == 1 ? 1 : (unsigned)src.max_h_samp_factor);
        interval = fit_interval(interval, (src.image_width + mcu_w - 1) / mcu_w);
    }
    if (interval) dst.restart_interval = interval;
    else dst.restart_in_rows = 1;
    sink->pub.init_destination = sink_start;
    sink->pub.empty_output_buffer = sink_grow;
    sink->pub.term_destination = sink_end;
    dst.dest = &sink->pub;
    jpeg_write_coefficients(&dst, coefficients);
    for (jpeg_saved_marker_ptr m = src.marker_list; m; m = m->next)
        jpeg_write_marker(&dst, m->marker, m->data, m->data_length);
    jpeg_finish_compress(&dst);
    jpeg_finish_decompress(&src);
    *used = sink->capacity - sink->pub.free_in_buffer;
    jpeg_destroy_compress(&dst);
    jpeg_destroy_decompress(&src);
    return 0;
}

/* Where each restart interval's entropy-coded data starts in the single-scan JPEG `data`
 * (the scan's first byte, then the byte after each RSTn marker, up to the first other
 * marker) into a new array, *count of them; NULL where no scan is found or out of memory. */
static uint32_t *find_restarts(const uint8_t *data, size_t size, size_t *count) {
    size_t scan = 0, capacity = 64;
    if (!walk_header(data, size, &scan, NULL, NULL, 0, 0) || scan > UINT32_MAX || size > UINT32_MAX) return NULL;
    uint32_t *offsets = malloc(capacity * sizeof *offsets);
    if (!offsets) return NULL;
    offsets[0] = (uint32_t)scan;
    *count = 1;
    for (size_t p = scan; p + 1 < size; ++p) {
        if (data[p] != 0xFF || data[p + 1] == 0x00) continue; /* 0xFF00: a stuffed 0xFF byte */
        if (data[p + 1] < 0xD0 || data[p + 1] > 0xD7) break;
        if (reserve((void **)&offsets, &capacity, *count + 1, sizeof *offsets) < 0) {
            free(offsets);
            return NULL;
        }
        offsets[(*count)++] = (uint32_t)(p + 2);
        ++p;
    }
    return offsets;
}

static PyObject *add_restarts(PyObject *self, PyObject *args) {
    Py_buffer data;
    int interval, fit;
    if (!PyArg_ParseTuple(args, "y*ip", &data, &interval, &fit)) return NULL;
    if (interval < 0 || interval > 65535) {
        PyBuffer_Release(&data);
        return PyErr_Format(PyExc_ValueError, "restart interval %d: 0 (every MCU row) to 65535 MCUs", interval);
    }
    Errors err;
    Sink sink = {.capacity = (size_t)data.len + (size_t)data.len / 8 + 4096};
    size_t used = 0, count = 0;
    uint32_t *offsets = NULL;
    int failed;
    Py_BEGIN_ALLOW_THREADS
    sink.buf = malloc(sink.capacity);
    failed = !sink.buf ? -2 : transcode(data.buf, (size_t)data.len, (unsigned)interval, fit, &sink, &used, &err);
    if (!failed && !(offsets = find_restarts(sink.buf, used, &count))) failed = -2;
    Py_END_ALLOW_THREADS
    PyObject *result = NULL;
    if (failed == -2) PyErr_NoMemory();
    else if (failed) PyErr_Format(PyExc_ValueError, "%s", err.message);
    else result = Py_BuildValue("(y#y#)", sink.buf, (Py_ssize_t)used, offsets, (Py_ssize_t)(count * sizeof *offsets));
    free(sink.buf);
    free(offsets);
    PyBuffer_Release(&data);
    return result;
}

static PyMethodDef methods[] = {
    {"headers", headers, METH_VARARGS,
     "headers(images, out): per encoded image (a list of buffers) int64 components, progressive, EXIF "
     "orientation, height, width, complete (ends with EOI), subsampling (the largest factor a component is "
     "subsampled by) into out [N, 7]; all 0 where libjpeg cannot read the headers"},
    {"decode_resample", decode_resample, METH_VARARGS,
     "decode_resample(images, denoms, gray, boxes, clips, out_hw, offsets, flips, mean, inv_std, out, interp, "
     "antialias, chw, to_uint8, restarts=None) -> [(row, message)] of the images that failed: each image decoded where "
     "its clip reads (from the restart intervals that cover it where restarts[i] holds its restart offsets), "
     "DCT-scaled by 1/denom (the box and clip in full-image pixels), then resampled as gpuio.ops._resample.resample"},
    {"decode_region", decode_region, METH_VARARGS,
     "decode_region(data, gray, denom, y0, x0, y1, x1, out, restarts=None): rows y0..y1, columns x0..x1 of the "
     "1/denom-scaled image, HWC uint8 into out (from the restart intervals that cover them where `restarts` holds "
     "the JPEG's restart offsets); ValueError saying why it failed"},
    {"add_restarts", add_restarts, METH_VARARGS,
     "add_restarts(data, interval, fit) -> (jpeg, offsets): the JPEG rewritten losslessly with a restart marker every "
     "`interval` MCUs (0: every MCU row; fit: the nearest that divides a row, within half to twice it, else a row), "
     "and the uint32 offsets of each restart interval's first entropy-coded byte"},
    {"stage_times", stage_times, METH_NOARGS,
     "stage_times() -> (decode, resample): CPU seconds decode_resample has spent in each, all threads, while "
     "time_stages(True) was in force"},
    {"time_stages", time_stages, METH_O, "time_stages(on): count stage_times() from now (True) or stop (False)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpuio.ops._jpeg", NULL, -1, methods};

PyMODINIT_FUNC PyInit__jpeg(void) { return PyModule_Create(&module); }
