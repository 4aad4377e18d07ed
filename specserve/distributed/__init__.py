"""Ray layer: the target and draft sides as actors (or Serve replicas) on the nodes you label.

Layers import downward only: this package uses the core (engine, sides, transport) and is
used by ``specserve.serve``; the core never imports Ray.
"""

from .placement import PlacementError

__all__ = ["PlacementError"]
