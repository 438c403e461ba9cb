"""Pipeline-parallel p2p tensor shapes for hyper-connected models (docs/math.md §1.2, §1.7).

Megatron sizes the activations exchanged between pipeline stages as ``[s, b, hidden_size]``
(``schedules.get_tensor_shapes`` for the 1F1B schedule, an inline ``[seq, mbs, hidden_size]`` in
the interleaved schedule; 0.16.1–0.19.0).  With N residual streams the state crossing a stage
boundary is ``[s, b, N·C]`` (stream-major, docs/math.md §1.2).  In this design the first stage expands
inside its first layer and the last stage reduces inside its last layer, so **every p2p edge —
forward activations and backward grads alike — carries ``[s, b, N·C]``**: the first stage's
input is the embedding and the last stage's output goes to the final norm and loss, and neither
crosses p2p.  ``s`` is the local sequence: ``seq / CP``, and ``/ TP`` with sequence parallelism.

How to make Megatron's schedules use N·C:

- 1F1B (non-interleaved) schedule: :func:`hc_p2p_shapes` (context manager) or
  :func:`install_hc_p2p_shapes` wraps ``schedules.get_tensor_shapes`` so every returned shape has
  its last dim multiplied by N.  It delegates to the original, so Megatron's SP/CP division and
  0.19's dynamic-shape mode (``[()]`` when ``variable_seq_lengths``) are kept.  Equivalent, per
  call: pass ``adjust_tensor_shapes_fn=hc_adjust_tensor_shapes_fn(N)`` to the schedule.
- Interleaved (virtual pipeline) schedule: it computes the shape inline, so nothing can be
  wrapped; set ``config.variable_seq_lengths = True`` (p2p then exchanges shapes before each
  transfer, one small extra message).  :func:`hc_p2p_shapes` refuses an interleaved config
  without it.

Megatron's schedules need CUDA (each allocates a ``device="cuda"`` token counter), so for CPU
tests :func:`gpipe_forward_backward` drives a pipeline by hand with Megatron's own
``P2PCommunicator`` (gloo) and the same ``schedules.get_tensor_shapes`` lookup, so the N·C
patch is exercised end to end.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

__all__ = [
    "check_pipeline_config",
    "gpipe_forward_backward",
    "hc_adjust_tensor_shapes_fn",
    "hc_p2p_shapes",
    "install_hc_p2p_shapes",
    "p2p_num_streams",
    "p2p_shapes_installed",
    "p2p_tensor_shape",
    "scale_tensor_shapes",
    "uninstall_hc_p2p_shapes",
]

Shape = Tuple[int, ...]


def p2p_tensor_shape(
    seq_length: int,
    micro_batch_size: int,
    hidden_size: int,
    num_streams: int = 1,
    *,
    tp_size: int = 1,
    cp_size: int = 1,
    sequence_parallel: bool = False,
) -> Tuple[int, int, int]:
    """Shape ``(s, b, N·C)`` of the tensor on every inter-stage p2p edge.

    ``s = seq_length / cp_size``, further ``/ tp_size`` with sequence parallelism (exact
    division required); ``N·C = num_streams · hidden_size``.  With ``num_streams=1`` this is
    Megatron's own ``get_tensor_shapes`` result.
    """
    for name, v in (("seq_length", seq_length), ("micro_batch_size", micro_batch_size),
                    ("hidden_size", hidden_size), ("num_streams", num_streams),
                    ("tp_size", tp_size), ("cp_size", cp_size)):  # fmt: skip
        if int(v) != v or v < 1:
            raise ValueError(f"p2p_tensor_shape: {name}={v!r} must be a positive integer")
    div = cp_size * (tp_size if sequence_parallel else 1)
    if seq_length % div:
        raise ValueError(
            f"p2p_tensor_shape: seq_length={seq_length} is not divisible by cp_size"
            f"{'·tp_size' if sequence_parallel else ''}={div}; pick a multiple of {div}"
        )
    return (seq_length // div, micro_batch_size, num_streams * hidden_size)


def p2p_num_streams(hc: Any) -> int:
    """The stream count N that sizes the p2p edges of a model with :class:`~xhc.config.HCConfig`
    ``hc``: ``hc.n`` when hyper-connections are enabled, 1 for ``variant='none'`` or ``disabled``
    (stock Megatron shapes).  Pass it to :func:`hc_p2p_shapes`."""
    return int(hc.n) if hc.enabled else 1


def scale_tensor_shapes(shapes: Sequence[Shape], num_streams: int) -> List[Shape]:
    """Multiply the last dim of each shape by ``num_streams``; empty shapes (dynamic) pass."""
    return [tuple(s[:-1]) + (s[-1] * num_streams,) if len(s) else tuple(s) for s in shapes]


def hc_adjust_tensor_shapes_fn(num_streams: int) -> Callable:
    """``adjust_tensor_shapes_fn`` for Megatron's 1F1B schedule: both send and receive N·C."""

    def adjust(recv_shapes: Sequence[Shape], send_shapes: Sequence[Shape]):
        return scale_tensor_shapes(recv_shapes, num_streams), scale_tensor_shapes(send_shapes, num_streams)

    return adjust


def check_pipeline_config(config: Any, num_streams: int) -> None:
    """Raise if Megatron's schedules cannot be made to carry N·C for this config."""
    interleaved = getattr(config, "virtual_pipeline_model_parallel_size", None) not in (None, 1)
    if num_streams > 1 and interleaved and not getattr(config, "variable_seq_lengths", False):
        raise ValueError(
            "pipeline: the interleaved schedule sizes p2p buffers from hidden_size inline; with "
            f"num_streams={num_streams} set config.variable_seq_lengths=True"
        )


_INSTALLED: Optional[Tuple[Any, Callable, int]] = None  # (schedules module, original, N)


def p2p_shapes_installed() -> Optional[int]:
    """N if :func:`install_hc_p2p_shapes` is active, else None."""
    return None if _INSTALLED is None else _INSTALLED[2]


def install_hc_p2p_shapes(num_streams: int, config: Any = None) -> None:
    """Wrap ``megatron.core.pipeline_parallel.schedules.get_tensor_shapes`` for N streams.

    ``num_streams=1`` installs nothing.  ``config``, if given, is checked with
    :func:`check_pipeline_config`.  Installing twice raises; undo with
    :func:`uninstall_hc_p2p_shapes`.
    """
    global _INSTALLED
    if config is not None:
        check_pipeline_config(config, num_streams)
    if num_streams == 1:
        return
    if _INSTALLED is not None:
        raise RuntimeError(f"install_hc_p2p_shapes: already installed for num_streams={_INSTALLED[2]}")
    from megatron.core.pipeline_parallel import schedules

    original = schedules.get_tensor_shapes

    @functools.wraps(original)
    def get_tensor_shapes(*args: Any, **kwargs: Any):
        return scale_tensor_shapes(original(*args, **kwargs), num_streams)

    schedules.get_tensor_shapes = get_tensor_shapes
    _INSTALLED = (schedules, original, num_streams)


def uninstall_hc_p2p_shapes() -> None:
    """Restore Megatron's ``get_tensor_shapes`` (no-op if nothing is installed)."""
    global _INSTALLED
    if _INSTALLED is not None:
        schedules, original, _ = _INSTALLED
        schedules.get_tensor_shapes = original
        _INSTALLED = None


@contextlib.contextmanager
def hc_p2p_shapes(num_streams: int, config: Any = None) -> Iterator[None]:
    """Context manager form of :func:`install_hc_p2p_shapes` / :func:`uninstall_hc_p2p_shapes`."""
    install_hc_p2p_shapes(num_streams, config)
    try:
        yield
    finally:
        if num_streams > 1:
            uninstall_hc_p2p_shapes()


def gpipe_forward_backward(
    model: Any,
    step_fn: Callable[[int, Any], Any],
    num_microbatches: int,
    *,
    seq_length: int,
    micro_batch_size: int,
    config: Any,
    forward_only: bool = False,
) -> List[Any]:
    """All-forward-then-all-backward pipeline step over Megatron's p2p (for CPU tests).

    ``model``: this stage's module (with ``set_input_tensor``, like ``GPTModel``).
    ``step_fn(i, model)`` runs micro-batch ``i`` on this stage after the driver has called
    ``model.set_input_tensor`` with the received activation (``None`` on the first stage) and
    returns the stage output: the tensor to send, or on the last stage a scalar loss.
    Receive buffers are shaped by ``schedules.get_tensor_shapes`` (so :func:`hc_p2p_shapes`
    applies) with dtype ``config.pipeline_dtype``.  The backward pass uses ``loss /
    num_microbatches``; grads accumulate in ``.grad`` (or ``main_grad`` under Megatron DDP).
    Returns the last stage's per-micro-batch losses (detached), ``[]`` on other stages.
    """
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    if config.pipeline_dtype is None:
        raise ValueError("gpipe_forward_backward: set config.pipeline_dtype (e.g. torch.float32)")
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    comm = P2PCommunicator(ps.get_pipeline_model_parallel_group(), config)
    shapes = schedules.get_tensor_shapes(
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        decoder_seq_length=None,
        config=config,
        tp_group=ps.get_tensor_model_parallel_group(),
        cp_group=ps.get_context_parallel_group(),
    )
    inputs, outputs, losses = [], [], []
    for i in range(num_microbatches):
        received = comm.recv_forward(shapes, first)
        inp = received[0] if isinstance(received, list) else received
        model.set_input_tensor(inp)
        out = step_fn(i, model)
        if last:
            losses.append(out.detach())
            out = out / num_microbatches
        else:
            comm.send_forward(out, last)
        inputs.append(inp)
        outputs.append(out)
    if forward_only:
        return losses
    for inp, out in zip(inputs, outputs):
        if last:
            torch.autograd.backward(out)
        else:
            grad = comm.recv_backward(shapes, last)
            torch.autograd.backward(out, grad_tensors=grad[0] if isinstance(grad, list) else grad)
        if not first:
            comm.send_backward(inp.grad, first)
    return losses


class StageGroup:
    """Stand-in for a pipeline process group that only answers ``rank()`` and ``size()``: one process
    builds the module of stage ``rank`` of a ``size``-stage pipeline (Megatron reads the stage from
    ``pg_collection.pp``).  For tests and single-device checks; it communicates nothing."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def pipeline_stage_collection(pp_rank: int, pp_size: int):
    """Megatron's process groups with the pipeline group replaced by a :class:`StageGroup`."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    pg = ProcessGroupCollection.use_mpu_process_groups()
    pg.pp = StageGroup(pp_rank, pp_size)
    return pg
