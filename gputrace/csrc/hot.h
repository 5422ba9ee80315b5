/* gputrace._hot: the shared header of the C build (one extension, several files by stage).
 *
 * The same logic as the pure-Python path (record.py, resolve.py, trace/, digest.py), which stays
 * the reference and the fallback and runs the same tests. The files, by stage:
 *   span.c     the hot path: span(), the Span and DisabledSpan types, __enter__/__exit__ slots,
 *              open/close on the installed record.HotState
 *   resolve.c  flush's split of finished spans, and resolve (closed spans -> rows)
 *   encode.c   Chrome JSON encoding, overflow lanes, nesting from the columns
 *   digest.c   the per-span loops of digest.Builder
 *   writer.c   the thread that writes encoded buffers behind the encoder
 *   module.c   the module: each stage adds its methods and types; LAYOUT
 * Built against the limited API, so one binary serves every Python from 3.10 on.
 *
 * What the hot path reads is record.HotState, declared there once: HOT_FIELDS below lists its
 * slots in the same order and HOT_LAYOUT is the same number; record.py refuses a build whose
 * LAYOUT differs (at import, or at a gputrace.native switch). What else it reads of stacks is
 * record.STACK_LAYOUT (STACK_FIELDS); what resolve reads of spans' tracks, the store and the
 * timelines is resolve.RESOLVE_LAYOUT (RESOLVE_FIELDS): each declared there once, listed below,
 * reported by the build and checked the same way. Names shared between files carry a gt_ prefix;
 * everything else stays static.
 */
#ifndef GPUTRACE_HOT_H
#define GPUTRACE_HOT_H

#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030A0000
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>
#include <time.h>
#include <stdio.h>
#include <math.h>
#include <limits.h>
#include <stdint.h>
#include <errno.h>
#include <pthread.h>
#include <unistd.h>

/* ---- the hot state ------------------------------------------------------------------------ */

#define HOT_LAYOUT 2
/* record.HotState.__slots__, in order. */
#define HOT_FIELDS(X)                                                                                  \
    X(local) X(has_device) X(cur_dev) X(raw_stream) X(capturing) X(new_event) X(record) X(pools) X(gens) \
    X(mono) X(pending) X(check_at) X(open_slow) X(close_slow) X(close_unusual) X(pending_full)          \
    X(close_by_name) X(nvtx)

typedef struct {
    PyObject_HEAD
#define X(name) PyObject *name;
    HOT_FIELDS(X)
#undef X
    PyObject *src;           /* the HotState these were read from */
    int has_dev;             /* has_device, as a C truth value */
    int native_mono;         /* mono is time.monotonic_ns: read CLOCK_MONOTONIC directly */
    Py_ssize_t n_check_at;   /* check_at, kept current by set_check_at() */
    uint64_t host_tid;       /* the thread (its thread state's id, never reused) whose host stack... */
    PyObject *host_stack;    /* ...this is: local.host without the thread-local lookup, or NULL */
    /* nvtx (a gputrace.nvtx.Ranges, or None: off): C functions where found, else Python ones */
    int nvtx_on;
    int (*nvtx_push)(const char *);
    int (*nvtx_pop)(void);
    PyObject *nvtx_push_py, *nvtx_pop_py;
    /* cur_dev and raw_stream are torch's: asked of c10 from C (set_current), and the last device
     * stack found kept for the thread, device and stream it was found for */
    int c10_current;
    uint64_t cuda_tid;
    int cuda_dev;
    void *cuda_raw;
    PyObject *cuda_stack;
    /* runtime events taken from pools[d], not yet used, for the first BUNDLE_DEVICES devices
     * (span.c: pooled_event) */
#define EVENT_BUNDLE 64
#define BUNDLE_DEVICES 8
    PyObject *bundle[BUNDLE_DEVICES][EVENT_BUNDLE];
    int n_bundle[BUNDLE_DEVICES];
} State;

/* Vectorcall (PEP 590): part of the limited API from 3.12, and the same protocol since 3.8. A
 * `with` statement calls __enter__ and __exit__ (Slot, in span.c) through it: no argument tuple. */
#ifndef Py_TPFLAGS_HAVE_VECTORCALL
#define Py_TPFLAGS_HAVE_VECTORCALL (1UL << 11)
#endif
typedef PyObject *(*hot_vectorcall)(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames);
#define HOT_NARGS(nargsf) ((Py_ssize_t)((nargsf) & ~((size_t)1 << (8 * sizeof(size_t) - 1))))

typedef struct {
    PyObject_HEAD
    hot_vectorcall vectorcall;
    PyObject *name, *args, *stack, *parent, *id, *gen, *t0, *t1, *error, *owner;
    char cuda, sync;
    /* A host span's times, held as nanoseconds rather than as int objects (ns0/ns1 set; t0/t1
     * NULL): Python reads and writes them as `t0`/`t1` all the same (Span_getset). */
    char ns0, ns1;
    char ranged; /* an NVTX range was pushed at its open and is not yet popped */
    long long h0, h1;
    long long entry; /* a device span: monotonic ns at its enter (when its start was queued); else 0 */
    /* A device span opened by the C path: its device and raw stream (its stack's), for its close */
    char at_raw;
    int raw_dev;
    void *raw_stream;
} Span;


#define SETREF(dst, src)            \
    do {                            \
        PyObject *_old = (dst);     \
        (dst) = (src);              \
        Py_XDECREF(_old);           \
    } while (0)

/* record.STACK_LAYOUT: what the hot path reads beside HotState, of a stack (record._Stack) and of
 * HotState.local (a thread's stacks), in the same order. */
#define STACK_FIELDS(X) X(stack, track) X(stack, device) X(stack, stream) X(stack, raw) X(local, cuda) X(local, host)

/* resolve.RESOLVE_LAYOUT: (what, attribute) for every attribute resolve and flush's split read of
 * the objects they are handed, in the same order; RESOLVE_LAYOUT_VERSION is the same number. */
#define RESOLVE_LAYOUT_VERSION 2
#define RESOLVE_FIELDS(X)                                                                                    \
    X(stack, track) X(track, index) X(track, device) X(store, names) X(store, _name_index) X(store, name)    \
    X(store, track) X(store, start) X(store, end) X(store, entry) X(store, args) X(store, capacity) X(store, dropped)        \
    X(store, _last_id) X(store, child_extent) X(timeline, _elapsed) X(timeline, anchors)                     \
    X(timeline, segment_ms) X(timeline, locate) X(timeline, to_host_ns) X(anchor, event) X(anchor, host_ns) \
    X(event, query) X(event, cuda_event)

/* ---- shared between the stages ------------------------------------------------------------ */

/* events.c: a timing event made and recorded by the CUDA runtime (created at its first record). */
typedef struct {
    PyObject_HEAD
    void *handle;  /* cudaEvent_t, NULL until the first record */
    int device;    /* the device it was created on, -1 before */
    char recorded;
} RawEvent;
extern PyTypeObject *gt_RawEventType;
/* Record `ev` on the raw stream handle (creating it on the current device first): 0, or -1 with an
 * exception set and the runtime's error cleared. */
int gt_raw_record(RawEvent *ev, void *stream);
/* The same where the current device may not be the event's (a close after a device switch): the
 * device is set around the call, as torch's record does. */
int gt_raw_record_on(RawEvent *ev, void *stream, int device);

extern PyTypeObject *gt_SpanType; /* span.c: the Span type; resolve's loops take only its spans */

/* A host span holds its times as ns (ns0/ns1) or as int objects. */
static inline int gt_span_on_host(Span *s) { return s->ns0 || (s->t0 && PyLong_CheckExact(s->t0)); }

/* A host span's start and end in ns (ints or held ns); 1: not both ints; -1: error. */
static inline int gt_span_host_times(Span *s, long long *t0, long long *t1) {
    if (s->ns0) *t0 = s->h0;
    else if (s->t0 && PyLong_CheckExact(s->t0)) *t0 = PyLong_AsLongLong(s->t0);
    else return 1;
    if (s->ns1) *t1 = s->h1;
    else if (s->t1 && PyLong_CheckExact(s->t1)) *t1 = PyLong_AsLongLong(s->t1);
    else return 1;
    return PyErr_Occurred() ? -1 : 0;
}

/* A growable column of int64 (digest.c's loops, readx.c's reader): 0, or -1 with MemoryError set. */
typedef struct {
    long long *v;
    Py_ssize_t n, cap;
} Vec;

static inline int vec_push(Vec *x, long long a) {
    if (x->n == x->cap) {
        Py_ssize_t cap = x->cap ? 2 * x->cap : 64;
        long long *g = PyMem_Realloc(x->v, sizeof(long long) * (size_t)cap);
        if (!g) { PyErr_NoMemory(); return -1; }
        x->v = g;
        x->cap = cap;
    }
    x->v[x->n++] = a;
    return 0;
}

static inline void vec_free(Vec *x) {
    PyMem_Free(x->v);
    x->v = NULL;
    x->n = x->cap = 0;
}

/* encode.c: an array.array's items as bytes, checked to hold `itemsize`-byte items (n of them). */
PyObject *gt_array_bytes(PyObject *arr, size_t itemsize, Py_ssize_t *n);

/* digest.c: an int64 column's items where they lie (or a copy to release in *keep). */
const void *gt_column_items(PyObject *col, Py_ssize_t *n, PyObject **keep);

/* A tuple of (what, attribute) pairs from a FIELDS list (module.c): the layouts' Python side. */
PyObject *gt_layout_pairs(const char *(*fields)[2], Py_ssize_t n);

/* int64 -> index, open addressing, doubling as it fills (the digest's keys and histogram cells,
 * the statistics' (name, rank) groups). */
typedef struct {
    long long *keys;
    Py_ssize_t *vals;
    Py_ssize_t cap, used;
} I64Map;

static inline int map_init(I64Map *m, Py_ssize_t cap) {
    m->cap = cap;
    m->used = 0;
    m->keys = PyMem_Malloc(sizeof(long long) * (size_t)cap);
    m->vals = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)cap);
    if (!m->keys || !m->vals) { PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < cap; i++) m->vals[i] = -1;
    return 0;
}

static inline void map_free(I64Map *m) {
    PyMem_Free(m->keys);
    PyMem_Free(m->vals);
    m->keys = NULL;
    m->vals = NULL;
}

static inline Py_ssize_t map_slot(const I64Map *m, long long key) {
    unsigned long long h = (unsigned long long)key * 0x9E3779B97F4A7C15ull;
    Py_ssize_t i = (Py_ssize_t)(h >> 20) & (m->cap - 1);
    while (m->vals[i] >= 0 && m->keys[i] != key) i = (i + 1) & (m->cap - 1);
    return i;
}

/* The index of `key`, given `next` (the number of keys so far) when it is new; -1 on error. */
static inline Py_ssize_t map_index(I64Map *m, long long key, Py_ssize_t next) {
    Py_ssize_t i = map_slot(m, key);
    if (m->vals[i] >= 0) return m->vals[i];
    if (2 * (m->used + 1) > m->cap) {
        I64Map bigger;
        if (map_init(&bigger, 2 * m->cap) < 0) { map_free(&bigger); return -1; }
        for (Py_ssize_t j = 0; j < m->cap; j++)
            if (m->vals[j] >= 0) {
                Py_ssize_t k = map_slot(&bigger, m->keys[j]);
                bigger.keys[k] = m->keys[j];
                bigger.vals[k] = m->vals[j];
            }
        bigger.used = m->used;
        map_free(m);
        *m = bigger;
        i = map_slot(m, key);
    }
    m->keys[i] = key;
    m->vals[i] = next;
    m->used++;
    return next;
}

/* Each stage adds its functions and types to the module (0, or -1 with an exception set);
 * gt_span_init first: the others use its types. */
int gt_span_init(PyObject *m);
int gt_resolve_init(PyObject *m);
int gt_encode_init(PyObject *m);
int gt_digest_init(PyObject *m);
int gt_writer_init(PyObject *m);
int gt_events_init(PyObject *m);

#endif /* GPUTRACE_HOT_H */
