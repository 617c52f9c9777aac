"""Run radbo's algorithms on Flower (optional extra ``radbo[flower]``).

Its modules need ``flwr``; ``import radbo`` does not. Its names are declared once, in
``__init__.pyi``, and imported on first use (PEP 562, through ``lazy_loader``), so the
deployment ClientApp (:mod:`radbo.flower.clientapp`) and the per-node worker transport
(:mod:`radbo.flower.worker`) load without torch.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
