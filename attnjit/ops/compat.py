"""FlashInfer's wrapper aliases and deprecated entry points, so an engine written against FlashInfer runs unchanged.

    begin_forward(...)        = plan(...)
    run_return_lse(...)       = run(..., return_lse=True)
    forward(...)              = run(...), FlashInfer's deprecated form: it also takes the plan's options (causal,
                                pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta,
                                use_fp16_qk_reduction) as keywords. FlashInfer re-applies them per call; attnjit
                                compiles them into the plan's kernel, so a value that differs from the plan is a
                                ValueError naming it (call plan()/begin_forward() with it), never a silent change.
    forward_return_lse(...)   = forward(..., return_lse=True)
    end_forward()             does nothing (as in FlashInfer)

``plan_settings`` (what plan() fixed) is recorded on the plan by the wrappers (``_Plan.settings``).
"""

from __future__ import annotations

import math
from typing import Any

# FlashInfer's deprecated forward() keywords, each compared with the plan's setting of the same name
FORWARD_SETTINGS = ("causal", "pos_encoding_mode", "use_fp16_qk_reduction", "window_left", "logits_soft_cap",
                    "sm_scale", "rope_scale", "rope_theta")


def plan_settings(*, causal: bool, opts: Any) -> dict[str, Any]:
    """What a plan fixed, by FlashInfer's argument names (``opts``: planner.PlanOptions)."""
    return {"causal": causal, "pos_encoding_mode": opts.pos_encoding_mode, "use_fp16_qk_reduction": False,
            "window_left": -1 if opts.window_left is None else opts.window_left,
            "logits_soft_cap": opts.logits_soft_cap, "sm_scale": opts.sm_scale, "rope_scale": opts.rope_scale,
            "rope_theta": opts.rope_theta}


def _same(name: str, given: Any, planned: Any) -> bool:
    if name == "logits_soft_cap" and given in (None, 0, 0.0):
        return planned is None
    if name in ("sm_scale", "rope_scale", "rope_theta", "logits_soft_cap"):
        if isinstance(given, bool) or not isinstance(given, (int, float)) or planned is None:
            return False
        return math.isclose(float(given), planned, rel_tol=1e-6)
    return given == planned


def check_forward_settings(plan: Any, given: dict[str, Any]) -> None:
    """forward()'s plan options must agree with the plan's (None: as planned)."""
    settings = getattr(plan, "settings", None) or {}
    for name, value in given.items():
        if value is None or name not in settings:
            continue
        if not _same(name, value, settings[name]):
            raise ValueError(f"forward({name}={value!r}) differs from the plan's {name}={settings[name]!r}; attnjit "
                             f"compiles it into the plan's kernel: pass {name} to plan() (or begin_forward())")


class FlashInferAliases:
    """begin_forward / run_return_lse / forward / forward_return_lse / end_forward over a wrapper's plan and run."""

    def begin_forward(self, *args: Any, **kwargs: Any):
        """FlashInfer's older name for plan()."""
        return self.plan(*args, **kwargs)

    def run_return_lse(self, *args: Any, **kwargs: Any):
        """run(..., return_lse=True): (out, lse)."""
        return self.run(*args, return_lse=True, **kwargs)

    def forward(self, *args: Any, **kwargs: Any):
        """FlashInfer's deprecated run(): its plan options must match the plan (see the module docstring)."""
        given = {name: kwargs.pop(name) for name in FORWARD_SETTINGS if name in kwargs}
        if self._plan is None:
            raise RuntimeError(f"{type(self).__name__}.forward() called before plan() (or begin_forward())")
        check_forward_settings(self._plan, given)
        return self.run(*args, **kwargs)

    def forward_return_lse(self, *args: Any, **kwargs: Any):
        return self.forward(*args, return_lse=True, **kwargs)

    def end_forward(self) -> None:
        """Does nothing (FlashInfer: deprecated, no effect)."""
