/* prorl_server._tree_c: the group tree's build and verification (issue #34) for groups whose rows recorded no
 * routed experts, compiled. prorl_server/tree.py holds the algorithm and its documentation; this file is the
 * same radix-tree insertion and the same checks, a token at a time over C arrays instead of Python runs, so a
 * group costs a few ns per token and no Python step per node position. tree.py falls back to its own code
 * when this module is missing or raises, and checks every answer of build() with verify() and every failure
 * of verify() with its own verify_tree (which names the failure).
 *
 * Provenance codes: 0 = a token the row did not generate (context); k >= 1 = generated under the k-th weight
 * version of the group (versions[k - 1]). Two codes may share a node position when equal or either is 0
 * (tree._compatible for rows without routes).
 *
 * build(rows) -> (nodes, paths)
 *   rows: list of (ids: list[int], runs: list[(start, end, provenance)] covering [0, len(ids)) (tree.Row.runs:
 *         provenance None or (version,)), prompt_len: int, logprobs: list[float]) in leaf order.
 *   nodes: list of (parent: int | None, depth, owner: int, end, sampled: list[(a, b)], logprobs: list,
 *         version_runs: list[(version, n)]) numbered depth first, children in the order rows reached them.
 *   paths: list[list[int]], one per row.
 * verify(rows, sampled_runs, nodes, leaves) -> float | None
 *   nodes: list of (parent, depth, token_ids, sampled, logprobs, version_runs, routed_experts) as served;
 *   leaves: list of (path, sampled). The largest behaviour-logprob spread, or None at the first check that
 *   fails (or a value of a form it does not read).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    PyObject *ids;      /* the row's token list (borrowed from the caller's tuple) */
    long long *tok;     /* its tokens */
    int *prov;          /* per token: provenance code */
    Py_ssize_t n, plen;
    PyObject *lps;      /* the row's response logprobs (borrowed) */
} CRow;

typedef struct {
    Py_ssize_t start, end, off;  /* row positions [start, end); its positions' provenance at pool[off ...] */
    int row, parent;
    int slot;       /* its index in its parent's kids */
    int next_same;  /* the parent's next kid with the same first token (other provenance), in kids order; -1 */
    int *kids;      /* in the order rows first reached them */
    int nkids, capkids;
} Node;

/* The kids of a node by first token: (parent, token) -> the first such kid (the rest by next_same), open
 * addressing. A row finds its child in O(1) however many children a node has (a wide group: thousands of
 * samples branching after one prompt); the table holds every node but the root, so it never fills. */
typedef struct {
    long long token;
    int parent, kid;  /* parent -1: empty */
} Edge;

typedef struct {
    CRow *rows;
    int nrows;
    Node *nodes;
    int nnodes, capnodes;
    int *pprov, *psrc;  /* the pool: a node's per-position provenance and the row whose logprob it keeps */
    Py_ssize_t ptop;
    Edge *edges;
    size_t emask;  /* capacity - 1 (a power of two) */
} Build;

static Edge *edge(Build *b, int parent, long long token) {
    size_t h = ((size_t)token * 0x9E3779B97F4A7C15ULL) ^ ((size_t)parent * 0xC2B2AE3D27D4EB4FULL);
    for (size_t i = (h ^ (h >> 29)) & b->emask;; i = (i + 1) & b->emask) {
        Edge *e = &b->edges[i];
        if (e->parent < 0 || (e->parent == parent && e->token == token)) return e;
    }
}

static long long first_token(Build *b, int j) { return b->rows[b->nodes[j].row].tok[b->nodes[j].start]; }

static int compat(int p, int q) { return p == q || p == 0 || q == 0; }

/* Lets other threads run after about 2^19 tokens of work. The route calls this module from a worker thread
 * while the server's event loop waits for the GIL; a release hands the GIL over when a waiting thread asked for
 * it (after its switch interval, 5 ms), as happens between bytecodes of Python code. A large group would
 * otherwise hold the loop for the whole call (tests/core/test_group_tree.py measures it). */
static void yield_gil(Py_ssize_t *work, Py_ssize_t n) {
    *work += n;
    if (*work >= (1 << 19)) {
        *work = 0;
        Py_BEGIN_ALLOW_THREADS
        Py_END_ALLOW_THREADS
    }
}

static void free_rows(CRow *rows, int n) {
    if (!rows) return;
    for (int i = 0; i < n; i++) { free(rows[i].tok); free(rows[i].prov); }
    free(rows);
}

/* A list of ints as long longs; -1 on anything else (an exception set or not: the caller clears it). */
static int to_ll(PyObject *list, long long *out, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyList_GET_ITEM(list, i);
        if (!PyLong_Check(x)) return -1;
        long long v = PyLong_AsLongLong(x);
        if (v == -1 && PyErr_Occurred()) return -1;
        out[i] = v;
    }
    return 0;
}

/* Reads rows (see the header) into C arrays, numbering each provenance tuple in pcodes ({(version,): code})
 * and provs (provs[code - 1]) as it first appears; -1 with an exception set on a form it does not take. */
static int read_rows(PyObject *rows, PyObject *pcodes, PyObject *provs, CRow **out, int *nout, Py_ssize_t *work) {
    if (!PyList_Check(rows)) { PyErr_SetString(PyExc_TypeError, "rows: a list"); return -1; }
    Py_ssize_t nr = PyList_GET_SIZE(rows);
    if (nr > 1 << 24) { PyErr_SetString(PyExc_ValueError, "too many rows"); return -1; }
    CRow *cr = calloc(nr ? nr : 1, sizeof(CRow));
    if (!cr) { PyErr_NoMemory(); return -1; }
    for (Py_ssize_t r = 0; r < nr; r++) {
        PyObject *t = PyList_GET_ITEM(rows, r);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 4) goto bad;
        PyObject *ids = PyTuple_GET_ITEM(t, 0), *runs = PyTuple_GET_ITEM(t, 1), *plen = PyTuple_GET_ITEM(t, 2);
        PyObject *lps = PyTuple_GET_ITEM(t, 3);
        if (!PyList_Check(ids) || !PyList_Check(runs) || !PyLong_Check(plen) || !PyList_Check(lps)) goto bad;
        Py_ssize_t n = PyList_GET_SIZE(ids);
        cr[r].ids = ids; cr[r].lps = lps; cr[r].n = n;
        cr[r].plen = PyLong_AsSsize_t(plen);
        if (cr[r].plen < 0 || cr[r].plen > n) goto bad;
        cr[r].tok = malloc((n ? n : 1) * sizeof(long long));
        cr[r].prov = malloc((n ? n : 1) * sizeof(int));
        if (!cr[r].tok || !cr[r].prov) { PyErr_NoMemory(); goto fail; }
        if (to_ll(ids, cr[r].tok, n) < 0) goto bad;
        yield_gil(work, n);
        Py_ssize_t at = 0;
        for (Py_ssize_t k = 0; k < PyList_GET_SIZE(runs); k++) {
            PyObject *run = PyList_GET_ITEM(runs, k);
            if (!PyTuple_Check(run) || PyTuple_GET_SIZE(run) != 3) goto bad;
            Py_ssize_t s = PyLong_AsSsize_t(PyTuple_GET_ITEM(run, 0)), e = PyLong_AsSsize_t(PyTuple_GET_ITEM(run, 1));
            PyObject *p = PyTuple_GET_ITEM(run, 2);
            long code = 0;
            if (PyErr_Occurred() || s != at || e < s || e > n) goto bad;
            if (p != Py_None) {
                if (!PyTuple_Check(p) || PyTuple_GET_SIZE(p) != 1) goto bad;  /* (version,): no routes */
                PyObject *c = PyDict_GetItemWithError(pcodes, p);
                if (c) {
                    code = PyLong_AsLong(c);
                } else {
                    if (PyErr_Occurred()) goto fail;
                    code = PyList_GET_SIZE(provs) + 1;
                    PyObject *v = PyLong_FromLong(code);
                    if (!v || PyDict_SetItem(pcodes, p, v) < 0 || PyList_Append(provs, p) < 0) { Py_XDECREF(v); goto fail; }
                    Py_DECREF(v);
                }
            }
            for (Py_ssize_t i = s; i < e; i++) cr[r].prov[i] = (int)code;
            at = e;
        }
        if (at != n) goto bad;
    }
    *out = cr; *nout = (int)nr;
    return 0;
bad:
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a row of a form build() does not take");
fail:
    free_rows(cr, (int)nr);
    return -1;
}

static int add_kid(Node *x, int kid) {
    if (x->nkids == x->capkids) {
        int cap = x->capkids ? 2 * x->capkids : 2;
        int *k = realloc(x->kids, cap * sizeof(int));
        if (!k) return -1;
        x->kids = k; x->capkids = cap;
    }
    x->kids[x->nkids++] = kid;
    return 0;
}

static int new_node(Build *b, int row, Py_ssize_t start, Py_ssize_t end, int parent, Py_ssize_t off) {
    if (b->nnodes == b->capnodes) {
        int cap = 2 * b->capnodes;
        Node *nn = realloc(b->nodes, cap * sizeof(Node));
        if (!nn) return -1;
        b->nodes = nn; b->capnodes = cap;
    }
    Node *x = &b->nodes[b->nnodes];
    x->start = start; x->end = end; x->off = off; x->row = row; x->parent = parent;
    x->slot = 0; x->next_same = -1;
    x->kids = NULL; x->nkids = x->capkids = 0;
    return b->nnodes++;
}

/* Inserts row r (tree.py's _build insertion); its end node in *end; -1 when out of memory. */
static int insert(Build *b, int r, int *end) {
    CRow *row = &b->rows[r];
    Py_ssize_t pos = 0, n = row->n;
    int node = 0;
    while (pos < n) {
        int child = -1, last = -1;
        Edge *e = edge(b, node, row->tok[pos]);
        for (int k = e->parent < 0 ? -1 : e->kid; k >= 0; last = k, k = b->nodes[k].next_same)
            if (compat(row->prov[pos], b->pprov[b->nodes[k].off])) { child = k; break; }
        if (child < 0) {  /* a new leaf node: the rest of the row */
            Py_ssize_t off = b->ptop;
            int c = new_node(b, r, pos, n, node, off);
            if (c < 0 || add_kid(&b->nodes[node], c) < 0) return -1;
            b->nodes[c].slot = b->nodes[node].nkids - 1;
            if (last >= 0) b->nodes[last].next_same = c;  /* the last kid with this first token */
            else { e->parent = node; e->token = row->tok[pos]; e->kid = c; }
            for (Py_ssize_t i = pos; i < n; i++) {
                b->pprov[off + i - pos] = row->prov[i];
                b->psrc[off + i - pos] = row->prov[i] ? r : -1;
            }
            b->ptop += n - pos;
            node = c;
            break;
        }
        Node *c = &b->nodes[child];
        Py_ssize_t length = c->end - c->start, lim = length < n - pos ? length : n - pos, m = 0;
        const long long *otok = b->rows[c->row].tok;
        const int *np = b->pprov + c->off;
        while (m < lim && row->tok[pos + m] == otok[pos + m] && compat(row->prov[pos + m], np[m])) m++;
        if (m < length) {  /* split: a head node takes [start, start + m); the child keeps its tail */
            int head = new_node(b, c->row, pos, pos + m, node, c->off);
            if (head < 0) return -1;
            c = &b->nodes[child];  /* new_node may move the nodes */
            Node *h = &b->nodes[head];
            /* the head takes the child's place: in the parent's kids, and in its first token's chain */
            b->nodes[node].kids[c->slot] = head;
            h->slot = c->slot;
            h->next_same = c->next_same;
            if (e->kid == child) e->kid = head;
            else b->nodes[last].next_same = head;  /* last: the kid before the child in the chain */
            c->parent = head; c->start = pos + m; c->off += m; c->slot = 0; c->next_same = -1;
            if (add_kid(&b->nodes[head], child) < 0) return -1;
            Edge *e2 = edge(b, head, first_token(b, child));
            e2->parent = head; e2->token = first_token(b, child); e2->kid = child;
            child = head;
        }
        Py_ssize_t off = b->nodes[child].off;
        for (Py_ssize_t i = 0; i < m; i++)  /* the row generated what the node held as context: the node takes it */
            if (b->pprov[off + i] == 0 && row->prov[pos + i] != 0) {
                b->pprov[off + i] = row->prov[pos + i];
                b->psrc[off + i] = r;
            }
        node = child;
        pos += m;
    }
    *end = node;
    return 0;
}

static PyObject *zero;  /* 0.0: a context token's behaviour logprob */

/* The node's tuple for the caller (see the header). */
static PyObject *emit_node(Build *b, int j, PyObject *parent, PyObject *provs) {
    Node *x = &b->nodes[j];
    Py_ssize_t L = x->end - x->start;
    const int *pp = b->pprov + x->off, *ps = b->psrc + x->off;
    PyObject *sampled = PyList_New(0), *lps = PyList_New(L), *vr = PyList_New(0), *t = NULL;
    if (!sampled || !lps || !vr) goto done;
    int last_code = -1;
    Py_ssize_t last_n = 0;
    for (Py_ssize_t i = 0; i < L;) {
        if (!pp[i]) { Py_INCREF(zero); PyList_SET_ITEM(lps, i, zero); i++; continue; }
        Py_ssize_t a = i;
        while (i < L && pp[i]) {
            CRow *src = &b->rows[ps[i]];
            Py_ssize_t k = x->start + i - src->plen;
            PyObject *lp = (k >= 0 && k < PyList_GET_SIZE(src->lps)) ? PyList_GET_ITEM(src->lps, k) : zero;
            Py_INCREF(lp);
            PyList_SET_ITEM(lps, i, lp);
            if (pp[i] != last_code) {
                if (last_code > 0) {
                    PyObject *v = Py_BuildValue("(On)", PyTuple_GET_ITEM(PyList_GET_ITEM(provs, last_code - 1), 0), last_n);
                    if (!v || PyList_Append(vr, v) < 0) { Py_XDECREF(v); goto done; }
                    Py_DECREF(v);
                }
                last_code = pp[i]; last_n = 0;
            }
            last_n++;
            i++;
        }
        PyObject *run = Py_BuildValue("(nn)", a, i);
        if (!run || PyList_Append(sampled, run) < 0) { Py_XDECREF(run); goto done; }
        Py_DECREF(run);
    }
    if (last_code > 0) {
        PyObject *v = Py_BuildValue("(On)", PyTuple_GET_ITEM(PyList_GET_ITEM(provs, last_code - 1), 0), last_n);
        if (!v || PyList_Append(vr, v) < 0) { Py_XDECREF(v); goto done; }
        Py_DECREF(v);
    }
    t = Py_BuildValue("(OnnnOOO)", parent, x->start, (Py_ssize_t)x->row, x->end, sampled, lps, vr);
done:
    Py_XDECREF(sampled); Py_XDECREF(lps); Py_XDECREF(vr);
    return t;
}

static PyObject *build(PyObject *self, PyObject *args) {
    PyObject *rows_in;
    if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &rows_in)) return NULL;
    Build b = {0};
    PyObject *result = NULL, *nodes = NULL, *paths = NULL, *pcodes = PyDict_New(), *provs = PyList_New(0);
    int *ends = NULL, *number = NULL, *stack = NULL, failed = 0;
    Py_ssize_t work = 0;
    if (!pcodes || !provs || read_rows(rows_in, pcodes, provs, &b.rows, &b.nrows, &work) < 0) goto out;
    Py_ssize_t total = 0;
    for (int r = 0; r < b.nrows; r++) total += b.rows[r].n;
    b.pprov = malloc((total ? total : 1) * sizeof(int));
    b.psrc = malloc((total ? total : 1) * sizeof(int));
    b.capnodes = 2 * b.nrows + 2;
    b.nodes = malloc(b.capnodes * sizeof(Node));
    size_t cap = 16;
    while (cap < 2 * (size_t)b.capnodes) cap *= 2;  /* at most 2 nodes per row: the load stays under 1/2 */
    b.emask = cap - 1;
    b.edges = malloc(cap * sizeof(Edge));
    if (b.edges) for (size_t i = 0; i < cap; i++) b.edges[i].parent = -1;
    ends = malloc((b.nrows ? b.nrows : 1) * sizeof(int));
    if (!b.pprov || !b.psrc || !b.nodes || !ends || !b.edges) { PyErr_NoMemory(); goto out; }
    new_node(&b, -1, 0, 0, -1, 0);  /* the root */
    Py_BEGIN_ALLOW_THREADS  /* the insertion reads and writes C arrays only: other threads run meanwhile */
    for (int r = 0; r < b.nrows && !failed; r++) failed = insert(&b, r, &ends[r]) < 0;
    Py_END_ALLOW_THREADS
    if (failed) { PyErr_NoMemory(); goto out; }
    /* depth-first numbering, children in the order rows first reached them */
    number = malloc(b.nnodes * sizeof(int));
    stack = malloc(b.nnodes * sizeof(int));
    nodes = PyList_New(0);
    if (!number || !stack || !nodes) { if (!nodes) goto out; PyErr_NoMemory(); goto out; }
    int top = 0, count = 0;
    for (int k = b.nodes[0].nkids - 1; k >= 0; k--) stack[top++] = b.nodes[0].kids[k];
    while (top) {
        int j = stack[--top];
        number[j] = count++;
        int p = b.nodes[j].parent;
        PyObject *parent = p == 0 ? Py_None : PyLong_FromLong(number[p]);
        if (!parent) goto out;
        if (p == 0) Py_INCREF(parent);
        PyObject *t = emit_node(&b, j, parent, provs);
        yield_gil(&work, b.nodes[j].end - b.nodes[j].start);
        Py_DECREF(parent);
        if (!t || PyList_Append(nodes, t) < 0) { Py_XDECREF(t); goto out; }
        Py_DECREF(t);
        for (int k = b.nodes[j].nkids - 1; k >= 0; k--) stack[top++] = b.nodes[j].kids[k];
    }
    paths = PyList_New(b.nrows);
    if (!paths) goto out;
    for (int r = 0; r < b.nrows; r++) {
        int depth = 0;
        for (int x = ends[r]; x != 0; x = b.nodes[x].parent) depth++;
        PyObject *path = PyList_New(depth);
        if (!path) goto out;
        PyList_SET_ITEM(paths, r, path);
        for (int x = ends[r]; x != 0; x = b.nodes[x].parent) {
            PyObject *v = PyLong_FromLong(number[x]);
            if (!v) goto out;
            PyList_SET_ITEM(path, --depth, v);
        }
    }
    result = PyTuple_Pack(2, nodes, paths);
out:
    Py_XDECREF(nodes); Py_XDECREF(paths); Py_XDECREF(pcodes); Py_XDECREF(provs);
    if (b.nodes) for (int j = 0; j < b.nnodes; j++) free(b.nodes[j].kids);
    free(b.nodes); free(b.pprov); free(b.psrc); free(b.edges); free(ends); free(number); free(stack);
    free_rows(b.rows, b.nrows);
    return result;
}

/* ---- verify ---- */

typedef struct {
    long long parent, depth;
    Py_ssize_t L;
    long long *tok;
    int *code;          /* per token: 0 or the code of the version it was generated under */
    PyObject *lps;      /* borrowed */
} VNode;

/* (a, b) of a run: a 2-item sequence of ints; -1 on anything else. */
static int pair(PyObject *run, Py_ssize_t *a, Py_ssize_t *b) {
    if (!(PyTuple_Check(run) || PyList_Check(run)) || PySequence_Fast_GET_SIZE(run) != 2) return -1;
    PyObject **it = PySequence_Fast_ITEMS(run);
    if (!PyLong_Check(it[0]) || !PyLong_Check(it[1])) return -1;
    *a = PyLong_AsSsize_t(it[0]); *b = PyLong_AsSsize_t(it[1]);
    return PyErr_Occurred() ? -1 : 0;
}

static int read_vnode(PyObject *t, PyObject *pcodes, VNode *v) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 7) return -1;
    PyObject *parent = PyTuple_GET_ITEM(t, 0), *depth = PyTuple_GET_ITEM(t, 1), *ids = PyTuple_GET_ITEM(t, 2);
    PyObject *sampled = PyTuple_GET_ITEM(t, 3), *lps = PyTuple_GET_ITEM(t, 4), *vr = PyTuple_GET_ITEM(t, 5);
    if (PyTuple_GET_ITEM(t, 6) != Py_None || !PyList_Check(ids) || !PyList_Check(sampled) || !PyList_Check(lps)
        || !PyList_Check(vr) || !PyLong_Check(depth) || (parent != Py_None && !PyLong_Check(parent)))
        return -1;
    v->parent = parent == Py_None ? -1 : PyLong_AsLongLong(parent);
    v->depth = PyLong_AsLongLong(depth);
    if (PyErr_Occurred() || v->depth < 0 || (parent != Py_None && v->parent < 0)) return -1;
    Py_ssize_t L = v->L = PyList_GET_SIZE(ids);
    if (PyList_GET_SIZE(lps) != L) return -1;
    v->lps = lps;
    v->tok = malloc((L ? L : 1) * sizeof(long long));
    v->code = calloc(L ? L : 1, sizeof(int));
    if (!v->tok || !v->code || to_ll(ids, v->tok, L) < 0) return -1;
    for (Py_ssize_t i = 0; i < L; i++) {
        double d = PyFloat_AsDouble(PyList_GET_ITEM(lps, i));
        if ((d == -1.0 && PyErr_Occurred()) || !isfinite(d)) return -1;
    }
    /* the version of each generated token, from the version runs in order over the sampled runs */
    Py_ssize_t at = 0, nvr = PyList_GET_SIZE(vr), k = 0, left = 0;
    int code = 0;
    for (Py_ssize_t q = 0; q < PyList_GET_SIZE(sampled); q++) {
        Py_ssize_t s, e;
        if (pair(PyList_GET_ITEM(sampled, q), &s, &e) < 0 || !(at <= s && s < e && e <= L)) return -1;
        for (Py_ssize_t i = at; i < s; i++)
            if (PyFloat_AsDouble(PyList_GET_ITEM(lps, i)) != 0.0) return -1;
        for (Py_ssize_t i = s; i < e; i++) {
            while (!left) {
                if (k >= nvr) return -1;
                PyObject *run = PyList_GET_ITEM(vr, k++);
                if (!(PyTuple_Check(run) || PyList_Check(run)) || PySequence_Fast_GET_SIZE(run) != 2) return -1;
                PyObject **it = PySequence_Fast_ITEMS(run);
                PyObject *key = PyTuple_Pack(1, it[0]);  /* the provenance of a token generated under it */
                PyObject *c = key ? PyDict_GetItemWithError(pcodes, key) : NULL;
                Py_XDECREF(key);
                if (!c || !PyLong_Check(it[1])) return -1;
                code = (int)PyLong_AsLong(c);
                left = PyLong_AsSsize_t(it[1]);
                if (PyErr_Occurred() || left < 0 || code <= 0) return -1;
            }
            v->code[i] = code;
            left--;
        }
        at = e;
    }
    for (Py_ssize_t i = at; i < L; i++)
        if (PyFloat_AsDouble(PyList_GET_ITEM(lps, i)) != 0.0) return -1;
    if (left) return -1;
    for (; k < nvr; k++) {  /* only empty runs may follow */
        PyObject *run = PyList_GET_ITEM(vr, k);
        if (!(PyTuple_Check(run) || PyList_Check(run)) || PySequence_Fast_GET_SIZE(run) != 2) return -1;
        PyObject *cnt = PySequence_Fast_ITEMS(run)[1];
        if (!PyLong_Check(cnt) || PyLong_AsSsize_t(cnt) != 0) return -1;
    }
    return 0;
}

static PyObject *verify(PyObject *self, PyObject *args) {
    PyObject *rows_in, *sampled_runs, *nodes_in, *leaves;
    if (!PyArg_ParseTuple(args, "O!O!O!O!", &PyList_Type, &rows_in, &PyList_Type, &sampled_runs, &PyList_Type,
                          &nodes_in, &PyList_Type, &leaves))
        return NULL;
    PyObject *pcodes = PyDict_New(), *provs = PyList_New(0);
    CRow *rows = NULL;
    int nrows = 0, ok = 0;
    double spread = 0.0;
    Py_ssize_t nn = PyList_GET_SIZE(nodes_in);
    VNode *vn = calloc(nn ? nn : 1, sizeof(VNode));
    if (!vn || !pcodes || !provs) { Py_XDECREF(pcodes); Py_XDECREF(provs); free(vn); return PyErr_NoMemory(); }
    Py_ssize_t work = 0;
    if (read_rows(rows_in, pcodes, provs, &rows, &nrows, &work) < 0) goto out;
    if (PyList_GET_SIZE(leaves) != nrows || PyList_GET_SIZE(sampled_runs) != nrows) goto out;
    for (Py_ssize_t j = 0; j < nn; j++) {
        if (read_vnode(PyList_GET_ITEM(nodes_in, j), pcodes, &vn[j]) < 0) goto out;
        yield_gil(&work, vn[j].L);
    }
    for (int r = 0; r < nrows; r++) {
        CRow *row = &rows[r];
        yield_gil(&work, row->n);
        PyObject *leaf = PyList_GET_ITEM(leaves, r), *mine = PyList_GET_ITEM(sampled_runs, r);
        if (!PyTuple_Check(leaf) || PyTuple_GET_SIZE(leaf) != 2 || !PyList_Check(PyTuple_GET_ITEM(leaf, 0))
            || !PyList_Check(PyTuple_GET_ITEM(leaf, 1)) || !PyList_Check(mine))
            goto out;
        PyObject *path = PyTuple_GET_ITEM(leaf, 0), *ls = PyTuple_GET_ITEM(leaf, 1);
        Py_ssize_t np = PyList_GET_SIZE(path), pos = 0;
        long long parent = -1;
        if (np > nn) goto out;
        int *pn = malloc((np ? np : 1) * sizeof(int));
        if (!pn) { PyErr_NoMemory(); goto out; }
        int good = 1;
        for (Py_ssize_t q = 0; q < np && good; q++) {  /* the path: parent links, depths, tokens */
            PyObject *x = PyList_GET_ITEM(path, q);
            long long nid = PyLong_Check(x) ? PyLong_AsLongLong(x) : -1;
            if (PyErr_Occurred() || nid < 0 || nid >= nn) { good = 0; break; }
            VNode *v = &vn[nid];
            if (v->parent != parent || v->depth != pos || pos + v->L > row->n
                || memcmp(v->tok, row->tok + pos, v->L * sizeof(long long)) != 0) { good = 0; break; }
            pn[q] = (int)nid;
            pos += v->L;
            parent = nid;
        }
        if (!good || pos != row->n || PyList_GET_SIZE(ls) != PyList_GET_SIZE(mine)) { free(pn); goto out; }
        /* the leaf's sampled runs are the row's, each token generated by its node under the row's version */
        Py_ssize_t q = 0, qstart = 0;  /* the path node holding position p, and its first position */
        for (Py_ssize_t k = 0; k < PyList_GET_SIZE(ls) && good; k++) {
            Py_ssize_t s, e, s2, e2;
            if (pair(PyList_GET_ITEM(ls, k), &s, &e) < 0 || pair(PyList_GET_ITEM(mine, k), &s2, &e2) < 0
                || s != s2 || e != e2 || !(0 <= s && s < e && e <= row->n)) { good = 0; break; }
            for (Py_ssize_t p = s; p < e; p++) {
                while (p >= qstart + vn[pn[q]].L) { qstart += vn[pn[q]].L; q++; }
                VNode *v = &vn[pn[q]];
                if (v->code[p - qstart] == 0 || v->code[p - qstart] != row->prov[p]) { good = 0; break; }
                double a = PyFloat_AsDouble(PyList_GET_ITEM(v->lps, p - qstart));
                Py_ssize_t i = p - row->plen;
                double b2 = (i >= 0 && i < PyList_GET_SIZE(row->lps)) ? PyFloat_AsDouble(PyList_GET_ITEM(row->lps, i))
                                                                      : 0.0;
                if (PyErr_Occurred()) { good = 0; break; }
                double d = fabs(a - b2);
                if (!isfinite(d)) { good = 0; break; }
                if (d > spread) spread = d;
            }
        }
        free(pn);
        if (!good) goto out;
        /* every position the row generated is in its sampled runs (its provenance is the row's) */
        Py_ssize_t gen = 0, listed = 0;
        for (Py_ssize_t p = 0; p < row->n; p++) gen += row->prov[p] != 0;
        for (Py_ssize_t k = 0; k < PyList_GET_SIZE(ls); k++) {
            Py_ssize_t s, e;
            pair(PyList_GET_ITEM(ls, k), &s, &e);
            listed += e - s;
        }
        if (gen != listed) goto out;
    }
    ok = 1;
out:
    PyErr_Clear();
    for (Py_ssize_t j = 0; j < nn; j++) { free(vn[j].tok); free(vn[j].code); }
    free(vn);
    free_rows(rows, nrows);
    Py_DECREF(pcodes); Py_DECREF(provs);
    if (!ok) Py_RETURN_NONE;
    return PyFloat_FromDouble(spread);
}

static PyMethodDef methods[] = {
    {"build", build, METH_VARARGS, "The group tree of rows without routed experts (see prorl_server/tree.py)."},
    {"verify", verify, METH_VARARGS, "Check a served tree against its rows; its logprob spread, or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tree_c", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__tree_c(void) {
    zero = PyFloat_FromDouble(0.0);
    if (!zero) return NULL;
    return PyModule_Create(&module);
}
