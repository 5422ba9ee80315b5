/* Timing events made and recorded by the CUDA runtime itself: RawEvent, and the runtime calls it
 * makes, found through torch's own CUDA library (cuda.py: set_runtime).
 *
 * torch's Event.record goes through Python and pybind and looks the stream up again: ~2.5 us a
 * call through the H200 VM against ~1.6 us for cudaEventRecord itself. A RawEvent is a
 * cudaEvent_t that the C hot path records with one record on the raw current stream
 * (gt_raw_record: the driver's cuEventRecord where set_driver found it, else cudaEventRecord);
 * from Python it has the methods gputrace asks of torch's events (record,
 * query, synchronize, elapsed_time, cuda_event), so anchors, flush's split and resolve take it
 * as they take torch's. It is created at its first record, on the device of the stream it is
 * recorded on (the current device on the hot path), as torch creates its events. Any runtime
 * error is cleared (torch would otherwise report it at its next kernel launch) and raised here.
 * cuda.CudaDevice uses these where the C build is in use; torch's events stay the fallback and
 * the Python twin's reference. */
#include "hot.h"

typedef int (*rt_create_fn)(void **event, unsigned int flags);
typedef int (*rt_event_fn)(void *event);
typedef int (*rt_record_fn)(void *event, void *stream);
typedef int (*rt_elapsed_fn)(float *ms, void *start, void *end);
typedef int (*rt_void_fn)(void);
typedef int (*rt_get_device_fn)(int *device);
typedef int (*rt_set_device_fn)(int device);

static rt_create_fn rt_create;      /* cudaEventCreateWithFlags */
static rt_record_fn rt_record;      /* cudaEventRecord */
static rt_event_fn rt_query;        /* cudaEventQuery */
static rt_event_fn rt_sync;         /* cudaEventSynchronize */
static rt_event_fn rt_destroy;      /* cudaEventDestroy */
static rt_elapsed_fn rt_elapsed;    /* cudaEventElapsedTime */
static rt_void_fn rt_last_error;    /* cudaGetLastError */
static rt_get_device_fn rt_get_dev; /* cudaGetDevice */
static rt_set_device_fn rt_set_dev; /* cudaSetDevice */

#define CUDA_ERROR_NOT_READY 600

PyTypeObject *gt_RawEventType;

static PyObject *s_cuda_stream, *s_device_index;

static PyObject *rt_error(const char *call, int err) {
    if (rt_last_error) (void)rt_last_error();
    PyErr_Format(PyExc_RuntimeError, "gputrace: %s failed with CUDA error %d", call, err);
    return NULL;
}

static int need_runtime(void) {
    if (rt_record) return 0;
    PyErr_SetString(PyExc_RuntimeError, "gputrace: RawEvent needs the CUDA runtime's calls (set_runtime)");
    return -1;
}

/* Create the event on `device` (-1: the current one), the current device kept. 0, or -1. */
static int raw_create(RawEvent *ev, int device) {
    int cur = -1, err;
    if ((err = rt_get_dev(&cur)) != 0) { rt_error("cudaGetDevice", err); return -1; }
    if (device >= 0 && device != cur && (err = rt_set_dev(device)) != 0) { rt_error("cudaSetDevice", err); return -1; }
    err = rt_create(&ev->handle, 0); /* cudaEventDefault: timing on */
    if (device >= 0 && device != cur) (void)rt_set_dev(cur);
    if (err != 0) {
        ev->handle = NULL;
        rt_error("cudaEventCreateWithFlags", err);
        return -1;
    }
    ev->device = device >= 0 ? device : cur;
    return 0;
}

/* The driver's cuEventRecord on the same handles (a runtime event is a driver event, a runtime
 * stream a driver stream), where set_driver found it: the runtime's cudaEventRecord is this call
 * behind the runtime's own checks, ~0.1-0.2 us a call on the H200 VM. A record the driver refuses
 * (no context current on this thread yet, say) is made again by the runtime, which sets up what it
 * needs or reports the error; after DRIVER_MISSES such records in a row the driver's call is left
 * alone. */
static rt_record_fn drv_record;
static int drv_misses;
#define DRIVER_MISSES 64

static int record_call(void *handle, void *stream) {
    if (drv_record) {
        if (drv_record(handle, stream) == 0) {
            drv_misses = 0;
            return 0;
        }
        if (++drv_misses >= DRIVER_MISSES) drv_record = NULL;
    }
    return rt_record(handle, stream);
}

int gt_raw_record(RawEvent *ev, void *stream) {
    if (need_runtime() < 0) return -1; /* the calls were taken back (set_runtime(None)) */
    if (!ev->handle && raw_create(ev, -1) < 0) return -1;
    int err = record_call(ev->handle, stream);
    if (err != 0) { rt_error("cudaEventRecord", err); return -1; }
    ev->recorded = 1;
    return 0;
}

int gt_raw_record_on(RawEvent *ev, void *stream, int device) {
    int cur = -1, err;
    if (need_runtime() < 0) return -1;
    if ((err = rt_get_dev(&cur)) != 0) { rt_error("cudaGetDevice", err); return -1; }
    if (cur == device) return gt_raw_record(ev, stream);
    if ((err = rt_set_dev(device)) != 0) { rt_error("cudaSetDevice", err); return -1; }
    int r = gt_raw_record(ev, stream);
    (void)rt_set_dev(cur);
    return r;
}


static PyObject *RawEvent_tp_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    if ((args && PyTuple_Size(args) > 0) || (kw && PyDict_Size(kw) > 0)) {
        PyErr_SetString(PyExc_TypeError, "RawEvent() takes no arguments");
        return NULL;
    }
    if (need_runtime() < 0) return NULL;
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    RawEvent *ev = (RawEvent *)alloc(type, 0);
    if (ev) ev->device = -1;
    return (PyObject *)ev;
}

static void RawEvent_dealloc(RawEvent *ev) {
    PyTypeObject *tp = Py_TYPE(ev);
    if (ev->handle && rt_destroy) {
        /* Freed by the runtime once any pending record has run; an error (the runtime already
         * unloading at exit) is cleared, never left for torch's next launch. */
        if (rt_destroy(ev->handle) != 0 && rt_last_error) (void)rt_last_error();
    }
    freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    f(ev);
    Py_DECREF(tp);
}

/* record(stream): a torch Stream (its cuda_stream and device_index) or a raw handle (an int, on
 * the current device). */
static PyObject *RawEvent_record(RawEvent *self, PyObject *stream) {
    void *raw;
    int device = -1;
    if (need_runtime() < 0) return NULL;
    if (PyLong_Check(stream)) {
        raw = PyLong_AsVoidPtr(stream);
    } else {
        PyObject *h = PyObject_GetAttr(stream, s_cuda_stream);
        if (!h) return NULL;
        raw = PyLong_AsVoidPtr(h);
        Py_DECREF(h);
        PyObject *d = PyErr_Occurred() ? NULL : PyObject_GetAttr(stream, s_device_index);
        if (d) {
            device = (int)PyLong_AsLong(d);
            Py_DECREF(d);
        }
    }
    if (PyErr_Occurred()) return NULL;
    if (!self->handle && raw_create(self, device) < 0) return NULL;
    if (device >= 0 && device != self->device) {
        PyErr_Format(PyExc_ValueError, "gputrace: an event of cuda:%d recorded on a stream of cuda:%d", self->device, device);
        return NULL;
    }
    if (gt_raw_record(self, raw) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *RawEvent_query(RawEvent *self, PyObject *unused) {
    if (!self->handle) Py_RETURN_TRUE; /* never recorded: nothing to wait for (as torch's) */
    if (need_runtime() < 0) return NULL;
    int err = rt_query(self->handle);
    if (err == 0) Py_RETURN_TRUE;
    if (err == CUDA_ERROR_NOT_READY) {
        (void)rt_last_error(); /* not an error: not left for torch to find */
        Py_RETURN_FALSE;
    }
    return rt_error("cudaEventQuery", err);
}

static PyObject *RawEvent_synchronize(RawEvent *self, PyObject *unused) {
    if (self->handle) {
        int err;
        if (need_runtime() < 0) return NULL;
        Py_BEGIN_ALLOW_THREADS
        err = rt_sync(self->handle);
        Py_END_ALLOW_THREADS
        if (err != 0) return rt_error("cudaEventSynchronize", err);
    }
    Py_RETURN_NONE;
}

static PyObject *RawEvent_elapsed_time(RawEvent *self, PyObject *other) {
    if (!PyObject_TypeCheck(other, gt_RawEventType)) {
        PyErr_SetString(PyExc_TypeError, "elapsed_time() takes another RawEvent");
        return NULL;
    }
    RawEvent *o = (RawEvent *)other;
    if (!self->recorded || !o->recorded) {
        PyErr_SetString(PyExc_ValueError, "gputrace: both events must be recorded before elapsed_time()");
        return NULL;
    }
    float ms = 0.0f;
    if (need_runtime() < 0) return NULL;
    int err = rt_elapsed(&ms, self->handle, o->handle);
    if (err != 0) return rt_error("cudaEventElapsedTime", err);
    return PyFloat_FromDouble((double)ms); /* the runtime's float32, widened, as torch's */
}

static PyObject *RawEvent_cuda_event(RawEvent *self, void *unused) { return PyLong_FromVoidPtr(self->handle); }

static PyObject *RawEvent_device(RawEvent *self, void *unused) {
    if (self->device < 0) Py_RETURN_NONE;
    return PyLong_FromLong(self->device);
}

static PyMethodDef RawEvent_methods[] = {
    {"record", (PyCFunction)RawEvent_record, METH_O,
     "record($self, stream, /)\n--\n\nRecord on `stream` (a torch Stream, or a raw handle on the current device)."},
    {"query", (PyCFunction)RawEvent_query, METH_NOARGS, "query($self, /)\n--\n\nWhether the event has run."},
    {"synchronize", (PyCFunction)RawEvent_synchronize, METH_NOARGS,
     "synchronize($self, /)\n--\n\nWait until the event has run."},
    {"elapsed_time", (PyCFunction)RawEvent_elapsed_time, METH_O,
     "elapsed_time($self, other, /)\n--\n\nMilliseconds from this event to `other` (float32, as CUDA gives)."},
    {NULL},
};

static PyGetSetDef RawEvent_getset[] = {
    {"cuda_event", (getter)RawEvent_cuda_event, NULL, "The raw cudaEvent_t (0 before the first record).", NULL},
    {"device", (getter)RawEvent_device, NULL, "The device it was created on (None before the first record).", NULL},
    {NULL},
};

static PyType_Slot RawEvent_slots[] = {
    {Py_tp_doc,
     "RawEvent()\n--\n\n"
     "A CUDA timing event made and recorded by the CUDA runtime (created at its first record)."},
    {Py_tp_new, RawEvent_tp_new},
    {Py_tp_dealloc, RawEvent_dealloc},
    {Py_tp_methods, RawEvent_methods},
    {Py_tp_getset, RawEvent_getset},
    {0, NULL},
};

static PyType_Spec RawEvent_spec = {"gputrace._hot.RawEvent", sizeof(RawEvent), 0, Py_TPFLAGS_DEFAULT, RawEvent_slots};

PyDoc_STRVAR(set_runtime_doc,
             "set_runtime($module, calls, /)\n--\n\n"
             "The CUDA runtime's calls RawEvent makes, by name (cudaEventCreateWithFlags, cudaEventRecord,\n"
             "cudaEventQuery, cudaEventSynchronize, cudaEventDestroy, cudaEventElapsedTime, cudaGetLastError,\n"
             "cudaGetDevice, cudaSetDevice) -> address; all must be there. None turns them off.");

static PyObject *hot_set_runtime(PyObject *self, PyObject *calls) {
    static const char *names[] = {"cudaEventCreateWithFlags", "cudaEventRecord", "cudaEventQuery",
                                  "cudaEventSynchronize",     "cudaEventDestroy", "cudaEventElapsedTime",
                                  "cudaGetLastError",         "cudaGetDevice",    "cudaSetDevice"};
    void *p[9] = {NULL};
    if (calls != Py_None) {
        if (!PyDict_Check(calls)) {
            PyErr_SetString(PyExc_TypeError, "set_runtime() takes a dict of addresses, or None");
            return NULL;
        }
        for (int i = 0; i < 9; i++) {
            PyObject *v = PyDict_GetItemString(calls, names[i]); /* borrowed */
            if (!v || !(p[i] = PyLong_AsVoidPtr(v))) {
                if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "set_runtime: no address for %s", names[i]);
                return NULL;
            }
        }
    }
    rt_create = (rt_create_fn)p[0];
    rt_query = (rt_event_fn)p[2];
    rt_sync = (rt_event_fn)p[3];
    rt_destroy = (rt_event_fn)p[4];
    rt_elapsed = (rt_elapsed_fn)p[5];
    rt_last_error = (rt_void_fn)p[6];
    rt_get_dev = (rt_get_device_fn)p[7];
    rt_set_dev = (rt_set_device_fn)p[8];
    rt_record = (rt_record_fn)p[1]; /* last: the one the others are checked by */
    if (!rt_record) drv_record = NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(set_driver_doc,
             "set_driver($module, record, /)\n--\n\n"
             "The address of the CUDA driver's cuEventRecord, which RawEvent records call first (the\n"
             "runtime's cudaEventRecord where it refuses); 0 turns it off. Needs set_runtime first.");

static PyObject *hot_set_driver(PyObject *self, PyObject *arg) {
    void *p = PyLong_AsVoidPtr(arg);
    if (PyErr_Occurred()) return NULL;
    if (p && need_runtime() < 0) return NULL;
    drv_record = (rt_record_fn)p;
    drv_misses = 0;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(driver_record_doc,
             "driver_record($module, /)\n--\n\n"
             "Whether RawEvent records go through the driver's cuEventRecord (set_driver) now.");

static PyObject *hot_driver_record(PyObject *self, PyObject *unused) { return PyBool_FromLong(drv_record != NULL); }

PyDoc_STRVAR(record_floor_doc,
             "record_floor($module, a, b, stream, n, driver=False, /)\n--\n\n"
             "The floor a CUDA span is measured against: ns for n iterations of two cudaEventRecord calls\n"
             "(events a and b, RawEvents, on the raw stream handle `stream`) in a C loop; `driver`: two of\n"
             "the driver's cuEventRecord (set_driver) instead.");

static PyObject *hot_record_floor(PyObject *self, PyObject *args) {
    PyObject *a, *b, *s;
    Py_ssize_t n;
    int driver = 0;
    if (!PyArg_ParseTuple(args, "O!O!On|p", gt_RawEventType, &a, gt_RawEventType, &b, &s, &n, &driver)) return NULL;
    void *stream = PyLong_AsVoidPtr(s);
    if (PyErr_Occurred() || need_runtime() < 0) return NULL;
    rt_record_fn rec = driver ? drv_record : rt_record;
    if (!rec) {
        PyErr_SetString(PyExc_RuntimeError, "gputrace: no driver cuEventRecord (set_driver)");
        return NULL;
    }
    RawEvent *ea = (RawEvent *)a, *eb = (RawEvent *)b;
    if (gt_raw_record(ea, stream) < 0 || gt_raw_record(eb, stream) < 0) return NULL; /* created outside the loop */
    struct timespec t0, t1;
    int err = 0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (Py_ssize_t i = 0; i < n && !err; i++) {
        err = rec(ea->handle, stream);
        if (!err) err = rec(eb->handle, stream);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (err) return rt_error(driver ? "cuEventRecord" : "cudaEventRecord", err);
    return PyLong_FromLongLong((long long)(t1.tv_sec - t0.tv_sec) * 1000000000LL + (t1.tv_nsec - t0.tv_nsec));
}

static PyMethodDef events_methods[] = {
    {"set_runtime", hot_set_runtime, METH_O, set_runtime_doc},
    {"record_floor", hot_record_floor, METH_VARARGS, record_floor_doc},
    {"set_driver", hot_set_driver, METH_O, set_driver_doc},
    {"driver_record", hot_driver_record, METH_NOARGS, driver_record_doc},
    {NULL},
};

int gt_events_init(PyObject *m) {
    if (!(s_cuda_stream = PyUnicode_InternFromString("cuda_stream")) ||
        !(s_device_index = PyUnicode_InternFromString("device_index")))
        return -1;
    gt_RawEventType = (PyTypeObject *)PyType_FromSpec(&RawEvent_spec);
    if (!gt_RawEventType || PyModule_AddObject(m, "RawEvent", Py_NewRef((PyObject *)gt_RawEventType)) < 0) return -1;
    return PyModule_AddFunctions(m, events_methods);
}
