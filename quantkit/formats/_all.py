"""Importing this module registers every format; :func:`quantkit.formats.registered` does it on
first use."""
from . import floats, iq2k, iq2kl, iq4, iq4kss, iqk, kquants, kt, legacy  # noqa: F401  (import registers the formats)
from . import ternary  # noqa: F401  (iq1_bn, iq2_bn, tq1_0, tq2_0)
from . import iq3xs  # noqa: F401  (iq3_xxs, iq3_s)
from . import mxfp4, q8kv  # noqa: F401  (mxfp4; q8_KV, q8_KV_r8, q8_k_r8)
from . import iq1  # noqa: F401  (iq1_s, iq1_m, iq1_s_r4, iq1_m_r4)
from . import iq2xs  # noqa: F401  (IQ2_XXS, IQ2_XS, IQ2_S)
from . import repacked

repacked.register_available()       # the interleaved types of every plain type above
