"""Ray layer: the draft and target sides as actors on separate nodes, joined by a channel.

Layers import downward only: this package uses the core (engine, sides, messages) and is
used by ``specserve.serve``; the core never imports Ray.
"""

from .placement import Placement, PlacementError

__all__ = ["Placement", "PlacementError"]
