"""The GPU training path's mechanisms, reached on CPU (training/optim/core.py, training/optim/megatron.py, training/pretrain.py,
models/hc_layer.py; bench/gpu_check.sh runs the real thing on a GPU, see docs/gpu.md).

- A bf16 model with fp32 HC parameters under Megatron DDP and the Megatron optimiser backend
  (Muon, and AdamW without the distributed optimizer): a ``dist_checkpointing`` round trip of
  model + optimiser resumes bit for bit; the fp32 HC parameters sit in their own ``FP32Optimizer``;
  one global grad norm per step.
- ``checkpoint.load_optimizer=false``: the first step after loading equals a fresh optimiser's
  first step on the loaded weights (the fp32 main copies are refreshed).
- HC parameters keep their fp32 initial values through the ``Float16Module`` wrap.
- Evaluation on the GPU path runs without autograd, so the router's per-expert token counts
  (the next expert-bias update) are untouched by it.
- ``overlap_param_gather``: the forced parameter all-gather happens before the checkpoint state
  is read, and the forward pre-hooks come back afterwards.
- Megatron 0.19's ``packed_seq_params`` reaches an MLP whose ``forward`` takes it.

Megatron's optimiser wrappers allocate CUDA scalars and check ``param.type()`` for
``torch.cuda.*`` names; the fixtures redirect exactly those on CPU (test-only).
"""

from __future__ import annotations

import functools
import types

import pytest
import torch

from models.zoo import build_model, build_transformer_config, load_preset
from tests.test_optim import SEQ, TINY, VOCAB, megatron_scalars_on_cpu, parallel  # noqa: F401 (fixtures)
from training.config import CheckpointConfig
from training.optim import OptimizerConfig, build_optimizer
from training.pretrain import Trainer, float16_module_keep_hc_fp32, params_synced
from training.run import CpuStepRunner, MegatronStepRunner

pytestmark = pytest.mark.megatron  # the Python 3.12 / newest megatron-core CI stage runs these

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU stand-ins for the CUDA-only checks")


@pytest.fixture
def bf16_megatron_on_cpu(monkeypatch, megatron_scalars_on_cpu):  # noqa: F811
    """``Float16OptimizerWithFloat16Params`` sorts params by ``param.type()`` and accepts only
    ``torch.cuda.{Float,BFloat16,Half}Tensor``: report CPU tensors under their CUDA names."""
    original = torch.Tensor.type

    def cuda_type_name(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and not self.is_cuda:
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    monkeypatch.setattr(torch.Tensor, "type", cuda_type_name)


def _seed(seed: int = 0) -> None:
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def fp32_model(name: str = "tiny-moe:xhc"):
    _seed()
    preset = load_preset(name, backbone_overrides=TINY)
    return build_model(preset, build_transformer_config(preset, cpu=True), vocab_size=VOCAB, seq_length=SEQ)


def bf16_ddp_model(name: str = "tiny-moe:xhc", distributed_optimizer: bool = False, parallel=None):
    """What MegatronStepRunner.wrap builds: bf16 backbone, fp32 HC parameters, Megatron DDP (fp32 grads).
    ``parallel``: TransformerConfig parallel sizes (as the initialised parallel state has them)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    _seed()
    preset = load_preset(name, backbone_overrides=TINY)
    config = build_transformer_config(preset, parallel, cpu=True, bf16=True, params_dtype=torch.bfloat16,
                                      pipeline_dtype=torch.bfloat16)
    model = float16_module_keep_hc_fp32(config, build_model(preset, config, vocab_size=VOCAB, seq_length=SEQ))
    return DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer), model)


def batch(step: int):
    g = torch.Generator().manual_seed(90 + step)
    t = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
    return t[:, :-1], t[:, 1:], torch.arange(SEQ).expand(2, SEQ)


def train_step(model, opt, step: int):
    from megatron.core.distributed import finalize_model_grads

    opt.zero_grad()
    tokens, labels, pos = batch(step)
    model(tokens, pos, None, labels=labels).float().mean().backward()
    finalize_model_grads([model])
    result = opt.step()
    assert result.updated
    return result


def gpt(chunk):
    return Trainer._unwrap(chunk)


def hc_names(model):
    return {n for n, p in model.named_parameters() if getattr(p, "is_hyper_connection", False)}


def params(model):
    return {n.removeprefix("module.").removeprefix("module."): p.detach().clone() for n, p in model.named_parameters()}


# ------------------------------------------------------------------------------------------------
# Finding 1: mixed bf16/fp32 params and the optimiser checkpoint
# ------------------------------------------------------------------------------------------------
@cpu_only
@pytest.mark.parametrize("opt_name,sharding", [  # (the GPU default, AdamW + dp_reshardable, stays in the fast
    # tier, so CI's Python 3.12 stage runs it against the newest megatron-core)
    pytest.param("muon", None, marks=pytest.mark.slow), pytest.param("adamw", None, marks=pytest.mark.slow),
    ("adamw", "dp_reshardable"), pytest.param("adamw", "fully_reshardable", marks=pytest.mark.slow),
    ("muon", "layer_wise")])  # Muon's GPU default: its state sharded by training.optim.megatron.ShardedLayerWiseOptimizer
def test_bf16_megatron_optimizer_checkpoint_round_trip(parallel, bf16_megatron_on_cpu, tmp_path,  # noqa: F811
                                                       opt_name, sharding):
    """2 steps, dist_checkpointing save of model + optimiser, fresh model and optimiser, load,
    1 step == 3 uninterrupted steps, bit for bit.  Before the fix the save raised (the bf16
    wrapper numbered its state from its bf16 params only).  With Megatron's distributed optimizer
    (AdamW's default on GPU) the save raised ``ShardedTensor.flattened_range is not supported`` on
    megatron-core 0.16 and 0.19 (its default sharding type is retired; seen on the H200)."""
    from megatron.core import dist_checkpointing
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

    from training.checkpoint import build_state

    dist_opt = sharding is not None and opt_name == "adamw"  # (both checkpoint.optimizer_sharding layouts)
    cfg = OptimizerConfig(name=opt_name, lr=1e-2, clip_grad=0.5, use_distributed_optimizer=sharding is not None)
    model = functools.partial(bf16_ddp_model, distributed_optimizer=dist_opt)

    straight = model()
    hc = hc_names(gpt(straight))
    assert hc and all(p.dtype == torch.float32 for n, p in gpt(straight).named_parameters() if n in hc)
    opt = build_optimizer(straight, cfg, use_megatron=True)
    subs = opt.megatron_optimizer.chained_optimizers
    if not dist_opt:  # (the distributed optimizer keeps fp32 main params for every parameter)
        hc_ids = {id(p) for n, p in gpt(straight).named_parameters() if n in hc}
        for o in subs:  # no bf16 wrapper holds an fp32 param; the HC params are in FP32Optimizers
            if isinstance(o, Float16OptimizerWithFloat16Params):
                assert not any(o.fp32_from_fp32_groups)
        in_fp32 = {id(p) for o in subs if isinstance(o, FP32Optimizer) for p in o.get_parameters()}
        assert hc_ids <= in_fp32
    for o in subs:  # every parameter's optimizer entry is its own shard (Megatron mis-indexed
        # groups that mix fp32 and bf16 parameters; training.optim.megatron._fix_param_group_index_map)
        for model_param, (gi, order) in getattr(o, "model_param_group_index_map", {}).items():
            main = o.optimizer.param_groups[gi]["params"][order]
            ranges = [b["param_map"][model_param]["param"] for maps in o.gbuf_ranges for m in maps.values()
                      for b in m if model_param in b["param_map"]]
            assert len(ranges) == 1 and main.numel() == ranges[0].size
            assert torch.equal(main.detach().float(), model_param.detach().view(-1)[ranges[0].start:ranges[0].end].float())
    for step in range(3):
        train_step(straight, opt, step)

    first = model()
    opt1 = build_optimizer(first, cfg, use_megatron=True)
    for step in range(2):
        train_step(first, opt1, step)
    layout = {"optimizer_sharding": sharding} if dist_opt else {}
    dist_checkpointing.save(build_state([first], opt1, None, None, rng=False, **layout), str(tmp_path))
    del first, opt1

    second = model()
    opt2 = build_optimizer(second, cfg, use_megatron=True)
    loaded = dist_checkpointing.load(build_state([second], opt2, None, None, rng=False, is_loading=True, **layout),
                                     str(tmp_path))
    missing, unexpected = gpt(second).load_state_dict(loaded["model"], strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    if opt_name == "muon":  # one entry per parameter, with the fp32 main copies (training.optim)
        assert opt2.checkpoint_format == "torch-sharded" and "optimizer" not in loaded
        opt2.load_torch_sharded_state_dict(loaded["optimizer_torch"])
    else:
        opt2.load_state_dict(loaded["optimizer"])
    train_step(second, opt2, 2)

    want, got = params(straight), params(second)
    assert want.keys() == got.keys()
    for n in want:
        assert got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]), f"{n} differs after resume"


@cpu_only
def test_stop_flags_ride_on_the_step_all_reduce():
    """Finding 6 (host syncs): the stop check before a step reuses the flags agreed in the previous
    step's loss all-reduce; only after a save / evaluation (flags cleared) does it all-reduce."""
    from training.run import Lifecycle

    calls = []
    life = Lifecycle(types.SimpleNamespace(run=types.SimpleNamespace(exit_at_step=None, train_steps=10,
                                                                     exit_after_minutes=5)),
                     all_reduce=lambda v: calls.append(list(v)) or [1.0, 0.0])
    life.agreed_flags = [0.0, 0.0]
    life.local_stop_flags = lambda: [0.0, 0.0]
    assert life.should_stop(1) is None and calls == []  # agreed in the step: no collective
    assert life.agreed_flags is None  # consumed
    assert life.should_stop(1) == "signal on another rank" and calls == [[0.0, 0.0]]
    life.agreed_flags = [0.0, 1.0]
    assert life.should_stop(1) == "run.exit_after_minutes=5" and len(calls) == 1


def test_megatron_step_computes_the_grad_norm_once(parallel, bf16_megatron_on_cpu):  # noqa: F811
    """The skip check and the clip share one global grad norm (one all-reduce, one host sync)."""
    model = bf16_ddp_model()
    opt = build_optimizer(model, OptimizerConfig(name="muon", lr=1e-2, clip_grad=1e-3), use_megatron=True)
    chained = opt.megatron_optimizer
    calls = []
    inner = chained.get_grad_norm
    chained.get_grad_norm = lambda: calls.append(1) or inner()
    norm = train_step(model, opt, 0).grad_norm
    assert len(calls) == 1
    assert norm > 1e-3  # clipping was active (the norm is the pre-clip norm)


# ------------------------------------------------------------------------------------------------
# Finding 3: checkpoint.load_optimizer=false
# ------------------------------------------------------------------------------------------------
@cpu_only
def _marks_only():
    """The Trainer's watchdog before setup() starts it: section marks, no thread."""
    from training.run import Watchdog, WatchdogSettings

    return Watchdog("", 0, 1, WatchdogSettings(enabled=False))


def test_load_optimizer_false_refreshes_the_main_params(parallel, bf16_megatron_on_cpu, tmp_path,  # noqa: F811
                                                        monkeypatch):
    """Trainer.load_checkpoint with load_optimizer=false, then one step == a fresh optimiser built
    on the loaded weights taking that step.  Loading the weights without the refresh does not."""
    from training.checkpoint import Checkpointer, build_state

    cfg = OptimizerConfig(name="adamw", lr=1e-2, use_distributed_optimizer=False)
    trained = bf16_ddp_model()
    opt = build_optimizer(trained, cfg, use_megatron=True)
    train_step(trained, opt, 0)
    ckpt = Checkpointer(str(tmp_path), keep_last=1, checksum="none", log=lambda *_: None)
    path = ckpt.save(1, build_state([trained], None, None, {"step": 1, "consumed_samples": 2, "skipped_steps": 0},
                                    rng=False))
    weights = gpt(trained).state_dict()

    reference = bf16_ddp_model()  # fresh optimiser on the loaded weights
    gpt(reference).load_state_dict(weights, strict=False)
    train_step(reference, build_optimizer(reference, cfg, use_megatron=True), 1)

    resumed = bf16_ddp_model()
    opt_r = build_optimizer(resumed, cfg, use_megatron=True)
    import training.checkpoint.run as rc

    monkeypatch.setattr(rc, "trainer_state", lambda run: {"step": 0, "consumed_samples": 0, "skipped_steps": 0})
    monkeypatch.setattr(rc, "compat_info", lambda run: {})  # nothing to compare: tested in test_reliability
    fake = types.SimpleNamespace(
        cfg=types.SimpleNamespace(checkpoint=CheckpointConfig(load_optimizer=False, load_rng=False)),
        chunks=[resumed], optimizer=opt_r, scheduler=None, ckpt=ckpt, _unwrap=Trainer._unwrap, log=lambda *_: None,
        watchdog=_marks_only())
    Trainer.load_checkpoint(fake, path)
    assert fake.step == 1
    train_step(resumed, opt_r, 1)

    stale = bf16_ddp_model()  # the bug: weights loaded, main copies left at their initial values
    opt_s = build_optimizer(stale, cfg, use_megatron=True)
    gpt(stale).load_state_dict(weights, strict=False)
    train_step(stale, opt_s, 1)

    want, got, bad = params(reference), params(resumed), params(stale)
    for n in want:
        assert torch.equal(got[n], want[n]), f"{n}: the resumed step differs from a fresh optimiser's"
    assert any(not torch.equal(bad[n], want[n]) for n in want)


# ------------------------------------------------------------------------------------------------
# Finding 5: fp32 HC initial values through Float16Module
# ------------------------------------------------------------------------------------------------
@cpu_only
def test_hc_parameters_keep_their_fp32_values_through_the_bf16_wrap(parallel):  # noqa: F811
    from megatron.core.transformer.module import Float16Module

    for name in ("tiny-moe:xhc", "tiny-moe:mhc"):
        model = fp32_model(name)
        hc = hc_names(model)
        init = {n: p.detach().double().clone() for n, p in model.named_parameters() if n in hc}
        # the check can fail: some HC initial value is not a bf16 number
        assert any(not torch.equal(v.bfloat16().double(), v) for v in init.values()), name
        config = model.config
        config.bf16, config.params_dtype = True, torch.bfloat16
        wrapped = float16_module_keep_hc_fp32(config, model)
        for n, p in wrapped.module.named_parameters():
            if n in hc:
                assert p.dtype == torch.float32 and torch.equal(p.double(), init[n]), f"{name}: {n}"
            else:
                assert p.dtype == torch.bfloat16, f"{name}: {n}"
        tokens, labels, pos = batch(0)
        loss = wrapped(tokens, pos, None, labels=labels)
        assert torch.isfinite(loss).all()
    # the naive order (wrap, then cast back) loses the fp32 values
    model = fp32_model("tiny-moe:xhc")
    init = {n: p.detach().clone() for n, p in model.named_parameters() if n in hc_names(model)}
    model.config.bf16, model.config.params_dtype = True, torch.bfloat16
    naive = Float16Module(model.config, model)
    assert any(not torch.equal(p.float(), init[n]) for n, p in naive.module.named_parameters() if n in init)


# ------------------------------------------------------------------------------------------------
# Finding 4: evaluation and the router's token counts
# ------------------------------------------------------------------------------------------------
def _step_runner(cls, model, preset):
    """A step runner (the real one) on ``model``: 3 micro-batches of 2, no CP slice, no document layout."""
    import contextlib

    cfg = types.SimpleNamespace(batch=types.SimpleNamespace(micro_batch_size=2),
                                parallel=types.SimpleNamespace(cp=1, pp=1),
                                run=types.SimpleNamespace(precision="fp32"))
    runner = cls(cfg, seq=SEQ, last_stage=True, num_micro=3)
    runner.chunks, runner.tf_config, runner.hc = [model], model.config, preset.hc
    runner._cp_slice = runner.to_device = lambda b: b
    runner._sequence_context = lambda b: contextlib.nullcontext()
    return runner


def _megatron_step_runner(model, preset, monkeypatch):
    """The GPU step runner driving Megatron's own (no-pipelining) schedule on CPU: the schedule's
    few ``device='cuda'`` scalars are redirected."""
    import megatron.core.pipeline_parallel.schedules as schedules

    from tests.test_optim import torch_with_cuda_factories_on_cpu

    monkeypatch.setattr(schedules, "torch", torch_with_cuda_factories_on_cpu())
    return _step_runner(MegatronStepRunner, model, preset)


def micro_batches():
    for i in range(1000):
        tokens, labels, pos = batch(i)
        mask = torch.ones(2, SEQ)
        mask[i % 2, : i % 5] = 0  # uneven token counts per micro-batch
        yield {"tokens": tokens, "labels": labels, "loss_mask": mask, "position_ids": pos}


@cpu_only
def test_gpu_evaluation_leaves_the_expert_token_counts_alone(parallel, monkeypatch):  # noqa: F811
    """MegatronStepRunner.forward_backward (the GPU path), through Megatron's schedule: forward_only leaves
    every router's ``local_tokens_per_expert`` unchanged (Megatron counts whenever gradients are
    on); a training pass adds exactly tokens x top-k per micro-batch to each.  The (Σ loss·mask,
    Σ mask) it returns equals the CPU path's over the same micro-batches."""
    model = fp32_model("tiny-moe:xhc")
    preset = load_preset("tiny-moe:xhc", backbone_overrides=TINY)
    runner = _megatron_step_runner(model, preset, monkeypatch)
    routers = [m for m in model.modules() if getattr(m, "local_tokens_per_expert", None) is not None]
    assert routers and all(r.enable_expert_bias for r in routers)
    topk = model.config.moe_router_topk

    before = [r.local_tokens_per_expert.clone() for r in routers]
    total, count = runner.forward_backward([micro_batches()], forward_only=True)
    for r, b in zip(routers, before):
        assert torch.equal(r.local_tokens_per_expert, b)
    want_total, want_count = _step_runner(CpuStepRunner, model, preset).forward_backward([micro_batches()], True, 3)
    assert count == want_count == 3 * 2 * SEQ - (0 + 1 + 2)
    assert total == pytest.approx(want_total, rel=1e-12)

    runner.forward_backward([micro_batches()], forward_only=False)
    for r, b in zip(routers, before):
        assert float((r.local_tokens_per_expert - b).sum()) == 3 * 2 * SEQ * topk
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


# ------------------------------------------------------------------------------------------------
# Finding 2: parameter sync before a checkpoint (overlap_param_gather)
# ------------------------------------------------------------------------------------------------
@cpu_only
def test_params_synced_forces_the_all_gather_and_restores_the_hooks(parallel):  # noqa: F811
    """Real Megatron DDP with the distributed optimizer's overlapped param gather: inside the
    block the pre-hooks are gone and a synchronous (forced) all-gather has run; after it the
    hooks are back, also when the block raises."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    model = fp32_model("tiny-moe:xhc")
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_param_gather=True, overlap_grad_reduce=True), model)
    assert ddp.use_forward_hook and ddp.remove_forward_pre_hook_handles
    syncs = []
    inner = ddp.start_param_sync
    ddp.start_param_sync = lambda *a, **k: syncs.append(k.get("force_sync")) or inner(*a, **k)
    with pytest.raises(RuntimeError, match="inside"):
        with params_synced([ddp]):
            assert syncs == [True] and not ddp.remove_forward_pre_hook_handles
            raise RuntimeError("inside")
    assert len(ddp.remove_forward_pre_hook_handles) == len(list(ddp.module.modules()))
    plain = DistributedDataParallel(model.config, DistributedDataParallelConfig(), fp32_model("tiny-moe:vanilla"))
    with params_synced([plain]):  # no overlapped gather: nothing to do
        pass


def test_save_checkpoint_syncs_params_before_reading_them(monkeypatch):
    """Trainer.save_checkpoint: the forced sync precedes building and writing the state."""
    import training.checkpoint.checkpointer as tc
    from training.config import ParallelConfig

    events = []

    class Chunk:
        use_forward_hook = True

        def disable_forward_pre_hook(self, param_sync=True):
            events.append(("sync", param_sync))

        def enable_forward_pre_hook(self):
            events.append("hooks back")

    import training.checkpoint.run as rc

    monkeypatch.setattr(tc, "build_state", lambda *a, **k: events.append("build_state") or {})
    monkeypatch.setattr(rc, "trainer_state", lambda run: {})
    monkeypatch.setattr(rc, "compat_info", lambda run: {})

    class Ckpt:
        def save(self, step, state, info):
            events.append("save")
            return "/nowhere"

    runner = MegatronStepRunner(types.SimpleNamespace(run=types.SimpleNamespace(precision="auto")))
    runner.chunks = [Chunk()]
    fake = types.SimpleNamespace(
        chunks=runner.chunks, runner=runner, optimizer=None, scheduler=None, step=3, world=1, consumed_samples=6,
        ckpt=Ckpt(), watchdog=_marks_only(),
        cfg=types.SimpleNamespace(model=types.SimpleNamespace(preset="tiny-moe:xhc"), parallel=ParallelConfig(),
                                  checkpoint=CheckpointConfig()),
        metrics=types.SimpleNamespace(event=lambda *a, **k: None),
        check_parameters=lambda why: events.append("finite check"),
        async_save=False, wait_for_checkpoint=lambda: events.append("wait for the save in flight"))
    Trainer.save_checkpoint(fake, "interval")
    # the finite-parameter check reads the synced parameters too, so it runs inside the sync; a save
    # still in flight is finished before the next state is built
    assert events == [("sync", True), "finite check", "wait for the save in flight", "build_state", "save",
                      "hooks back"]


# ------------------------------------------------------------------------------------------------
# Finding 7: Megatron 0.19 passes packed_seq_params to the MLP
# ------------------------------------------------------------------------------------------------
def test_mlp_gets_packed_seq_params_when_its_forward_takes_them():
    from models.hc_layer import mlp_kwargs

    class MLP016(torch.nn.Module):
        def forward(self, hidden_states, padding_mask=None):
            return hidden_states, None

    class MLP019(torch.nn.Module):
        def forward(self, hidden_states, padding_mask=None, packed_seq_params=None):
            return hidden_states, None

    packed, mask = object(), torch.zeros(1, 2, dtype=torch.bool)
    assert mlp_kwargs(MLP016(), mask, packed) == {"padding_mask": mask}
    kw = mlp_kwargs(MLP019(), mask, packed)
    assert kw == {"padding_mask": mask, "packed_seq_params": packed}
    MLP019()(torch.zeros(1), **kw)  # a call with them works
    MLP016()(torch.zeros(1), **mlp_kwargs(MLP016(), mask, packed))
    assert mlp_kwargs(MLP019(), None, None) == {"padding_mask": None}


# ------------------------------------------------------------------------------------------------
# MegatronStepRunner.wrap itself (device moves stubbed out)
# ------------------------------------------------------------------------------------------------
@cpu_only
@pytest.mark.parametrize("n_chunks,overlap,opt_name,aligned", [
    (1, True, "adamw", False),   # one chunk: the DDP pre-hooks prefetch the next bucket
    (2, True, "adamw", True),    # virtual stages: the interleaved schedule dispatches via param_sync_func
    (2, True, "muon", False),    # Muon: no distributed optimizer, so no overlapped gather at all
    (2, False, "adamw", False),
])
def test_wrap_gpu(parallel, monkeypatch, n_chunks, overlap, opt_name, aligned):  # noqa: F811
    """The GPU wrap on CPU (``.cuda()`` stubbed): bf16 backbone, HC parameters fp32 at their
    initial values, Megatron DDP with ``align_param_gather`` exactly when ``param_sync_func``
    will drive the gather (overlapped gather with virtual pipeline stages)."""
    from training.config import ParallelConfig

    chunks = [fp32_model("tiny-moe:xhc") for _ in range(n_chunks)]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # where Megatron DDP puts its buffers
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, device=None: self)
    init = [{n: p.detach().clone() for n, p in c.named_parameters() if getattr(p, "is_hyper_connection", False)}
            for c in chunks]
    config = chunks[0].config
    config.bf16, config.params_dtype = True, torch.bfloat16
    runner = MegatronStepRunner(types.SimpleNamespace(
        optimizer=OptimizerConfig(name=opt_name), run=types.SimpleNamespace(precision="auto"),
        parallel=ParallelConfig(overlap_grad_reduce=overlap, overlap_param_gather=overlap)), dp=1)
    runner.tf_config = config
    wrapped = runner.wrap(chunks, True)
    assert len(wrapped) == n_chunks
    for w, hc in zip(wrapped, init):
        assert w.ddp_config.align_param_gather is aligned
        assert w.ddp_config.use_distributed_optimizer is (opt_name == "adamw")
        assert w.ddp_config.overlap_param_gather is (overlap and opt_name == "adamw")
        for n, p in gpt(w).named_parameters():
            if n in hc:
                assert p.dtype == torch.float32 and torch.equal(p, hc[n]), n
            else:
                assert p.dtype == torch.bfloat16, n
