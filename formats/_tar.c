/* The header walk of a WebDataset tar shard, for gpuio.formats.webdataset.
 *
 * shard() reads the 512-byte headers of an uncompressed tar with pread(2), skipping
 * member data, and groups regular-file members into samples as webdataset.py's full
 * parser (_members, _scan) does: GNU long names ('L'), pax headers ('x': path and size
 * records; 'g' and 'K' passed over), ustar name prefixes; a member's key is its name up
 * to the first dot of the base name, its field the rest in ASCII lower case.
 *
 * It indexes only what it can index exactly the way the full parser does. Anything else
 * (a bad checksum or number, a truncated file, a sparse member, a malformed pax record,
 * a name that is not UTF-8 or whose field has non-ASCII bytes, a field twice in a sample,
 * a sample without a wanted field unless skipped, a read error) makes it return None:
 * the caller then runs the full parser, which indexes the rare cases and raises the
 * error, naming the tar and the header's byte offset, for the bad ones. The walk runs
 * with the GIL released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define BLOCK 512
#define WINDOW (64 << 10)        /* bytes read at once where headers lie close together */
#define EXTENDED_MAX (1 << 20)   /* the longest pax or long-name data the full parser takes */
#define MAX_FIELDS 64

typedef struct {
    char *data;
    size_t len, cap;
} Buf;

static int buf_reserve(Buf *b, size_t more) {
    if (b->len + more <= b->cap)
        return 0;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + more)
        cap *= 2;
    char *p = realloc(b->data, cap);
    if (!p)
        return -1;
    b->data = p;
    b->cap = cap;
    return 0;
}

static int buf_add(Buf *b, const void *src, size_t n) {
    if (buf_reserve(b, n))
        return -1;
    memcpy(b->data + b->len, src, n);
    b->len += n;
    return 0;
}

/* Read exactly n bytes at off (the caller has checked that the file holds them). */
static int read_at(int fd, char *dst, size_t n, int64_t off) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = pread(fd, dst + got, n - got, (off_t)(off + (int64_t)got));
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        got += (size_t)r;
    }
    return 0;
}

static int is_space(unsigned char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }

/* A size field (12 bytes) as the full parser's _number reads it, for the forms it can
 * read exactly: GNU base-256 (0x80 first) or octal digits between whitespace, ended by a
 * NUL or the field's end. -1 for anything else (negative, other spellings). */
static int64_t size_field(const unsigned char *f) {
    if (f[0] == 0x80) {
        uint64_t v = 0;
        for (int i = 1; i < 12; i++) {
            if (v >> 55)
                return -1;
            v = v << 8 | f[i];
        }
        return v > (uint64_t)INT64_MAX / 2 ? -1 : (int64_t)v;
    }
    int end = 0;
    while (end < 12 && f[end])
        end++;
    int i = 0;
    while (i < end && is_space(f[i]))
        i++;
    int64_t v = 0;
    int digits = 0;
    for (; i < end && f[i] >= '0' && f[i] <= '7'; i++, digits++)
        v = v * 8 + (f[i] - '0');
    while (i < end && is_space(f[i]))
        i++;
    if (i != end || digits > 20)
        return -1;
    return v; /* no digits: 0, as the full parser reads an empty field */
}

/* The checksum field as _octal_fields reads it: blanks (space, NUL), octal digits, then
 * blanks; -1 where it is not of that form. */
static int64_t checksum_field(const unsigned char *f) {
    int64_t v = 0;
    int state = 0; /* 0 leading blanks, 1 digits, 2 ended */
    for (int i = 0; i < 8; i++) {
        unsigned char c = f[i];
        int digit = c >= '0' && c <= '7', blank = c == ' ' || c == 0;
        if (digit && state < 2) {
            v = v * 8 + (c - '0');
            state = 1;
        } else if (digit || !blank) {
            return -1;
        } else if (state == 1) {
            state = 2;
        }
    }
    return v;
}

/* The header's checksum: its bytes summed with the checksum field taken as 8 spaces. */
static int checksum_ok(const unsigned char *h) {
    uint32_t sum = 0;
    for (int i = 0; i < BLOCK; i++) /* one pass the compiler vectorizes */
        sum += h[i];
    for (int i = 148; i < 156; i++)
        sum -= h[i];
    return checksum_field(h + 148) == (int64_t)sum + 8 * ' ';
}

/* Strict UTF-8, as Python's decoder takes it (no overlong forms, surrogates or code
 * points past U+10FFFF). */
static int utf8_ok(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned char c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t len;
        uint32_t cp;
        if (c >= 0xC2 && c <= 0xDF) {
            len = 2;
            cp = c & 0x1F;
        } else if (c >= 0xE0 && c <= 0xEF) {
            len = 3;
            cp = c & 0x0F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            len = 4;
            cp = c & 0x07;
        } else {
            return 0;
        }
        if (i + len > n)
            return 0;
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xC0) != 0x80)
                return 0;
            cp = cp << 6 | (s[i + k] & 0x3F);
        }
        if ((len == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)))
            return 0;
        i += len;
    }
    return 1;
}

/* The records of a pax header, as _pax_records reads them ("%d key=value\n" each, until
 * the data or a NUL ends); path and size are kept. 0 where a record is malformed or
 * spelled in a way only Python's int() reads. */
static int pax_records(const char *d, size_t n, Buf *path, int *has_path, int64_t *size, int *has_size) {
    size_t pos = 0;
    while (pos < n && d[pos] != 0) {
        const char *sp = memchr(d + pos, ' ', n - pos);
        if (!sp || sp == d + pos)
            return 0;
        size_t len = 0;
        for (const char *p = d + pos; p < sp; p++) {
            if (*p < '0' || *p > '9' || len > (size_t)EXTENDED_MAX)
                return 0;
            len = len * 10 + (size_t)(*p - '0');
        }
        if (len == 0 || pos + len > n || d[pos + len - 1] != '\n')
            return 0;
        const char *rec = sp + 1, *end = d + pos + len - 1;
        if (rec > end)
            return 0;
        const char *eq = memchr(rec, '=', (size_t)(end - rec));
        if (!eq)
            return 0;
        size_t klen = (size_t)(eq - rec);
        const char *val = eq + 1;
        size_t vlen = (size_t)(end - val);
        if (klen == 4 && !memcmp(rec, "path", 4)) {
            path->len = 0;
            if (buf_add(path, val, vlen))
                return 0;
            *has_path = 1;
        } else if (klen == 4 && !memcmp(rec, "size", 4)) {
            int64_t v = 0;
            if (vlen == 0 || vlen > 18)
                return 0;
            for (size_t k = 0; k < vlen; k++) {
                if (val[k] < '0' || val[k] > '9')
                    return 0;
                v = v * 10 + (val[k] - '0');
            }
            *size = v;
            *has_size = 1;
        }
        pos += len;
    }
    return 1;
}

typedef struct {
    int fd;
    int64_t size;
    int nfields, skip;
    const char *fields[MAX_FIELDS];
    Py_ssize_t field_len[MAX_FIELDS];
    Buf rows;     /* per sample: nfields offsets, then nfields lengths (int64) */
    Buf keys;     /* the samples' keys, UTF-8, back to back */
    Buf key_len;  /* int64 per sample */
    int64_t samples;
} Walk;

/* The sample being gathered. */
typedef struct {
    Buf key;
    int open;
    int64_t at[MAX_FIELDS], len[MAX_FIELDS];
} Sample;

/* Close the current sample: kept when it has every field, dropped under skip, else 0. */
static int flush(Walk *w, Sample *s) {
    if (!s->open)
        return 1;
    s->open = 0;
    for (int k = 0; k < w->nfields; k++)
        if (s->at[k] < 0)
            return w->skip;
    int64_t klen = (int64_t)s->key.len;
    if (buf_add(&w->rows, s->at, sizeof(int64_t) * w->nfields) || buf_add(&w->rows, s->len, sizeof(int64_t) * w->nfields)
        || buf_add(&w->keys, s->key.data, s->key.len) || buf_add(&w->key_len, &klen, sizeof klen))
        return 0;
    w->samples++;
    return 1;
}

/* One regular member: its name decides its sample and field. 0: the full parser decides. */
static int member(Walk *w, Sample *s, const unsigned char *name, size_t n, int64_t data_at, int64_t length) {
    if (!utf8_ok(name, n))
        return 0;
    size_t slash = n, dot;
    for (size_t i = n; i-- > 0;)
        if (name[i] == '/') {
            slash = i;
            break;
        }
    size_t base = slash == n ? 0 : slash + 1;
    for (dot = base; dot < n && name[dot] != '.'; dot++)
        ;
    if (dot == n || dot == base)
        return 1; /* no dot in the base name, or a leading one: not a sample's member */
    if (!s->open || s->key.len != dot || memcmp(s->key.data, name, dot)) {
        if (!flush(w, s))
            return 0;
        s->key.len = 0;
        if (buf_add(&s->key, name, dot))
            return 0;
        s->open = 1;
        for (int k = 0; k < w->nfields; k++)
            s->at[k] = -1;
    }
    const unsigned char *ext = name + dot + 1;
    size_t elen = n - dot - 1;
    for (size_t i = 0; i < elen; i++)
        if (ext[i] >= 0x80)
            return 0; /* Unicode lower case: the full parser's */
    for (int k = 0; k < w->nfields; k++) {
        if ((size_t)w->field_len[k] != elen)
            continue;
        size_t i = 0;
        while (i < elen) {
            unsigned char c = ext[i];
            if (c >= 'A' && c <= 'Z')
                c += 32;
            if (c != (unsigned char)w->fields[k][i])
                break;
            i++;
        }
        if (i == elen) {
            if (s->at[k] >= 0)
                return 0; /* a field twice in one sample: the full parser names it */
            s->at[k] = data_at;
            s->len[k] = length;
            break;
        }
    }
    return 1;
}

/* The walk; 1 when every header was indexed, 0 where the full parser must take over. */
static int walk(Walk *w) {
    int ok = 0;
    char *win = malloc(WINDOW);
    Buf ext = {0}, long_name = {0}, pax_path = {0}, name = {0};
    Sample s = {0};
    if (!win)
        return 0;
    int64_t pos = 0, win_at = 0, win_len = 0, last_jump = 0;
    int has_long = 0, has_path = 0, has_size = 0;
    int64_t pax_size = 0;
    for (;;) {
        if (pos + BLOCK > w->size)
            goto done; /* truncated */
        if (!(win_at <= pos && pos + BLOCK <= win_at + win_len)) {
            /* after a long member, read a page: the window would be mostly member data */
            int64_t want = last_jump > WINDOW / 2 ? 4096 : WINDOW;
            if (want > w->size - pos)
                want = w->size - pos;
            if (read_at(w->fd, win, (size_t)want, pos))
                goto done;
            win_at = pos;
            win_len = want;
        }
        const unsigned char *h = (const unsigned char *)win + (pos - win_at);
        int zero = 1;
        for (int i = 0; i < BLOCK && zero; i++)
            zero = h[i] == 0;
        if (zero)
            break;
        if (!checksum_ok(h))
            goto done;
        unsigned char type = h[156];
        int64_t length = size_field(h + 124);
        if (length < 0)
            goto done;
        int64_t data_at = pos + BLOCK;
        if (type == 'x' || type == 'L') {
            if (length > EXTENDED_MAX || data_at + length > w->size)
                goto done;
            ext.len = 0;
            if (buf_reserve(&ext, (size_t)length + 1) || read_at(w->fd, ext.data, (size_t)length, data_at))
                goto done;
            ext.len = (size_t)length;
            if (type == 'x') {
                has_path = has_size = 0; /* a pax header's records replace the last one's */
                if (!pax_records(ext.data, ext.len, &pax_path, &has_path, &pax_size, &has_size))
                    goto done;
            } else {
                char *nul = memchr(ext.data, 0, ext.len);
                long_name.len = 0;
                if (buf_add(&long_name, ext.data, nul ? (size_t)(nul - ext.data) : ext.len))
                    goto done;
                has_long = 1;
            }
        } else if (type == 'S') {
            goto done; /* sparse: its bytes are not contiguous */
        } else if (type != 'g' && type != 'K') {
            const unsigned char *nm;
            size_t n;
            if (has_path) {
                nm = (const unsigned char *)pax_path.data;
                n = pax_path.len;
            } else if (has_long && long_name.len) {
                nm = (const unsigned char *)long_name.data;
                n = long_name.len;
            } else {
                const unsigned char *nul = memchr(h, 0, 100);
                size_t nlen = nul ? (size_t)(nul - h) : 100;
                name.len = 0;
                if (!memcmp(h + 257, "ustar", 5)) {
                    const unsigned char *pnul = memchr(h + 345, 0, 155);
                    size_t plen = pnul ? (size_t)(pnul - (h + 345)) : 155;
                    if (plen && (buf_add(&name, h + 345, plen) || buf_add(&name, "/", 1)))
                        goto done;
                }
                if (buf_add(&name, h, nlen))
                    goto done;
                nm = (const unsigned char *)name.data;
                n = name.len;
            }
            if (has_size)
                length = pax_size;
            if (type == '0' || type == 0 || type == '7') {
                if (data_at + length > w->size || !member(w, &s, nm, n, data_at, length))
                    goto done;
            }
            has_long = has_path = has_size = 0;
        }
        last_jump = (length + BLOCK - 1) / BLOCK * BLOCK;
        pos = data_at + last_jump;
    }
    ok = flush(w, &s);
done:
    free(win);
    free(ext.data);
    free(long_name.data);
    free(pax_path.data);
    free(name.data);
    free(s.key.data);
    return ok;
}

static PyObject *shard(PyObject *self, PyObject *args) {
    (void)self;
    int fd, skip;
    long long size;
    PyObject *fields;
    if (!PyArg_ParseTuple(args, "iLO!p", &fd, &size, &PyTuple_Type, &fields, &skip))
        return NULL;
    Walk w = {0};
    w.fd = fd;
    w.size = size;
    w.skip = skip;
    w.nfields = (int)PyTuple_GET_SIZE(fields);
    if (w.nfields < 1 || w.nfields > MAX_FIELDS) {
        PyErr_Format(PyExc_ValueError, "between 1 and %d fields, got %d", MAX_FIELDS, w.nfields);
        return NULL;
    }
    for (int k = 0; k < w.nfields; k++) {
        PyObject *f = PyTuple_GET_ITEM(fields, k);
        if (!PyBytes_Check(f)) {
            PyErr_SetString(PyExc_TypeError, "fields must be bytes");
            return NULL;
        }
        w.fields[k] = PyBytes_AS_STRING(f);
        w.field_len[k] = PyBytes_GET_SIZE(f);
    }
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = walk(&w);
    Py_END_ALLOW_THREADS
    PyObject *out = NULL;
    if (ok) {
        out = Py_BuildValue("(y#y#y#L)", w.rows.data ? w.rows.data : "", (Py_ssize_t)w.rows.len,
                            w.keys.data ? w.keys.data : "", (Py_ssize_t)w.keys.len,
                            w.key_len.data ? w.key_len.data : "", (Py_ssize_t)w.key_len.len, (long long)w.samples);
    } else {
        out = Py_NewRef(Py_None);
    }
    free(w.rows.data);
    free(w.keys.data);
    free(w.key_len.data);
    return out;
}

static PyMethodDef methods[] = {
    {"shard", shard, METH_VARARGS,
     "shard(fd, size, fields, skip) -> (rows, keys, key_lengths, samples) or None; see _tar.pyi"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpuio.formats._tar", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__tar(void) { return PyModule_Create(&module); }
