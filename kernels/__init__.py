"""Triton kernels of the resolvent mixer (installed as ``hf_resolvent.kernels``). See kernels/README.md."""
