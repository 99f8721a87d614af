"""admin_ui package."""
