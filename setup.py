"""Installs llmtrain (the training library) and kernels (Triton kernels with PyTorch fallbacks)."""

from setuptools import find_packages, setup

setup(
    name="llmtrain",
    version="0.1.0",
    description="Megatron-style LLM pretraining: TP/PP/DP, Triton kernels, an auto-config planner.",
    python_requires=">=3.10",
    packages=find_packages(include=["llmtrain", "llmtrain.*", "kernels", "kernels.*"]),
    # The planner's cluster presets and the published table its validation reads: data files, not modules.
    package_data={"llmtrain.planner": ["clusters/*.yaml", "data/*.csv"]},
    # torch is declared with a floor only: GPU users bring their own build; CPU machines pin the CPU wheel.
    install_requires=[
        "torch>=2.4",
        "triton>=3.0; platform_system == 'Linux'",
        "sentencepiece>=0.2",
        "tokenizers>=0.19",
        "filelock>=3.12",
        "datasets>=2.19",
        "safetensors>=0.4",
        "pyyaml>=6.0",
        "numpy>=1.24",
        "tensorboard>=2.15",
        "tqdm>=4.66",
        "matplotlib>=3.7",
    ],
    extras_require={
        # train.precision=fp8: torchao's float8 training (its float8 GEMMs also run, slowly, on CPU).
        "fp8": ["torchao>=0.18"],
        # parallel.engine=deepspeed (ZeRO-2/3 with CPU offload); its C++ ops compile on first use.
        "deepspeed": ["deepspeed>=0.19"],
        # logging.wandb.project: metrics and config to Weights & Biases.
        "wandb": ["wandb>=0.19"],
        "test": [
            "pytest>=8.0",
            "pytest-timeout>=2.3",
            # The README's test command runs two workers, a test file each (module-scoped process groups
            # stay in one worker); multi-process tests already fill the cores, the rest overlap with them.
            "pytest-xdist>=3.5",
            "hypothesis>=6.100",
            "transformers>=4.54",
            "megatron-core>=0.16",
            "psutil>=5.9",
            "ruff>=0.5",
            "torchao>=0.18",  # tests/training/test_fp8.py
            # tests/parallel/test_deepspeed.py; CPU Adam compiles once (~3 CPU minutes) into
            # ~/.cache/torch_extensions and later runs reuse it.
            "deepspeed>=0.19",
            "wandb>=0.19",  # tests/observability/test_wandb.py, offline
        ],
    },
)
