/* The digest's loops: the per-span work of digest.Builder over a recorder's columns
 * (digest_rows, digest_fold; digest_cover and digest_nest for digest_breakdown.Local), and reading
 * an int64 column where it lies. */
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

/* ---- the step breakdown's and self time's loops (digest_breakdown.py) ---------------------------- */

/* Bytes of n int64 from v (an empty column when n is 0). */
static PyObject *bytes_ll(const long long *v, Py_ssize_t n) {
    return PyBytes_FromStringAndSize(n ? (const char *)v : NULL, n * 8);
}

/* bisect.bisect_left(a[0:n], x) */
static Py_ssize_t bisect_left_ll(const long long *a, Py_ssize_t n, long long x) {
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (a[mid] < x) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* An int64 column of any length (array.array 'q', read in place where it can be). */
typedef struct {
    PyObject *keep;
    const long long *v;
    Py_ssize_t n;
} Col;

static int col_read(Col *c, PyObject *o) {
    c->keep = NULL;
    c->v = (const long long *)gt_column_items(o, &c->n, &c->keep);
    return c->v ? 0 : -1;
}

/* The columns the comparators below read: qsort has no context argument everywhere, and the GIL
 * is held throughout (no Python code runs while they sort). */
static const Cols *sort_cols;

/* The cover's order: by track, start, end, then as given. */
static int cover_cmp(const void *a, const void *b) {
    Py_ssize_t i = *(const Py_ssize_t *)a, j = *(const Py_ssize_t *)b;
    const Cols *c = sort_cols;
    if (c->track[i] != c->track[j]) return c->track[i] < c->track[j] ? -1 : 1;
    if (c->start[i] != c->start[j]) return c->start[i] < c->start[j] ? -1 : 1;
    if (c->end[i] != c->end[j]) return c->end[i] < c->end[j] ? -1 : 1;
    return i < j ? -1 : (i > j);
}

/* The nesting order: by track, end, start descending, then as given. */
static int nest_cmp(const void *a, const void *b) {
    Py_ssize_t i = *(const Py_ssize_t *)a, j = *(const Py_ssize_t *)b;
    const Cols *c = sort_cols;
    if (c->track[i] != c->track[j]) return c->track[i] < c->track[j] ? -1 : 1;
    if (c->end[i] != c->end[j]) return c->end[i] < c->end[j] ? -1 : 1;
    if (c->start[i] != c->start[j]) return c->start[i] > c->start[j] ? -1 : 1;
    return i < j ? -1 : (i > j);
}

/* Sort span indices by `cmp` (track first): a stable counting sort by track, then an insertion
 * sort within each track, which is near linear for spans that come nearly in order, as a
 * recorder's do (children before their parents); a track whose spans need more moves than a few
 * per span is sorted by qsort instead. */
static int sort_spans(Py_ssize_t *idx, Py_ssize_t m, const Cols *c, int (*cmp)(const void *, const void *)) {
    sort_cols = c;
    long long maxt = -1;
    for (Py_ssize_t i = 0; i < m; i++)
        if (c->track[idx[i]] > maxt) maxt = c->track[idx[i]];
    if (maxt > 4 * (long long)m + 1024) { /* track numbers far apart: no counting */
        qsort(idx, (size_t)m, sizeof(Py_ssize_t), cmp);
        return 0;
    }
    Py_ssize_t *cnt = PyMem_Calloc((size_t)maxt + 2, sizeof(Py_ssize_t));
    Py_ssize_t *tmp = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(m ? m : 1));
    if (!cnt || !tmp) {
        PyMem_Free(cnt);
        PyMem_Free(tmp);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < m; i++) cnt[c->track[idx[i]] + 1]++;
    for (long long t = 0; t <= maxt; t++) cnt[t + 1] += cnt[t];
    for (Py_ssize_t i = 0; i < m; i++) tmp[cnt[c->track[idx[i]]]++] = idx[i];
    memcpy(idx, tmp, sizeof(Py_ssize_t) * (size_t)m);
    PyMem_Free(cnt);
    PyMem_Free(tmp);
    for (Py_ssize_t lo = 0; lo < m;) {
        Py_ssize_t hi = lo;
        while (hi < m && c->track[idx[hi]] == c->track[idx[lo]]) hi++;
        long long moves = 0, budget = 16 * (long long)(hi - lo) + 64;
        for (Py_ssize_t i = lo + 1; i < hi; i++) {
            Py_ssize_t x = idx[i], j = i;
            while (j > lo && cmp(&idx[j - 1], &x) > 0) {
                idx[j] = idx[j - 1];
                j--;
                moves++;
            }
            idx[j] = x;
            if (moves > budget) {
                qsort(idx + lo, (size_t)(hi - lo), sizeof(Py_ssize_t), cmp);
                break;
            }
        }
        lo = hi;
    }
    return 0;
}

static PyObject *tuple_of_vecs(Vec *v, int n) {
    PyObject *t = PyTuple_New(n);
    if (!t) return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *l = list_ll(v[i].v, v[i].n);
        if (!l) { Py_DECREF(t); return NULL; }
        PyTuple_SetItem(t, i, l);
    }
    return t;
}

PyDoc_STRVAR(digest_cover_doc,
             "digest_cover(names, tracks, starts, ends, skip, row_mask, step_starts, step_ends, step_tracks,\n"
             "             as_bytes=False, /)\n--\n\n"
             "digest_breakdown._cover_py: the union per track of the spans not set in skip, not of a row\n"
             "name, not other tools', not empty or inverted, and not a step's ancestor: (tracks, starts, ends)\n"
             "of disjoint intervals, by track then start.");
static PyObject *hot_digest_cover(PyObject *self, PyObject *args) {
    PyObject *names, *tracks, *starts, *ends, *skipo, *sso, *seo, *sto;
    const char *mask;
    Py_ssize_t nmask;
    int as_bytes = 0; /* the three columns as bytes of int64, not lists (stats: 8 bytes an interval) */
    if (!PyArg_ParseTuple(args, "OOOOOy#OOO|p", &names, &tracks, &starts, &ends, &skipo, &mask, &nmask, &sso, &seo, &sto,
                          &as_bytes))
        return NULL;
    Cols c;
    Col ss = {0}, se = {0}, st = {0};
    Py_ssize_t *p = NULL;
    Vec out[3] = {{0}};
    PyObject *result = NULL;
    const char *skip = NULL;
    if (cols_read(&c, names, tracks, starts, ends) < 0) return NULL;
    if (skipo != Py_None) {
        if (!PyBytes_Check(skipo) || PyBytes_Size(skipo) != c.n) {
            PyErr_SetString(PyExc_TypeError, "digest_cover: skip is not bytes of the columns' length");
            goto out;
        }
        skip = PyBytes_AsString(skipo);
    }
    if (col_read(&ss, sso) < 0 || col_read(&se, seo) < 0 || col_read(&st, sto) < 0) goto out;
    if (se.n != ss.n || st.n != ss.n) {
        PyErr_SetString(PyExc_ValueError, "digest_cover: step columns of different lengths");
        goto out;
    }
    p = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(c.n ? c.n : 1));
    if (!p) { PyErr_NoMemory(); goto out; }
    Py_ssize_t m = 0;
    for (Py_ssize_t i = 0; i < c.n; i++) {
        long long t = c.track[i], s = c.start[i], e = c.end[i], k = c.name[i];
        if (t < 0 || e <= s || (skip && skip[i]) || (k >= 0 && k < nmask && mask[k])) continue;
        Py_ssize_t j = bisect_left_ll(ss.v, ss.n, s); /* breakdown.is_ancestor */
        if (j < ss.n && se.v[j] <= e && st.v[j] == t && (ss.v[j] > s || se.v[j] < e)) continue;
        p[m++] = i;
    }
    if (sort_spans(p, m, &c, cover_cmp) < 0) goto out;
    if (as_bytes) { /* counted first, then written to bytes of their exact size */
        Py_ssize_t nout = 0;
        long long lt = 0, le = 0;
        for (Py_ssize_t k = 0; k < m; k++) {
            Py_ssize_t i = p[k];
            if (nout && lt == c.track[i] && c.start[i] <= le) {
                if (c.end[i] > le) le = c.end[i];
            } else {
                nout++;
                lt = c.track[i];
                le = c.end[i];
            }
        }
        PyObject *b[3] = {NULL, NULL, NULL};
        long long *w[3];
        for (int j = 0; j < 3; j++) {
            if (!(b[j] = PyBytes_FromStringAndSize(NULL, nout * 8))) break;
            w[j] = (long long *)PyBytes_AsString(b[j]);
        }
        if (b[2]) {
            Py_ssize_t o = 0;
            for (Py_ssize_t k = 0; k < m; k++) {
                Py_ssize_t i = p[k];
                if (o && w[0][o - 1] == c.track[i] && c.start[i] <= w[2][o - 1]) {
                    if (c.end[i] > w[2][o - 1]) w[2][o - 1] = c.end[i];
                } else {
                    w[0][o] = c.track[i];
                    w[1][o] = c.start[i];
                    w[2][o] = c.end[i];
                    o++;
                }
            }
            result = PyTuple_Pack(3, b[0], b[1], b[2]);
        }
        for (int j = 0; j < 3; j++) Py_XDECREF(b[j]);
        goto out;
    }
    for (Py_ssize_t k = 0; k < m; k++) {
        Py_ssize_t n = out[0].n, i = p[k];
        long long t = c.track[i], s = c.start[i], e = c.end[i];
        if (n && out[0].v[n - 1] == t && s <= out[2].v[n - 1]) {
            if (e > out[2].v[n - 1]) out[2].v[n - 1] = e;
        } else if (vec_push(&out[0], t) < 0 || vec_push(&out[1], s) < 0 || vec_push(&out[2], e) < 0) {
            goto out;
        }
    }
    result = tuple_of_vecs(out, 3); /* as_bytes returned above */
out:
    cols_free(&c);
    Py_XDECREF(ss.keep);
    Py_XDECREF(se.keep);
    Py_XDECREF(st.keep);
    PyMem_Free(p);
    for (int i = 0; i < 3; i++) vec_free(&out[i]);
    return result;
}

PyDoc_STRVAR(digest_nest_doc,
             "digest_nest(names, tracks, starts, ends, skip, step_starts, bucket, nb, carry_tracks, carry_starts,\n"
             "            carry_ends, floor, lean=False, carry_bytes=False, /)\n--\n\n"
             "digest_breakdown._nest_py: per key, the time its spans' children took; the spans not yet taken\n"
             "after the batch; the spans that took every carried span of their track and start at or before\n"
             "floor[track]. NotImplemented where a sum would pass 2^63.");
static PyObject *hot_digest_nest(PyObject *self, PyObject *args) {
    PyObject *names, *tracks, *starts, *ends, *skipo, *steps, *cto, *cso, *ceo, *flo;
    long bucket, nb;
    int lean = 0; /* the keys' children's time only: no spans left untaken (stats reads a whole rank at once) */
    int carry_bytes = 0; /* the spans left untaken as int64 bytes, not lists (they pass every batch) */
    if (!PyArg_ParseTuple(args, "OOOOOOllOOOO|pp", &names, &tracks, &starts, &ends, &skipo, &steps, &bucket, &nb, &cto,
                          &cso, &ceo, &flo, &lean, &carry_bytes))
        return NULL;
    Cols c;
    Col sb = {0}, ct = {0}, cs = {0}, ce = {0}, fl = {0};
    Py_ssize_t *order = NULL;
    Vec out[8] = {{0}}; /* ck, cn, ot, os, oe, bk, bt, bs */
    Vec ss = {0}, se = {0}; /* the stack of the track at hand */
    I64Map keys = {0};
    PyObject *result = NULL;
    const char *skip = NULL;
    if (cols_read(&c, names, tracks, starts, ends) < 0) return NULL;
    if (skipo != Py_None) {
        if (!PyBytes_Check(skipo) || PyBytes_Size(skipo) != c.n) {
            PyErr_SetString(PyExc_TypeError, "digest_nest: skip is not bytes of the columns' length");
            goto out;
        }
        skip = PyBytes_AsString(skipo);
    }
    if (nb < 1) {
        PyErr_SetString(PyExc_ValueError, "digest_nest: bad buckets");
        goto out;
    }
    if (col_read(&sb, steps) < 0 || col_read(&ct, cto) < 0 || col_read(&cs, cso) < 0 || col_read(&ce, ceo) < 0 ||
        col_read(&fl, flo) < 0)
        goto out;
    if (cs.n != ct.n || ce.n != ct.n) {
        PyErr_SetString(PyExc_ValueError, "digest_nest: carried columns of different lengths");
        goto out;
    }
    order = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(c.n ? c.n : 1));
    if (!order || map_init(&keys, 64) < 0) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto out;
    }
    Py_ssize_t m = 0;
    for (Py_ssize_t i = 0; i < c.n; i++)
        if (c.track[i] >= 0 && c.end[i] >= c.start[i] && !(skip && skip[i])) order[m++] = i;
    if (sort_spans(order, m, &c, nest_cmp) < 0) goto out;
    Py_ssize_t cp = 0, a = 0;
    while (a < m || cp < ct.n) {
        long long t = a < m ? c.track[order[a]] : LLONG_MAX;
        /* carried tracks before this one pass through */
        while (cp < ct.n && ct.v[cp] < t) {
            if (lean) { cp++; continue; }
            if (vec_push(&out[2], ct.v[cp]) < 0 || vec_push(&out[3], cs.v[cp]) < 0 || vec_push(&out[4], ce.v[cp]) < 0)
                goto out;
            cp++;
        }
        if (a >= m) break;
        ss.n = se.n = 0;
        while (cp < ct.n && ct.v[cp] == t) {
            if (vec_push(&ss, cs.v[cp]) < 0 || vec_push(&se, ce.v[cp]) < 0) goto out;
            cp++;
        }
        for (; a < m && c.track[order[a]] == t; a++) {
            Py_ssize_t i = order[a];
            long long s = c.start[i], took = 0;
            while (ss.n && ss.v[ss.n - 1] >= s) {
                se.n = --ss.n;
                long long d = se.v[ss.n] - ss.v[ss.n];
                if (d < 0 || d > LLONG_MAX - took) { result = Py_NewRef(Py_NotImplemented); goto out; }
                took += d;
            }
            long b = bucket >= 0 ? bucket : (long)bisect_right_ll(sb.v, sb.n, s);
            if (b > nb - 1) b = nb - 1;
            long long key = (long long)c.name[i] * nb + b;
            if (took) {
                Py_ssize_t k = map_index(&keys, key, out[0].n);
                if (k < 0) goto out;
                if (k == out[0].n && (vec_push(&out[0], key) < 0 || vec_push(&out[1], 0) < 0)) goto out;
                if (took > LLONG_MAX - out[1].v[k]) { result = Py_NewRef(Py_NotImplemented); goto out; }
                out[1].v[k] += took;
            }
            if (!ss.n && t < fl.n && s <= fl.v[t]) {
                if (vec_push(&out[5], key) < 0 || vec_push(&out[6], t) < 0 || vec_push(&out[7], s) < 0) goto out;
            }
            if (vec_push(&ss, s) < 0 || vec_push(&se, c.end[i]) < 0) goto out;
        }
        for (Py_ssize_t j = 0; j < ss.n && !lean; j++)
            if (vec_push(&out[2], t) < 0 || vec_push(&out[3], ss.v[j]) < 0 || vec_push(&out[4], se.v[j]) < 0) goto out;
    }
    if (!carry_bytes) {
        result = tuple_of_vecs(out, 8);
        goto out;
    }
    if (!(result = PyTuple_New(8))) goto out;
    for (int j = 0; j < 8; j++) {
        PyObject *col = j >= 2 && j < 5 ? bytes_ll(out[j].v, out[j].n) : list_ll(out[j].v, out[j].n);
        if (!col) { Py_CLEAR(result); break; }
        PyTuple_SetItem(result, j, col);
    }
out:
    cols_free(&c);
    Py_XDECREF(sb.keep);
    Py_XDECREF(ct.keep);
    Py_XDECREF(cs.keep);
    Py_XDECREF(ce.keep);
    Py_XDECREF(fl.keep);
    PyMem_Free(order);
    for (int i = 0; i < 8; i++) vec_free(&out[i]);
    vec_free(&ss);
    vec_free(&se);
    map_free(&keys);
    return result;
}

/* ---- the launch lags' host entries (digest_breakdown.Local) ------------------------------------- */

PyDoc_STRVAR(digest_entries_doc,
             "digest_entries(entry, tracks, starts, ends, skip, cuda_mask, /)\n--\n\n"
             "digest_breakdown._entries_py: (host entry, device start) of the spans with a host entry (> 0)\n"
             "on a CUDA track (cuda_mask, a byte a track), not inverted, not set in skip; two int64 columns\n"
             "as bytes, in span order.");
static PyObject *hot_digest_entries(PyObject *self, PyObject *args) {
    PyObject *eo, *to, *so, *no, *skipo;
    const char *mask;
    Py_ssize_t nmask;
    if (!PyArg_ParseTuple(args, "OOOOOy#", &eo, &to, &so, &no, &skipo, &mask, &nmask)) return NULL;
    Col e = {0}, t = {0}, s = {0}, n = {0};
    Vec ox = {0}, os = {0};
    PyObject *result = NULL, *bx = NULL, *bs = NULL;
    const char *skip = NULL;
    if (col_read(&e, eo) < 0 || col_read(&t, to) < 0 || col_read(&s, so) < 0 || col_read(&n, no) < 0) goto out;
    if (t.n != e.n || s.n != e.n || n.n != e.n) {
        PyErr_SetString(PyExc_ValueError, "digest_entries: columns of different lengths");
        goto out;
    }
    if (skipo != Py_None) {
        if (!PyBytes_Check(skipo) || PyBytes_Size(skipo) != e.n) {
            PyErr_SetString(PyExc_TypeError, "digest_entries: skip is not bytes of the columns' length");
            goto out;
        }
        skip = PyBytes_AsString(skipo);
    }
    for (Py_ssize_t i = 0; i < e.n; i++) {
        long long tr = t.v[i];
        if (e.v[i] > 0 && tr >= 0 && tr < nmask && mask[tr] && n.v[i] >= s.v[i] && !(skip && skip[i]))
            if (vec_push(&ox, e.v[i]) < 0 || vec_push(&os, s.v[i]) < 0) goto out;
    }
    if ((bx = bytes_ll(ox.v, ox.n)) && (bs = bytes_ll(os.v, os.n))) result = PyTuple_Pack(2, bx, bs);
out:
    Py_XDECREF(bx);
    Py_XDECREF(bs);
    Py_XDECREF(e.keep);
    Py_XDECREF(t.keep);
    Py_XDECREF(s.keep);
    Py_XDECREF(n.keep);
    vec_free(&ox);
    vec_free(&os);
    return result;
}

PyDoc_STRVAR(digest_lags_doc,
             "digest_lags(xs, ss, step_starts, step_ends, final, /)\n--\n\n"
             "digest_breakdown._lags_py: host entries xs at device starts ss placed in the steps (ascending\n"
             "starts) by device start: per step that got one, (step index, entry, start) of its least\n"
             "(start, entry), steps ascending, as lists; then the entries that wait (unless final: none\n"
             "steps, or starting at or past the last step's end) as two int64 columns of bytes, in order.");
static PyObject *hot_digest_lags(PyObject *self, PyObject *args) {
    PyObject *xo, *so, *sso, *seo;
    int final;
    if (!PyArg_ParseTuple(args, "OOOOp", &xo, &so, &sso, &seo, &final)) return NULL;
    Col x = {0}, s = {0}, ss = {0}, se = {0};
    Vec wx = {0}, ws = {0}, out[3] = {{0}};
    Py_ssize_t *best = NULL;
    PyObject *result = NULL, *placed = NULL, *bx = NULL, *bs = NULL;
    if (col_read(&x, xo) < 0 || col_read(&s, so) < 0 || col_read(&ss, sso) < 0 || col_read(&se, seo) < 0) goto out;
    if (s.n != x.n || se.n != ss.n) {
        PyErr_SetString(PyExc_ValueError, "digest_lags: columns of different lengths");
        goto out;
    }
    best = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(ss.n ? ss.n : 1));
    if (!best) { PyErr_NoMemory(); goto out; }
    for (Py_ssize_t j = 0; j < ss.n; j++) best[j] = -1;
    long long last_end = LLONG_MIN;
    for (Py_ssize_t j = 0; j < se.n; j++)
        if (se.v[j] > last_end) last_end = se.v[j];
    for (Py_ssize_t i = 0; i < x.n; i++) {
        long long v = s.v[i];
        Py_ssize_t j = bisect_right_ll(ss.v, ss.n, v) - 1;
        if (j >= 0 && v < se.v[j]) {
            Py_ssize_t b = best[j];
            if (b < 0 || v < s.v[b] || (v == s.v[b] && x.v[i] < x.v[b])) best[j] = i;
        } else if (!final && (!ss.n || v >= last_end)) {
            if (vec_push(&wx, x.v[i]) < 0 || vec_push(&ws, v) < 0) goto out;
        }
    }
    for (Py_ssize_t j = 0; j < ss.n; j++) {
        Py_ssize_t b = best[j];
        if (b >= 0 && (vec_push(&out[0], j) < 0 || vec_push(&out[1], x.v[b]) < 0 || vec_push(&out[2], s.v[b]) < 0))
            goto out;
    }
    if ((placed = tuple_of_vecs(out, 3)) && (bx = bytes_ll(wx.v, wx.n)) && (bs = bytes_ll(ws.v, ws.n)))
        result = Py_BuildValue("(OOOOO)", PyTuple_GetItem(placed, 0), PyTuple_GetItem(placed, 1),
                               PyTuple_GetItem(placed, 2), bx, bs);
out:
    Py_XDECREF(placed);
    Py_XDECREF(bx);
    Py_XDECREF(bs);
    Py_XDECREF(x.keep);
    Py_XDECREF(s.keep);
    Py_XDECREF(ss.keep);
    Py_XDECREF(se.keep);
    PyMem_Free(best);
    vec_free(&wx);
    vec_free(&ws);
    for (int i = 0; i < 3; i++) vec_free(&out[i]);
    return result;
}

/* ---- interval sets of the step breakdown (breakdown.py: union, minus, within) ------------------- */

typedef struct {
    long long s, e;
} Iv;

static int iv_cmp(const void *a, const void *b) {
    const Iv *x = a, *y = b;
    if (x->s != y->s) return x->s < y->s ? -1 : 1;
    if (x->e != y->e) return x->e < y->e ? -1 : 1;
    return 0;
}

static PyObject *pair_of_vecs(Vec *a, Vec *b) {
    PyObject *x = list_ll(a->v, a->n), *y = x ? list_ll(b->v, b->n) : NULL;
    PyObject *t = y ? PyTuple_Pack(2, x, y) : NULL;
    Py_XDECREF(x);
    Py_XDECREF(y);
    return t;
}

PyDoc_STRVAR(interval_union_doc,
             "interval_union(starts, ends, as_bytes=False, /)\n--\n\n"
             "breakdown.union: the union of [start, end) intervals as sorted, disjoint (starts, ends).");
static PyObject *hot_interval_union(PyObject *self, PyObject *args) {
    PyObject *so, *eo;
    int as_bytes = 0; /* (starts, ends) as bytes of int64, not lists */
    if (!PyArg_ParseTuple(args, "OO|p", &so, &eo, &as_bytes)) return NULL;
    Col a = {0}, b = {0};
    Iv *v = NULL;
    Vec us = {0}, ue = {0};
    PyObject *result = NULL;
    if (col_read(&a, so) < 0 || col_read(&b, eo) < 0) goto out;
    if (a.n != b.n) {
        PyErr_SetString(PyExc_ValueError, "interval_union: columns of different lengths");
        goto out;
    }
    v = PyMem_Malloc(sizeof(Iv) * (size_t)(a.n ? a.n : 1));
    if (!v) { PyErr_NoMemory(); goto out; }
    Py_ssize_t m = 0;
    int sorted = 1;
    for (Py_ssize_t i = 0; i < a.n; i++) {
        if (b.v[i] <= a.v[i]) continue;
        v[m].s = a.v[i];
        v[m].e = b.v[i];
        if (m && iv_cmp(&v[m - 1], &v[m]) > 0) sorted = 0;
        m++;
    }
    if (!sorted) qsort(v, (size_t)m, sizeof(Iv), iv_cmp);
    if (as_bytes) { /* merged in place, then written to bytes of their exact size: 32 bytes an interval at most */
        Py_ssize_t k = 0;
        for (Py_ssize_t i = 0; i < m; i++) {
            if (k && v[i].s <= v[k - 1].e) {
                if (v[i].e > v[k - 1].e) v[k - 1].e = v[i].e;
            } else {
                v[k++] = v[i];
            }
        }
        PyObject *bs = PyBytes_FromStringAndSize(NULL, k * 8);
        PyObject *be = bs ? PyBytes_FromStringAndSize(NULL, k * 8) : NULL;
        if (be) {
            long long *ps = (long long *)PyBytes_AsString(bs), *pe = (long long *)PyBytes_AsString(be);
            for (Py_ssize_t i = 0; i < k; i++) {
                ps[i] = v[i].s;
                pe[i] = v[i].e;
            }
            result = PyTuple_Pack(2, bs, be);
        }
        Py_XDECREF(bs);
        Py_XDECREF(be);
        goto out;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        if (us.n && v[i].s <= ue.v[ue.n - 1]) {
            if (v[i].e > ue.v[ue.n - 1]) ue.v[ue.n - 1] = v[i].e;
        } else if (vec_push(&us, v[i].s) < 0 || vec_push(&ue, v[i].e) < 0) {
            goto out;
        }
    }
    result = pair_of_vecs(&us, &ue);
out:
    Py_XDECREF(a.keep);
    Py_XDECREF(b.keep);
    PyMem_Free(v);
    vec_free(&us);
    vec_free(&ue);
    return result;
}

PyDoc_STRVAR(interval_minus_doc,
             "interval_minus(xs, xe, ys, ye, /)\n--\n\n"
             "breakdown.minus: x less y, both sorted and disjoint, as (starts, ends).");
static PyObject *hot_interval_minus(PyObject *self, PyObject *args) {
    PyObject *o[4];
    if (!PyArg_ParseTuple(args, "OOOO", &o[0], &o[1], &o[2], &o[3])) return NULL;
    Col c[4] = {{0}};
    Vec us = {0}, ue = {0};
    PyObject *result = NULL;
    for (int i = 0; i < 4; i++)
        if (col_read(&c[i], o[i]) < 0) goto out;
    if (c[0].n != c[1].n || c[2].n != c[3].n) {
        PyErr_SetString(PyExc_ValueError, "interval_minus: columns of different lengths");
        goto out;
    }
    const long long *xs = c[0].v, *xe = c[1].v, *ys = c[2].v, *ye = c[3].v;
    Py_ssize_t ny = c[2].n, j = 0;
    for (Py_ssize_t i = 0; i < c[0].n; i++) {
        long long a = xs[i], b = xe[i];
        while (j < ny && ye[j] <= a) j++;
        for (Py_ssize_t k = j; a < b && k < ny && ys[k] < b; k++) {
            if (ys[k] > a && (vec_push(&us, a) < 0 || vec_push(&ue, ys[k]) < 0)) goto out;
            if (ye[k] > a) a = ye[k];
        }
        if (a < b && (vec_push(&us, a) < 0 || vec_push(&ue, b) < 0)) goto out;
    }
    result = pair_of_vecs(&us, &ue);
out:
    for (int i = 0; i < 4; i++) Py_XDECREF(c[i].keep);
    vec_free(&us);
    vec_free(&ue);
    return result;
}

PyDoc_STRVAR(interval_within_doc,
             "interval_within(us, ue, ws, we, /)\n--\n\n"
             "breakdown.within: for each window [ws[k], we[k]), the length of the sorted, disjoint\n"
             "intervals (us, ue) inside it.");
static PyObject *hot_interval_within(PyObject *self, PyObject *args) {
    PyObject *o[4];
    if (!PyArg_ParseTuple(args, "OOOO", &o[0], &o[1], &o[2], &o[3])) return NULL;
    Col c[4] = {{0}};
    long long *prefix = NULL, *got = NULL;
    PyObject *result = NULL;
    for (int i = 0; i < 4; i++)
        if (col_read(&c[i], o[i]) < 0) goto out;
    if (c[0].n != c[1].n || c[2].n != c[3].n) {
        PyErr_SetString(PyExc_ValueError, "interval_within: columns of different lengths");
        goto out;
    }
    const long long *us = c[0].v, *ue = c[1].v, *ws = c[2].v, *we = c[3].v;
    Py_ssize_t n = c[0].n, nw = c[2].n;
    prefix = PyMem_Malloc(sizeof(long long) * (size_t)(n + 1));
    got = PyMem_Malloc(sizeof(long long) * (size_t)(nw ? nw : 1));
    if (!prefix || !got) { PyErr_NoMemory(); goto out; }
    prefix[0] = 0;
    for (Py_ssize_t i = 0; i < n; i++) prefix[i + 1] = prefix[i] + (ue[i] - us[i]);
    for (Py_ssize_t k = 0; k < nw; k++) {
        long long a = ws[k], b = we[k];
        Py_ssize_t i = bisect_right_ll(ue, n, a), j = bisect_left_ll(us, n, b);
        if (i >= j) { got[k] = 0; continue; }
        got[k] = prefix[j] - prefix[i] - (us[i] < a ? a - us[i] : 0) - (ue[j - 1] > b ? ue[j - 1] - b : 0);
    }
    result = list_ll(got, nw);
out:
    for (int i = 0; i < 4; i++) Py_XDECREF(c[i].keep);
    PyMem_Free(prefix);
    PyMem_Free(got);
    return result;
}

/* Sort intervals by iv_cmp in place: an introsort (quicksort, heapsort past a depth, insertion
 * sort of short runs), where glibc's qsort takes a second buffer as large as the array. */
static void iv_swap(Iv *a, Iv *b) {
    Iv t = *a;
    *a = *b;
    *b = t;
}

static void iv_sift(Iv *v, Py_ssize_t root, Py_ssize_t n) {
    for (;;) {
        Py_ssize_t child = 2 * root + 1;
        if (child >= n) return;
        if (child + 1 < n && iv_cmp(&v[child], &v[child + 1]) < 0) child++;
        if (iv_cmp(&v[root], &v[child]) >= 0) return;
        iv_swap(&v[root], &v[child]);
        root = child;
    }
}

static void iv_sort(Iv *v, Py_ssize_t n, int depth) {
    while (n > 16) {
        if (depth-- == 0) { /* heapsort: no worse than n log n whatever the order */
            for (Py_ssize_t i = n / 2; i-- > 0;) iv_sift(v, i, n);
            for (Py_ssize_t i = n - 1; i > 0; i--) {
                iv_swap(&v[0], &v[i]);
                iv_sift(v, 0, i);
            }
            return;
        }
        Py_ssize_t mid = n / 2; /* the median of three to v[0], then Hoare's partition around it */
        if (iv_cmp(&v[mid], &v[0]) < 0) iv_swap(&v[mid], &v[0]);
        if (iv_cmp(&v[n - 1], &v[0]) < 0) iv_swap(&v[n - 1], &v[0]);
        if (iv_cmp(&v[n - 1], &v[mid]) < 0) iv_swap(&v[n - 1], &v[mid]);
        iv_swap(&v[0], &v[mid]);
        Iv pivot = v[0];
        Py_ssize_t i = 0, j = n;
        for (;;) {
            do i++; while (i < n && iv_cmp(&v[i], &pivot) < 0);
            do j--; while (iv_cmp(&v[j], &pivot) > 0);
            if (i >= j) break;
            iv_swap(&v[i], &v[j]);
        }
        iv_swap(&v[0], &v[j]);
        /* The smaller side by recursion, the larger by the loop: a stack of log n at most. */
        if (j < n - j - 1) {
            iv_sort(v, j, depth);
            v += j + 1;
            n -= j + 1;
        } else {
            iv_sort(v + j + 1, n - j - 1, depth);
            n = j;
        }
    }
    for (Py_ssize_t i = 1; i < n; i++) {
        Iv x = v[i];
        Py_ssize_t j = i;
        for (; j > 0 && iv_cmp(&v[j - 1], &x) > 0; j--) v[j] = v[j - 1];
        v[j] = x;
    }
}

PyDoc_STRVAR(interval_covered_doc,
             "interval_covered(starts, ends, ws, we, /)\n--\n\n"
             "breakdown.covered: for each window [ws[k], we[k]), the length of the union of the [start, end)\n"
             "intervals inside it (interval_within of interval_union, without the union's columns).");
static PyObject *hot_interval_covered(PyObject *self, PyObject *args) {
    PyObject *o[4];
    if (!PyArg_ParseTuple(args, "OOOO", &o[0], &o[1], &o[2], &o[3])) return NULL;
    Col c[4] = {{0}};
    Iv *v = NULL;
    long long *got = NULL;
    PyObject *result = NULL;
    for (int i = 0; i < 4; i++)
        if (col_read(&c[i], o[i]) < 0) goto out;
    if (c[0].n != c[1].n || c[2].n != c[3].n) {
        PyErr_SetString(PyExc_ValueError, "interval_covered: columns of different lengths");
        goto out;
    }
    const long long *a = c[0].v, *b = c[1].v, *ws = c[2].v, *we = c[3].v;
    Py_ssize_t n = c[0].n, nw = c[2].n, m = 0, k = 0;
    v = PyMem_Malloc(sizeof(Iv) * (size_t)(n ? n : 1));
    got = PyMem_Malloc(sizeof(long long) * (size_t)(nw ? nw : 1));
    if (!v || !got) { PyErr_NoMemory(); goto out; }
    int sorted = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (b[i] <= a[i]) continue;
        v[m].s = a[i];
        v[m].e = b[i];
        if (m && iv_cmp(&v[m - 1], &v[m]) > 0) sorted = 0;
        m++;
    }
    if (!sorted) {
        int depth = 0;
        for (Py_ssize_t x = m; x > 1; x >>= 1) depth += 2;
        iv_sort(v, m, depth);
    }
    for (Py_ssize_t i = 0; i < m; i++) { /* the union, in place: sorted, disjoint, touching ones joined */
        if (k && v[i].s <= v[k - 1].e) {
            if (v[i].e > v[k - 1].e) v[k - 1].e = v[i].e;
        } else {
            v[k++] = v[i];
        }
    }
    for (Py_ssize_t w = 0; w < nw; w++) {
        long long lo = ws[w], hi = we[w], sum = 0;
        Py_ssize_t i = 0, j = k;
        while (i < j) { /* the first interval that ends after lo (the ends ascend too) */
            Py_ssize_t mid = i + (j - i) / 2;
            if (v[mid].e <= lo) i = mid + 1;
            else j = mid;
        }
        for (; i < k && v[i].s < hi; i++) sum += (v[i].e < hi ? v[i].e : hi) - (v[i].s > lo ? v[i].s : lo);
        got[w] = sum;
    }
    result = list_ll(got, nw);
out:
    for (int i = 0; i < 4; i++) Py_XDECREF(c[i].keep);
    PyMem_Free(v);
    PyMem_Free(got);
    return result;
}

/* ---- the document's columns ------------------------------------------------------------- */

/* A list's items, or an int64 column's where they lie (*keep: a copy to release, or NULL); for a
 * list NULL is returned and *is_list set. */
static const long long *seq_items(PyObject *o, Py_ssize_t *n, PyObject **keep, int *is_list) {
    *keep = NULL;
    *is_list = PyList_Check(o);
    if (*is_list) {
        *n = PyList_Size(o);
        return NULL;
    }
    return (const long long *)gt_column_items(o, n, keep);
}

static int seq_ll(PyObject *list, const long long *col, Py_ssize_t i, long long *out) {
    if (col) {
        *out = col[i];
        return 0;
    }
    *out = PyLong_AsLongLong(PyList_GetItem(list, i));
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

PyDoc_STRVAR(int_deltas_doc,
             "int_deltas($module, a, b, base, /)\n--\n\n"
             "[a[i] - b[i]] of two int lists or int64 columns; with b None, each of a less the one before\n"
             "it (the first less `base`): digest_breakdown._deltas_py without a Python call an item.\n"
             "NotImplemented where a difference would not fit in 64 bits (the twin then makes them).");

static PyObject *hot_int_deltas(PyObject *self, PyObject *args) {
    PyObject *a, *b, *keep_a = NULL, *keep_b = NULL, *out = NULL;
    long long base;
    int la = 0, lb = 0;
    if (!PyArg_ParseTuple(args, "OOL", &a, &b, &base)) return NULL;
    Py_ssize_t n, nb = 0;
    const long long *ca = seq_items(a, &n, &keep_a, &la), *cb = NULL;
    if (!ca && !la) return NULL;
    if (b != Py_None) {
        cb = seq_items(b, &nb, &keep_b, &lb);
        if (!cb && !lb) goto done;
        if (nb != n) {
            PyErr_SetString(PyExc_ValueError, "int_deltas: columns of different lengths");
            goto done;
        }
    }
    if (!(out = PyList_New(n))) goto done;
    long long prev = base;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long x, y, d;
        if (seq_ll(a, ca, i, &x) < 0) goto fail;
        if (b != Py_None) {
            if (seq_ll(b, cb, i, &y) < 0) goto fail;
        } else {
            y = prev;
            prev = x;
        }
        if (__builtin_sub_overflow(x, y, &d)) {
            Py_CLEAR(out);
            out = Py_NewRef(Py_NotImplemented);
            goto done;
        }
        PyObject *v = PyLong_FromLongLong(d);
        if (!v) goto fail;
        PyList_SetItem(out, i, v);
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    Py_XDECREF(keep_a);
    Py_XDECREF(keep_b);
    return out;
}

PyDoc_STRVAR(int_span_total_doc,
             "int_span_total($module, ends, starts, lo, hi, /)\n--\n\n"
             "sum(ends[lo:hi]) - sum(starts[lo:hi]) of two int64 columns: digest_breakdown._span_total_py\n"
             "without a Python int an item. NotImplemented where the total would not fit in 64 bits.");

static PyObject *hot_int_span_total(PyObject *self, PyObject *args) {
    PyObject *eo, *so, *ke = NULL, *ks = NULL, *out = NULL;
    Py_ssize_t lo, hi, ne, ns;
    if (!PyArg_ParseTuple(args, "OOnn", &eo, &so, &lo, &hi)) return NULL;
    const long long *e = gt_column_items(eo, &ne, &ke), *s = e ? gt_column_items(so, &ns, &ks) : NULL;
    if (!s) goto done;
    if (lo < 0 || hi > ne || hi > ns || lo > hi) {
        PyErr_SetString(PyExc_ValueError, "int_span_total: rows out of range");
        goto done;
    }
    __int128 total = 0;
    for (Py_ssize_t i = lo; i < hi; i++) total += (__int128)e[i] - s[i];
    out = total > LLONG_MAX || total < LLONG_MIN ? Py_NewRef(Py_NotImplemented) : PyLong_FromLongLong((long long)total);
done:
    Py_XDECREF(ke);
    Py_XDECREF(ks);
    return out;
}

static PyMethodDef digest_methods[] = {
    {"digest_rows", hot_digest_rows, METH_VARARGS, digest_rows_doc},
    {"digest_fold", hot_digest_fold, METH_VARARGS, digest_fold_doc},
    {"digest_cover", hot_digest_cover, METH_VARARGS, digest_cover_doc},
    {"digest_nest", hot_digest_nest, METH_VARARGS, digest_nest_doc},
    {"digest_entries", hot_digest_entries, METH_VARARGS, digest_entries_doc},
    {"digest_lags", hot_digest_lags, METH_VARARGS, digest_lags_doc},
    {"interval_union", hot_interval_union, METH_VARARGS, interval_union_doc},
    {"interval_minus", hot_interval_minus, METH_VARARGS, interval_minus_doc},
    {"interval_within", hot_interval_within, METH_VARARGS, interval_within_doc},
    {"interval_covered", hot_interval_covered, METH_VARARGS, interval_covered_doc},
    {"int_deltas", hot_int_deltas, METH_VARARGS, int_deltas_doc},
    {"int_span_total", hot_int_span_total, METH_VARARGS, int_span_total_doc},
    {NULL},
};

int gt_digest_init(PyObject *m) {
    if (!(s_buffer_info = PyUnicode_InternFromString("buffer_info")) ||
        !(s_typecode = PyUnicode_InternFromString("typecode")))
        return -1;
    return PyModule_AddFunctions(m, digest_methods);
}
