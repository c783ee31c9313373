"""Hand-written Triton kernels, one op per file, each beside its plain-PyTorch reference: ``<op>_triton``, ``<op>_ref``
and ``<op>`` (dispatching through :mod:`nanospec.kernels.backend`), with the same signature."""
