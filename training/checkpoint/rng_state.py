"""The per-rank RNG states a checkpoint carries (python, numpy, torch, CUDA, Megatron's tracker)."""

from __future__ import annotations

import random
from typing import Any, Dict

import numpy as np
import torch

def capture_rng_state() -> Dict[str, Any]:
    """python / numpy / torch (CPU and CUDA) generators and Megatron's RNG-tracker states."""
    from megatron.core import tensor_parallel

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": {k: v.clone() if torch.is_tensor(v) else v
                    for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: Dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
