"""solar.codec (see docs)."""
