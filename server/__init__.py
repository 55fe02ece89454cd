"""flotilla.server."""
