"""solar.testing (see docs)."""
