/* The writer thread: a Writer writes encoded buffers to a file from a thread of its own. */
#include "hot.h"

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
    Py_ssize_t wake;           /* the thread writes once this many wait (or at close): a wake-up,
                                * two context switches, a buffer is dearer than writing it */
} Writer;

static PyTypeObject *WriterType;

static void *writer_main(void *arg) {
    Writer *w = (Writer *)arg;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while ((!w->head || w->queued < w->wake) && !w->closing) pthread_cond_wait(&w->cv, &w->mu);
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

/* Wait, without the GIL, until at most `most` bytes wait to be written (the GIL kept where none
 * need wait: letting it go and taking it back costs a switch on a busy machine). */
static void writer_wait(Writer *w, Py_ssize_t most) {
    pthread_mutex_lock(&w->mu);
    int fits = w->queued <= most;
    pthread_mutex_unlock(&w->mu);
    if (fits) {
        writer_release(w);
        return;
    }
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
    /* 1 MiB: the JSON save hands it 64 KiB chunks as it encodes them; a longer queue only
     * grows the heap, whose freed top is given back and faulted in again (measured: 4 MiB cost
     * ~40 ns a span more CPU for the same wall time on a 2-core VM) */
    Py_ssize_t limit = 1 << 20;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "i|n", kwlist, &fd, &limit)) return NULL;
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    Writer *w = (Writer *)alloc(type, 0);
    if (!w) return NULL;
    w->fd = fd;
    w->limit = limit > 0 ? limit : 1;
    w->wake = w->limit / 4 > 0 ? w->limit / 4 : 1;
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
    if (w->queued >= w->wake) pthread_cond_broadcast(&w->cv);
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
     "Writer(fd, limit=1 MiB)\n--\n\n"
     "Writes bytes to the file descriptor `fd` in a thread of its own, in the order given, while\n"
     "the caller goes on; `close()` waits for them. The descriptor's offset is the thread's until then."},
    {Py_tp_new, Writer_new},
    {Py_tp_dealloc, Writer_dealloc},
    {Py_tp_methods, Writer_methods},
    {0, NULL},
};

static PyType_Spec Writer_spec = {"gputrace._hot.Writer", sizeof(Writer), 0, Py_TPFLAGS_DEFAULT, Writer_slots};

int gt_writer_init(PyObject *m) {
    WriterType = (PyTypeObject *)PyType_FromSpec(&Writer_spec);
    if (!WriterType || PyModule_AddObject(m, "Writer", Py_NewRef((PyObject *)WriterType)) < 0) return -1;
    return 0;
}
