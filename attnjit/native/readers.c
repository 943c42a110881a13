/* attnjit/native/readers.c: attnjit._cplan's host metadata readers and graph mode's decode re-plan (the module
 * and the scheduler they call are in cplan.c).
 *
 *   read_paged(indptr, last_page_len, indices, page_size, max_kv_len, kv_lens, kv_bases)
 *     -> (status, used, max_page)
 *
 * indptr [B+1], last_page_len [B], indices: int32 buffers (strided views too); kv_lens, kv_bases: writable
 * contiguous int64 [B], filled with each request's KV length and first page-table entry. status 0: valid, used =
 * indptr[B], max_page the largest of indices[:used] (-1 for none); otherwise the first rule broken (1 indptr[0] != 0
 * or decreasing, 2 indptr[B] > len(indices), 3 a last_page_len outside 1..page_size (0 for a request without
 * pages), 4 a KV length above max_kv_len, 5 a negative page id), and read_paged in Python raises its message.
 *
 *   read_prefill(qo_indptr, indptr, last_page_len, indices, page_size, max_kv_len, max_qo_rows, qo_out, qo_lens,
 *                kv_lens, kv_bases) -> (status, used, max_page, max_qo_len, causal_ok)
 *
 * A prefill plan's host metadata in one call: qo_indptr [B+1] (int32, strided views too) checked as
 * planner.read_qo_indptr checks it and written to qo_out (int64 [B+1]) with qo_lens (int64 [B]), then read_paged's
 * table. status 0: as read_paged's, and max_qo_len the longest request's query rows, causal_ok whether every
 * request has qo_len <= kv_len; 1..5 read_paged's; 6 qo_indptr[0] != 0 or decreasing; 7 qo_indptr[B] > max_qo_rows;
 * 8 the three tensors' lengths disagree. On any status but 0 the Python reader runs and raises its error.
 *
 *   fast_decode(indptr, last_page_len, indices, batch, n_indices, page_size, max_kv_len, num_pages, staging,
 *               rec_cap, at_tickets, ticket_cap, ids_at, ids_cap, group, cta_q, cta_kv, causal, num_kv_heads,
 *               slots, max_slots, allow_split, fixed_chunk, max_items)
 *     -> (status, count, chunk, num_groups, num_slots, split_requests, used, max_page, total)
 *
 * Graph mode's decode re-plan (MetadataBuffers.fast_decode) in one call: read_paged's checks of a host page table
 * (one query row per request), the page ids against the cache a replay reads (num_pages; -1: not known yet),
 * plan_work, and the staging buffer written as the fixed device buffer's image: [count, 0, 0, 0], the records
 * (at most rec_cap), the tickets zeroed (at most ticket_cap, from at_tickets), the page ids copied to ids_at (at
 * most ids_cap). indptr, last_page_len, indices: addresses of dense host int32 arrays of batch + 1, batch and
 * n_indices entries (the caller has checked each tensor); staging: a writable int32 buffer of at least
 * ids_at + ids_cap ints. total: the ints of staging the device copy must carry. status 0: all written; otherwise
 * nothing is to be copied and the full Python path plans again and raises its error: 1..5 read_paged's, 6 a page
 * id >= num_pages, 7 more page ids than ids_cap, 8 more tickets than ticket_cap, 10 + plan_work's status.
 */
#include "cplan.h"

/* min and max of v[0..n), n >= 1 (a page table holds ~10^5 ids): a plain reduction the compiler vectorizes; on
 * x86-64 also built for SSE4.1 and AVX2 (packed min/max), the best one picked when the module loads */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "sse4.1", "default")))
#endif
static void range32(const int32_t *v, int64_t n, int32_t *lo_out, int32_t *hi_out) {
  int32_t lo = v[0], hi = v[0];
  for (int64_t j = 1; j < n; ++j) {
    const int32_t x = v[j];
    lo = x < lo ? x : lo;
    hi = x > hi ? x : hi;
  }
  *lo_out = lo;
  *hi_out = hi;
}

/* range32 and a copy of v[0..n) to dst in the same pass (fast_decode: the page ids read once, not twice) */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "sse4.1", "default")))
#endif
static void range_copy32(const int32_t *restrict v, int32_t *restrict dst, int64_t n, int32_t *lo_out,
                         int32_t *hi_out) {
  int32_t lo = v[0], hi = v[0];
  for (int64_t j = 0; j < n; ++j) {
    const int32_t x = v[j];
    dst[j] = x;
    lo = x < lo ? x : lo;
    hi = x > hi ? x : hi;
  }
  *lo_out = lo;
  *hi_out = hi;
}

/* One int32 column of a table: n entries `stride` bytes apart (a strided view, or a dense array) */
typedef struct {
  const char *buf;
  Py_ssize_t n, stride;
} Ints;

#define AT(v, i) (*(const int32_t *)((v).buf + (i) * (v).stride))

static Ints ints(const Py_buffer *view) { return (Ints){(const char *)view->buf, view->shape[0], view->strides[0]}; }

static void release(Py_buffer *views, int n) {
  while (n-- > 0) PyBuffer_Release(&views[n]);
}

/* n 1-D int32 buffers (strided views too), all or none: a TypeError naming the first that is not one */
static int int32_views(PyObject *const *objs, const char *const *names, int n, Py_buffer *views) {
  for (int i = 0; i < n; ++i) {
    if (PyObject_GetBuffer(objs[i], &views[i], PyBUF_STRIDED_RO | PyBUF_FORMAT) < 0) {
      release(views, i);
      return -1;
    }
    const char *f = views[i].format ? views[i].format : "B";
    if (views[i].ndim != 1 || views[i].itemsize != 4 || !(f[0] == 'i' || (f[0] == '<' && f[1] == 'i'))) {
      PyErr_Format(PyExc_TypeError, "_cplan: %s must be a 1-D int32 buffer", names[i]);
      release(views, i + 1);
      return -1;
    }
  }
  return 0;
}

/* n writable contiguous int64 buffers of lens[i] entries, all or none */
static int int64_outputs(PyObject *const *objs, const char *const *names, const Py_ssize_t *lens, int n,
                         Py_buffer *views) {
  for (int i = 0; i < n; ++i) {
    if (cplan_int64_buffer(objs[i], &views[i], names[i], lens[i]) < 0) {
      release(views, i);
      return -1;
    }
    if (views[i].readonly) {
      PyErr_Format(PyExc_TypeError, "_cplan: %s must be writable", names[i]);
      release(views, i + 1);
      return -1;
    }
  }
  return 0;
}

/* read_paged's checks and lengths of a page table of b requests (the GIL released by the caller). copy_to (or
 * NULL): where dense page ids are also copied while they are checked, when they fit in copy_cap; so a table read
 * with status 0 and used <= copy_cap has its ids there */
static int64_t read_table(Ints ind, Ints last, Ints ids, Py_ssize_t b, int64_t page_size, int64_t max_kv_len,
                          int64_t *kv, int64_t *base, int64_t *used_out, int64_t *max_page_out, int32_t *copy_to,
                          int64_t copy_cap) {
  int64_t status = 0, used = 0, max_page = -1;
  if (AT(ind, 0) != 0) status = 1;
  for (Py_ssize_t i = 0; !status && i < b; ++i) {
    const int64_t lo = AT(ind, i), hi = AT(ind, i + 1), l = AT(last, i), pages = hi - lo;
    if (pages < 0) {
      status = 1;
    } else if (pages ? (l < 1 || l > page_size) : l != 0) {
      status = 3;
    } else {
      kv[i] = pages ? page_size * (pages - 1) + l : 0;
      base[i] = lo;
      if (kv[i] > max_kv_len) status = 4;
    }
  }
  /* the Python reader's order: indptr, then the entries it needs, then the lengths, then the page ids */
  if (status != 1) {
    used = AT(ind, b);
    if (used > ids.n) status = 2;
  }
  if (!status && used > 0) {
    int32_t lo, hi;
    if (ids.stride == 4 && copy_to && used <= copy_cap)
      range_copy32((const int32_t *)ids.buf, copy_to, used, &lo, &hi);
    else if (ids.stride == 4)
      range32((const int32_t *)ids.buf, used, &lo, &hi);
    else {
      lo = hi = AT(ids, 0);
      for (int64_t j = 1; j < used; ++j) {
        const int32_t v = AT(ids, j);
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
      }
    }
    if (lo < 0) status = 5;
    max_page = hi;
  }
  *used_out = used;
  *max_page_out = max_page;
  return status;
}

static const char *const TABLE[3] = {"indptr", "last_page_len", "indices"};

PyObject *cplan_read_paged(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *in[3], *outs[2];
  long long page_size, max_kv_len;
  if (!PyArg_ParseTuple(args, "OOOLLOO", &in[0], &in[1], &in[2], &page_size, &max_kv_len, &outs[0], &outs[1]))
    return NULL;
  Py_buffer v[3], out[2];
  if (int32_views(in, TABLE, 3, v) < 0) return NULL;
  const Py_ssize_t b = v[0].shape[0] - 1;
  if (b < 0 || v[1].shape[0] != b) {
    PyErr_SetString(PyExc_ValueError, "_cplan.read_paged: indptr must have len(last_page_len) + 1 >= 1 entries");
    release(v, 3);
    return NULL;
  }
  static const char *const names[2] = {"kv_lens", "kv_bases"};
  const Py_ssize_t lens[2] = {b, b};
  if (int64_outputs(outs, names, lens, 2, out) < 0) {
    release(v, 3);
    return NULL;
  }
  int64_t status, used, max_page;
  Py_BEGIN_ALLOW_THREADS
  status = read_table(ints(&v[0]), ints(&v[1]), ints(&v[2]), b, page_size, max_kv_len, (int64_t *)out[0].buf,
                      (int64_t *)out[1].buf, &used, &max_page, NULL, 0);
  Py_END_ALLOW_THREADS
  release(out, 2);
  release(v, 3);
  return Py_BuildValue("(LLL)", (long long)status, (long long)used, (long long)max_page);
}

/* read_prefill: read_paged's table after qo_indptr's checks (see the top of this file). */
PyObject *cplan_read_prefill(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *in[4], *outs[4];
  long long page_size, max_kv_len, max_qo_rows;
  if (!PyArg_ParseTuple(args, "OOOOLLLOOOO", &in[0], &in[1], &in[2], &in[3], &page_size, &max_kv_len, &max_qo_rows,
                        &outs[0], &outs[1], &outs[2], &outs[3]))
    return NULL;
  static const char *const names[4] = {"qo_indptr", "indptr", "last_page_len", "indices"};
  static const char *const out_names[4] = {"qo_indptr_out", "qo_lens", "kv_lens", "kv_bases"};
  Py_buffer v[4], out[4];
  if (int32_views(in, names, 4, v) < 0) return NULL;
  const Py_ssize_t b = v[0].shape[0] - 1;
  if (b < 0 || v[1].shape[0] != b + 1 || v[2].shape[0] != b) {
    release(v, 4);
    return Py_BuildValue("(LLLLL)", 8LL, 0LL, -1LL, 0LL, 0LL); /* lengths disagree: Python's checks say how */
  }
  const Py_ssize_t lens[4] = {b + 1, b, b, b};
  if (int64_outputs(outs, out_names, lens, 4, out) < 0) {
    release(v, 4);
    return NULL;
  }
  int64_t status = 0, used = 0, max_page = -1, max_qo = 0, causal_ok = 1;
  Py_BEGIN_ALLOW_THREADS
  const Ints qo = ints(&v[0]);
  int64_t *q64 = (int64_t *)out[0].buf, *ql = (int64_t *)out[1].buf, *kv = (int64_t *)out[2].buf;
  q64[0] = AT(qo, 0);
  if (q64[0] != 0) status = 6;
  for (Py_ssize_t i = 0; !status && i < b; ++i) {
    q64[i + 1] = AT(qo, i + 1);
    ql[i] = q64[i + 1] - q64[i];
    if (ql[i] < 0) status = 6;
    else if (ql[i] > max_qo) max_qo = ql[i];
  }
  if (!status && q64[b] > max_qo_rows) status = 7;
  if (!status)
    status = read_table(ints(&v[1]), ints(&v[2]), ints(&v[3]), b, page_size, max_kv_len, kv, (int64_t *)out[3].buf,
                        &used, &max_page, NULL, 0);
  for (Py_ssize_t i = 0; !status && causal_ok && i < b; ++i) causal_ok = ql[i] <= kv[i];
  Py_END_ALLOW_THREADS
  release(out, 4);
  release(v, 4);
  return Py_BuildValue("(LLLLL)", (long long)status, (long long)used, (long long)max_page, (long long)max_qo,
                       (long long)causal_ok);
}

/* fast_decode: see the top of this file. The table is read by read_table, as read_paged reads it; the caller
 * copies nothing unless the status is 0. */
PyObject *cplan_fast_decode(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long a_ind, a_last, a_ids;
  long long b, n_ids, page_size, max_kv_len, num_pages, rec_cap, at_tickets, ticket_cap, ids_at, ids_cap;
  long long group, cta_q, cta_kv, heads, slots, max_slots, fixed_chunk, max_items;
  int causal, allow_split;
  PyObject *ostage;
  if (!PyArg_ParseTuple(args, "KKKLLLLLOLLLLLLLLpLLLpLL", &a_ind, &a_last, &a_ids, &b, &n_ids, &page_size,
                        &max_kv_len, &num_pages, &ostage, &rec_cap, &at_tickets, &ticket_cap, &ids_at, &ids_cap,
                        &group, &cta_q, &cta_kv, &causal, &heads, &slots, &max_slots, &allow_split, &fixed_chunk,
                        &max_items))
    return NULL;
  if (b < 1 || b > LIMIT || n_ids < 0 || page_size < 1 || rec_cap < 0 || ticket_cap < 0 || ids_cap < 0 ||
      at_tickets < 4 + FIELDS * rec_cap || ids_at < at_tickets + ticket_cap || group < 1 || group > 4096 ||
      cta_q < 1 || cta_q > 4096 || cta_kv < 1 || cta_kv > 4096 || heads < 1 || heads > (1 << 20) || slots < 0 ||
      max_slots < 0 || !a_ind || !a_last || (n_ids && !a_ids)) {
    PyErr_SetString(PyExc_ValueError, "_cplan.fast_decode: arguments out of range (see cplan.c)");
    return NULL;
  }
  if (fixed_chunk > LIMIT) fixed_chunk = LIMIT;
  Py_buffer st;
  if (PyObject_GetBuffer(ostage, &st, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) return NULL;
  if (st.itemsize != 4 || st.len / 4 < ids_at + ids_cap) {
    PyErr_SetString(PyExc_TypeError, "_cplan.fast_decode: staging must be a writable int32 buffer of at least "
                                     "ids_at + ids_cap ints");
    PyBuffer_Release(&st);
    return NULL;
  }
  const Ints ind = {(const char *)(uintptr_t)a_ind, b + 1, 4}, last = {(const char *)(uintptr_t)a_last, b, 4};
  const Ints ids = {(const char *)(uintptr_t)a_ids, n_ids, 4};
  int32_t *host = (int32_t *)st.buf;
  int64_t status = 0, used = 0, max_page = -1, total = 0;
  Result r = {0, 0, -1, 0, 0, 0};
  int64_t *mem = (int64_t *)malloc((size_t)(4 * b) * sizeof(int64_t));
  if (!mem) {
    PyBuffer_Release(&st);
    return PyErr_NoMemory();
  }
  Py_BEGIN_ALLOW_THREADS
  int64_t *q = mem, *kv = mem + b, *off = mem + 2 * b, *base = mem + 3 * b;
  /* the ids (dense: ids.stride 4) copied to staging while checked; a refused table's copy is never sent */
  status = read_table(ind, last, ids, b, page_size, max_kv_len, kv, base, &used, &max_page, host + ids_at, ids_cap);
  if (!status && used > ids_cap) status = 7;
  else if (!status && num_pages >= 0 && max_page >= num_pages) status = 6;
  if (!status) {
    for (int64_t i = 0; i < b; ++i) q[i] = 1, off[i] = i; /* decode: one query row per request */
  }
  if (!status) {
    r = cplan_plan(b, q, kv, off, base, host + 4, rec_cap, group, cta_q, cta_kv, causal, heads, slots, max_slots,
                   allow_split, fixed_chunk, max_items);
    if (r.status) status = 10 + r.status;
    else if (r.num_groups * heads > ticket_cap) status = 8;
  }
  if (!status) {
    const int64_t tickets = r.num_groups * heads;
    host[0] = (int32_t)r.count;
    host[1] = host[2] = host[3] = 0;
    if (tickets) memset(host + at_tickets, 0, (size_t)tickets * 4);
    total = used ? ids_at + used : tickets ? at_tickets + tickets : 4 + FIELDS * r.count;
  }
  Py_END_ALLOW_THREADS
  free(mem);
  PyBuffer_Release(&st);
  return Py_BuildValue("(LLLLLLLLL)", (long long)status, (long long)r.count, (long long)r.chunk,
                       (long long)r.num_groups, (long long)r.num_slots, (long long)r.split_requests,
                       (long long)used, (long long)max_page, (long long)total);
}
