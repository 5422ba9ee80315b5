/* The span hot path: span(), the Span and DisabledSpan types, their __enter__/__exit__ slots, and
 * open/close on the installed state. install() reads a record.HotState into a new State object
 * and then switches to it in one step, so a thread inside a span never sees a half-built state;
 * each open and close holds a reference to the State it started with. Anything unusual (a new
 * stack, CUDA graph capture, cuda_sync, misuse, a full pending list) calls back into the
 * recorder's Python methods. */
#include "hot.h"

static PyTypeObject *StateType;
static State *g_state;      /* the installed recorder's state, or NULL: nothing to close into */
static int g_recording;     /* spans open (recording on); implies g_state */
static int g_capture;       /* CUDA graph captures under way (torch.cuda.CUDAGraph, watched from Python) */

/* bound at import of record.py (and again at each gputrace.native switch to this build) */
static PyObject *g_disabled;   /* dict: name -> shared disabled handle */
static PyObject *g_slow;       /* record._span_slow(name, kwargs) */
static PyObject *g_traced;     /* record.traced(fn, name, args, cuda, sync) */

/* One interned name per STACK_FIELDS entry, a_<what>_<attribute>: what is read, declared once. */
#define X(what, name) static PyObject *a_##what##_##name;
STACK_FIELDS(X)
#undef X
static PyObject *s_name; /* a function's __name__ (Python's, not the layout's) */

PyTypeObject *gt_SpanType;

static void bundle_return(State *st);

static void State_dealloc(State *st) {
    PyTypeObject *tp = Py_TYPE(st);
    PyObject *et, *ev, *etb; /* an exception may be on its way: kept as it is */
    PyErr_Fetch(&et, &ev, &etb);
    bundle_return(st);
    PyErr_Restore(et, ev, etb);
#define X(name) Py_CLEAR(st->name);
    HOT_FIELDS(X)
#undef X
    Py_CLEAR(st->src);
    Py_CLEAR(st->host_stack);
    Py_CLEAR(st->nvtx_push_py);
    Py_CLEAR(st->nvtx_pop_py);
    Py_CLEAR(st->cuda_stack);
    freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    f(st);
    Py_DECREF(tp);
}

static PyType_Slot State_slots[] = {
    {Py_tp_doc, "A record.HotState as the C hot path reads it (internal)."},
    {Py_tp_dealloc, State_dealloc},
    {0, NULL},
};

static PyType_Spec State_spec = {"gputrace._hot._State", sizeof(State), 0, Py_TPFLAGS_DEFAULT, State_slots};

/* torch's current device and current stream, asked of c10 itself (libc10_cuda's exported
 * c10::cuda::current_device, getCurrentCUDAStream and CUDAStream::stream), standing in for
 * torch's Python bindings of the same calls (~0.2-0.3 us each through pybind on the H200 VM).
 * Set by cuda.py (set_current), which checks them against the bindings first. A CUDAStream is
 * 16 trivially copyable bytes (a c10::Stream: device, then a 64-bit stream id), returned in
 * registers. */
typedef struct {
    int64_t device, id;
} C10Stream;
static int8_t (*g_c10_device)(void);
static C10Stream (*g_c10_stream)(int8_t device);
static void *(*g_c10_raw)(const C10Stream *stream);
static PyObject *g_device_for, *g_stream_for; /* the bindings they stand in for */

PyDoc_STRVAR(set_current_doc,
             "set_current($module, device, stream, raw, device_for, stream_for, /)\n--\n\n"
             "Ask torch's current device and raw current stream of c10 from C, at these addresses\n"
             "(c10::cuda::current_device, c10::cuda::getCurrentCUDAStream, CUDAStream::stream), where the\n"
             "recorder's own calls are `device_for` and `stream_for` (torch's bindings); 0s turn it off.");

static PyObject *hot_set_current(PyObject *self, PyObject *args) {
    PyObject *d, *st, *r, *dfor, *sfor;
    if (!PyArg_ParseTuple(args, "OOOOO", &d, &st, &r, &dfor, &sfor)) return NULL;
    void *pd = PyLong_AsVoidPtr(d), *ps = PyLong_AsVoidPtr(st), *pr = PyLong_AsVoidPtr(r);
    if (PyErr_Occurred()) return NULL;
    int on = pd && ps && pr;
    g_c10_device = on ? (int8_t(*)(void))pd : NULL;
    g_c10_stream = on ? (C10Stream(*)(int8_t))ps : NULL;
    g_c10_raw = on ? (void *(*)(const C10Stream *))pr : NULL;
    SETREF(g_device_for, on ? Py_NewRef(dfor) : NULL);
    SETREF(g_stream_for, on ? Py_NewRef(sfor) : NULL);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(current_stream_doc,
             "current_stream($module, /)\n--\n\n"
             "(device, raw stream) as the C hot path reads them through set_current's calls, or None.");

static PyObject *hot_current_stream(PyObject *self, PyObject *unused) {
    if (!g_c10_device) Py_RETURN_NONE;
    int8_t d = g_c10_device();
    C10Stream cs = g_c10_stream(d);
    return Py_BuildValue("(iN)", (int)d, PyLong_FromVoidPtr(g_c10_raw(&cs)));
}

/* A new State read from the HotState `src`, or NULL with an exception set. Runs Python code
 * (attribute reads), so nothing global may change until it is complete. */
static State *state_from(PyObject *src) {
    State *st = (State *)PyType_GenericAlloc(StateType, 0);
    if (!st) return NULL;
    st->src = Py_NewRef(src);
#define X(name) \
    if (!(st->name = PyObject_GetAttrString(src, #name))) goto fail;
    HOT_FIELDS(X)
#undef X
    if ((st->has_dev = PyObject_IsTrue(st->has_device)) < 0) goto fail;
    st->n_check_at = PyLong_AsSsize_t(st->check_at);
    if (st->n_check_at == -1 && PyErr_Occurred()) goto fail;
    PyObject *time_mod = PyImport_ImportModule("time");
    if (!time_mod) goto fail;
    PyObject *mono = PyObject_GetAttrString(time_mod, "monotonic_ns");
    Py_DECREF(time_mod);
    if (!mono) goto fail;
    st->native_mono = (mono == st->mono);
    Py_DECREF(mono);
    st->c10_current = g_c10_device && st->cur_dev == g_device_for && st->raw_stream == g_stream_for;
    if (st->nvtx != Py_None) { /* read once here: the hot path calls what it holds */
        void *push = NULL, *pop = NULL;
        PyObject *v = PyObject_GetAttrString(st->nvtx, "push_addr");
        if (v) { push = PyLong_AsVoidPtr(v); Py_DECREF(v); }
        v = PyErr_Occurred() ? NULL : PyObject_GetAttrString(st->nvtx, "pop_addr");
        if (v) { pop = PyLong_AsVoidPtr(v); Py_DECREF(v); }
        if (PyErr_Occurred()) goto fail;
        if (push && pop) {
            st->nvtx_push = (int (*)(const char *))push;
            st->nvtx_pop = (int (*)(void))pop;
        } else if (!(st->nvtx_push_py = PyObject_GetAttrString(st->nvtx, "push")) ||
                   !(st->nvtx_pop_py = PyObject_GetAttrString(st->nvtx, "pop"))) {
            goto fail;
        }
        st->nvtx_on = 1;
    }
    return st;
fail:
    Py_DECREF(st);
    return NULL;
}

PyDoc_STRVAR(install_doc,
             "install($module, state, recording, /)\n--\n\n"
             "Make `state` (a record.HotState, or None) the one spans close into, and open into while\n"
             "`recording`. The new state is read whole before it replaces the old one.");

static PyObject *hot_install(PyObject *self, PyObject *args) {
    PyObject *src;
    int recording;
    if (!PyArg_ParseTuple(args, "Op", &src, &recording)) return NULL;
    State *st = NULL;
    if (src != Py_None && !(st = state_from(src))) return NULL;
    /* The switch: plain stores, no Python code in between. */
    State *old = g_state;
    g_state = st;
    g_recording = st != NULL && recording;
    Py_XDECREF(old); /* may run Python code (the last reference to a recorder): after the switch */
    Py_RETURN_NONE;
}

PyDoc_STRVAR(bind_doc,
             "bind($module, disabled, span_slow, traced, /)\n--\n\n"
             "The record module's shared disabled handles (a dict), its span() slow path and its\n"
             "decorator factory; called once, at import.");

static PyObject *hot_bind(PyObject *self, PyObject *args) {
    PyObject *disabled, *slow, *traced;
    if (!PyArg_ParseTuple(args, "O!OO", &PyDict_Type, &disabled, &slow, &traced)) return NULL;
    SETREF(g_disabled, Py_NewRef(disabled));
    SETREF(g_slow, Py_NewRef(slow));
    SETREF(g_traced, Py_NewRef(traced));
    Py_RETURN_NONE;
}

PyDoc_STRVAR(set_check_at_doc,
             "set_check_at($module, state, n, /)\n--\n\n"
             "The pending length at which a close calls pending_full, where `state` is installed.");

static PyObject *hot_set_check_at(PyObject *self, PyObject *args) {
    PyObject *src;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "On", &src, &n)) return NULL;
    if (g_state && g_state->src == src) g_state->n_check_at = n;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(set_capture_doc,
             "set_capture($module, n, /)\n--\n\n"
             "CUDA graph captures under way; while any is, every open asks the slow path.");

static PyObject *hot_set_capture(PyObject *self, PyObject *arg) {
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    g_capture = (int)n;
    Py_RETURN_NONE;
}

/* Monotonic ns into *out: CLOCK_MONOTONIC itself, or the state's clock (a test's). 0, or -1. */
static int mono_ns(State *st, long long *out) {
    if (st->native_mono) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        *out = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
        return 0;
    }
    PyObject *t = PyObject_CallNoArgs(st->mono);
    if (!t) return -1;
    *out = PyLong_AsLongLong(t);
    Py_DECREF(t);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* ---- open / close -------------------------------------------------------------------------- */

/* The stack for this span on this thread, or NULL with no error set: take the slow path. A device
 * span's stack comes with its device and the raw current stream it is keyed by. */
static PyObject *find_stack(State *st, Span *s, PyObject **dev_out, void **raw_out) {
    *dev_out = NULL;
    if (s->cuda && st->has_dev) {
        PyObject *dev, *raw;
        uint64_t tid = 0;
        if (st->c10_current) {
            int8_t d = g_c10_device();
            C10Stream cs = g_c10_stream(d);
            void *rp = g_c10_raw(&cs);
            tid = PyThreadState_GetID(PyThreadState_Get());
            *raw_out = rp;
            if (!(dev = PyLong_FromLong(d))) return NULL;
            /* The same thread, device and stream as the last span: the same stack (a key's stack
             * never changes for one recorder). */
            if (st->cuda_stack && st->cuda_tid == tid && st->cuda_dev == d && st->cuda_raw == rp) {
                *dev_out = dev;
                return Py_NewRef(st->cuda_stack);
            }
            if (!(raw = PyLong_FromVoidPtr(rp))) { Py_DECREF(dev); return NULL; }
        } else {
            if (!(dev = PyObject_CallNoArgs(st->cur_dev))) return NULL;
            if (!(raw = PyObject_CallFunctionObjArgs(st->raw_stream, dev, NULL))) { Py_DECREF(dev); return NULL; }
            *raw_out = PyLong_Check(raw) ? PyLong_AsVoidPtr(raw) : NULL;
            if (PyErr_Occurred()) PyErr_Clear(); /* not a handle: recorded through st->record */
        }
        PyObject *stacks = PyObject_GetAttr(st->local, a_local_cuda);
        if (!stacks) { PyErr_Clear(); Py_DECREF(dev); Py_DECREF(raw); return NULL; }
        PyObject *key = PyTuple_Pack(2, dev, raw);
        Py_DECREF(raw);
        if (!key) { Py_DECREF(stacks); Py_DECREF(dev); return NULL; }
        PyObject *stack = PyDict_GetItemWithError(stacks, key); /* borrowed */
        Py_DECREF(key);
        Py_XINCREF(stack);
        Py_DECREF(stacks);
        if (!stack) { Py_DECREF(dev); return NULL; }
        if (st->c10_current) {
            SETREF(st->cuda_stack, Py_NewRef(stack));
            st->cuda_tid = tid;
            st->cuda_dev = (int)PyLong_AsLong(dev);
            st->cuda_raw = *raw_out;
        }
        *dev_out = dev;
        return stack;
    }
    /* A thread's host stack never changes for one recorder: the last thread's is kept. */
    uint64_t tid = PyThreadState_GetID(PyThreadState_Get());
    if (st->host_stack && st->host_tid == tid) return Py_NewRef(st->host_stack);
    PyObject *stack = PyObject_GetAttr(st->local, a_local_host);
    if (!stack) {
        PyErr_Clear();
        return NULL;
    }
    SETREF(st->host_stack, Py_NewRef(stack));
    st->host_tid = tid;
    return stack;
}

/* The item of a per-device list (pools, gens) for device `d` (or `dev`, where d < 0 or the
 * container is not a list): a new reference, or NULL with an exception set. */
static PyObject *per_device(PyObject *of, PyObject *dev, long d) {
    if (d >= 0 && PyList_Check(of)) {
        PyObject *v = PyList_GetItem(of, d); /* borrowed */
        return v ? Py_NewRef(v) : NULL;
    }
    if (dev) return PyObject_GetItem(of, dev);
    PyObject *key = PyLong_FromLong(d);
    if (!key) return NULL;
    PyObject *v = PyObject_GetItem(of, key);
    Py_DECREF(key);
    return v;
}

/* The runtime events the state took from the devices' pools and has not used: back to the end of
 * their pools, in their order (the state is going). */
static void bundle_return(State *st) {
    for (int d = 0; d < BUNDLE_DEVICES; d++) {
        int n = st->n_bundle[d];
        st->n_bundle[d] = 0;
        if (!n) continue;
        PyObject *pool = PyList_Check(st->pools) ? PyList_GetItem(st->pools, d) : NULL;
        if (!pool) PyErr_Clear();
        for (int i = 0; i < n; i++) {
            if (pool && PyList_Check(pool) && PyList_Append(pool, st->bundle[d][i]) < 0) PyErr_Clear();
            Py_DECREF(st->bundle[d][i]);
        }
    }
}

/* An event from the device's pool (one atomic take under the GIL), else a new one. Runtime events
 * are taken a bundle at a time (the last EVENT_BUNDLE of the pool, used newest first, as the pool
 * would give them), a bundle per device: one list operation a bundle, not a delete of the pool's
 * last item a record. */
static PyObject *pooled_event(State *st, PyObject *dev, long d) {
    int bundled = d >= 0 && d < BUNDLE_DEVICES;
    if (bundled && st->n_bundle[d] > 0) return st->bundle[d][--st->n_bundle[d]];
    PyObject *pool = per_device(st->pools, dev, d);
    if (!pool) { /* a device past the pools (a span opened under a recorder of more): a new event, as the twin */
        if (!PyErr_ExceptionMatches(PyExc_IndexError)) return NULL;
        PyErr_Clear();
        return PyObject_CallNoArgs(st->new_event);
    }
    PyObject *ev;
    Py_ssize_t n = PyList_Size(pool);
    if (n > 1 && bundled && PyList_Check(st->pools) && PyList_Check(pool) &&
        Py_TYPE(PyList_GetItem(pool, n - 1)) == gt_RawEventType) {
        PyObject **b = st->bundle[d];
        Py_ssize_t k = 0;
        while (k < EVENT_BUNDLE && k < n && Py_TYPE(PyList_GetItem(pool, n - 1 - k)) == gt_RawEventType) k++;
        for (Py_ssize_t i = 0; i < k; i++) b[i] = Py_NewRef(PyList_GetItem(pool, n - k + i));
        if (PyList_SetSlice(pool, n - k, n, NULL) < 0) {
            for (Py_ssize_t i = 0; i < k; i++) Py_DECREF(b[i]);
            Py_DECREF(pool);
            return NULL;
        }
        Py_DECREF(pool);
        st->n_bundle[d] = (int)k - 1;
        return b[k - 1];
    }
    if (n > 0) {
        ev = PyList_GetItem(pool, n - 1); /* borrowed */
        Py_INCREF(ev);
        if (PyList_SetSlice(pool, n - 1, n, NULL) < 0) { Py_DECREF(ev); ev = NULL; }
    } else {
        if (n < 0) PyErr_Clear();
        ev = PyObject_CallNoArgs(st->new_event);
    }
    Py_DECREF(pool);
    return ev;
}

static int record_on(State *st, PyObject *ev, PyObject *stack) {
    PyObject *stream = PyObject_GetAttr(stack, a_stack_stream);
    if (!stream) return -1;
    PyObject *r = PyObject_CallFunctionObjArgs(st->record, ev, stream, NULL);
    Py_DECREF(stream);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

/* A close's record of a runtime event on its stack's raw stream; the device may have been switched
 * since the open (the raw handle 0 means the current device's default stream). */
static int raw_record_close(RawEvent *ev, PyObject *stack, PyObject *dev) {
    PyObject *r = PyObject_GetAttr(stack, a_stack_raw);
    if (!r) return -1;
    void *raw = PyLong_AsVoidPtr(r);
    Py_DECREF(r);
    long d = PyLong_AsLong(dev);
    if (PyErr_Occurred()) return -1;
    return gt_raw_record_on(ev, raw, (int)d);
}

static PyObject *open_span(State *st, Span *s) {
    s->at_raw = 0; /* set below where this open records a runtime event; never by the slow path */
    if (s->sync) return PyObject_CallFunctionObjArgs(st->open_slow, (PyObject *)s, NULL);
    PyObject *dev;
    void *raw = NULL;
    PyObject *stack = find_stack(st, s, &dev, &raw);
    if (!stack) {
        if (PyErr_Occurred()) return NULL;
        return PyObject_CallFunctionObjArgs(st->open_slow, (PyObject *)s, NULL);
    }
    if (dev) {
        if (g_capture) { /* the Python path asks CUDA itself, and skips the span if capturing */
            Py_DECREF(stack);
            Py_DECREF(dev);
            return PyObject_CallFunctionObjArgs(st->open_slow, (PyObject *)s, NULL);
        }
        /* The host moment the start is queued: one clock read, the host spans' own clock. */
        if (mono_ns(st, &s->entry) < 0) { Py_DECREF(stack); Py_DECREF(dev); return NULL; }
        long d = PyLong_AsLong(dev);
        if (d == -1 && PyErr_Occurred()) { Py_DECREF(stack); Py_DECREF(dev); return NULL; }
        PyObject *ev = pooled_event(st, dev, d);
        /* A runtime event: one record on the raw current stream (the stack's), on the current
         * device (the stack's too); else the device's own record. */
        int is_raw = ev && Py_TYPE(ev) == gt_RawEventType;
        int bad = !ev || (is_raw ? gt_raw_record((RawEvent *)ev, raw) : record_on(st, ev, stack)) < 0;
        if (bad) {
            Py_XDECREF(ev); Py_DECREF(stack); Py_DECREF(dev);
            return NULL;
        }
        if (is_raw && d >= 0 && d <= INT_MAX) { /* the close records on the same, without asking the stack */
            s->at_raw = 1;
            s->raw_dev = (int)d;
            s->raw_stream = raw;
        }
        SETREF(s->t0, ev);
        s->ns0 = 0;
        PyObject *gen = per_device(st->gens, dev, d);
        Py_DECREF(dev);
        if (!gen) { Py_DECREF(stack); return NULL; }
        SETREF(s->gen, gen);
    } else {
        if (mono_ns(st, &s->h0) < 0) { Py_DECREF(stack); return NULL; }
        s->ns0 = 1;
        Py_CLEAR(s->t0);
    }
    Py_ssize_t n = PyList_Size(stack);
    PyObject *parent = n > 0 ? PyList_GetItem(stack, n - 1) : Py_None;
    SETREF(s->parent, Py_NewRef(parent));
    SETREF(s->stack, stack); /* takes our reference */
    if (PyList_Append(stack, (PyObject *)s) < 0) return NULL;
    Py_RETURN_NONE;
}

/* A span whose end is recorded: onto the pending list. */
static PyObject *closed(State *st, Span *s, int untrack) {
    if (PyList_Append(st->pending, (PyObject *)s) < 0) return NULL;
    /* Closed in order, the span is off its stack and in no cycle: the collector need not walk it
     * (each collection of the young objects would, for every span closed since the last). */
    if (untrack) PyObject_GC_UnTrack((PyObject *)s);
    if (PyList_Size(st->pending) >= st->n_check_at) return PyObject_CallNoArgs(st->pending_full);
    Py_RETURN_NONE;
}

/* A host span: its start is held as ns, or is an int (set by the Python slow path). */
static PyObject *close_span(State *st, Span *s) {
    if (s->sync) return PyObject_CallFunctionObjArgs(st->close_slow, (PyObject *)s, NULL);
    PyObject *stack = s->stack;
    Py_ssize_t n = (stack && stack != Py_None) ? PyList_Size(stack) : 0;
    int untrack = 0; /* closed and in no cycle: see below */
    if (n > 0 && PyList_GetItem(stack, n - 1) == (PyObject *)s) {
        if (PyList_SetSlice(stack, n - 1, n, NULL) < 0) return NULL;
        /* A handle opened twice is its own parent, or still lower on its stack: in a cycle. */
        untrack = s->parent != (PyObject *)s;
        for (Py_ssize_t i = 0; untrack && i < n - 1; i++) untrack = PyList_GetItem(stack, i) != (PyObject *)s;
    } else { /* a misnested close: spans still open inside it name it their parent (a cycle) */
        PyErr_Clear();
        PyObject *go = PyObject_CallFunctionObjArgs(st->close_unusual, (PyObject *)s, NULL);
        if (!go) return NULL;
        int record_end = PyObject_IsTrue(go);
        Py_DECREF(go);
        if (!record_end) Py_RETURN_NONE;
        stack = s->stack;
    }
    if (s->at_raw && !gt_span_on_host(s)) { /* opened by the C path on a runtime event */
        PyObject *ev = pooled_event(st, NULL, s->raw_dev);
        if (!ev) return NULL;
        int r = Py_TYPE(ev) == gt_RawEventType ? gt_raw_record_on((RawEvent *)ev, s->raw_stream, s->raw_dev)
                                               : record_on(st, ev, stack);
        if (r < 0) { Py_DECREF(ev); return NULL; }
        SETREF(s->t1, ev);
        s->ns1 = 0;
        return closed(st, s, untrack);
    }
    PyObject *dev = gt_span_on_host(s) ? Py_NewRef(Py_None) : PyObject_GetAttr(stack, a_stack_device); /* host: none */
    if (!dev) return NULL;
    if (dev != Py_None) {
        PyObject *ev = pooled_event(st, dev, -1);
        if (!ev || ((Py_TYPE(ev) == gt_RawEventType) ? raw_record_close((RawEvent *)ev, stack, dev) : record_on(st, ev, stack)) < 0) {
            Py_XDECREF(ev); Py_DECREF(dev);
            return NULL;
        }
        SETREF(s->t1, ev);
        s->ns1 = 0;
    } else {
        if (mono_ns(st, &s->h1) < 0) { Py_DECREF(dev); return NULL; }
        s->ns1 = 1;
        Py_CLEAR(s->t1);
    }
    Py_DECREF(dev);
    return closed(st, s, untrack);
}

/* The NVTX range of a span (the nvtx option): pushed once its open is recorded, popped before its
 * close is, so the range holds the user's code and not gputrace's. 0, or -1 with an exception. */
static int nvtx_push(State *st, Span *s) {
    if (st->nvtx_push) {
        Py_ssize_t n;
        const char *name = PyUnicode_Check(s->name) ? PyUnicode_AsUTF8AndSize(s->name, &n) : NULL;
        if (!name) { PyErr_Clear(); name = "?"; } /* a name that is not text: a range all the same */
        (void)st->nvtx_push(name);
    } else {
        PyObject *r = PyObject_CallFunctionObjArgs(st->nvtx_push_py, s->name, NULL);
        if (!r) return -1;
        Py_DECREF(r);
    }
    s->ranged = 1;
    return 0;
}

static int nvtx_pop(State *st, Span *s) {
    s->ranged = 0;
    if (st->nvtx_pop) {
        (void)st->nvtx_pop();
        return 0;
    }
    PyObject *r = PyObject_CallNoArgs(st->nvtx_pop_py);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

/* open_span / close_span on the installed state, held for the call: a callback into Python
 * may install another state meanwhile, and this one must outlive the call. */
static PyObject *open_installed(Span *s) {
    /* An open span is in a cycle with its stack: the collector must see it (see close_span). */
    if (!PyObject_GC_IsTracked((PyObject *)s)) PyObject_GC_Track((PyObject *)s);
    State *st = g_state;
    Py_INCREF(st);
    PyObject *r = open_span(st, s);
    if (r && st->nvtx_on && !s->ranged && nvtx_push(st, s) < 0) Py_CLEAR(r);
    Py_DECREF(st);
    return r;
}

static PyObject *close_installed(Span *s) {
    State *st = g_state;
    Py_INCREF(st);
    PyObject *r = (s->ranged && st->nvtx_on && nvtx_pop(st, s) < 0) ? NULL : close_span(st, s);
    Py_DECREF(st);
    return r;
}

/* ---- the Span type ------------------------------------------------------------------------- */

static PyObject *Span_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames);

/* Freed spans kept for reuse: a host span's whole cost is a few hundred ns, and an allocation
 * and a free of a collector-tracked object are a tenth of it. A kept span is untracked, its
 * fields cleared; it is made a new object again as CPython's own free lists do (the memory and
 * the collector's header stay; PyObject_Init gives it its type and one reference). Spans are freed
 * when resolved, thousands at a time (a flush anchors at most every few ms): the list holds as
 * many (~1.3 MB at most), or every span past its first few hundred would be a new allocation. */
#define SPAN_FREE_MAX 8192
static Span *g_free_spans[SPAN_FREE_MAX];
static int g_n_free_spans;

static Span *span_alloc(PyTypeObject *type) {
    Span *s;
    if (type == gt_SpanType && g_n_free_spans > 0) {
        s = g_free_spans[--g_n_free_spans];
        memset((char *)s + offsetof(Span, vectorcall), 0, sizeof(Span) - offsetof(Span, vectorcall));
        PyObject_Init((PyObject *)s, type);
        PyObject_GC_Track((PyObject *)s);
    } else {
        allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
        if (!(s = (Span *)alloc(type, 0))) return NULL;
    }
    s->vectorcall = Span_vectorcall;
    return s;
}

static PyObject *Span_tp_new(PyTypeObject *type, PyObject *args, PyObject *kw) { return (PyObject *)span_alloc(type); }

static PyObject *Span_new_from(PyTypeObject *type, PyObject *name, PyObject *args) {
    Span *s = span_alloc(type);
    if (!s) return NULL;
    s->name = Py_NewRef(name);
    s->args = Py_NewRef(args);
    s->cuda = 1;
    return (PyObject *)s;
}

static int Span_init(Span *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"name", "args", "cuda", "sync", "owner", NULL};
    PyObject *name, *a = Py_None, *owner = Py_None;
    int cuda = 1, sync = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OppO", kwlist, &name, &a, &cuda, &sync, &owner)) return -1;
    SETREF(self->name, Py_NewRef(name));
    SETREF(self->args, Py_NewRef(a));
    SETREF(self->owner, owner == Py_None ? NULL : Py_NewRef(owner));
    self->cuda = (char)cuda;
    self->sync = (char)sync;
    return 0;
}

static int Span_traverse(Span *s, visitproc visit, void *arg) {
    Py_VISIT(s->name); Py_VISIT(s->args); Py_VISIT(s->stack); Py_VISIT(s->parent); Py_VISIT(s->id);
    Py_VISIT(s->gen); Py_VISIT(s->t0); Py_VISIT(s->t1); Py_VISIT(s->error); Py_VISIT(s->owner);
    return 0;
}

static int Span_clear(Span *s) {
    Py_CLEAR(s->name); Py_CLEAR(s->args); Py_CLEAR(s->stack); Py_CLEAR(s->parent); Py_CLEAR(s->id);
    Py_CLEAR(s->gen); Py_CLEAR(s->t0); Py_CLEAR(s->t1); Py_CLEAR(s->error); Py_CLEAR(s->owner);
    return 0;
}

static void Span_dealloc(Span *s) {
    PyTypeObject *tp = Py_TYPE(s);
    PyObject_GC_UnTrack(s);
    Span_clear(s);
    if (tp == gt_SpanType && g_n_free_spans < SPAN_FREE_MAX) {
        g_free_spans[g_n_free_spans++] = s;
    } else {
        freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
        f(s);
    }
    Py_DECREF(tp);
}

static PyObject *Span_enter(Span *self, PyObject *unused) {
    if (g_recording) {
        PyObject *r = open_installed(self);
        if (!r) return NULL;
        Py_DECREF(r);
    }
    return Py_NewRef((PyObject *)self);
}

static PyObject *Span_exit(Span *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs > 0 && args[0] != Py_None) {
        PyObject *n = PyObject_GetAttr(args[0], s_name);
        if (!n) return NULL;
        SETREF(self->error, n);
    }
    if (g_state) {
        PyObject *r = close_installed(self);
        if (!r) return NULL;
        Py_DECREF(r);
    }
    Py_RETURN_NONE;
}

static PyObject *Span_end(Span *self, PyObject *unused) {
    if (!self->stack) {
        if (!g_recording) Py_RETURN_NONE;
        State *st = g_state; /* held for the call, as in open_installed */
        Py_INCREF(st);
        PyObject *r = PyObject_CallFunctionObjArgs(st->close_by_name, (PyObject *)self, NULL);
        Py_DECREF(st);
        return r;
    }
    return Span_exit(self, NULL, 0);
}

/* The decorator: `@span("name")` wraps fn. */
static PyObject *Span_decorate(Span *self, PyObject *fn) {
    return PyObject_CallFunction(g_traced, "OOOOO", fn, self->name, self->args, self->cuda ? Py_True : Py_False,
                                 self->sync ? Py_True : Py_False);
}

/* A call's positional arguments (at most 3) from tp_call's tuple; -1 with keywords or more. */
static Py_ssize_t tuple_args(PyObject *args, PyObject *kw, PyObject **a) {
    Py_ssize_t n = PyTuple_Size(args);
    if ((kw && PyDict_Size(kw) > 0) || n > 3) return -1;
    for (Py_ssize_t i = 0; i < n; i++) a[i] = PyTuple_GetItem(args, i);
    return n;
}

/* A call on the handle, by its argument count (n = -1: keywords or too many): one decorates;
 * none is `__enter__()` and three are `__exit__(exc_type, exc, tb)` (see Slot below). */
static PyObject *span_dispatch(Span *self, PyObject *const *a, Py_ssize_t n) {
    if (n == 0) return Span_enter(self, NULL);
    if (n == 3) return Span_exit(self, a, 3);
    if (n == 1) return Span_decorate(self, a[0]);
    PyErr_SetString(PyExc_TypeError, "a span decorates one function, given alone");
    return NULL;
}

static PyObject *Span_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return span_dispatch((Span *)self, args, kwnames && PyTuple_Size(kwnames) > 0 ? -1 : HOT_NARGS(nargsf));
}

static PyObject *Span_call(Span *self, PyObject *args, PyObject *kw) {
    PyObject *a[3];
    return span_dispatch(self, a, tuple_args(args, kw, a));
}

static PyObject *Span_track(Span *self, void *closure) {
    if (!self->stack || self->stack == Py_None) Py_RETURN_NONE;
    return PyObject_GetAttr(self->stack, a_stack_track);
}

static PyObject *Span_repr(Span *self) { return PyUnicode_FromFormat("<gputrace span %R>", self->name); }

static PyMethodDef Span_methods[] = {
    {"start", (PyCFunction)Span_enter, METH_NOARGS, "start($self, /)\n--\n\nOpen the span; pair with .end()."},
    {"end", (PyCFunction)Span_end, METH_NOARGS,
     "end($self, /)\n--\n\n"
     "Close the span. On a handle never started, close the innermost open span of this name."},
    {NULL},
};

static PyMemberDef Span_members[] = {
    {"name", T_OBJECT_EX, offsetof(Span, name), 0, "The span's name."},
    {"args", T_OBJECT, offsetof(Span, args), 0, "Keyword arguments given to span(), or None."},
    {"stack", T_OBJECT_EX, offsetof(Span, stack), 0, NULL},
    {"parent", T_OBJECT_EX, offsetof(Span, parent), 0, NULL},
    {"id", T_OBJECT, offsetof(Span, id), 0, NULL}, /* None until resolved: no exception to ask */
    {"gen", T_OBJECT_EX, offsetof(Span, gen), 0, NULL},
    {"error", T_OBJECT, offsetof(Span, error), 0, NULL},
    {"ranged", T_BOOL, offsetof(Span, ranged), 0, "An NVTX range was pushed at its open and not yet popped."},
    {"entry", T_LONGLONG, offsetof(Span, entry), 0, "A device span: monotonic ns when the host entered it."},
    {"owner", T_OBJECT, offsetof(Span, owner), 0, NULL},
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(Span, vectorcall), READONLY, NULL},
    {"cuda", T_BOOL, offsetof(Span, cuda), 0, "Timed with CUDA events (else a host span)."},
    {"sync", T_BOOL, offsetof(Span, sync), 0, "Synchronises the device around each record."},
    {NULL},
};

/* t0 / t1: the start and end, a device's event or a host span's monotonic ns. */
static PyObject *span_time_get(Span *s, void *which) {
    int w = which != NULL;
    PyObject *o = w ? s->t1 : s->t0;
    if (o) return Py_NewRef(o);
    if (w ? s->ns1 : s->ns0) return PyLong_FromLongLong(w ? s->h1 : s->h0);
    PyErr_SetString(PyExc_AttributeError, w ? "t1" : "t0");
    return NULL;
}

static int span_time_set(Span *s, PyObject *v, void *which) {
    int w = which != NULL;
    PyObject **slot = w ? &s->t1 : &s->t0;
    char *ns = w ? &s->ns1 : &s->ns0;
    long long *h = w ? &s->h1 : &s->h0;
    if (v && PyLong_CheckExact(v)) {
        long long x = PyLong_AsLongLong(v);
        if (!(x == -1 && PyErr_Occurred())) {
            Py_CLEAR(*slot);
            *h = x;
            *ns = 1;
            return 0;
        }
        PyErr_Clear(); /* past 64 bits: kept as the object */
    }
    *ns = 0;
    SETREF(*slot, v ? Py_NewRef(v) : NULL);
    return 0;
}

static PyGetSetDef Span_getset[] = {
    {"t0", (getter)span_time_get, (setter)span_time_set, "The start: a CUDA event, or monotonic ns.", NULL},
    {"t1", (getter)span_time_get, (setter)span_time_set, "The end: a CUDA event, or monotonic ns.", (void *)1},
    {"track", (getter)Span_track, NULL, "The track the span was recorded on (None before it opens).", NULL},
    {NULL},
};

static PyType_Slot Span_slots[] = {
    {Py_tp_doc,
     "Span(name, args=None, cuda=True, sync=False, owner=None)\n--\n\n"
     "One span: the handle span() returns, and the record the recorder keeps. A context manager,\n"
     "a decorator, and .start()/.end()."},
    {Py_tp_init, Span_init},
    {Py_tp_new, Span_tp_new},
    {Py_tp_dealloc, Span_dealloc},
    {Py_tp_traverse, Span_traverse},
    {Py_tp_clear, Span_clear},
    {Py_tp_methods, Span_methods},
    {Py_tp_members, Span_members},
    {Py_tp_getset, Span_getset},
    {Py_tp_call, Span_call},
    {Py_tp_repr, Span_repr},
    {0, NULL},
};

static PyType_Spec Span_spec = {
    "gputrace._hot.Span", sizeof(Span), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL, Span_slots,
};

/* ---- the handle span() gives while recording is off ------------------------------------------ */

/* record._DisabledSpan in C: a context manager whose enter and exit are C calls, so a disabled
 * span costs a dict lookup more than a bare no-op context manager written in Python, not two
 * Python calls more. It remembers its name, so `@span("name")` applied while recording is off
 * still traces under that name once recording is on. */
typedef struct {
    PyObject_HEAD
    hot_vectorcall vectorcall;
    PyObject *name, *args;
    char cuda, sync;
} Disabled;

static PyTypeObject *DisabledType;

static int Disabled_init(Disabled *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"name", "args", "cuda", "sync", NULL};
    PyObject *name, *a = Py_None;
    int cuda = 1, sync = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|Opp", kwlist, &name, &a, &cuda, &sync)) return -1;
    SETREF(self->name, Py_NewRef(name));
    SETREF(self->args, Py_NewRef(a));
    self->cuda = (char)cuda;
    self->sync = (char)sync;
    return 0;
}

static int Disabled_traverse(Disabled *s, visitproc visit, void *arg) {
    Py_VISIT(s->name);
    Py_VISIT(s->args);
    return 0;
}

static int Disabled_clear(Disabled *s) {
    Py_CLEAR(s->name);
    Py_CLEAR(s->args);
    return 0;
}

static void Disabled_dealloc(Disabled *s) {
    PyTypeObject *tp = Py_TYPE(s);
    PyObject_GC_UnTrack(s);
    Disabled_clear(s);
    freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    f(s);
    Py_DECREF(tp);
}

static PyObject *Disabled_self(PyObject *self, PyObject *unused) { return Py_NewRef(self); }

static PyObject *Disabled_end(PyObject *self, PyObject *unused) { Py_RETURN_NONE; }

/* As span_dispatch: one argument decorates, none enters, three exit (all doing nothing). */
static PyObject *disabled_dispatch(Disabled *self, PyObject *const *a, Py_ssize_t n) {
    if (n == 0) return Py_NewRef((PyObject *)self);
    if (n == 3) Py_RETURN_NONE;
    if (n != 1) {
        PyErr_SetString(PyExc_TypeError, "a span decorates one function, given alone");
        return NULL;
    }
    return PyObject_CallFunction(g_traced, "OOOOO", a[0], self->name, self->args ? self->args : Py_None,
                                 self->cuda ? Py_True : Py_False, self->sync ? Py_True : Py_False);
}

static PyObject *Disabled_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return disabled_dispatch((Disabled *)self, args, kwnames && PyTuple_Size(kwnames) > 0 ? -1 : HOT_NARGS(nargsf));
}

static PyObject *Disabled_call(Disabled *self, PyObject *args, PyObject *kw) {
    PyObject *a[3];
    return disabled_dispatch(self, a, tuple_args(args, kw, a));
}

static PyObject *Disabled_tp_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    Disabled *d = (Disabled *)alloc(type, 0);
    if (d) d->vectorcall = Disabled_vectorcall;
    return (PyObject *)d;
}

static PyObject *Disabled_repr(Disabled *self) {
    return PyUnicode_FromFormat("<gputrace span %R (recording off)>", self->name);
}

static PyMethodDef Disabled_methods[] = {
    {"start", (PyCFunction)Disabled_self, METH_NOARGS, "start($self, /)\n--\n\nDoes nothing; returns the handle."},
    {"end", (PyCFunction)Disabled_end, METH_NOARGS, "end($self, /)\n--\n\nDoes nothing."},
    {NULL},
};

static PyMemberDef Disabled_members[] = {
    {"name", T_OBJECT_EX, offsetof(Disabled, name), READONLY, "The span's name."},
    {"args", T_OBJECT, offsetof(Disabled, args), READONLY, "Keyword arguments given to span(), or None."},
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(Disabled, vectorcall), READONLY, NULL},
    {"cuda", T_BOOL, offsetof(Disabled, cuda), READONLY, "Timed with CUDA events (else a host span)."},
    {"sync", T_BOOL, offsetof(Disabled, sync), READONLY, "Synchronises the device around each record."},
    {NULL},
};

static PyType_Slot Disabled_slots[] = {
    {Py_tp_doc,
     "DisabledSpan(name, args=None, cuda=True, sync=False)\n--\n\n"
     "What span() gives while recording is off: a do-nothing context manager that remembers its\n"
     "name (as a decorator it traces under that name once recording is on)."},
    {Py_tp_init, Disabled_init},
    {Py_tp_new, Disabled_tp_new},
    {Py_tp_dealloc, Disabled_dealloc},
    {Py_tp_traverse, Disabled_traverse},
    {Py_tp_clear, Disabled_clear},
    {Py_tp_methods, Disabled_methods},
    {Py_tp_members, Disabled_members},
    {Py_tp_call, Disabled_call},
    {Py_tp_repr, Disabled_repr},
    {0, NULL},
};

static PyType_Spec Disabled_spec = {
    "gputrace._hot.DisabledSpan", sizeof(Disabled), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    Disabled_slots,
};

/* ---- __enter__ and __exit__ without a bound method ----------------------------------------- */

/* A `with` statement looks __enter__ and __exit__ up on the type and binds each to the handle:
 * for a C method that is a new bound-method object each, ~50 ns a span for the two on Python
 * 3.12, a sixth of a host span's whole cost. A Slot binds to the handle itself instead, and the
 * handle's call dispatches on its argument count (Span_call): none is __enter__, three are
 * __exit__, one is the decorator. Looked up on the class (`type(cm).__enter__(cm)`, as
 * contextlib.ExitStack does) a Slot is called with the handle first. */
typedef struct {
    PyObject_HEAD
    PyTypeObject *owner; /* the handle type it is a slot of */
    PyObject *name;      /* "__enter__" or "__exit__" */
    int nargs;           /* the arguments it takes after the handle: 0 or 3 */
} Slot;

static PyTypeObject *SlotType;

static void Slot_dealloc(Slot *s) {
    PyTypeObject *tp = Py_TYPE(s);
    Py_CLEAR(s->name);
    Py_CLEAR(s->owner);
    freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    f(s);
    Py_DECREF(tp);
}

/* The handle's __enter__ and __exit__ as bound methods, for a Span subclass whose call is its
 * own (Slot_get below). */
static PyObject *slot_enter(PyObject *h, PyObject *unused) { return span_dispatch((Span *)h, NULL, 0); }

static PyObject *slot_exit(PyObject *h, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "__exit__() takes exc_type, exc and tb");
        return NULL;
    }
    return span_dispatch((Span *)h, args, 3);
}

static PyMethodDef slot_defs[2] = {
    {"__enter__", (PyCFunction)slot_enter, METH_NOARGS, "__enter__($self, /)\n--\n\nOpen the span; returns it."},
    {"__exit__", (PyCFunction)(void (*)(void))slot_exit, METH_FASTCALL,
     "__exit__($self, exc_type, exc, tb, /)\n--\n\nClose the span; an exception's type name goes into its args."},
};

/* The handle itself where its call is the owner type's dispatch; a subclass that defines
 * __call__ gets a bound method, as a C method would give. */
static PyObject *Slot_get(PyObject *self, PyObject *obj, PyObject *type) {
    if (!obj || obj == Py_None) return Py_NewRef(self);
    Slot *sl = (Slot *)self;
    if (Py_TYPE(obj) == sl->owner || PyType_GetSlot(Py_TYPE(obj), Py_tp_call) == PyType_GetSlot(sl->owner, Py_tp_call))
        return Py_NewRef(obj);
    return PyCFunction_NewEx(&slot_defs[sl->nargs ? 1 : 0], obj, NULL);
}

static PyObject *Slot_call(Slot *self, PyObject *args, PyObject *kw) {
    Py_ssize_t n = PyTuple_Size(args);
    PyObject *h = n > 0 ? PyTuple_GetItem(args, 0) : NULL;
    if (n != self->nargs + 1 || (kw && PyDict_Size(kw) > 0) || !PyObject_TypeCheck(h, self->owner)) {
        PyErr_Format(PyExc_TypeError, "%U() takes a span handle%s", self->name,
                     self->nargs ? ", exc_type, exc and tb" : " alone");
        return NULL;
    }
    PyObject *a[3];
    for (Py_ssize_t i = 1; i < n; i++) a[i - 1] = PyTuple_GetItem(args, i);
    return self->owner == DisabledType ? disabled_dispatch((Disabled *)h, a, self->nargs)
                                       : span_dispatch((Span *)h, a, self->nargs);
}

static PyObject *Slot_repr(Slot *self) {
    return PyUnicode_FromFormat("<slot %R of %R>", self->name, (PyObject *)self->owner);
}

static PyType_Slot Slot_slots[] = {
    {Py_tp_doc, "__enter__ or __exit__ of a span handle, bound to the handle itself (internal)."},
    {Py_tp_dealloc, Slot_dealloc},
    {Py_tp_descr_get, Slot_get},
    {Py_tp_call, Slot_call},
    {Py_tp_repr, Slot_repr},
    {0, NULL},
};

#ifndef Py_TPFLAGS_DISALLOW_INSTANTIATION
#define Py_TPFLAGS_DISALLOW_INSTANTIATION (1UL << 7)
#endif
static PyType_Spec Slot_spec = {"gputrace._hot._Slot", sizeof(Slot), 0,
                                Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, Slot_slots};

/* Set type.__enter__ and type.__exit__ to Slots. */
static int add_slots(PyTypeObject *type) {
    static const char *names[2] = {"__enter__", "__exit__"};
    for (int i = 0; i < 2; i++) {
        Slot *s = (Slot *)PyType_GenericAlloc(SlotType, 0);
        if (!s) return -1;
        s->owner = (PyTypeObject *)Py_NewRef((PyObject *)type);
        s->nargs = i ? 3 : 0;
        int r = (s->name = PyUnicode_InternFromString(names[i])) ? PyObject_SetAttr((PyObject *)type, s->name, (PyObject *)s)
                                                                 : -1;
        Py_DECREF(s);
        if (r < 0) return -1;
    }
    return 0;
}

/* ---- span() and the recorder entry points ------------------------------------------------- */

static PyObject *slow_path(PyObject *name, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *kw = PyDict_New();
    if (!kw) return NULL;
    Py_ssize_t nk = kwnames ? PyTuple_Size(kwnames) : 0;
    for (Py_ssize_t i = 0; i < nk; i++) {
        if (PyDict_SetItem(kw, PyTuple_GetItem(kwnames, i), args[nargs + i]) < 0) { Py_DECREF(kw); return NULL; }
    }
    PyObject *r = PyObject_CallFunctionObjArgs(g_slow, name, kw, NULL);
    Py_DECREF(kw);
    return r;
}

PyDoc_STRVAR(span_doc,
             "span($module, name, /, **args)\n--\n\n"
             "A span: `with span(\"fwd\"):`, `@span`, `@span(\"name\")`, or `s = span(\"x\").start(); s.end()`.\n\n"
             "Keyword arguments land in the trace event's args, except `timer_type` (TimerType.CUDA, the\n"
             "default, or TimerType.CPU / \"cpu\" for a host-thread span) and `cuda_sync=True`\n"
             "(synchronise the device before each record). While recording is off this returns a shared\n"
             "do-nothing handle; under torch.compile, `nullcontext()`.");

static PyObject *hot_span(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "span() takes one positional argument, the name (or a function)");
        return NULL;
    }
    PyObject *name = args[0];
    int has_kw = kwnames && PyTuple_Size(kwnames) > 0;
    if (!g_disabled || !g_slow) {
        PyErr_SetString(PyExc_RuntimeError, "gputrace._hot is used before gputrace.record bound it");
        return NULL;
    }
    if (!g_recording) {
        if (!has_kw) {
            PyObject *h = PyDict_GetItemWithError(g_disabled, name);
            if (h) return Py_NewRef(h);
            if (PyErr_Occurred()) PyErr_Clear(); /* unhashable: the slow path explains */
        }
        return slow_path(name, args, nargs, kwnames);
    }
    if (has_kw || !PyUnicode_CheckExact(name)) return slow_path(name, args, nargs, kwnames);
    return Span_new_from(gt_SpanType, name, Py_None);
}

PyDoc_STRVAR(open_doc, "open($module, span, /)\n--\n\nOpen `span` on the installed state (Recorder.open).");

static PyObject *hot_open(PyObject *self, PyObject *s) {
    if (!PyObject_TypeCheck(s, gt_SpanType)) {
        PyErr_SetString(PyExc_TypeError, "open() takes a Span");
        return NULL;
    }
    if (!g_state) {
        PyErr_SetString(PyExc_RuntimeError, "gputrace: no recorder is installed to open a span in");
        return NULL;
    }
    return open_installed((Span *)s);
}

PyDoc_STRVAR(close_doc, "close($module, span, /)\n--\n\nClose `span` on the installed state (Recorder.close).");

static PyObject *hot_close(PyObject *self, PyObject *s) {
    if (!PyObject_TypeCheck(s, gt_SpanType)) {
        PyErr_SetString(PyExc_TypeError, "close() takes a Span");
        return NULL;
    }
    if (!g_state) Py_RETURN_NONE;
    return close_installed((Span *)s);
}

static PyMethodDef span_methods[] = {
    {"span", (PyCFunction)(void (*)(void))hot_span, METH_FASTCALL | METH_KEYWORDS, span_doc},
    {"bind", hot_bind, METH_VARARGS, bind_doc},
    {"install", hot_install, METH_VARARGS, install_doc},
    {"set_check_at", hot_set_check_at, METH_VARARGS, set_check_at_doc},
    {"set_capture", hot_set_capture, METH_O, set_capture_doc},
    {"set_current", hot_set_current, METH_VARARGS, set_current_doc},
    {"current_stream", hot_current_stream, METH_NOARGS, current_stream_doc},
    {"open", hot_open, METH_O, open_doc},
    {"close", hot_close, METH_O, close_doc},
    {NULL},
};

int gt_span_init(PyObject *m) {
#define X(what, name) \
    if (!(a_##what##_##name = PyUnicode_InternFromString(#name))) return -1;
    STACK_FIELDS(X)
#undef X
    if (!(s_name = PyUnicode_InternFromString("__name__"))) return -1;
    static const char *fields[][2] = {
#define X(what, name) {#what, #name},
        STACK_FIELDS(X)
#undef X
    };
    PyObject *layout = gt_layout_pairs(fields, (Py_ssize_t)(sizeof(fields) / sizeof(fields[0])));
    if (!layout || PyModule_AddObject(m, "STACK_LAYOUT", layout) < 0) { Py_XDECREF(layout); return -1; }
    if (PyModule_AddFunctions(m, span_methods) < 0) return -1;
    gt_SpanType = (PyTypeObject *)PyType_FromSpec(&Span_spec);
    if (!gt_SpanType || PyModule_AddObject(m, "Span", Py_NewRef((PyObject *)gt_SpanType)) < 0) return -1;
    DisabledType = (PyTypeObject *)PyType_FromSpec(&Disabled_spec);
    if (!DisabledType || PyModule_AddObject(m, "DisabledSpan", Py_NewRef((PyObject *)DisabledType)) < 0) return -1;
    SlotType = (PyTypeObject *)PyType_FromSpec(&Slot_spec);
    if (!SlotType || add_slots(gt_SpanType) < 0 || add_slots(DisabledType) < 0) return -1;
    StateType = (PyTypeObject *)PyType_FromSpec(&State_spec);
    return StateType ? 0 : -1;
}
