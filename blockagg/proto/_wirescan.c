/* The protobuf wire scan of blockagg.proto.decode, compiled: one pass per row instead of
 * numpy's lock step across rows, and the byte gathers and fixed-width loads around it.
 *
 * It reads only rows it can prove *regular*: every tag of at most 5 bytes, below 2**32,
 * field number above 0, wire type 0, 1, 2 or 5, every varint ending within 10 bytes and
 * inside the row, every length prefix of at most 5 bytes and within the row, every fixed
 * value inside the row, every packed run whole (its varints ending inside it, its length
 * a multiple of its width), and no second occurrence of a singular field the caller marks
 * watched. On such rows numpy's lock-step scan sets no error code, so both record the same
 * occurrences. On anything else `scan` answers None, and the caller runs the numpy scan
 * over all the rows: what to make of a damaged row stays decided in one place.
 *
 * spec: one int32 per field number 0..max: -1 for a number the message does not declare,
 * else (slot << 8) | flags, flags: bits 0-2 the expected wire type, FL_REPEATED,
 * FL_PACKABLE, FL_WATCH (below); groups: one int32 per slot, the slot whose "seen" flag a
 * watched slot shares (the members of one oneof share one: upb's case changes).
 * A singular slot is written into the caller's numpy arrays (present u8[n], value u64[n],
 * length i64[n] or empty), as the lock step leaves them: the last occurrence's value. A
 * repeated slot comes back as four bytearrays (rows i64, steps i64, values u64, lengths
 * i64), one element per value in row order, then wire order, a packed run's values in
 * place of its tag. A step is the index of the tag within its row, the lock step's
 * iteration at which numpy records it. A value is a varint's value, or where a fixed or
 * length-delimited value's bytes start in the buffer.
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

/* A growing array of 8-byte elements. */
typedef struct {
    uint64_t *data;
    Py_ssize_t size, capacity;
} vec;

static inline int push(vec *v, uint64_t x) {
    if (v->size == v->capacity) {
        Py_ssize_t capacity = v->capacity ? 2 * v->capacity : 256;
        uint64_t *data = PyMem_Realloc(v->data, (size_t)capacity * 8);
        if (!data)
            return 0;
        v->data = data;
        v->capacity = capacity;
    }
    v->data[v->size++] = x;
    return 1;
}

typedef struct {
    Py_buffer single[3]; /* a singular slot's present, value, length */
    int held;
    vec rep[4];          /* a repeated slot's rows, steps, values, lengths */
} slot_out;

typedef struct {
    const int32_t *spec;
    Py_ssize_t spec_len;
    const int32_t *groups; /* per slot: its index in `seen` */
    slot_out *outs;
    uint8_t *seen;         /* per slot, for FL_WATCH: reset per row */
    Py_ssize_t slots;
    int no_memory;
} scan_state;

/* Record one occurrence; 0 when a singular slot's arrays have no room, or memory ran out. */
static inline int record(scan_state *st, slot_out *o, int32_t entry, int64_t row,
                         int64_t step, int wt, uint64_t value, int64_t dpos) {
    uint64_t where = wt == WT_VARINT ? value : (uint64_t)dpos;
    if (!(entry & FL_REPEATED)) {
        if (row >= o->single[0].len || 8 * (row + 1) > o->single[1].len
            || (wt == WT_LEN && 8 * (row + 1) > o->single[2].len))
            return 0;
        ((uint8_t *)o->single[0].buf)[row] = 1;
        ((uint64_t *)o->single[1].buf)[row] = where;
        if (wt == WT_LEN)
            ((int64_t *)o->single[2].buf)[row] = (int64_t)value;
        return 1;
    }
    if (!push(&o->rep[0], (uint64_t)row) || !push(&o->rep[1], (uint64_t)step)
        || !push(&o->rep[2], where) || (wt == WT_LEN && !push(&o->rep[3], value))) {
        st->no_memory = 1;
        return 0;
    }
    return 1;
}

/* The values of a packed run of `expected` wire type at [q, end), as occurrences of the
 * tag's step; 0 when the run is not whole (a varint cut off or over 10 bytes, a length not
 * a multiple of the width). */
static int packed_run(scan_state *st, slot_out *o, int32_t entry, int expected, int64_t row,
                      int64_t step, const uint8_t *base, const uint8_t *q,
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
        if (!record(st, o, entry, row, step, expected, value, dpos))
            return 0;
    }
    return 1;
}

/* Scan and record row [p, end); 0 when it is not regular. */
static int scan_row(scan_state *st, int64_t row, const uint8_t *base, const uint8_t *p,
                    const uint8_t *end) {
    int64_t step = 0;
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
            slot_out *o = &st->outs[entry >> 8];
            int expected = entry & 7;
            if (wt == WT_LEN && wt != expected && (entry & FL_PACKABLE)) {
                const uint8_t *run = base + dpos;
                if (!packed_run(st, o, entry, expected, row, step, base, run, run + value))
                    return 0;
            } else if (wt == expected) {
                if (!(entry & FL_REPEATED) && (entry & FL_WATCH)) {
                    int32_t group = st->groups[entry >> 8];
                    if (st->seen[group])
                        return 0;
                    st->seen[group] = 1;
                }
                if (!record(st, o, entry, row, step, wt, value, dpos))
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

/* The repeated slots' arrays, as the list `scan` returns (None for a singular slot). */
static PyObject *repeated_arrays(slot_out *outs, Py_ssize_t slots) {
    PyObject *list = PyList_New(slots);
    if (!list)
        return NULL;
    for (Py_ssize_t k = 0; k < slots; k++) {
        if (outs[k].held) {
            Py_INCREF(Py_None);
            PyList_SET_ITEM(list, k, Py_None);
            continue;
        }
        PyObject *arrays = PyTuple_New(4);
        if (!arrays) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, k, arrays);
        for (int j = 0; j < 4; j++) {
            PyObject *b = PyByteArray_FromStringAndSize((const char *)outs[k].rep[j].data,
                                                        8 * outs[k].rep[j].size);
            if (!b) {
                Py_DECREF(list);
                return NULL;
            }
            PyTuple_SET_ITEM(arrays, j, b);
        }
    }
    return list;
}

/* scan(buf, starts, ends, spec, groups, singular) -> list | None: records every field
 * occurrence of the rows buf[starts[i]:ends[i]], each singular slot's into the arrays
 * `singular[slot]` holds (a tuple of 3; None for a repeated slot); returns the repeated
 * slots' arrays, or None, having recorded a part, when a row is not regular (or a
 * singular slot's arrays have no room for it). */
static PyObject *scan(PyObject *self, PyObject *args) {
    PyObject *buf_obj, *starts_obj, *ends_obj, *singular_obj;
    Py_buffer buf, starts, ends, spec, groups;
    if (!PyArg_ParseTuple(args, "OOOy*y*O", &buf_obj, &starts_obj, &ends_obj, &spec, &groups,
                          &singular_obj))
        return NULL;
    PyObject *result = NULL, *singular = NULL;
    slot_out *outs = NULL;
    uint8_t *seen = NULL;
    Py_ssize_t slots = 0;
    if (!get_rows(buf_obj, starts_obj, ends_obj, &buf, &starts, &ends))
        goto out;
    if (!check_spec(&spec, &groups, &slots))
        goto rows;
    singular = PySequence_Fast(singular_obj, "singular: a sequence, an item per slot");
    if (!singular)
        goto rows;
    if (PySequence_Fast_GET_SIZE(singular) != slots) {
        PyErr_SetString(PyExc_ValueError, "singular: an item per slot");
        goto rows;
    }
    outs = PyMem_Calloc((size_t)slots + 1, sizeof(slot_out));
    seen = PyMem_Calloc((size_t)slots + 1, 1);
    if (!outs || !seen) {
        PyErr_NoMemory();
        goto release;
    }
    const int32_t *entries = spec.buf;
    for (Py_ssize_t i = 0; i < spec.len / 4; i++) {
        if (entries[i] < 0)
            continue;
        Py_ssize_t k = entries[i] >> 8;
        PyObject *t = PySequence_Fast_GET_ITEM(singular, k);
        int repeated = (entries[i] & FL_REPEATED) != 0;
        if (repeated ? t != Py_None : !(PyTuple_Check(t) && PyTuple_GET_SIZE(t) == 3)) {
            PyErr_SetString(PyExc_ValueError,
                            "singular: 3 arrays a singular slot, None a repeated one");
            goto release;
        }
        for (Py_ssize_t j = 0; !repeated && !outs[k].held && j < 3; j++) {
            if (PyObject_GetBuffer(PyTuple_GET_ITEM(t, j), &outs[k].single[j],
                                   PyBUF_WRITABLE) < 0) {
                for (Py_ssize_t r = 0; r < j; r++)
                    PyBuffer_Release(&outs[k].single[r]);
                goto release;
            }
            if (j == 2)
                outs[k].held = 1;
        }
    }
    scan_state st = {spec.buf, spec.len / 4, groups.buf, outs, seen, slots, 0};
    const uint8_t *base = buf.buf;
    const int64_t *s = starts.buf, *e = ends.buf;
    int regular = 1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < starts.len / 8 && regular; i++)
        regular = scan_row(&st, i, base, base + s[i], base + e[i]);
    Py_END_ALLOW_THREADS
    if (st.no_memory)
        PyErr_NoMemory();
    else if (!regular)
        result = Py_NewRef(Py_None);
    else
        result = repeated_arrays(outs, slots);
release:
    if (outs) {
        for (Py_ssize_t k = 0; k < slots; k++) {
            for (int j = 0; outs[k].held && j < 3; j++)
                PyBuffer_Release(&outs[k].single[j]);
            for (int j = 0; j < 4; j++)
                PyMem_Free(outs[k].rep[j].data);
        }
    }
    PyMem_Free(outs);
    PyMem_Free(seen);
rows:
    Py_XDECREF(singular);
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
    {"scan", scan, METH_VARARGS, "Record every field occurrence of regular rows."},
    {"gather", gather, METH_VARARGS, "Copy byte ranges next to each other."},
    {"load8", load8, METH_VARARGS, "Little-endian u64 at each position."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_wirescan", "The compiled wire scan of blockagg.proto.decode.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__wirescan(void) { return PyModule_Create(&module); }
