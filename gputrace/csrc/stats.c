/* The statistics' per-span loops (gputrace/stats_columns.py holds their Python twins, the
 * reference and the fallback): grouping a trace's spans by (name, rank slot) into one index
 * column, and sorted durations of a set of spans. Results are bytes of int64 (or of one byte a
 * span), which the Python side turns into array.array columns. */
#include "hot.h"

static PyObject *s_unfinished, *s_cover, *s_collective;

/* a.get(key) for a span's args (a dict, or anything with get()); a new reference or NULL. */
static PyObject *args_get(PyObject *a, PyObject *key) {
    if (PyDict_Check(a)) {
        PyObject *v = PyDict_GetItemWithError(a, key);
        if (v) Py_INCREF(v);
        else if (!PyErr_Occurred()) { Py_INCREF(Py_None); v = Py_None; }
        return v;
    }
    return PyObject_CallMethod(a, "get", "O", key);
}


/* A new bytes object of n int64 items to fill in place (no second copy of a column). */
static PyObject *new_int64s(Py_ssize_t n, long long **items) {
    PyObject *b = PyBytes_FromStringAndSize(NULL, n * 8);
    if (b) *items = (long long *)PyBytes_AsString(b);
    return b;
}

PyDoc_STRVAR(stats_groups_doc,
             "stats_groups(names, tracks, args, slot_of_track, stride, /)\n--\n\n"
             "stats_columns._groups_py: (order, keys, bounds, marked, own, own_bounds) as bytes.");
static PyObject *hot_stats_groups(PyObject *self, PyObject *py_args) {
    PyObject *no, *to, *args, *so;
    long long stride;
    if (!PyArg_ParseTuple(py_args, "OOOOL", &no, &to, &args, &so, &stride)) return NULL;
    PyObject *kn = NULL, *kt = NULL, *ks = NULL, *result = NULL;
    PyObject *order_b = NULL, *keys_b = NULL, *bounds_b = NULL, *marked_b = NULL, *own_b = NULL, *own_bounds_b = NULL;
    Py_ssize_t *grp = NULL, *cnt = NULL;
    long long *gkeys = NULL, *bounds = NULL, *own_bounds = NULL, *order = NULL, *own = NULL, *at = NULL;
    char *marked = NULL;
    I64Map km = {0};
    Py_ssize_t n, nt, ns, ng = 0;
    const long long *name = gt_column_items(no, &n, &kn);
    if (!name) goto out;
    const long long *track = gt_column_items(to, &nt, &kt);
    if (!track) goto out;
    const long long *slot = gt_column_items(so, &ns, &ks);
    if (!slot) goto out;
    if (nt != n || !PyList_Check(args) || PyList_Size(args) != n || stride < 1) {
        PyErr_SetString(PyExc_ValueError, "stats_groups: columns of different lengths");
        goto out;
    }
    grp = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n ? n : 1));
    if (!grp) { PyErr_NoMemory(); goto out; }
    if (!(marked_b = PyBytes_FromStringAndSize(NULL, n))) goto out;
    marked = PyBytes_AsString(marked_b);
    if (map_init(&km, 64) < 0) goto out;
    /* Each span's key, and its group (numbered in order of first sight). */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (track[i] < 0 || track[i] >= ns) {
            PyErr_SetString(PyExc_IndexError, "stats_groups: a span's track is not in slot_of_track");
            goto out;
        }
        long long s = slot[track[i]], key = name[i] * stride + s;
        marked[i] = 0;
        PyObject *a = PyList_GetItem(args, i);
        if (!a) goto out;
        if (a != Py_None) {
            int t = PyObject_IsTrue(a);
            if (t < 0) goto out;
            if (t) {
                PyObject *v = args_get(a, s_unfinished);
                if (!v) goto out;
                t = PyObject_IsTrue(v);
                Py_DECREF(v);
                if (t < 0) goto out;
                if (t) {
                    key = -1 - s;
                } else {
                    v = args_get(a, s_cover);
                    if (!v) goto out;
                    t = PyObject_IsTrue(v);
                    Py_DECREF(v);
                    if (t < 0) goto out;
                    if (t) key = -1 - stride - s;
                }
                v = args_get(a, s_collective);
                if (!v) goto out;
                if (v != Py_None) {
                    t = PyObject_IsTrue(v);
                    if (t < 0) { Py_DECREF(v); goto out; }
                    marked[i] = t ? 2 : 1;
                }
                Py_DECREF(v);
            }
        }
        if ((grp[i] = map_index(&km, key, km.used)) < 0) goto out;
    }
    ng = km.used;
    /* The groups' keys, each key's group number being its place in order of first sight. */
    cnt = PyMem_Calloc((size_t)ng + 1, sizeof(Py_ssize_t));
    if (!cnt) { PyErr_NoMemory(); goto out; }
    if (!(keys_b = new_int64s(ng, &gkeys)) || !(bounds_b = new_int64s(ng + 1, &bounds))) goto out;
    for (Py_ssize_t j = 0; j < km.cap; j++)
        if (km.vals[j] >= 0) gkeys[km.vals[j]] = km.keys[j];
    for (Py_ssize_t i = 0; i < n; i++) cnt[grp[i]]++;
    bounds[0] = 0;
    for (Py_ssize_t g = 0; g < ng; g++) bounds[g + 1] = bounds[g] + cnt[g];
    memset(cnt, 0, sizeof(Py_ssize_t) * ((size_t)ng + 1));
    if (!(order_b = new_int64s(n, &order))) goto out;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t g = grp[i];
        order[bounds[g] + cnt[g]++] = i;
    }
    /* Each rank slot's spans that are in a group of its own (finished, not a cover, not another
     * process's: key >= 0 and key % stride != stride - 1), in order. */
    if (!(own_bounds_b = new_int64s(stride + 1, &own_bounds))) goto out;
    memset(own_bounds, 0, sizeof(long long) * ((size_t)stride + 1));
    for (Py_ssize_t i = 0; i < n; i++) {
        long long k = gkeys[grp[i]];
        if (k >= 0 && k % stride != stride - 1) own_bounds[k % stride + 1]++;
    }
    for (long long s = 0; s < stride; s++) own_bounds[s + 1] += own_bounds[s];
    at = PyMem_Malloc(sizeof(long long) * ((size_t)stride + 1));
    if (!at) { PyErr_NoMemory(); goto out; }
    memcpy(at, own_bounds, sizeof(long long) * ((size_t)stride + 1));
    if (!(own_b = new_int64s((Py_ssize_t)own_bounds[stride], &own))) goto out;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long k = gkeys[grp[i]];
        if (k >= 0 && k % stride != stride - 1) own[at[k % stride]++] = i;
    }
    result = PyTuple_Pack(6, order_b, keys_b, bounds_b, marked_b, own_b, own_bounds_b);
out:
    Py_XDECREF(kn);
    Py_XDECREF(kt);
    Py_XDECREF(ks);
    Py_XDECREF(order_b);
    Py_XDECREF(keys_b);
    Py_XDECREF(bounds_b);
    Py_XDECREF(marked_b);
    Py_XDECREF(own_b);
    Py_XDECREF(own_bounds_b);
    map_free(&km);
    PyMem_Free(grp);
    PyMem_Free(cnt);
    PyMem_Free(at);
    return result;
}

static int q_cmp(const void *a, const void *b) {
    long long x = *(const long long *)a, y = *(const long long *)b;
    return x < y ? -1 : (x > y);
}

PyDoc_STRVAR(stats_sorted_durations_doc,
             "stats_sorted_durations(starts, ends, idx, /)\n--\n\n"
             "stats_columns._sorted_durations_py: end - start of the spans `idx`, ascending, as bytes.");
static PyObject *hot_stats_sorted_durations(PyObject *self, PyObject *py_args) {
    PyObject *so, *eo, *io;
    if (!PyArg_ParseTuple(py_args, "OOO", &so, &eo, &io)) return NULL;
    PyObject *ks = NULL, *ke = NULL, *ki = NULL, *result = NULL;
    long long *d = NULL;
    Py_ssize_t n, ne, m;
    const long long *s = gt_column_items(so, &n, &ks);
    if (!s) goto out;
    const long long *e = gt_column_items(eo, &ne, &ke);
    if (!e) goto out;
    const long long *idx = gt_column_items(io, &m, &ki);
    if (!idx) goto out;
    if (ne != n) {
        PyErr_SetString(PyExc_ValueError, "stats_sorted_durations: columns of different lengths");
        goto out;
    }
    if (!(result = new_int64s(m, &d))) goto out;
    int sorted = 1;
    for (Py_ssize_t j = 0; j < m; j++) {
        long long i = idx[j];
        if (i < 0 || i >= n) {
            PyErr_SetString(PyExc_IndexError, "stats_sorted_durations: a span index out of range");
            Py_CLEAR(result);
            goto out;
        }
        if (__builtin_sub_overflow(e[i], s[i], &d[j])) { /* as the twin's int64 array refuses it */
            PyErr_SetString(PyExc_OverflowError, "stats_sorted_durations: a duration past 64 bits");
            Py_CLEAR(result);
            goto out;
        }
        if (j && d[j - 1] > d[j]) sorted = 0;
    }
    if (!sorted) qsort(d, (size_t)m, sizeof(long long), q_cmp);
out:
    Py_XDECREF(ks);
    Py_XDECREF(ke);
    Py_XDECREF(ki);
    return result;
}

PyDoc_STRVAR(stats_take_doc,
             "stats_take(idx, *columns, /)\n--\n\n"
             "stats_columns._take_py: for each column, its items at `idx`, as bytes of int64.");
static PyObject *hot_stats_take(PyObject *self, PyObject *py_args) {
    Py_ssize_t k = PyTuple_Size(py_args);
    if (k < 1) {
        PyErr_SetString(PyExc_TypeError, "stats_take: an index column and columns to take from");
        return NULL;
    }
    PyObject *ki = NULL, *result = NULL, *got = NULL;
    Py_ssize_t m;
    const long long *idx = gt_column_items(PyTuple_GetItem(py_args, 0), &m, &ki);
    if (!idx) goto out;
    if (!(got = PyTuple_New(k - 1))) goto out;
    for (Py_ssize_t c = 1; c < k; c++) {
        PyObject *kc = NULL;
        Py_ssize_t n;
        long long *d = NULL;
        const long long *col = gt_column_items(PyTuple_GetItem(py_args, c), &n, &kc);
        if (!col) goto out;
        PyObject *b = new_int64s(m, &d);
        if (!b) { Py_XDECREF(kc); goto out; }
        if (PyTuple_SetItem(got, c - 1, b) < 0) { Py_XDECREF(kc); goto out; }
        for (Py_ssize_t j = 0; j < m; j++) {
            long long i = idx[j];
            if (i < 0 || i >= n) {
                PyErr_SetString(PyExc_IndexError, "stats_take: a span index out of range");
                Py_XDECREF(kc);
                goto out;
            }
            d[j] = col[i];
        }
        Py_XDECREF(kc);
    }
    result = got;
    got = NULL;
out:
    Py_XDECREF(ki);
    Py_XDECREF(got);
    return result;
}

PyDoc_STRVAR(stats_step_of_doc,
             "stats_step_of(step_starts, step_ends, starts, /)\n--\n\n"
             "stats_columns._step_of_py: the step of each start (-1: none), as bytes of int64.");
static PyObject *hot_stats_step_of(PyObject *self, PyObject *py_args) {
    PyObject *so, *eo, *co;
    if (!PyArg_ParseTuple(py_args, "OOO", &so, &eo, &co)) return NULL;
    PyObject *ks = NULL, *ke = NULL, *kc = NULL, *result = NULL;
    long long *d = NULL;
    Py_ssize_t n, ne, m;
    const long long *ss = gt_column_items(so, &n, &ks);
    if (!ss) goto out;
    const long long *se = gt_column_items(eo, &ne, &ke);
    if (!se) goto out;
    const long long *cs = gt_column_items(co, &m, &kc);
    if (!cs) goto out;
    if (ne != n) {
        PyErr_SetString(PyExc_ValueError, "stats_step_of: step columns of different lengths");
        goto out;
    }
    if (!(result = new_int64s(m, &d))) goto out;
    for (Py_ssize_t i = 0; i < m; i++) {
        long long a = cs[i];
        Py_ssize_t lo = 0, hi = n; /* bisect_right: the first step that starts after a */
        while (lo < hi) {
            Py_ssize_t mid = lo + (hi - lo) / 2;
            if (a < ss[mid]) hi = mid;
            else lo = mid + 1;
        }
        d[i] = lo && a < se[lo - 1] ? (long long)(lo - 1) : -1;
    }
out:
    Py_XDECREF(ks);
    Py_XDECREF(ke);
    Py_XDECREF(kc);
    return result;
}

PyDoc_STRVAR(stats_track_split_doc,
             "stats_track_split(starts, ends, tracks, is_coll, track, /)\n--\n\n"
             "stats_columns._track_split_py: (starts, ends) of the collectives on `track`, then of the\n"
             "spans that are neither collectives nor on it, as four bytes of int64.");
static PyObject *hot_stats_track_split(PyObject *self, PyObject *py_args) {
    PyObject *so, *eo, *to, *co;
    long long t;
    if (!PyArg_ParseTuple(py_args, "OOOSL", &so, &eo, &to, &co, &t)) return NULL;
    PyObject *ks = NULL, *ke = NULL, *kt = NULL, *result = NULL;
    PyObject *b[4] = {NULL, NULL, NULL, NULL};
    long long *d[4] = {NULL, NULL, NULL, NULL};
    Py_ssize_t n, ne, nt;
    const long long *s = gt_column_items(so, &n, &ks);
    if (!s) goto out;
    const long long *e = gt_column_items(eo, &ne, &ke);
    if (!e) goto out;
    const long long *tr = gt_column_items(to, &nt, &kt);
    if (!tr) goto out;
    const char *c = PyBytes_AsString(co);
    if (!c) goto out;
    if (ne != n || nt != n || PyBytes_Size(co) != n) {
        PyErr_SetString(PyExc_ValueError, "stats_track_split: columns of different lengths");
        goto out;
    }
    Py_ssize_t mine = 0, others = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (c[i] && tr[i] == t) mine++;
        else if (!c[i] && tr[i] != t) others++;
    }
    if (!(b[0] = new_int64s(mine, &d[0])) || !(b[1] = new_int64s(mine, &d[1])) ||
        !(b[2] = new_int64s(others, &d[2])) || !(b[3] = new_int64s(others, &d[3])))
        goto out;
    Py_ssize_t m = 0, o = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (c[i] && tr[i] == t) {
            d[0][m] = s[i];
            d[1][m++] = e[i];
        } else if (!c[i] && tr[i] != t) {
            d[2][o] = s[i];
            d[3][o++] = e[i];
        }
    }
    result = PyTuple_Pack(4, b[0], b[1], b[2], b[3]);
out:
    Py_XDECREF(ks);
    Py_XDECREF(ke);
    Py_XDECREF(kt);
    for (int k = 0; k < 4; k++) Py_XDECREF(b[k]);
    return result;
}

static PyMethodDef stats_methods[] = {
    {"stats_groups", hot_stats_groups, METH_VARARGS, stats_groups_doc},
    {"stats_sorted_durations", hot_stats_sorted_durations, METH_VARARGS, stats_sorted_durations_doc},
    {"stats_take", hot_stats_take, METH_VARARGS, stats_take_doc},
    {"stats_step_of", hot_stats_step_of, METH_VARARGS, stats_step_of_doc},
    {"stats_track_split", hot_stats_track_split, METH_VARARGS, stats_track_split_doc},
    {NULL},
};

int gt_stats_init(PyObject *m) {
    if (!(s_unfinished = PyUnicode_InternFromString("unfinished")) || !(s_cover = PyUnicode_InternFromString("cover")) ||
        !(s_collective = PyUnicode_InternFromString("collective")))
        return -1;
    return PyModule_AddFunctions(m, stats_methods);
}
