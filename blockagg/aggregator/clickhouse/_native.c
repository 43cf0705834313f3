/* ClickHouse's Native encoding of a String column, compiled: per value, its length as a
 * LEB128 varint, then its bytes. blockagg.aggregator.clickhouse.native encodes the same bytes
 * with numpy where this module was not built; tests/unit/clickhouse/test_native.py compares
 * both with clickhouse-driver's own serialisation, byte for byte.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static inline Py_ssize_t varint_size(uint64_t n) {
    Py_ssize_t size = 1;
    while (n >= 0x80) {
        n >>= 7;
        size++;
    }
    return size;
}

/* strings(offsets, data) -> bytes: the values data[offsets[i]:offsets[i + 1]] (offsets: int64,
 * not decreasing, inside data) in Native layout. */
static PyObject *strings(PyObject *self, PyObject *args) {
    Py_buffer offsets, data;
    if (!PyArg_ParseTuple(args, "y*y*", &offsets, &data))
        return NULL;
    PyObject *result = NULL;
    const int64_t *o = offsets.buf;
    Py_ssize_t n = offsets.len / 8 - 1, total = 0;
    if (offsets.len % 8 || n < 0) {
        PyErr_SetString(PyExc_ValueError, "offsets: an int64 array of at least one item");
        goto out;
    }
    if (o[0] < 0 || o[n] > data.len) {
        PyErr_SetString(PyExc_ValueError, "offsets lie outside the data");
        goto out;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t length = o[i + 1] - o[i];
        if (length < 0) {
            PyErr_SetString(PyExc_ValueError, "offsets decrease");
            goto out;
        }
        total += varint_size((uint64_t)length) + length;
    }
    result = PyBytes_FromStringAndSize(NULL, total);
    if (!result)
        goto out;
    uint8_t *w = (uint8_t *)PyBytes_AS_STRING(result);
    const uint8_t *d = data.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t length = (uint64_t)(o[i + 1] - o[i]);
        uint64_t v = length;
        while (v >= 0x80) {
            *w++ = (uint8_t)(v | 0x80);
            v >>= 7;
        }
        *w++ = (uint8_t)v;
        memcpy(w, d + o[i], (size_t)length);
        w += length;
    }
out:
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&data);
    return result;
}

static PyMethodDef methods[] = {
    {"strings", strings, METH_VARARGS, "A String column's Native bytes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native", "ClickHouse's Native String encoding, compiled.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
