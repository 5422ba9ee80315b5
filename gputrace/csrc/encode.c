/* Encoding: spans as Chrome JSON (encode_events, encode_rows), overflow lanes for spans that
 * cannot nest (layout), nesting from a recorder's columns (nest_tracks), a column's range. */
#include "hot.h"

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

/* How many decimal digits v has. */
static inline int digits_of(unsigned long long v) {
    int n = 1;
    while (v >= 10000) { v /= 10000; n += 4; }
    if (v >= 100) { v /= 100; n += 2; }
    return n + (v >= 10);
}

/* A non-negative integer in decimal, two digits a step, written in place from its last digit
 * (snprintf costs several times more). */
static void raw_u(Buf *b, unsigned long long v) {
    int n = digits_of(v);
    char *p = b->p + b->len + n;
    b->len += (size_t)n;
    while (v >= 100) {
        unsigned r = (unsigned)(v % 100);
        v /= 100;
        *--p = DIGITS2[2 * r + 1];
        *--p = DIGITS2[2 * r];
    }
    if (v >= 10) {
        *--p = DIGITS2[2 * v + 1];
        *--p = DIGITS2[2 * v];
    } else {
        *--p = (char)('0' + v);
    }
}

/* Nanoseconds as microseconds with exactly three decimals: 1234567 -> "1234.567". */
static void raw_us(Buf *b, unsigned long long ns) {
    unsigned long long us = ns / 1000;
    unsigned r = (unsigned)(ns - us * 1000), t = r % 100;
    raw_u(b, us);
    char *p = b->p + b->len;
    p[0] = '.';
    p[1] = (char)('0' + r / 100);
    p[2] = DIGITS2[2 * t];
    p[3] = DIGITS2[2 * t + 1];
    b->len += 4;
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

/* The source of a span's launch arrow, as chrome.launch_event writes it (without its separator):
 * a zero-length slice on the launch track at the host entry, or 1 ns before the span where the
 * entry is not before it (never before the base), the exact entry then as its argument. */
static int put_launch(Buf *b, const char *name, size_t namen, long long pid, long long tid, long long entry,
                      long long start, long long base, long long flow) {
    long long at = entry < start - 1 ? entry : start - 1;
    if (at < base) at = base;
    if (buf_reserve(b, 160 + namen) < 0) return -1;
    RAW_LIT(b, "{\"ph\":\"X\",\"cat\":\"launch\",\"name\":");
    raw_put(b, name, namen);
    RAW_LIT(b, ",\"pid\":");
    raw_u(b, (unsigned long long)pid);
    RAW_LIT(b, ",\"tid\":");
    raw_u(b, (unsigned long long)tid);
    RAW_LIT(b, ",\"ts\":");
    raw_us(b, (unsigned long long)(at - base));
    RAW_LIT(b, ",\"dur\":0.000,\"bind_id\":");
    raw_u(b, (unsigned long long)flow);
    RAW_LIT(b, ",\"flow_out\":true");
    if (at != entry) {
        RAW_LIT(b, ",\"args\":{\"entry_ns\":");
        raw_u(b, (unsigned long long)entry);
        RAW_LIT(b, "}");
    }
    RAW_LIT(b, "}");
    return 0;
}

/* The span's end of its launch arrow. */
static int put_flow_in(Buf *b, long long flow) {
    if (buf_reserve(b, 64) < 0) return -1;
    RAW_LIT(b, ",\"bind_id\":");
    raw_u(b, (unsigned long long)flow);
    RAW_LIT(b, ",\"flow_in\":true");
    return 0;
}

PyDoc_STRVAR(encode_events_doc,
             "encode_events($module, name_json, name_idx, cats, track_idx, lanes, tid_base, pid, starts, ends, base, args_json, entries=None, launch_tid=0, first_flow=0, /)\n--\n\n"
             "The X events of a trace, comma-separated JSON, ts/dur as exact decimals of integer ns; with\n"
             "`entries` (host entry ns per row, 0: none), each span with one gets its launch arrow.");

/* encode_events(name_json, name_idx, cats, track_idx, lanes, tid_base, pid, starts, ends, base, args_json)
 * -> the X events, comma-separated, ts/dur as exact decimals of integer ns (as the Python twin). */
static PyObject *hot_encode_events(PyObject *self, PyObject *args) {
    PyObject *name_json, *name_idx, *cats, *track_idx, *lanes, *tid_base, *starts, *ends, *args_json;
    PyObject *entries = Py_None;
    long long pid, base, launch_tid = 0, flow = 0;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!LO!O!LO!|OLL", &PyList_Type, &name_json, &PyList_Type, &name_idx,
                          &PyList_Type, &cats, &PyList_Type, &track_idx, &PyList_Type, &lanes, &PyList_Type, &tid_base,
                          &pid, &PyList_Type, &starts, &PyList_Type, &ends, &base, &PyList_Type, &args_json, &entries,
                          &launch_tid, &flow))
        return NULL;
    PyObject *tids = lanes;
    Py_ssize_t n = PyList_Size(starts);
    if (entries != Py_None && (!PyList_Check(entries) || PyList_Size(entries) != n)) {
        PyErr_SetString(PyExc_ValueError, "encode_events: entries must be a list, one per span");
        return NULL;
    }
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
        long long en = 0;
        if (entries != Py_None && item_ll(entries, i, &en) < 0) goto fail;
        if (en > 0) {
            char *nmp;
            Py_ssize_t nmn;
            if (PyBytes_AsStringAndSize(nm, &nmp, &nmn) < 0) goto fail;
            if ((i && buf_put(&b, ",", 1) < 0) || put_launch(&b, nmp, (size_t)nmn, pid, launch_tid, en, s, base, flow) < 0)
                goto fail;
        }
        if (((i || en > 0) && buf_put(&b, ",", 1) < 0) || PUT_LIT(&b, "{\"ph\":\"X\",\"cat\":") < 0 || buf_bytes(&b, cat) < 0 ||
            PUT_LIT(&b, ",\"name\":") < 0 || buf_bytes(&b, nm) < 0)
            goto fail;
        if (PUT_LIT(&b, ",\"pid\":") < 0 || put_u(&b, (unsigned long long)pid) < 0 || PUT_LIT(&b, ",\"tid\":") < 0 ||
            put_u(&b, (unsigned long long)tid) < 0 || PUT_LIT(&b, ",\"ts\":") < 0 ||
            put_us(&b, (unsigned long long)ts) < 0 || PUT_LIT(&b, ",\"dur\":") < 0 ||
            put_us(&b, (unsigned long long)dur) < 0)
            goto fail;
        if (a != Py_None && (PUT_LIT(&b, ",\"args\":") < 0 || buf_bytes(&b, a) < 0)) goto fail;
        if (en > 0 && put_flow_in(&b, flow++) < 0) goto fail;
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
PyObject *gt_array_bytes(PyObject *arr, size_t itemsize, Py_ssize_t *n) {
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
    /* The columns where they lie (a copy of each, fresh pages, cost about as much as the pass);
     * copied only where they are not 8-byte arrays (tb, sb, eb then hold the copies). */
    PyObject *tb = NULL, *sb = NULL, *eb = NULL;
    const long *tr = NULL;
    const long long *st = NULL, *en = NULL;
    PyObject *result = NULL, *order = NULL;
    Kept *kept = NULL;
    Py_ssize_t *first = NULL, nt = 0, *next = NULL, *head = NULL, *tail = NULL;
    long *tseen = NULL;
    if (sizeof(long) == 8) {
        if (!(tr = gt_column_items(tracks_a, &n, &tb)) || !(st = gt_column_items(starts_a, &n1, &sb)) ||
            !(en = gt_column_items(ends_a, &n2, &eb)))
            goto done;
    } else {
        if (!(tb = gt_array_bytes(tracks_a, sizeof(long), &n)) || !(sb = gt_array_bytes(starts_a, 8, &n1)) ||
            !(eb = gt_array_bytes(ends_a, 8, &n2)))
            goto done;
        tr = (const long *)PyBytes_AsString(tb);
        st = (const long long *)PyBytes_AsString(sb);
        en = (const long long *)PyBytes_AsString(eb);
    }
    if (n1 != n || n2 != n) { PyErr_SetString(PyExc_ValueError, "nest_tracks: columns of different lengths"); goto done; }
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
             "encode_rows($module, name_json, names, tracks, starts, ends, args, dump, track_info, pid, base, entry=None, launch_tid=0, first_flow=0, write=None, /)\n"
             "--\n\n"
             "The X events of one piece whose spans all lie on lane 0 of their track, from the columns\n"
             "(array.array 'l', 'l', 'q', 'q'; `args` a list): each event followed by `,\\n`. `track_info(t)`\n"
             "gives (tid, cat JSON) of each track, asked once per track in the order the tracks first\n"
             "appear; `dump(args)` gives an args dict's JSON. With `entry` (array 'q' of host entry ns, 0:\n"
             "none), `launch_tid` and `first_flow`, each span with an entry gets its launch arrow. With\n"
             "`write`, the bytes go to it in chunks of about 64 KiB and None is returned.");

/* The chunk handed to `write`: small enough that malloc takes it from the heap and reuses it
 * (below glibc's least mmap threshold): a saved trace's bytes never pass through fresh pages
 * in this process, which cost on these VMs about as much as encoding them. */
#define ROWS_CHUNK (1 << 16)

/* A decimal counter kept as its digits (the flow ids: two a span, each one more than the last). */
typedef struct {
    char d[24];
    int n; /* digits in d[24 - n .. 23] */
} Dec;

static void dec_set(Dec *c, unsigned long long v) {
    c->n = 0;
    do {
        c->d[23 - c->n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
}

static void dec_inc(Dec *c) {
    int i = 23;
    while (i >= 24 - c->n && c->d[i] == '9') c->d[i--] = '0';
    if (i >= 24 - c->n) c->d[i]++;
    else c->d[23 - c->n++] = '1';
}

/* `write(chunk)` with the buffer's bytes, the buffer then empty. */
static int rows_emit(Buf *b, PyObject *write) {
    if (!b->len) return 0;
    PyObject *chunk = PyBytes_FromStringAndSize(b->p, (Py_ssize_t)b->len);
    if (!chunk) return -1;
    PyObject *r = PyObject_CallFunctionObjArgs(write, chunk, NULL);
    Py_DECREF(chunk);
    if (!r) return -1;
    Py_DECREF(r);
    b->len = 0;
    return 0;
}

/* What each track's events start with, made once: `,"pid":P,"tid":T,"ts":` and its cat. */
typedef struct {
    char mid[64];
    size_t midn;
    const char *cat;
    size_t catn;
} TrackText;

static size_t mid_text(char *out, long long pid, long long tid) {
    Buf m = {out, 0, 64};
    RAW_LIT(&m, ",\"pid\":");
    raw_u(&m, (unsigned long long)pid);
    RAW_LIT(&m, ",\"tid\":");
    raw_u(&m, (unsigned long long)tid);
    RAW_LIT(&m, ",\"ts\":");
    return m.len;
}

static PyObject *hot_encode_rows(PyObject *self, PyObject *args) {
    PyObject *name_json, *names_a, *tracks_a, *starts_a, *ends_a, *argl, *dump, *track_info, *entry_a = Py_None;
    PyObject *write = Py_None;
    long long pid, base, launch_tid = 0, flow = 0;
    if (!PyArg_ParseTuple(args, "O!OOOOO!OOLL|OLLO", &PyList_Type, &name_json, &names_a, &tracks_a, &starts_a,
                          &ends_a, &PyList_Type, &argl, &dump, &track_info, &pid, &base, &entry_a, &launch_tid, &flow,
                          &write))
        return NULL;
    if (write != Py_None && !PyCallable_Check(write)) {
        PyErr_SetString(PyExc_TypeError, "encode_rows: write must be callable or None");
        return NULL;
    }
    if (pid < 0 || launch_tid < 0 || flow < 0) {
        PyErr_SetString(PyExc_ValueError, "encode_rows: a negative pid, tid or flow id");
        return NULL;
    }
    Py_ssize_t n, n0, n1, n2, n3 = 0;
    PyObject *keep[5] = {NULL, NULL, NULL, NULL, NULL}; /* the columns' copies, where they were copied */
    const long long *nm = NULL, *tr = NULL; /* 8-byte items: gt_column_items checks */
    const long long *st = NULL, *en = NULL, *ent = NULL;
    PyObject *result = NULL;
    Buf b = {NULL, 0, 0};
    TrackText *tt = NULL;
    const char **namep = NULL;
    size_t *namen = NULL;
    long long ntr = 0;
    if (!(nm = gt_column_items(names_a, &n0, &keep[0])) || !(tr = gt_column_items(tracks_a, &n, &keep[1])) ||
        !(st = gt_column_items(starts_a, &n1, &keep[2])) || !(en = gt_column_items(ends_a, &n2, &keep[3])))
        goto done;
    if (entry_a != Py_None && !(ent = gt_column_items(entry_a, &n3, &keep[4]))) goto done;
    if (n0 != n || n1 != n || n2 != n || PyList_Size(argl) != n || (ent && n3 != n)) {
        PyErr_SetString(PyExc_ValueError, "encode_rows: columns of different lengths");
        goto done;
    }
    Py_ssize_t nnames = PyList_Size(name_json);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (tr[i] < 0) { PyErr_SetString(PyExc_ValueError, "encode_rows: a negative track"); goto done; }
        if (tr[i] >= ntr) ntr = tr[i] + 1;
        if (nm[i] < 0 || nm[i] >= nnames) {
            PyErr_SetString(PyExc_ValueError, "encode_rows: a name index out of range");
            goto done;
        }
    }
    tt = PyMem_Calloc((size_t)(ntr ? ntr : 1), sizeof(TrackText));
    namep = PyMem_Calloc((size_t)(nnames ? nnames : 1), sizeof(char *));
    namen = PyMem_Calloc((size_t)(nnames ? nnames : 1), sizeof(size_t));
    if (!tt || !namep || !namen) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) { /* each track's tid and cat, asked in first-seen order */
        TrackText *t = &tt[tr[i]];
        if (t->cat) continue;
        PyObject *k = PyLong_FromLongLong(tr[i]);
        PyObject *info = k ? PyObject_CallFunctionObjArgs(track_info, k, NULL) : NULL;
        Py_XDECREF(k);
        if (!info) goto done;
        if (!PyTuple_Check(info) || PyTuple_Size(info) != 2 || !PyBytes_Check(PyTuple_GetItem(info, 1))) {
            Py_DECREF(info);
            PyErr_SetString(PyExc_TypeError, "encode_rows: track_info must give (tid, cat bytes)");
            goto done;
        }
        long long tid = PyLong_AsLongLong(PyTuple_GetItem(info, 0));
        PyObject *cat = PyTuple_GetItem(info, 1);
        /* The cat stays alive in the trace's writer (a constant); kept by the tuple until here, so
         * copied: a cat is a short literal. */
        Py_ssize_t cn = PyBytes_Size(cat);
        char *cp = PyMem_Malloc((size_t)cn + 1);
        if (cp) memcpy(cp, PyBytes_AsString(cat), (size_t)cn);
        Py_DECREF(info);
        if (!cp) { PyErr_NoMemory(); goto done; }
        t->cat = cp;
        t->catn = (size_t)cn;
        if (tid == -1 && PyErr_Occurred()) goto done;
        if (tid < 0) { PyErr_SetString(PyExc_ValueError, "encode_rows: a negative tid"); goto done; }
        t->midn = mid_text(t->mid, pid, tid);
    }
    char launch_mid[64];
    size_t launch_midn = mid_text(launch_mid, pid, launch_tid);
    Dec fl;
    dec_set(&fl, (unsigned long long)flow);
    if (buf_reserve(&b, write != Py_None ? ROWS_CHUNK + 4096 : (size_t)n * 96 + 1) < 0) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long ts = st[i] - base, dur = en[i] - st[i];
        if (ts < 0 || dur < 0) {
            PyErr_SetString(PyExc_ValueError, "a span starts before the trace's base or ends before it starts");
            goto done;
        }
        if (!namep[nm[i]]) {
            char *p;
            Py_ssize_t pn;
            if (PyBytes_AsStringAndSize(PyList_GetItem(name_json, nm[i]), &p, &pn) < 0) goto done;
            namep[nm[i]] = p; /* the list holds the bytes for the whole call */
            namen[nm[i]] = (size_t)pn;
        }
        const char *name = namep[nm[i]];
        size_t nn = namen[nm[i]];
        const TrackText *t = &tt[tr[i]];
        int arrow = ent && ent[i] > 0;
        /* the literals (95 with an arrow, 60 without), at most 6 numbers of 20 digits (+4 for the
         * three us decimals), the names, cat and the two mid texts */
        if (buf_reserve(&b, 320 + 2 * nn + t->catn + t->midn + launch_midn) < 0) goto done;
        if (arrow) { /* the source of its launch arrow, as chrome.launch_event writes it */
            long long e = ent[i], at = e < st[i] - 1 ? e : st[i] - 1;
            if (at < base) at = base;
            RAW_LIT(&b, "{\"ph\":\"X\",\"cat\":\"launch\",\"name\":");
            raw_put(&b, name, nn);
            raw_put(&b, launch_mid, launch_midn);
            raw_us(&b, (unsigned long long)(at - base));
            RAW_LIT(&b, ",\"dur\":0.000,\"bind_id\":");
            raw_put(&b, fl.d + 24 - fl.n, (size_t)fl.n);
            RAW_LIT(&b, ",\"flow_out\":true");
            if (at != e) {
                RAW_LIT(&b, ",\"args\":{\"entry_ns\":");
                raw_u(&b, (unsigned long long)e);
                RAW_LIT(&b, "}");
            }
            RAW_LIT(&b, "},\n");
        }
        RAW_LIT(&b, "{\"ph\":\"X\",\"cat\":");
        raw_put(&b, t->cat, t->catn);
        RAW_LIT(&b, ",\"name\":");
        raw_put(&b, name, nn);
        raw_put(&b, t->mid, t->midn);
        raw_us(&b, (unsigned long long)ts);
        RAW_LIT(&b, ",\"dur\":");
        raw_us(&b, (unsigned long long)dur);
        PyObject *a = PyList_GetItem(argl, i);
        if (a != Py_None) {
            int truthy = PyObject_IsTrue(a);
            if (truthy < 0) goto done;
            if (truthy) {
                PyObject *j = PyObject_CallFunctionObjArgs(dump, a, NULL);
                if (!j) goto done;
                int r = PUT_LIT(&b, ",\"args\":") < 0 || put_args(&b, j) < 0;
                Py_DECREF(j);
                if (r || buf_reserve(&b, 64) < 0) goto done;
            }
        }
        if (arrow) {
            RAW_LIT(&b, ",\"bind_id\":");
            raw_put(&b, fl.d + 24 - fl.n, (size_t)fl.n);
            RAW_LIT(&b, ",\"flow_in\":true");
            dec_inc(&fl);
        }
        RAW_LIT(&b, "},\n");
        if (write != Py_None && b.len >= ROWS_CHUNK && rows_emit(&b, write) < 0) goto done;
    }
    if (write != Py_None) {
        if (rows_emit(&b, write) < 0) goto done;
        result = Py_NewRef(Py_None);
    } else {
        result = PyBytes_FromStringAndSize(b.p ? b.p : "", (Py_ssize_t)b.len);
    }
done:
    PyMem_Free(b.p);
    if (tt)
        for (long long k = 0; k < ntr; k++) PyMem_Free((void *)tt[k].cat);
    PyMem_Free(tt);
    PyMem_Free((void *)namep);
    PyMem_Free(namen);
    for (int k = 0; k < 5; k++) Py_XDECREF(keep[k]);
    return result;
}


PyDoc_STRVAR(column_range_doc,
             "column_range(column, /)\n--\n\n"
             "(least, largest) of an array('q') column, or None when it is empty: min() and max() of it\n"
             "without a Python int per item.");
static PyObject *hot_column_range(PyObject *self, PyObject *col) {
    Py_ssize_t n;
    PyObject *b;
    const long long *v = gt_column_items(col, &n, &b);
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

PyDoc_STRVAR(entries_range_doc,
             "entries_range(column, /)\n--\n\n"
             "(how many items are > 0, the least item that is not 0, or 0) of an array('q') column of host\n"
             "entry times (0: none): layout.entries_range without a Python int per item.");
static PyObject *hot_entries_range(PyObject *self, PyObject *col) {
    Py_ssize_t n, count = 0;
    PyObject *b;
    const long long *v = gt_column_items(col, &n, &b);
    if (!v) return NULL;
    long long least = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        count += v[i] > 0;
        if (v[i] && (!least || v[i] < least)) least = v[i];
    }
    Py_XDECREF(b);
    return Py_BuildValue("(nL)", count, least);
}

static PyMethodDef encode_methods[] = {
    {"layout", hot_layout, METH_VARARGS, layout_doc},
    {"nest_tracks", hot_nest_tracks, METH_VARARGS, nest_tracks_doc},
    {"encode_rows", hot_encode_rows, METH_VARARGS, encode_rows_doc},
    {"encode_events", hot_encode_events, METH_VARARGS, encode_events_doc},
    {"column_range", hot_column_range, METH_O, column_range_doc},
    {"entries_range", hot_entries_range, METH_O, entries_range_doc},
    {NULL},
};

int gt_encode_init(PyObject *m) {
    if (!(s_tobytes = PyUnicode_InternFromString("tobytes"))) return -1;
    return PyModule_AddFunctions(m, encode_methods);
}
