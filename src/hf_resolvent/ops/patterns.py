""":mod:`hf_resolvent.patterns` under the name the ops modules import it by (``from .patterns import ...``).

Why: a saved model folder ships the ops modules unchanged as flat files beside ``patterns.py``, where that
import finds the real module; in the installed package it finds this alias, which is the same module object.
"""

import sys

from .. import patterns

sys.modules[__name__] = patterns
