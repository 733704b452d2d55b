"""Command-line tools: one module per `spd` subcommand."""
