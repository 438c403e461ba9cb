"""Megatron-Core integration and the Hugging Face model code (docs/architecture.md)."""
import logging as _logging


class _NoCudaRuntimeNote(_logging.Filter):
    """torch's CUDA builds (PyPI's torch on Python 3.12, the GPU image's) log ``No CUDA runtime is
    found, using CUDA_HOME=...`` when ``torch.utils.cpp_extension`` is imported on a machine without
    CUDA, which megatron-core does at import.  On a CPU machine that is expected, and the line would
    precede every one-line error of our command-line tools; only that message is dropped."""

    def filter(self, record: _logging.LogRecord) -> bool:
        return not str(record.msg).startswith("No CUDA runtime is found")


_logging.getLogger("torch.utils.cpp_extension").addFilter(_NoCudaRuntimeNote())
