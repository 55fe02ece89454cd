"""flotilla.scripts."""
