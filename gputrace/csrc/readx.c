/* Reading a Chrome JSON trace (gputrace/trace/chrome.py `_Builder.add`): the plain complete
 * events ("ph": "X", no flow, on a thread and with a name already seen), the bulk of any trace,
 * taken from the parsed batch to columns in C. The first event that is anything else stops the
 * loop and goes to the Python loop, which is the twin of this one (the same columns: tests in
 * tests/test_read_x.py); a view of traces that came without digests reads every one of them. */
#include "hot.h"

static PyObject *s_ph, *s_x, *s_ts, *s_dur, *s_bind_id, *s_cat, *s_pid, *s_tid, *s_name, *s_args, *s_empty, *s_cuda,
    *s_cpu;

/* `x` * 1000 rounded as Python's round() rounds (half to even), into *out; 0 where it is not an
 * int or float (exactly: not bool) or does not fit 64 bits (the Python loop then says). */
static int times_1000(PyObject *x, long long *out) {
    if (PyLong_CheckExact(x)) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
        if (overflow || (v == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return 0;
        }
        return !__builtin_mul_overflow(v, 1000LL, out);
    }
    if (PyFloat_CheckExact(x)) {
        double d = PyFloat_AsDouble(x) * 1000.0;
        if (!isfinite(d)) return 0;
        double r = round(d); /* as CPython's float.__round__: halfway cases to even */
        if (fabs(d - r) == 0.5) r = 2.0 * round(d / 2.0);
        if (!(r >= -9223372036854775808.0 && r < 9223372036854775808.0)) return 0;
        *out = (long long)r;
        return 1;
    }
    return 0;
}

/* The arguments named in `keys` of a non-empty dict `args`, in its order (chrome._only), or None. */
static PyObject *only_keys(PyObject *args, PyObject *keys) {
    PyObject *k, *v, *out = NULL;
    Py_ssize_t pos = 0;
    while (PyDict_Next(args, &pos, &k, &v)) {
        int in = PySet_Contains(keys, k);
        if (in < 0) {
            Py_XDECREF(out);
            return NULL;
        }
        if (!in) continue;
        if (!out && !(out = PyDict_New())) return NULL;
        if (PyDict_SetItem(out, k, v) < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    if (!out) Py_RETURN_NONE;
    return out;
}

PyDoc_STRVAR(read_x_rows_doc,
             "read_x_rows(events, i, base, track_index, name_index, keys, args, cats, /)\n--\n\n"
             "chrome._Builder.add's loop over events[i:] while each is a plain X event (a dict with ph 'X',\n"
             "no bind_id, int or float ts and dur that place it within 64 bits, a (pid, tid) in track_index,\n"
             "a str name in name_index): the index of the first that is not, and of those taken: starts,\n"
             "ends, names, tracks as bytes of int64; their args appended to `args`, their categories to\n"
             "`cats` (None where keys is given: none are kept).");
static PyObject *hot_read_x_rows(PyObject *self, PyObject *py_args) {
    PyObject *events, *track_index, *name_index, *keys, *args_out, *cats_out;
    Py_ssize_t i;
    long long base;
    if (!PyArg_ParseTuple(py_args, "OnLOOOOO", &events, &i, &base, &track_index, &name_index, &keys, &args_out,
                          &cats_out))
        return NULL;
    if (!PyList_Check(events) || !PyDict_Check(track_index) || !PyDict_Check(name_index) ||
        (keys != Py_None && !PyAnySet_Check(keys)) || !PyList_Check(args_out) ||
        (keys == Py_None && !PyList_Check(cats_out))) {
        PyErr_SetString(PyExc_TypeError,
                        "read_x_rows: events (list), track_index, name_index (dicts), keys (set or None), args and "
                        "cats (lists; cats None where keys is given)");
        return NULL;
    }
    if (keys != Py_None) cats_out = NULL;
    Py_ssize_t n = PyList_Size(events);
    if (i < 0) i = 0;
    Vec cs = {0}, ce = {0}, cn = {0}, ct = {0};
    /* Room for the rest of the batch at once: buffers grown by doubling crossed glibc's mmap
     * threshold and back every batch, which left the reader's own columns fragmented (+9% peak). */
    Py_ssize_t room = n > i ? n - i : 1;
    Vec *cols[4] = {&cs, &ce, &cn, &ct};
    for (int c = 0; c < 4; c++) {
        if (!(cols[c]->v = PyMem_Malloc((size_t)room * sizeof(long long)))) {
            for (int k = 0; k < c; k++) PyMem_Free(cols[k]->v);
            return PyErr_NoMemory();
        }
        cols[c]->cap = room;
    }
    PyObject *result = NULL;
    for (; i < n; i++) {
        PyObject *e = PyList_GetItem(events, i); /* borrowed */
        if (!e || !PyDict_CheckExact(e)) break;
        PyObject *ph = PyDict_GetItemWithError(e, s_ph);
        if (!ph) {
            if (PyErr_Occurred()) goto out;
            break;
        }
        if (!PyUnicode_CheckExact(ph) || PyUnicode_Compare(ph, s_x) != 0) break;
        int flow = PyDict_Contains(e, s_bind_id);
        if (flow < 0) goto out;
        if (flow) break;
        PyObject *ts = PyDict_GetItemWithError(e, s_ts);
        if (!ts) {
            if (PyErr_Occurred()) goto out;
            break;
        }
        PyObject *dur = PyDict_GetItemWithError(e, s_dur);
        if (!dur && PyErr_Occurred()) goto out;
        long long t, d = 0, start, end;
        if (!times_1000(ts, &t) || (dur && !times_1000(dur, &d))) break;
        if (__builtin_add_overflow(base, t, &start) || __builtin_add_overflow(start, d, &end)) break;
        PyObject *pid = PyDict_GetItemWithError(e, s_pid);
        if (!pid && PyErr_Occurred()) goto out;
        PyObject *tid = PyDict_GetItemWithError(e, s_tid);
        if (!tid && PyErr_Occurred()) goto out;
        PyObject *key = PyTuple_Pack(2, pid ? pid : Py_None, tid ? tid : Py_None);
        if (!key) goto out;
        PyObject *track = PyDict_GetItemWithError(track_index, key); /* borrowed */
        Py_DECREF(key);
        if (!track) {
            PyErr_Clear(); /* a new thread, or a pid or tid that cannot be a key: the Python loop's */
            break;
        }
        PyObject *name = PyDict_GetItemWithError(e, s_name);
        if (!name && PyErr_Occurred()) goto out;
        if (!name) name = s_empty;
        if (!PyUnicode_CheckExact(name)) break;
        PyObject *ni = PyDict_GetItemWithError(name_index, name);
        if (!ni) {
            if (PyErr_Occurred()) goto out;
            break; /* a new name: interned by the Python loop */
        }
        long long track_i = PyLong_AsLongLong(track), name_i = PyLong_AsLongLong(ni);
        if ((track_i == -1 || name_i == -1) && PyErr_Occurred()) goto out;
        PyObject *xa = PyDict_GetItemWithError(e, s_args);
        if (!xa && PyErr_Occurred()) goto out;
        PyObject *kept; /* new reference */
        if (xa && PyDict_CheckExact(xa) && PyDict_Size(xa) > 0) {
            if (keys == Py_None) {
                Py_INCREF(xa);
                kept = xa;
            } else if (!(kept = only_keys(xa, keys))) {
                goto out;
            }
        } else {
            Py_INCREF(Py_None);
            kept = Py_None;
        }
        int bad = PyList_Append(args_out, kept);
        Py_DECREF(kept);
        if (bad < 0) goto out;
        if (cats_out) {
            PyObject *cat = PyDict_GetItemWithError(e, s_cat);
            if (!cat && PyErr_Occurred()) goto out;
            /* Kept only where it says more than the track's kind (chrome._Builder.add). */
            int plain = !cat || !PyUnicode_Check(cat) || PyUnicode_Compare(cat, s_cuda) == 0 ||
                        PyUnicode_Compare(cat, s_cpu) == 0;
            if (PyErr_Occurred()) goto out;
            if (PyList_Append(cats_out, plain ? Py_None : cat) < 0) goto out;
        }
        if (vec_push(&cs, start) < 0 || vec_push(&ce, end) < 0 || vec_push(&cn, name_i) < 0 || vec_push(&ct, track_i) < 0)
            goto out;
    }
#define BYTES(c) (c.v ? (const char *)c.v : ""), (c.n * (Py_ssize_t)sizeof(long long))
    result = Py_BuildValue("(ny#y#y#y#)", i, BYTES(cs), BYTES(ce), BYTES(cn), BYTES(ct));
#undef BYTES
out:
    vec_free(&cs);
    vec_free(&ce);
    vec_free(&cn);
    vec_free(&ct);
    return result;
}

static PyMethodDef readx_methods[] = {
    {"read_x_rows", hot_read_x_rows, METH_VARARGS, read_x_rows_doc},
    {NULL, NULL, 0, NULL},
};

int gt_readx_init(PyObject *m) {
#define INTERN(var, text) \
    if (!(var = PyUnicode_InternFromString(text))) return -1;
    INTERN(s_ph, "ph")
    INTERN(s_x, "X")
    INTERN(s_ts, "ts")
    INTERN(s_dur, "dur")
    INTERN(s_bind_id, "bind_id")
    INTERN(s_cat, "cat")
    INTERN(s_pid, "pid")
    INTERN(s_tid, "tid")
    INTERN(s_name, "name")
    INTERN(s_args, "args")
    INTERN(s_empty, "")
    INTERN(s_cuda, "cuda")
    INTERN(s_cpu, "cpu")
#undef INTERN
    return PyModule_AddFunctions(m, readx_methods);
}
