/* Resolving: flush's split of the spans the GPU has finished (split_finished), and closed spans
 * into a store's columns (resolve); the raw CUDA call that measures between two events. */
#include "hot.h"

/* ---- resolving closed spans into a store's columns ---------------------------------------- */

/* The same logic as resolve.resolve (the reference, which also serves every case this does not):
 * one loop over the closed spans, the rows packed into the store's arrays with one call per
 * column. Device spans are located and mapped through their DeviceTimeline's own methods, so
 * every device (torch's, or a test double) is measured exactly as the Python twin measures it. */

/* One interned name per RESOLVE_FIELDS entry, a_<what>_<attribute>: what is read, declared once. */
#define X(what, name) static PyObject *a_##what##_##name;
RESOLVE_FIELDS(X)
#undef X
static PyObject *s_error, *s_frombytes; /* a dict key and array.array's method: not the layout's */

/* A span's id, given on first need (as SpanStore.id_of). */
static long long id_of(Span *s, long long *last_id) {
    if (s->id && s->id != Py_None) {
        long long v = PyLong_AsLongLong(s->id);
        return v;
    }
    PyObject *v = PyLong_FromLongLong(++*last_id);
    if (!v) return -1;
    SETREF(s->id, v);
    return *last_id;
}

/* _take_in_children: a parent on a device track takes in its children's ends that stick out by
 * no more than `rounding` ns. */
static int take_in_children(PyObject *extent, long long sid, long long rounding, long long *start, long long *end) {
    PyObject *key = PyLong_FromLongLong(sid);
    if (!key) return -1;
    PyObject *ext = PyDict_GetItemWithError(extent, key); /* borrowed */
    if (!ext) {
        Py_DECREF(key);
        return PyErr_Occurred() ? -1 : 0;
    }
    long long lo = PyLong_AsLongLong(PyTuple_GetItem(ext, 0));
    long long hi = PyLong_AsLongLong(PyTuple_GetItem(ext, 1));
    if (PyErr_Occurred() || PyDict_DelItem(extent, key) < 0) { Py_DECREF(key); return -1; }
    Py_DECREF(key);
    if (0 < *start - lo && *start - lo <= rounding) *start = lo;
    if (0 < hi - *end && hi - *end <= rounding) *end = hi;
    return 0;
}

static int widen_extent(PyObject *extent, long long pid, long long start, long long end) {
    PyObject *key = PyLong_FromLongLong(pid);
    if (!key) return -1;
    PyObject *ext = PyDict_GetItemWithError(extent, key); /* borrowed */
    if (!ext && PyErr_Occurred()) { Py_DECREF(key); return -1; }
    if (ext) {
        long long lo = PyLong_AsLongLong(PyTuple_GetItem(ext, 0));
        long long hi = PyLong_AsLongLong(PyTuple_GetItem(ext, 1));
        if (PyErr_Occurred()) { Py_DECREF(key); return -1; }
        if (lo < start) start = lo;
        if (hi > end) end = hi;
    }
    PyObject *v = Py_BuildValue("(LL)", start, end);
    int r = v ? PyDict_SetItem(extent, key, v) : -1;
    Py_XDECREF(v);
    Py_DECREF(key);
    return r;
}

/* tl.locate(event, first) -> (k, d) or None; NULL on error. */
static PyObject *locate(PyObject *tl, PyObject *event, PyObject *first) {
    return PyObject_CallMethodObjArgs(tl, a_timeline_locate, event, first, NULL);
}

static int to_host(PyObject *tl, PyObject *kd, long long *out) {
    PyObject *r = PyObject_CallMethodObjArgs(tl, a_timeline_to_host_ns, PyTuple_GetItem(kd, 0), PyTuple_GetItem(kd, 1), NULL);
    if (!r) return -1;
    *out = PyLong_AsLongLong(r);
    Py_DECREF(r);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* Append n values to an array.array column as raw bytes (one call per column). */
static int column_extend(PyObject *store, PyObject *attr, const void *data, size_t itemsize, Py_ssize_t n) {
    if (n == 0) return 0;
    PyObject *col = PyObject_GetAttr(store, attr);
    if (!col) return -1;
    PyObject *bytes = PyBytes_FromStringAndSize((const char *)data, (Py_ssize_t)(itemsize * (size_t)n));
    if (!bytes) { Py_DECREF(col); return -1; }
    PyObject *r = PyObject_CallMethodObjArgs(col, s_frombytes, bytes, NULL);
    Py_DECREF(bytes);
    Py_DECREF(col);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

static Py_ssize_t attr_ssize(PyObject *o, PyObject *attr) {
    PyObject *v = PyObject_GetAttr(o, attr);
    if (!v) return -1;
    Py_ssize_t n = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    return n;
}

/* The CUDA driver's cuEventElapsedTime (or the runtime's cudaEventElapsedTime) and the runtime's
 * cudaGetLastError, called on the events' raw handles (`event.cuda_event`): torch's
 * Event.elapsed_time asks both events whether they ran and sets the device around the same call,
 * ~3 us a call through the H200 VM against ~0.1 us (driver) to ~0.15-0.5 us (runtime) for the
 * call itself. Set by cuda.py from the libraries torch loaded (set_raw_elapsed);
 * used only for timelines whose `_elapsed` is `g_raw_for` (torch's method), so test doubles and
 * other devices keep their own. Any failure (an event never recorded, one not yet run, another
 * context) clears the runtime's error, which torch would otherwise report at its next kernel
 * launch, and asks torch's method instead, which raises what it raises. */
typedef int (*raw_elapsed_fn)(float *ms, void *start, void *end);
typedef int (*raw_clear_fn)(void);
typedef int (*raw_device_fn)(int *device);
static raw_elapsed_fn g_raw_elapsed;
static raw_elapsed_fn g_raw_elapsed_then; /* asked where g_raw_elapsed refuses (the runtime's, after the driver's) */
static raw_clear_fn g_raw_clear;
static raw_device_fn g_raw_device; /* cudaGetDevice: the raw call only where the thread's device is the events' */
static PyObject *g_raw_for; /* the Python elapsed callable the raw call stands in for */

/* An event's raw handle, or NULL (no handle: ask Python). Never leaves an exception set. A
 * RawEvent's is read where it lies (what its cuda_event gives, without an int made a call). */
static void *raw_handle(PyObject *ev) {
    if (gt_RawEventType && Py_TYPE(ev) == gt_RawEventType) return ((RawEvent *)ev)->handle;
    PyObject *h = PyObject_GetAttr(ev, a_event_cuda_event);
    if (!h) { PyErr_Clear(); return NULL; }
    void *p = PyLong_Check(h) ? PyLong_AsVoidPtr(h) : NULL;
    Py_DECREF(h);
    if (PyErr_Occurred()) { PyErr_Clear(); return NULL; }
    return p;
}

/* 1 with *ms from the runtime; 0: not answered (ask Python). */
static int raw_elapsed(PyObject *a, PyObject *b, double *ms) {
    void *ha = raw_handle(a), *hb;
    if (!ha || !(hb = raw_handle(b))) return 0;
    float v = 0.0f;
    /* The driver's call refuses on a thread with no context current (one that never touched
     * CUDA): the runtime's makes the device's current, so the driver's works there next time. */
    if (g_raw_elapsed(&v, ha, hb) != 0 && (!g_raw_elapsed_then || g_raw_elapsed_then(&v, ha, hb) != 0)) {
        if (g_raw_clear) (void)g_raw_clear();
        return 0;
    }
    *ms = (double)v; /* what torch returns: the runtime's float32, widened */
    return 1;
}

PyDoc_STRVAR(set_raw_elapsed_doc,
             "set_raw_elapsed(elapsed_ptr, clear_ptr, device_ptr, stands_for, then_ptr=0, /)\n--\n\n"
             "Use the C functions at these addresses (cuEventElapsedTime or cudaEventElapsedTime,\n"
             "cudaGetLastError, cudaGetDevice; then_ptr: an elapsed call asked where the first refuses)\n"
             "on the raw handles of events whose timeline measures with `stands_for`, where the calling\n"
             "thread's device is the events' (elsewhere the runtime could make a context on another\n"
             "device: torch's call sets the device around it); 0 turns it off.");
static PyObject *hot_set_raw_elapsed(PyObject *self, PyObject *args) {
    PyObject *fn, *clear, *dev, *for_, *then = NULL;
    if (!PyArg_ParseTuple(args, "OOOO|O", &fn, &clear, &dev, &for_, &then)) return NULL;
    void *pf = PyLong_AsVoidPtr(fn), *pc = PyLong_AsVoidPtr(clear), *pd = PyLong_AsVoidPtr(dev);
    void *pt = then ? PyLong_AsVoidPtr(then) : NULL;
    if (PyErr_Occurred()) return NULL;
    if (pf && (!pc || !pd)) {
        PyErr_SetString(PyExc_ValueError, "set_raw_elapsed: the elapsed call needs the error and device calls");
        return NULL;
    }
    g_raw_elapsed = (raw_elapsed_fn)pf;
    g_raw_elapsed_then = pf ? (raw_elapsed_fn)pt : NULL;
    g_raw_clear = (raw_clear_fn)pc;
    g_raw_device = (raw_device_fn)pd;
    SETREF(g_raw_for, pf ? Py_NewRef(for_) : NULL);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(raw_elapsed_ms_doc,
             "raw_elapsed_ms(a, b, /)\n--\n\n"
             "Milliseconds from event a to event b through the raw call set by set_raw_elapsed, or None\n"
             "where it gives no answer.");
static PyObject *hot_raw_elapsed_ms(PyObject *self, PyObject *args) {
    PyObject *a, *b;
    if (!PyArg_ParseTuple(args, "OO", &a, &b)) return NULL;
    double ms;
    if (!g_raw_elapsed || !raw_elapsed(a, b, &ms)) Py_RETURN_NONE;
    return PyFloat_FromDouble(ms);
}

/* A DeviceTimeline read once per resolve, where it is of the class itself: its locate() and
 * to_host_ns() (clock.interpolate) are then done here, with the same float steps, calling its
 * own `_elapsed` for each event (or the raw call standing in for it); anything else goes
 * through the timeline's methods. */
typedef struct {
    PyObject *elapsed, *anchors, *segs; /* owned */
    int raw;                            /* measure through g_raw_elapsed first */
    /* The newest anchors' event and host time, read once per resolve (spans are placed between
     * the last few anchors): anchors lo.. of the list, `got` saying which are read. */
    Py_ssize_t lo, n;
    PyObject **event; /* owned where read */
    long long *host;
    char *got; /* bit 1: event read; bit 2: host read */
} Timeline;

#define TIMELINE_CACHED 256

static void timeline_clear(Timeline *t) {
    Py_CLEAR(t->elapsed);
    Py_CLEAR(t->anchors);
    Py_CLEAR(t->segs);
    for (Py_ssize_t c = 0; t->event && c < t->n - t->lo; c++) Py_XDECREF(t->event[c]);
    PyMem_Free(t->event);
    PyMem_Free(t->host);
    PyMem_Free(t->got);
    t->event = NULL;
    t->host = NULL;
    t->got = NULL;
    t->lo = t->n = 0;
}

static int timeline_read(Timeline *t, PyObject *tl) {
    timeline_clear(t);
    if (!(t->elapsed = PyObject_GetAttr(tl, a_timeline__elapsed)) || !(t->anchors = PyObject_GetAttr(tl, a_timeline_anchors)) ||
        !(t->segs = PyObject_GetAttr(tl, a_timeline_segment_ms)))
        return -1;
    t->raw = g_raw_elapsed != NULL && t->elapsed == g_raw_for;
    if (!PyList_Check(t->anchors) || !PyList_Check(t->segs) || PyList_Size(t->segs) != PyList_Size(t->anchors)) {
        PyErr_SetString(PyExc_TypeError, "resolve: a timeline's anchors and segments are not lists of one length");
        return -1;
    }
    Py_ssize_t n = PyList_Size(t->anchors), m = n < TIMELINE_CACHED ? n : TIMELINE_CACHED;
    t->n = n;
    t->lo = n - m;
    t->event = PyMem_Calloc((size_t)(m ? m : 1), sizeof(PyObject *));
    t->host = PyMem_Calloc((size_t)(m ? m : 1), sizeof(long long));
    t->got = PyMem_Calloc((size_t)(m ? m : 1), 1);
    if (!t->event || !t->host || !t->got) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static int anchor_host_ns(Timeline *t, Py_ssize_t k, long long *out) {
    Py_ssize_t c = k - t->lo;
    int cached = c >= 0 && k < t->n;
    if (cached && (t->got[c] & 2)) {
        *out = t->host[c];
        return 0;
    }
    PyObject *v = PyObject_GetAttr(PyList_GetItem(t->anchors, k), a_anchor_host_ns);
    if (!v) return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (*out == -1 && PyErr_Occurred()) return -1;
    if (cached) {
        t->host[c] = *out;
        t->got[c] |= 2;
    }
    return 0;
}

/* Anchor k's event, a new reference (NULL on error). */
static PyObject *anchor_event(Timeline *t, Py_ssize_t k) {
    Py_ssize_t c = k - t->lo;
    if (c >= 0 && k < t->n && (t->got[c] & 1)) return Py_NewRef(t->event[c]);
    PyObject *ev = PyObject_GetAttr(PyList_GetItem(t->anchors, k), a_anchor_event);
    if (ev && c >= 0 && k < t->n) {
        t->event[c] = Py_NewRef(ev); /* the cache's own reference */
        t->got[c] |= 1;
    }
    return ev;
}

/* DeviceTimeline.locate: 0 with *k (-1: after the newest anchor) and *d; 1: an answer that is not a
 * float (the timeline's methods take the span); -1 on error. */
static int timeline_locate(Timeline *t, PyObject *event, Py_ssize_t first, Py_ssize_t *k, double *d) {
    Py_ssize_t n = PyList_Size(t->anchors);
    for (Py_ssize_t i = first > 0 ? first : 0; i < n; i++) {
        PyObject *ref = anchor_event(t, i);
        if (!ref) return -1;
        double v;
        if (!t->raw || !raw_elapsed(ref, event, &v)) {
            PyObject *r = PyObject_CallFunctionObjArgs(t->elapsed, ref, event, NULL);
            Py_DECREF(ref);
            if (!r) return -1;
            if (!PyFloat_CheckExact(r)) { Py_DECREF(r); return 1; }
            v = PyFloat_AsDouble(r);
            Py_DECREF(r);
        } else {
            Py_DECREF(ref);
        }
        if (v <= 0.0) {
            *k = i;
            *d = v;
            return 0;
        }
    }
    *k = -1;
    return 0;
}

/* clock.interpolate: host(k) + round(d * 1e6 * (host(k) - host(k-1)) / (gpu(k) * 1e6)), or slope 1
 * before the first segment. 1: a value Python's round() would refuse or a segment not a float. */
static int timeline_host_ns(Timeline *t, Py_ssize_t k, double d, long long *out) {
    long long h1, h0;
    if (anchor_host_ns(t, k, &h1) < 0) return -1;
    PyObject *segv = PyList_GetItem(t->segs, k);
    if (!PyFloat_CheckExact(segv)) return 1;
    double seg = PyFloat_AsDouble(segv), x;
    if (k == 0 || seg <= 0.0) {
        x = d * 1e6;
    } else {
        if (anchor_host_ns(t, k - 1, &h0) < 0) return -1;
        x = d * 1e6 * (double)(h1 - h0) / (seg * 1e6);
    }
    if (!isfinite(x) || fabs(x) > 9e18) return 1;
    *out = h1 + (long long)nearbyint(x); /* round half to even, as round() */
    return 0;
}

/* A device span's start and end through a Timeline: 0 (with *found), 1 (the methods decide), -1. */
static int timeline_span(Timeline *t, Span *s, long long *start, long long *end, int *found) {
    Py_ssize_t first = s->gen ? PyLong_AsSsize_t(s->gen) : -1, ka, kb;
    if (first == -1 && PyErr_Occurred()) { PyErr_Clear(); return 1; }
    double da, db;
    int r = timeline_locate(t, s->t0, first, &ka, &da);
    if (r) return r;
    *found = 0;
    if (ka < 0) return 0;
    if ((r = timeline_locate(t, s->t1, ka, &kb, &db))) return r;
    if (kb < 0) return 0;
    if ((r = timeline_host_ns(t, ka, da, start)) || (r = timeline_host_ns(t, kb, db, end))) return r;
    *found = 1;
    return 0;
}

/* Per span of `done`: its track index and device (-1: a host track), read once per stack. 0; 1: a
 * span this module's loops do not take (another type, or not as the hot path leaves it); -1. */
static int span_tracks(PyObject *done, long *track_of, Py_ssize_t *dev_of) {
    PyObject *last_stack = NULL;
    long tr = 0;
    Py_ssize_t dv = -1, n = PyList_Size(done);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyList_GetItem(done, i);
        if (!PyObject_TypeCheck(o, gt_SpanType)) return 1;
        Span *s = (Span *)o;
        if (!s->name || !s->stack || s->stack == Py_None || !(s->t0 || s->ns0) || !(s->t1 || s->ns1)) return 1;
        if (s->parent && s->parent != Py_None && !PyObject_TypeCheck(s->parent, gt_SpanType)) return 1;
        if (s->stack != last_stack) {
            PyObject *track = PyObject_GetAttr(s->stack, a_stack_track);
            if (!track) return -1;
            PyObject *idx = PyObject_GetAttr(track, a_track_index);
            PyObject *dev = idx ? PyObject_GetAttr(track, a_track_device) : NULL;
            Py_DECREF(track);
            if (!dev) { Py_XDECREF(idx); return -1; }
            tr = PyLong_AsLong(idx);
            dv = dev == Py_None ? -1 : PyLong_AsSsize_t(dev);
            Py_DECREF(idx);
            Py_DECREF(dev);
            if (PyErr_Occurred()) return -1;
            if (dv < -1 || tr < 0) return 1;
            last_stack = s->stack;
        }
        if (dv < 0 && !(gt_span_on_host(s) && (s->ns1 || PyLong_CheckExact(s->t1)))) return 1;
        if (dv >= 0 && !(s->t0 && s->t1)) return 1; /* a device span's times are its events */
        track_of[i] = tr;
        dev_of[i] = dv;
    }
    return 0;
}

PyDoc_STRVAR(split_finished_doc,
             "split_finished($module, pending, wait, /)\n--\n\n"
             "record._split_finished for spans of this module's Span type, and the devices to anchor:\n"
             "(done, waiting, sorted devices of the done spans). With `wait` every span is done. NotImplemented\n"
             "(nothing asked) when a span is of another type.");

static PyObject *hot_split_finished(PyObject *self, PyObject *args) {
    PyObject *pending;
    int wait;
    if (!PyArg_ParseTuple(args, "O!p", &PyList_Type, &pending, &wait)) return NULL;
    Py_ssize_t n = PyList_Size(pending);
    long *track_of = PyMem_Malloc(sizeof(long) * (size_t)(n ? n : 1));
    Py_ssize_t *dev_of = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n ? n : 1));
    Py_ssize_t *group = NULL, *next = NULL, *head = NULL, *tail = NULL, *idx = NULL, ng = 0;
    PyObject *done = NULL, *waiting = NULL, *result = NULL;
    char *dev_used = NULL;
    Py_ssize_t maxdev = -1;
    if (!track_of || !dev_of) { PyErr_NoMemory(); goto out; }
    int r = span_tracks(pending, track_of, dev_of);
    if (r < 0) goto out;
    if (r > 0) { result = Py_NewRef(Py_NotImplemented); goto out; }
    long maxt = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (track_of[i] > maxt) maxt = track_of[i];
        if (dev_of[i] > maxdev) maxdev = dev_of[i];
    }
    group = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(maxt + 2));
    next = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n ? n : 1));
    head = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n ? n : 1));
    tail = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n ? n : 1));
    idx = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n ? n : 1));
    dev_used = PyMem_Calloc((size_t)(maxdev + 2), 1);
    if (!group || !next || !head || !tail || !idx || !dev_used) { PyErr_NoMemory(); goto out; }
    if (!(done = PyList_New(0)) || !(waiting = PyList_New(0))) goto out;
    for (long t = 0; t <= maxt; t++) group[t] = -1;
    /* Host spans are done, in order; device spans grouped by track, tracks in first-seen order. */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (dev_of[i] < 0 || wait) {
            if (PyList_Append(done, PyList_GetItem(pending, i)) < 0) goto out;
            if (dev_of[i] >= 0) dev_used[dev_of[i]] = 1;
            continue;
        }
        Py_ssize_t g = group[track_of[i]];
        next[i] = -1;
        if (g < 0) {
            g = group[track_of[i]] = ng++;
            head[g] = i;
        } else {
            next[tail[g]] = i;
        }
        tail[g] = i;
    }
    for (Py_ssize_t g = 0; g < ng; g++) {
        Py_ssize_t m = 0;
        for (Py_ssize_t i = head[g]; i >= 0; i = next[i]) idx[m++] = i;
        /* On one stream events complete in order: the finished spans are a prefix. The last is
         * asked first (at a flush a step the GPU has usually finished them all: one query, each
         * ~1.5 us on the H200 VM), then a binary search. */
        Py_ssize_t lo = 0, hi = m;
        while (lo < hi) {
            Py_ssize_t mid = hi == m ? m - 1 : (lo + hi) / 2;
            PyObject *q = PyObject_CallMethodObjArgs(((Span *)PyList_GetItem(pending, idx[mid]))->t1, a_event_query, NULL);
            if (!q) goto out;
            int t = PyObject_IsTrue(q);
            Py_DECREF(q);
            if (t < 0) goto out;
            if (t) lo = mid + 1;
            else hi = mid;
        }
        for (Py_ssize_t j = 0; j < m; j++)
            if (PyList_Append(j < lo ? done : waiting, PyList_GetItem(pending, idx[j])) < 0) goto out;
        if (lo > 0) dev_used[dev_of[head[g]]] = 1;
    }
    {
        PyObject *devs = PyList_New(0);
        if (!devs) goto out;
        for (Py_ssize_t d = 0; d <= maxdev; d++) {
            if (!dev_used[d]) continue;
            PyObject *v = PyLong_FromSsize_t(d);
            if (!v || PyList_Append(devs, v) < 0) { Py_XDECREF(v); Py_DECREF(devs); goto out; }
            Py_DECREF(v);
        }
        result = PyTuple_Pack(3, done, waiting, devs);
        Py_DECREF(devs);
    }
out:
    PyMem_Free(track_of);
    PyMem_Free(dev_of);
    PyMem_Free(group);
    PyMem_Free(next);
    PyMem_Free(head);
    PyMem_Free(tail);
    PyMem_Free(idx);
    PyMem_Free(dev_used);
    Py_XDECREF(done);
    Py_XDECREF(waiting);
    return result;
}

PyDoc_STRVAR(resolve_doc,
             "resolve($module, done, offset, store, timelines, freed, rounding_ns, timeline_type, /)\n--\n\n"
             "resolve.resolve for spans of this module's Span type: append every span of `done` that its\n"
             "device's anchors cover to `store`, each resolved device span's events to freed[device] (None:\n"
             "new lists, one per timeline), and\n"
             "return (those that wait for a newer anchor, freed, {owner: [ns of each of its spans]}). NotImplemented\n"
             "(nothing done) when a span is of another type: the Python twin resolves those.");

typedef struct {
    long long start, end, entry;
    long track;
} Row;

static PyObject *hot_resolve(PyObject *self, PyObject *args) {
    PyObject *done, *store, *timelines, *freed, *timeline_type;
    long long offset, rounding;
    if (!PyArg_ParseTuple(args, "O!LOOOLO", &PyList_Type, &done, &offset, &store, &timelines, &freed, &rounding,
                          &timeline_type))
        return NULL;
    Timeline tlc = {0};
    int tl_native = 0;
    Py_ssize_t n = PyList_Size(done);
    /* Per span: its track index and device (-1: a host track), read once per stack. The check
     * pass changes nothing, so a span this loop cannot take leaves everything to the twin. */
    long *track_of = PyMem_Malloc(sizeof(long) * (size_t)(n ? n : 1));
    Py_ssize_t *dev_of = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n ? n : 1));
    Row *rows = PyMem_Malloc(sizeof(Row) * (size_t)(n ? n : 1));
    PyObject **names = PyMem_Calloc((size_t)(n ? n : 1), sizeof(PyObject *));
    PyObject **argv = PyMem_Calloc((size_t)(n ? n : 1), sizeof(PyObject *)); /* each row's args, owned */
    PyObject *later = NULL, *durations = NULL, *extent = NULL, *result = NULL;
    PyObject *last_tl = NULL, *last_freed = NULL, *freed_made = NULL; /* owned */
    Py_ssize_t last_tl_dev = -1;
    long long last_id = 0;
    int have_last_id = 0;
    Py_ssize_t nrows = 0;
    if (!track_of || !dev_of || !rows || !names || !argv) { PyErr_NoMemory(); goto done_; }
    {
        int r = span_tracks(done, track_of, dev_of);
        if (r < 0) goto done_;
        if (r > 0) goto not_mine;
    }
    if (!(later = PyList_New(0)) || !(durations = PyDict_New())) goto done_;
    if (freed == Py_None) { /* one list per timeline, made here: a Python comprehension costs more */
        Py_ssize_t ntl = PySequence_Size(timelines);
        if (ntl < 0 || !(freed = freed_made = PyList_New(ntl))) goto done_;
        for (Py_ssize_t k = 0; k < ntl; k++) {
            PyObject *l = PyList_New(0);
            if (!l) goto done_;
            PyList_SetItem(freed_made, k, l); /* steals it */
        }
    }
    if (!(extent = PyObject_GetAttr(store, a_store_child_extent))) goto done_;
    if (!PyDict_Check(extent)) { PyErr_SetString(PyExc_TypeError, "resolve: child_extent is not a dict"); goto done_; }
    {
        PyObject *v = PyObject_GetAttr(store, a_store__last_id);
        if (!v) goto done_;
        last_id = PyLong_AsLongLong(v);
        Py_DECREF(v);
        if (PyErr_Occurred()) goto done_;
        have_last_id = 1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Span *s = (Span *)PyList_GetItem(done, i);
        Span *parent = (s->parent && s->parent != Py_None) ? (Span *)s->parent : NULL;
        Py_ssize_t dv = dev_of[i];
        long long start, end, entry = 0; /* a host span is entered at its start: 0 */
        if (dv < 0) {
            if (gt_span_host_times(s, &start, &end) != 0) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "resolve: a host span's times are not ints");
                goto done_;
            }
            start += offset;
            end += offset;
        } else {
            if (dv != last_tl_dev) {
                Py_CLEAR(last_tl);
                Py_CLEAR(last_freed);
                if (!(last_tl = PySequence_GetItem(timelines, dv)) || !(last_freed = PySequence_GetItem(freed, dv)))
                    goto done_;
                last_tl_dev = dv;
                tl_native = (PyObject *)Py_TYPE(last_tl) == timeline_type;
                if (tl_native && timeline_read(&tlc, last_tl) < 0) goto done_;
                if (tlc.raw) { /* the raw call only on the events' own device (see set_raw_elapsed) */
                    int cur = -1;
                    if (g_raw_device(&cur) != 0) (void)g_raw_clear();
                    if (cur != dv) tlc.raw = 0;
                }
            }
            int found = 0, r = tl_native ? timeline_span(&tlc, s, &start, &end, &found) : 1;
            if (r < 0) goto done_;
            if (r == 1) { /* through the timeline's own methods */
                PyObject *a = locate(last_tl, s->t0, s->gen ? s->gen : Py_None);
                if (!a) goto done_;
                PyObject *b = NULL;
                if (a != Py_None) {
                    b = locate(last_tl, s->t1, PyTuple_GetItem(a, 0));
                    if (!b) { Py_DECREF(a); goto done_; }
                }
                found = a != Py_None && b != Py_None;
                int bad = found && (to_host(last_tl, a, &start) < 0 || to_host(last_tl, b, &end) < 0);
                Py_DECREF(a);
                Py_XDECREF(b);
                if (bad) goto done_;
            }
            if (!found) {
                if (PyList_Append(later, (PyObject *)s) < 0) goto done_;
                continue;
            }
            if (end < start) end = start; /* back-to-back events either side of an anchor */
            if (PyDict_Size(extent) > 0) {
                long long sid = id_of(s, &last_id);
                if ((sid == -1 && PyErr_Occurred()) || take_in_children(extent, sid, rounding, &start, &end) < 0)
                    goto done_;
            }
            if (PyList_Append(last_freed, s->t0) < 0 || PyList_Append(last_freed, s->t1) < 0) goto done_;
            PyObject *zero = PyLong_FromLong(0);
            if (!zero) goto done_;
            SETREF(s->t0, Py_NewRef(zero));
            SETREF(s->t1, zero); /* the events are no longer the span's */
            entry = s->entry + offset;
        }
        PyObject *a = s->args ? s->args : Py_None;
        if (s->error && s->error != Py_None) {
            PyObject *d = PyDict_New();
            if (!d) goto done_;
            int t = PyObject_IsTrue(a);
            if (t < 0 || (t && PyDict_Update(d, a) < 0) || PyDict_SetItem(d, s_error, s->error) < 0) {
                Py_DECREF(d);
                goto done_;
            }
            argv[nrows] = d;
        } else {
            argv[nrows] = Py_NewRef(a);
        }
        if (dv >= 0 && parent && parent->stack == s->stack) {
            long long pid = id_of(parent, &last_id);
            if ((pid == -1 && PyErr_Occurred()) || widen_extent(extent, pid, start, end) < 0) goto done_;
        }
        Row *row = &rows[nrows];
        row->start = start;
        row->end = end;
        row->entry = entry;
        row->track = track_of[i];
        names[nrows] = Py_NewRef(s->name);
        nrows++;
        if (s->owner && s->owner != Py_None) {
            /* Grouped per owner: its timer adds a flush's durations in one call. */
            PyObject *ns = PyDict_GetItemWithError(durations, s->owner); /* borrowed */
            if (!ns) {
                if (PyErr_Occurred() || !(ns = PyList_New(0))) goto done_;
                int r = PyDict_SetItem(durations, s->owner, ns);
                Py_DECREF(ns); /* the dict holds it */
                if (r < 0) goto done_;
            }
            PyObject *d = PyLong_FromLongLong(end - start);
            int r = d ? PyList_Append(ns, d) : -1;
            Py_XDECREF(d);
            if (r < 0) goto done_;
        }
    }
    {
        /* Past the store's capacity rows are counted, not kept (as SpanStore.extend). */
        Py_ssize_t capacity = attr_ssize(store, a_store_capacity);
        if (capacity == -1 && PyErr_Occurred()) goto done_;
        PyObject *starts = PyObject_GetAttr(store, a_store_start);
        if (!starts) goto done_;
        Py_ssize_t have = PyObject_Size(starts);
        Py_DECREF(starts);
        if (have < 0) goto done_;
        Py_ssize_t room = capacity - have > 0 ? capacity - have : 0;
        Py_ssize_t keep = nrows < room ? nrows : room;
        if (nrows > keep) {
            Py_ssize_t dropped = attr_ssize(store, a_store_dropped);
            if (dropped == -1 && PyErr_Occurred()) goto done_;
            PyObject *v = PyLong_FromSsize_t(dropped + nrows - keep);
            if (!v) goto done_;
            int r = PyObject_SetAttr(store, a_store_dropped, v);
            Py_DECREF(v);
            if (r < 0) goto done_;
        }
        PyObject *index = PyObject_GetAttr(store, a_store__name_index);
        PyObject *namelist = index ? PyObject_GetAttr(store, a_store_names) : NULL;
        if (!namelist) { Py_XDECREF(index); goto done_; }
        long *cn = PyMem_Malloc(sizeof(long) * 2 * (size_t)(keep ? keep : 1));
        long long *cq = PyMem_Malloc(sizeof(long long) * 3 * (size_t)(keep ? keep : 1));
        int bad = !cn || !cq || !PyDict_Check(index) || !PyList_Check(namelist);
        if (!cn || !cq) PyErr_NoMemory();
        else if (bad) PyErr_SetString(PyExc_TypeError, "resolve: the store's names are not a list and a dict");
        PyObject *last_name = NULL; /* spans of one name come in runs: look each run up once */
        long last_ix = 0;
        for (Py_ssize_t j = 0; !bad && j < keep; j++) {
            PyObject *ix = names[j] == last_name ? NULL : PyDict_GetItemWithError(index, names[j]);
            if (names[j] == last_name) {
                cn[j] = last_ix;
            } else if (ix) {
                cn[j] = PyLong_AsLong(ix);
            } else if (PyErr_Occurred()) {
                bad = 1;
                break;
            } else {
                Py_ssize_t k = PyList_Size(namelist);
                PyObject *kv = PyLong_FromSsize_t(k);
                if (!kv || PyDict_SetItem(index, names[j], kv) < 0 || PyList_Append(namelist, names[j]) < 0) bad = 1;
                Py_XDECREF(kv);
                cn[j] = (long)k;
            }
            last_name = names[j];
            last_ix = cn[j];
            cn[keep + j] = rows[j].track;
            cq[j] = rows[j].start;
            cq[keep + j] = rows[j].end;
            cq[2 * keep + j] = rows[j].entry;
        }
        Py_DECREF(index);
        Py_DECREF(namelist);
        if (!bad) {
            bad = column_extend(store, a_store_name, cn, sizeof(long), keep) < 0 ||
                  column_extend(store, a_store_track, cn + keep, sizeof(long), keep) < 0 ||
                  column_extend(store, a_store_start, cq, sizeof(long long), keep) < 0 ||
                  column_extend(store, a_store_end, cq + keep, sizeof(long long), keep) < 0 ||
                  column_extend(store, a_store_entry, cq + 2 * keep, sizeof(long long), keep) < 0;
        }
        PyMem_Free(cn);
        PyMem_Free(cq);
        if (bad) goto done_;
        if (keep) {
            PyObject *sargs = PyObject_GetAttr(store, a_store_args);
            if (!sargs) goto done_;
            PyObject *part = PyList_New(keep);
            for (Py_ssize_t j = 0; part && j < keep; j++) {
                PyList_SetItem(part, j, argv[j]); /* steals it */
                argv[j] = NULL;
            }
            int r = part ? PyList_SetSlice(sargs, PY_SSIZE_T_MAX, PY_SSIZE_T_MAX, part) : -1;
            Py_XDECREF(part);
            Py_DECREF(sargs);
            if (r < 0) goto done_;
        }
    }
    result = PyTuple_Pack(3, later, freed, durations);
    goto done_;
not_mine:
    result = Py_NewRef(Py_NotImplemented);
done_:
    if (have_last_id) {
        /* Always written back: ids given before an error stay given. */
        PyObject *exc_type, *exc_value, *exc_tb;
        PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
        PyObject *v = PyLong_FromLongLong(last_id);
        if (!v || PyObject_SetAttr(store, a_store__last_id, v) < 0) Py_CLEAR(result);
        Py_XDECREF(v);
        if (exc_type) PyErr_Restore(exc_type, exc_value, exc_tb);
    }
    if (names)
        for (Py_ssize_t j = 0; j < nrows; j++) Py_XDECREF(names[j]);
    PyMem_Free(names);
    PyMem_Free(rows);
    PyMem_Free(dev_of);
    PyMem_Free(track_of);
    Py_XDECREF(last_tl);
    Py_XDECREF(last_freed);
    Py_XDECREF(freed_made);
    timeline_clear(&tlc);
    Py_XDECREF(later);
    Py_XDECREF(durations);
    if (argv)
        for (Py_ssize_t j = 0; j < n; j++) Py_XDECREF(argv[j]);
    PyMem_Free(argv);
    Py_XDECREF(extent);
    return result;
}

static PyMethodDef resolve_methods[] = {
    {"resolve", hot_resolve, METH_VARARGS, resolve_doc},
    {"split_finished", hot_split_finished, METH_VARARGS, split_finished_doc},
    {"set_raw_elapsed", hot_set_raw_elapsed, METH_VARARGS, set_raw_elapsed_doc},
    {"raw_elapsed_ms", hot_raw_elapsed_ms, METH_VARARGS, raw_elapsed_ms_doc},
    {NULL},
};

int gt_resolve_init(PyObject *m) {
#define X(what, name) \
    if (!(a_##what##_##name = PyUnicode_InternFromString(#name))) return -1;
    RESOLVE_FIELDS(X)
#undef X
    if (!(s_error = PyUnicode_InternFromString("error")) || !(s_frombytes = PyUnicode_InternFromString("frombytes")))
        return -1;
    static const char *fields[][2] = {
#define X(what, name) {#what, #name},
        RESOLVE_FIELDS(X)
#undef X
    };
    PyObject *pairs = gt_layout_pairs(fields, (Py_ssize_t)(sizeof(fields) / sizeof(fields[0])));
    PyObject *layout = pairs ? Py_BuildValue("(iN)", RESOLVE_LAYOUT_VERSION, pairs) : NULL;
    if (!layout || PyModule_AddObject(m, "RESOLVE_LAYOUT", layout) < 0) { Py_XDECREF(layout); return -1; }
    return PyModule_AddFunctions(m, resolve_methods);
}
