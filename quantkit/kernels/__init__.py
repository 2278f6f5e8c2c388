"""numba kernels of the block formats."""
# numba's cache of these kernels is keyed on all of quantkit's sources: before any cache=True
from .. import kernel_cache  # noqa: F401
