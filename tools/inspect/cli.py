"""xhc-inspect: what the residual streams learned, as figures, for a run, a checkpoint or an exported model.

::

    python -m tools.inspect runs/X --output inspect/X                     # newest checkpoint of a run
    python -m tools.inspect runs/X --step 200 --output inspect/X-200      # one kept checkpoint
    python -m tools.inspect runs/X --steps all --output inspect/X-steps   # every kept checkpoint
    python -m tools.inspect runs/X/checkpoints/step_00000300 --output inspect/ckpt
    python -m tools.inspect hf/X --text notes.txt --output inspect/hf      # exported Hugging Face folder
    python -m tools.inspect runs/mhc --compare runs/vanilla runs/xhc --output inspect/sweep
    python -m tools.inspect --estimate moe-18b:xhc                         # memory bound, meta device

SOURCE is a run directory (its newest checkpoint, or ``--step N`` / ``--steps all|N,M``), a checkpoint
directory (``runs/X/checkpoints/step_N``) or a Hugging Face folder written by ``xhc-convert to-hf``.
The output folder gets PNG figures, ``report.md`` (the figures with one-line captions) and
``inspect.json`` (every plotted number).  docs/inspect.md explains how to read each figure.

The model is streamed one decoder layer at a time, the way ``xhc-convert`` reads checkpoints: only
the embedding rows of the sampled tokens and one layer's tensors are held, and the layer runs forward
(``torch.no_grad``, eager hyper-connection kernels) on ``--tokens`` tokens of the run's validation
data (or ``--text FILE``; seeded random ids when neither exists).  Vanilla models have no
hyper-connections: they are reported as such (their training curves are still drawn).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from tools._cli import require, run_main
from tools.inspect.figures import figures_compare, figures_curves, figures_one, figures_steps
from tools.inspect.sources import (InspectError, ModelInfo, Target, _parse_steps, _stream_groups, build_layer,
                                   model_info_checkpoint, model_info_hf, resolve, stream_checkpoint_layers,
                                   stream_hf_layers)  # noqa: F401 (re-exported)
from training.run import cpu_entry_point, set_omp_wait_policy
from xhc.config import FLASH_FAMILY

set_omp_wait_policy()

SCHEMA = 1
DEFAULT_TOKENS = 256
RANDOM_SEED = 0
FLASH = FLASH_FAMILY


# ================================================================================================
# Tokens
# ================================================================================================
def _validation_prefix(target: Target, ck: Optional[str]) -> Optional[Tuple[str, str]]:
    """(prefix, split) of the run's validation documents, from its run record (training.run.run_record:
    checked, one-line error where a recorded file is missing or changed), or for a run made before
    records by the lookup next to the run directory (with a one-line note)."""
    from training.run import RecordError, read_run_record

    try:
        record = read_run_record(ck) if ck else None
        if record is None and target.run_dir:
            record = read_run_record(target.run_dir)
        if record is not None:
            d = record.data
            if d.get("source") == "mock":
                return None
            if d.get("source") == "per_split":
                if not (d.get("per_split") or {}).get("valid"):
                    return None
                return record.prefixes("valid", target.data)[0], "0,1,0"
            return record.prefixes("train", target.data)[0], record.split
    except RecordError as e:
        raise InspectError(str(e)) from None
    if target.data:
        split = (target.run_config.get("data") or {}).get("split") or "969,30,1"
        target.log(f"note: {ck or target.path} has no run record (made before run records): validation data "
                   f"{target.data[0]} from --data")
        return target.data[0], split
    found = _lookup_validation_prefix(target)
    mock = (target.run_config.get("data") or {}).get("mock")
    target.log(f"note: {ck or target.path} has no run record (made before run records): validation data "
               + (f"found by lookup at {found[0]}" if found else "none by its config.yaml (mock data)" if mock
                  else "not found by lookup (pass --data PREFIX)"))
    return found


def _validation_tokens(target: Target, count: int, ck: Optional[str] = None) -> Optional[Tuple[List[int], str]]:
    """The first ``count`` tokens of the run's validation documents (default data or data.prefixes)."""
    got = _validation_prefix(target, ck)
    if got is None:
        return None
    prefix, split = got
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from training.data import split_ranges

    ds = IndexedDataset(prefix, mmap=True)
    n_docs = len(ds.document_indices) - 1
    rng = split_ranges(n_docs, split)[1]
    if rng is None or rng[1] <= rng[0]:
        return None
    out: List[int] = []
    for doc in range(rng[0], rng[1]):
        for s in range(int(ds.document_indices[doc]), int(ds.document_indices[doc + 1])):
            out.extend(int(t) for t in ds[s])
            if len(out) >= count:
                return out[:count], f"validation documents of {prefix} (split {split})"
    return (out, f"validation documents of {prefix} (split {split})") if out else None


def _lookup_validation_prefix(target: Target) -> Optional[Tuple[str, str]]:
    """Runs made before run records: (prefix, split) of the validation documents by lookup."""
    cfg = target.run_config
    d = cfg.get("data") or {}
    if not target.run_dir or d.get("mock") or d.get("per_split") and not (d.get("per_split") or {}).get("valid"):
        return None
    named = True  # the config names its data (else the default corpus, wherever that run built it)
    if d.get("per_split"):
        prefix, split = d["per_split"]["valid"][0], "0,1,0"
    elif d.get("prefixes"):
        prefix, split = d["prefixes"][0], d.get("split") or "969,30,1"
    else:
        from training.data import PREFIX_NAME

        named = bool(d.get("default_dir")) and d.get("default_dir") != "data/default"
        prefix, split = os.path.join(d.get("default_dir") or "data/default", PREFIX_NAME), d.get("split") or "969,30,1"
    # A relative path: next to the run directory (runs/<name> in the checkout that trained it), and the
    # working directory only when the config names the data itself: an unnamed default must not pick up
    # whatever data/default the current directory holds (another run's corpus, other tokens than the
    # same model's checkpoint or export would get).
    run_parent = os.path.dirname(os.path.abspath(target.run_dir))
    candidates = [prefix] if os.path.isabs(prefix) else (
        ([prefix] if named else []) + [os.path.join(run_parent, prefix), os.path.join(os.path.dirname(run_parent), prefix)])
    prefix = next((p for p in candidates if os.path.isfile(p + ".idx") and os.path.isfile(p + ".bin")), None)
    return None if prefix is None else (prefix, split)


def _text_tokens(path: str, info: ModelInfo, count: int) -> Tuple[List[int], str]:
    if not os.path.isfile(path):
        raise InspectError(f"--text {path}: no such file")
    tokenizer = info.tokenizer() if callable(info.tokenizer) else info.tokenizer
    if tokenizer is None:
        raise InspectError(f"--text {path}: the source has no tokenizer to encode it with (mock data or raw ids)")
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if os.path.isdir(tokenizer):  # an exported folder: the tokenizer training used, else tokenizer.json
        spm = os.path.join(tokenizer, "tokenizer.model")
        if os.path.isfile(spm):
            from training.data import Tokenizer

            ids = Tokenizer.from_file(spm).tokenize(text)
        else:
            from tokenizers import Tokenizer as HFTokenizer

            ids = HFTokenizer.from_file(os.path.join(tokenizer, "tokenizer.json")).encode(
                text, add_special_tokens=False).ids
    else:
        from training.data import Tokenizer

        ids = Tokenizer.from_file(tokenizer).tokenize(text)
    if not ids:
        raise InspectError(f"--text {path}: encodes to no tokens")
    return [int(t) for t in ids[:count]], f"--text {path}"


def sample_tokens(target: Target, info: ModelInfo, count: int, text: Optional[str], ck: Optional[str] = None):
    """``[b, s]`` token ids (rows of at most the model's sequence length) and a description."""
    import torch

    if text is not None:
        ids, where = _text_tokens(text, info, count)
    else:
        got = _validation_tokens(target, count, ck) if target.kind != "hf" else None
        if got is None:
            g = torch.Generator().manual_seed(RANDOM_SEED)
            ids = torch.randint(0, info.vocab_size, (count,), generator=g).tolist()
            where = f"random token ids (seed {RANDOM_SEED}; no validation data; pass --text FILE for real text)"
        else:
            ids, where = got
    ids = [min(max(int(t), 0), info.vocab_size - 1) for t in ids]
    s = min(info.seq_length, len(ids))
    b = max(len(ids) // s, 1)
    return torch.tensor(ids[: b * s], dtype=torch.long).view(b, s), where


# ================================================================================================
# Measures (pure functions; known answers in tests/test_inspect.py)
# ================================================================================================
def nearest_permutation(H) -> Tuple[List[int], float]:
    """The permutation matrix P closest to ``H`` in Frobenius norm and ‖H − P‖_F.

    ‖H − P_π‖² = ‖H‖² + n − 2 Σ_i H[i, π(i)], so the nearest P maximises the assignment Σ_i H[i, π(i)]
    (Hungarian algorithm).  Returns (π as a list, π[i] = column of row i's one; distance).
    """
    import numpy as np
    from scipy.optimize import linear_sum_assignment

    H = np.asarray(H, dtype=np.float64)
    rows, cols = linear_sum_assignment(-H)
    P = np.zeros_like(H)
    P[rows, cols] = 1.0
    return [int(c) for c in cols], float(np.sqrt(((H - P) ** 2).sum()))


def mixing_measures(H) -> dict:
    """Distances of one N×N mixing matrix from the identity, the permutations and the doubly
    stochastic set (row / column sums), all in float64."""
    import numpy as np

    H = np.asarray(H, dtype=np.float64)
    n = H.shape[0]
    perm, d_perm = nearest_permutation(H)
    return {
        "dist_identity": float(np.sqrt(((H - np.eye(n)) ** 2).sum())),
        "dist_permutation": d_perm,
        "nearest_permutation": perm,
        "row_sum_error": float(np.abs(H.sum(1) - 1).max()),
        "col_sum_error": float(np.abs(H.sum(0) - 1).max()),
        "min_entry": float(H.min()),
    }


def composite_gains(H_list: Sequence) -> Tuple[List[float], List[float]]:
    """Amax gain over depth ([mHC] §4, Fig. 3): for P_l = H_l ⋯ H_1 (X' = H X, left products, float64),
    forward gain = max absolute row sum of P_l, backward gain = max absolute column sum; one value per l."""
    import numpy as np

    fwd, bwd, P = [], [], None
    for H in H_list:
        H = np.asarray(H, dtype=np.float64)
        P = H if P is None else H @ P
        fwd.append(float(np.abs(P).sum(1).max()))
        bwd.append(float(np.abs(P).sum(0).max()))
    return fwd, bwd


def routing_measures(I, p, n: int, k: int, m: int) -> dict:
    """Router load per stream (fraction of tokens that write it; fixed streams 1, the loads sum to k),
    the share of route weight on fixed vs routed slots, and the entropy of the routed choice."""
    import torch

    from xhc.router import router_load

    I = I.reshape(-1, I.shape[-1])
    p = p.reshape(-1, p.shape[-1]).double()
    load = router_load(I, n).double()
    tot = p.sum(-1).clamp_min(1e-30)
    fixed_share = float((p[:, :m].sum(-1) / tot).mean()) if m else 0.0
    out = {"load": [float(x) for x in load], "fixed_share": fixed_share, "routed_share": 1.0 - fixed_share,
           "route_weight_mean": float(p[:, m:].mean()) if k > m else None, "entropy": None, "entropy_normalised": None}
    if k > m and n - m > 1:
        q = load[m:] / (k - m)
        ent = float(-(q[q > 0] * torch.log(q[q > 0])).sum())
        out["entropy"] = ent
        out["entropy_normalised"] = ent / math.log(n - m)
    return out


def _rms_per_stream(X) -> List[float]:
    """sqrt(mean over tokens and channels of X_i²) for ``X``: ``[..., N, C]``."""
    Xd = X.detach().double().reshape(-1, *X.shape[-2:])
    return [float(v) for v in Xd.pow(2).mean((0, 2)).sqrt()]


def _cosine(X) -> List[List[float]]:
    """Mean over tokens of cos(X_i, X_j): ``[N, N]``."""
    import torch

    Xd = X.detach().double().reshape(-1, *X.shape[-2:])
    Xn = Xd / Xd.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    return torch.einsum("tic,tjc->ij", Xn, Xn).div(Xd.shape[0]).tolist()


# ================================================================================================
# Recording one forward pass
# ================================================================================================
class Recorder:
    """Drives each layer's hyper-connection modules exactly as ``XHCMoeDecoderLayer.forward`` does
    (read, branch, write per sublayer; Flash windows through begin / attn / mlp) and records, per
    sublayer, the per-token coefficients; per layer, the state X.  :meth:`result` turns the records
    into the numbers of ``inspect.json``."""

    def __init__(self, hc):
        self.hc = hc
        self.n = hc.n
        self.subs: List[dict] = []
        self.routing: List[dict] = []
        self.depth_labels: List[str] = []
        self.stream_rms: List[List[float]] = []
        self.cosine: List[List[List[float]]] = []
        self.carry: dict = {}

    # ---- per-token tensors -> records ---------------------------------------------------------
    def _sub(self, index: int, layer: int, kind: str, H_tok, h_pre_tok, h_post_tok, static: dict, **extra) -> None:
        import torch

        n = self.n
        eye = torch.eye(n, dtype=torch.float64)
        if H_tok is None:
            H_mean, H_std, d_tok = eye, torch.zeros(n, n, dtype=torch.float64), 0.0
        else:
            Ht = H_tok.detach().double().cpu().reshape(-1, n, n)
            H_mean, H_std = Ht.mean(0), Ht.std(0, unbiased=False)
            d_tok = float((Ht - eye).pow(2).sum((-1, -2)).sqrt().mean())
        rec = {"index": index, "layer": layer, "kind": kind, "H_mean": H_mean.tolist(), "H_spread": H_std.tolist(),
               "dist_identity_token_mean": d_tok}
        rec.update(mixing_measures(H_mean.numpy()))
        rec["h_pre"] = [float(v) for v in h_pre_tok.detach().double().cpu().reshape(-1, n).mean(0)]
        rec["h_post"] = [float(v) for v in h_post_tok.detach().double().cpu().reshape(-1, n).mean(0)]
        rec.update(static)
        rec.update(extra)
        self.subs.append(rec)

    def _state(self, label: str, X) -> None:
        self.depth_labels.append(label)
        self.stream_rms.append(_rms_per_stream(X))
        self.cosine.append(_cosine(X))

    # ---- static (token-independent) parts --------------------------------------------------------
    def _static_mhc(self, mod) -> dict:
        import torch

        from xhc.norms import fp32

        n, cfg = self.n, self.hc
        if cfg.variant == "hc":
            H = mod.S_res if mod.S_res is not None else torch.eye(n)
            pre = mod.a_pre if mod.a_pre is not None else torch.full((n,), 1.0 / n)
            post = mod.a_post if mod.a_post is not None else torch.ones(n)
        else:
            H = torch.eye(n) if mod.b_res is None else mod.mixing(fp32(mod.b_res))
            pre = torch.full((n,), 1.0 / n) if mod.b_pre is None else torch.sigmoid(fp32(mod.b_pre))
            post = torch.ones(n) if mod.b_post is None else 2 * torch.sigmoid(fp32(mod.b_post))
        return {"H_static": H.double().tolist(), "h_pre_static": [float(v) for v in pre],
                "h_post_static": [float(v) for v in post]}

    def _static_xhc(self, res, pre, post) -> dict:
        import torch

        from xhc.xhc import res_weights_from_logits

        k, cfg = self.hc.k, self.hc
        out = {}
        if res is not None:
            out["H_static"] = res_weights_from_logits(res.bias.float().view(k, k), cfg, "eager").double().tolist()
        else:
            out["H_static"] = torch.eye(k, dtype=torch.float64).tolist()
        out["H_static_note"] = f"active block ({k}×{k}, slots in routing order)"
        if pre is not None:
            out["h_pre_static"] = [float(v) for v in (torch.sigmoid(pre.bias.float()) if pre.bias is not None
                                                      else torch.full((pre.n,), 1.0 / pre.n))]
        if post is not None:
            b = post.bias.float().view(post.k, post.K) if post.bias is not None else torch.zeros(post.k, post.K)
            out["h_post_static"] = [float(v) for v in (2 * torch.sigmoid(b[:, 0]))]
            out["h_post_static_note"] = "per active slot (weight of the branch output y)"
        return out

    # ---- xHC helpers --------------------------------------------------------------------------
    def _write_weights(self, I, p, H_post):
        """Per-stream weight of the branch output y: p_j·H_post[j, 0] at stream I_j, 0 elsewhere. ``[..., N]``."""
        import torch

        w = (p * H_post[..., 0]).double()
        return torch.zeros(*I.shape[:-1], self.n, dtype=torch.float64, device=I.device).scatter(-1, I, w)

    def _components(self, temporal, y, seq) -> dict:
        """RMS of the write-back components before and after Gram–Schmidt (``[K]`` each)."""
        from xhc.gram_schmidt import gram_schmidt

        if temporal is None:
            return {}
        V = temporal(y, seq).double()  # [s, b, K, C]
        after = gram_schmidt(V, self.hc.gs_eps) if self.hc.gram_schmidt else V

        def rms(t):
            return [float(v) for v in t.pow(2).mean((0, 1, 3)).sqrt()]

        kernels = []
        for w in temporal.conv:  # [κ_j, C]: w[i, c] multiplies y[t − i, c]
            wd = w.detach().double()
            kernels.append({"size": int(wd.shape[0]), "mean": [float(v) for v in wd.mean(1)],
                            "rms": [float(v) for v in wd.pow(2).mean(1).sqrt()]})
        return {"gs_rms_before": rms(V), "gs_rms_after": rms(after), "gram_schmidt": bool(self.hc.gram_schmidt),
                "conv_kernels": kernels}

    def _routing(self, index: int, sublayers: List[int], I, p, window: Optional[int] = None) -> None:
        r = routing_measures(I, p, self.n, self.hc.k, self.hc.m)
        r.update({"index": index, "sublayers": sublayers})
        if window is not None:
            r["window"] = window
        self.routing.append(r)

    # ---- one layer ------------------------------------------------------------------------------
    def run_layer(self, i: int, attn_mod, mlp_mod, attn: Callable, mlp: Callable, X, seq=None, last: bool = False):
        """Layer ``i``: ``X`` ``[s, b, N, C]`` -> ``X`` after the layer (before any exit reduction)."""
        import torch

        from xhc.flash import Flash4FirstLayer, Flash4SecondLayer, XHCFlashLayer
        from xhc.hyper_connection import HyperConnection
        from xhc.norms import rms_norm_flat
        from xhc.xhc import XHCSublayer, scatter_active

        if not self.depth_labels:
            self._state("embedding", X)
        n, eps = self.n, self.hc.norm_eps
        if isinstance(attn_mod, HyperConnection):
            for idx, mod, f in ((2 * i, attn_mod, attn), (2 * i + 1, mlp_mod, mlp)):
                u, ctx = mod.read(X)
                y = f(u)
                pre = ctx.h_pre if ctx.h_pre is not None else torch.full(X.shape[:-1], 1.0 / n)
                post = ctx.h_post if ctx.h_post is not None else torch.ones(X.shape[:-1])
                self._sub(idx, i, "attention" if idx % 2 == 0 else "mlp", ctx.H_res, pre, post, self._static_mhc(mod))
                X = mod.write(X, y, ctx, seq)
        elif isinstance(attn_mod, XHCSublayer):
            for idx, mod, f in ((2 * i, attn_mod, attn), (2 * i + 1, mlp_mod, mlp)):
                u, ctx = mod.read(X)
                y = f(u)
                H = mod.effective_mixing(ctx) if ctx.H_res is not None else None
                pre = ctx.h_pre if self.hc.dense_read else torch.zeros(*X.shape[:-2], n, dtype=ctx.h_pre.dtype,
                                                                        device=X.device).scatter(
                    -1, ctx.I, ctx.h_pre)
                self._routing(idx, [idx], ctx.I, ctx.p)
                self._sub(idx, i, "attention" if idx % 2 == 0 else "mlp", H, pre,
                          self._write_weights(ctx.I, ctx.p, ctx.H_post), self._static_xhc(mod.res, mod.pre, mod.post),
                          **self._components(mod.temporal, y, seq))
                X = mod.write(X, y, ctx, seq)
        elif isinstance(attn_mod, XHCFlashLayer):
            mod = attn_mod
            st = mod.begin(X)
            self._routing(2 * i, [2 * i, 2 * i + 1], st.I, st.p, window=i)
            H_post_A = mod.post_A(rms_norm_flat(st.Xa.flatten(-2), eps))
            yA = attn(mod.attn_read(st))
            self._sub(2 * i, i, "attention", None, st.h_pre[..., 0, :], self._write_weights(st.I, st.p, H_post_A),
                      self._static_xhc(None, mod.pre_A, mod.post_A), window=i,
                      **self._components(mod.temporal_A, yA, seq))
            st = mod.attn_write(st, yA, seq)
            H_res = mod.mlp_mixing(st)
            H_post_M = mod.post_M(rms_norm_flat(st.Xa.flatten(-2), eps))
            yM = mlp(mod.mlp_read(st))
            from xhc.router import effective_mixing

            self._sub(2 * i + 1, i, "mlp", None if H_res is None else effective_mixing(st.I, H_res, n),
                      st.h_pre[..., 1, :], self._write_weights(st.I, st.p, H_post_M),
                      self._static_xhc(mod.res_M, mod.pre_M, mod.post_M), window=i,
                      **self._components(mod.temporal_M, yM, seq))
            X = mod.mlp_write(st, yM, seq)
        elif isinstance(attn_mod, (Flash4FirstLayer, Flash4SecondLayer)):
            from xhc.router import effective_mixing

            mod = attn_mod
            first = isinstance(mod, Flash4FirstLayer)
            g = i // 2
            if first:
                st = mod.begin(X)
                self._routing(2 * i, [2 * i, 2 * i + 1, 2 * i + 2, 2 * i + 3], st.I, st.p, window=g)
                self.carry[g] = {"pre": [mod.pre_A1, mod.pre_M1, mod.pre_A2, mod.pre_M2]}
                names = (("A1", mod.post_A1, mod.temporal_A1, None), ("M1", mod.post_M1, mod.temporal_M1, None))
                base_t = 0
            else:
                st = self.carry[g].pop("state")
                names = (("A2", mod.post_A2, mod.temporal_A2, None), ("M2", mod.post_M2, mod.temporal_M2, mod.res_M2))
                base_t = 2
            pres = self.carry[g]["pre"]
            for t_off, (name, post, temporal, res) in enumerate(names):
                t = base_t + t_off
                idx = 2 * i + t_off
                xa_hat = rms_norm_flat(st.Xa.flatten(-2), eps)
                H_post = post(xa_hat)
                H_res = None if res is None else res(xa_hat)
                u = mod.attn_read(st) if t_off == 0 else mod.mlp_read(st)
                y = (attn if t_off == 0 else mlp)(u)
                self._sub(idx, i, "attention" if t_off == 0 else "mlp",
                          None if H_res is None else effective_mixing(st.I, H_res, n), st.h_pre[..., t, :],
                          self._write_weights(st.I, st.p, H_post), self._static_xhc(res, pres[t], post),
                          window=g, window_sublayer=name, **self._components(temporal, y, seq))
                st = mod.attn_write(st, y, seq) if t_off == 0 else mod.mlp_write(st, y, seq)
            if first:
                self.carry[g]["state"] = st
                X = scatter_active(st.X0, st.I, st.Xa)  # the state as it stands (inactive streams unchanged)
                self._state(f"layer {i + 1}", X)
                return st.X0  # the window's entry state travels on; the exit scatter is in layer 2g+1
            X = st
        else:
            raise InspectError(f"layer {i}: unknown hyper-connection module {type(attn_mod).__name__}")
        self._state(f"layer {i + 1}", X)
        return X

    # ---- summary -------------------------------------------------------------------------------
    def result(self) -> dict:
        subs = sorted(self.subs, key=lambda r: r["index"])
        fwd, bwd = composite_gains([r["H_mean"] for r in subs])
        single = [composite_gains([r["H_mean"]]) for r in subs]
        import numpy as np

        P = None
        for r in subs:  # the composite mapping H_ℓ ⋯ H_1 itself (float64), drawn beside the per-sublayer H_res
            H = np.asarray(r["H_mean"], dtype=np.float64)
            P = H if P is None else H @ P
            r["H_composite"] = P.tolist()
        for r, f, b, s in zip(subs, fwd, bwd, single):
            r["gain_fwd"], r["gain_bwd"] = f, b
            r["gain_single_fwd"], r["gain_single_bwd"] = s[0][0], s[1][0]
        n_layers = len(self.depth_labels) - 1
        picks = sorted({0, max(n_layers // 4, 1), max(n_layers // 2, 1), n_layers} & set(range(1, n_layers + 1)))
        return {
            "sublayers": subs,
            "gain": {"forward": fwd, "backward": bwd},
            "routing": sorted(self.routing, key=lambda r: r["index"]),
            "depth": {"labels": self.depth_labels, "stream_rms": self.stream_rms,
                      "cosine": {str(d): self.cosine[d] for d in picks}},
        }


def _rss_mb() -> float:
    """This process's resident memory now, in MB (psutil; 0 when unavailable)."""
    try:
        import psutil

        return psutil.Process().memory_info().rss / 1e6
    except Exception:  # pragma: no cover
        return 0.0


def inspect_stream(groups: Iterator[Tuple[str, Dict]], info: ModelInfo, tokens, log: Callable[[str], None],
                   device: str = "cpu", keep: Optional[dict] = None) -> dict:
    """Run the tokens through the streamed layers, one at a time, on ``device``, and return the measures.
    ``keep``: filled with the final N-stream state ``X`` and the token embeddings ``emb`` (for MTP)."""
    import torch
    from transformers.masking_utils import create_causal_mask
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding

    from xhc.hyper_connection import expand_streams

    cfg = info.hf_config
    cfg._attn_implementation = "eager"
    if hasattr(cfg, "_experts_implementation"):
        cfg._experts_implementation = "eager"
    rec = Recorder(info.hc)
    X = emb = mask = pos_emb = head = None
    b, s = tokens.shape
    position_ids = torch.arange(s, device=device).unsqueeze(0)
    peak_group = 0
    t0 = time.perf_counter()
    with torch.no_grad():
        for g, tensors in groups:
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            peak_group = max(peak_group, nbytes)
            if g == "embedding":
                W = tensors["model.embed_tokens.weight"]
                emb = W[tokens].float().to(device)  # [b, s, C]
                del W, tensors
                mask = create_causal_mask(config=cfg, inputs_embeds=emb, attention_mask=None, cache=None,
                                          position_ids=position_ids)
                pos_emb = Glm4MoeRotaryEmbedding(config=cfg).to(device)(emb, position_ids)
                X = expand_streams(emb.transpose(0, 1), info.hc.n)  # [s, b, N, C]
                continue
            i = int(g.split(".")[1])
            if X is None:
                raise InspectError("the source has no embedding (model.embed_tokens.weight)")
            layer = build_layer(info, i, tensors).to(device)
            del tensors
            kw = dict(attention_mask=mask, position_ids=position_ids, cache=None, use_cache=False,
                      position_embeddings=pos_emb)
            X = rec.run_layer(i, layer.self_attention_hyper_connection, layer.mlp_hyper_connection,
                              lambda u, _l=layer: _l._attn(u, **kw), layer._mlp, X, None, i == info.num_layers - 1)
            if i == info.num_layers - 1 and getattr(layer, "hc_head", None) is not None:
                head = head_measures(layer.hc_head.weights(X))
            del layer
            log(f"layer {i + 1}/{info.num_layers} ({nbytes / 1e6:.1f} MB of tensors) {time.perf_counter() - t0:.1f}s, "
                f"RSS {_rss_mb():.0f} MB")
    if len(rec.depth_labels) != info.num_layers + 1:
        raise InspectError(f"the source holds {len(rec.depth_labels) - 1} of {info.num_layers} layers")
    if keep is not None:
        keep.update(X=X, emb=emb)
    out = rec.result()
    if head is not None:
        out["head"] = head
    out["largest_group_bytes"] = peak_group
    return out


def _mtp_tensors(src, preset, info: ModelInfo, depths: int) -> Dict[str, "object"]:
    """The MTP depths' tensors of a checkpoint (Megatron names ``mtp.layers.<k>.*``), read by
    ``dist_checkpointing`` from a meta-device single-rank model that has the depths."""
    import dataclasses

    from megatron.core import dist_checkpointing

    import tools.hf as C
    from models.zoo import load_preset

    bb = dict(src.backbone_overrides or {})
    with_mtp = load_preset(src.preset_name, backbone_overrides=bb, hc_overrides=src.hc_overrides or None)
    with_mtp = dataclasses.replace(with_mtp, hc=preset.hc)
    with C.single_rank():
        model = C.build_single_rank_model(with_mtp, info.vocab_size, info.seq_length)
        part = {k: C.materialise(v) for k, v in model.sharded_state_dict().items() if k.startswith("mtp.")}
        part = {k: v for k, v in part.items() if v is not None}
        try:
            loaded = dist_checkpointing.load(part, src.checkpoint)
        except Exception as e:
            raise InspectError(f"{src.checkpoint}: cannot read the MTP depths ({type(e).__name__})") from None
    return {k: v for k, v in loaded.items() if hasattr(v, "shape")}


def inspect_mtp(src, preset, info: ModelInfo, keep: dict, depths: int, device: str = "cpu") -> dict:
    """The multi-token prediction depths (models/mtp.py), recorded like the decoder's layers.

    Depth k takes the N streams the previous depth (the decoder for k = 1) left and the embeddings of the
    tokens k ahead: U_i = h_proj(hnorm(X_i)) + e_proj(enorm(E)); its HC layer runs through the same
    remote-code layer as the decoder's.  Positions whose token k ahead lies outside the sample are
    dropped (Megatron pads them with id 0)."""
    import torch
    from transformers.masking_utils import create_causal_mask
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding

    from models.hf.export import mapping as M
    from xhc.norms import rms_norm_flat

    tensors = _mtp_tensors(src, preset, info, depths)
    arch = M.arch_of(preset.backbone)
    eps = float(preset.backbone.get("layernorm_epsilon", 1e-5))
    cfg, L, hc = info.hf_config, info.num_layers, info.hc
    rec = Recorder(hc)
    X, emb = keep["X"], keep["emb"]  # [s, b, N, C], [b, s, C]

    def norm(x, w):
        return rms_norm_flat(x.float(), eps) * w.float()

    with torch.no_grad():
        for k in range(depths):
            p = f"mtp.layers.{k}."
            t = {n[len(p):]: v.to(device) for n, v in tensors.items() if n.startswith(p)}
            s = X.shape[0] - 1
            if s < 1:
                raise InspectError(f"too few tokens for MTP depth {k + 1}")
            E = emb[:, 1:1 + s].transpose(0, 1)  # [s, b, C]: the next token of each of the depth's inputs
            X = X[:s]
            U = norm(X, t["hnorm.weight"]) @ t["h_proj.weight"].float().T \
                + (norm(E, t["enorm.weight"]) @ t["e_proj.weight"].float().T).unsqueeze(2)
            # the depth's layer as a decoder layer: an even index past the decoder's is a stand-alone
            # Flash window for Flash-4sub, as models.mtp builds it
            i = L + k + ((L + k) % 2 if hc.variant == "xhc_flash4" else 0)
            layer_t = {f"decoder.layers.{i}.{n[len('transformer_layer.'):]}": v for n, v in t.items()
                       if n.startswith("transformer_layer.")}
            layer = build_layer(info, i, M.megatron_to_hf(layer_t, arch, fused_experts=True)).to(device)
            position_ids = torch.arange(s, device=device).unsqueeze(0)
            x_emb = U[:, :, 0].transpose(0, 1)
            mask = create_causal_mask(config=cfg, inputs_embeds=x_emb, attention_mask=None, cache=None,
                                      position_ids=position_ids)
            pos_emb = Glm4MoeRotaryEmbedding(config=cfg).to(device)(x_emb, position_ids)
            kw = dict(attention_mask=mask, position_ids=position_ids, cache=None, use_cache=False,
                      position_embeddings=pos_emb)
            X = rec.run_layer(i, layer.self_attention_hyper_connection, layer.mlp_hyper_connection,
                              lambda u, _l=layer: _l._attn(u, **kw), layer._mlp, U.to(X.dtype), None, False)
            emb = emb[:, 1:]
    out = rec.result()
    out["depth"]["labels"] = ["MTP input (depth 1)"] + [f"MTP depth {k + 1}" for k in range(depths)]
    out["depths"] = depths
    return out


def head_measures(w) -> dict:
    """The learned head's per-token stream weights ``w`` ``[s, b, N]`` (``reduction: learned``,
    xhc/head.py): per stream their mean, min and max over the tokens, and the mean of Σ_i w_i."""
    w = w.double().flatten(0, -2)
    return {"weights_mean": w.mean(0).tolist(), "weights_min": w.min(0).values.tolist(),
            "weights_max": w.max(0).values.tolist(), "sum_mean": w.sum(-1).mean().item()}


# ================================================================================================
# metrics.jsonl
# ================================================================================================
HEALTH_KEYS = ("h_res_identity_distance", "h_res_identity_distance_max", "amax_gain_fwd", "amax_gain_bwd",
               "router_load_min", "router_load_max")


def read_curves(run_dir: Optional[str]) -> dict:
    """Loss curves and the logged HC health scalars of ``<run>/metrics.jsonl`` (empty when absent)."""
    if not run_dir or not os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
        return {}
    from training.run import dedupe_resumed, read_jsonl

    recs = dedupe_resumed(read_jsonl(os.path.join(run_dir, "metrics.jsonl")))
    out = {"train": {"step": [], "loss": []}, "eval": {"step": [], "loss": []}, "hc": {}}
    for r in recs:
        kind = r.get("kind")
        if kind in ("train", "eval") and isinstance(r.get("loss"), (int, float)):
            out[kind]["step"].append(int(r["step"]))
            out[kind]["loss"].append(float(r["loss"]))
        if kind == "train" and isinstance(r.get("hc"), dict):
            for k in HEALTH_KEYS:
                v = r["hc"].get(k)
                if isinstance(v, (int, float)):
                    out["hc"].setdefault(k, {"step": [], "value": []})
                    out["hc"][k]["step"].append(int(r["step"]))
                    out["hc"][k]["value"].append(float(v))
    return out


# ================================================================================================
# One SOURCE
# ================================================================================================
def inspect_target(target: Target, tokens_count: int, text: Optional[str], log: Callable[[str], None],
                   progress: bool = True, device: str = "cpu") -> dict:
    """Everything ``inspect.json`` holds for one SOURCE (one entry of ``runs``)."""
    run = {"label": target.label, "source": {"path": target.path, "kind": target.kind}, "inspections": [],
           "curves": read_curves(target.run_dir) if target.kind == "run" else {}}
    snaps = target.checkpoints if target.kind != "hf" else [(None, target.path)]
    for step, where in snaps:
        t0 = time.perf_counter()
        if target.kind == "hf":
            info = model_info_hf(target)
            src = preset = None
        else:
            info, src, preset = model_info_checkpoint(target, where, step)
        hc = info.hc
        run.update({"preset": info.preset, "variant": hc.variant if hc.enabled else "none", "hc": bool(hc.enabled)})
        if hc.enabled:
            run.update({"n": hc.n, "dynamic": bool(hc.dynamic)})
            if hc.is_xhc:
                run.update({"k": hc.k, "m": hc.m})
        if not hc.enabled:
            run["message"] = (f"{target.path}: variant none (vanilla): the model has no hyper-connections, so there is "
                              "no residual mixing, stream or router to inspect")
            log(run["message"])
            break
        tokens, where_tokens = sample_tokens(target, info, tokens_count, text, where if target.kind != "hf" else None)
        log(f"{target.path}{'' if step is None else f' step {step}'}: {info.preset} ({hc.variant}, N={hc.n}), "
            f"{tokens.numel()} tokens from {where_tokens}")
        groups = (stream_hf_layers(target.path, info) if target.kind == "hf"
                  else stream_checkpoint_layers(src, preset, info, progress))
        keep: dict = {}
        m = inspect_stream(groups, info, tokens, log if progress else (lambda _m: None), device, keep)
        depths = int((src.backbone_overrides or {}).get("mtp_num_layers") or 0) if src is not None else 0
        if depths:
            m["mtp"] = inspect_mtp(src, preset, info, keep, depths, device)
            log(f"{depths} multi-token prediction depth(s) inspected")
        m.update({"step": step if step is not None else info.step, "checkpoint": where,
                  "tokens": {"count": int(tokens.numel()), "shape": list(tokens.shape), "from": where_tokens},
                  "seconds": round(time.perf_counter() - t0, 3)})
        run["inspections"].append(m)
    return run


# ================================================================================================
# Report
# ================================================================================================
def _fmt(v) -> str:
    return "n/a" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))


def write_report(result: dict, out_dir: str) -> str:
    lines = ["# xhc-inspect report", ""]
    for r in result["runs"]:
        lines += [f"## {r['label']}", "", f"- source: `{r['source']['path']}` ({r['source']['kind']})",
                  f"- preset: `{r.get('preset')}`, variant `{r.get('variant')}`" +
                  (f", N={r['n']}" if r.get("hc") else "") + (f", k={r['k']}, m={r['m']}" if "k" in r else "")]
        if r.get("message"):
            lines += [f"- {r['message']}"]
        for m in r["inspections"]:
            lines += [f"- step {_fmt(m.get('step'))}: {m['tokens']['count']} tokens from {m['tokens']['from']}; "
                      f"last-sublayer forward / backward gain {_fmt(m['gain']['forward'][-1])} / "
                      f"{_fmt(m['gain']['backward'][-1])}; max ‖H̄ − I‖_F "
                      f"{_fmt(max(s['dist_identity'] for s in m['sublayers']))}"]
            if m.get("head"):
                means = ", ".join(_fmt(v) for v in m["head"]["weights_mean"])
                lines += [f"- learned head: stream weights (token mean) {means}; Σ w {_fmt(m['head']['sum_mean'])}"]
        lines.append("")
        for fgr in r.get("figures", []):
            lines += [f"![{fgr['caption']}]({fgr['file']})", "", f"*{fgr['caption']}*", ""]
    for fgr in result.get("figures", []):
        lines += [f"![{fgr['caption']}]({fgr['file']})", "", f"*{fgr['caption']}*", ""]
    path = os.path.join(out_dir, "report.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    return path


# ================================================================================================
# Estimate (meta device)
# ================================================================================================
def estimate(preset_name: str, tokens: int = DEFAULT_TOKENS) -> dict:
    """What inspecting ``preset_name`` holds at most, from a meta-device model (nothing allocated).

    Tensors: the largest streamed group twice (fp32 as ``dist_checkpointing`` loads it, plus the
    Hugging Face-named copy the layer is built on; the embedding group is held alone, before any
    layer), plus the activations of ``tokens`` tokens: the state X (T·N·C fp32) with up to 8 buffers of
    its size alive inside one sublayer (read, write, the gathered active streams, the K write-back
    components before and after Gram–Schmidt), and one sublayer's per-token mixing matrices in float64
    (T·N·N, with 3 buffers of that size).  The process adds the libraries (about 0.6 GB on CPU).
    """
    import tools.hf as C
    from models.hf.export import mapping as M
    from models.zoo import ZooError, load_preset

    try:
        preset = load_preset(preset_name)
    except ZooError as e:
        raise InspectError(f"--estimate {preset_name}: {e}") from None
    vocab = -(-preset.vocab_size // 128) * 128
    groups: Dict[str, int] = {}
    with C.single_rank():
        model = C.build_single_rank_model(preset, vocab, preset.seq_length)
        for name, entry in model.sharded_state_dict().items():
            data = getattr(entry, "data", None)
            if hasattr(data, "numel"):
                g = M.group_of(name)
                groups[g] = groups.get(g, 0) + data.numel()
    layers = {g: v for g, v in groups.items() if g.startswith("layer.")}
    worst = max(layers, key=layers.get)
    hc, width = preset.hc, int(preset.backbone["hidden_size"])
    n = hc.n if hc.enabled else 1
    act = tokens * n * width * 4 * 8 + tokens * n * n * 8 * 3
    emb = groups.get("embedding", 0) * 4
    peak = max(2 * layers[worst] * 4, emb) + act
    return {"preset": preset_name, "parameters": sum(groups.values()), "groups": len(groups), "largest_layer": worst,
            "largest_layer_fp32_bytes": layers[worst] * 4, "embedding_fp32_bytes": emb, "activation_bytes": act,
            "peak_bytes": peak, "full_model_fp32_bytes": sum(groups.values()) * 4, "tokens": tokens}


# ================================================================================================
# Command line
# ================================================================================================
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="xhc-inspect", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("::")[1])
    p.add_argument("source", nargs="?", help="run directory, checkpoint directory or Hugging Face folder")
    p.add_argument("--compare", nargs="+", default=[], metavar="SOURCE", help="more SOURCEs drawn on the same axes")
    p.add_argument("--output", "-o", help="folder for the figures, report.md and inspect.json")
    p.add_argument("--step", type=int, help="a run's checkpoint at this step (default: the newest)")
    p.add_argument("--steps", help="'all' or a list N,M,...: every named kept checkpoint of a run (small multiples)")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help=f"tokens for the dynamic measures (default {DEFAULT_TOKENS})")
    p.add_argument("--text", help="a text file to take the tokens from (default: the run's validation data)")
    p.add_argument("--tokenizer", metavar="PATH", help="SOURCE's tokenizer (for --text), if not at the path its run "
                   "record names (the same tokenizer: its hash is checked)")
    p.add_argument("--data", nargs="+", metavar="PREFIX", help="SOURCE's validation dataset prefix(es), if not where "
                   "its run record names them (the same data: sizes and hash are checked)")
    p.add_argument("--device", default="cpu", help="where the layers run: cpu (default) or cuda")
    p.add_argument("--no-figures", action="store_true", help="write inspect.json and report.md only")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--estimate", metavar="PRESET", help="print the memory bound for inspecting PRESET (meta device) and exit")
    return p.parse_args(argv)


def run(args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    """Inspect ``args.source`` (+ ``--compare``) and write the output folder; returns inspect.json's content."""
    import torch

    if args.tokens < 1:
        raise InspectError(f"--tokens {args.tokens}: must be at least 1")
    if args.device != "cpu" and not (args.device.startswith("cuda") and torch.cuda.is_available()):
        raise InspectError(f"--device {args.device}: not available here (use cpu{', cuda' if torch.cuda.is_available() else ''})")
    steps = _parse_steps(args.steps)
    if args.step is not None and steps is not None:
        raise InspectError("--step and --steps: give one of them")
    if args.output is None:
        raise InspectError("--output DIR is required")
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise InspectError(f"--output {args.output}: exists and is not a directory")
    targets = [resolve(args.source, args.step, steps)] + [resolve(c) for c in args.compare]
    targets[0].tokenizer, targets[0].data = getattr(args, "tokenizer", None), getattr(args, "data", None)
    for t in targets:
        t.log = log
    labels = [t.label for t in targets]
    for i, t in enumerate(targets):  # unique labels (file name prefixes)
        if labels.count(t.label) > 1:
            t.label = f"{t.label}-{i}"
    os.makedirs(args.output, exist_ok=True)
    t0 = time.perf_counter()
    runs = [inspect_target(t, args.tokens, args.text, log, progress=not args.quiet, device=args.device)
            for t in targets]
    import resource

    result = {"schema": SCHEMA, "tool": "xhc-inspect", "runs": runs, "figures": [],
              "seconds": round(time.perf_counter() - t0, 3),
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "torch_threads": torch.get_num_threads()}
    if not args.no_figures:
        multi = len(runs) > 1
        for r in runs:
            r["figures"] = []
            if not r.get("hc"):
                continue
            if len(r["inspections"]) > 1:
                r["figures"] += figures_steps(r, args.output)
            m = r["inspections"][-1]
            r["figures"] += figures_one(r, m, args.output, prefix=f"{r['label']}_" if multi else "")
            if m.get("mtp"):  # the multi-token prediction depths, drawn as the decoder's layers are
                r["figures"] += figures_one(r, m["mtp"], args.output,
                                            prefix=(f"{r['label']}_" if multi else "") + "mtp_")
        result["figures"] = figures_curves(runs, args.output) + figures_compare(runs, args.output)
    with open(os.path.join(args.output, "inspect.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    write_report(result, args.output)
    return result


def main(argv=None) -> int:
    with cpu_entry_point():
        return _main(argv)


def _main(argv=None) -> int:
    import warnings

    with warnings.catch_warnings():  # library deprecation notices would bury the progress lines
        warnings.filterwarnings("ignore", module=r"megatron(\..*)?$")
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed(\..*)?$")
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"(torch|transformers)(\..*)?$")
        return _run_main(argv)


def _run_main(argv=None) -> int:
    args = parse_args(argv)

    def log(msg: str) -> None:
        if not args.quiet:
            print(f"[xhc-inspect] {msg}", file=sys.stderr, flush=True)

    def body() -> int:
        if args.estimate:
            est = estimate(args.estimate, args.tokens)
            print(f"[xhc-inspect] {est['preset']}: {est['parameters'] / 1e9:.2f}B parameters in {est['groups']} groups; "
                  f"largest layer {est['largest_layer']} = {est['largest_layer_fp32_bytes'] / 1e9:.2f} GB fp32, "
                  f"embedding {est['embedding_fp32_bytes'] / 1e9:.2f} GB; activations for {est['tokens']} tokens "
                  f"{est['activation_bytes'] / 1e6:.1f} MB; inspect peak tensor memory ≈ {est['peak_bytes'] / 1e9:.2f} GB "
                  f"vs {est['full_model_fp32_bytes'] / 1e9:.1f} GB for the whole model")
            return 0
        if not args.source:
            raise InspectError("SOURCE is required (a run directory, a checkpoint directory or a Hugging Face folder)")
        if not args.no_figures:
            require("xhc-inspect (its figures; --no-figures writes inspect.json and report.md only)", "plot",
                    "matplotlib")
        result = run(args, log)
        for r in result["runs"]:
            if r.get("message"):
                print(f"[xhc-inspect] {r['message']}")
        print(f"[xhc-inspect] wrote {args.output}/report.md, inspect.json and "
              f"{sum(len(r.get('figures', [])) for r in result['runs']) + len(result['figures'])} figures in "
              f"{result['seconds']:.1f}s (peak RSS {result['peak_rss_bytes'] / 1e6:.0f} MB)")
        return 0

    return run_main(body, InspectError)


if __name__ == "__main__":
    sys.exit(main())
