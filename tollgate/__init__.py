"""tollgate package."""
