/* The protobuf wire scan of blockagg.proto.decode, compiled: one pass per row instead of
 * numpy's lock step across rows.
 *
 * It reads only rows it can prove *regular*: every tag of at most 5 bytes, below 2**32,
 * field number above 0, wire type 0, 1, 2 or 5, every varint ending within 10 bytes and
 * inside the row, every length prefix of at most 5 bytes and within the row, every fixed
 * value inside the row, and no second occurrence of a singular field the caller marks
 * watched. On such rows numpy's lock-step scan sets no error code, so both record the same
 * occurrences. On anything else `count` answers False, and the caller runs the numpy scan
 * over all the rows: what to make of a damaged row stays decided in one place.
 *
 * spec: one int32 per field number 0..max: -1 for a number the message does not declare,
 * else (slot << 8) | flags, flags: bits 0-2 the expected wire type, FL_REPEATED,
 * FL_PACKABLE, FL_WATCH (below); groups: one int32 per slot, the slot whose "seen" flag a
 * watched slot shares (the members of one oneof share one: upb's case changes). The outputs are the caller's numpy arrays, by slot: a
 * singular slot's (present u8[n], value u64[n], length i64[n] or empty), as the lock step
 * leaves them (the last occurrence's value); a repeated slot's (rows, steps, values,
 * lengths), sized from `count`, one element per value in row order, then wire order, a
 * packed run's values in place of its tag. A step is the index of the tag within its row,
 * the lock step's iteration at which numpy records it. Values are a varint's value, or
 * where a fixed or length-delimited value's bytes start in the buffer.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define FL_REPEATED 0x10
#define FL_PACKABLE 0x20
#define FL_WATCH 0x40

enum { WT_VARINT = 0, WT_I64 = 1, WT_LEN = 2, WT_I32 = 5 };

/* A varint at *p, ending before `end` and within `max_bytes`; 0 when it does not. */
static inline int read_varint(const uint8_t **p, const uint8_t *end, int max_bytes,
                              uint64_t *out) {
    const uint8_t *q = *p;
    uint64_t v = 0;
    for (int i = 0; i < max_bytes; i++) {
        if (q >= end)
            return 0;
        uint8_t b = *q++;
        v |= (uint64_t)(b & 0x7F) << (7 * i);
        if (!(b & 0x80)) {
            *p = q;
            *out = v;
            return 1;
        }
    }
    return 0;
}

/* One field occurrence, as the scan hands it to a visitor. */
typedef struct {
    int64_t row, step;
    int32_t entry;  /* spec entry, -1 when unknown */
    int wt;
    uint64_t value; /* varint value, or the length of a length-delimited value */
    int64_t dpos;   /* where a fixed or length-delimited value's bytes start */
} occurrence;

typedef struct {
    Py_buffer buf[4];
    int held;
    int64_t elements;  /* fill cursor of a repeated slot */
} slot_out;

typedef struct {
    const int32_t *spec;
    Py_ssize_t spec_len;
    const int32_t *groups; /* per slot: its index in `seen` */
    int64_t *counts;      /* count: elements per slot */
    slot_out *outs;       /* fill */
    uint8_t *seen;        /* per slot, for FL_WATCH: reset per row */
    Py_ssize_t slots;
} scan_state;

#define FITS(b, k) ((Py_ssize_t)(8 * ((k) + 1)) <= (b).len)

/* Write one occurrence to a slot's arrays; 0 when they have no room for it. */
static inline int record(slot_out *o, int32_t entry, int64_t row, int64_t step, int wt,
                         uint64_t value, int64_t dpos) {
    if (!(entry & FL_REPEATED)) {
        if (row >= o->buf[0].len || !FITS(o->buf[1], row)
            || (wt == WT_LEN && !FITS(o->buf[2], row)))
            return 0;
        ((uint8_t *)o->buf[0].buf)[row] = 1;
        ((uint64_t *)o->buf[1].buf)[row] = wt == WT_VARINT ? value : (uint64_t)dpos;
        if (wt == WT_LEN)
            ((int64_t *)o->buf[2].buf)[row] = (int64_t)value;
        return 1;
    }
    int64_t k = o->elements++;
    if (!FITS(o->buf[0], k) || !FITS(o->buf[1], k) || !FITS(o->buf[2], k)
        || (wt == WT_LEN && !FITS(o->buf[3], k)))
        return 0;
    ((int64_t *)o->buf[0].buf)[k] = row;
    ((int64_t *)o->buf[1].buf)[k] = step;
    ((uint64_t *)o->buf[2].buf)[k] = wt == WT_VARINT ? value : (uint64_t)dpos;
    if (wt == WT_LEN)
        ((int64_t *)o->buf[3].buf)[k] = (int64_t)value;
    return 1;
}

/* The elements of a packed run of `expected` wire type at [q, end) as occurrences of the
 * tag's step, counted or recorded; 0 when the run is not regular (a varint cut off or over
 * 10 bytes, a length not a multiple of the width). */
static int packed_run(scan_state *st, Py_ssize_t slot, int32_t entry, int expected,
                      int64_t row, int64_t step, const uint8_t *base, const uint8_t *q,
                      const uint8_t *end) {
    int64_t width = expected == WT_I64 ? 8 : expected == WT_I32 ? 4 : 0;
    if (width && (end - q) % width)
        return 0;
    while (q < end) {
        uint64_t value = 0;
        int64_t dpos = q - base;
        if (width)
            q += width;
        else if (!read_varint(&q, end, 10, &value))
            return 0;
        if (st->counts)
            st->counts[slot] += 1;
        else if (!record(&st->outs[slot], entry, row, step, expected, value, dpos))
            return 0;
    }
    return 1;
}

/* Scan row [p, end); 0 when it is not regular. With `outs`, record its occurrences. */
static int scan_row(scan_state *st, int64_t row, const uint8_t *base, const uint8_t *p,
                    const uint8_t *end) {
    int64_t step = 0;
    if (st->seen)
        memset(st->seen, 0, (size_t)st->slots);
    while (p < end) {
        uint64_t tag, value = 0;
        if (!read_varint(&p, end, 5, &tag) || tag > 0xFFFFFFFFull || (tag >> 3) == 0)
            return 0;
        int wt = (int)(tag & 7);
        uint64_t number = tag >> 3;
        int64_t dpos = 0;
        switch (wt) {
        case WT_VARINT:
            if (!read_varint(&p, end, 10, &value))
                return 0;
            break;
        case WT_I64:
        case WT_I32: {
            Py_ssize_t width = wt == WT_I64 ? 8 : 4;
            if (end - p < width)
                return 0;
            dpos = p - base;
            p += width;
            break;
        }
        case WT_LEN:
            if (!read_varint(&p, end, 5, &value) || value > (uint64_t)(end - p))
                return 0;
            dpos = p - base;
            p += value;
            break;
        default:
            return 0;
        }
        int32_t entry = (Py_ssize_t)number < st->spec_len ? st->spec[number] : -1;
        if (entry >= 0) {
            Py_ssize_t slot = entry >> 8;
            int expected = entry & 7;
            int packed = wt == WT_LEN && wt != expected && (entry & FL_PACKABLE);
            if (packed) {
                const uint8_t *run = base + dpos;
                if (!packed_run(st, slot, entry, expected, row, step, base, run, run + value))
                    return 0;
            } else if (wt == expected) {
                if (!(entry & FL_REPEATED) && (entry & FL_WATCH)) {
                    int32_t group = st->groups[slot];
                    if (st->seen[group])
                        return 0;
                    st->seen[group] = 1;
                }
                if (st->counts)
                    st->counts[slot] += (entry & FL_REPEATED) ? 1 : 0;
                else if (!record(&st->outs[slot], entry, row, step, wt, value, dpos))
                    return 0;
            }
        }
        step++;
    }
    return 1;
}

static int get_rows(PyObject *buf_obj, PyObject *starts_obj, PyObject *ends_obj,
                    Py_buffer *buf, Py_buffer *starts, Py_buffer *ends) {
    if (PyObject_GetBuffer(buf_obj, buf, PyBUF_SIMPLE) < 0)
        return 0;
    if (PyObject_GetBuffer(starts_obj, starts, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(buf);
        return 0;
    }
    if (PyObject_GetBuffer(ends_obj, ends, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(buf);
        PyBuffer_Release(starts);
        return 0;
    }
    if (starts->len != ends->len || starts->len % 8) {
        PyErr_SetString(PyExc_ValueError, "starts and ends: int64 arrays of one length");
        goto fail;
    }
    const int64_t *s = starts->buf, *e = ends->buf;
    for (Py_ssize_t i = 0; i < starts->len / 8; i++) {
        if (s[i] < 0 || e[i] < s[i] || e[i] > buf->len) {
            PyErr_SetString(PyExc_ValueError, "a row lies outside the buffer");
            goto fail;
        }
    }
    return 1;
fail:
    PyBuffer_Release(buf);
    PyBuffer_Release(starts);
    PyBuffer_Release(ends);
    return 0;
}

static int scan_rows(scan_state *st, Py_buffer *buf, Py_buffer *starts, Py_buffer *ends) {
    const uint8_t *base = buf->buf;
    const int64_t *s = starts->buf, *e = ends->buf;
    Py_ssize_t n = starts->len / 8;
    int regular = 1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!scan_row(st, i, base, base + s[i], base + e[i])) {
            regular = 0;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    return regular;
}

/* The spec's slots (one past the highest); groups: an int32 per slot, each in [0, slots). */
static int check_spec(Py_buffer *spec, Py_buffer *groups, Py_ssize_t *slots) {
    if (spec->len % 4) {
        PyErr_SetString(PyExc_ValueError, "spec: an int32 array");
        return 0;
    }
    Py_ssize_t most = 0;
    const int32_t *v = spec->buf;
    for (Py_ssize_t i = 0; i < spec->len / 4; i++)
        if (v[i] >= 0 && (v[i] >> 8) + 1 > most)
            most = (v[i] >> 8) + 1;
    const int32_t *g = groups->buf;
    if (groups->len != 4 * most) {
        PyErr_SetString(PyExc_ValueError, "groups: an int32 per slot");
        return 0;
    }
    for (Py_ssize_t k = 0; k < most; k++)
        if (g[k] < 0 || g[k] >= most) {
            PyErr_SetString(PyExc_ValueError, "groups: each a slot's index");
            return 0;
        }
    *slots = most;
    return 1;
}

/* count(buf, starts, ends, spec, groups, counts) -> bool: whether every row is regular; counts
 * (int64, one per slot) gets each repeated slot's elements, packed ones included. */
static PyObject *count(PyObject *self, PyObject *args) {
    PyObject *buf_obj, *starts_obj, *ends_obj;
    Py_buffer buf, starts, ends, spec, groups, counts;
    if (!PyArg_ParseTuple(args, "OOOy*y*w*", &buf_obj, &starts_obj, &ends_obj, &spec, &groups,
                          &counts))
        return NULL;
    PyObject *result = NULL;
    uint8_t *seen = NULL;
    Py_ssize_t slots;
    if (!get_rows(buf_obj, starts_obj, ends_obj, &buf, &starts, &ends))
        goto out;
    if (!check_spec(&spec, &groups, &slots))
        goto rows;
    if (counts.len < (Py_ssize_t)(8 * slots)) {
        PyErr_SetString(PyExc_ValueError, "counts: an int64 per slot");
        goto rows;
    }
    memset(counts.buf, 0, (size_t)counts.len);
    seen = PyMem_Calloc((size_t)slots + 1, 1);
    if (!seen) {
        PyErr_NoMemory();
        goto rows;
    }
    scan_state st = {spec.buf, spec.len / 4, groups.buf, counts.buf, NULL, seen, slots};
    result = PyBool_FromLong(scan_rows(&st, &buf, &starts, &ends));
    PyMem_Free(seen);
rows:
    PyBuffer_Release(&buf);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&ends);
out:
    PyBuffer_Release(&spec);
    PyBuffer_Release(&groups);
    PyBuffer_Release(&counts);
    return result;
}

/* fill(buf, starts, ends, spec, groups, outs) -> None: records every occurrence into `outs` (a
 * sequence, one tuple of writable arrays per slot, sized from `count`). */
static PyObject *fill(PyObject *self, PyObject *args) {
    PyObject *buf_obj, *starts_obj, *ends_obj, *outs_obj;
    Py_buffer buf, starts, ends, spec, groups;
    if (!PyArg_ParseTuple(args, "OOOy*y*O", &buf_obj, &starts_obj, &ends_obj, &spec, &groups,
                          &outs_obj))
        return NULL;
    PyObject *result = NULL, *outs_seq = NULL;
    slot_out *outs = NULL;
    uint8_t *seen = NULL;
    Py_ssize_t slots = 0;
    if (!get_rows(buf_obj, starts_obj, ends_obj, &buf, &starts, &ends))
        goto out;
    if (!check_spec(&spec, &groups, &slots))
        goto rows;
    outs_seq = PySequence_Fast(outs_obj, "outs: a sequence of tuples");
    if (!outs_seq)
        goto rows;
    if (PySequence_Fast_GET_SIZE(outs_seq) < slots) {
        PyErr_SetString(PyExc_ValueError, "outs: one tuple per slot");
        goto rows;
    }
    outs = PyMem_Calloc((size_t)slots + 1, sizeof(slot_out));
    seen = PyMem_Calloc((size_t)slots + 1, 1);
    if (!outs || !seen) {
        PyErr_NoMemory();
        goto release;
    }
    for (Py_ssize_t k = 0; k < slots; k++) {
        PyObject *t = PySequence_Fast_GET_ITEM(outs_seq, k);
        if (!PyTuple_Check(t) || (PyTuple_GET_SIZE(t) != 3 && PyTuple_GET_SIZE(t) != 4)) {
            PyErr_SetString(PyExc_ValueError, "outs: 3 arrays a singular slot, 4 a repeated");
            goto release;
        }
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(t); j++) {
            if (PyObject_GetBuffer(PyTuple_GET_ITEM(t, j), &outs[k].buf[j], PyBUF_WRITABLE) < 0)
                goto release;
            outs[k].held = (int)j + 1;
        }
    }
    scan_state st = {spec.buf, spec.len / 4, groups.buf, NULL, outs, seen, slots};
    if (!scan_rows(&st, &buf, &starts, &ends)) {
        PyErr_SetString(PyExc_ValueError, "fill: a row is not regular, or the arrays have no room (size them with count)");
        goto release;
    }
    result = Py_None;
    Py_INCREF(result);
release:
    if (outs)
        for (Py_ssize_t k = 0; k < slots; k++)
            for (int j = 0; j < outs[k].held; j++)
                PyBuffer_Release(&outs[k].buf[j]);
    PyMem_Free(outs);
    PyMem_Free(seen);
rows:
    Py_XDECREF(outs_seq);
    PyBuffer_Release(&buf);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&ends);
out:
    PyBuffer_Release(&spec);
    PyBuffer_Release(&groups);
    return result;
}

/* gather(buf, starts, lengths, out) -> None: buf[starts[i]:starts[i] + lengths[i]] for
 * every i, one after another, into out (u8, exactly their total length). */
static PyObject *gather(PyObject *self, PyObject *args) {
    Py_buffer buf, starts, lengths, out;
    if (!PyArg_ParseTuple(args, "y*y*y*w*", &buf, &starts, &lengths, &out))
        return NULL;
    PyObject *result = NULL;
    const int64_t *s = starts.buf, *l = lengths.buf;
    Py_ssize_t n = starts.len / 8, total = 0;
    if (starts.len != lengths.len || starts.len % 8) {
        PyErr_SetString(PyExc_ValueError, "starts and lengths: int64 arrays of one length");
        goto out;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (s[i] < 0 || l[i] < 0 || s[i] > buf.len - l[i]) {
            PyErr_SetString(PyExc_ValueError, "a range lies outside the buffer");
            goto out;
        }
        total += l[i];
    }
    if (total != out.len) {
        PyErr_SetString(PyExc_ValueError, "out: the ranges' total length");
        goto out;
    }
    Py_BEGIN_ALLOW_THREADS
    uint8_t *o = out.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(o, (const uint8_t *)buf.buf + s[i], (size_t)l[i]);
        o += l[i];
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
out:
    PyBuffer_Release(&buf);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&lengths);
    PyBuffer_Release(&out);
    return result;
}

/* load8(buf, pos, out) -> None: the 8 bytes at each pos as a little-endian u64. */
static PyObject *load8(PyObject *self, PyObject *args) {
    Py_buffer buf, pos, out;
    if (!PyArg_ParseTuple(args, "y*y*w*", &buf, &pos, &out))
        return NULL;
    PyObject *result = NULL;
    const int64_t *p = pos.buf;
    Py_ssize_t n = pos.len / 8;
    if (pos.len % 8 || out.len != pos.len) {
        PyErr_SetString(PyExc_ValueError, "pos and out: 8-byte arrays of one length");
        goto out;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (p[i] < 0 || p[i] > buf.len - 8) {
            PyErr_SetString(PyExc_ValueError, "a position lies within 8 bytes of the end");
            goto out;
        }
    const uint8_t *b = buf.buf;
    uint64_t *o = out.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *q = b + p[i];
        o[i] = (uint64_t)q[0] | (uint64_t)q[1] << 8 | (uint64_t)q[2] << 16
               | (uint64_t)q[3] << 24 | (uint64_t)q[4] << 32 | (uint64_t)q[5] << 40
               | (uint64_t)q[6] << 48 | (uint64_t)q[7] << 56;
    }
    result = Py_None;
    Py_INCREF(result);
out:
    PyBuffer_Release(&buf);
    PyBuffer_Release(&pos);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"count", count, METH_VARARGS, "Whether every row is regular; repeated slots' sizes."},
    {"fill", fill, METH_VARARGS, "Record every occurrence of regular rows."},
    {"gather", gather, METH_VARARGS, "Copy byte ranges next to each other."},
    {"load8", load8, METH_VARARGS, "Little-endian u64 at each position."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_wirescan", "The compiled wire scan of blockagg.proto.decode.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__wirescan(void) { return PyModule_Create(&module); }
