"""Hyper-connection health during training: H_res distance from identity, router load, Amax gain.

:class:`HCHealth` finds the hyper-connection modules of the model chunks
(:class:`models.hc_layer.HyperConnectionTransformerLayer` slots) and wraps, per module instance,
the method that produces the mixing of one sublayer, so that while :meth:`HCHealth.recording`
is active every forward records detached statistics:

==================================  =========================================================
module                              what is recorded (per sublayer, token means)
==================================  =========================================================
HC / mHC family (``read``)          H_res ``[N, N]`` (identity when ablated), ‖H_res − I‖_F
xHC sublayer (``read``)             router load ``[N]``, ‖H_res − I_k‖_F, the N×N effective
                                    mixing Ĥ (identity on inactive streams)
xHC-Flash / Flash-4sub second       the MLP mixing of the window (the only H_res), its router
layer (``mlp_read``)                load and distance; attention sublayers there mix by I
==================================  =========================================================

:meth:`HCHealth.summary` gathers the records of all ranks (a collective: call it on every rank)
and returns, for logging:

- ``h_res_identity_distance`` (mean over sublayers) and ``..._max``;
- ``amax_gain_fwd`` / ``amax_gain_bwd``: the composite Amax gain of the product of the per-layer
  token-mean mixings over depth ([mHC] §4; :func:`xhc.diagnostics.amax_gain`), max absolute row /
  column sum; 1 for doubly stochastic products;
- xHC: ``router_load`` (per stream, averaged over sublayers; fixed streams are 1, the loads sum to
  k) with ``router_load_min`` / ``router_load_max`` over the routed streams.

Nothing is recorded (and the wrappers cost one flag test) outside :meth:`recording`; while
recording, the sums stay on the device (no host sync) until :meth:`HCHealth.summary`.  The
pre-training loop records every ``logging.hc_health_interval`` steps (default: every
``logging.interval`` steps, the console lines).  HC-recompute replays in backward are not recorded.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Sequence

import torch

from xhc.diagnostics import identity_distance_tensor

__all__ = ["HCHealth"]


class _Acc:
    """Running sums for one sublayer, kept on the model's device: recording never syncs with the
    host; :meth:`export` (called by :meth:`HCHealth.summary`) copies them to the CPU once."""

    __slots__ = ("H", "count", "dist", "dist_count", "load", "load_count")

    def __init__(self):
        self.H = None
        self.count = 0
        self.dist = 0.0
        self.dist_count = 0
        self.load = None
        self.load_count = 0

    def add_H(self, H: torch.Tensor) -> None:
        H = H.detach().double().reshape(-1, *H.shape[-2:]).mean(0)
        self.H = H if self.H is None else self.H + H
        self.count += 1

    def add_dist(self, d) -> None:
        self.dist = self.dist + (d.detach().double() if isinstance(d, torch.Tensor) else float(d))
        self.dist_count += 1

    def add_load(self, load: torch.Tensor) -> None:
        load = load.detach().double()
        self.load = load if self.load is None else self.load + load
        self.load_count += 1

    def export(self) -> dict:
        dist = self.dist.item() if isinstance(self.dist, torch.Tensor) else float(self.dist)
        return {"H": None if self.H is None else self.H.cpu().numpy(), "count": self.count, "dist": dist,
                "dist_count": self.dist_count, "load": None if self.load is None else self.load.cpu().numpy(),
                "load_count": self.load_count}


def _identity_distance(H: torch.Tensor) -> torch.Tensor:
    """Token-mean ‖H − I‖_F in fp32 as a 0-d tensor on H's device (no host sync)."""
    return identity_distance_tensor(H.detach().float())


def _recording(health) -> bool:
    """Record now: the health is active and this is not an HC-recompute replay in backward."""
    if not health.active:
        return False
    from models.hc_layer import hc_replaying

    return not hc_replaying()


class HCHealth:
    """Record hyper-connection statistics of ``chunks`` (model chunks of this rank)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], hc_config):
        self.hc = hc_config
        self.n = hc_config.n
        self.active = False
        self.acc: Dict[int, _Acc] = {}
        self.num_wrapped = 0
        if not hc_config.enabled:
            return
        for chunk in chunks:
            for layer in chunk.modules():
                if not hasattr(layer, "self_attention_hyper_connection") or not hasattr(layer, "layer_number"):
                    continue
                i = int(layer.layer_number) - 1  # global 0-based layer index
                for mod, idx in ((layer.self_attention_hyper_connection, 2 * i),
                                 (getattr(layer, "mlp_hyper_connection", None), 2 * i + 1)):
                    if mod is not None:
                        self._wrap(mod, idx, i)

    # ---- wrapping ----------------------------------------------------------------------------
    def _acc(self, idx: int) -> _Acc:
        if idx not in self.acc:
            self.acc[idx] = _Acc()
        return self.acc[idx]

    def _wrap(self, mod: torch.nn.Module, idx: int, layer: int) -> None:
        kind = type(mod).__name__
        health = self
        if kind == "XHCSublayer":
            orig = mod.read

            def read(X, _orig=orig, _mod=mod, _idx=idx):
                out = _orig(X)
                if _recording(health):
                    with torch.no_grad():
                        health._record_xhc(_mod, out[1], _idx)
                return out

            mod.read = read
        elif kind == "HyperConnection":
            orig = mod.read

            def read(X, _orig=orig, _idx=idx):
                out = _orig(X)
                if _recording(health):
                    with torch.no_grad():
                        health._record_mhc(out[1], _idx)
                return out

            mod.read = read
        elif kind in ("XHCFlashLayer", "Flash4SecondLayer"):
            orig = mod.mlp_read
            mlp_idx = 2 * layer + 1  # the window's one H_res sits on this layer's MLP sublayer

            def mlp_read(state, _orig=orig, _mod=mod, _idx=mlp_idx):
                if _recording(health):
                    with torch.no_grad():
                        health._record_flash(_mod, state, _idx)
                return _orig(state)

            mod.mlp_read = mlp_read
        else:
            return  # Flash4FirstLayer: no H_res (its routing is recorded by the second layer)
        self.num_wrapped += 1

    # ---- recording ---------------------------------------------------------------------------
    def _record_mhc(self, ctx, idx: int) -> None:
        acc = self._acc(idx)
        H = getattr(ctx, "H_res", None)
        if H is None:
            acc.add_dist(0.0)
            return  # identity: contributes I to the composite
        acc.add_H(H)
        acc.add_dist(_identity_distance(H))

    def _record_xhc(self, mod, ctx, idx: int) -> None:
        from xhc.router import effective_mixing

        acc = self._acc(idx)
        acc.add_load(_router_load(ctx.I, self.n))
        if ctx.H_res is not None:
            acc.add_dist(_identity_distance(ctx.H_res))
            acc.add_H(effective_mixing(ctx.I, ctx.H_res.float(), self.n))
        else:
            acc.add_dist(0.0)

    def _record_flash(self, mod, state, idx: int) -> None:
        from xhc.router import effective_mixing

        acc = self._acc(idx)
        H = mod.mlp_mixing(state)
        acc.add_load(_router_load(state.I, self.n))
        if H is None:
            acc.add_dist(0.0)
            return
        acc.add_dist(_identity_distance(H))
        acc.add_H(effective_mixing(state.I, H.float(), self.n))

    @contextlib.contextmanager
    def recording(self):
        """Record during the forward passes inside this block (statistics accumulate until :meth:`reset`)."""
        self.active = True
        try:
            yield self
        finally:
            self.active = False

    def reset(self) -> None:
        self.acc = {}

    # ---- summary -----------------------------------------------------------------------------
    def summary(self, group=None) -> Dict[str, object]:
        """Merge all ranks' records (collective over ``group``, default world) and reset.  Empty
        dict when the model has no hyper-connections."""
        import torch.distributed as dist

        if not self.hc.enabled:
            return {}
        local = {idx: a.export() for idx, a in self.acc.items()}
        self.reset()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            gathered: List[Optional[dict]] = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, local, group=group)
        else:
            gathered = [local]
        merged: Dict[int, dict] = {}
        for part in gathered:
            for idx, e in (part or {}).items():
                m = merged.setdefault(idx, {"H": None, "count": 0, "dist": 0.0, "dist_count": 0, "load": None,
                                            "load_count": 0})
                for key in ("H", "load"):
                    if e[key] is not None:
                        v = torch.as_tensor(e[key])
                        m[key] = v if m[key] is None else m[key] + v
                for key in ("count", "dist", "dist_count", "load_count"):
                    m[key] += e[key]
        return summarise(merged, self.hc)


def _router_load(I: torch.Tensor, n: int) -> torch.Tensor:
    from xhc.router import router_load

    return router_load(I, n)


def summarise(merged: Dict[int, dict], hc) -> Dict[str, object]:
    """Logging values from merged per-sublayer sums (see the module docstring)."""
    from xhc.diagnostics import amax_gain

    if not merged:
        return {}
    out: Dict[str, object] = {}
    dists = [m["dist"] / m["dist_count"] for _, m in sorted(merged.items()) if m["dist_count"]]
    if dists:
        out["h_res_identity_distance"] = float(sum(dists) / len(dists))
        out["h_res_identity_distance_max"] = float(max(dists))
    mats = [m["H"] / m["count"] for _, m in sorted(merged.items()) if m["H"] is not None and m["count"]]
    gain = amax_gain(mats)  # identity sublayers contribute I; an empty product gives 1
    out["amax_gain_fwd"] = gain.forward
    out["amax_gain_bwd"] = gain.backward
    loads = [m["load"] / m["load_count"] for _, m in sorted(merged.items()) if m["load"] is not None]
    if loads:
        load = torch.stack(loads).mean(0)
        out["router_load"] = [round(float(x), 5) for x in load]
        routed = load[hc.m:] if hc.m < len(load) else load
        out["router_load_min"] = float(routed.min())
        out["router_load_max"] = float(routed.max())
    out["sublayers"] = len(merged)
    return out
