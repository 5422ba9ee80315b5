/* The module gputrace._hot: each stage (span.c, resolve.c, encode.c, digest.c, writer.c, stats.c) adds its
 * functions and types; LAYOUT, STACK_LAYOUT and RESOLVE_LAYOUT say what they read, for the
 * modules that declare those to check at import (record.py, resolve.py). */
#include "hot.h"

int gt_stats_init(PyObject *m); /* stats.c: the statistics' loops (after digest.c's, whose column reader it uses) */
int gt_first_init(PyObject *m); /* first.c: the page's first document from a digest's rows */
int gt_readx_init(PyObject *m); /* readx.c: a Chrome JSON trace's plain X events to columns */

static struct PyModuleDef hot_module = {
    PyModuleDef_HEAD_INIT, "gputrace._hot", "gputrace's span hot path in C (see record.py for its Python twin).", -1,
    NULL};

/* LAYOUT = (HOT_LAYOUT, the slot names): record.py compares it with HotState at import. */
static PyObject *layout_tuple(void) {
    static const char *names[] = {
#define X(name) #name,
        HOT_FIELDS(X)
#undef X
    };
    Py_ssize_t n = (Py_ssize_t)(sizeof(names) / sizeof(names[0]));
    PyObject *slots = PyTuple_New(n);
    if (!slots) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *s = PyUnicode_InternFromString(names[i]);
        if (!s) { Py_DECREF(slots); return NULL; }
        PyTuple_SetItem(slots, i, s);
    }
    return Py_BuildValue("(iN)", HOT_LAYOUT, slots);
}

PyObject *gt_layout_pairs(const char *(*fields)[2], Py_ssize_t n) {
    PyObject *pairs = PyTuple_New(n);
    if (!pairs) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = Py_BuildValue("(ss)", fields[i][0], fields[i][1]);
        if (!pair) { Py_DECREF(pairs); return NULL; }
        PyTuple_SetItem(pairs, i, pair);
    }
    return pairs;
}

PyMODINIT_FUNC PyInit__hot(void) {
    PyObject *m = PyModule_Create(&hot_module);
    if (!m) return NULL;
    if (gt_span_init(m) < 0 || gt_resolve_init(m) < 0 || gt_encode_init(m) < 0 || gt_digest_init(m) < 0 ||
        gt_writer_init(m) < 0 || gt_events_init(m) < 0 || gt_stats_init(m) < 0 || gt_first_init(m) < 0 || gt_readx_init(m) < 0)
        goto fail;
    PyObject *layout = layout_tuple();
    if (!layout || PyModule_AddObject(m, "LAYOUT", layout) < 0) { Py_XDECREF(layout); goto fail; }
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
