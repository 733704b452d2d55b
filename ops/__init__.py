"""Kernels used by the runtime; each ships with a plain torch reference."""
