from setuptools import find_packages, setup

setup(
    name="megatron_edit",
    version="0.1.0",
    description="EDiT / A-EDiT local SGD for Megatron-LM as runtime patches (arXiv 2412.07210)",
    packages=find_packages(include=["megatron_edit", "megatron_edit.*"]),
    python_requires=">=3.10",
    # torch is not pinned here on purpose: install it first (Python 3.11: the CPU build
    # torch==2.13.0, so pip does not pull a CUDA build; Python 3.12, which megatron-core 0.17+
    # needs: torch>=2.8, see scripts/setup_env.sh). megatron-core's partial distributed optimizer
    # is needed (0.12+); 0.20+ is refused until checked.
    install_requires=["megatron-core>=0.12.0,<0.20", "einops", "numpy", "psutil"],
    # ft: the fault-tolerant exchange across workers (--local-sgd-sync-backend torchft).
    # metrics: the status server's /metrics (python -m megatron_edit.status, supervise --status-port).
    extras_require={"test": ["pytest", "pytest-timeout", "psutil"], "bench": ["matplotlib"],
                    "ft": ["torchft==0.2.0"], "metrics": ["prometheus_client"]},
    package_data={"megatron_edit.status": ["page.html"]},
)
