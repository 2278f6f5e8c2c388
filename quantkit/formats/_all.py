"""Importing this module registers every format; :func:`quantkit.formats.registered` does it on
first use."""
from . import floats, iq2k, iq2kl, iq4, iq4kss, iqk, kquants, kt, legacy  # noqa: F401  (import registers the formats)
from . import iq2xs  # noqa: F401  (IQ2_XXS, IQ2_XS, IQ2_S)
from . import repacked

repacked.register_available()       # the interleaved types of every plain type above
