"""solar.checkpoint (see docs)."""
