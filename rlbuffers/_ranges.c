/* rlbuffers._ranges: copy many byte ranges of a few source buffers into one output buffer,
 * with the GIL released (the ragged gathers of rlbuffers/storage/ragged_column.py), make the
 * row views of packed values (rlbuffers/packed.py: Packed.to_list), and search a sum tree
 * (rlbuffers/sampling/segment_tree.py: SegmentTree.find_prefix).
 *
 * Optional: rlbuffers/ranges.py falls back to Python when this module is not built.
 * Everything is checked before the first byte is written or the first view made: a failed
 * call writes nothing. What the work with the GIL released relies on (indices, the running
 * sum) is copied to private memory with the GIL held and checked there: another thread that
 * changes the caller's arrays meanwhile cannot make it read or write out of bounds.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#define N_INDEX 5
static const char *INDEX_NAMES[N_INDEX] = {"source", "starts", "ends", "dst", "stops"};

/* Get `obj` as a 1-D C-contiguous buffer of 8-byte items whose struct format is one of
 * `formats` ("ql": int64; "d": float64), else TypeError naming `name` and `what` it expected. */
static int vector8(PyObject *obj, const char *name, Py_buffer *view, const char *formats,
                   const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return -1;
    }
    const char *f = view->format ? view->format : "B";
    if (*f == '@' || *f == '=' || *f == '<') {
        f++;
    }
    if (view->ndim != 1 || view->itemsize != 8 || f[0] == 0 || f[1] != 0 ||
        strchr(formats, f[0]) == NULL) {
        PyErr_Format(PyExc_TypeError, "%s: expected a 1-D contiguous %s buffer, got format "
                     "'%s', itemsize %zd, %d dimension(s)", name, what,
                     view->format ? view->format : "B", view->itemsize, view->ndim);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int int64_vector(PyObject *obj, const char *name, Py_buffer *view)
{
    return vector8(obj, name, view, "ql", "int64");
}

PyDoc_STRVAR(copy_ranges_doc,
"copy_ranges(out, sources, source, starts, ends, dst, stops)\n--\n\n"
"For each i: out[dst[i]:dst[i] + n] = sources[source[i]][starts[i]:ends[i]] (n = ends[i] -\n"
"starts[i] bytes), then out[dst[i] + n:stops[i]] = 0. out: a writable C-contiguous buffer\n"
"that may not overlap a source that some row reads; sources: a sequence of C-contiguous\n"
"buffers; the other five: int64[N] C-contiguous buffers. Every index is checked before\n"
"anything is written (ValueError naming the argument, the row, the expected range and the\n"
"value; ValueError naming out where it shares memory with such a source; TypeError for a\n"
"buffer of the wrong kind). The five vectors are copied once, with the GIL held, and only\n"
"that copy is checked and used: the copies run with the GIL released, and a thread that\n"
"changes the vectors meanwhile changes nothing.");

static PyObject *copy_ranges(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *out_obj, *sources_obj, *index_obj[N_INDEX];
    if (!PyArg_ParseTuple(args, "OOOOOOO:copy_ranges", &out_obj, &sources_obj, &index_obj[0],
                          &index_obj[1], &index_obj[2], &index_obj[3], &index_obj[4])) {
        return NULL;
    }
    PyObject *result = NULL, *seq = NULL;
    Py_buffer out = {0}, index[N_INDEX] = {{0}};
    Py_buffer *src = NULL;
    char *have = NULL; /* have[s]: src[s] acquired (only the sources some row reads) */
    int64_t *own = NULL; /* the five vectors, copied: the only values checked and used */
    Py_ssize_t n_src = 0;
    int got_out = 0, got_index = 0;

    if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        goto done;
    }
    got_out = 1;
    for (; got_index < N_INDEX; got_index++) {
        if (int64_vector(index_obj[got_index], INDEX_NAMES[got_index], &index[got_index]) < 0) {
            goto done;
        }
    }
    Py_ssize_t n = index[0].shape[0];
    for (int k = 1; k < N_INDEX; k++) {
        if (index[k].shape[0] != n) {
            PyErr_Format(PyExc_ValueError, "%s: expected %zd values (as source), got %zd",
                         INDEX_NAMES[k], n, index[k].shape[0]);
            goto done;
        }
    }
    if (n > PY_SSIZE_T_MAX / (Py_ssize_t)(N_INDEX * sizeof(int64_t))) {
        PyErr_NoMemory();
        goto done;
    }
    own = PyMem_Malloc(n ? (size_t)n * N_INDEX * sizeof(int64_t) : 1);
    if (own == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (int k = 0; k < N_INDEX && n > 0; k++) {
        memcpy(own + k * n, index[k].buf, (size_t)n * sizeof(int64_t));
    }
    /* A tuple: the items stay referenced while their buffers are acquired, whatever another
     * thread does to a list passed as sources. */
    PyObject *items = PySequence_Fast(sources_obj, "sources: expected a sequence of buffers");
    if (items == NULL) {
        goto done;
    }
    seq = PySequence_Tuple(items);
    Py_DECREF(items);
    if (seq == NULL) {
        goto done;
    }
    n_src = PySequence_Fast_GET_SIZE(seq);
    src = PyMem_Calloc(n_src ? n_src : 1, sizeof(Py_buffer));
    have = PyMem_Calloc(n_src ? n_src : 1, 1);
    if (src == NULL || have == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const int64_t *source = own, *starts = own + n, *ends = own + 2 * n;
    const int64_t *dst = own + 3 * n, *stops = own + 4 * n;
    const char *o = out.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (source[i] < 0 || source[i] >= n_src) {
            PyErr_Format(PyExc_ValueError, "source[%zd]: expected a value in [0, %zd), got %lld",
                         i, n_src, (long long)source[i]);
            goto done;
        }
        if (!have[source[i]]) {
            if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, source[i]), &src[source[i]],
                                   PyBUF_C_CONTIGUOUS) < 0) {
                goto done;
            }
            have[source[i]] = 1;
            const char *b = src[source[i]].buf;
            Py_ssize_t blen = src[source[i]].len;
            if (blen > 0 && out.len > 0 && b < o + out.len && o < b + blen) {
                PyErr_Format(PyExc_ValueError, "out: expected a buffer that shares no memory "
                             "with sources[%lld] (which row %zd reads), got one that overlaps "
                             "its %zd bytes", (long long)source[i], i, blen);
                goto done;
            }
        }
        Py_ssize_t len = src[source[i]].len;
        if (starts[i] < 0 || starts[i] > ends[i] || ends[i] > len) {
            PyErr_Format(PyExc_ValueError, "starts[%zd], ends[%zd]: expected 0 <= start <= end "
                         "<= %zd (the bytes of sources[%lld]), got %lld, %lld", i, i, len,
                         (long long)source[i], (long long)starts[i], (long long)ends[i]);
            goto done;
        }
        if (dst[i] < 0 || dst[i] > stops[i] || ends[i] - starts[i] > stops[i] - dst[i] ||
            stops[i] > out.len) {
            PyErr_Format(PyExc_ValueError, "dst[%zd], stops[%zd]: expected 0 <= dst <= dst + %lld "
                         "(the range's bytes) <= stop <= %zd (the bytes of out), got %lld, %lld",
                         i, i, (long long)(ends[i] - starts[i]), out.len, (long long)dst[i],
                         (long long)stops[i]);
            goto done;
        }
    }
    char *w = out.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t k = ends[i] - starts[i];
        memcpy(w + dst[i], (const char *)src[source[i]].buf + starts[i], (size_t)k);
        memset(w + dst[i] + k, 0, (size_t)(stops[i] - dst[i] - k));
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    for (Py_ssize_t j = 0; have != NULL && j < n_src; j++) {
        if (have[j]) {
            PyBuffer_Release(&src[j]);
        }
    }
    PyMem_Free(have);
    PyMem_Free(src);
    PyMem_Free(own);
    Py_XDECREF(seq);
    for (int k = 0; k < got_index; k++) {
        PyBuffer_Release(&index[k]);
    }
    if (got_out) {
        PyBuffer_Release(&out);
    }
    return result;
}

PyDoc_STRVAR(row_views_doc,
"row_views(values, cu_seqlens)\n--\n\n"
"[values[cu_seqlens[i]:cu_seqlens[i + 1]] for i in range(N)]: N views of values (an ndarray of\n"
"at least 1 dimension), each with values as its base and its dtype, strides and writeability;\n"
"cu_seqlens: int64[N + 1], non-decreasing, in [0, len(values)] (ValueError naming the first\n"
"entry that is not, before any view is made).");

static PyObject *row_views(PyObject *self, PyObject *args)
{
    (void)self;
    PyArrayObject *values;
    PyObject *cu_obj, *list = NULL;
    Py_buffer cu;
    if (!PyArg_ParseTuple(args, "O!O:row_views", &PyArray_Type, &values, &cu_obj)) {
        return NULL;
    }
    int nd = PyArray_NDIM(values);
    if (nd < 1) {
        PyErr_SetString(PyExc_ValueError, "values: expected an array of at least 1 dimension, "
                        "got 0");
        return NULL;
    }
    if (int64_vector(cu_obj, "cu_seqlens", &cu) < 0) {
        return NULL;
    }
    const int64_t *c = cu.buf;
    Py_ssize_t n = cu.shape[0] - 1;
    npy_intp rows = PyArray_DIM(values, 0);
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "cu_seqlens: expected at least 1 value, got 0");
        goto done;
    }
    for (Py_ssize_t i = 0; i <= n; i++) {
        if (c[i] < (i ? c[i - 1] : 0) || c[i] > rows) {
            PyErr_Format(PyExc_ValueError, "cu_seqlens[%zd]: expected a value in [%lld, %lld] "
                         "(non-decreasing, at most len(values)), got %lld", i,
                         (long long)(i ? c[i - 1] : 0), (long long)rows, (long long)c[i]);
            goto done;
        }
    }
    npy_intp dims[NPY_MAXDIMS];
    npy_intp *strides = PyArray_STRIDES(values);
    for (int k = 0; k < nd; k++) {
        dims[k] = PyArray_DIM(values, k);
    }
    PyArray_Descr *descr = PyArray_DESCR(values);
    char *data = PyArray_BYTES(values);
    int flags = PyArray_FLAGS(values) & NPY_ARRAY_WRITEABLE;
    list = PyList_New(n);
    if (list == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        dims[0] = (npy_intp)(c[i + 1] - c[i]);
        Py_INCREF(descr); /* stolen by PyArray_NewFromDescr */
        PyObject *view = PyArray_NewFromDescr(&PyArray_Type, descr, nd, dims, strides,
                                              data + c[i] * strides[0], flags, NULL);
        if (view == NULL) {
            Py_CLEAR(list);
            goto done;
        }
        Py_INCREF(values); /* stolen by PyArray_SetBaseObject, on failure too */
        if (PyArray_SetBaseObject((PyArrayObject *)view, (PyObject *)values) < 0) {
            Py_DECREF(view);
            Py_CLEAR(list);
            goto done;
        }
        PyList_SET_ITEM(list, i, view);
    }
done:
    PyBuffer_Release(&cu);
    return list;
}

PyDoc_STRVAR(prefix_search_doc,
"prefix_search(tree, first, mass, out)\n--\n\n"
"For each i: out[i] = the leaf that SegmentTree.find_prefix finds for mass[i] in the sum tree\n"
"tree (float64[2n], n a power of two, leaves at [n, 2n), root tree[1] > 0), searching first\n"
"the running sum of the `first` nodes at [first, 2 first) (first a power of two <= n): the\n"
"first node b whose running sum exceeds mass[i] (clamped to the largest float below the\n"
"level's total), then below it with mass[i] - the running sum before b, going right where\n"
"(mass >= left and right > 0) or left <= 0. mass: float64[m], each >= 0; out: int64[m],\n"
"each in [0, n). The same floating-point operations in the same order as the numpy path: the\n"
"same leaves. ValueError (naming the argument, before anything is written) for any other\n"
"shape or value, and for a level [first, 2 first) whose running sum is NaN or <= 0 (its\n"
"nodes are not those of a sum tree of finite leaves >= 0: no node to search below).");

static PyObject *prefix_search(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *tree_obj, *mass_obj, *out_obj, *result = NULL;
    Py_ssize_t first;
    Py_buffer tree = {0}, mass = {0}, out = {0};
    double *cs = NULL;
    if (!PyArg_ParseTuple(args, "OnOO:prefix_search", &tree_obj, &first, &mass_obj, &out_obj)) {
        return NULL;
    }
    if (vector8(tree_obj, "tree", &tree, "d", "float64") < 0) {
        return NULL;
    }
    if (vector8(mass_obj, "mass", &mass, "d", "float64") < 0) {
        goto done_tree;
    }
    if (int64_vector(out_obj, "out", &out) < 0) {
        goto done_mass;
    }
    Py_ssize_t n = tree.shape[0] / 2, m = mass.shape[0];
    if (n < 1 || tree.shape[0] != 2 * n || (n & (n - 1)) != 0) {
        PyErr_Format(PyExc_ValueError, "tree: expected 2 n values, n a power of two, got %zd",
                     tree.shape[0]);
        goto done;
    }
    if (first < 1 || first > n || (first & (first - 1)) != 0) {
        PyErr_Format(PyExc_ValueError, "first: expected a power of two in [1, %zd], got %zd", n,
                     first);
        goto done;
    }
    if (out.shape[0] != m || out.readonly) {
        PyErr_Format(PyExc_ValueError, "out: expected %zd writable values (as mass), got %zd%s",
                     m, out.shape[0], out.readonly ? " read-only" : "");
        goto done;
    }
    const double *t = tree.buf, *q = mass.buf;
    if (!(t[1] > 0 && t[1] < INFINITY)) {
        PyObject *v = PyFloat_FromDouble(t[1]); /* PyErr_Format has no %g */
        if (v != NULL) {
            PyErr_Format(PyExc_ValueError, "tree: expected a root in (0, inf), got %R", v);
            Py_DECREF(v);
        }
        goto done;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        if (!(q[i] >= 0)) {
            PyObject *v = PyFloat_FromDouble(q[i]);
            if (v != NULL) {
                PyErr_Format(PyExc_ValueError, "mass[%zd]: expected a value >= 0, got %R", i, v);
                Py_DECREF(v);
            }
            goto done;
        }
    }
    cs = PyMem_Malloc((size_t)first * sizeof(double));
    if (cs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* The running sum, in private memory with the GIL held: with its total > 0, every x below
     * is < cs[first - 1], so the search below finds a node in [first, 2 first) whatever the
     * values (or a thread that changes tree or mass meanwhile), and the descent from there
     * ends on a leaf in [n, 2n). NaN or <= 0 (not a sum tree of finite leaves >= 0): no node
     * would be found (leaf n, out of range), so refused. */
    double run = 0.0;
    for (Py_ssize_t j = 0; j < first; j++) {
        run += t[first + j];
        cs[j] = run;
    }
    if (!(run > 0)) {
        PyObject *v = PyFloat_FromDouble(run);
        if (v != NULL) {
            PyErr_Format(PyExc_ValueError, "tree: expected the nodes [%zd, %zd) to sum to a "
                         "value > 0 (the nodes of a sum tree of finite leaves >= 0), got %R",
                         first, 2 * first, v);
            Py_DECREF(v);
        }
        goto done;
    }
    int64_t *o = out.buf;
    Py_BEGIN_ALLOW_THREADS
    double top = nextafter(cs[first - 1], 0.0);
    for (Py_ssize_t i = 0; i < m; i++) {
        double x = q[i] < top ? q[i] : top;
        Py_ssize_t lo = 0, hi = first; /* the first b with cs[b] > x */
        while (lo < hi) {
            Py_ssize_t mid = lo + (hi - lo) / 2;
            if (cs[mid] > x) {
                hi = mid;
            }
            else {
                lo = mid + 1;
            }
        }
        if (lo > 0) {
            x = x - cs[lo - 1];
        }
        Py_ssize_t k = first + lo;
        while (k < n) {
            double left = t[2 * k], right = t[2 * k + 1];
            int go_right = (x >= left && right > 0) || left <= 0;
            if (go_right) {
                x = x - left;
            }
            k = 2 * k + go_right;
        }
        o[i] = (int64_t)(k - n);
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_Free(cs);
    PyBuffer_Release(&out);
done_mass:
    PyBuffer_Release(&mass);
done_tree:
    PyBuffer_Release(&tree);
    return result;
}

static PyMethodDef methods[] = {
    {"prefix_search", prefix_search, METH_VARARGS, prefix_search_doc},
    {"copy_ranges", copy_ranges, METH_VARARGS, copy_ranges_doc},
    {"row_views", row_views, METH_VARARGS, row_views_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_ranges",
    "Byte-range copies and row views for ragged fields (optional; rlbuffers/ranges.py).",
    -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ranges(void)
{
    import_array(); /* numpy's C API (row_views); returns NULL with ImportError if it fails */
    return PyModule_Create(&module);
}
