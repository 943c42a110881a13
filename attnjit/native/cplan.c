/* attnjit._cplan: the split-KV scheduler's work list (attnjit/ops/scheduler.py plan_work), the host page table's
 * checks (attnjit/ops/planner.py read_paged, read_prefill) and graph mode's decode re-plan
 * (attnjit/ops/_upload.py MetadataBuffers.fast_decode) in C.
 *
 * An optional accelerator: setup.py builds it where a C compiler is present, and attnjit/ops/scheduler.py uses it
 * when it imports (ATTNJIT_NATIVE=0 turns it off). The Python scheduler stays the definition: this file computes the
 * same records in the same order (tests/test_native_plan.py holds the two equal on thousands of random plans), and
 * where a plan is refused (too many items, too few partial-state slots) it only says so: the Python path then raises
 * the error with its message.
 *
 *   plan_work(qo_lens, kv_lens, qo_offsets, kv_bases, out, group, cta_q, cta_kv, causal, num_kv_heads, slots,
 *             max_slots, allow_split, fixed_chunk, max_items)
 *     -> (status, count, chunk, num_groups, num_slots, split_requests)
 *
 * qo_lens .. kv_bases: C-contiguous int64 buffers of the batch size; out: a writable C-contiguous int32 buffer of
 * rows of 12 (RECORD_FIELDS); fixed_chunk < 0: none. status 0: out[:count] holds the records; 1: more than
 * max_items items; 2: more than max_slots partial-state slots; 3: out holds fewer than count rows (nothing
 * written); 4: out of memory; 5: a negative length, or one past 2^31 (not from plan()). chunk is -1 where nothing
 * is split.
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
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { FIELDS = 12, MIN_CHUNK = 256, MERGE_ROWS = 512 }; /* scheduler.py's */
#define LIMIT (INT64_C(1) << 31) /* lengths past this are not plan()'s: 5 (plan in Python) */

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; } /* a >= 0, b > 0 */
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Stable sort of idx[0..n) by key[idx[i]], largest first (ties keep their order): insertion sort on short runs,
 * merged bottom-up through tmp. */
static void sort_desc(int64_t *idx, int64_t n, const int64_t *key, int64_t *tmp) {
  enum { RUN = 16 };
  for (int64_t lo = 0; lo < n; lo += RUN) {
    const int64_t hi = min64(lo + RUN, n);
    for (int64_t i = lo + 1; i < hi; ++i) {
      const int64_t v = idx[i], kv = key[v];
      int64_t j = i;
      while (j > lo && key[idx[j - 1]] < kv) {
        idx[j] = idx[j - 1];
        --j;
      }
      idx[j] = v;
    }
  }
  int64_t *src = idx, *dst = tmp;
  for (int64_t width = RUN; width < n; width *= 2) {
    for (int64_t lo = 0; lo < n; lo += 2 * width) {
      const int64_t mid = min64(lo + width, n), hi = min64(lo + 2 * width, n);
      int64_t a = lo, b = mid, o = lo;
      while (a < mid && b < hi) dst[o++] = key[src[b]] > key[src[a]] ? src[b++] : src[a++];
      while (a < mid) dst[o++] = src[a++];
      while (b < hi) dst[o++] = src[b++];
    }
    int64_t *t = src;
    src = dst;
    dst = t;
  }
  if (src != idx) memcpy(idx, src, (size_t)n * sizeof(int64_t));
}

/* choose_chunk: the smallest chunk (a multiple of cta_kv, >= the minimum) whose items fit in slots, or -1. */
static int64_t choose_chunk(int64_t n, const int64_t *tiles, const int64_t *q, const int64_t *k, int64_t cta_kv,
                            int64_t heads, int64_t slots, int64_t max_slots, int64_t group, int64_t cta_q) {
  int64_t total = 0, max_kv = 0;
  const int64_t fit = slots / heads; /* items * heads <= slots  <=>  items <= fit (no product to overflow) */
  for (int64_t i = 0; i < n && total <= fit; ++i) total += tiles[i];
  if (total * heads >= slots || total > fit) return -1;
  for (int64_t i = 0; i < n; ++i)
    if (tiles[i] && k[i] > max_kv) max_kv = k[i];
  const int64_t min_chunk = max64(MIN_CHUNK, 2 * cta_kv);
  if (max_kv <= min_chunk) return -1;
  int64_t lo = cdiv(min_chunk, cta_kv), hi = cdiv(max_kv, cta_kv);
  while (lo < hi) { /* items(c) is non-increasing in c */
    const int64_t mid = (lo + hi) / 2, c = mid * cta_kv;
    int64_t items = 0;
    for (int64_t i = 0; i < n && items <= fit; ++i)
      if (tiles[i] && k[i]) items += tiles[i] * cdiv(k[i], c);
    if (items <= fit)
      hi = mid;
    else
      lo = mid + 1;
  }
  int64_t chunk = lo * cta_kv;
  while (chunk < max_kv) { /* partial states past the workspace, or a split group's merge past MERGE_ROWS: double */
    int64_t partial = 0, merge = 0;
    for (int64_t i = 0; i < n && partial <= max_slots; ++i)
      if (tiles[i] && k[i] > chunk) {
        partial += q[i] * cdiv(k[i], chunk);
        merge = max64(merge, min64(cta_q, q[i] * group) * cdiv(k[i], chunk)); /* q < 2^31, group <= 4096 */
      }
    if (partial <= max_slots && merge <= MERGE_ROWS) break;
    chunk *= 2;
  }
  return chunk < max_kv ? chunk : -1;
}

typedef struct {
  int64_t status, count, chunk, num_groups, num_slots, split_requests;
} Result;

static Result plan(int64_t n, const int64_t *q, const int64_t *k, const int64_t *qo_off, const int64_t *kv_base,
                   int32_t *out, int64_t cap, int64_t group, int64_t cta_q, int64_t cta_kv, int causal, int64_t heads,
                   int64_t slots, int64_t max_slots, int allow_split, int64_t fixed_chunk, int64_t max_items) {
  Result r = {0, 0, -1, 0, 0, 0};
  /* one block: tiles, chunks, slot0, group0, heaviest, the request order, its merge buffer */
  int64_t *mem = (int64_t *)malloc((size_t)(7 * n + 1) * sizeof(int64_t));
  if (!mem) {
    r.status = 4;
    return r;
  }
  int64_t *tiles = mem, *nch = mem + n, *slot0 = mem + 2 * n, *group0 = mem + 3 * n, *heaviest = mem + 4 * n;
  int64_t *order = mem + 5 * n, *tmp = mem + 6 * n;
  for (int64_t i = 0; i < n; ++i) {
    /* plan() passes validated lengths (< 2^31); anything else is left to the Python path. With that bound each
     * term below is < 2^61, and every sum stops once past the bound it is compared with: none overflows */
    if (q[i] < 0 || k[i] < 0 || q[i] > LIMIT || k[i] > LIMIT) {
      r.status = 5;
      free(mem);
      return r;
    }
    tiles[i] = q[i] > 0 ? cdiv(q[i] * group, cta_q) : 0;
  }
  int64_t chunk = -1;
  if (fixed_chunk >= 0)
    chunk = cdiv(fixed_chunk, cta_kv) * cta_kv;
  else if (allow_split)
    chunk = choose_chunk(n, tiles, q, k, cta_kv, heads, slots, max_slots, group, cta_q);
  int64_t count = 0, slots_used = 0, groups = 0, split = 0, max_items_req = 0, active = 0;
  for (int64_t i = 0; i < n && count <= max_items; ++i) {
    nch[i] = chunk >= 0 && k[i] > chunk ? cdiv(k[i], chunk) : 1;
    count += tiles[i] * nch[i];
  }
  if (count > max_items) {
    r.status = 1;
    free(mem);
    return r;
  }
  for (int64_t i = 0; i < n; ++i) {
    slot0[i] = group0[i] = -1;
    if (!tiles[i]) continue;
    if (nch[i] > 1) { /* a split request owns chunks x qo_len slots and one group per q tile */
      if (slots_used > max_slots) continue; /* refused below; the numbering is not needed */
      slot0[i] = slots_used;
      group0[i] = groups;
      slots_used += nch[i] * q[i];
      groups += tiles[i];
      ++split;
    }
    max_items_req = max64(max_items_req, tiles[i] * nch[i]);
    order[active++] = i;
  }
  if (slots_used > max_slots) {
    r.status = 2;
    free(mem);
    return r;
  }
  r.count = count;
  r.num_slots = slots_used;
  r.num_groups = groups;
  r.split_requests = split;
  r.chunk = split ? chunk : -1;
  if (count > cap) {
    r.status = 3;
    free(mem);
    return r;
  }
  if (!count) {
    free(mem);
    return r;
  }
  /* an item's cost (item_costs): packed rows x the KV tokens it visits (at least 1); items of a request in
   * generation order, q tile by q tile, chunk by chunk */
  int64_t *cost = (int64_t *)malloc((size_t)(3 * max_items_req) * sizeof(int64_t));
  if (!cost) {
    r.status = 4;
    free(mem);
    return r;
  }
  int64_t *items = cost + max_items_req, *itmp = cost + 2 * max_items_req;
#define ITEM_COST(i, j, out_cost)                                                                      \
  do {                                                                                                 \
    const int64_t qt_ = (j) / nch[i], c_ = (j) % nch[i];                                              \
    const int64_t begin_ = chunk >= 0 ? c_ * chunk : 0, end_ = chunk >= 0 ? min64(k[i], (c_ + 1) * chunk) : k[i]; \
    const int64_t rows_ = min64(cta_q, q[i] * group - qt_ * cta_q);                                     \
    const int64_t last_ = causal ? k[i] - q[i] + (qt_ * cta_q + rows_ - 1) / group + 1 : k[i];          \
    (out_cost) = rows_ * max64(1, min64(end_, last_) - begin_);                                         \
  } while (0)
  for (int64_t a = 0; a < active; ++a) {
    const int64_t i = order[a], per = tiles[i] * nch[i];
    int64_t best = 0;
    for (int64_t j = 0; j < per; ++j) {
      int64_t c;
      ITEM_COST(i, j, c);
      if (j == 0 || c > best) best = c;
    }
    heaviest[i] = best;
  }
  sort_desc(order, active, heaviest, tmp); /* heaviest request first; ties in request order */
  int32_t *o = out;
  for (int64_t a = 0; a < active; ++a) {
    const int64_t i = order[a], per = tiles[i] * nch[i];
    for (int64_t j = 0; j < per; ++j) {
      ITEM_COST(i, j, cost[j]);
      items[j] = j;
    }
    if (per > 1) sort_desc(items, per, cost, itmp); /* its items longest first; ties in generation order */
    for (int64_t x = 0; x < per; ++x) {
      const int64_t j = items[x], qt = j / nch[i], c = j % nch[i];
      const int is_split = nch[i] > 1;
      o[0] = (int32_t)i;
      o[1] = (int32_t)qt;
      o[2] = (int32_t)(chunk >= 0 ? c * chunk : 0);
      o[3] = (int32_t)(chunk >= 0 ? min64(k[i], (c + 1) * chunk) : k[i]);
      o[4] = (int32_t)(is_split ? slot0[i] : -1);
      o[5] = (int32_t)c;
      o[6] = (int32_t)nch[i];
      o[7] = (int32_t)(is_split ? group0[i] + qt : -1);
      o[8] = (int32_t)qo_off[i];
      o[9] = (int32_t)q[i];
      o[10] = (int32_t)k[i];
      o[11] = (int32_t)kv_base[i];
      o += FIELDS;
    }
  }
#undef ITEM_COST
  free(cost);
  free(mem);
  return r;
}

static int int64_buffer(PyObject *obj, Py_buffer *view, const char *name, Py_ssize_t n) {
  if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
  const char *f = view->format ? view->format : "B";
  if (view->itemsize != 8 || !(f[0] == 'q' || f[0] == 'l' || (f[0] == '<' && (f[1] == 'q' || f[1] == 'l'))) ||
      (n >= 0 && view->len != n * 8)) {
    PyErr_Format(PyExc_TypeError, "_cplan.plan_work: %s must be a contiguous int64 buffer of the batch size", name);
    PyBuffer_Release(view);
    return -1;
  }
  return 0;
}

static PyObject *py_plan_work(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *oq, *ok, *ooff, *obase, *oout;
  long long group, cta_q, cta_kv, heads, slots, max_slots, fixed_chunk, max_items;
  int causal, allow_split;
  if (!PyArg_ParseTuple(args, "OOOOOLLLpLLLpLL", &oq, &ok, &ooff, &obase, &oout, &group, &cta_q, &cta_kv, &causal,
                        &heads, &slots, &max_slots, &allow_split, &fixed_chunk, &max_items))
    return NULL;
  if (group < 1 || group > 4096 || cta_q < 1 || cta_q > 4096 || cta_kv < 1 || cta_kv > 4096 || heads < 1 ||
      heads > (1 << 20) || slots < 0 || max_slots < 0) {
    PyErr_SetString(PyExc_ValueError, "_cplan.plan_work: group, cta_q, cta_kv (1..4096), num_kv_heads (1..2^20) must "
                                      "be positive and slots, max_slots not negative");
    return NULL;
  }
  if (fixed_chunk > LIMIT) fixed_chunk = LIMIT; /* a chunk past every length: nothing splits, as in Python */
  Py_buffer bq, bk, boff, bbase, bout;
  if (int64_buffer(oq, &bq, "qo_lens", -1) < 0) return NULL;
  const Py_ssize_t n = bq.len / 8;
  if (int64_buffer(ok, &bk, "kv_lens", n) < 0) goto fail_q;
  if (int64_buffer(ooff, &boff, "qo_offsets", n) < 0) goto fail_k;
  if (int64_buffer(obase, &bbase, "kv_bases", n) < 0) goto fail_off;
  if (PyObject_GetBuffer(oout, &bout, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) goto fail_base;
  if (bout.itemsize != 4 || bout.len % (4 * FIELDS)) {
    PyErr_SetString(PyExc_TypeError, "_cplan.plan_work: out must be a writable contiguous int32 buffer of rows of 12");
    PyBuffer_Release(&bout);
    goto fail_base;
  }
  Result r;
  Py_BEGIN_ALLOW_THREADS
  r = plan(n, (const int64_t *)bq.buf, (const int64_t *)bk.buf, (const int64_t *)boff.buf,
           (const int64_t *)bbase.buf, (int32_t *)bout.buf, bout.len / (4 * FIELDS), group, cta_q, cta_kv, causal,
           heads, slots, max_slots, allow_split, fixed_chunk, max_items);
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&bout);
  PyBuffer_Release(&bbase);
  PyBuffer_Release(&boff);
  PyBuffer_Release(&bk);
  PyBuffer_Release(&bq);
  return Py_BuildValue("(LLLLLL)", (long long)r.status, (long long)r.count, (long long)r.chunk,
                       (long long)r.num_groups, (long long)r.num_slots, (long long)r.split_requests);
fail_base:
  PyBuffer_Release(&bbase);
fail_off:
  PyBuffer_Release(&boff);
fail_k:
  PyBuffer_Release(&bk);
fail_q:
  PyBuffer_Release(&bq);
  return NULL;
}

static int int32_view(PyObject *obj, Py_buffer *view, const char *name) {
  if (PyObject_GetBuffer(obj, view, PyBUF_STRIDED_RO | PyBUF_FORMAT) < 0) return -1;
  const char *f = view->format ? view->format : "B";
  if (view->ndim != 1 || view->itemsize != 4 || !(f[0] == 'i' || (f[0] == '<' && f[1] == 'i'))) {
    PyErr_Format(PyExc_TypeError, "_cplan.read_paged: %s must be a 1-D int32 buffer", name);
    PyBuffer_Release(view);
    return -1;
  }
  return 0;
}

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

#define AT(view, i) (*(const int32_t *)((const char *)(view).buf + (i) * (view).strides[0]))

/* read_paged's checks and lengths of a page table of b requests (the GIL released by the caller). */
static int64_t read_table(const Py_buffer *ind_, const Py_buffer *last_, const Py_buffer *ids_, Py_ssize_t b,
                          int64_t page_size, int64_t max_kv_len, int64_t *kv, int64_t *base, int64_t *used_out,
                          int64_t *max_page_out) {
  const Py_buffer ind = *ind_, last = *last_, ids = *ids_;
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
    if (used > ids.shape[0]) status = 2;
  }
  if (!status && used > 0) {
    int32_t lo, hi;
    if (ids.strides[0] == 4)
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

static PyObject *py_read_paged(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *oind, *olast, *oids, *olens, *obases;
  long long page_size, max_kv_len;
  if (!PyArg_ParseTuple(args, "OOOLLOO", &oind, &olast, &oids, &page_size, &max_kv_len, &olens, &obases)) return NULL;
  Py_buffer ind, last, ids, lens, bases;
  if (int32_view(oind, &ind, "indptr") < 0) return NULL;
  if (int32_view(olast, &last, "last_page_len") < 0) goto f_ind;
  if (int32_view(oids, &ids, "indices") < 0) goto f_last;
  const Py_ssize_t b = ind.shape[0] - 1;
  if (b < 0 || last.shape[0] != b) {
    PyErr_SetString(PyExc_ValueError, "_cplan.read_paged: indptr must have len(last_page_len) + 1 >= 1 entries");
    goto f_ids;
  }
  if (int64_buffer(olens, &lens, "kv_lens", b) < 0) goto f_ids;
  if (int64_buffer(obases, &bases, "kv_bases", b) < 0) goto f_lens;
  if (lens.readonly || bases.readonly) {
    PyErr_SetString(PyExc_TypeError, "_cplan.read_paged: kv_lens and kv_bases must be writable");
    goto f_bases;
  }
  int64_t status, used, max_page;
  Py_BEGIN_ALLOW_THREADS
  status = read_table(&ind, &last, &ids, b, page_size, max_kv_len, (int64_t *)lens.buf, (int64_t *)bases.buf, &used,
                      &max_page);
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&bases);
  PyBuffer_Release(&lens);
  PyBuffer_Release(&ids);
  PyBuffer_Release(&last);
  PyBuffer_Release(&ind);
  return Py_BuildValue("(LLL)", (long long)status, (long long)used, (long long)max_page);
f_bases:
  PyBuffer_Release(&bases);
f_lens:
  PyBuffer_Release(&lens);
f_ids:
  PyBuffer_Release(&ids);
f_last:
  PyBuffer_Release(&last);
f_ind:
  PyBuffer_Release(&ind);
  return NULL;
}

/* read_prefill: read_paged's table after qo_indptr's checks (see the top of this file). */
static PyObject *py_read_prefill(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *oqo, *oind, *olast, *oids, *oq64, *oqlens, *olens, *obases;
  long long page_size, max_kv_len, max_qo_rows;
  if (!PyArg_ParseTuple(args, "OOOOLLLOOOO", &oqo, &oind, &olast, &oids, &page_size, &max_kv_len, &max_qo_rows,
                        &oq64, &oqlens, &olens, &obases))
    return NULL;
  Py_buffer qo, ind, last, ids, out[4];
  PyObject *outs[4] = {oq64, oqlens, olens, obases};
  static const char *names[4] = {"qo_indptr_out", "qo_lens", "kv_lens", "kv_bases"};
  int got = 0;
  PyObject *ret = NULL;
  if (int32_view(oqo, &qo, "qo_indptr") < 0) return NULL;
  if (int32_view(oind, &ind, "indptr") < 0) goto f_qo;
  if (int32_view(olast, &last, "last_page_len") < 0) goto f_ind;
  if (int32_view(oids, &ids, "indices") < 0) goto f_last;
  const Py_ssize_t b = qo.shape[0] - 1;
  if (b < 0 || ind.shape[0] != b + 1 || last.shape[0] != b) {
    ret = Py_BuildValue("(LLLLL)", 8LL, 0LL, -1LL, 0LL, 0LL); /* lengths disagree: Python's checks say how */
    goto f_ids;
  }
  for (; got < 4; ++got) {
    if (int64_buffer(outs[got], &out[got], names[got], got ? b : b + 1) < 0) goto f_outs;
    if (out[got].readonly) {
      PyErr_SetString(PyExc_TypeError, "_cplan.read_prefill: the output buffers must be writable");
      PyBuffer_Release(&out[got]);
      goto f_outs;
    }
  }
  int64_t status = 0, used = 0, max_page = -1, max_qo = 0, causal_ok = 1;
  Py_BEGIN_ALLOW_THREADS
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
    status = read_table(&ind, &last, &ids, b, page_size, max_kv_len, kv, (int64_t *)out[3].buf, &used, &max_page);
  for (Py_ssize_t i = 0; !status && causal_ok && i < b; ++i) causal_ok = ql[i] <= kv[i];
  Py_END_ALLOW_THREADS
  ret = Py_BuildValue("(LLLLL)", (long long)status, (long long)used, (long long)max_page, (long long)max_qo,
                      (long long)causal_ok);
f_outs:
  while (got-- > 0) PyBuffer_Release(&out[got]);
f_ids:
  PyBuffer_Release(&ids);
f_last:
  PyBuffer_Release(&last);
f_ind:
  PyBuffer_Release(&ind);
f_qo:
  PyBuffer_Release(&qo);
  return ret;
}

/* fast_decode: see the top of this file. The table is read in read_paged's order; every check before a write
 * that a device copy would carry (the caller copies nothing unless the status is 0). */
static PyObject *py_fast_decode(PyObject *self, PyObject *args) {
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
  const int32_t *ind = (const int32_t *)(uintptr_t)a_ind, *last = (const int32_t *)(uintptr_t)a_last;
  const int32_t *ids = (const int32_t *)(uintptr_t)a_ids;
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
  if (ind[0] != 0) status = 1;
  for (int64_t i = 0; !status && i < b; ++i) {
    const int64_t lo = ind[i], pages = (int64_t)ind[i + 1] - lo, l = last[i];
    if (pages < 0) {
      status = 1;
    } else if (pages ? (l < 1 || l > page_size) : l != 0) {
      status = 3;
    } else {
      kv[i] = pages ? page_size * (pages - 1) + l : 0;
      if (kv[i] > max_kv_len) status = 4;
      base[i] = lo;
      q[i] = 1;
      off[i] = i;
    }
  }
  if (!status) {
    used = ind[b];
    if (used > n_ids) status = 2;
    else if (used > ids_cap) status = 7;
  }
  if (!status && used > 0) {
    int32_t lo, hi;
    memcpy(host + ids_at, ids, (size_t)used * 4);
    range32(host + ids_at, used, &lo, &hi);
    if (lo < 0) status = 5;
    else if (num_pages >= 0 && hi >= num_pages) status = 6;
    max_page = hi;
  }
  if (!status) {
    r = plan(b, q, kv, off, base, host + 4, rec_cap, group, cta_q, cta_kv, causal, heads, slots, max_slots,
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

static PyMethodDef methods[] = {
    {"plan_work", py_plan_work, METH_VARARGS, "The split-KV work list (see attnjit/native/cplan.c)."},
    {"read_paged", py_read_paged, METH_VARARGS, "The host page table's checks and lengths (see cplan.c)."},
    {"read_prefill", py_read_prefill, METH_VARARGS, "qo_indptr's checks, then read_paged's (see cplan.c)."},
    {"fast_decode", py_fast_decode, METH_VARARGS, "Graph mode's decode re-plan into a staging image (see cplan.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "attnjit._cplan", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cplan(void) { return PyModule_Create(&module); }
