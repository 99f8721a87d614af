"""billing package."""
