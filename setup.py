"""The optional C extensions; everything else is in pyproject.toml.

(``[[tool.setuptools.ext-modules]]`` in pyproject.toml would do the same, but setuptools prints
at every build that the table is experimental.)
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        # Our fp32 CPU GEMM (framework/csrc/cpu_kernels.c, loaded through ctypes by
        # speculant/models/cpu_kernels.py). Optional: where it does not build, the CPU path
        # uses BLAS.
        Extension("speculant._cpu_kernels", ["framework/csrc/cpu_kernels.c"],
                  extra_compile_args=["-O3"], optional=True),
        # Host staging of CUDA-graph inputs (framework/csrc/staging.c: drafting/draft_graph.py,
        # drafting/head_graph.py, engine/cuda_graph.py). Optional: without it the same inputs
        # are built in Python.
        Extension("speculant._staging", ["framework/csrc/staging.c"],
                  extra_compile_args=["-O2"], optional=True),
    ],
)
