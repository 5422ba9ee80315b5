/* gputrace._hot: the span hot path in C.
 *
 * The same logic as the pure-Python path in record.py (which stays the reference and the
 * fallback, and runs the same tests): span() hands out Span objects; entering one pushes it on
 * its (thread, device, stream) stack and records a pooled CUDA event or a monotonic timestamp;
 * leaving records the end and appends the span to the recorder's pending list. Anything unusual
 * (a new stack, CUDA graph capture, cuda_sync, misuse, a full pending list) calls back into the
 * recorder's Python methods. Built against the limited API, so one binary serves every Python
 * from 3.10 on.
 *
 * What the hot path reads is record.HotState, declared there once: HOT_FIELDS below lists its
 * slots in the same order and HOT_LAYOUT is the same number; record.py refuses a build whose
 * LAYOUT differs. install() reads a HotState into a new State object and then switches to it in
 * one step, so a thread inside a span never sees a half-built state; each open and close holds
 * a reference to the State it started with.
 */
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

#define HOT_LAYOUT 1
/* record.HotState.__slots__, in order. */
#define HOT_FIELDS(X)                                                                                  \
    X(local) X(has_device) X(cur_dev) X(raw_stream) X(capturing) X(new_event) X(record) X(pools) X(gens) \
    X(mono) X(pending) X(check_at) X(open_slow) X(close_slow) X(close_unusual) X(pending_full)          \
    X(close_by_name)

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
} State;

static PyTypeObject *StateType;
static State *g_state;      /* the installed recorder's state, or NULL: nothing to close into */
static int g_recording;     /* spans open (recording on); implies g_state */
static int g_capture;       /* CUDA graph captures under way (torch.cuda.CUDAGraph, watched from Python) */

/* bound once, at import of record.py */
static PyObject *g_disabled;   /* dict: name -> shared disabled handle */
static PyObject *g_slow;       /* record._span_slow(name, kwargs) */
static PyObject *g_traced;     /* record.traced(fn, name, args, cuda, sync) */

static PyObject *s_host, *s_cuda, *s_track, *s_stream, *s_device, *s_name;

static PyTypeObject *SpanType;

/* Vectorcall (PEP 590): part of the limited API from 3.12, and the same protocol since 3.8. A
 * `with` statement calls __enter__ and __exit__ (Slot, below) through it: no argument tuple. */
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
    long long h0, h1;
} Span;


#define SETREF(dst, src)            \
    do {                            \
        PyObject *_old = (dst);     \
        (dst) = (src);              \
        Py_XDECREF(_old);           \
    } while (0)

static void State_dealloc(State *st) {
    PyTypeObject *tp = Py_TYPE(st);
#define X(name) Py_CLEAR(st->name);
    HOT_FIELDS(X)
#undef X
    Py_CLEAR(st->src);
    Py_CLEAR(st->host_stack);
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

/* The stack for this span on this thread, or NULL with no error set: take the slow path. */
static PyObject *find_stack(State *st, Span *s, PyObject **dev_out) {
    *dev_out = NULL;
    if (s->cuda && st->has_dev) {
        PyObject *stacks = PyObject_GetAttr(st->local, s_cuda);
        if (!stacks) { PyErr_Clear(); return NULL; }
        PyObject *dev = PyObject_CallNoArgs(st->cur_dev);
        if (!dev) { Py_DECREF(stacks); return NULL; }
        PyObject *raw = PyObject_CallFunctionObjArgs(st->raw_stream, dev, NULL);
        if (!raw) { Py_DECREF(stacks); Py_DECREF(dev); return NULL; }
        PyObject *key = PyTuple_Pack(2, dev, raw);
        Py_DECREF(raw);
        if (!key) { Py_DECREF(stacks); Py_DECREF(dev); return NULL; }
        PyObject *stack = PyDict_GetItemWithError(stacks, key); /* borrowed */
        Py_DECREF(key);
        Py_XINCREF(stack);
        Py_DECREF(stacks);
        if (!stack) { Py_DECREF(dev); return NULL; }
        *dev_out = dev;
        return stack;
    }
    /* A thread's host stack never changes for one recorder: the last thread's is kept. */
    uint64_t tid = PyThreadState_GetID(PyThreadState_Get());
    if (st->host_stack && st->host_tid == tid) return Py_NewRef(st->host_stack);
    PyObject *stack = PyObject_GetAttr(st->local, s_host);
    if (!stack) {
        PyErr_Clear();
        return NULL;
    }
    SETREF(st->host_stack, Py_NewRef(stack));
    st->host_tid = tid;
    return stack;
}

/* An event from the device's pool (one atomic take under the GIL), else a new one. */
static PyObject *pooled_event(State *st, PyObject *dev) {
    PyObject *pool = PyObject_GetItem(st->pools, dev);
    if (!pool) return NULL;
    PyObject *ev;
    Py_ssize_t n = PyList_Size(pool);
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
    PyObject *stream = PyObject_GetAttr(stack, s_stream);
    if (!stream) return -1;
    PyObject *r = PyObject_CallFunctionObjArgs(st->record, ev, stream, NULL);
    Py_DECREF(stream);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

static PyObject *open_span(State *st, Span *s) {
    if (s->sync) return PyObject_CallFunctionObjArgs(st->open_slow, (PyObject *)s, NULL);
    PyObject *dev;
    PyObject *stack = find_stack(st, s, &dev);
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
        PyObject *ev = pooled_event(st, dev);
        if (!ev || record_on(st, ev, stack) < 0) {
            Py_XDECREF(ev); Py_DECREF(stack); Py_DECREF(dev);
            return NULL;
        }
        SETREF(s->t0, ev);
        s->ns0 = 0;
        PyObject *gen = PyObject_GetItem(st->gens, dev);
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

/* A host span: its start is held as ns, or is an int (set by the Python slow path). */
static int span_on_host(Span *s) { return s->ns0 || (s->t0 && PyLong_CheckExact(s->t0)); }

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
    PyObject *dev = span_on_host(s) ? Py_NewRef(Py_None) : PyObject_GetAttr(stack, s_device); /* host: none */
    if (!dev) return NULL;
    if (dev != Py_None) {
        PyObject *ev = pooled_event(st, dev);
        if (!ev || record_on(st, ev, stack) < 0) {
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
    if (PyList_Append(st->pending, (PyObject *)s) < 0) return NULL;
    /* Closed in order, the span is off its stack and in no cycle: the collector need not walk it
     * (each collection of the young objects would, for every span closed since the last). */
    if (untrack) PyObject_GC_UnTrack((PyObject *)s);
    if (PyList_Size(st->pending) >= st->n_check_at) return PyObject_CallNoArgs(st->pending_full);
    Py_RETURN_NONE;
}

/* open_span / close_span on the installed state, held for the call: a callback into Python
 * may install another state meanwhile, and this one must outlive the call. */
static PyObject *open_installed(Span *s) {
    /* An open span is in a cycle with its stack: the collector must see it (see close_span). */
    if (!PyObject_GC_IsTracked((PyObject *)s)) PyObject_GC_Track((PyObject *)s);
    State *st = g_state;
    Py_INCREF(st);
    PyObject *r = open_span(st, s);
    Py_DECREF(st);
    return r;
}

static PyObject *close_installed(Span *s) {
    State *st = g_state;
    Py_INCREF(st);
    PyObject *r = close_span(st, s);
    Py_DECREF(st);
    return r;
}

/* ---- the Span type ------------------------------------------------------------------------- */

static PyObject *Span_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames);

/* Freed spans kept for reuse: a host span's whole cost is a few hundred ns, and an allocation
 * and a free of a collector-tracked object are a tenth of it. A kept span is untracked, its
 * fields cleared; it is made a new object again as CPython's own free lists do (the memory and
 * the collector's header stay; PyObject_Init gives it its type and one reference). */
#define SPAN_FREE_MAX 512
static Span *g_free_spans[SPAN_FREE_MAX];
static int g_n_free_spans;

static Span *span_alloc(PyTypeObject *type) {
    Span *s;
    if (type == SpanType && g_n_free_spans > 0) {
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
    if (tp == SpanType && g_n_free_spans < SPAN_FREE_MAX) {
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
    return PyObject_GetAttr(self->stack, s_track);
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

/* A host span's start and end in ns (ints or held ns); 1: not both ints; -1: error. */
static int span_host_times(Span *s, long long *t0, long long *t1) {
    if (s->ns0) *t0 = s->h0;
    else if (s->t0 && PyLong_CheckExact(s->t0)) *t0 = PyLong_AsLongLong(s->t0);
    else return 1;
    if (s->ns1) *t1 = s->h1;
    else if (s->t1 && PyLong_CheckExact(s->t1)) *t1 = PyLong_AsLongLong(s->t1);
    else return 1;
    return PyErr_Occurred() ? -1 : 0;
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
    return Span_new_from(SpanType, name, Py_None);
}

PyDoc_STRVAR(open_doc, "open($module, span, /)\n--\n\nOpen `span` on the installed state (Recorder.open).");

static PyObject *hot_open(PyObject *self, PyObject *s) {
    if (!PyObject_TypeCheck(s, SpanType)) {
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
    if (!PyObject_TypeCheck(s, SpanType)) {
        PyErr_SetString(PyExc_TypeError, "close() takes a Span");
        return NULL;
    }
    if (!g_state) Py_RETURN_NONE;
    return close_installed((Span *)s);
}

/* ---- encoding spans as Chrome JSON ------------------------------------------------------- */

typedef struct {
    char *p;
    size_t len, cap;
} Buf;

/* Room for `n` more bytes, so the raw_* writers below need no checks. */
static int buf_reserve(Buf *b, size_t n) {
    if (b->len + n <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 1 << 16;
    while (cap < b->len + n) cap *= 2;
    char *p = PyMem_Realloc(b->p, cap);
    if (!p) { PyErr_NoMemory(); return -1; }
    b->p = p;
    b->cap = cap;
    return 0;
}

static void raw_put(Buf *b, const char *src, size_t n) {
    memcpy(b->p + b->len, src, n);
    b->len += n;
}

#define RAW_LIT(b, lit) raw_put((b), (lit), sizeof(lit) - 1)

static const char DIGITS2[201] =
    "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
    "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
    "8081828384858687888990919293949596979899";

/* A non-negative integer in decimal, two digits a step (snprintf costs several times more). */
static void raw_u(Buf *b, unsigned long long v) {
    char tmp[24];
    int i = 24;
    while (v >= 100) {
        unsigned r = (unsigned)(v % 100);
        v /= 100;
        tmp[--i] = DIGITS2[2 * r + 1];
        tmp[--i] = DIGITS2[2 * r];
    }
    if (v >= 10) {
        tmp[--i] = DIGITS2[2 * v + 1];
        tmp[--i] = DIGITS2[2 * v];
    } else {
        tmp[--i] = (char)('0' + v);
    }
    raw_put(b, tmp + i, (size_t)(24 - i));
}

/* Nanoseconds as microseconds with exactly three decimals: 1234567 -> "1234.567". */
static void raw_us(Buf *b, unsigned long long ns) {
    raw_u(b, ns / 1000);
    char frac[4] = {'.', (char)('0' + ns / 100 % 10), (char)('0' + ns / 10 % 10), (char)('0' + ns % 10)};
    raw_put(b, frac, 4);
}

/* The checked writers: room first, then the raw ones. */
static int buf_put(Buf *b, const char *src, size_t n) {
    if (buf_reserve(b, n) < 0) return -1;
    raw_put(b, src, n);
    return 0;
}

static int buf_bytes(Buf *b, PyObject *o) {
    char *data;
    Py_ssize_t n;
    if (PyBytes_AsStringAndSize(o, &data, &n) < 0) return -1;
    return buf_put(b, data, (size_t)n);
}

#define PUT_LIT(b, lit) buf_put((b), (lit), sizeof(lit) - 1)

static int put_u(Buf *b, unsigned long long v) {
    if (buf_reserve(b, 24) < 0) return -1;
    raw_u(b, v);
    return 0;
}

static int put_us(Buf *b, unsigned long long ns) {
    if (buf_reserve(b, 28) < 0) return -1;
    raw_us(b, ns);
    return 0;
}

static int item_ll(PyObject *list, Py_ssize_t i, long long *out) {
    PyObject *o = PyList_GetItem(list, i);
    if (!o) return -1;
    *out = PyLong_AsLongLong(o);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

PyDoc_STRVAR(encode_events_doc,
             "encode_events($module, name_json, name_idx, cats, track_idx, lanes, tid_base, pid, starts, ends, base, args_json, /)\n--\n\n"
             "The X events of a trace, comma-separated JSON, ts/dur as exact decimals of integer ns.");

/* encode_events(name_json, name_idx, cats, track_idx, lanes, tid_base, pid, starts, ends, base, args_json)
 * -> the X events, comma-separated, ts/dur as exact decimals of integer ns (as the Python twin). */
static PyObject *hot_encode_events(PyObject *self, PyObject *args) {
    PyObject *name_json, *name_idx, *cats, *track_idx, *lanes, *tid_base, *starts, *ends, *args_json;
    long long pid, base;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!LO!O!LO!", &PyList_Type, &name_json, &PyList_Type, &name_idx,
                          &PyList_Type, &cats, &PyList_Type, &track_idx, &PyList_Type, &lanes, &PyList_Type, &tid_base,
                          &pid, &PyList_Type, &starts, &PyList_Type, &ends, &base, &PyList_Type, &args_json))
        return NULL;
    PyObject *tids = lanes;
    Py_ssize_t n = PyList_Size(starts);
    if (PyList_Size(ends) != n || PyList_Size(name_idx) != n || PyList_Size(track_idx) != n ||
        PyList_Size(tids) != n || PyList_Size(args_json) != n) {
        PyErr_SetString(PyExc_ValueError, "encode_events: columns of different lengths");
        return NULL;
    }
    Buf b = {NULL, 0, 0};
    for (Py_ssize_t i = 0; i < n; i++) {
        long long s, e, ni, ti, ln, tb;
        if (item_ll(starts, i, &s) < 0 || item_ll(ends, i, &e) < 0 || item_ll(name_idx, i, &ni) < 0 ||
            item_ll(track_idx, i, &ti) < 0 || item_ll(tids, i, &ln) < 0 || item_ll(tid_base, (Py_ssize_t)ti, &tb) < 0)
            goto fail;
        long long tid = tb + ln;
        PyObject *nm = PyList_GetItem(name_json, (Py_ssize_t)ni);
        PyObject *cat = PyList_GetItem(cats, (Py_ssize_t)ti);
        PyObject *a = PyList_GetItem(args_json, i);
        if (!nm || !cat || !a) goto fail;
        long long ts = s - base, dur = e - s;
        if (ts < 0 || dur < 0) {
            PyErr_SetString(PyExc_ValueError, "encode_events: a span starts before the base or ends before it starts");
            goto fail;
        }
        if ((i && buf_put(&b, ",", 1) < 0) || PUT_LIT(&b, "{\"ph\":\"X\",\"cat\":") < 0 || buf_bytes(&b, cat) < 0 ||
            PUT_LIT(&b, ",\"name\":") < 0 || buf_bytes(&b, nm) < 0)
            goto fail;
        if (PUT_LIT(&b, ",\"pid\":") < 0 || put_u(&b, (unsigned long long)pid) < 0 || PUT_LIT(&b, ",\"tid\":") < 0 ||
            put_u(&b, (unsigned long long)tid) < 0 || PUT_LIT(&b, ",\"ts\":") < 0 ||
            put_us(&b, (unsigned long long)ts) < 0 || PUT_LIT(&b, ",\"dur\":") < 0 ||
            put_us(&b, (unsigned long long)dur) < 0)
            goto fail;
        if (a != Py_None && (PUT_LIT(&b, ",\"args\":") < 0 || buf_bytes(&b, a) < 0)) goto fail;
        if (buf_put(&b, "}", 1) < 0) goto fail;
    }
    PyObject *out = PyBytes_FromStringAndSize(b.p ? b.p : "", (Py_ssize_t)b.len);
    PyMem_Free(b.p);
    return out;
fail:
    PyMem_Free(b.p);
    return NULL;
}

/* ---- lanes: overflow tracks for spans that cannot nest ----------------------------------- */

typedef struct {
    long long start, end;
    Py_ssize_t idx;
} Item;

static int item_cmp(const void *a, const void *b) {
    const Item *x = a, *y = b;
    if (x->start != y->start) return x->start < y->start ? -1 : 1;
    if (x->end != y->end) return x->end > y->end ? -1 : 1; /* longest first, as Perfetto sorts */
    return x->idx < y->idx ? -1 : (x->idx > y->idx);
}

typedef struct {
    long long *v;
    Py_ssize_t n, cap;
} Stack;

PyDoc_STRVAR(layout_doc,
             "layout($module, track_idx, starts, ends, ntracks, /)\n--\n\n"
             "(lane per span, lanes used per track): spans that cannot nest go to overflow lanes.");

/* layout(track_idx, starts, ends, ntracks) -> (lane per span, lanes used per track) */
static PyObject *hot_layout(PyObject *self, PyObject *args) {
    PyObject *track_idx, *starts, *ends;
    Py_ssize_t ntracks;
    if (!PyArg_ParseTuple(args, "O!O!O!n", &PyList_Type, &track_idx, &PyList_Type, &starts, &PyList_Type, &ends,
                          &ntracks))
        return NULL;
    Py_ssize_t n = PyList_Size(starts);
    if (PyList_Size(ends) != n || PyList_Size(track_idx) != n || ntracks < 0) {
        PyErr_SetString(PyExc_ValueError, "layout: columns of different lengths");
        return NULL;
    }
    Py_ssize_t *count = PyMem_Calloc((size_t)ntracks + 1, sizeof(Py_ssize_t));
    Item *items = PyMem_Malloc(sizeof(Item) * (size_t)(n ? n : 1));
    long long *tr = PyMem_Malloc(sizeof(long long) * (size_t)(n ? n : 1));
    Py_ssize_t *lane = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_ssize_t));
    Py_ssize_t *used = PyMem_Calloc((size_t)ntracks + 1, sizeof(Py_ssize_t));
    Stack *stacks = NULL;
    Py_ssize_t nstacks = 0;
    PyObject *result = NULL;
    if (!count || !items || !tr || !lane || !used) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (item_ll(track_idx, i, &tr[i]) < 0) goto done;
        if (tr[i] < 0 || tr[i] >= ntracks) { PyErr_SetString(PyExc_ValueError, "layout: bad track index"); goto done; }
        count[tr[i] + 1]++;
    }
    for (Py_ssize_t t = 0; t < ntracks; t++) count[t + 1] += count[t]; /* count[t]: first slot of track t */
    {
        Py_ssize_t *fill = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(ntracks + 1));
        if (!fill) { PyErr_NoMemory(); goto done; }
        memcpy(fill, count, sizeof(Py_ssize_t) * (size_t)(ntracks + 1));
        for (Py_ssize_t i = 0; i < n; i++) {
            Item *it = &items[fill[tr[i]]++];
            if (item_ll(starts, i, &it->start) < 0 || item_ll(ends, i, &it->end) < 0) { PyMem_Free(fill); goto done; }
            it->idx = i;
        }
        PyMem_Free(fill);
    }
    for (Py_ssize_t t = 0; t < ntracks; t++) {
        Py_ssize_t lo = count[t], hi = count[t + 1];
        if (hi == lo) continue;
        qsort(items + lo, (size_t)(hi - lo), sizeof(Item), item_cmp);
        for (Py_ssize_t k = 0; k < nstacks; k++) stacks[k].n = 0;
        Py_ssize_t nl = 0;
        for (Py_ssize_t j = lo; j < hi; j++) {
            Item *it = &items[j];
            Py_ssize_t k;
            for (k = 0; k < nl; k++) {
                Stack *st = &stacks[k];
                while (st->n && st->v[st->n - 1] <= it->start) st->n--;
                if (!st->n || st->v[st->n - 1] >= it->end) break;
            }
            if (k == nl) {
                if (nl == nstacks) {
                    Stack *ns = PyMem_Realloc(stacks, sizeof(Stack) * (size_t)(nstacks + 1));
                    if (!ns) { PyErr_NoMemory(); goto done; }
                    stacks = ns;
                    stacks[nstacks].v = NULL;
                    stacks[nstacks].n = stacks[nstacks].cap = 0;
                    nstacks++;
                }
                stacks[nl].n = 0;
                nl++;
            }
            Stack *st = &stacks[k];
            if (st->n == st->cap) {
                Py_ssize_t cap = st->cap ? st->cap * 2 : 64;
                long long *v = PyMem_Realloc(st->v, sizeof(long long) * (size_t)cap);
                if (!v) { PyErr_NoMemory(); goto done; }
                st->v = v;
                st->cap = cap;
            }
            st->v[st->n++] = it->end;
            lane[it->idx] = k;
        }
        used[t] = nl;
    }
    {
        PyObject *lanes = PyList_New(n), *usedl = PyList_New(ntracks);
        if (!lanes || !usedl) { Py_XDECREF(lanes); Py_XDECREF(usedl); goto done; }
        for (Py_ssize_t i = 0; i < n; i++) PyList_SetItem(lanes, i, PyLong_FromSsize_t(lane[i]));
        for (Py_ssize_t t = 0; t < ntracks; t++) PyList_SetItem(usedl, t, PyLong_FromSsize_t(used[t] ? used[t] : 1));
        result = PyTuple_Pack(2, lanes, usedl);
        Py_DECREF(lanes);
        Py_DECREF(usedl);
    }
done:
    for (Py_ssize_t k = 0; k < nstacks; k++) PyMem_Free(stacks[k].v);
    PyMem_Free(stacks);
    PyMem_Free(count);
    PyMem_Free(items);
    PyMem_Free(tr);
    PyMem_Free(lane);
    PyMem_Free(used);
    return result;
}

/* ---- one piece of a recorder's spans: nesting and encoding from the columns ------------------ */

static PyObject *s_tobytes;

/* An array.array's items as bytes (one copy at C speed), checked to hold `itemsize`-byte items. */
static PyObject *array_bytes(PyObject *arr, size_t itemsize, Py_ssize_t *n) {
    PyObject *b = PyObject_CallMethodObjArgs(arr, s_tobytes, NULL);
    if (!b) return NULL;
    if (!PyBytes_Check(b) || PyBytes_Size(b) % (Py_ssize_t)itemsize) {
        Py_DECREF(b);
        PyErr_SetString(PyExc_TypeError, "a span column of an unexpected item size");
        return NULL;
    }
    *n = PyBytes_Size(b) / (Py_ssize_t)itemsize;
    return b;
}

/* A lane's kept spans while a piece is placed: the first `m` of the lane's own lists (read only
 * where the pass looks, at the top), then the ones this piece pushed. */
typedef struct {
    long long *s, *e;
    Py_ssize_t n, cap;
    PyObject *bs, *be; /* the lane's starts and ends lists (owned), or NULL */
    Py_ssize_t m;
} Kept;

static int kept_top(Kept *k, int end, long long *out) {
    if (k->n) {
        *out = end ? k->e[k->n - 1] : k->s[k->n - 1];
        return 0;
    }
    *out = PyLong_AsLongLong(PyList_GetItem(end ? k->be : k->bs, k->m - 1));
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* Item i of the kept starts (end=0) or ends, as a new reference. */
static PyObject *kept_item(Kept *k, int end, Py_ssize_t i) {
    if (i < k->m) return Py_NewRef(PyList_GetItem(end ? k->be : k->bs, i));
    return PyLong_FromLongLong(end ? k->e[i - k->m] : k->s[i - k->m]);
}

/* The lane's new list of kept starts or ends, the oldest joined past `limit` (as Layout). */
static PyObject *kept_list(Kept *k, int end, Py_ssize_t limit) {
    Py_ssize_t total = k->m + k->n, j = total > limit ? total - limit + 1 : 1;
    Py_ssize_t len = total ? total - j + 1 : 0;
    PyObject *l = PyList_New(len);
    if (!l || !len) return l;
    PyObject *first = kept_item(k, end, end ? j - 1 : 0);
    if (!first) { Py_DECREF(l); return NULL; }
    PyList_SetItem(l, 0, first);
    for (Py_ssize_t i = j; i < total; i++) {
        PyObject *x = kept_item(k, end, i);
        if (!x) { Py_DECREF(l); return NULL; }
        PyList_SetItem(l, i - j + 1, x);
    }
    return l;
}

static int kept_push(Kept *k, long long s, long long e) {
    if (k->n == k->cap) {
        Py_ssize_t cap = k->cap ? k->cap * 2 : 64;
        long long *ns = PyMem_Realloc(k->s, sizeof(long long) * (size_t)cap);
        if (!ns) { PyErr_NoMemory(); return -1; }
        k->s = ns;
        long long *ne = PyMem_Realloc(k->e, sizeof(long long) * (size_t)cap);
        if (!ne) { PyErr_NoMemory(); return -1; }
        k->e = ne;
        k->cap = cap;
    }
    k->s[k->n] = s;
    k->e[k->n] = e;
    k->n++;
    return 0;
}

PyDoc_STRVAR(nest_tracks_doc,
             "nest_tracks($module, lanes, tracks, starts, ends, limit, /)\n--\n\n"
             "Layout.place's one pass (chrome._nest_in_end_order) for every track of a piece at once, from\n"
             "the columns (array.array 'l', 'q', 'q'). When every track's spans come in the order they ended\n"
             "and nest, each track's lane 0 in `lanes` takes them and the tracks come back in first-seen\n"
             "order; else None, and `lanes` is unchanged.");

static PyObject *hot_nest_tracks(PyObject *self, PyObject *args) {
    PyObject *lanes, *tracks_a, *starts_a, *ends_a;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "O!OOOn", &PyDict_Type, &lanes, &tracks_a, &starts_a, &ends_a, &limit)) return NULL;
    if (limit < 1) { PyErr_SetString(PyExc_ValueError, "nest_tracks: limit must be positive"); return NULL; }
    Py_ssize_t n, n1, n2;
    PyObject *tb = array_bytes(tracks_a, sizeof(long), &n);
    PyObject *sb = tb ? array_bytes(starts_a, sizeof(long long), &n1) : NULL;
    PyObject *eb = sb ? array_bytes(ends_a, sizeof(long long), &n2) : NULL;
    PyObject *result = NULL, *order = NULL;
    Kept *kept = NULL;
    Py_ssize_t *first = NULL, nt = 0, *next = NULL, *head = NULL, *tail = NULL;
    long *tseen = NULL;
    if (!eb) goto done;
    if (n1 != n || n2 != n) { PyErr_SetString(PyExc_ValueError, "nest_tracks: columns of different lengths"); goto done; }
    const long *tr = (const long *)PyBytes_AsString(tb);
    const long long *st = (const long long *)PyBytes_AsString(sb);
    const long long *en = (const long long *)PyBytes_AsString(eb);
    long maxt = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (tr[i] < 0) { PyErr_SetString(PyExc_ValueError, "nest_tracks: a negative track"); goto done; }
        if (tr[i] > maxt) maxt = tr[i];
    }
    /* Rows of each track as a chain (next[i]), tracks in first-seen order. */
    first = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(maxt + 2));
    next = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n ? n : 1));
    head = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n ? n : 1));
    tail = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n ? n : 1));
    tseen = PyMem_Malloc(sizeof(long) * (size_t)(n ? n : 1));
    if (!first || !next || !head || !tail || !tseen) { PyErr_NoMemory(); goto done; }
    for (long t = 0; t <= maxt; t++) first[t] = -1; /* track -> its slot in seen order */
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t k = first[tr[i]];
        next[i] = -1;
        if (k < 0) {
            k = first[tr[i]] = nt++;
            tseen[k] = tr[i];
            head[k] = i;
        } else {
            next[tail[k]] = i;
        }
        tail[k] = i;
    }
    kept = PyMem_Calloc((size_t)(nt ? nt : 1), sizeof(Kept));
    if (!kept) { PyErr_NoMemory(); goto done; }
    int nested = 1;
    for (Py_ssize_t k = 0; k < nt && nested; k++) {
        Kept *kp = &kept[k];
        PyObject *key = PyLong_FromLong(tseen[k]);
        if (!key) goto done;
        PyObject *tl = PyDict_GetItemWithError(lanes, key); /* borrowed */
        Py_DECREF(key);
        if (!tl && PyErr_Occurred()) goto done;
        if (tl && PyList_Check(tl) && PyList_Size(tl) > 0) {
            PyObject *lane0 = PyList_GetItem(tl, 0);
            PyObject *ks = PyTuple_Check(lane0) && PyTuple_Size(lane0) == 2 ? PyTuple_GetItem(lane0, 0) : NULL;
            PyObject *ke = ks ? PyTuple_GetItem(lane0, 1) : NULL;
            if (!ke || !PyList_Check(ks) || !PyList_Check(ke) || PyList_Size(ks) != PyList_Size(ke)) {
                PyErr_SetString(PyExc_TypeError, "nest_tracks: a lane is not (starts, ends) lists");
                goto done;
            }
            kp->bs = Py_NewRef(ks);
            kp->be = Py_NewRef(ke);
            kp->m = PyList_Size(ks);
        } else if (tl && !PyList_Check(tl)) {
            PyErr_SetString(PyExc_TypeError, "nest_tracks: a track's lanes are not a list");
            goto done;
        }
        int have_last = kp->m + kp->n > 0;
        long long last = 0, top;
        if (have_last && kept_top(kp, 1, &last) < 0) goto done;
        for (Py_ssize_t i = head[k]; i >= 0; i = next[i]) {
            long long s = st[i], e = en[i];
            if (have_last && e < last) { nested = 0; break; }
            last = e;
            have_last = 1;
            while (kp->m + kp->n) {
                if (kept_top(kp, 0, &top) < 0) goto done;
                if (top < s) break;
                if (kp->n) kp->n--;
                else kp->m--;
            }
            if (kp->m + kp->n) {
                if (kept_top(kp, 1, &top) < 0) goto done;
                if (top > s) { nested = 0; break; }
            }
            if (kept_push(kp, s, e) < 0) goto done;
        }
    }
    if (!nested) { result = Py_NewRef(Py_None); goto done; }
    if (!(order = PyList_New(nt))) goto done;
    for (Py_ssize_t k = 0; k < nt; k++) {
        PyObject *key = PyLong_FromLong(tseen[k]);
        if (!key) goto done;
        PyList_SetItem(order, k, key); /* steals; borrowed below */
    }
    for (Py_ssize_t k = 0; k < nt; k++) { /* commit: nothing above changed `lanes` */
        PyObject *key = PyList_GetItem(order, k);
        PyObject *ks = kept_list(&kept[k], 0, limit), *ke = ks ? kept_list(&kept[k], 1, limit) : NULL;
        PyObject *lane0 = ke ? PyTuple_Pack(2, ks, ke) : NULL;
        Py_XDECREF(ks);
        Py_XDECREF(ke);
        if (!lane0) goto done;
        PyObject *tl = PyDict_GetItemWithError(lanes, key);
        int r;
        if (!tl) {
            if (PyErr_Occurred()) { Py_DECREF(lane0); goto done; }
            PyObject *l = PyList_New(1);
            if (!l) { Py_DECREF(lane0); goto done; }
            PyList_SetItem(l, 0, lane0); /* steals */
            r = PyDict_SetItem(lanes, key, l);
            Py_DECREF(l);
        } else if (PyList_Size(tl) == 0) {
            r = PyList_Append(tl, lane0);
            Py_DECREF(lane0);
        } else {
            r = PyList_SetItem(tl, 0, lane0); /* steals */
        }
        if (r < 0) goto done;
    }
    result = Py_NewRef(order);
done:
    if (kept)
        for (Py_ssize_t k = 0; k < nt; k++) {
            PyMem_Free(kept[k].s);
            PyMem_Free(kept[k].e);
            Py_XDECREF(kept[k].bs);
            Py_XDECREF(kept[k].be);
        }
    PyMem_Free(kept);
    PyMem_Free(first);
    PyMem_Free(next);
    PyMem_Free(head);
    PyMem_Free(tail);
    PyMem_Free(tseen);
    Py_XDECREF(order);
    Py_XDECREF(tb);
    Py_XDECREF(sb);
    Py_XDECREF(eb);
    return result;
}

/* Args JSON as the event loop writes it: `},{"ph"` (an event boundary to the line splitter) gets
 * the same newline the encoder's callers give it everywhere else. */
static int put_args(Buf *b, PyObject *a) {
    char *data;
    Py_ssize_t n;
    if (PyBytes_AsStringAndSize(a, &data, &n) < 0) return -1;
    static const char pat[] = "},{\"ph\"";
    const Py_ssize_t pn = (Py_ssize_t)sizeof(pat) - 1;
    Py_ssize_t from = 0;
    for (Py_ssize_t i = 0; i + pn <= n; i++) {
        if (data[i] == '}' && memcmp(data + i, pat, (size_t)pn) == 0) {
            if (buf_put(b, data + from, (size_t)(i + 2 - from)) < 0 || buf_put(b, "\n", 1) < 0) return -1;
            from = i + 2;
            i += pn - 1;
        }
    }
    return buf_put(b, data + from, (size_t)(n - from));
}

PyDoc_STRVAR(encode_rows_doc,
             "encode_rows($module, name_json, names, tracks, starts, ends, args, dump, track_info, pid, base, /)\n"
             "--\n\n"
             "The X events of one piece whose spans all lie on lane 0 of their track, from the columns\n"
             "(array.array 'l', 'l', 'q', 'q'; `args` a list): each event followed by `,\\n`. `track_info(t)`\n"
             "gives (tid, cat JSON) of each track, asked once per track in the order the tracks first\n"
             "appear; `dump(args)` gives an args dict's JSON.");

static PyObject *hot_encode_rows(PyObject *self, PyObject *args) {
    PyObject *name_json, *names_a, *tracks_a, *starts_a, *ends_a, *argl, *dump, *track_info;
    long long pid, base;
    if (!PyArg_ParseTuple(args, "O!OOOOO!OOLL", &PyList_Type, &name_json, &names_a, &tracks_a, &starts_a, &ends_a,
                          &PyList_Type, &argl, &dump, &track_info, &pid, &base))
        return NULL;
    Py_ssize_t n, n0, n1, n2;
    PyObject *nb = array_bytes(names_a, sizeof(long), &n0);
    PyObject *tb = nb ? array_bytes(tracks_a, sizeof(long), &n) : NULL;
    PyObject *sb = tb ? array_bytes(starts_a, sizeof(long long), &n1) : NULL;
    PyObject *eb = sb ? array_bytes(ends_a, sizeof(long long), &n2) : NULL;
    PyObject *result = NULL;
    Buf b = {NULL, 0, 0}, pre = {NULL, 0, 0}; /* pre: the start of the last event (its name and track) */
    long pre_name = -1, pre_track = -1;
    long long *tidv = NULL;
    PyObject **catv = NULL;
    long ntr = 0;
    if (!eb) goto done;
    if (n0 != n || n1 != n || n2 != n || PyList_Size(argl) != n) {
        PyErr_SetString(PyExc_ValueError, "encode_rows: columns of different lengths");
        goto done;
    }
    const long *nm = (const long *)PyBytes_AsString(nb);
    const long *tr = (const long *)PyBytes_AsString(tb);
    const long long *st = (const long long *)PyBytes_AsString(sb);
    const long long *en = (const long long *)PyBytes_AsString(eb);
    Py_ssize_t nnames = PyList_Size(name_json);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (tr[i] < 0) { PyErr_SetString(PyExc_ValueError, "encode_rows: a negative track"); goto done; }
        if (tr[i] >= ntr) ntr = tr[i] + 1;
    }
    tidv = PyMem_Malloc(sizeof(long long) * (size_t)(ntr ? ntr : 1));
    catv = PyMem_Calloc((size_t)(ntr ? ntr : 1), sizeof(PyObject *));
    if (!tidv || !catv) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) { /* each track's tid and cat, asked in first-seen order */
        if (catv[tr[i]]) continue;
        PyObject *t = PyLong_FromLong(tr[i]);
        PyObject *info = t ? PyObject_CallFunctionObjArgs(track_info, t, NULL) : NULL;
        Py_XDECREF(t);
        if (!info) goto done;
        if (!PyTuple_Check(info) || PyTuple_Size(info) != 2 || !PyBytes_Check(PyTuple_GetItem(info, 1))) {
            Py_DECREF(info);
            PyErr_SetString(PyExc_TypeError, "encode_rows: track_info must give (tid, cat bytes)");
            goto done;
        }
        tidv[tr[i]] = PyLong_AsLongLong(PyTuple_GetItem(info, 0));
        catv[tr[i]] = Py_NewRef(PyTuple_GetItem(info, 1));
        Py_DECREF(info);
        if (tidv[tr[i]] == -1 && PyErr_Occurred()) goto done;
    }
    if (buf_reserve(&b, (size_t)n * 96) < 0) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long ts = st[i] - base, dur = en[i] - st[i];
        if (ts < 0 || dur < 0) {
            PyErr_SetString(PyExc_ValueError, "a span starts before the trace's base or ends before it starts");
            goto done;
        }
        if (nm[i] < 0 || nm[i] >= nnames) {
            PyErr_SetString(PyExc_ValueError, "encode_rows: a name index out of range");
            goto done;
        }
        if (nm[i] != pre_name || tr[i] != pre_track) { /* the event's start, made once a run */
            char *cat, *name;
            Py_ssize_t catn, namen;
            if (PyBytes_AsStringAndSize(catv[tr[i]], &cat, &catn) < 0 ||
                PyBytes_AsStringAndSize(PyList_GetItem(name_json, nm[i]), &name, &namen) < 0)
                goto done;
            /* the literals (45 bytes), two numbers (at most 24 bytes each), the cat and the name */
            Buf p = {NULL, 0, 0};
            if (buf_reserve(&p, 100 + (size_t)catn + (size_t)namen) < 0) goto done;
            RAW_LIT(&p, "{\"ph\":\"X\",\"cat\":");
            raw_put(&p, cat, (size_t)catn);
            RAW_LIT(&p, ",\"name\":");
            raw_put(&p, name, (size_t)namen);
            RAW_LIT(&p, ",\"pid\":");
            raw_u(&p, (unsigned long long)pid);
            RAW_LIT(&p, ",\"tid\":");
            raw_u(&p, (unsigned long long)tidv[tr[i]]);
            RAW_LIT(&p, ",\"ts\":");
            PyMem_Free(pre.p);
            pre = p;
            pre_name = nm[i];
            pre_track = tr[i];
        }
        /* the start, two numbers (at most 24 bytes each) and the literals after them */
        if (buf_reserve(&b, pre.len + 80) < 0) goto done;
        raw_put(&b, pre.p, pre.len);
        raw_us(&b, (unsigned long long)ts);
        RAW_LIT(&b, ",\"dur\":");
        raw_us(&b, (unsigned long long)dur);
        PyObject *a = PyList_GetItem(argl, i);
        int truthy = a == Py_None ? 0 : PyObject_IsTrue(a);
        if (truthy < 0) goto done;
        if (truthy) {
            PyObject *j = PyObject_CallFunctionObjArgs(dump, a, NULL);
            if (!j) goto done;
            int r = PUT_LIT(&b, ",\"args\":") < 0 || put_args(&b, j) < 0;
            Py_DECREF(j);
            if (r) goto done;
        }
        if (PUT_LIT(&b, "},\n") < 0) goto done;
    }
    result = PyBytes_FromStringAndSize(b.p ? b.p : "", (Py_ssize_t)b.len);
done:
    PyMem_Free(b.p);
    PyMem_Free(pre.p);
    PyMem_Free(tidv);
    if (catv)
        for (long t = 0; t < ntr; t++) Py_XDECREF(catv[t]);
    PyMem_Free(catv);
    Py_XDECREF(nb);
    Py_XDECREF(tb);
    Py_XDECREF(sb);
    Py_XDECREF(eb);
    return result;
}

static const void *column_items(PyObject *col, Py_ssize_t *n, PyObject **keep);

PyDoc_STRVAR(column_range_doc,
             "column_range(column, /)\n--\n\n"
             "(least, largest) of an array('q') column, or None when it is empty: min() and max() of it\n"
             "without a Python int per item.");
static PyObject *hot_column_range(PyObject *self, PyObject *col) {
    Py_ssize_t n;
    PyObject *b;
    const long long *v = column_items(col, &n, &b);
    if (!v) return NULL;
    if (n == 0) { Py_XDECREF(b); Py_RETURN_NONE; }
    long long lo = v[0], hi = v[0];
    for (Py_ssize_t i = 1; i < n; i++) {
        if (v[i] < lo) lo = v[i];
        if (v[i] > hi) hi = v[i];
    }
    Py_XDECREF(b);
    return Py_BuildValue("(LL)", lo, hi);
}

/* ---- per-rank digests: the per-span loops of digest.Builder ------------------------------------ */

/* A column's items where they lie: an array.array of 8-byte signed integers ('q', or 'l' where a
 * long is 8 bytes) is read through its own buffer (array.buffer_info()), valid while no Python
 * code runs, which the loops that use this never do; anything else is copied. *keep: the copy to
 * release, or NULL. Copying 100k spans' columns (3 MB, fresh pages) cost as much as the loop. */
static PyObject *s_buffer_info, *s_typecode;

static const void *column_items(PyObject *col, Py_ssize_t *n, PyObject **keep) {
    *keep = NULL;
    PyObject *tc = PyObject_GetAttr(col, s_typecode);
    int ok = 0;
    if (tc && PyUnicode_Check(tc)) {
        ok = PyUnicode_CompareWithASCIIString(tc, "q") == 0 ||
             (sizeof(long) == 8 && PyUnicode_CompareWithASCIIString(tc, "l") == 0);
    }
    Py_XDECREF(tc);
    if (ok) {
        PyObject *info = PyObject_CallMethodObjArgs(col, s_buffer_info, NULL);
        if (info && PyTuple_Check(info) && PyTuple_Size(info) == 2) {
            void *p = PyLong_AsVoidPtr(PyTuple_GetItem(info, 0));
            Py_ssize_t len = PyLong_AsSsize_t(PyTuple_GetItem(info, 1));
            Py_DECREF(info);
            if (!PyErr_Occurred() && len >= 0) {
                *n = len;
                return len ? p : (const void *)"";
            }
        } else {
            Py_XDECREF(info);
        }
    }
    PyErr_Clear();
    PyObject *b = array_bytes(col, 8, n);
    if (!b) return NULL;
    *keep = b;
    return PyBytes_AsString(b);
}

/* int64 -> index, open addressing (the (name, warm-up bucket) keys and histogram cells of one
 * chunk: few, whatever the chunk's length). */
typedef struct {
    long long *keys;
    Py_ssize_t *vals;
    Py_ssize_t cap, used;
} I64Map;

static int map_init(I64Map *m, Py_ssize_t cap) {
    m->cap = cap;
    m->used = 0;
    m->keys = PyMem_Malloc(sizeof(long long) * (size_t)cap);
    m->vals = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)cap);
    if (!m->keys || !m->vals) { PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < cap; i++) m->vals[i] = -1;
    return 0;
}

static void map_free(I64Map *m) {
    PyMem_Free(m->keys);
    PyMem_Free(m->vals);
    m->keys = NULL;
    m->vals = NULL;
}

static Py_ssize_t map_slot(const I64Map *m, long long key) {
    unsigned long long h = (unsigned long long)key * 0x9E3779B97F4A7C15ull;
    Py_ssize_t i = (Py_ssize_t)(h >> 20) & (m->cap - 1);
    while (m->vals[i] >= 0 && m->keys[i] != key) i = (i + 1) & (m->cap - 1);
    return i;
}

/* The index of `key`, given `next` (the number of keys so far) when it is new; -1 on error. */
static Py_ssize_t map_index(I64Map *m, long long key, Py_ssize_t next) {
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

/* Columns as C arrays of 8-byte integers: names and tracks are array("l"), starts and ends
 * array("q"), all n long (where a long is 4 bytes the C loops step aside: see cols_read). */
typedef struct {
    PyObject *b[4]; /* owned copies, or NULL where read in place */
    const long long *name, *track;
    const long long *start, *end;
    Py_ssize_t n;
} Cols;

static void cols_free(Cols *c) {
    for (int i = 0; i < 4; i++) Py_CLEAR(c->b[i]);
}

static int cols_read(Cols *c, PyObject *names, PyObject *tracks, PyObject *starts, PyObject *ends) {
    PyObject *src[4] = {names, tracks, starts, ends};
    const void *p[4];
    Py_ssize_t n[4];
    memset(c->b, 0, sizeof(c->b));
    if (sizeof(long) != 8) {
        PyErr_SetString(PyExc_TypeError, "digest: the C loops need 8-byte longs");
        return -1;
    }
    for (int i = 0; i < 4; i++)
        if (!(p[i] = column_items(src[i], &n[i], &c->b[i]))) return -1;
    if (n[1] != n[0] || n[2] != n[0] || n[3] != n[0]) {
        PyErr_SetString(PyExc_ValueError, "digest: columns of different lengths");
        return -1;
    }
    c->n = n[0];
    c->name = (const long long *)p[0];
    c->track = (const long long *)p[1];
    c->start = (const long long *)p[2];
    c->end = (const long long *)p[3];
    return 0;
}

static PyObject *list_ll(const long long *v, Py_ssize_t n) {
    PyObject *l = PyList_New(n);
    if (!l) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyLong_FromLongLong(v[i]);
        if (!x) { Py_DECREF(l); return NULL; }
        PyList_SetItem(l, i, x);
    }
    return l;
}

/* bisect.bisect_right(a[0:n], x) */
static Py_ssize_t bisect_right_ll(const long long *a, Py_ssize_t n, long long x) {
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (x < a[mid]) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

/* min(bisect_right(bound, d), n - 1) for digest.py's histogram bounds (bound[16 o] = 2^o): the
 * octave from the highest set bit, then 4 steps within it, not 10 over all of them. */
static Py_ssize_t hist_slot(const long long *bound, Py_ssize_t n, long long d) {
    Py_ssize_t r;
#if defined(__GNUC__) || defined(__clang__)
    if (d > 0) {
        Py_ssize_t o = 63 - __builtin_clzll((unsigned long long)d), lo = 16 * o, hi = lo + 16;
        if (hi < n && bound[lo] <= d && d < bound[hi]) {
            lo++; /* bisect_right lies in (16 o, 16 o + 16] */
            while (lo < hi) {
                Py_ssize_t mid = (lo + hi) / 2;
                if (d < bound[mid]) hi = mid;
                else lo = mid + 1;
            }
            return lo < n - 1 ? lo : n - 1;
        }
    }
#endif
    r = bisect_right_ll(bound, n, d);
    return r < n - 1 ? r : n - 1;
}

PyDoc_STRVAR(digest_rows_doc,
             "digest_rows(names, tracks, starts, ends, row_mask, /)\n--\n\n"
             "digest._rows_py: (indices of the spans whose name id is set in row_mask, leaving out other\n"
             "tools' (track < 0) and inverted ones, the number of inverted spans of the rank's own tracks,\n"
             "the number of other tools' spans).");
static PyObject *hot_digest_rows(PyObject *self, PyObject *args) {
    PyObject *names, *tracks, *starts, *ends;
    const char *mask;
    Py_ssize_t nmask;
    if (!PyArg_ParseTuple(args, "OOOOy#", &names, &tracks, &starts, &ends, &mask, &nmask)) return NULL;
    Cols c;
    PyObject *rows = NULL, *result = NULL;
    if (cols_read(&c, names, tracks, starts, ends) < 0 || !(rows = PyList_New(0))) goto out;
    long long negative = 0, foreign = 0;
    for (Py_ssize_t i = 0; i < c.n; i++) {
        if (c.track[i] < 0) { foreign++; continue; }
        if (c.end[i] < c.start[i]) { negative++; continue; }
        long k = c.name[i];
        if (k >= 0 && k < nmask && mask[k]) {
            PyObject *v = PyLong_FromSsize_t(i);
            if (!v || PyList_Append(rows, v) < 0) { Py_XDECREF(v); goto out; }
            Py_DECREF(v);
        }
    }
    result = Py_BuildValue("(OLL)", rows, negative, foreign);
out:
    Py_XDECREF(rows);
    cols_free(&c);
    return result;
}

PyDoc_STRVAR(digest_fold_doc,
             "digest_fold(names, tracks, starts, ends, skip, step_starts, bucket, nb, bounds, /)\n--\n\n"
             "digest._fold_py: the spans' aggregates per key name * nb + warm-up bucket, leaving out those\n"
             "set in `skip` (bytes, or None), other tools' and inverted ones. The bucket is `bucket`, or where\n"
             "bucket < 0 min(bisect_right(step_starts, start), nb - 1). Returns (keys, counts, totals, least,\n"
             "longest, longest's start, longest's track, histogram key index, histogram bucket, count), keys\n"
             "and cells in the order first met; the histogram bucket of d is min(bisect_right(bounds, d),\n"
             "len(bounds) - 1) - 1. NotImplemented where a total would pass 2^63.");
static PyObject *hot_digest_fold(PyObject *self, PyObject *args) {
    PyObject *names, *tracks, *starts, *ends, *skipo, *steps, *boundso;
    long bucket, nb;
    if (!PyArg_ParseTuple(args, "OOOOOOllO", &names, &tracks, &starts, &ends, &skipo, &steps, &bucket, &nb, &boundso))
        return NULL;
    Cols c;
    PyObject *sb = NULL, *bb = NULL, *result = NULL;
    I64Map keys = {0}, cells = {0};
    long long *agg = NULL, *cell_key = NULL; /* agg: 6 per key; cells: key and count */
    Py_ssize_t nkeys = 0, ncells = 0, cap_keys = 16, cap_cells = 64, nsteps, nbounds;
    const char *skip = NULL;
    if (cols_read(&c, names, tracks, starts, ends) < 0) goto out;
    if (skipo != Py_None) {
        if (!PyBytes_Check(skipo) || PyBytes_Size(skipo) != c.n) {
            PyErr_SetString(PyExc_TypeError, "digest_fold: skip is not bytes of the columns' length");
            goto out;
        }
        skip = PyBytes_AsString(skipo);
    }
    if (nb < 1 || !(sb = array_bytes(steps, sizeof(long long), &nsteps)) ||
        !(bb = array_bytes(boundso, sizeof(long long), &nbounds)) || nbounds < 2 || nbounds > 1000) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "digest_fold: bad buckets");
        goto out;
    }
    const long long *step = (const long long *)PyBytes_AsString(sb), *bound = (const long long *)PyBytes_AsString(bb);
    if (map_init(&keys, 64) < 0 || map_init(&cells, 256) < 0) goto out;
    agg = PyMem_Malloc(sizeof(long long) * 6 * (size_t)cap_keys);
    cell_key = PyMem_Malloc(sizeof(long long) * 2 * (size_t)cap_cells);
    if (!agg || !cell_key) { PyErr_NoMemory(); goto out; }
    long long last_key = -1, last_ck = -1;
    Py_ssize_t last = -1, last_cell = -1;
    for (Py_ssize_t i = 0; i < c.n; i++) {
        if ((skip && skip[i]) || c.track[i] < 0) continue;
        long long st = c.start[i], en = c.end[i];
        if (en < st) continue;
        if (st < 0 && en > LLONG_MAX + st) { /* end - start past 2^63: Python's ints take it */
            result = Py_NewRef(Py_NotImplemented);
            goto out;
        }
        long long d = en - st;
        long b = bucket >= 0 ? bucket : (long)bisect_right_ll(step, nsteps, st);
        if (b > nb - 1) b = nb - 1;
        long long key = (long long)c.name[i] * nb + b;
        Py_ssize_t k;
        if (last >= 0 && key == last_key) {
            k = last;
        } else {
            k = map_index(&keys, key, nkeys);
            if (k < 0) goto out;
            if (k == nkeys) { /* a new key */
                if (nkeys == cap_keys) {
                    long long *g = PyMem_Realloc(agg, sizeof(long long) * 12 * (size_t)cap_keys);
                    if (!g) { PyErr_NoMemory(); goto out; }
                    agg = g;
                    cap_keys *= 2;
                }
                long long *a = agg + 6 * k;
                a[0] = key; a[1] = 0; a[2] = 0; a[3] = d; a[4] = -1; a[5] = 0;
                nkeys++;
            }
            last_key = key;
            last = k;
        }
        long long *a = agg + 6 * k; /* key, count, total, least, longest, (index of the longest) */
        a[1]++;
        if (d > LLONG_MAX - a[2]) { /* a total past 2^63 ns (both >= 0): Python's ints take it */
            result = Py_NewRef(Py_NotImplemented);
            goto out;
        }
        a[2] += d;
        if (d < a[3]) a[3] = d;
        if (d > a[4]) { a[4] = d; a[5] = i; } /* the first of the longest, in the order given */
        Py_ssize_t hb = hist_slot(bound, nbounds, d);
        long long ck = (long long)k * 1024 + hb; /* hb - 1 is the histogram bucket, -1 .. 998 */
        Py_ssize_t j;
        if (last_cell >= 0 && ck == last_ck) {
            j = last_cell; /* spans of one name and like durations come in runs */
        } else {
            j = map_index(&cells, ck, ncells);
            if (j < 0) goto out;
            last_ck = ck;
            last_cell = j;
        }
        if (j == ncells) {
            if (ncells == cap_cells) {
                long long *g = PyMem_Realloc(cell_key, sizeof(long long) * 4 * (size_t)cap_cells);
                if (!g) { PyErr_NoMemory(); goto out; }
                cell_key = g;
                cap_cells *= 2;
            }
            cell_key[2 * j] = ck;
            cell_key[2 * j + 1] = 0;
            ncells++;
        }
        cell_key[2 * j + 1]++;
    }
    {
        long long *col = PyMem_Malloc(sizeof(long long) * (size_t)(7 * (nkeys ? nkeys : 1) + 3 * (ncells ? ncells : 1)));
        if (!col) { PyErr_NoMemory(); goto out; }
        long long *kk = col, *cn = kk + nkeys, *tot = cn + nkeys, *lo = tot + nkeys, *hi = lo + nkeys,
                  *hs = hi + nkeys, *ht = hs + nkeys, *ck = ht + nkeys, *cb = ck + ncells, *cc = cb + ncells;
        for (Py_ssize_t k = 0; k < nkeys; k++) {
            long long *a = agg + 6 * k;
            kk[k] = a[0]; cn[k] = a[1]; tot[k] = a[2]; lo[k] = a[3]; hi[k] = a[4];
            hs[k] = c.start[a[5]];
            ht[k] = c.track[a[5]];
        }
        for (Py_ssize_t j = 0; j < ncells; j++) {
            ck[j] = cell_key[2 * j] / 1024;
            cb[j] = cell_key[2 * j] % 1024 - 1;
            cc[j] = cell_key[2 * j + 1];
        }
        PyObject *parts[10] = {NULL};
        const long long *srcs[10] = {kk, cn, tot, lo, hi, hs, ht, ck, cb, cc};
        int ok = 1;
        for (int p = 0; p < 10 && ok; p++) ok = (parts[p] = list_ll(srcs[p], p < 7 ? nkeys : ncells)) != NULL;
        if (ok) result = PyTuple_New(10);
        for (int p = 0; p < 10; p++) {
            if (result) PyTuple_SetItem(result, p, parts[p]);
            else Py_XDECREF(parts[p]);
        }
        PyMem_Free(col);
    }
out:
    cols_free(&c);
    Py_XDECREF(sb);
    Py_XDECREF(bb);
    map_free(&keys);
    map_free(&cells);
    PyMem_Free(agg);
    PyMem_Free(cell_key);
    return result;
}

/* ---- resolving closed spans into a store's columns ---------------------------------------- */

/* The same logic as resolve.resolve (the reference, which also serves every case this does not):
 * one loop over the closed spans, the rows packed into the store's arrays with one call per
 * column. Device spans are located and mapped through their DeviceTimeline's own methods, so
 * every device (torch's, or a test double) is measured exactly as the Python twin measures it. */

static PyObject *s_index, *s_names, *s_name_index, *s_last_id, *s_capacity, *s_dropped, *s_child_extent,
    *s_locate, *s_to_host_ns, *s_elapsed_attr, *s_anchors, *s_segment_ms, *s_host_ns, *s_event_attr, *s_query, *s_add_ns, *s_error, *s_frombytes, *s_args_attr, *s_cols[4];

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
    return PyObject_CallMethodObjArgs(tl, s_locate, event, first, NULL);
}

static int to_host(PyObject *tl, PyObject *kd, long long *out) {
    PyObject *r = PyObject_CallMethodObjArgs(tl, s_to_host_ns, PyTuple_GetItem(kd, 0), PyTuple_GetItem(kd, 1), NULL);
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

/* The CUDA runtime's own cudaEventElapsedTime and cudaGetLastError, called on the events' raw
 * handles (`event.cuda_event`): torch's Event.elapsed_time asks both events whether they ran and
 * sets the device around the same call, ~3 us a call through the H200 VM's gVisor against
 * ~0.5 us for the call itself. Set by cuda.py from the runtime torch loaded (set_raw_elapsed);
 * used only for timelines whose `_elapsed` is `g_raw_for` (torch's method), so test doubles and
 * other devices keep their own. Any failure (an event never recorded, one not yet run, another
 * context) clears the runtime's error, which torch would otherwise report at its next kernel
 * launch, and asks torch's method instead, which raises what it raises. */
typedef int (*raw_elapsed_fn)(float *ms, void *start, void *end);
typedef int (*raw_clear_fn)(void);
typedef int (*raw_device_fn)(int *device);
static raw_elapsed_fn g_raw_elapsed;
static raw_clear_fn g_raw_clear;
static raw_device_fn g_raw_device; /* cudaGetDevice: the raw call only where the thread's device is the events' */
static PyObject *g_raw_for; /* the Python elapsed callable the raw call stands in for */
static PyObject *s_cuda_event;

/* An event's raw handle, or NULL (no handle: ask Python). Never leaves an exception set. */
static void *raw_handle(PyObject *ev) {
    PyObject *h = PyObject_GetAttr(ev, s_cuda_event);
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
    if (g_raw_elapsed(&v, ha, hb) != 0) {
        if (g_raw_clear) (void)g_raw_clear();
        return 0;
    }
    *ms = (double)v; /* what torch returns: the runtime's float32, widened */
    return 1;
}

PyDoc_STRVAR(set_raw_elapsed_doc,
             "set_raw_elapsed(elapsed_ptr, clear_ptr, device_ptr, stands_for, /)\n--\n\n"
             "Use the C functions at these addresses (cudaEventElapsedTime, cudaGetLastError, cudaGetDevice)\n"
             "on the raw handles of events whose timeline measures with `stands_for`, where the calling\n"
             "thread's device is the events' (elsewhere the runtime could make a context on another\n"
             "device: torch's call sets the device around it); 0 turns it off.");
static PyObject *hot_set_raw_elapsed(PyObject *self, PyObject *args) {
    PyObject *fn, *clear, *dev, *for_;
    if (!PyArg_ParseTuple(args, "OOOO", &fn, &clear, &dev, &for_)) return NULL;
    void *pf = PyLong_AsVoidPtr(fn), *pc = PyLong_AsVoidPtr(clear), *pd = PyLong_AsVoidPtr(dev);
    if (PyErr_Occurred()) return NULL;
    if (pf && (!pc || !pd)) {
        PyErr_SetString(PyExc_ValueError, "set_raw_elapsed: the elapsed call needs the error and device calls");
        return NULL;
    }
    g_raw_elapsed = (raw_elapsed_fn)pf;
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
} Timeline;

static void timeline_clear(Timeline *t) {
    Py_CLEAR(t->elapsed);
    Py_CLEAR(t->anchors);
    Py_CLEAR(t->segs);
}

static int timeline_read(Timeline *t, PyObject *tl) {
    timeline_clear(t);
    if (!(t->elapsed = PyObject_GetAttr(tl, s_elapsed_attr)) || !(t->anchors = PyObject_GetAttr(tl, s_anchors)) ||
        !(t->segs = PyObject_GetAttr(tl, s_segment_ms)))
        return -1;
    t->raw = g_raw_elapsed != NULL && t->elapsed == g_raw_for;
    if (!PyList_Check(t->anchors) || !PyList_Check(t->segs) || PyList_Size(t->segs) != PyList_Size(t->anchors)) {
        PyErr_SetString(PyExc_TypeError, "resolve: a timeline's anchors and segments are not lists of one length");
        return -1;
    }
    return 0;
}

static int anchor_host_ns(Timeline *t, Py_ssize_t k, long long *out) {
    PyObject *v = PyObject_GetAttr(PyList_GetItem(t->anchors, k), s_host_ns);
    if (!v) return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* DeviceTimeline.locate: 0 with *k (-1: after the newest anchor) and *d; 1: an answer that is not a
 * float (the timeline's methods take the span); -1 on error. */
static int timeline_locate(Timeline *t, PyObject *event, Py_ssize_t first, Py_ssize_t *k, double *d) {
    Py_ssize_t n = PyList_Size(t->anchors);
    for (Py_ssize_t i = first > 0 ? first : 0; i < n; i++) {
        PyObject *ref = PyObject_GetAttr(PyList_GetItem(t->anchors, i), s_event_attr);
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
        if (!PyObject_TypeCheck(o, SpanType)) return 1;
        Span *s = (Span *)o;
        if (!s->name || !s->stack || s->stack == Py_None || !(s->t0 || s->ns0) || !(s->t1 || s->ns1)) return 1;
        if (s->parent && s->parent != Py_None && !PyObject_TypeCheck(s->parent, SpanType)) return 1;
        if (s->stack != last_stack) {
            PyObject *track = PyObject_GetAttr(s->stack, s_track);
            if (!track) return -1;
            PyObject *idx = PyObject_GetAttr(track, s_index);
            PyObject *dev = idx ? PyObject_GetAttr(track, s_device) : NULL;
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
        if (dv < 0 && !(span_on_host(s) && (s->ns1 || PyLong_CheckExact(s->t1)))) return 1;
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
            PyObject *q = PyObject_CallMethodObjArgs(((Span *)PyList_GetItem(pending, idx[mid]))->t1, s_query, NULL);
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
             "resolve($module, done, offset, store, timelines, pools, rounding_ns, timeline_type, /)\n--\n\n"
             "resolve.resolve for spans of this module's Span type: append every span of `done` to\n"
             "`store` and return those that wait for a newer anchor. NotImplemented (nothing done)\n"
             "when a span is of another type: the Python twin resolves those.");

typedef struct {
    long long start, end;
    long track;
} Row;

static PyObject *hot_resolve(PyObject *self, PyObject *args) {
    PyObject *done, *store, *timelines, *pools, *timeline_type;
    long long offset, rounding;
    if (!PyArg_ParseTuple(args, "O!LOOOLO", &PyList_Type, &done, &offset, &store, &timelines, &pools, &rounding,
                          &timeline_type))
        return NULL;
    Timeline tlc = {NULL, NULL, NULL};
    int tl_native = 0;
    Py_ssize_t n = PyList_Size(done);
    /* Per span: its track index and device (-1: a host track), read once per stack. The check
     * pass changes nothing, so a span this loop cannot take leaves everything to the twin. */
    long *track_of = PyMem_Malloc(sizeof(long) * (size_t)(n ? n : 1));
    Py_ssize_t *dev_of = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n ? n : 1));
    Row *rows = PyMem_Malloc(sizeof(Row) * (size_t)(n ? n : 1));
    PyObject **names = PyMem_Calloc((size_t)(n ? n : 1), sizeof(PyObject *));
    PyObject **argv = PyMem_Calloc((size_t)(n ? n : 1), sizeof(PyObject *)); /* each row's args, owned */
    PyObject *later = NULL, *extent = NULL, *result = NULL;
    PyObject *last_tl = NULL, *last_pool = NULL; /* owned */
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
    if (!(later = PyList_New(0))) goto done_;
    if (!(extent = PyObject_GetAttr(store, s_child_extent))) goto done_;
    if (!PyDict_Check(extent)) { PyErr_SetString(PyExc_TypeError, "resolve: child_extent is not a dict"); goto done_; }
    {
        PyObject *v = PyObject_GetAttr(store, s_last_id);
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
        long long start, end;
        if (dv < 0) {
            if (span_host_times(s, &start, &end) != 0) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "resolve: a host span's times are not ints");
                goto done_;
            }
            start += offset;
            end += offset;
        } else {
            if (dv != last_tl_dev) {
                Py_CLEAR(last_tl);
                Py_CLEAR(last_pool);
                if (!(last_tl = PySequence_GetItem(timelines, dv)) || !(last_pool = PySequence_GetItem(pools, dv)))
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
            if (PyList_Append(last_pool, s->t0) < 0 || PyList_Append(last_pool, s->t1) < 0) goto done_;
            PyObject *zero = PyLong_FromLong(0);
            if (!zero) goto done_;
            SETREF(s->t0, Py_NewRef(zero));
            SETREF(s->t1, zero); /* the events are the pool's again */
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
        row->track = track_of[i];
        names[nrows] = Py_NewRef(s->name);
        nrows++;
        if (s->owner && s->owner != Py_None) {
            PyObject *d = PyLong_FromLongLong(end - start);
            if (!d) goto done_;
            PyObject *r = PyObject_CallMethodObjArgs(s->owner, s_add_ns, d, NULL);
            Py_DECREF(d);
            if (!r) goto done_;
            Py_DECREF(r);
        }
    }
    {
        /* Past the store's capacity rows are counted, not kept (as SpanStore.extend). */
        Py_ssize_t capacity = attr_ssize(store, s_capacity);
        if (capacity == -1 && PyErr_Occurred()) goto done_;
        PyObject *starts = PyObject_GetAttr(store, s_cols[2]);
        if (!starts) goto done_;
        Py_ssize_t have = PyObject_Size(starts);
        Py_DECREF(starts);
        if (have < 0) goto done_;
        Py_ssize_t room = capacity - have > 0 ? capacity - have : 0;
        Py_ssize_t keep = nrows < room ? nrows : room;
        if (nrows > keep) {
            Py_ssize_t dropped = attr_ssize(store, s_dropped);
            if (dropped == -1 && PyErr_Occurred()) goto done_;
            PyObject *v = PyLong_FromSsize_t(dropped + nrows - keep);
            if (!v) goto done_;
            int r = PyObject_SetAttr(store, s_dropped, v);
            Py_DECREF(v);
            if (r < 0) goto done_;
        }
        PyObject *index = PyObject_GetAttr(store, s_name_index);
        PyObject *namelist = index ? PyObject_GetAttr(store, s_names) : NULL;
        if (!namelist) { Py_XDECREF(index); goto done_; }
        long *cn = PyMem_Malloc(sizeof(long) * 2 * (size_t)(keep ? keep : 1));
        long long *cq = PyMem_Malloc(sizeof(long long) * 2 * (size_t)(keep ? keep : 1));
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
        }
        Py_DECREF(index);
        Py_DECREF(namelist);
        if (!bad) {
            bad = column_extend(store, s_cols[0], cn, sizeof(long), keep) < 0 ||
                  column_extend(store, s_cols[1], cn + keep, sizeof(long), keep) < 0 ||
                  column_extend(store, s_cols[2], cq, sizeof(long long), keep) < 0 ||
                  column_extend(store, s_cols[3], cq + keep, sizeof(long long), keep) < 0;
        }
        PyMem_Free(cn);
        PyMem_Free(cq);
        if (bad) goto done_;
        if (keep) {
            PyObject *sargs = PyObject_GetAttr(store, s_args_attr);
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
    result = Py_NewRef(later);
    goto done_;
not_mine:
    result = Py_NewRef(Py_NotImplemented);
done_:
    if (have_last_id) {
        /* Always written back: ids given before an error stay given. */
        PyObject *exc_type, *exc_value, *exc_tb;
        PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
        PyObject *v = PyLong_FromLongLong(last_id);
        if (!v || PyObject_SetAttr(store, s_last_id, v) < 0) Py_CLEAR(result);
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
    Py_XDECREF(last_pool);
    timeline_clear(&tlc);
    Py_XDECREF(later);
    if (argv)
        for (Py_ssize_t j = 0; j < n; j++) Py_XDECREF(argv[j]);
    PyMem_Free(argv);
    Py_XDECREF(extent);
    return result;
}

/* ---- writing behind: a thread of its own writes buffers to a file ------------------------- */

/* Saving a trace encodes it (holding the GIL) and writes it (the kernel's copy into the page
 * cache: as long again on the machines measured). A Writer's thread writes each buffer while
 * the next one is encoded, with no Python in it: it never takes the GIL, so it never waits for
 * the encoder to let go of it. The buffers are bytes objects the Writer keeps referenced until
 * its owner, holding the GIL, has seen them written. */
typedef struct WItem {
    PyObject *keep; /* the bytes; released under the GIL */
    const char *p;
    Py_ssize_t n;
    struct WItem *next;
} WItem;

typedef struct {
    PyObject_HEAD
    int fd, started, closing, err; /* err: the errno of the first failed write */
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    WItem *head, *tail, *done; /* to write (in order); written, to release */
    Py_ssize_t queued, limit;  /* bytes not yet written; at most this many wait */
} Writer;

static PyTypeObject *WriterType;

static void *writer_main(void *arg) {
    Writer *w = (Writer *)arg;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (!w->head && !w->closing) pthread_cond_wait(&w->cv, &w->mu);
        WItem *it = w->head;
        if (!it) break;
        int failed = w->err;
        pthread_mutex_unlock(&w->mu);
        const char *p = it->p;
        Py_ssize_t left = it->n;
        while (!failed && left > 0) {
            ssize_t k = write(w->fd, p, (size_t)left);
            if (k < 0 && errno == EINTR) continue;
            if (k <= 0) failed = k < 0 ? errno : EIO;
            else { p += k; left -= k; }
        }
        pthread_mutex_lock(&w->mu);
        if (failed && !w->err) w->err = failed;
        w->head = it->next;
        if (!w->head) w->tail = NULL;
        it->next = w->done;
        w->done = it;
        w->queued -= it->n;
        pthread_cond_broadcast(&w->cv);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

/* Release the written buffers (the GIL held, the lock not). */
static void writer_release(Writer *w) {
    pthread_mutex_lock(&w->mu);
    WItem *it = w->done;
    w->done = NULL;
    pthread_mutex_unlock(&w->mu);
    while (it) {
        WItem *next = it->next;
        Py_DECREF(it->keep);
        PyMem_Free(it);
        it = next;
    }
}

/* Wait, without the GIL, until at most `most` bytes wait to be written. */
static void writer_wait(Writer *w, Py_ssize_t most) {
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&w->mu);
    while (w->queued > most) pthread_cond_wait(&w->cv, &w->mu);
    pthread_mutex_unlock(&w->mu);
    Py_END_ALLOW_THREADS
    writer_release(w);
}

static int writer_error(Writer *w) {
    pthread_mutex_lock(&w->mu);
    int e = w->err;
    pthread_mutex_unlock(&w->mu);
    if (e) {
        errno = e;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

static void writer_stop(Writer *w) {
    if (!w->started) return;
    pthread_mutex_lock(&w->mu);
    w->closing = 1;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    Py_BEGIN_ALLOW_THREADS
    pthread_join(w->thread, NULL);
    Py_END_ALLOW_THREADS
    w->started = 0;
    writer_release(w);
}

static PyObject *Writer_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"fd", "limit", NULL};
    int fd;
    Py_ssize_t limit = 4 << 20;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "i|n", kwlist, &fd, &limit)) return NULL;
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    Writer *w = (Writer *)alloc(type, 0);
    if (!w) return NULL;
    w->fd = fd;
    w->limit = limit > 0 ? limit : 1;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    int e = pthread_create(&w->thread, NULL, writer_main, w);
    if (e) {
        Py_DECREF(w);
        errno = e;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    w->started = 1;
    return (PyObject *)w;
}

static PyObject *Writer_write(Writer *w, PyObject *data) {
    char *p;
    Py_ssize_t n;
    if (!w->started) {
        PyErr_SetString(PyExc_ValueError, "write() on a closed Writer");
        return NULL;
    }
    if (!PyBytes_Check(data)) {
        PyErr_SetString(PyExc_TypeError, "Writer.write() takes bytes");
        return NULL;
    }
    writer_release(w);
    if (writer_error(w) < 0) return NULL;
    if (PyBytes_AsStringAndSize(data, &p, &n) < 0) return NULL;
    if (n == 0) Py_RETURN_NONE;
    WItem *it = PyMem_Malloc(sizeof(WItem));
    if (!it) return PyErr_NoMemory();
    it->keep = Py_NewRef(data);
    it->p = p;
    it->n = n;
    it->next = NULL;
    pthread_mutex_lock(&w->mu);
    if (w->tail) w->tail->next = it;
    else w->head = it;
    w->tail = it;
    w->queued += n;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    writer_wait(w, w->limit); /* the encoder may run at most `limit` bytes ahead */
    Py_RETURN_NONE;
}

static PyObject *Writer_close(Writer *w, PyObject *unused) {
    writer_stop(w);
    if (writer_error(w) < 0) return NULL;
    Py_RETURN_NONE;
}

static void Writer_dealloc(Writer *w) {
    PyTypeObject *tp = Py_TYPE(w);
    writer_stop(w); /* joins the thread: nothing of this object is in use after it */
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    f(w);
    Py_DECREF(tp);
}

static PyMethodDef Writer_methods[] = {
    {"write", (PyCFunction)Writer_write, METH_O,
     "write($self, data, /)\n--\n\nQueue bytes to be written; waits while more than `limit` bytes wait. Raises a\n"
     "failed earlier write's OSError."},
    {"close", (PyCFunction)Writer_close, METH_NOARGS,
     "close($self, /)\n--\n\nWrite what waits, stop the thread; raises the first failed write's OSError."},
    {NULL},
};

static PyType_Slot Writer_slots[] = {
    {Py_tp_doc,
     "Writer(fd, limit=4 MiB)\n--\n\n"
     "Writes bytes to the file descriptor `fd` in a thread of its own, in the order given, while\n"
     "the caller goes on; `close()` waits for them. The descriptor's offset is the thread's until then."},
    {Py_tp_new, Writer_new},
    {Py_tp_dealloc, Writer_dealloc},
    {Py_tp_methods, Writer_methods},
    {0, NULL},
};

static PyType_Spec Writer_spec = {"gputrace._hot.Writer", sizeof(Writer), 0, Py_TPFLAGS_DEFAULT, Writer_slots};

static PyMethodDef hot_methods[] = {
    {"layout", hot_layout, METH_VARARGS, layout_doc},
    {"resolve", hot_resolve, METH_VARARGS, resolve_doc},
    {"split_finished", hot_split_finished, METH_VARARGS, split_finished_doc},
    {"nest_tracks", hot_nest_tracks, METH_VARARGS, nest_tracks_doc},
    {"encode_rows", hot_encode_rows, METH_VARARGS, encode_rows_doc},
    {"encode_events", hot_encode_events, METH_VARARGS, encode_events_doc},
    {"span", (PyCFunction)(void (*)(void))hot_span, METH_FASTCALL | METH_KEYWORDS, span_doc},
    {"bind", hot_bind, METH_VARARGS, bind_doc},
    {"install", hot_install, METH_VARARGS, install_doc},
    {"set_check_at", hot_set_check_at, METH_VARARGS, set_check_at_doc},
    {"set_capture", hot_set_capture, METH_O, set_capture_doc},
    {"set_raw_elapsed", hot_set_raw_elapsed, METH_VARARGS, set_raw_elapsed_doc},
    {"digest_rows", hot_digest_rows, METH_VARARGS, digest_rows_doc},
    {"column_range", hot_column_range, METH_O, column_range_doc},
    {"digest_fold", hot_digest_fold, METH_VARARGS, digest_fold_doc},
    {"raw_elapsed_ms", hot_raw_elapsed_ms, METH_VARARGS, raw_elapsed_ms_doc},
    {"open", hot_open, METH_O, open_doc},
    {"close", hot_close, METH_O, close_doc},
    {NULL},
};

static struct PyModuleDef hot_module = {
    PyModuleDef_HEAD_INIT, "gputrace._hot", "gputrace's span hot path in C (see record.py for its Python twin).", -1,
    hot_methods};

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

PyMODINIT_FUNC PyInit__hot(void) {
    PyObject *m = PyModule_Create(&hot_module);
    if (!m) return NULL;
    s_host = PyUnicode_InternFromString("host");
    s_cuda = PyUnicode_InternFromString("cuda");
    s_track = PyUnicode_InternFromString("track");
    s_stream = PyUnicode_InternFromString("stream");
    s_device = PyUnicode_InternFromString("device");
    s_name = PyUnicode_InternFromString("__name__");
    s_index = PyUnicode_InternFromString("index");
    s_tobytes = PyUnicode_InternFromString("tobytes");
    s_query = PyUnicode_InternFromString("query");
    s_elapsed_attr = PyUnicode_InternFromString("_elapsed");
    s_anchors = PyUnicode_InternFromString("anchors");
    s_segment_ms = PyUnicode_InternFromString("segment_ms");
    s_host_ns = PyUnicode_InternFromString("host_ns");
    s_event_attr = PyUnicode_InternFromString("event");
    s_cuda_event = PyUnicode_InternFromString("cuda_event");
    s_buffer_info = PyUnicode_InternFromString("buffer_info");
    s_typecode = PyUnicode_InternFromString("typecode");
    s_names = PyUnicode_InternFromString("names");
    s_name_index = PyUnicode_InternFromString("_name_index");
    s_last_id = PyUnicode_InternFromString("_last_id");
    s_capacity = PyUnicode_InternFromString("capacity");
    s_dropped = PyUnicode_InternFromString("dropped");
    s_child_extent = PyUnicode_InternFromString("child_extent");
    s_locate = PyUnicode_InternFromString("locate");
    s_to_host_ns = PyUnicode_InternFromString("to_host_ns");
    s_add_ns = PyUnicode_InternFromString("add_ns");
    s_error = PyUnicode_InternFromString("error");
    s_frombytes = PyUnicode_InternFromString("frombytes");
    s_args_attr = PyUnicode_InternFromString("args");
    {
        static const char *cols[4] = {"name", "track", "start", "end"};
        for (int i = 0; i < 4; i++)
            if (!(s_cols[i] = PyUnicode_InternFromString(cols[i]))) goto fail;
    }
    SpanType = (PyTypeObject *)PyType_FromSpec(&Span_spec);
    if (!SpanType || PyModule_AddObject(m, "Span", Py_NewRef((PyObject *)SpanType)) < 0) goto fail;
    DisabledType = (PyTypeObject *)PyType_FromSpec(&Disabled_spec);
    if (!DisabledType || PyModule_AddObject(m, "DisabledSpan", Py_NewRef((PyObject *)DisabledType)) < 0) goto fail;
    WriterType = (PyTypeObject *)PyType_FromSpec(&Writer_spec);
    if (!WriterType || PyModule_AddObject(m, "Writer", Py_NewRef((PyObject *)WriterType)) < 0) goto fail;
    SlotType = (PyTypeObject *)PyType_FromSpec(&Slot_spec);
    if (!SlotType || add_slots(SpanType) < 0 || add_slots(DisabledType) < 0) goto fail;
    StateType = (PyTypeObject *)PyType_FromSpec(&State_spec);
    if (!StateType) goto fail;
    PyObject *layout = layout_tuple();
    if (!layout || PyModule_AddObject(m, "LAYOUT", layout) < 0) { Py_XDECREF(layout); goto fail; }
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
