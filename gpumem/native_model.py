"""The model of torch's native caching allocator that forecasts compare with.

It lives in gpumem.forecast.native_model, whose docstring states its rules;
this module keeps its public names importable as gpumem.native_model:

    from gpumem.native_model import replay_native, min_capacity_native
"""

from .forecast.native_model import *  # noqa: F401,F403
from .forecast.native_model import UNLIMITED, __all__  # noqa: F401
