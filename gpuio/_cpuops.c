/* CPU image ops for gpuio.ops, run with the GIL released.
 *
 * resample(): crop -> resize -> flip -> normalize -> layout -> cast for a whole batch
 * of uint8 HWC images in one call (gpuio/_resample.h, which gpuio/_jpeg.c shares).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_resample.h"

/* A contiguous buffer of at least `need` bytes; -1 with an exception set otherwise. */
static int get_buf(PyObject *obj, Py_buffer *view, Py_ssize_t need, int writable, const char *what) {
    if (PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return -1;
    if (view->len < need) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, need %zd", what, view->len, need);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *resample(PyObject *self, PyObject *args) {
    PyObject *images, *o_boxes, *o_clips, *o_hw, *o_offsets, *o_flips, *o_mean, *o_istd, *o_out;
    Job job;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOiiip", &images, &o_boxes, &o_clips, &o_hw, &o_offsets, &o_flips,
                          &o_mean, &o_istd, &o_out, &job.interp, &job.antialias, &job.chw, &job.to_uint8))
        return NULL;
    if (!PyList_Check(images)) return PyErr_Format(PyExc_TypeError, "images must be a list");
    if (job.interp == CUBIC || job.interp < NEAREST || job.interp > AREA)
        return PyErr_Format(PyExc_ValueError, "interp %d: nearest, linear or area only", job.interp);
    const Py_ssize_t n = PyList_GET_SIZE(images);
    Py_buffer bufs[6], out;
    PyObject *objs[6] = {o_boxes, o_clips, o_hw, o_offsets, o_flips, o_mean};
    const Py_ssize_t needs[6] = {32 * n, 32 * n, 16 * n, 8 * n, 8 * n, 0};
    Py_buffer *views = calloc(n ? n : 1, sizeof(Py_buffer));
    Sample *samples = calloc(n ? n : 1, sizeof(Sample));
    Py_buffer istd;
    int nbuf = 0, nviews = 0, have_istd = 0, have_out = 0, channels = -1;
    PyObject *result = NULL;
    if (!views || !samples) { PyErr_NoMemory(); goto done; }
    for (; nbuf < 6; ++nbuf)
        if (get_buf(objs[nbuf], &bufs[nbuf], needs[nbuf], 0, "parameter array") < 0) goto done;
    if (get_buf(o_istd, &istd, bufs[5].len, 0, "inv_std") < 0) goto done;
    have_istd = 1;
    if (get_buf(o_out, &out, 0, 1, "out") < 0) goto done;
    have_out = 1;
    const double *boxes = bufs[0].buf;
    const int64_t *clips = bufs[1].buf, *hw = bufs[2].buf, *offsets = bufs[3].buf, *flips = bufs[4].buf;
    const Py_ssize_t item = job.to_uint8 ? 1 : 4;
    for (; nviews < n; ++nviews) {
        Py_buffer *v = &views[nviews];
        if (PyObject_GetBuffer(PyList_GET_ITEM(images, nviews), v, PyBUF_STRIDED_RO) < 0) goto done;
        Sample *s = &samples[nviews];
        const int64_t *c = clips + 4 * nviews;
        if (v->ndim != 3 || v->itemsize != 1 || (channels >= 0 && v->shape[2] != channels) || v->shape[2] > 4
                || c[0] < 0 || c[1] < 0 || c[2] > v->shape[0] || c[3] > v->shape[1] || c[0] >= c[2] || c[1] >= c[3]
                || hw[2 * nviews] < 1 || hw[2 * nviews + 1] < 1
                || (offsets[nviews] + hw[2 * nviews] * hw[2 * nviews + 1] * v->shape[2]) * item > out.len) {
            PyErr_Format(PyExc_ValueError, "image %zd: want uint8 HWC with the batch's 1-4 channels, a clip "
                         "inside it and an output inside `out`", nviews);
            ++nviews;
            goto done;
        }
        channels = (int)v->shape[2];
        s->src = v->buf;
        s->rs = v->strides[0]; s->cs = v->strides[1]; s->chs = v->strides[2];
        memcpy(s->box, boxes + 4 * nviews, sizeof s->box);
        memcpy(s->clip, c, sizeof s->clip);
        memcpy(s->out_hw, hw + 2 * nviews, sizeof s->out_hw);
        s->offset = offsets[nviews];
        s->flip = flips[nviews];
    }
    if (n && bufs[5].len < (Py_ssize_t)sizeof(float) * channels) {
        PyErr_Format(PyExc_ValueError, "mean has fewer than %d values", channels);
        goto done;
    }
    job.channels = channels;
    job.mean = bufs[5].buf;
    job.inv_std = istd.buf;
    job.out = out.buf;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && !failed; ++i) failed = resample_one(&job, &samples[i]);
    Py_END_ALLOW_THREADS
    if (failed) { PyErr_NoMemory(); goto done; }
    result = Py_NewRef(Py_None);
done:
    for (int i = 0; i < nviews; ++i) PyBuffer_Release(&views[i]);
    for (int i = 0; i < nbuf; ++i) PyBuffer_Release(&bufs[i]);
    if (have_istd) PyBuffer_Release(&istd);
    if (have_out) PyBuffer_Release(&out);
    free(views);
    free(samples);
    return result;
}

static PyMethodDef methods[] = {
    {"resample", resample, METH_VARARGS,
     "resample(images, boxes, clips, out_hw, offsets, flips, mean, inv_std, out, interp, antialias, chw, "
     "to_uint8): see gpuio.ops.fused"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpuio._cpuops", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpuops(void) { return PyModule_Create(&module); }
