"""Kernels used by the runtime; each ships with a plain torch reference.

Imported as `spd_engine.kernels`. Imported as a top-level `kernels`, this folder would stand in
for the PyPI package of that name (which transformers imports): that happens only when the
repository root is on sys.path (`python -m ...` run from the root), which nothing documented does.
"""
if __name__ == "kernels":
    raise ImportError("the repository root is on sys.path, so its kernels/ folder shadows the PyPI package "
                      "'kernels': run `spd ...` or `pytest`, not `python -m ...`, from the repository root")
