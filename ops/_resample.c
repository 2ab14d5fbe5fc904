/* CPU image ops for gpuio.ops, run with the GIL released.
 *
 * resample(): crop -> resize -> flip -> normalize -> layout -> cast for a whole batch
 * of uint8 HWC images in one call (ops/_resample.h, which ops/_jpeg.c shares).
 */
#include "_resample.h"

static PyObject *resample(PyObject *self, PyObject *args) {
    PyObject *images, *objs[8];
    BatchArgs a;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOiiip", &images, &objs[0], &objs[1], &objs[2], &objs[3], &objs[4],
                          &objs[5], &objs[6], &objs[7], &a.job.interp, &a.job.antialias, &a.job.chw,
                          &a.job.to_uint8))
        return NULL;
    if (!PyList_Check(images)) return PyErr_Format(PyExc_TypeError, "images must be a list");
    const Py_ssize_t n = PyList_GET_SIZE(images);
    Py_buffer *views = calloc(n ? n : 1, sizeof(Py_buffer));
    Sample *samples = calloc(n ? n : 1, sizeof(Sample));
    Py_ssize_t nviews = 0;
    int channels = 1, have_args = 0;
    PyObject *result = NULL;
    if (!views || !samples) {
        PyErr_NoMemory();
        goto done;
    }
    for (; nviews < n; ++nviews) {
        Py_buffer *v = &views[nviews];
        if (PyObject_GetBuffer(PyList_GET_ITEM(images, nviews), v, PyBUF_STRIDED_RO) < 0) goto done;
        if (v->ndim != 3 || v->itemsize != 1 || v->shape[2] < 1 || v->shape[2] > 4
                || (nviews && v->shape[2] != channels)) {
            ++nviews;
            PyErr_Format(PyExc_ValueError, "image %zd: want uint8 HWC with the batch's 1-4 channels", nviews - 1);
            goto done;
        }
        channels = (int)v->shape[2];
    }
    if (get_args(objs, n, channels, &a) < 0) goto done;
    have_args = 1;
    for (Py_ssize_t i = 0; i < n; ++i) {
        const Py_buffer *v = &views[i];
        Sample *s = &samples[i];
        const int64_t *c = a.clips + 4 * i;
        if (sample_args(&a, i, s) < 0 || c[0] < 0 || c[1] < 0 || c[2] > v->shape[0] || c[3] > v->shape[1]
                || c[0] >= c[2] || c[1] >= c[3]) {
            PyErr_Format(PyExc_ValueError, "image %zd: want a clip inside it and an output inside `out`", i);
            goto done;
        }
        s->src = v->buf;
        s->rs = v->strides[0];
        s->cs = v->strides[1];
        s->chs = v->strides[2];
    }
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && !failed; ++i) failed = resample_one(&a.job, &samples[i]);
    Py_END_ALLOW_THREADS
    if (failed) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; i < nviews; ++i) PyBuffer_Release(&views[i]);
    if (have_args) release_args(&a);
    free(views);
    free(samples);
    return result;
}

static PyMethodDef methods[] = {
    {"resample", resample, METH_VARARGS,
     "resample(images, boxes, clips, out_hw, offsets, flips, mean, inv_std, out, interp, antialias, chw, "
     "to_uint8): see gpuio.ops.fused"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpuio.ops._resample", NULL, -1, methods};

PyMODINIT_FUNC PyInit__resample(void) { return PyModule_Create(&module); }
