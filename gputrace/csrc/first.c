/* The page's first document (viewer/first.py): one digest's span rows, as the parsed file gives
 * them (lists of ints), to the rows the page's first view draws, in one pass and no Python object
 * a row; and the order statistics of the steps' table across ranks (per step: the largest, who
 * holds it, the median; per rank and step the other ranks' median) that the first document, the
 * full one and the summary compute. Python twins: viewer/first.py `_rows_py`,
 * gputrace/stats_columns.py `_columns_py`, viewer/findings.py `_others_median_py`;
 * tests/test_first_rows.py holds each pair equal. */
#include "hot.h"

/* Span flags of the digest file (gputrace/trace/digestfile.py). */
#define F_COLL 1
#define F_COLL_TRUE 2
#define F_UNFINISHED 4

/* The i-th item of `list` as an int64: an exact int in range, else ValueError (the twin's). */
static int item_ll(PyObject *list, Py_ssize_t i, long long *out) {
    PyObject *x = PyList_GetItem(list, i); /* borrowed */
    if (!x) return -1;
    if (!PyLong_CheckExact(x)) {
        PyErr_SetString(PyExc_ValueError, "first_rows: a column holds something other than an integer");
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
    if (overflow) {
        PyErr_SetString(PyExc_ValueError, "first_rows: a number past 64 bits");
        return -1;
    }
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

static PyObject *int64_bytes(const long long *d, Py_ssize_t n) {
    return PyBytes_FromStringAndSize((const char *)d, n * (Py_ssize_t)sizeof(long long));
}

PyDoc_STRVAR(first_rows_doc,
             "first_rows(name, track, start, dur, flags, base, kinds, n_tracks, /)\n--\n\n"
             "viewer.first._rows_py: a digest's span columns (lists of ints; start as deltas from base) read\n"
             "once: (flags or-ed, in start order, per track its least start, largest end and whether it\n"
             "has rows (bytes of int64, int64, bytes), and the finished rows of three kinds in row order,\n"
             "each as (start, end, track) bytes of int64: the steps (kinds[name] == 1), the rows marked\n"
             "collective=True, the rows of a waiting name (kinds[name] == 2) not marked collective).\n"
             "ValueError for columns a digest's reader refuses.");
static PyObject *hot_first_rows(PyObject *self, PyObject *args) {
    PyObject *lists[5];
    long long base;
    Py_ssize_t n_tracks;
    PyObject *kinds_obj;
    if (!PyArg_ParseTuple(args, "OOOOOLSn", &lists[0], &lists[1], &lists[2], &lists[3], &lists[4], &base, &kinds_obj,
                          &n_tracks))
        return NULL;
    for (int c = 0; c < 5; c++) {
        if (!PyList_Check(lists[c])) {
            PyErr_SetString(PyExc_ValueError, "first_rows: a column that is not a list");
            return NULL;
        }
    }
    PyObject *names = lists[0], *tracks = lists[1], *starts = lists[2], *durs = lists[3], *flags = lists[4];
    Py_ssize_t n = PyList_Size(names);
    for (int c = 1; c < 5; c++) {
        if (PyList_Size(lists[c]) != n) {
            PyErr_SetString(PyExc_ValueError, "first_rows: span columns of different lengths");
            return NULL;
        }
    }
    if (n_tracks < 0) n_tracks = 0;
    const unsigned char *kinds = (const unsigned char *)PyBytes_AsString(kinds_obj);
    if (!kinds) return NULL;
    Py_ssize_t n_names = PyBytes_Size(kinds_obj);
    PyObject *result = NULL;
    long long *lo = PyMem_Calloc((size_t)n_tracks + 1, sizeof(long long));
    long long *hi = PyMem_Calloc((size_t)n_tracks + 1, sizeof(long long));
    char *has = PyMem_Calloc((size_t)n_tracks + 1, 1);
    long long *pick[3][3] = {{NULL}};
    Py_ssize_t count[3] = {0, 0, 0};
    int ok = lo && hi && has;
    for (int k = 0; k < 3 && ok; k++)
        for (int c = 0; c < 3 && ok; c++) ok = (pick[k][c] = PyMem_Malloc(((size_t)n + 1) * sizeof(long long))) != NULL;
    if (!ok) {
        PyErr_NoMemory();
        goto out;
    }
    long long at = base, flags_or = 0;
    int in_order = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long name, track, delta, dur, f, end;
        if (item_ll(names, i, &name) < 0 || item_ll(tracks, i, &track) < 0 || item_ll(starts, i, &delta) < 0 ||
            item_ll(durs, i, &dur) < 0 || item_ll(flags, i, &f) < 0)
            goto out;
        if (f < 0 || f > 7) {
            PyErr_SetString(PyExc_ValueError, "first_rows: a span's flags out of range");
            goto out;
        }
        if (track < 0 || track >= n_tracks || name < 0 || name >= n_names || dur < 0) {
            PyErr_SetString(PyExc_ValueError, "first_rows: a span out of range");
            goto out;
        }
        if (__builtin_add_overflow(at, delta, &at) || __builtin_add_overflow(at, dur, &end)) {
            PyErr_SetString(PyExc_ValueError, "first_rows: a time past 64 bits");
            goto out;
        }
        if (i && delta < 0) in_order = 0;
        flags_or |= f;
        if (!has[track]) {
            has[track] = 1;
            lo[track] = at;
            hi[track] = end;
        } else {
            if (at < lo[track]) lo[track] = at;
            if (end > hi[track]) hi[track] = end;
        }
        if (f & F_UNFINISHED) continue;
        int kind = kinds[name];
        int which[3] = {kind == 1, (f & F_COLL_TRUE) != 0, kind == 2 && !(f & F_COLL)};
        for (int k = 0; k < 3; k++) {
            if (!which[k]) continue;
            pick[k][0][count[k]] = at;
            pick[k][1][count[k]] = end;
            pick[k][2][count[k]++] = track;
        }
    }
    PyObject *groups = PyTuple_New(3);
    if (!groups) goto out;
    for (int k = 0; k < 3; k++) {
        PyObject *g = Py_BuildValue("(NNN)", int64_bytes(pick[k][0], count[k]), int64_bytes(pick[k][1], count[k]),
                                    int64_bytes(pick[k][2], count[k]));
        if (!g || PyTuple_SetItem(groups, k, g) < 0) {
            Py_DECREF(groups);
            goto out;
        }
    }
    result = Py_BuildValue("(LONNNN)", flags_or, in_order ? Py_True : Py_False, int64_bytes(lo, n_tracks),
                           int64_bytes(hi, n_tracks), PyBytes_FromStringAndSize(has, n_tracks), groups);
out:
    PyMem_Free(lo);
    PyMem_Free(hi);
    PyMem_Free(has);
    for (int k = 0; k < 3; k++)
        for (int c = 0; c < 3; c++) PyMem_Free(pick[k][c]);
    return result;
}

/* ---- the steps' table across ranks: per step (a column of `rows`), order statistics --------- */

/* `rows` (a list of n rows, each a list of ints or an int64 array of at least `count` items) as a
 * count x n matrix of int64 (column-major: a step's values together). NULL with an error set. */
static long long *read_rows(PyObject *rows, Py_ssize_t count, Py_ssize_t *n_out) {
    if (!PyList_Check(rows)) {
        PyErr_SetString(PyExc_TypeError, "first: rows is not a list");
        return NULL;
    }
    Py_ssize_t n = PyList_Size(rows);
    *n_out = n;
    long long *m = PyMem_Malloc(((size_t)n * (size_t)count + 1) * sizeof(long long));
    if (!m) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t r = 0; r < n; r++) {
        PyObject *row = PyList_GetItem(rows, r);
        if (!row) goto fail;
        if (PyList_Check(row)) {
            if (PyList_Size(row) < count) goto short_row;
            for (Py_ssize_t k = 0; k < count; k++) {
                PyObject *x = PyList_GetItem(row, k);
                if (!x) goto fail;
                if (!PyLong_Check(x)) {
                    PyErr_SetString(PyExc_TypeError, "first: a row holds something other than an integer");
                    goto fail;
                }
                long long v = PyLong_AsLongLong(x); /* OverflowError past 64 bits: the twin takes those */
                if (v == -1 && PyErr_Occurred()) goto fail;
                m[k * n + r] = v;
            }
        } else {
            PyObject *keep = NULL;
            Py_ssize_t len;
            const long long *items = gt_column_items(row, &len, &keep);
            if (!items) goto fail;
            if (len < count) {
                Py_XDECREF(keep);
                goto short_row;
            }
            for (Py_ssize_t k = 0; k < count; k++) m[k * n + r] = items[k];
            Py_XDECREF(keep);
        }
    }
    return m;
short_row:
    PyErr_SetString(PyExc_ValueError, "first: a row shorter than the count");
fail:
    PyMem_Free(m);
    return NULL;
}

static int ll_cmp(const void *a, const void *b) {
    long long x = *(const long long *)a, y = *(const long long *)b;
    return (x > y) - (x < y);
}

/* floor((a + b) / 2), as Python's (a + b) // 2, for any two int64. */
static long long floor_half(long long a, long long b) { return (long long)(((__int128)a + b) >> 1); }

static PyObject *list_of(const long long *v, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyLong_FromLongLong(v[i]);
        if (!x || PyList_SetItem(out, i, x) < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

/* The two column functions' start: their arguments (rows, count) parsed, the rows read as columns
 * (read_rows), a scratch column of n values in *col; fewer than `least` rows is a ValueError saying
 * `few`. NULL (nothing held) on error. */
static long long *columns_of(PyObject *args, Py_ssize_t least, const char *few, Py_ssize_t *count,
                             Py_ssize_t *n, long long **col) {
    PyObject *rows;
    if (!PyArg_ParseTuple(args, "On", &rows, count)) return NULL;
    if (*count < 0) *count = 0;
    long long *m = read_rows(rows, *count, n);
    if (!m) return NULL;
    if (!(*col = PyMem_Malloc(((size_t)*n + 1) * sizeof(long long)))) {
        PyErr_NoMemory();
    } else if (*n < least) {
        PyErr_SetString(PyExc_ValueError, few);
        PyMem_Free(*col);
    } else {
        return m;
    }
    PyMem_Free(m);
    return NULL;
}

PyDoc_STRVAR(first_columns_doc,
             "first_columns(rows, count, /)\n--\n\n"
             "stats_columns._columns_py: per column k < count of `rows` (n >= 1 rows: lists of ints or int64\n"
             "arrays), its largest value, the first row holding it, and its median (the middle value, or the\n"
             "floor of the two middle ones' mean), as three lists.");
static PyObject *hot_first_columns(PyObject *self, PyObject *args) {
    Py_ssize_t count, n;
    long long *col;
    long long *m = columns_of(args, 1, "first_columns: no rows", &count, &n, &col);
    if (!m) return NULL;
    PyObject *result = NULL;
    long long *out = PyMem_Malloc(((size_t)count * 3 + 1) * sizeof(long long));
    if (!out) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t k = 0; k < count; k++) {
        const long long *v = m + k * n;
        Py_ssize_t j = 0;
        for (Py_ssize_t r = 1; r < n; r++)
            if (v[r] > v[j]) j = r; /* the first largest */
        memcpy(col, v, (size_t)n * sizeof(long long));
        qsort(col, (size_t)n, sizeof(long long), ll_cmp);
        out[k] = v[j];
        out[count + k] = j;
        out[2 * count + k] = n % 2 ? col[n / 2] : floor_half(col[n / 2 - 1], col[n / 2]);
    }
    result = Py_BuildValue("(NNN)", list_of(out, count), list_of(out + count, count), list_of(out + 2 * count, count));
out:
    PyMem_Free(m);
    PyMem_Free(col);
    PyMem_Free(out);
    return result;
}

PyDoc_STRVAR(first_others_median_doc,
             "first_others_median(rows, count, /)\n--\n\n"
             "viewer.findings._others_median_py for n >= 2 rows (lists of ints or int64 arrays): per row and\n"
             "column k < count, the median of the other rows' values in that column, as lists.");
static PyObject *hot_first_others_median(PyObject *self, PyObject *args) {
    Py_ssize_t count, n;
    long long *col;
    long long *m = columns_of(args, 2, "first_others_median: fewer than two rows", &count, &n, &col);
    if (!m) return NULL;
    PyObject *result = NULL;
    long long *out = PyMem_Malloc(((size_t)n * (size_t)count + 1) * sizeof(long long));
    if (!out) {
        PyErr_NoMemory();
        goto out;
    }
    Py_ssize_t others = n - 1;
    for (Py_ssize_t k = 0; k < count; k++) {
        const long long *v = m + k * n;
        memcpy(col, v, (size_t)n * sizeof(long long));
        qsort(col, (size_t)n, sizeof(long long), ll_cmp);
        for (Py_ssize_t r = 0; r < n; r++) {
            long long x = v[r];
            long long got;
            if (others % 2) { /* the j-th of the others: v[j] where x sorts after it, else v[j + 1] */
                Py_ssize_t j = others / 2;
                got = x > col[j] ? col[j] : col[j + 1];
            } else {
                Py_ssize_t j = others / 2 - 1;
                long long first = x > col[j] ? col[j] : col[j + 1];
                long long second = x > col[j + 1] ? col[j + 1] : col[j + 2];
                got = floor_half(first, second);
            }
            out[r * count + k] = got;
        }
    }
    if (!(result = PyList_New(n))) goto out;
    for (Py_ssize_t r = 0; r < n; r++) {
        PyObject *row = list_of(out + r * count, count);
        if (!row || PyList_SetItem(result, r, row) < 0) {
            Py_CLEAR(result);
            goto out;
        }
    }
out:
    PyMem_Free(m);
    PyMem_Free(col);
    PyMem_Free(out);
    return result;
}

static PyMethodDef first_methods[] = {
    {"first_rows", hot_first_rows, METH_VARARGS, first_rows_doc},
    {"first_columns", hot_first_columns, METH_VARARGS, first_columns_doc},
    {"first_others_median", hot_first_others_median, METH_VARARGS, first_others_median_doc},
    {NULL, NULL, 0, NULL},
};

int gt_first_init(PyObject *m) { return PyModule_AddFunctions(m, first_methods); }
