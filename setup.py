"""xhc: a pre-training model zoo for hyper-connection MoE transformers on Megatron-Core."""

import sys

from setuptools import find_packages, setup

# megatron-core: the tested range.  0.16.x is the newest release that installs on Python 3.11
# (tested: 0.16.1, the CI's main stage); 0.17+ needs Python 3.12 (tested: the newest 0.19.x in the
# CI's second stage, tools/compat_check.sh; 0.17.1 and 0.18.2 once with the same script).  API
# differences are handled by feature detection.
MEGATRON = "megatron-core>=0.16.1,<0.20" if sys.version_info >= (3, 12) else "megatron-core>=0.16.1,<0.17"

setup(
    name="xhc",
    version="0.1.0",
    description="Hyper-connection (HC, mHC, mHC-lite, KromHC, xHC) MoE transformers on Megatron-Core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["xhc", "xhc.*", "models", "models.*", "training", "training.*", "tools", "tools.*",
                                    "configs"]),
    # The YAML presets and run configs ship inside the wheel (found through importlib.resources).
    package_data={"configs": ["models/*.yaml", "pretrain/*.yaml", "finetune/*.yaml", "sweeps/*.yaml",
                              "lm_eval/*.yaml"],
                  "tools": ["*.sh"]},
    # Minimums: the GPU check image's versions (torch 2.11, triton 3.6, transformers 5.17), the oldest
    # checked (tools/device_env_check.sh, tests/test_triton_aot.py); docs/gpu.md lists what fails there.
    install_requires=[
        "torch>=2.11",
        MEGATRON,
        "datasets>=3.0",
        "sentencepiece>=0.2.0",
        "pyyaml>=6.0",
        "numpy>=1.26",
        "tqdm>=4.66",
        "tensorboard>=2.16",
        # Megatron's dist_checkpointing writer needs psutil but does not declare it: without it the
        # first checkpoint save fails in the writer process and the trainer waits forever.
        "psutil>=5.9",
        "scipy>=1.11",
        # training/data/default.py: one build of the shared default data under concurrency.
        "filelock>=3.12",
    ],
    extras_require={
        # Transformer Engine needs CUDA.  apex is not on PyPI: see README ("Optional GPU extras").
        "te": ["transformer-engine[pytorch]>=2.0"],
        "hf": ["transformers>=5.17", "safetensors>=0.4", "peft>=0.17"],
        # Everything the test suite needs (a superset of hf, eval, plot and kernels: Triton and
        # Liger-Kernel install on CPU-only machines; the tests run Triton under TRITON_INTERPRET=1), so
        # `pip install -e .[test]` then `pytest tests` is green with no skip beyond the allow-list.
        "test": ["pytest>=8.0", "pytest-xdist>=3.5", "hypothesis>=6.100", "transformers>=5.17", "safetensors>=0.4",
                 "peft>=0.17", "lm-eval>=0.4.13", "matplotlib>=3.8", "triton>=3.6", "liger-kernel>=0.8.5"],
        "wandb": ["wandb>=0.17"],
        # tools.evaluate / tests: lm-eval-harness on exported Hugging Face folders (CPU torch stays).
        "eval": ["lm-eval>=0.4.13", "transformers>=5.17", "safetensors>=0.4"],
        "plot": ["matplotlib>=3.8"],
        # Triton kernels for the HC ops (docs/kernels.md); optional: without it the torch paths run.
        # Liger-Kernel: its fused mHC coefficient op, backend `kernels: liger` (xhc/kernels/liger.py).
        "kernels": ["triton>=3.6", "liger-kernel>=0.8.5"],
    },
    entry_points={
        "console_scripts": [
            "xhc-pretrain=training.pretrain:main",
            "xhc-finetune=training.finetune:main",
            "xhc-convert=tools.hf:main",
            "xhc-sweep=tools.sweep:main",
            "xhc-inspect=tools.inspect:main",
            "xhc-plan=tools.plan:main",
        ]
    },
)
