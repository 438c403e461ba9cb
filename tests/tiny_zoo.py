"""One shared set of tiny models for the conversion and inspection tests (the ``tiny_zoo`` fixture).

Every tiny variant, its parameters (and MoE expert biases) moved off their initial values by
seeded noise, saved three ways: a run directory as ``training.pretrain`` lays it out
(``config.yaml`` + ``checkpoints/step_00000001``), the fp32 Hugging Face export of that run, and
the Megatron model's logits on :func:`tokens` (``logits.pt``), the reference every parity test
compares with.

Built once per test session, also under pytest-xdist: the first worker to ask builds it under a
file lock in the session's shared temporary folder, the others wait and read it.  Tests only read
it (they write into their own ``tmp_path``).
"""
from __future__ import annotations

import os

import torch

VARIANTS = ["vanilla", "hc", "mhc", "mhc-lite", "kromhc", "identity", "xhc", "xhc-flash", "xhc-flash4"]
VOCAB, SEQ = 256, 48
NOISE = 0.05
_DONE = "zoo-complete"


def tokens(b: int = 2, s: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


def megatron_logits(model, toks: torch.Tensor) -> torch.Tensor:
    model.eval()
    pos = torch.arange(toks.shape[1]).unsqueeze(0).expand_as(toks)
    with torch.no_grad():
        return model(toks, pos, None).float()


def perturb(modules, g: torch.Generator, noise: float = NOISE) -> None:
    """Move every parameter, and every MoE expert bias, off its initial value by seeded noise."""
    with torch.no_grad():
        for module in modules:
            for _, p in sorted(module.named_parameters()):
                p.add_(noise * torch.randn(p.shape, generator=g))
            for name, b in sorted(module.named_buffers()):
                if name.endswith("expert_bias"):
                    b.copy_(noise * torch.randn(b.shape, generator=g))


def write_run(root: str, preset: str, model, step: int = 1, hc: dict = None) -> str:
    """A run directory as training.pretrain lays it out (config.yaml + checkpoints/step_N);
    ``hc``: the run's ``model.hc`` overrides of the preset, if any."""
    import yaml

    from training.checkpoint import Checkpointer, build_state

    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "config.yaml"), "w") as f:
        yaml.safe_dump({"model": {"preset": preset, **({"hc": hc} if hc else {})}, "optimizer": {"name": "adamw"},
                        "batch": {"seq_length": SEQ}}, f)
    state = build_state([model], trainer={"step": step, "consumed_samples": 0, "skipped_steps": 0}, rng=False)
    return Checkpointer(os.path.join(root, "checkpoints"), log=lambda *_: None).save(step, state, {"preset": preset})


def build(root: str) -> None:
    """Write every variant under ``root`` (needs Megatron's parallel state initialised)."""
    from tools.hf import conversion as C
    from models.zoo import build_model, build_transformer_config, load_preset

    toks = tokens()
    for v in VARIANTS:
        preset = load_preset(f"tiny-moe:{v}")
        torch.manual_seed(0)
        model = build_model(preset, build_transformer_config(preset, cpu=True), use_transformer_engine=False,
                            vocab_size=VOCAB, seq_length=SEQ)
        perturb([model], torch.Generator().manual_seed(5))
        run = os.path.join(root, v)
        write_run(run, f"tiny-moe:{v}", model)
        C.to_hf(C.resolve_source(run=run), os.path.join(root, f"{v}-hf"), dtype="fp32", progress=False,
                log=lambda *_: None)
        torch.save(megatron_logits(model, toks), os.path.join(run, "logits.pt"))
    open(os.path.join(root, _DONE), "w").close()


def entries(root: str) -> dict:
    """``{variant: {"run", "checkpoint", "hf", "logits"}}`` of a built zoo."""
    out = {}
    for v in VARIANTS:
        run = os.path.join(root, v)
        out[v] = {"run": run, "checkpoint": os.path.join(run, "checkpoints", "step_00000001"),
                  "hf": os.path.join(root, f"{v}-hf"), "logits": torch.load(os.path.join(run, "logits.pt"))}
    return out


def shared(tmp_path_factory) -> dict:
    """The session's zoo: built by the first (xdist) worker that asks, read by the others."""
    from filelock import FileLock

    from models.parallel import initialize_parallel

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # shared by every worker of this session
    root = os.path.join(str(base), "tiny-zoo")
    torch.set_num_threads(1)
    initialize_parallel()
    with FileLock(root + ".lock"):
        if not os.path.exists(os.path.join(root, _DONE)):
            build(root)
    return entries(root)
