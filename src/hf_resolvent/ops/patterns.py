""":mod:`hf_resolvent.patterns` under the name the ops modules import it by (``from .patterns import ...``): the same
module object, so that the ops modules import it as they do in a saved folder, where they lie beside ``patterns.py``
(:mod:`hf_resolvent.remote_code`).
"""

import sys

from .. import patterns

sys.modules[__name__] = patterns
