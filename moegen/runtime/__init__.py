"""Small, stable helpers that generated packages import: launch, alignment, routing, layer."""
