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
 * The page-table readers (read_paged, read_prefill) and fast_decode are in readers.c; cplan.h is what both share.
 */
#include "cplan.h"

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

Result cplan_plan(int64_t n, const int64_t *q, const int64_t *k, const int64_t *qo_off, const int64_t *kv_base,
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

int cplan_int64_buffer(PyObject *obj, Py_buffer *view, const char *name, Py_ssize_t n) {
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
  if (cplan_int64_buffer(oq, &bq, "qo_lens", -1) < 0) return NULL;
  const Py_ssize_t n = bq.len / 8;
  if (cplan_int64_buffer(ok, &bk, "kv_lens", n) < 0) goto fail_q;
  if (cplan_int64_buffer(ooff, &boff, "qo_offsets", n) < 0) goto fail_k;
  if (cplan_int64_buffer(obase, &bbase, "kv_bases", n) < 0) goto fail_off;
  if (PyObject_GetBuffer(oout, &bout, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) goto fail_base;
  if (bout.itemsize != 4 || bout.len % (4 * FIELDS)) {
    PyErr_SetString(PyExc_TypeError, "_cplan.plan_work: out must be a writable contiguous int32 buffer of rows of 12");
    PyBuffer_Release(&bout);
    goto fail_base;
  }
  Result r;
  Py_BEGIN_ALLOW_THREADS
  r = cplan_plan(n, (const int64_t *)bq.buf, (const int64_t *)bk.buf, (const int64_t *)boff.buf,
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

static PyMethodDef methods[] = {
    {"plan_work", py_plan_work, METH_VARARGS, "The split-KV work list (see attnjit/native/cplan.c)."},
    {"read_paged", cplan_read_paged, METH_VARARGS, "The host page table's checks and lengths (see cplan.c)."},
    {"read_prefill", cplan_read_prefill, METH_VARARGS, "qo_indptr's checks, then read_paged's (see cplan.c)."},
    {"fast_decode", cplan_fast_decode, METH_VARARGS, "Graph mode's decode re-plan into a staging image (see cplan.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "attnjit._cplan", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cplan(void) { return PyModule_Create(&module); }
