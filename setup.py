"""xhc: a pre-training model zoo for hyper-connection MoE transformers on Megatron-Core."""

import sys

from setuptools import find_packages, setup

# megatron-core: 0.16.x is the newest release that installs on Python 3.11; 0.17+ needs
# Python 3.12.  Both are supported (the layer code only uses APIs present in both).
MEGATRON = "megatron-core>=0.16.1" if sys.version_info >= (3, 12) else "megatron-core>=0.16.1,<0.17"

setup(
    name="xhc",
    version="0.1.0",
    description="Hyper-connection (HC, mHC, mHC-lite, KromHC, xHC) MoE transformers on Megatron-Core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["xhc", "xhc.*", "models", "models.*", "training", "training.*", "tools", "tools.*"]),
    package_data={"": ["*.yaml"]},
    install_requires=[
        "torch>=2.6",
        MEGATRON,
        "datasets>=3.0",
        "sentencepiece>=0.2.0",
        "pyyaml>=6.0",
        "numpy>=1.26",
        "tqdm>=4.66",
        "tensorboard>=2.16",
        "scipy>=1.11",
    ],
    extras_require={
        # Transformer Engine needs CUDA.  apex is not on PyPI: see README ("Optional GPU extras").
        "te": ["transformer-engine[pytorch]>=2.0"],
        "hf": ["transformers>=4.56", "safetensors>=0.4", "peft>=0.17"],
        "test": ["pytest>=8.0", "hypothesis>=6.100", "transformers>=4.56", "safetensors>=0.4", "peft>=0.17"],
        "wandb": ["wandb>=0.17"],
        "plot": ["matplotlib>=3.8"],
    },
    entry_points={
        "console_scripts": [
            "xhc-pretrain=training.pretrain:main",
            "xhc-finetune=training.finetune:main",
            "xhc-sweep=tools.sweep:main",
        ]
    },
)
