/* attnjit/native/cplan.h: what the two halves of attnjit._cplan share: cplan.c (the split-KV scheduler and the
 * module) and readers.c (the host metadata readers and graph mode's decode re-plan). */
#pragma once
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { FIELDS = 12, MIN_CHUNK = 256, MERGE_ROWS = 512 }; /* scheduler.py's */
#define LIMIT (INT64_C(1) << 31) /* lengths past this are not plan()'s: 5 (plan in Python) */

typedef struct {
  int64_t status, count, chunk, num_groups, num_slots, split_requests;
} Result;

/* plan_work's records into out (cap rows), lengths validated by the caller (cplan.c) */
Result cplan_plan(int64_t n, const int64_t *q, const int64_t *k, const int64_t *qo_off, const int64_t *kv_base,
                  int32_t *out, int64_t cap, int64_t group, int64_t cta_q, int64_t cta_kv, int causal, int64_t heads,
                  int64_t slots, int64_t max_slots, int allow_split, int64_t fixed_chunk, int64_t max_items);
/* a C-contiguous int64 buffer of n entries (n < 0: any), else a TypeError naming it (cplan.c) */
int cplan_int64_buffer(PyObject *obj, Py_buffer *view, const char *name, Py_ssize_t n);
/* the module's functions of readers.c */
PyObject *cplan_read_paged(PyObject *self, PyObject *args);
PyObject *cplan_read_prefill(PyObject *self, PyObject *args);
PyObject *cplan_fast_decode(PyObject *self, PyObject *args);
