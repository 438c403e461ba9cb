"""Pre-training diagnostics of an mHC-wrapped Hugging Face model ([PEFT] App. C.3/C.5, docs/math.md §2.g).

:func:`run_adapter_diagnostics` runs, on one small batch, and restores the model afterwards:

==================  ==========================================================================
check               passes when
==================  ==========================================================================
output_shape        wrapped logits have the backbone's shape ``[b, s, vocab]``
routing             every H_res finite, ≥ 0, square, rows 1 ± 1e-5, columns 1 ± 1e-3;
                    h_pre ∈ (0, 1), h_post ∈ (0, 2), finite
frozen_backbone     backbone parameters have ``requires_grad=False``; adapter ones ``True``
gradient_flow       after one backward: no frozen parameter has a gradient; every read/write
                    tensor (b_pre, b_post, W_pre, W_post) has a non-zero one.  Gates α, the
                    mapping-norm gain, the readout and the residual-mixing tensors are exactly
                    zero at step 0 (W = 0, identical streams) and are rechecked after one AdamW
                    step, except sublayer 0's residual mixing, whose input streams are always
                    identical copies of the embedding (its gradient is zero in exact arithmetic)
logits_identity     max |wrapped − backbone| ≤ 1e-5 (fp32, init noise off), else
                    ≤ 1e-2 · max |logit| (bf16 or init noise on)
sublayer_identity   every wrapped sublayer, at init and on identical streams, is within 1 % of
                    x + F(x) (:func:`xhc.diagnostics.check_sublayer_identity`)
stream_divergence   after a short overfitting run on the batch, max_ij ‖X_i − X_j‖/‖X‖ grew
                    above its initial value and above 1e-6
==================  ==========================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.nn as nn

from models.hf.mhc_adapter import (
    HCDecoderLayer,
    adapter_config,
    adapter_named_parameters,
    hc_disabled,
    hc_layers,
    is_adapter_parameter,
    record_routing,
)
from xhc.diagnostics import check_doubly_stochastic, check_sublayer_identity, stream_divergence

READ_WRITE = ("b_pre", "b_post", "W_pre", "W_post")
RES = ("b_res", "W_res", "alpha_res")
LATE = ("alpha_pre", "alpha_post", "norm_weight")  # zero gradient at step 0 by construction


@dataclass
class CheckResult:
    name: str
    ok: bool
    value: Optional[float]
    detail: str


@dataclass
class AdapterDiagnostics:
    checks: List[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def get(self, name: str) -> CheckResult:
        return next(c for c in self.checks if c.name == name)

    def table(self) -> str:
        w = max(len(c.name) for c in self.checks)
        lines = [f"{'check':<{w}}  status  {'value':>10}  detail"]
        for c in self.checks:
            v = "" if c.value is None else f"{c.value:.3g}"
            lines.append(f"{c.name:<{w}}  {'PASS' if c.ok else 'FAIL':<6}  {v:>10}  {c.detail}")
        return "\n".join(lines)


class AdapterDiagnosticError(AssertionError):
    """At least one adapter diagnostic failed (the message lists the failures)."""


def _logits(model, input_ids, attention_mask):
    return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def _has_grad(p: nn.Parameter) -> bool:
    return p.grad is not None and bool(p.grad.detach().abs().sum() > 0)


def _grad_check(model, input_ids, attention_mask, step: int) -> tuple:
    """(missing adapter grads, unexpected frozen grads) after one backward."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids, use_cache=False)
    out.loss.backward()
    missing = []
    for name, p in adapter_named_parameters(model):
        leaf = name.rsplit(".", 1)[-1]
        sublayer0_res = name.startswith("layers.0.hc_attn.") and leaf in RES
        if step == 0:
            required = leaf in READ_WRITE
        else:
            required = not sublayer0_res
        if required and p.requires_grad and not _has_grad(p):
            missing.append(name)
    unexpected = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    return missing, unexpected


def run_adapter_diagnostics(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    overfit_steps: int = 50,
    overfit_lr: float = 1e-2,
    logits_tol: Optional[float] = None,
    strict: bool = False,
) -> AdapterDiagnostics:
    """Run every check on ``input_ids`` (``[b, s]``) and return the report.

    The model's parameters, gradients and train/eval mode are restored afterwards.  With
    ``strict=True`` a failure raises :class:`AdapterDiagnosticError`.
    """
    cfg = adapter_config(model)
    rep = AdapterDiagnostics()
    was_training = model.training
    snapshot = {id(p): p.detach().clone() for p in model.parameters() if p.requires_grad}
    params = {id(p): p for p in model.parameters() if p.requires_grad}
    try:
        model.eval()
        # ---- 1 + 4: shape and logits equality ----------------------------------------------
        with torch.no_grad():
            with hc_disabled(model):
                ref = _logits(model, input_ids, attention_mask)
            with record_routing(model) as records:
                out = _logits(model, input_ids, attention_mask)
        rep.checks.append(CheckResult(
            "output_shape", out.shape == ref.shape, None, f"{tuple(out.shape)} vs backbone {tuple(ref.shape)}"))
        diff = float((out.float() - ref.float()).abs().max())
        exact = cfg.init_noise == 0 and out.dtype == torch.float32
        scale = float(ref.float().abs().max())
        tol = logits_tol if logits_tol is not None else (1e-5 if exact else 1e-2 * scale)
        rep.checks.append(CheckResult(
            "logits_identity", diff <= tol, diff,
            f"max |wrapped - backbone| (tolerance {tol:.3g}; max |logit| {scale:.3g})"))

        # ---- 2: routing objects -------------------------------------------------------------
        worst_row = worst_col = 0.0
        problems = []
        for r in records:
            if r.H_res is not None:
                s = check_doubly_stochastic(r.H_res, 1e-5, 1e-3, strict=False, name=f"H_res[{r.sublayer}]")
                worst_row, worst_col = max(worst_row, s.max_row_error), max(worst_col, s.max_col_error)
                if not s.ok:
                    problems.append(s.message)
            if r.h_pre is not None and not (torch.isfinite(r.h_pre).all() and (r.h_pre > 0).all()
                                             and (r.h_pre < 1).all()):
                problems.append(f"h_pre[{r.sublayer}] outside (0, 1)")
            if r.h_post is not None and not (torch.isfinite(r.h_post).all() and (r.h_post > 0).all()
                                              and (r.h_post < 2).all()):
                problems.append(f"h_post[{r.sublayer}] outside (0, 2)")
        n_res = sum(r.H_res is not None for r in records)
        rep.checks.append(CheckResult(
            "routing", not problems, max(worst_row, worst_col),
            problems[0] if problems else
            f"{len(records)} sublayers; {n_res} H_res doubly stochastic "
            f"(row err {worst_row:.1e}, col err {worst_col:.1e})"
            + ("" if n_res else " (H_res = I)")))

        # ---- 3: frozen backbone and gradient flow ---------------------------------------------
        bad_frozen = [n for n, p in model.named_parameters()
                      if is_adapter_parameter(n) and not p.requires_grad]
        hc_ids = {id(p) for _, p in adapter_named_parameters(model)}
        peft_names = ("lora_", "vera_", "ia3_", "prompt_")
        bad_backbone = [n for n, p in model.named_parameters()
                        if id(p) not in hc_ids and p.requires_grad and not any(t in n for t in peft_names)]
        rep.checks.append(CheckResult(
            "frozen_backbone", not bad_frozen and not bad_backbone, float(len(bad_frozen) + len(bad_backbone)),
            (f"trainable backbone parameter {bad_backbone[0]}" if bad_backbone else
             f"frozen adapter parameter {bad_frozen[0]}" if bad_frozen else
             "backbone frozen, adapter trainable")))
        model.train()
        missing0, unexpected0 = _grad_check(model, input_ids, attention_mask, step=0)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=overfit_lr, weight_decay=0.0)
        opt.step()
        missing1, unexpected1 = _grad_check(model, input_ids, attention_mask, step=1)
        unexpected = unexpected0 + unexpected1
        ok = not (missing0 or missing1 or unexpected)
        detail = ("gradients reach the adapter only (step 0: reads/writes; step 1: all but sublayer 0's H_res)"
                  if ok else
                  f"frozen parameter with gradient: {unexpected[0]}" if unexpected else
                  f"no gradient at step 0 on {missing0[0]}" if missing0 else f"no gradient at step 1 on {missing1[0]}")
        rep.checks.append(CheckResult("gradient_flow", ok, float(len(missing0) + len(missing1) + len(unexpected)),
                                      detail))
        _restore(params, snapshot)
        model.zero_grad(set_to_none=True)
        model.eval()

        # ---- 4b: sublayer identity ------------------------------------------------------------
        rep.checks.append(_sublayer_identity(model, input_ids, attention_mask))

        # ---- 5: stream divergence after a short overfit -----------------------------------------
        with torch.no_grad(), record_routing(model) as rec0:
            _logits(model, input_ids, attention_mask)
        before = max(stream_divergence(r.X) for r in rec0)
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=overfit_lr, weight_decay=0.0)
        losses = []
        for _ in range(overfit_steps):
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids, use_cache=False).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        model.eval()
        with torch.no_grad(), record_routing(model) as rec1:
            _logits(model, input_ids, attention_mask)
        after = max(stream_divergence(r.X) for r in rec1)
        ok = after > before and after > 1e-6
        rep.checks.append(CheckResult(
            "stream_divergence", ok, after,
            f"{before:.2e} at init -> {after:.2e} after {overfit_steps} steps "
            f"(loss {losses[0]:.4f} -> {losses[-1]:.4f})"
            if losses else f"{before:.2e} (no steps)"))
    finally:
        _restore(params, snapshot)
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    if strict and not rep.ok:
        failed = "; ".join(f"{c.name}: {c.detail}" for c in rep.checks if not c.ok)
        raise AdapterDiagnosticError(f"mHC adapter diagnostics failed: {failed}")
    return rep


def _restore(params: dict, snapshot: dict) -> None:
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(snapshot[k])


def _sublayer_identity(model, input_ids, attention_mask) -> CheckResult:
    """Each wrapped sublayer vs x + F(x) on identical streams, x = that layer's (stream-mean) input."""
    layers = hc_layers(model)
    captured = {}

    def pre_hook(mod, args, kwargs):
        hs = args[0] if args else kwargs["hidden_states"]
        captured[mod.layer_index] = (hs.detach(), {k: v for k, v in kwargs.items() if k != "hidden_states"})

    handles = [l.register_forward_pre_hook(pre_hook, with_kwargs=True) for l in layers]
    try:
        with torch.no_grad():
            _logits(model, input_ids, attention_mask)
    finally:
        for h in handles:
            h.remove()
    worst, where = 0.0, ""
    with torch.no_grad():
        for l in layers:
            hs, kw = captured[l.layer_index]
            x = hs if l.is_first else hs.view(*hs.shape[:-1], l.n, l.hidden_size).mean(-2)
            for hc, branch in ((l.hc_attn, lambda u, kw=kw, l=l: l.attn_branch(u, **kw)), (l.hc_mlp, l.mlp_branch)):
                rel = check_sublayer_identity(hc, branch, x, rel_tol=1e-2, strict=False)
                if rel >= worst:
                    worst, where = rel, f"sublayer {hc.layer_index}"
    return CheckResult("sublayer_identity", worst <= 1e-2, worst,
                       f"max relative deviation from x + F(x) over {2 * len(layers)} sublayers ({where}); tolerance 1%")
