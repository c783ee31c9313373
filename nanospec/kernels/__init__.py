"""Hand-written Triton kernels, one op per file, each beside its plain-PyTorch reference.

Each module exposes ``<op>`` (dispatching through :mod:`nanospec.kernels.backend`), ``<op>_triton``
and ``<op>_ref`` with the same signature.
"""
