"""CLI subcommands, one module per group."""
