/* speculant host staging (the optional extension ``speculant._staging``): the int inputs of the
 * proposers' one-graph greedy proposes (draft model, EAGLE) and of the engine's CUDA-graph
 * forwards (ring_ints, at the end), written into their pinned buffers.
 *
 * draft_ints: the int64 input vector of the draft model's one-graph greedy propose
 * (framework/drafting/draft_graph.py; the layout is framework/drafting/propose_ints.py's, and
 * ``draft_graph.fused_ints`` is the Python version and the reference the tests compare this
 * with, value for value). The GPU waits for this host work before the draft graph runs: this
 * one pass takes about a tenth of the Python version's time at batch 16.
 *
 *   draft_ints(out, tables, cached, feeds, ks, Bp, Q, K, W, bs)
 *     out:    writable C-contiguous int64 buffer of exactly the layout's length (written in full)
 *     tables: list of A block tables (lists of int, each at most W long)
 *     cached: list of A ints, tokens in each draft cache before the catch-up
 *     feeds:  list of A lists of int, the catch-up tokens of each sequence (>= 1 each)
 *     ks:     list of A ints, drafts of each sequence (1..K)
 *
 * Errors (a table wider than W, a position past a sequence's table, more catch-up rows than
 * Bp * Q, more sequences than Bp) raise ValueError naming the bad value; ``out`` is then
 * partly written (the caller runs its eager path or fails).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

typedef long long i64;

/* item i of a list / tuple as a C integer; -1 with an exception set on failure */
static int item_i64(PyObject *seq, Py_ssize_t i, i64 *v) {
    *v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
    return (*v == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* the n integer arguments args[0 .. n-1] into dims, each at least mins[d]; -1 with an exception */
static int int_args(PyObject *const *args, int n, i64 *dims, const i64 *mins, const char *msg) {
    for (int d = 0; d < n; d++) {
        dims[d] = PyLong_AsLongLong(args[d]);
        if (dims[d] == -1 && PyErr_Occurred()) return -1;
        if (dims[d] < mins[d]) {
            PyErr_SetString(PyExc_ValueError, msg);
            return -1;
        }
    }
    return 0;
}

/* o as a writable C-contiguous buffer of int64 (itemsize 8) or int32 (itemsize 4) entries:
 * exactly n of them (exact), or at least n. ``fn`` and ``what`` name the function and argument
 * in errors. -1 with an exception (nothing to release then). */
static int int_buffer(PyObject *o, Py_ssize_t itemsize, i64 n, int exact, Py_buffer *ob,
                      const char *fn, const char *what) {
    if (PyObject_GetBuffer(o, ob, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    const char *f = ob->format;
    int ok = ob->itemsize == itemsize && f != NULL
             && (itemsize == 8 ? (!strcmp(f, "q") || !strcmp(f, "l") || !strcmp(f, "<q")
                                  || !strcmp(f, "<l"))
                               : (!strcmp(f, "i") || !strcmp(f, "<i")));
    if (!ok || (exact ? ob->len != n * itemsize : ob->len < n * itemsize)) {
        PyErr_Format(PyExc_ValueError, "%s: %s must be int%d of %s%lld entries", fn, what,
                     (int)(8 * itemsize), exact ? "" : ">= ", (long long)n);
        PyBuffer_Release(ob);
        return -1;
    }
    return 0;
}

static PyObject *py_draft_ints(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10)
        return PyErr_Format(PyExc_TypeError,
                            "draft_ints(out, tables, cached, feeds, ks, Bp, Q, K, W, bs)");
    i64 dims[5];
    static const i64 mins[5] = {1, 1, 1, 1, 1};
    if (int_args(args + 5, 5, dims, mins, "draft_ints: Bp, Q, K, W, bs >= 1") < 0) return NULL;
    const i64 Bp = dims[0], Q = dims[1], K = dims[2], W = dims[3], bs = dims[4];
    const i64 M = Bp * Q, S = K - 1;
    const i64 head = 3 * M + 3 * Bp + 1 + 3 * S * Bp + Bp + 1; /* entries before the tables */
    PyObject *res = NULL, *tables = NULL, *cached = NULL, *feeds = NULL, *ks = NULL;
    Py_buffer ob;
    if (int_buffer(args[0], 8, head + Bp * W, 1, &ob, "draft_ints", "out") < 0) return NULL;
    tables = PySequence_Fast(args[1], "draft_ints: tables must be a list");
    cached = PySequence_Fast(args[2], "draft_ints: cached must be a list");
    feeds = PySequence_Fast(args[3], "draft_ints: feeds must be a list");
    ks = PySequence_Fast(args[4], "draft_ints: ks must be a list");
    if (!tables || !cached || !feeds || !ks) goto done;
    const Py_ssize_t A = PySequence_Fast_GET_SIZE(tables);
    if (PySequence_Fast_GET_SIZE(cached) != A || PySequence_Fast_GET_SIZE(feeds) != A
        || PySequence_Fast_GET_SIZE(ks) != A) {
        PyErr_SetString(PyExc_ValueError, "draft_ints: tables, cached, feeds, ks differ in length");
        goto done;
    }
    if (A > Bp) {
        PyErr_Format(PyExc_ValueError, "draft_ints: %zd sequences > batch bucket %lld", A, Bp);
        goto done;
    }
    i64 *o = (i64 *)ob.buf;
    i64 *ids = o, *pos = o + M, *slots = o + 2 * M, *ctx = o + 3 * M, *qsl = ctx + Bp;
    i64 *last = qsl + Bp + 1, *spos = last + Bp, *sslots = spos + S * Bp, *sctx = sslots + S * Bp;
    i64 *sqsl = sctx + S * Bp, *tab = sqsl + Bp + 1;
    /* defaults: padding rows and sequences, unused steps (slot -1 writes no K/V) */
    memset(o, 0, (size_t)(head + Bp * W) * 8);
    for (i64 i = 0; i < M; i++) slots[i] = -1;
    for (i64 i = 0; i < S * Bp; i++) sslots[i] = -1;
    i64 t = 0;
    for (Py_ssize_t r = 0; r < A; r++) {
        PyObject *bt = PySequence_Fast(PySequence_Fast_GET_ITEM(tables, r), "a block table must be a list");
        if (!bt) goto done;
        const Py_ssize_t nb = PySequence_Fast_GET_SIZE(bt);
        if (nb > W) {
            PyErr_Format(PyExc_ValueError, "draft_ints: block table of %zd blocks > width %lld", nb, W);
            Py_DECREF(bt);
            goto done;
        }
        i64 *row = tab + r * W;
        for (Py_ssize_t b = 0; b < nb; b++)
            if (item_i64(bt, b, row + b) < 0) { Py_DECREF(bt); goto done; }
        i64 c0, k;
        if (item_i64(cached, r, &c0) < 0 || item_i64(ks, r, &k) < 0) { Py_DECREF(bt); goto done; }
        PyObject *feed = PySequence_Fast(PySequence_Fast_GET_ITEM(feeds, r), "a feed must be a list");
        if (!feed) { Py_DECREF(bt); goto done; }
        const Py_ssize_t nf = PySequence_Fast_GET_SIZE(feed);
        const i64 n = c0 + nf; /* tokens in the draft cache after the catch-up */
        if (t + nf > M || (nf > 0 && (n - 1) / bs >= nb)) {
            PyErr_Format(PyExc_ValueError,
                         "draft_ints: sequence %zd: %lld catch-up rows over %lld, or position %lld "
                         "past its %zd blocks",
                         r, (long long)(t + nf), (long long)M, (long long)(n - 1), nb);
            Py_DECREF(feed);
            Py_DECREF(bt);
            goto done;
        }
        for (Py_ssize_t f = 0; f < nf; f++) {
            const i64 p = c0 + f;
            if (item_i64(feed, f, ids + t + f) < 0) { Py_DECREF(feed); Py_DECREF(bt); goto done; }
            pos[t + f] = p;
            slots[t + f] = row[p / bs] * bs + p % bs;
        }
        Py_DECREF(feed);
        Py_DECREF(bt);
        ctx[r] = n;
        t += nf;
        qsl[r + 1] = t;
        last[r] = t - 1;
        /* step j feeds draft j at position n + j; rows with k - 1 <= j skip it (no write) */
        for (i64 j = 0; j < S; j++) {
            i64 *sp = spos + j * Bp + r, *ss = sslots + j * Bp + r, *sc = sctx + j * Bp + r;
            if (j < k - 1) {
                const i64 q = n + j;
                i64 b = q / bs;
                if (b > W - 1) b = W - 1;
                *sp = q;
                *ss = (b < nb ? row[b] : 0) * bs + q % bs;
                *sc = q + 1;
            } else {
                *sc = n;
            }
        }
    }
    for (i64 r = A; r < Bp; r++) qsl[r + 1] = t;
    for (i64 r = 0; r <= Bp; r++) sqsl[r] = r < A ? r : A;
    res = Py_None;
    Py_INCREF(res);
done:
    Py_XDECREF(tables);
    Py_XDECREF(cached);
    Py_XDECREF(feeds);
    Py_XDECREF(ks);
    PyBuffer_Release(&ob);
    return res;
}

/* eagle_ints: the int64 input vector of the one-graph greedy EAGLE propose
 * (framework/drafting/head_graph.py, layout in drafting/propose_ints.py; ``fused_ints`` there is
 * the Python version and the reference). Rows: the call's sequences in graph order, drafting first.
 *
 *   eagle_ints(out, tables, offsets, starts, ns, tokens, A, Bp, Q, K, W, bs)
 *     tables:  list of block tables (lists of int, at most W long) of the draft cache
 *     offsets: first position each draft cache holds;  starts: first position of the catch-up
 *     ns:      tokens of each sequence (the catch-up covers positions start .. n - 2)
 *     tokens:  each sequence's token ids (a list; the catch-up feeds tokens[start + 1 : n])
 * A catch-up position past its table reads block 0 (as a zero-padded table row does). */
static PyObject *py_eagle_ints(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 12)
        return PyErr_Format(PyExc_TypeError,
                            "eagle_ints(out, tables, offsets, starts, ns, tokens, A, Bp, Q, K, W, bs)");
    i64 dims[6];
    static const i64 mins[6] = {0, 1, 1, 1, 1, 1};
    if (int_args(args + 6, 6, dims, mins, "eagle_ints: A >= 0 and Bp, Q, K, W, bs >= 1") < 0)
        return NULL;
    const i64 A = dims[0], Bp = dims[1], Q = dims[2], K = dims[3], W = dims[4], bs = dims[5];
    const i64 M = Bp * Q, S = K - 1;
    const i64 total = 3 * M + 3 * Bp + 1 + 3 * S * Bp + Bp + 1 + Bp * W;
    PyObject *res = NULL, *l[5] = {NULL, NULL, NULL, NULL, NULL};
    Py_buffer ob;
    if (int_buffer(args[0], 8, total, 1, &ob, "eagle_ints", "out") < 0) return NULL;
    for (int j = 0; j < 5; j++)
        if (!(l[j] = PySequence_Fast(args[1 + j], "eagle_ints: tables, offsets, starts, ns and "
                                                  "tokens must be lists")))
            goto done;
    const Py_ssize_t R = PySequence_Fast_GET_SIZE(l[0]);
    for (int j = 1; j < 5; j++)
        if (PySequence_Fast_GET_SIZE(l[j]) != R) {
            PyErr_SetString(PyExc_ValueError, "eagle_ints: the row lists differ in length");
            goto done;
        }
    if (R > Bp || A > R) {
        PyErr_Format(PyExc_ValueError, "eagle_ints: %zd rows (%lld drafting) for batch bucket %lld",
                     R, (long long)A, (long long)Bp);
        goto done;
    }
    i64 *o = (i64 *)ob.buf;
    i64 *ids = o, *pos = o + M, *slots = o + 2 * M, *ctx = o + 3 * M, *qsl = ctx + Bp;
    i64 *last = qsl + Bp + 1, *spos = last + Bp, *sslots = spos + S * Bp, *sctx = sslots + S * Bp;
    i64 *sqsl = sctx + S * Bp, *tab = sqsl + Bp + 1;
    memset(o, 0, (size_t)total * 8);
    for (i64 i = 0; i < M; i++) slots[i] = -1;
    for (i64 i = 0; i < S * Bp; i++) sslots[i] = -1;
    i64 t = 0;
    for (Py_ssize_t r = 0; r < R; r++) {
        i64 off, start, n;
        if (item_i64(l[1], r, &off) < 0 || item_i64(l[2], r, &start) < 0
            || item_i64(l[3], r, &n) < 0)
            goto done;
        PyObject *bt = PySequence_Fast(PySequence_Fast_GET_ITEM(l[0], r), "a block table must be a list");
        if (!bt) goto done;
        const Py_ssize_t nb = PySequence_Fast_GET_SIZE(bt);
        PyObject *tk = PySequence_Fast(PySequence_Fast_GET_ITEM(l[4], r), "token ids must be a list");
        if (!tk) { Py_DECREF(bt); goto done; }
        const i64 cnt = n - 1 - start; /* catch-up rows: positions start .. n - 2 */
        if (nb > W || cnt < 0 || t + cnt > M || n > PySequence_Fast_GET_SIZE(tk) || start < off) {
            PyErr_Format(PyExc_ValueError,
                         "eagle_ints: row %zd: table of %zd blocks (width %lld), catch-up %lld .. "
                         "%lld (offset %lld, %zd tokens), %lld rows over %lld",
                         r, nb, (long long)W, (long long)start, (long long)(n - 2), (long long)off,
                         PySequence_Fast_GET_SIZE(tk), (long long)(t + cnt), (long long)M);
            Py_DECREF(tk);
            Py_DECREF(bt);
            goto done;
        }
        i64 *row = tab + r * W;
        int bad = 0;
        for (Py_ssize_t b = 0; b < nb && !bad; b++) bad = item_i64(bt, b, row + b) < 0;
        for (i64 f = 0; f < cnt && !bad; f++) {
            const i64 q = start + f, idx = q - off, b = idx / bs;
            bad = item_i64(tk, start + 1 + f, ids + t + f) < 0;
            pos[t + f] = q;
            slots[t + f] = (b < nb ? row[b] : 0) * bs + idx % bs;
        }
        Py_DECREF(tk);
        Py_DECREF(bt);
        if (bad) goto done;
        ctx[r] = n - 1 - off;
        t += cnt;
        qsl[r + 1] = t;
        if (r < A) {
            last[r] = t - 1;
            for (i64 j = 0; j < S; j++) { /* draft step j writes position n - 1 + j */
                const i64 idx = n - 1 + j - off, b = idx / bs;
                spos[j * Bp + r] = n - 1 + j;
                sslots[j * Bp + r] = (b < nb ? row[b] : 0) * bs + idx % bs;
                sctx[j * Bp + r] = idx + 1;
            }
        }
    }
    for (i64 r = R; r < Bp; r++) qsl[r + 1] = t;
    for (i64 r = 0; r <= Bp; r++) sqsl[r] = r < A ? r : A;
    res = Py_None;
    Py_INCREF(res);
done:
    for (int j = 0; j < 5; j++) Py_XDECREF(l[j]);
    PyBuffer_Release(&ob);
    return res;
}

/* ring_ints: the inputs of one engine forward replayed as a CUDA graph
 * (engine/cuda_graph.py ``CudaGraphRunner._fill_small``, the Python version and the reference),
 * written into a pinned staging buffer or ring slot. Between a verification step's read-back and
 * the next launch the GPU waits for this.
 *
 *   ring_ints(h64, h32, tables, starts, feeds, on_device, N, M, B, W, bs, c, q, t)
 *     h64: int64 buffer of >= 3 * N entries: ids | positions | slots, N each (first M written)
 *     h32: int32 buffer: ctx at c (B), query starts at q (B + 1), block tables at t (B rows of W;
 *          only each sequence's own blocks are written)
 *     tables: list of block tables (lists of int);  starts: tokens cached before this step
 *     feeds: list of token lists (their lengths are the query lengths; with on_device true their
 *            ids are written as 0, the caller copies them on the device)
 * Padding rows get id 0, position 0 and slot -1 (no K/V write); padding sequences context 0 and
 * an empty query range. */
static PyObject *py_ring_ints(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 14)
        return PyErr_Format(PyExc_TypeError, "ring_ints(h64, h32, tables, starts, feeds, "
                                             "on_device, N, M, B, W, bs, c, q, t)");
    const int on_device = PyObject_IsTrue(args[5]);
    if (on_device < 0) return NULL;
    i64 d[8];
    static const i64 mins[8] = {1, 1, 1, 1, 1, 0, 0, 0};
    if (int_args(args + 6, 8, d, mins, "ring_ints: N, M, B, W, bs >= 1 and c, q, t >= 0") < 0)
        return NULL;
    const i64 N = d[0], M = d[1], B = d[2], W = d[3], bs = d[4], c = d[5], q = d[6], t0 = d[7];
    if (M > N) return PyErr_Format(PyExc_ValueError, "ring_ints: M=%lld rows > N=%lld", M, N);
    i64 need32 = t0 + B * W;
    if (c + B > need32) need32 = c + B;
    if (q + B + 1 > need32) need32 = q + B + 1;
    PyObject *res = NULL, *l[3] = {NULL, NULL, NULL};
    Py_buffer b64, b32;
    if (int_buffer(args[0], 8, 3 * N, 0, &b64, "ring_ints", "h64") < 0) return NULL;
    if (int_buffer(args[1], 4, need32, 0, &b32, "ring_ints", "h32") < 0) {
        PyBuffer_Release(&b64);
        return NULL;
    }
    for (int j = 0; j < 3; j++)
        if (!(l[j] = PySequence_Fast(args[2 + j], "ring_ints: tables, starts and feeds must be "
                                                  "lists")))
            goto done;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(l[0]);
    if (PySequence_Fast_GET_SIZE(l[1]) != n || PySequence_Fast_GET_SIZE(l[2]) != n || n > B) {
        PyErr_Format(PyExc_ValueError, "ring_ints: %zd tables, %zd starts, %zd feeds for a batch "
                     "bucket of %lld", n, PySequence_Fast_GET_SIZE(l[1]),
                     PySequence_Fast_GET_SIZE(l[2]), (long long)B);
        goto done;
    }
    i64 *ids = (i64 *)b64.buf, *pos = ids + N, *slots = ids + 2 * N;
    int *h32 = (int *)b32.buf, *ctx = h32 + c, *qsl = h32 + q, *tab = h32 + t0;
    i64 T = 0;
    qsl[0] = 0;
    for (Py_ssize_t r = 0; r < n; r++) {
        i64 start;
        if (item_i64(l[1], r, &start) < 0) goto done;
        PyObject *bt = PySequence_Fast(PySequence_Fast_GET_ITEM(l[0], r), "a block table must be a list");
        if (!bt) goto done;
        PyObject *feed = PySequence_Fast(PySequence_Fast_GET_ITEM(l[2], r), "a feed must be a list");
        if (!feed) { Py_DECREF(bt); goto done; }
        const Py_ssize_t nb = PySequence_Fast_GET_SIZE(bt), nf = PySequence_Fast_GET_SIZE(feed);
        if (nb > W || T + nf > M || start < 0 || (nf > 0 && (start + nf - 1) / bs >= nb)) {
            PyErr_Format(PyExc_ValueError,
                         "ring_ints: sequence %zd: table of %zd blocks (width %lld), positions "
                         "%lld .. %lld, %lld rows over %lld",
                         r, nb, (long long)W, (long long)start, (long long)(start + nf - 1),
                         (long long)(T + nf), (long long)M);
            Py_DECREF(feed);
            Py_DECREF(bt);
            goto done;
        }
        int *row = tab + r * W;
        int bad = 0;
        for (Py_ssize_t b = 0; b < nb && !bad; b++) {
            i64 v;
            bad = item_i64(bt, b, &v) < 0;
            if (!bad && (v < 0 || v > 0x7fffffff)) {
                PyErr_Format(PyExc_ValueError, "ring_ints: sequence %zd: block id %lld is not an "
                             "int32 block index", r, (long long)v);
                bad = 1;
            }
            row[b] = (int)v;
        }
        for (Py_ssize_t f = 0; f < nf && !bad; f++) {
            const i64 p = start + f;
            if (on_device)
                ids[T + f] = 0;
            else
                bad = item_i64(feed, f, ids + T + f) < 0;
            pos[T + f] = p;
            slots[T + f] = (i64)row[p / bs] * bs + p % bs;
        }
        Py_DECREF(feed);
        Py_DECREF(bt);
        if (bad) goto done;
        T += nf;
        ctx[r] = (int)(start + nf);
        qsl[r + 1] = (int)T;
    }
    for (i64 i = T; i < M; i++) {
        ids[i] = 0;
        pos[i] = 0;
        slots[i] = -1;
    }
    for (i64 r = n; r < B; r++) {
        ctx[r] = 0;
        qsl[r + 1] = (int)T;
    }
    res = Py_None;
    Py_INCREF(res);
done:
    for (int j = 0; j < 3; j++) Py_XDECREF(l[j]);
    PyBuffer_Release(&b32);
    PyBuffer_Release(&b64);
    return res;
}

static PyMethodDef methods[] = {
    {"draft_ints", (PyCFunction)(void (*)(void))py_draft_ints, METH_FASTCALL,
     "draft_ints(out, tables, cached, feeds, ks, Bp, Q, K, W, bs): the draft model's one-graph "
     "propose inputs (plugins/draft_graph.py)"},
    {"eagle_ints", (PyCFunction)(void (*)(void))py_eagle_ints, METH_FASTCALL,
     "eagle_ints(out, tables, offsets, starts, ns, tokens, A, Bp, Q, K, W, bs): the EAGLE "
     "one-graph propose inputs (plugins/eagle_graph.py)"},
    {"ring_ints", (PyCFunction)(void (*)(void))py_ring_ints, METH_FASTCALL,
     "ring_ints(h64, h32, tables, starts, feeds, on_device, N, M, B, W, bs, c, q, t): an engine "
     "forward's CUDA-graph inputs (engine/cuda_graph.py)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_staging",
                                    "speculant host staging of CUDA-graph inputs", -1, methods};

PyMODINIT_FUNC PyInit__staging(void) { return PyModule_Create(&module); }
