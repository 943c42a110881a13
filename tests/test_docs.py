"""The public wrappers document their plan() (issue 12): each docstring names the metadata arguments its signature
takes, the backend rule and the errors, so `help(wrapper.plan)` is enough to call it."""

from __future__ import annotations

import inspect

import pytest

import attnjit

WRAPPERS = {
    "BatchPrefillWithPagedKVCacheWrapper": ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"),
    "BatchPrefillWithRaggedKVCacheWrapper": ("qo_indptr", "kv_indptr"),
    "BatchDecodeWithPagedKVCacheWrapper": ("indptr", "indices", "last_page_len"),
}


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_plan_docstring_names_its_metadata_and_rules(name):
    plan = getattr(attnjit, name).plan
    doc = inspect.getdoc(plan) or ""
    params = inspect.signature(plan).parameters
    for arg in WRAPPERS[name]:
        assert arg in params, f"{name}.plan has no argument {arg}"
        assert f"{arg}:" in doc, f"{name}.plan's docstring does not describe {arg}"
    for rule in ("int32", "ValueError", "backend", "use_cuda_graph"):
        assert rule in doc, f"{name}.plan's docstring says nothing about {rule}"
