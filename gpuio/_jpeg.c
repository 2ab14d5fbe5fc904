/* Region JPEG decoding for gpuio.ops on the CPU, run with the GIL released.
 *
 * decode_jpeg(): the rows y0..y1 of a JPEG decoded by libjpeg(-turbo), DCT-scaled by
 * 1/denom, with columns x0..x1 (aligned down to an iMCU by libjpeg) only: rows above
 * are skipped, rows below never decoded. Built where jpeglib.h and libjpeg exist;
 * elsewhere gpuio decodes whole images with simplejpeg.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdlib.h>
#include <string.h>
#include <setjmp.h>
#include <stdio.h>
#include <jpeglib.h>

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

typedef struct {
    const unsigned char *data;
    size_t size;
    int gray, denom, y0, x0, y1, x1;
    unsigned char *out;
    size_t capacity;
    unsigned int xoff, width;
    Errors err;
} Decode;

/* Runs without the GIL; 0 on success, else d->err.message says why. */
static int decode_rows(Decode *d) {
    struct jpeg_decompress_struct cinfo;
    JSAMPROW *volatile rows = NULL; /* volatile: read after a longjmp */
    cinfo.err = jpeg_std_error(&d->err.mgr);
    d->err.mgr.error_exit = on_error;
    d->err.mgr.emit_message = on_message;
    jpeg_create_decompress(&cinfo);
    if (setjmp(d->err.jump)) {
        free(rows);
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    jpeg_mem_src(&cinfo, d->data, (unsigned long)d->size);
    jpeg_read_header(&cinfo, TRUE);
    cinfo.out_color_space = d->gray ? JCS_GRAYSCALE : JCS_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned int)d->denom;
    jpeg_start_decompress(&cinfo);
    const int C = d->gray ? 1 : 3;
    if (d->y1 > (int)cinfo.output_height || d->x1 > (int)cinfo.output_width) {
        snprintf(d->err.message, sizeof d->err.message, "region %dx%d is outside the %ux%u decoded image",
                 d->y1, d->x1, cinfo.output_height, cinfo.output_width);
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    JDIMENSION xoff = (JDIMENSION)d->x0, width = (JDIMENSION)(d->x1 - d->x0);
    if (width < cinfo.output_width) jpeg_crop_scanline(&cinfo, &xoff, &width);
    d->xoff = xoff;
    d->width = width;
    const size_t stride = (size_t)width * C, nrows = (size_t)(d->y1 - d->y0);
    if (stride * nrows > d->capacity) {
        snprintf(d->err.message, sizeof d->err.message, "%zu rows of %zu bytes do not fit in %zu bytes",
                 nrows, stride, d->capacity);
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    if (d->y0 > 0) jpeg_skip_scanlines(&cinfo, (JDIMENSION)d->y0);
    rows = malloc(sizeof(JSAMPROW) * nrows);
    if (!rows) {
        snprintf(d->err.message, sizeof d->err.message, "out of memory");
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    for (size_t r = 0; r < nrows; ++r) rows[r] = d->out + r * stride;
    while (cinfo.output_scanline < (JDIMENSION)d->y1)
        jpeg_read_scanlines(&cinfo, rows + (cinfo.output_scanline - d->y0), (JDIMENSION)d->y1 - cinfo.output_scanline);
    free(rows);
    rows = NULL;
    jpeg_abort_decompress(&cinfo); /* rows below the region are never decoded */
    jpeg_destroy_decompress(&cinfo);
    return 0;
}

static PyObject *decode_jpeg(PyObject *self, PyObject *args) {
    Py_buffer data, out;
    Decode d;
    memset(&d, 0, sizeof d);
    if (!PyArg_ParseTuple(args, "y*iiiiiiw*", &data, &d.gray, &d.denom, &d.y0, &d.x0, &d.y1, &d.x1, &out))
        return NULL;
    PyObject *result = NULL;
    if (d.denom != 1 && d.denom != 2 && d.denom != 4 && d.denom != 8) {
        PyErr_Format(PyExc_ValueError, "denom %d: 1, 2, 4 or 8", d.denom);
    } else if (d.y0 < 0 || d.x0 < 0 || d.y1 <= d.y0 || d.x1 <= d.x0) {
        PyErr_Format(PyExc_ValueError, "empty or negative region (%d, %d, %d, %d)", d.y0, d.x0, d.y1, d.x1);
    } else {
        d.data = data.buf;
        d.size = (size_t)data.len;
        d.out = out.buf;
        d.capacity = (size_t)out.len;
        int failed;
        Py_BEGIN_ALLOW_THREADS
        failed = decode_rows(&d);
        Py_END_ALLOW_THREADS
        if (failed) PyErr_Format(PyExc_ValueError, "%s", d.err.message);
        else result = Py_BuildValue("II", d.xoff, d.width);
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"decode_jpeg", decode_jpeg, METH_VARARGS,
     "decode_jpeg(data, gray, denom, y0, x0, y1, x1, out) -> (xoff, width): rows y0..y1 of the "
     "1/denom-scaled image, columns xoff..xoff+width (covering x0..x1; libjpeg moves x0 down to an iMCU, "
     "at most 31 pixels), HWC uint8 written to `out`"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpuio._jpeg", NULL, -1, methods};

PyMODINIT_FUNC PyInit__jpeg(void) { return PyModule_Create(&module); }
