/* The digest's loops: the per-span work of digest.Builder over a recorder's columns
 * (digest_rows, digest_fold), and reading an int64 column where it lies. */
#include "hot.h"

/* ---- per-rank digests: the per-span loops of digest.Builder ------------------------------------ */

/* A column's items where they lie: an array.array of 8-byte signed integers ('q', or 'l' where a
 * long is 8 bytes) is read through its own buffer (array.buffer_info()), valid while no Python
 * code runs, which the loops that use this never do; anything else is copied. *keep: the copy to
 * release, or NULL. Copying 100k spans' columns (3 MB, fresh pages) cost as much as the loop. */
static PyObject *s_buffer_info, *s_typecode;

const void *gt_column_items(PyObject *col, Py_ssize_t *n, PyObject **keep) {
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
    PyObject *b = gt_array_bytes(col, 8, n);
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
        if (!(p[i] = gt_column_items(src[i], &n[i], &c->b[i]))) return -1;
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
    if (nb < 1 || !(sb = gt_array_bytes(steps, sizeof(long long), &nsteps)) ||
        !(bb = gt_array_bytes(boundso, sizeof(long long), &nbounds)) || nbounds < 2 || nbounds > 1000) {
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

static PyMethodDef digest_methods[] = {
    {"digest_rows", hot_digest_rows, METH_VARARGS, digest_rows_doc},
    {"digest_fold", hot_digest_fold, METH_VARARGS, digest_fold_doc},
    {NULL},
};

int gt_digest_init(PyObject *m) {
    if (!(s_buffer_info = PyUnicode_InternFromString("buffer_info")) ||
        !(s_typecode = PyUnicode_InternFromString("typecode")))
        return -1;
    return PyModule_AddFunctions(m, digest_methods);
}
