"""radbo: resource-aware federated bilevel optimization on heterogeneous edge devices.

The public names are declared once, in ``radbo/__init__.pyi``, and imported on first use
(PEP 562, through ``lazy_loader``), so ``import radbo`` -- and importing a light submodule such
as :mod:`radbo.flower.worker` -- does not import torch; ``radbo.run``, ``from radbo import
RABO`` and the like work as if imported eagerly.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
